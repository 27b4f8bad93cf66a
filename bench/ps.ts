// Parameter-server benchmark: push + pull of a whole model by one trainer (ASP, so nothing
// waits on other trainers) against shard processes on a real nats-server, in GB/s, next to raw
// NATS request/reply of the same messages (same sizes, same number of processes, no work) in
// the same run. Ratio = parameter-server GB/s / raw NATS GB/s (of the f32 model's bytes); target 0.8.
//
// --compress runs each size once per codec (pushes encoded with error feedback; bf16/fp16 also
// pull a 16-bit copy): wire_mb is what one push + pull moved (requests and replies as encoded),
// and vs_f32 the push + pull time against the uncompressed run's.
//
//   bun run bench ps [--sizes-mb 4,16,64] [--shards 1,2,4] [--rounds 15] [--compress none,bf16,int8,topk:0.01] [--json-only]
import { join } from "node:path";
import { packByBytes } from "../schemas/codec.ts";
import { decodeShardStats } from "../schemas/messages/parameter-server.ts";
import { encodeJobRequest, SyncPolicy } from "../schemas/messages/job.ts";
import { planHere } from "../services/data-loader/loader.ts";
import { buildLayout, type Layout } from "../services/runtime/job/layout.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../services/runtime/job/config.ts";
import { subjects } from "../services/runtime/job/subjects.ts";
import { JobStore } from "../services/runtime/job/ledger.ts";
import { initialParameters } from "../services/runtime/job/model.ts";
import { NatsBus } from "../services/runtime/mesh/nats.ts";
import { startNatsServer } from "../services/runtime/mesh/nats-server.ts";
import { PsClient } from "../services/trainer/ps-client.ts";
import { ConfigError } from "../ffi/errors.ts";
import { parseCompression } from "../engine/parallel/compress.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, printReport, round } from "./table.ts";

export interface PsBenchResult {
  model_mb: number;
  shards: number;
  messages: number;
  ps_ms: number;
  ps_gb_per_s: number;
  nats_gb_per_s: number;
  ratio: number;
  target: number;
  compress: string;
  /** bytes one push + pull moved, as encoded */
  wire_mb: number;
  /** push + pull time against the uncompressed run of the same size and shards (0: not run) */
  vs_f32: number;
}

const psColumns: readonly (keyof PsBenchResult)[] = [
  "model_mb",
  "shards",
  "compress",
  "messages",
  "ps_ms",
  "wire_mb",
  "vs_f32",
  "ps_gb_per_s",
  "nats_gb_per_s",
  "ratio",
  "target",
];

const root = join(import.meta.dir, "..");
const chunkBytes = 1 << 20;
const payloadBytesMax = 8 << 20;
const list = (name: string, raw: unknown) =>
  String(raw)
    .split(",")
    .map((x) => positiveInt(name, x));

/** An MLP 784-H-10 of about `mb` megabytes of fp32 parameters. */
function jobFor(mb: number, shards: number, compress: string): JobConfig {
  const hidden = Math.round((mb * (1 << 20)) / 4 / (784 + 10 + 1));
  return parseJobConfig({
    ...jobDefaults,
    job: `bench.${mb}mb-${shards}-${compress.replace(/[^a-z0-9]/g, "")}`,
    compress,
    model: { kind: "mlp", widths: [784, hidden, 10], dropout: 0 },
    trainers: 1,
    shards,
    sync: "asp",
    optimizer: { kind: "sgd", momentum: 0.9, nesterov: false, weightDecay: 0 },
    schedule: "constant",
    warmupSteps: 0,
    chunkBytes,
    checkpointEvery: 0,
  });
}

function spawn(args: string[]) {
  const p = Bun.spawn([process.execPath, ...args], {
    cwd: root,
    stdout: "pipe",
    stderr: "ignore",
    env: { ...process.env, OMP_NUM_THREADS: "1", MT_LOG_LEVEL: "warn" },
  });
  return p;
}

