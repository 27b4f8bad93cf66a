// Durable, verified snapshots on a local folder:
//   <root>/<job>/<id>/ holds the snapshot's files and manifest.mtcm (the Manifest message);
//   <id> is step-<9 digits>. Other entries of <root>/<job>/ (the job's exported model.mtm, a
//   logs/ folder the local launcher writes) are not snapshots and are left alone.
// A snapshot is written into <root>/<job>/.tmp-<id>/ (each file written, then fsynced), the
// manifest last, the folder fsynced, then renamed to <id> and the parent fsynced: a crash
// leaves either the whole snapshot or a .tmp- folder that is ignored and removed.
// Reading verifies every file's size and CRC32 against the manifest.
import { m } from "../runtime/mesh/metrics.ts";
import {
  closeSync,
  existsSync,
  fsyncSync,
  mkdirSync,
  openSync,
  readdirSync,
  readFileSync,
  renameSync,
  rmSync,
  writeSync,
} from "node:fs";
import { join } from "node:path";
import { fsyncPath } from "../../engine/durable.ts";
import { decodeManifest, encodeManifest, type Manifest } from "../../schemas/messages/checkpoint.ts";
import { BadRequestError, CorruptDataError, NotReadyError } from "../runtime/mesh/errors.ts";
import { fileBytesMax, formatVersion, manifestBytesMax, snapshotsMax } from "./limits.ts";

export const manifestName = "manifest.mtcm";

/**
 * Writes every file, then fsyncs them all: the kernel writes them back together instead of one
 * after the other, and nothing is acknowledged before all of it is on disk.
 */
function writeAllDurable(files: readonly { path: string; bytes: Uint8Array }[]): void {
  const fds: number[] = [];
  try {
    for (const f of files) {
      const fd = openSync(f.path, "w");
      fds.push(fd);
      let at = 0;
      while (at < f.bytes.byteLength) at += writeSync(fd, f.bytes, at);
    }
    for (const fd of fds) {
      const end = m.checkpointFsync.startTimer();
      fsyncSync(fd);
      end();
    }
  } finally {
    for (const fd of fds) closeSync(fd);
  }
}

export const snapshotId = (step: number) => `step-${String(step).padStart(9, "0")}`;
/** A snapshot's id as `snapshotId` names it (`step-` and at least 9 digits). */
export const isSnapshotId = (name: string) => /^step-\d{9,}$/.test(name);
/** The model file a job's final snapshot is exported to, in the job's folder. */
export const modelFileName = "model.mtm";

export interface SnapshotFile {
  name: string;
  bytes: Uint8Array;
}

/** What a snapshot's manifest says besides its files (and what prepare fills in). */
export type SnapshotMeta = Omit<Manifest, "files" | "formatVersion" | "id" | "createdMs" | "modelPath"> & {
  modelPath?: string;
};

/** Snapshots there are, none of which can resume the job as it is now configured (a resized
 *  job's from before its world changed): NotReady for an operator's restore, but for a process
 *  that opened the job without its state, nothing will restore it. */
export class UnusableSnapshotsError extends NotReadyError {}

export class CheckpointStore {
  constructor(readonly root: string) {
    mkdirSync(root, { recursive: true });
  }

  /** The folder of a job's snapshots (and its exported model). */
  jobDir(job: string): string {
    return join(this.root, job);
  }

  /** Writes a snapshot atomically and returns its manifest. */
  save(m: SnapshotMeta, files: readonly SnapshotFile[]): Manifest {
    const manifest = this.prepare(m, files);
    this.write(manifest, files);
    return manifest;
  }

  /** The manifest a snapshot of `files` will have (sizes and CRC32s), before anything is written. */
  prepare(m: SnapshotMeta, files: readonly SnapshotFile[]): Manifest {
    for (const f of files)
      if (f.name.includes("/") || f.name === manifestName) throw new Error(`bad snapshot file name ${f.name}`);
    return {
      ...m,
      modelPath: m.modelPath ?? "",
      id: snapshotId(m.step),
      formatVersion,
      createdMs: Date.now(),
      files: files.map((f) => ({ name: f.name, bytes: f.bytes.byteLength, crc32: Bun.hash.crc32(f.bytes) })),
    };
  }

  /**
   * Writes a prepared snapshot atomically: into a .tmp- folder (every file fsynced, the manifest
   * last, the folder fsynced), renamed into place, the parent fsynced. A crash at any point
   * leaves the snapshots before it as they were.
   */
  write(manifest: Manifest, files: readonly SnapshotFile[]): void {
    const id = manifest.id;
    const dir = this.jobDir(manifest.job);
    mkdirSync(dir, { recursive: true });
    const tmp = join(dir, `.tmp-${id}-${process.pid}`);
    rmSync(tmp, { recursive: true, force: true });
    mkdirSync(tmp);
    writeAllDurable([
      ...files.map((f) => ({ path: join(tmp, f.name), bytes: f.bytes })),
      { path: join(tmp, manifestName), bytes: encodeManifest(manifest) },
    ]);
    const end = m.checkpointFsync.startTimer();
    fsyncPath(tmp);
    end();
    m.checkpointSnapshots.inc({ job: manifest.job });
    m.checkpointBytes.inc(
      { job: manifest.job },
      files.reduce((n, f) => n + f.bytes.byteLength, 0),
    );
    const final = join(dir, id);
    rmSync(final, { recursive: true, force: true }); // a snapshot of the same step is replaced
    renameSync(tmp, final);
    fsyncPath(dir);
  }

