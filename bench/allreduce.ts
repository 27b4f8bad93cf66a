// All-reduce benchmark: the ring over NATS among N rank processes (bench/collective-rank.ts) on
// a real nats-server, as bus bandwidth (nccl-tests' busbw = algbw · 2(N-1)/N, where algbw =
// buffer bytes / time), against raw NATS moving the same bytes point-to-point in the same run:
// every rank sends the 2(N-1)/N of the buffer a ring puts on its link to the next rank, as
// requests of the same piece size with the same window, and nothing else (no encoding, no
// sums, no hops to wait for). Ratio = ring busbw / raw busbw; target 0.8.
//
// Transports (--transport): "nats", every byte through NATS; "shm", the values through shared
// memory between the rank processes and only the pieces' headers through NATS (what a job's
// ranks on one machine use, --coll-transport auto). Raw NATS is the baseline of both.
// "nccl": NCCL's all-reduce of a device buffer among rank processes on GPUs of this machine
// (bench/nccl-rank.ts; rank r on GPU r mod count, so it needs as many GPUs as ranks, or
// scripts/emulated-gpus.sh); its baseline is each GPU copying the bytes a ring puts on a link,
// device to device, in the same run (the ratio says how near the link gets to local memory).
//
//   bun run bench allreduce [--ranks 2,4] [--sizes-mb 1,4,16,64] [--transport nats,shm,nccl] [--rounds 5] [--piece-kb 1024] [--window 4] [--json-only]
//
// Each operation starts after a barrier; its time is the slowest rank's, and a row reports the
// median over rounds.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ConfigError } from "../ffi/errors.ts";
import { collPieceOverheadBytes } from "../schemas/messages/trainer.ts";
import { startNatsServer } from "../services/runtime/mesh/nats-server.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { type RankOp, type RankPlan, type RankResult, runRankProcesses } from "./collective-rank.ts";
import { median, printTable, round } from "./table.ts";
import { probeCuda } from "../ffi/cuda/backend.ts";
import { ncclLibrary } from "../ffi/cuda/nccl.ts";
import { type NcclRankPlan, runNcclRankProcesses } from "./nccl-rank.ts";

export interface AllReduceBenchResult {
  transport: string;
  ranks: number;
  size_mb: number;
  ring_ms: number;
  ring_busbw_gb_per_s: number;
  raw_ms: number;
  raw_busbw_gb_per_s: number;
  ratio: number;
  target: number;
}

const list = (name: string, raw: unknown) =>
  String(raw)
    .split(",")
    .map((x) => positiveInt(name, x));