async function waitLine(p: ReturnType<typeof spawn>, text: string): Promise<void> {
  const decoder = new TextDecoder();
  let out = "";
  for await (const chunk of p.stdout) {
    out += decoder.decode(chunk);
    if (out.includes(text)) return;
  }
  throw new Error(`process exited before printing "${text}"`);
}

export async function runPsBench(argv: string[]): Promise<PsBenchResult[]> {
  const v = parseBenchArgs(argv, {
    "sizes-mb": { type: "string", default: "4,16,64" },
    shards: { type: "string", default: "1,2,4" },
    rounds: { type: "string", default: "15" },
    compress: { type: "string", default: "none" },
    "json-only": { type: "boolean", default: false },
  });
  const codecs = String(v.compress).split(",");
  for (const c of codecs) parseCompression(c);
  const sizes = list("sizes-mb", v["sizes-mb"]),
    shardCounts = list("shards", v.shards),
    rounds = positiveInt("rounds", v.rounds);
  if (Math.max(...shardCounts) > 8) throw new ConfigError("--shards: at most 8");
  await using server = await startNatsServer({ maxPayloadBytes: payloadBytesMax });
  const maxShards = Math.max(...shardCounts);
  const shards = Array.from({ length: maxShards }, (_, k) =>
    spawn(["services/parameter-server/main.ts", "--nats-url", server.url, "--shard", String(k)]),
  );
  // the shards take each job's step count (its schedule's length) from the data-loader's plan
  const loader = spawn(["services/data-loader/main.ts", "--nats-url", server.url]);
  const echoes = Array.from({ length: maxShards }, (_, k) => spawn(["bench/nats-echo.ts", server.url, String(k)]));
  await Promise.all(echoes.map((p) => waitLine(p, "ready")));
  const bus = await NatsBus.connect({
    url: server.url,
    name: "bench-ps",
    connectRetryMsMax: 10_000,
    connectBackoffMsMax: 500,
  });
  const store = await JobStore.open(bus);
  const rows: PsBenchResult[] = [];
  try {
    for (const mb of sizes)
      for (const n of shardCounts)
        for (const c of codecs) {
          const row = await benchOne(bus, store, jobFor(mb, n, c), mb, rounds);
          const f32 = rows.find((r) => r.model_mb === mb && r.shards === n && r.compress === "none");
          rows.push({ ...row, vs_f32: c === "none" ? 1 : f32 ? round(row.ps_ms / f32.ps_ms, 3) : 0 });
        }
  } finally {
    await bus.close();
    for (const p of [...shards, loader, ...echoes]) p.kill("SIGTERM");
    await Promise.all([...shards, loader, ...echoes].map((p) => p.exited));
  }
  printReport({
    bench: "ps",
    header:
      `parameter-server benchmark: 1 trainer pushes then pulls the whole model (ASP, SGD momentum), ${chunkBytes >> 20} MB chunks, ` +
      `messages up to ${payloadBytesMax >> 20} MB; medians of ${rounds} rounds, interleaved with rounds of raw NATS (the same messages to echo processes)`,
    rows,
    columns: psColumns,
    quiet: v["json-only"],
  });
  return rows;
}

