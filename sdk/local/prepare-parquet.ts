// `meshtrain prepare --parquet <column>`: a Parquet file (FineWeb's and most of the Hugging Face
// hub's format), read with hyparquet and its decompressors (snappy, gzip, zstd, brotli, lz4) a
// row group at a time, from the file's bytes as they are needed: memory holds one row group's
// column whatever the file's size. Its strings are decoded by hyparquet (bytes that are not UTF-8
// become U+FFFD: --invalid-utf8 reads text and JSON Lines).
import { asyncBufferFromFile, type FileMetaData, parquetMetadataAsync, parquetRead } from "hyparquet";
import { compressors } from "hyparquet-compressors";
import { DataFileError } from "../../engine/data/errors.ts";
import { shownPath } from "../user-paths.ts";
import type { Document } from "./prepare-sources.ts";

async function metadataOf(
  path: string,
): Promise<{ file: Awaited<ReturnType<typeof asyncBufferFromFile>>; metadata: FileMetaData }> {
  try {
    const file = await asyncBufferFromFile(path);
    return { file, metadata: await parquetMetadataAsync(file) };
  } catch (e) {
    throw new DataFileError(path, `is not a Parquet file: ${(e as Error).message}`, { cause: e });
  }
}

/** A Parquet file's documents: each row's `column`, a string. */
export async function* parquetDocuments(path: string, column: string): AsyncGenerator<Document> {
  const { file, metadata } = await metadataOf(path);
  // the top-level columns: the root's children (a column nested in a group is not a document)
  const names = metadata.schema
    .slice(1)
    .filter((s) => s.num_children === undefined)
    .map((s) => s.name);
  if (!names.includes(column))
    throw new DataFileError(path, `has no column ${JSON.stringify(column)}; its columns: ${names.join(", ")}`);
  let rowStart = 0;
  for (const group of metadata.row_groups) {
    const rowEnd = rowStart + Number(group.num_rows);
    let rows: unknown[][] = [];
    await parquetRead({
      file,
      metadata,
      columns: [column],
      rowStart,
      rowEnd,
      compressors,
      rowFormat: "array",
      onComplete: (r: unknown[][]) => {
        rows = r;
      },
    });
    for (let i = 0; i < rows.length; i++) {
      const text = rows[i]![0];
      if (typeof text !== "string")
        throw new DataFileError(
          path,
          `row ${rowStart + i}: column ${JSON.stringify(column)} is ${text === null ? "null" : typeof text}, not a string`,
        );
      yield { text, where: `${shownPath(path)}: row ${rowStart + i}` };
    }
    rowStart = rowEnd;
  }
}