export async function runAllReduceBench(argv: string[]): Promise<AllReduceBenchResult[]> {
  const v = parseBenchArgs(argv, {
    ranks: { type: "string", default: "2,4" },
    "sizes-mb": { type: "string", default: "1,4,16,64" },
    transport: { type: "string", default: "nats,shm" },
    rounds: { type: "string", default: "5" },
    "piece-kb": { type: "string", default: "1024" },
    window: { type: "string", default: "4" },
    "json-only": { type: "boolean", default: false },
  });
  const rankCounts = list("ranks", v.ranks),
    sizes = list("sizes-mb", v["sizes-mb"]),
    rounds = positiveInt("rounds", v.rounds);
  const pieceBytes = positiveInt("piece-kb", v["piece-kb"]) * 1024,
    windowPieces = positiveInt("window", v.window);
  const transports = String(v.transport).split(",");
  for (const t of transports)
    if (t !== "nats" && t !== "shm" && t !== "nccl")
      throw new ConfigError(`--transport must be a list of nats, shm, nccl; got ${String(v.transport)}`);
  if (rankCounts.some((n) => n < 2 || n > 16))
    throw new ConfigError("--ranks: each from 2 to 16 (one rank moves nothing)");
  if (pieceBytes > 16 << 20) throw new ConfigError("--piece-kb: at most 16384");
  if (Math.max(...sizes) > 1024) throw new ConfigError("--sizes-mb: at most 1024");
  const dir = mkdtempSync(join(tmpdir(), "mt-bench-allreduce-"));
  await using server = await startNatsServer({
    maxPayloadBytes: Math.max(1 << 20, pieceBytes + collPieceOverheadBytes + 4096),
  });
  const rows: AllReduceBenchResult[] = [];
  try {
    for (const transport of transports)
      for (const n of rankCounts) {
        if (transport === "nccl") {
          rows.push(...(await ncclRows(dir, n, sizes, rounds)));
          continue;
        }
        const ops: RankOp[] = [];
        let step = 0;
        for (const mb of sizes) {
          const len = (mb << 20) / 4;
          for (let r = 0; r < rounds; r++) {
            ops.push({ op: "allReduce", len, seed: 1, step: ++step, bucket: 0, check: false });
            ops.push({ op: "raw", len, seed: 1, step: ++step, bucket: 0, check: false });
          }
        }
        const results = await runRanks(dir, server.url, n, ops, pieceBytes, windowPieces, transport === "shm");
        for (const mb of sizes) {
          const len = (mb << 20) / 4;
          const slowest = (kind: string) =>
            ops
              .map((o, i) => ({ o, i }))
              .filter(({ o }) => o.op === kind && o.len === len)
              .map(({ i }) => Math.max(...results.map((rs) => rs[i]!.ms)));
          rows.push(
            benchRow(
              transport,
              n,
              mb,
              median(slowest("allReduce")),
              median(slowest("raw")),
              1,
              transport === "nats" ? 0.8 : 0,
            ),
          );
        }
      }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  if (!v["json-only"]) {
    console.log(
      `all-reduce: ring over NATS, or with its values through shared memory (shm), ${pieceBytes >> 10} KB pieces, ${windowPieces} in flight per link, ` +
        `vs raw NATS moving the same bytes per link; median of ${rounds}`,
    );
    if (transports.includes("nccl"))
      console.log(
        "nccl rows: ring_* is NCCL's all-reduce of a device buffer, raw_* each GPU copying the bytes a ring puts on a link (device to device)",
      );
    printTable(rows, [
      "transport",
      "ranks",
      "size_mb",
      "ring_ms",
      "ring_busbw_gb_per_s",
      "raw_ms",
      "raw_busbw_gb_per_s",
      "ratio",
      "target",
    ]);
  }
  console.log(JSON.stringify({ bench: "allreduce", rows }));
  return rows;
}

/** --transport nccl: one process per rank on its own GPU, an id made here; rows as the ring's. */
async function ncclRows(dir: string, n: number, sizes: number[], rounds: number): Promise<AllReduceBenchResult[]> {
  const probe = probeCuda();
  if (!probe.ok) throw new ConfigError(`--transport nccl needs GPUs: ${probe.reason}`);
  if (probe.deviceCount < n)
    throw new ConfigError(
      `--transport nccl with ${n} ranks needs ${n} GPUs (NCCL refuses two ranks on one GPU); this machine shows ${probe.deviceCount}`,
    );
  const idHex = Buffer.from(ncclLibrary().getUniqueId()).toString("hex");
  const lens = sizes.map((mb) => (mb << 20) / 4);
  const plans = Array.from(
    { length: n },
    (_, rank): NcclRankPlan => ({ job: `bench-nccl-${n}`, rank, ranks: n, idHex, lens, rounds }),
  );
  const run = await runNcclRankProcesses(dir, plans);
  const perRank = run.results.map((lines, rank) => {
    const wrong = lines.find((l) => l.op === "allReduce" && !l.correct);
    if (run.codes[rank] !== 0 || lines.length !== 2 * lens.length * rounds || wrong)
      throw new Error(
        `NCCL rank ${rank} of ${n} failed (exit ${run.codes[rank]}): ${wrong ? `a wrong sum at ${wrong.len} elements` : run.stderr[rank]!.trim().split("\n").slice(-3).join(" | ")}`,
      );
    return lines;
  });
  return sizes.map((mb, k) => {
    const slowest = (op: string) =>
      median(
        Array.from({ length: rounds }, (_, r) => {
          const i = 2 * (k * rounds + r) + (op === "allReduce" ? 0 : 1);
          return Math.max(...perRank.map((lines) => lines[i]!.ms));
        }),
      );
    return benchRow("nccl", n, mb, slowest("allReduce"), slowest("copy"), 2, 0);
  });
}

/** A row: the collective's and the baseline's times (ms, rounded to `digits`) for `mb` MB among
 *  `n` ranks, as bus bandwidth (nccl-tests' busbw: algbw · 2(n-1)/n), and their ratio. */
function benchRow(
  transport: string,
  n: number,
  mb: number,
  ringMs: number,
  rawMs: number,
  digits: number,
  target: number,
): AllReduceBenchResult {
  const bus = (ms: number) => (((mb << 20) / (ms / 1000) / 1e9) * (2 * (n - 1))) / n;
  return {
    transport,
    ranks: n,
    size_mb: mb,
    ring_ms: round(ringMs, digits),
    ring_busbw_gb_per_s: round(bus(ringMs), 3),
    raw_ms: round(rawMs, digits),
    raw_busbw_gb_per_s: round(bus(rawMs), 3),
    ratio: round(rawMs / ringMs, 2),
    target,
  };
}

async function runRanks(
  dir: string,
  url: string,
  n: number,
  ops: RankOp[],
  pieceBytes: number,
  windowPieces: number,
  sharedMemory: boolean,
): Promise<RankResult[][]> {
  const job = `bench-allreduce-${n}-${sharedMemory ? "shm" : "nats"}`;
  const plans = Array.from(
    { length: n },
    (_, rank): RankPlan => ({
      url,
      job,
      rank,
      hosts: Array(n).fill("local"),
      pieceBytes,
      windowPieces,
      progressTimeoutMs: 60_000,
      peerLostMs: 60_000,
      ops,
      sharedMemory,
    }),
  );
  // one thread per rank: the ranks share the cores, as trainers on one machine do
  const run = await runRankProcesses(dir, plans, { OMP_NUM_THREADS: "1" });
  return run.results.map((lines, rank) => {
    const failed = lines.find((l) => l.error);
    if (run.codes[rank] !== 0 || lines.length !== ops.length || failed) {
      throw new Error(
        `rank ${rank} of ${n} failed (exit ${run.codes[rank]}): ${failed?.error?.message ?? run.stderr[rank]!.trim().split("\n").slice(-3).join(" | ")}`,
      );
    }
    return lines;
  });
}