async function benchOne(
  bus: NatsBus,
  store: JobStore,
  cfg: JobConfig,
  mb: number,
  rounds: number,
): Promise<PsBenchResult> {
  const { layout, total } = await putJobForShards(bus, store, cfg);
  const client = new PsClient(bus, layout, 0, payloadBytesMax, parseCompression(cfg.compress));
  const grads = new Float32Array(total).fill(1e-6),
    params = new Float32Array(total);
  const groups = rawGroups(layout);
  let step = 0;
  const psRound = async () => {
    const t0 = performance.now();
    await client.push(step, grads);
    await client.pull(++step, params);
    return performance.now() - t0;
  };
  const natsRound = async () => {
    const t0 = performance.now();
    await Promise.all(
      groups.flatMap((g, k) => g.map((bytes) => bus.request(`bench.${k}.push`, new Uint8Array(bytes + 256), 60_000))),
    );
    await Promise.all(
      groups.flatMap((g, k) => g.map((bytes) => bus.request(`bench.${k}.pull`, sizeRequest(bytes), 60_000))),
    );
    return performance.now() - t0;
  };
  let wire = 0;
  const { psMs, natsMs } = await interleaved(rounds, psRound, natsRound, () => {
    wire = client.wireBytes;
  });
  await store.deleteSpec(cfg.job);
  const bytes = 2 * total * 4;
  const ps = bytes / median(psMs) / 1e6,
    nats = bytes / median(natsMs) / 1e6;
  return {
    model_mb: mb,
    shards: cfg.shards,
    messages: 2 * groups.flat().length,
    ps_ms: round(median(psMs), 1),
    ps_gb_per_s: round(ps, 3),
    nats_gb_per_s: round(nats, 3),
    ratio: round(ps / nats, 3),
    target: 0.8,
    compress: cfg.compress,
    wire_mb: round((client.wireBytes - wire) / rounds / 1e6, 2),
    vs_f32: 0,
  };
}

/** Puts the job's spec in the store and waits until every shard serves it. Returns the layout the
 *  shards and trainers derive from the model (checked against each shard's element count) and
 *  the model's parameter count. */
async function putJobForShards(
  bus: NatsBus,
  store: JobStore,
  cfg: JobConfig,
): Promise<{ layout: Layout; total: number }> {
  const plan = planHere(cfg);
  await store.putSpec({
    job: cfg.job,
    trainers: 1,
    shards: cfg.shards,
    sync: SyncPolicy.ASP,
    staleness: 0,
    configJson: JSON.stringify(cfg),
    plan,
  });
  // the same layout the shards and trainers derive from the model
  const init = initialParameters(cfg, plan);
  const total = init.values.length;
  const layout = buildLayout(cfg.job, total, init.decayElems, cfg.chunkBytes, cfg.shards);
  for (let k = 0; k < cfg.shards; k++) {
    for (let i = 0; ; i++) {
      try {
        const s = decodeShardStats(
          await bus.request(subjects.psStats(cfg.job, k), encodeJobRequest({ job: cfg.job, step: 0, tag: "" }), 2000),
          1 << 20,
        );
        if (s.elements !== layout.byShard[k]!.reduce((a, id) => a + layout.chunks[id]!.count, 0))
          throw new Error(`shard ${k} layout differs from the bench's`);
        break;
      } catch (e) {
        if (i > 600 || (e as Error).message.includes("layout differs")) throw e;
        await Bun.sleep(50);
      }
    }
  }
  return { layout, total };
}

/** The same messages, raw: per shard, the byte sizes of the groups PsClient sends. */
function rawGroups(layout: Layout): number[][] {
  return layout.byShard.map((ids) =>
    packByBytes(ids, (id) => layout.chunks[id]!.count * 4, payloadBytesMax).map((g) =>
      g.reduce((s, id) => s + layout.chunks[id]!.count * 4, 0),
    ),
  );
}

/** An echo process's pull request: the reply's size in its first 4 bytes. */
function sizeRequest(bytes: number): Uint8Array {
  const b = new Uint8Array(64);
  new DataView(b.buffer).setUint32(0, bytes + 256, true);
  return b;
}

/** `rounds` timed rounds of each after one to warm up (then `warmedUp` runs), interleaved and
 *  alternating which goes first, so both see the same (noisy) machine. */
async function interleaved(
  rounds: number,
  psRound: () => Promise<number>,
  natsRound: () => Promise<number>,
  warmedUp: () => void,
): Promise<{ psMs: number[]; natsMs: number[] }> {
  const psMs: number[] = [],
    natsMs: number[] = [];
  for (let r = 0; r <= rounds; r++) {
    let p: number, n: number;
    if (r % 2 === 0) {
      p = await psRound();
      n = await natsRound();
    } else {
      n = await natsRound();
      p = await psRound();
    }
    if (r === 0) warmedUp();
    if (r > 0) {
      psMs.push(p);
      natsMs.push(n);
    }
  }
  return { psMs, natsMs };
}