  /** Manifests of the job's snapshots, oldest first. Unreadable manifests are reported, skipped. */
  list(job: string, onBad?: (id: string, why: string) => void): Manifest[] {
    const dir = this.jobDir(job);
    if (!existsSync(dir)) return [];
    const out: Manifest[] = [];
    for (const id of readdirSync(dir).sort()) {
      if (!isSnapshotId(id)) continue; // .tmp- folders of a crashed save, the model file, logs
      try {
        const m = this.#manifest(job, id);
        out.push(m);
      } catch (e) {
        onBad?.(id, (e as Error).message);
      }
    }
    return out.sort((a, b) => a.step - b.step);
  }

  #manifest(job: string, id: string): Manifest {
    const path = join(this.jobDir(job), id, manifestName);
    let bytes: Uint8Array;
    try {
      bytes = readFileSync(path);
    } catch (e) {
      throw new CorruptDataError(`snapshot ${id} of ${job} has no readable manifest (${(e as Error).message})`);
    }
    let m: Manifest;
    try {
      m = decodeManifest(bytes, manifestBytesMax);
    } catch (e) {
      throw new CorruptDataError(`snapshot ${id} of ${job}: manifest does not decode (${(e as Error).message})`);
    }
    if (m.formatVersion !== formatVersion) {
      throw new CorruptDataError(
        `snapshot ${id} of ${job} has checkpoint format ${m.formatVersion}; this build reads ${formatVersion} (restore it with a matching meshtrain)`,
      );
    }
    if (m.id !== id || m.job !== job)
      throw new CorruptDataError(`snapshot folder ${id} of ${job} holds the manifest of ${m.job}/${m.id}`);
    return m;
  }

  /** Reads every file of a snapshot and checks its size and CRC32; throws CorruptDataError naming the file. */
  read(job: string, id: string): { manifest: Manifest; files: Map<string, Uint8Array> } {
    const manifest = this.#manifest(job, id);
    const files = new Map<string, Uint8Array>();
    for (const f of manifest.files) {
      if (f.bytes > fileBytesMax)
        throw new CorruptDataError(`snapshot ${id}: ${f.name} claims ${f.bytes} bytes, over the ${fileBytesMax} limit`);
      let bytes: Uint8Array;
      try {
        bytes = readFileSync(join(this.jobDir(job), id, f.name));
      } catch (e) {
        throw new CorruptDataError(`snapshot ${id}: ${f.name} is missing (${(e as Error).message})`);
      }
      if (bytes.byteLength !== f.bytes)
        throw new CorruptDataError(
          `snapshot ${id}: ${f.name} has ${bytes.byteLength} bytes, the manifest says ${f.bytes}`,
        );
      const crc = Bun.hash.crc32(bytes);
      if (crc !== f.crc32)
        throw new CorruptDataError(
          `snapshot ${id}: ${f.name} fails its checksum (crc32 ${crc.toString(16)}, manifest ${f.crc32.toString(16)})`,
        );
      files.set(f.name, bytes);
    }
    return { manifest, files };
  }

  /**
   * The newest snapshot (or the one named) whose files all verify. Each corrupt one is reported
   * through onCorrupt and the next older one is tried.
   */
  latestGood(
    job: string,
    id: string,
    onCorrupt: (id: string, why: string) => void,
    /** why a snapshot cannot be restored now (null: it can); such ones are passed over */
    unusable: (m: Manifest) => string | null = () => null,
  ): { manifest: Manifest; files: Map<string, Uint8Array> } {
    const all = this.list(job, onCorrupt);
    const candidates = (id ? all.filter((m) => m.id === id) : all).reverse();
    // an id it does not have will not come by waiting (a later one gets a later id): not "retry"
    if (candidates.length === 0 && id)
      throw new BadRequestError(
        `job ${job} has no snapshot ${id}; it has ${all.length === 0 ? "none" : all.map((m) => m.id).join(", ")}`,
      );
    if (candidates.length === 0) throw new NotReadyError(`job ${job} has no snapshot yet`);
    const passed: string[] = [];
    for (const m of candidates) {
      const why = unusable(m);
      if (why !== null) {
        passed.push(`${m.id}: ${why}`);
        continue;
      }
      try {
        return this.read(job, m.id);
      } catch (e) {
        if (!(e instanceof CorruptDataError)) throw e;
        onCorrupt(m.id, e.message);
      }
    }
    if (passed.length === candidates.length)
      throw new UnusableSnapshotsError(
        `no snapshot of job ${job} can resume it now (${passed.slice(0, 3).join("; ")})`,
      );
    throw new CorruptDataError(
      `every snapshot of job ${job} failed verification${passed.length > 0 ? ` or cannot resume it now (${passed.slice(0, 3).join("; ")})` : ""}`,
    );
  }

  /** Keeps the last `keepLast` snapshots and the one with the best metric; removes the rest. */
  retain(job: string, keepLast: number): string[] {
    const all = this.list(job);
    const keep = new Set(all.slice(-Math.min(keepLast, snapshotsMax)).map((m) => m.id));
    const scored = all.filter((m) => Number.isFinite(m.metric));
    if (scored.length > 0) keep.add(scored.reduce((a, b) => (b.metric > a.metric ? b : a)).id);
    const removed: string[] = [];
    for (const m of all) {
      if (keep.has(m.id)) continue;
      rmSync(join(this.jobDir(job), m.id), { recursive: true, force: true });
      removed.push(m.id);
    }
    if (removed.length > 0) fsyncPath(this.jobDir(job));
    return removed;
  }

  /** Removes .tmp- folders left by a crash mid-save. */
  sweep(job: string): void {
    const dir = this.jobDir(job);
    if (!existsSync(dir)) return;
    for (const name of readdirSync(dir))
      if (name.startsWith(".tmp-")) rmSync(join(dir, name), { recursive: true, force: true });
  }
}
