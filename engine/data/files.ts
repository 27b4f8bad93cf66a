// Reading whole data files with errors that name the file.
import { readFileSync, readSync, statSync } from "node:fs";
import { DataFileError } from "./errors.ts";
import { packageRoot } from "../../ffi/package-root.ts";

/** Why a file could not be read, in the user's words (the system call's error code), for a DataFileError. */
export function readFailure(e: unknown): string {
  const code = (e as NodeJS.ErrnoException).code;
  if (code === "ENOENT") return "file not found";
  if (code === "EISDIR") return "is a folder, not a file";
  return `cannot be read: ${pathProblem(e) ?? (e as Error).message}`;
}

/** What a system call's error code says of a path, in the user's words; undefined for one it
 *  does not know (a path read here, or written: sdk/user-paths.ts). */
export function pathProblem(e: unknown): string | undefined {
  const code = (e as NodeJS.ErrnoException).code;
  return code === undefined ? undefined : pathProblems[code];
}

const pathProblems: Record<string, string> = {
  ENOTDIR: "a part of its path is a file, not a folder",
  EEXIST: "a part of its path is a file, not a folder",
  EISDIR: "it is a folder",
  EACCES: "permission denied",
  EPERM: "not permitted",
  EROFS: "a read-only file system",
  ENOSPC: "no space left on the device",
  EBUSY: "it is in use (a mount point?)",
};

/** A JSON file's value: a file that cannot be read says why (readFailure), text that is not JSON says so. */
export function readJsonFile(path: string): unknown {
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch (e) {
    throw new DataFileError(path, readFailure(e), { cause: e });
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new DataFileError(path, `is not JSON: ${(e as Error).message}`, { cause: e });
  }
}

export function readDataFile(path: string): Uint8Array {
  let size: number;
  try {
    const st = statSync(path);
    if (!st.isFile()) throw new DataFileError(path, "is not a regular file");
    size = st.size;
  } catch (e) {
    if (e instanceof DataFileError) throw e;
    throw new DataFileError(path, readFailure(e), { cause: e });
  }
  if (size === 0) throw new DataFileError(path, "file is empty");
  try {
    const buf = readFileSync(path);
    // a plain Uint8Array over the Buffer's own memory: a copy of MNIST's 47 MB costs more than its
    // read (page faults: about 0.2 s each on 2-core VMs), in every process that loads a data set.
    // A Buffer that shares a pool with others (a small file's, in some runtimes) is copied.
    return buf.byteOffset === 0 && buf.byteLength === buf.buffer.byteLength
      ? new Uint8Array(buf.buffer, 0, buf.byteLength)
      : new Uint8Array(buf);
  } catch (e) {
    throw new DataFileError(path, readFailure(e), { cause: e });
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

/** The crc32 of a file's first `length` bytes, read a piece at a time. */
export function fileCrc32(fd: number, length: number): number {
  const piece = new Uint8Array(Math.min(length, 8 << 20));
  let crc = 0;
  for (let at = 0; at < length; ) {
    const n = readSync(fd, piece, 0, Math.min(piece.length, length - at), at);
    if (n <= 0)
      throw new DataFileError(`file descriptor ${fd}`, `ended at byte ${at} of ${length} while its crc32 was read`);
    crc = Bun.hash.crc32(piece.subarray(0, n), crc);
    at += n;
  }
  return crc;
}
