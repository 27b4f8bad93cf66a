#!/usr/bin/env bun
// One rank of a collective over a real nats-server, as its own process: runs a plan of
// operations and prints one JSON line per operation. `bun run bench allreduce` starts several
// of these; test/services/collective.integration.test.ts does too, to check results against a
// float64 sum and what happens when a rank dies.
//
//   bun bench/collective-rank.ts <plan.json>
//
// The plan names the NATS URL, the job, this rank, the ranks' host labels and the operations.
// Every rank makes every rank's input from (seed, rank), so each can check its result alone.
// "raw" moves the same bytes a ring all-reduce puts on each link (2(N-1)/N of the buffer) to
// the next rank as plain NATS requests of the same size and window: the baseline.
import { type PlanRun, type PlanSpawn, runPlanProcesses } from "./plan-processes.ts";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { HierarchicalCollective } from "../engine/parallel/hierarchical.ts";
import type { Collective, WireCoder } from "../engine/parallel/collective.ts";
import { Codec, ErrorFeedback, parseCompression } from "../engine/parallel/compress.ts";
import { RingCollective } from "../engine/parallel/ring.ts";
import type { PeerTransport } from "../engine/parallel/transport.ts";
import { Rng } from "../engine/rng.ts";
import { BusTransport, busTransportDefaults } from "../services/runtime/transport/collective-bus.ts";
import { NatsBus } from "../services/runtime/mesh/nats.ts";

export interface RankOp {
  op: "allReduce" | "reduceScatter" | "allGather" | "broadcast" | "barrier" | "raw";
  /** elements (raw: elements whose ring share is sent) */
  len: number;
  seed: number;
  step: number;
  bucket: number;
  root?: number;
  /** check the result against float64 (off for large benchmark buffers) */
  check: boolean;
  /** allReduce: encoded round the ring (the collective's encodedAllReduce, with error feedback) */
  compress?: "bf16" | "fp16" | "int8";
}

export interface RankPlan {
  url: string;
  job: string;
  rank: number;
  /** host label per rank; all the same: the flat ring */
  hosts: string[];
  pieceBytes: number;
  windowPieces: number;
  progressTimeoutMs: number;
  peerLostMs: number;
  ops: RankOp[];
  /** die (SIGKILL itself) once this many pieces have arrived: a crash mid-operation */
  dieAfterPieces?: number;
  /** values through shared memory between these processes (one machine) */
  sharedMemory?: boolean;
  /** this rank's address for pieces over TCP from other machines (the collective's direct links) */
  netAddress?: string;
}

export interface RankResult {
  op: string;
  len: number;
  step: number;
  bucket: number;
  ms: number;
  /** base64 of the result's bytes' 64-bit hash (the part every rank must agree on) */
  hash: string;
  /** largest |result - float64| / rounding bound over checked elements; <= 1 passes */
  errorRatio: number;
  /** peers this rank sent to through shared memory by the operation's end */
  shmPeers: number;
  /** peers this rank sends to over a direct TCP link by the operation's end */
  netPeers: number;
  /** bytes of pieces this rank sent in the operation */
  wireBytes: number;
  /** ... of them, those in the message (through NATS, not shared memory: to other hosts) */
  inlineBytes: number;
  /** ms this rank spent encoding and decoding (an encoded all-reduce) */
  codecMs: number;
  error?: { name: string; message: string };
}

/** Rank r's input of an operation. */
export function rankInput(seed: number, rank: number, len: number): Float32Array {
  const rng = new Rng(seed * 1009 + rank);
  const x = new Float32Array(len);
  for (let i = 0; i < len; i++) x[i] = rng.normal() * 3;
  return x;
}

function errorRatio(got: Float32Array, inputs: Float32Array[], from: number, to: number): number {
  let worst = 0;
  for (let i = from; i < to; i++) {
    let sum = 0,
      abs = 0;
    for (const x of inputs) {
      sum += x[i]!;
      abs += Math.abs(x[i]!);
    }
    const bound = abs * 2 ** -23 * inputs.length + 1e-30;
    worst = Math.max(worst, Math.abs(got[i]! - sum) / bound);
  }
  return worst;
}

