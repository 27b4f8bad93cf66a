// Reading whole data files with errors that name the file.
import { readFileSync, statSync } from "node:fs";
import { DataFileError } from "./errors.ts";
import { packageRoot } from "../../ffi/package-root.ts";

export function readDataFile(path: string): Uint8Array {
  let size: number;
  try {
    const st = statSync(path);
    if (!st.isFile()) throw new DataFileError(path, "is not a regular file");
    size = st.size;
  } catch (e) {
    if (e instanceof DataFileError) throw e;
    const code = (e as NodeJS.ErrnoException).code;
    throw new DataFileError(path, code === "ENOENT" ? "file not found" : `cannot read (${code ?? String(e)})`, {
      cause: e,
    });
  }
  if (size === 0) throw new DataFileError(path, "file is empty");
  try {
    return new Uint8Array(readFileSync(path));
  } catch (e) {
    throw new DataFileError(path, `cannot read (${(e as NodeJS.ErrnoException).code ?? String(e)})`, { cause: e });
  }
}

/** Resolve a file shipped inside an installed npm package. */
export function packageFile(pkg: string, relative: string): string {
  let root: string;
  try {
    root = Bun.resolveSync(`${pkg}/package.json`, packageRoot).replace(/package\.json$/, "");
  } catch (e) {
    throw new DataFileError(`${pkg}/${relative}`, `npm package ${pkg} is not installed; run: npm ci`, { cause: e });
  }
  return root + relative;
}
