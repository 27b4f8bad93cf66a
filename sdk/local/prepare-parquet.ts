// `meshtrain prepare --parquet <column>`: a Parquet file (FineWeb's and most of the Hugging Face
// hub's format), read with hyparquet and its decompressors (snappy, gzip, zstd, brotli, lz4) a
// row group at a time, from the file's bytes as they are needed: memory holds one row group's
// column whatever the file's size. The column's bytes are checked as UTF-8 as every input's are
// (--invalid-utf8), a row's where being its row number.
import { asyncBufferFromFile, type FileMetaData, parquetMetadataAsync, parquetRead } from "hyparquet";
import { compressors } from "hyparquet-compressors";
import { DataFileError } from "../../engine/data/errors.ts";
import { shownPath } from "../user-paths.ts";
import type { Document } from "./prepare-sources.ts";
import { decodeUtf8, type InvalidUtf8 } from "./prepare-utf8.ts";

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
export async function* parquetDocuments(
  path: string,
  column: string,
  invalidUtf8: InvalidUtf8,
  notes: string[],
): AsyncGenerator<Document> {
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
      // the bytes, so that they are checked as UTF-8 here (hyparquet would replace what is not)
      utf8: false,
      rowFormat: "array",
      onComplete: (r: unknown[][]) => {
        rows = r;
      },
    });
    for (let i = 0; i < rows.length; i++) {
      const value = rows[i]![0];
      const row = rowStart + i;
      if (!(value instanceof Uint8Array) && typeof value !== "string")
        throw new DataFileError(
          path,
          `row ${row}: column ${JSON.stringify(column)} is ${value === null ? "null" : typeof value}, not a string`,
        );
      const text =
        typeof value === "string"
          ? value
          : decodeUtf8(value, { path, line: row, offset: 0, row: true }, invalidUtf8, notes);
      yield { text, where: `${shownPath(path)}: row ${row}` };
    }
    rowStart = rowEnd;
  }
}