const hashOf = (x: Float32Array, from = 0, to = x.length) =>
  Bun.hash.xxHash64(new Uint8Array(x.buffer, x.byteOffset + from * 4, (to - from) * 4)).toString(16);

async function main(): Promise<void> {
  const plan = (await Bun.file(process.argv[2]!).json()) as RankPlan;
  const size = plan.hosts.length;
  const meter = { bytes: 0, inlineBytes: 0 };
  const bus = await NatsBus.connect({
    url: plan.url,
    name: `coll-rank-${plan.rank}`,
    connectRetryMsMax: 10_000,
    connectBackoffMsMax: 500,
  });
  const transport = new BusTransport(bus, {
    job: plan.job,
    rank: plan.rank,
    size,
    generation: 1,
    pieceBytesMax: plan.pieceBytes,
    windowPieces: plan.windowPieces,
    sendTimeoutMs: busTransportDefaults.sendTimeoutMs,
    peerLostMs: plan.peerLostMs,
    sharedMemory: plan.sharedMemory ?? false,
    netAddress: plan.netAddress ?? null,
    meter,
  });
  let arrived = 0;
  const dieAfter = plan.dieAfterPieces ?? Infinity;
  // the transport, with a receiver that counts pieces and crashes the process when told to
  const counting: PeerTransport = {
    rank: transport.rank,
    pieceBytesMax: transport.pieceBytesMax,
    send: (h, v, s) => transport.send(h, v, s),
    abort: (h, r) => transport.abort(h, r),
    close: () => transport.close(),
    listen: (receive) =>
      transport.listen((p) => {
        if (++arrived >= dieAfter) process.kill(process.pid, "SIGKILL");
        return receive(p);
      }),
  };
  const options = { progressTimeoutMs: plan.progressTimeoutMs };
  const coll: Collective =
    new Set(plan.hosts).size > 1
      ? new HierarchicalCollective(counting, { hosts: plan.hosts }, options)
      : new RingCollective(counting, size, options);
  const raw = rawLink(bus, plan);
  // a piece for a rank that has not subscribed yet is retried (NoResponders) until it has
  for (const op of plan.ops) {
    const before = { ...meter };
    codecMs = 0;
    const result = await runOp(coll, raw, plan, op);
    result.wireBytes = meter.bytes - before.bytes;
    result.inlineBytes = meter.inlineBytes - before.inlineBytes;
    result.codecMs = codecMs;
    result.shmPeers = transport.sharedMemoryPeers.length;
    result.netPeers = transport.netPeers.length;
    process.stdout.write(JSON.stringify(result) + "\n");
  }
  coll.close("plan done");
  await raw.close();
  await bus.close();
}

async function runOp(
  coll: Collective,
  raw: ReturnType<typeof rawLink>,
  plan: RankPlan,
  op: RankOp,
): Promise<RankResult> {
  const size = plan.hosts.length,
    key = { step: op.step, bucket: op.bucket };
  const inputs = op.check ? Array.from({ length: size }, (_, r) => rankInput(op.seed, r, op.len)) : [];
  const buf = op.check ? inputs[plan.rank]!.slice() : filled(op.len, plan.rank);
  const out: RankResult = {
    op: op.op,
    len: op.len,
    step: op.step,
    bucket: op.bucket,
    ms: 0,
    hash: "",
    errorRatio: 0,
    shmPeers: 0,
    netPeers: 0,
    wireBytes: 0,
    inlineBytes: 0,
    codecMs: 0,
  };
  let t0 = performance.now();
  try {
    await coll.barrier({ step: op.step, bucket: 0xffff_0000 + (op.bucket & 0xffff) });
    t0 = performance.now();
    if (op.op === "allReduce") {
      if (op.compress === undefined) await coll.allReduce(buf, key);
      else await coll.encodedAllReduce!(buf, key, coderOf(op.compress, op.len));
      out.ms = performance.now() - t0;
      out.hash = hashOf(buf);
      if (op.check) out.errorRatio = errorRatio(buf, inputs, 0, op.len);
    } else if (op.op === "reduceScatter") {
      const s = await coll.reduceScatter(buf, key);
      out.ms = performance.now() - t0;
      out.hash = hashOf(buf, s.offset, s.offset + s.count);
      if (op.check) out.errorRatio = errorRatio(buf, inputs, s.offset, s.offset + s.count);
    } else if (op.op === "allGather") {
      await coll.allGather(buf, key);
      out.ms = performance.now() - t0;
      out.hash = hashOf(buf);
      if (op.check) {
        const want = new Float32Array(op.len);
        inputs.forEach((x, r) => {
          const from = Math.floor((r * op.len) / size),
            to = Math.floor(((r + 1) * op.len) / size);
          want.set(x.subarray(from, to), from);
        });
        out.errorRatio = hashOf(want) === out.hash ? 0 : Infinity;
      }
    } else if (op.op === "broadcast") {
      await coll.broadcast(buf, op.root ?? 0, key);
      out.ms = performance.now() - t0;
      out.hash = hashOf(buf);
      if (op.check) out.errorRatio = hashOf(inputs[op.root ?? 0]!) === out.hash ? 0 : Infinity;
    } else if (op.op === "barrier") {
      await coll.barrier(key);
      out.ms = performance.now() - t0;
    } else {
      await raw.run((op.len * 4 * 2 * (size - 1)) / size, op.step);
      out.ms = performance.now() - t0;
    }
  } catch (e) {
    out.ms = performance.now() - t0;
    out.error = { name: (e as Error).name, message: (e as Error).message };
  }
  return out;
}

