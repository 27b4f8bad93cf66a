// The checkpoint service's messages: a snapshot's manifest (also the file beside its parts on
// disk) and the list of a job's snapshots it answers. The state a snapshot holds travels as
// ShardState (parameter-server.ts). The decoding contract is in common.ts.
import type { Builder } from "flatbuffers";
import { finishBytes, guarded, openRoot, schemaVersion } from "../codec.ts";
import { CheckpointList as CheckpointListT, FileEntry as FileEntryT, Manifest as ManifestT } from "../wire.ts";
import { big, builder, num, readList, root, str } from "./common.ts";

// ---- checkpoint manifest -------------------------------------------------------------------

export interface FileEntry {
  name: string;
  bytes: number;
  crc32: number;
}

export interface Manifest {
  formatVersion: number;
  job: string;
  id: string;
  step: number;
  createdMs: number;
  metric: number;
  configJson: string;
  files: FileEntry[];
  /** per trainer rank: the step its data resumes from */
  cursors: number[];
  /** the model file exported from this snapshot (a job's final one); "" otherwise */
  modelPath: string;
}

const manifestRoot = root("Manifest", "MTCM", (bb) => ManifestT.getRootAsManifest(bb));

function writeManifest(b: Builder, m: Manifest): number {
  const cursors = ManifestT.createCursorsVector(b, m.cursors.map(big));
  const files = ManifestT.createFilesVector(
    b,
    m.files.map((f) => FileEntryT.createFileEntry(b, str(b, f.name), big(f.bytes), f.crc32)),
  );
  const job = str(b, m.job),
    id = str(b, m.id),
    config = str(b, m.configJson),
    modelPath = str(b, m.modelPath);
  return ManifestT.createManifest(
    b,
    schemaVersion,
    m.formatVersion,
    job,
    id,
    big(m.step),
    m.createdMs,
    m.metric,
    config,
    files,
    cursors,
    modelPath,
  );
}

export function encodeManifest(m: Manifest): Uint8Array {
  const b = builder(1024 + (m.configJson.length + m.modelPath.length) * 3);
  return finishBytes(b, writeManifest(b, m), manifestRoot.identifier);
}

function readManifest(r: ManifestT): Manifest {
  return {
    formatVersion: r.formatVersion(),
    job: r.job() ?? "",
    id: r.id() ?? "",
    step: num(r.step()),
    createdMs: r.createdMs(),
    metric: r.metric(),
    configJson: r.configJson() ?? "",
    files: readList(
      r.filesLength(),
      (i) => r.files(i),
      (f) => ({ name: f.name() ?? "", bytes: num(f.bytes()), crc32: f.crc32() }),
      "Manifest.files",
    ),
    cursors: Array.from({ length: r.cursorsLength() }, (_, i) => num(r.cursors(i) ?? 0n)),
    modelPath: r.modelPath() ?? "",
  };
}

export function decodeManifest(data: Uint8Array, bytesMax: number): Manifest {
  const r = openRoot(data, manifestRoot, bytesMax);
  return guarded("Manifest", () => readManifest(r));
}

export interface CheckpointList {
  job: string;
  items: Manifest[];
}

const checkpointListRoot = root("CheckpointList", "MTCL", (bb) => CheckpointListT.getRootAsCheckpointList(bb));

export function encodeCheckpointList(m: CheckpointList): Uint8Array {
  const b = builder(1024);
  const items = CheckpointListT.createItemsVector(
    b,
    m.items.map((x) => writeManifest(b, x)),
  );
  const job = str(b, m.job);
  return finishBytes(
    b,
    CheckpointListT.createCheckpointList(b, schemaVersion, job, items),
    checkpointListRoot.identifier,
  );
}

export function decodeCheckpointList(data: Uint8Array, bytesMax: number): CheckpointList {
  const r = openRoot(data, checkpointListRoot, bytesMax);
  return guarded("CheckpointList", () => ({
    job: r.job() ?? "",
    items: readList(r.itemsLength(), (i) => r.items(i), readManifest, "CheckpointList.items"),
  }));
}
