// Files written so that a crash leaves the old file or the new one, never a part of one: a temp
// file beside the target, fsynced, renamed over it, and the folder fsynced (the rename itself
// made durable). A write that fails removes its temp file.
import { closeSync, fsyncSync, openSync, renameSync, rmSync, writeSync } from "node:fs";
import { dirname } from "node:path";

/** fsync a file or folder by path (a folder: makes a rename or a new entry in it durable). */
export function fsyncPath(path: string): void {
  const fd = openSync(path, "r");
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

/** Writes `parts`, one after another, as the file at `path`, durably. */
export function writeDurably(path: string, parts: readonly Uint8Array[]): void {
  const tmp = `${path}.tmp-${process.pid}`;
  try {
    const fd = openSync(tmp, "w");
    try {
      for (const p of parts) for (let at = 0; at < p.length; ) at += writeSync(fd, p, at, p.length - at);
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
    renameSync(tmp, path);
  } catch (e) {
    rmSync(tmp, { force: true });
    throw e;
  }
  fsyncPath(dirname(path));
}