/** ms spent in the codec during the operation that runs */
let codecMs = 0;

function timed<A extends unknown[]>(f: (...a: A) => void): (...a: A) => void {
  return (...a) => {
    const t0 = performance.now();
    f(...a);
    codecMs += performance.now() - t0;
  };
}

/** A codec with its error feedback over `len` values (a fresh residual: one operation), timed. */
function coderOf(kind: "bf16" | "fp16" | "int8", len: number): WireCoder {
  const coder = new ErrorFeedback(new Codec(parseCompression(kind)), len).wireCoder((words) => new Float32Array(words));
  return { ...coder, encode: timed(coder.encode), decode: timed(coder.decode) };
}

function filled(len: number, rank: number): Float32Array {
  const x = new Float32Array(len);
  x.fill(rank + 1);
  return x;
}

/** The baseline: `bytes` to the next rank as requests of pieceBytes, windowPieces in flight. */
function rawLink(bus: NatsBus, plan: RankPlan) {
  const size = plan.hosts.length;
  const next = (plan.rank + 1) % size;
  const received = new Map<number, number>();
  const waiters: (() => void)[] = [];
  const sub = bus.handle(`_mt.raw.${plan.job}.${plan.rank}`, (data) => {
    const step = new DataView(data.buffer, data.byteOffset, 8).getFloat64(0, true);
    received.set(step, (received.get(step) ?? 0) + data.byteLength - 8);
    for (const w of waiters.splice(0)) w();
    return new Uint8Array(0);
  });
  const payload = new Uint8Array(plan.pieceBytes + 8);
  return {
    async run(bytes: number, step: number): Promise<void> {
      const total = Math.floor(bytes);
      const msgs: number[] = [];
      for (let o = 0; o < total; o += plan.pieceBytes) msgs.push(Math.min(plan.pieceBytes, total - o));
      new DataView(payload.buffer).setFloat64(0, step, true);
      let i = 0;
      const lane = async () => {
        while (i < msgs.length) {
          const n = msgs[i++]!;
          await bus.request(`_mt.raw.${plan.job}.${next}`, payload.subarray(0, n + 8), 30_000);
        }
      };
      await Promise.all(Array.from({ length: plan.windowPieces }, lane));
      while ((received.get(step) ?? 0) < total) await new Promise<void>((r) => waiters.push(r));
    },
    async close(): Promise<void> {
      sub.unsubscribe();
    },
  };
}

export type RanksRun = PlanRun<RankResult>;

/** Runs one rank process per plan (plans[r].rank === r) to the end; processes left are killed. */
export const runRankProcesses = (
  dir: string,
  plans: RankPlan[],
  env: Record<string, string> = {},
  spawn?: PlanSpawn,
): Promise<RanksRun> => runPlanProcesses<RankResult>(import.meta.path, dir, plans, env, spawn);

if (import.meta.main) await main();
