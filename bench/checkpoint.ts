// Checkpoint benchmark: a snapshot of two shard files saved through the checkpoint store
// (CRC32 per file, manifest, fsync of every file and folder, atomic rename) and read back with
// verification, against a plain sequential write + fsync of the same bytes in the same run,
// interleaved. Ratios = store MB/s / plain write MB/s (the baseline for both); target
// 0.7. A plain read of the same bytes is shown too: restore reads them and checks CRC32s.
//
//   bun run bench checkpoint [--sizes-mb 16,64,256] [--reps 6] [--dir /tmp] [--json-only]
import { closeSync, fsyncSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, writeSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { CheckpointStore } from "../services/checkpoint/store.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, printReport, round } from "./table.ts";

export interface CheckpointBenchResult {
  snapshot_mb: number;
  plain_write_mb_per_s: number;
  save_mb_per_s: number;
  save_ratio: number;
  restore_mb_per_s: number;
  restore_ratio: number;
  target: number;
  plain_read_mb_per_s: number;
}

const checkpointColumns: readonly (keyof CheckpointBenchResult)[] = [
  "snapshot_mb",
  "plain_write_mb_per_s",
  "save_mb_per_s",
  "save_ratio",
  "restore_mb_per_s",
  "restore_ratio",
  "target",
  "plain_read_mb_per_s",
];

function plainWrite(dir: string, files: { name: string; bytes: Uint8Array }[]): void {
  mkdirSync(dir, { recursive: true });
  for (const f of files) {
    const fd = openSync(join(dir, f.name), "w");
    let at = 0;
    while (at < f.bytes.byteLength) at += writeSync(fd, f.bytes, at);
    fsyncSync(fd);
    closeSync(fd);
  }
}

const timed = (fn: () => void) => {
  const t0 = performance.now();
  fn();
  return performance.now() - t0;
};

export function runCheckpointBench(argv: string[]): CheckpointBenchResult[] {
  const v = parseBenchArgs(argv, {
    "sizes-mb": { type: "string", default: "16,64,256" },
    reps: { type: "string", default: "6" },
    dir: { type: "string", default: tmpdir() },
    "json-only": { type: "boolean", default: false },
  });
  const sizes = String(v["sizes-mb"])
    .split(",")
    .map((x) => positiveInt("sizes-mb", x));
  const reps = positiveInt("reps", v.reps);
  const root = mkdtempSync(join(String(v.dir), "mt-bench-ckpt-"));
  const rows: CheckpointBenchResult[] = [];
  try {
    for (const mb of sizes) {
      const half = (mb << 20) / 2;
      const files = ["ps-0.mtss", "ps-1.mtss"].map((name) => ({
        name,
        bytes: new Uint8Array(half).map((_, i) => (i * 2654435761) >>> 24),
      }));
      const store = new CheckpointStore(join(root, "store"));
      const save: number[] = [],
        plain: number[] = [],
        restore: number[] = [],
        read: number[] = [];
      for (let r = 0; r < reps; r++) {
        const step = mb * 1000 + r;
        // alternate which goes first: the second writer pays for the first one's writeback
        const writePlain = () => plain.push(timed(() => plainWrite(join(root, "plain", String(r)), files)));
        const writeStore = () =>
          save.push(
            timed(() =>
              store.save({ job: "bench", step, metric: Number.NaN, configJson: "{}", cursors: [step] }, files),
            ),
          );
        if (r % 2 === 0) {
          writePlain();
          writeStore();
        } else {
          writeStore();
          writePlain();
        }
        read.push(timed(() => files.forEach((f) => readFileSync(join(root, "plain", String(r), f.name)))));
        restore.push(timed(() => store.read("bench", `step-${String(step).padStart(9, "0")}`)));
        rmSync(join(root, "plain", String(r)), { recursive: true, force: true });
      }
      rmSync(join(root, "store"), { recursive: true, force: true });
      const rate = (ms: number[]) => mb / (median(ms) / 1000);
      rows.push({
        snapshot_mb: mb,
        plain_write_mb_per_s: round(rate(plain), 1),
        save_mb_per_s: round(rate(save), 1),
        save_ratio: round(rate(save) / rate(plain), 3),
        restore_mb_per_s: round(rate(restore), 1),
        restore_ratio: round(rate(restore) / rate(plain), 3),
        target: 0.7,
        plain_read_mb_per_s: round(rate(read), 1),
      });
    }
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
  printReport({
    bench: "checkpoint",
    header:
      `checkpoint benchmark: 2 files per snapshot in ${String(v.dir)}; median of ${reps}; save = CRC32 + write + fsync + manifest + rename + folder fsync, ` +
      "restore = read + size and CRC32 checks; ratios against the plain write + fsync of the same bytes; plain read for reference (page cache)",
    rows,
    columns: checkpointColumns,
    quiet: v["json-only"],
  });
  return rows;
}
