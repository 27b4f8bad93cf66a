// Trainer benchmark: end-to-end samples/s of a training job on the local mesh (2 trainers,
// loader, checkpoint, and 2 shards in parameter-server mode; all on this machine, each trainer
// limited to its share of the cores) against the single-process trainer on the same model and
// global batch in the same run, with the mesh step's time split: data wait, pull, compute,
// push, and in all-reduce mode the all-reduce's time and the part of it the step waited for
// (exposed), also as a share of the step. Per model: the MLP on MNIST (an epoch by default),
// and the GPT on Moby Dick (--gpt-steps steps of 2 x 32 windows of 64 characters).
//
// In all-reduce mode, --coll-transport picks what carries the gradients between the trainers:
// auto (shared memory and a Unix socket between processes on one machine, as a job does by
// default) and/or nats (every byte through the NATS server).
//
// --compress runs each mesh configuration once per codec (engine/parallel/compress.ts) and
// reports the gradient and parameter bytes each trainer moved per step, measured at the bus
// (pushes and pulls as encoded, or the collective's pieces sent), against the f32 run's
// (measured, when "none" is in the list) and against what the codec should give (theory), and
// the final accuracy (MNIST) or validation loss (GPT).
//
// --snapshot-every N runs each model and sync mode with a snapshot every N steps instead, twice:
// snapshots staged and written in the background (the default), and written before the save is
// answered (--sync-snapshots, the baseline); it reports how long rank 0's steps waited for them
// (per snapshot, and as a share of all step time) and the samples/s of each.
//
// --layouts DxPxT,... runs the GPT once per layout of data x pipeline x tensor parallelism on
// the mesh (D x P x T trainers; the same global batch of 32 windows in --micro-batches
// micro-batches, the same steps) and reports each one's samples/s against 1x1x1's, what each
// rank holds (parameters, gradients and optimizer state; the arena's peak of activations), and
// the share of a step the speaking ranks waited for their neighbours against the pipeline's
// theoretical bubble. On this machine's 2 cores more trainers share the same cores: the rows
// show what each layout costs and saves per rank, not a speed-up.
//
// --device cuda (and --trainers, --precision) runs the mesh's trainers and the single process on
// GPUs: with one GPU per trainer an all-reduce job takes NCCL, so `--trainers 1 --sync allreduce`
// measures one rank on device buffers against the engine alone.
//
//   bun run bench trainer [--model mlp,gpt] [--epochs 1] [--gpt-steps 60] [--sync bsp,allreduce] [--coll-transport auto,nats] [--bucket-mb 25]
//                         [--device cpu|cuda|auto] [--trainers 2] [--precision f32|tf32|bf16|f16]
//                         [--compress none,bf16,int8,topk:0.01] [--snapshot-every 20] [--layouts 1x1x1,1x2x1,1x1x2,2x2x1,1x2x2]
//                         [--micro-batches 4] [--schedule 1f1b] [--json-only]
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { type DeviceChoice, deviceChoices, openBackend } from "../ffi/select.ts";
import { loadCorpus } from "../engine/data/corpus.ts";
import { ImageBatcher } from "../engine/data/images.ts";
import { loadMnist } from "../engine/data/mnist.ts";
import { TokenBatcher } from "../engine/data/tokens.ts";
import { optimizerOf } from "../engine/optim/choose.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/context.ts";
import { type HostBatch, TrainStep } from "../engine/train.ts";
import { ConfigError } from "../ffi/errors.ts";
import {
  gptJobDefaults,
  type JobConfig,
  jobDefaults,
  parseJobConfig,
  usesShards,
} from "../services/runtime/job/config.ts";
import { buildModel } from "../services/runtime/job/model.ts";
import { type JobStatus, MeshClient } from "../sdk/client.ts";
import { LocalMesh } from "../sdk/local-mesh.ts";
import { type JobOutcome, watchJob } from "../sdk/watch.ts";
import { EventKind } from "../schemas/messages/job.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { printReport, round } from "./table.ts";
import { Codec, type Compression, parseCompression } from "../engine/parallel/compress.ts";

export interface TrainerBenchResult {
  model: string;
  run: string;
  steps: number;
  samples_per_s: number;
  data_wait_ms: number;
  pull_ms: number;
  compute_ms: number;
  push_ms: number;
  comm_ms: number;
  exposed_ms: number;
  /** exposed communication over the step time */
  exposed_share: number;
  ratio: number;
  compress: string;
  /** gradient and parameter bytes per trainer step, measured at the bus */
  wire_kb: number;
  /** wire bytes against the same run uncompressed (measured; 0 when not run) and against theory */
  wire_ratio: number;
  wire_theory: number;
  /** MNIST: test accuracy; GPT: validation loss */
  quality: number;
}

const benchSyncs = ["bsp", "asp", "ssp", "allreduce"] as const;

const benchModels = ["mlp", "gpt"] as const;

const trainerColumns: readonly (keyof TrainerBenchResult)[] = [
  "model",
  "run",
  "steps",
  "samples_per_s",
  "data_wait_ms",
  "pull_ms",
  "compute_ms",
  "push_ms",
  "comm_ms",
  "exposed_ms",
  "exposed_share",
  "ratio",
  "compress",
  "wire_kb",
  "wire_ratio",
  "wire_theory",
  "quality",
];

/** The options of `bench trainer`, checked. */
interface TrainerBenchArgs {
  models: string[];
  syncs: string[];
  epochs: number;
  gptSteps: number;
  bucketMb: number;
  transports: JobConfig["collTransport"][];
  codecs: string[];
  /** 0: no snapshot bench */
  snapshotEvery: number;
  /** null: no layout bench */
  layouts: Layout3[] | null;
  microBatches: number;
  schedule: "1f1b" | "gpipe";
  /** where the trainers and the single process compute (the mesh's MT_DEVICE) */
  device: DeviceChoice;
  trainers: number;
  precision: JobConfig["precision"];
  jsonOnly: boolean;
}

/** A comma-separated list of `allowed` values, or a ConfigError naming the option. */
function listOf(name: string, raw: unknown, allowed: readonly string[]): string[] {
  const xs = String(raw).split(",");
  for (const x of xs)
    if (!allowed.includes(x))
      throw new ConfigError(`--${name} must be a list of ${allowed.join(", ")}, got ${String(raw)}`);
  return xs;
}

function trainerArgs(argv: string[]): TrainerBenchArgs {
  const v = parseBenchArgs(argv, {
    model: { type: "string", default: "mlp,gpt" },
    epochs: { type: "string", default: "1" },
    "gpt-steps": { type: "string", default: "60" },
    sync: { type: "string", default: "bsp,allreduce" },
    "bucket-mb": { type: "string", default: String(jobDefaults.bucketMb) },
    "coll-transport": { type: "string", default: "auto" },
    compress: { type: "string", default: "none" },
    "snapshot-every": { type: "string", default: "0" },
    layouts: { type: "string", default: "" },
    "micro-batches": { type: "string", default: "4" },
    schedule: { type: "string", default: "1f1b" },
    device: { type: "string", default: "cpu" },
    trainers: { type: "string", default: "2" },
    precision: { type: "string", default: "f32" },
    "json-only": { type: "boolean", default: false },
  });
  const [device] = listOf("device", v.device, deviceChoices) as [DeviceChoice];
  const [precision] = listOf("precision", v.precision, ["f32", "tf32", "bf16", "f16"]) as [JobConfig["precision"]];
  const trainers = positiveInt("trainers", v.trainers);
  if (trainers > 16) throw new ConfigError(`--trainers: at most 16, got ${trainers}`);
  const snapshotEvery = Number(v["snapshot-every"]);
  if (!(Number.isInteger(snapshotEvery) && snapshotEvery >= 0))
    throw new ConfigError(`--snapshot-every must be a step count >= 0, got ${String(v["snapshot-every"])}`);
  const codecs = String(v.compress).split(",");
  for (const c of codecs) parseCompression(c);
  const syncs = listOf("sync", v.sync, benchSyncs);
  const models = listOf("model", v.model, benchModels);
  const transports = String(v["coll-transport"]).split(",") as JobConfig["collTransport"][];
  for (const x of transports)
    if (x !== "auto" && x !== "nats")
      throw new ConfigError(`--coll-transport must be a list of auto, nats; got ${String(v["coll-transport"])}`);
  const bucketMb = Number(v["bucket-mb"]);
  if (!(bucketMb > 0 && bucketMb <= 1024))
    throw new ConfigError(`--bucket-mb must be a number in (0, 1024], got ${String(v["bucket-mb"])}`);
  const schedule = String(v.schedule);
  if (schedule !== "1f1b" && schedule !== "gpipe")
    throw new ConfigError(`--schedule must be 1f1b or gpipe, got ${schedule}`);
  return {
    models,
    syncs,
    epochs: positiveInt("epochs", v.epochs),
    gptSteps: positiveInt("gpt-steps", v["gpt-steps"]),
    bucketMb,
    transports,
    codecs,
    snapshotEvery,
    layouts: String(v.layouts) === "" ? null : parseLayouts(String(v.layouts)),
    microBatches: positiveInt("micro-batches", v["micro-batches"]),
    schedule,
    device,
    trainers,
    precision,
    jsonOnly: Boolean(v["json-only"]),
  };
}

export async function runTrainerBench(
  argv: string[],
): Promise<TrainerBenchResult[] | SnapshotBenchResult[] | LayoutBenchResult[]> {
  const a = trainerArgs(argv);
  if (a.layouts !== null) return await layoutBench(a.layouts, a.gptSteps, a.microBatches, a.schedule, a.jsonOnly);
  if (a.snapshotEvery > 0)
    return await snapshotBench(a.models, a.syncs, a.epochs, a.gptSteps, a.snapshotEvery, a.jsonOnly);
  const rows: TrainerBenchResult[] = [];
  for (const kind of a.models) {
    const base = modelJob(kind, a.epochs, a.gptSteps, {
      job: "bench.trainer",
      checkpointEvery: 0,
      trainers: a.trainers,
      precision: a.precision,
    });
    rows.push(...(await benchModel(base, a.syncs, a.bucketMb, a.transports, a.codecs, a.device)));
  }
  printReport({
    bench: "trainer",
    header:
      `trainer benchmark: ${a.trainers} trainer${a.trainers > 1 ? "s" : ""} per mesh run on ${a.device} (MT_DEVICE), all services on this machine (${navigator.hardwareConcurrency} cores); ` +
      `mesh times are per trainer step (ms); ratio = samples/s against the single-process trainer on the same model, global batch and steps`,
    rows,
    columns: trainerColumns,
    quiet: a.jsonOnly,
  });
  return rows;
}

/** A model's job: the MLP on MNIST for `epochs` epochs, or the GPT on Moby Dick for `gptSteps` steps without evals. */
function modelJob(kind: string, epochs: number, gptSteps: number, over: Record<string, unknown>): JobConfig {
  return kind === "mlp"
    ? parseJobConfig({ ...jobDefaults, epochs, ...over })
    : parseJobConfig({ ...gptJobDefaults, epochs: 1, maxSteps: gptSteps, evalEvery: 0, ...over });
}

const modelName = (cfg: JobConfig) =>
  cfg.model.kind === "mlp"
    ? `mlp ${cfg.model.widths.join("-")}`
    : `gpt L${cfg.model.nLayer} C${cfg.model.nEmbd} T${cfg.model.blockSize}`;

/** `cfg` submitted as `job` to a local mesh of its trainers (and shards), started in a temporary
 *  folder named from `mesh.tmpPrefix` and removed after; `watch` follows the job with the mesh's client. */
async function onLocalMesh<R>(
  cfg: JobConfig,
  job: string,
  mesh: { tmpPrefix: string; env?: Record<string, string> },
  watch: (client: MeshClient) => Promise<R>,
): Promise<R> {
  const dir = mkdtempSync(join(tmpdir(), mesh.tmpPrefix));
  try {
    await using m = await LocalMesh.start({
      jobsDir: join(dir, "jobs"),
      logDir: join(dir, "logs"),
      trainers: cfg.trainers,
      shards: usesShards(cfg) ? cfg.shards : 0,
      env: mesh.env,
    });
    await using client = await MeshClient.connect(m.url, m.auth());
    await client.submit({ ...cfg, job }, { membersWaitMs: 60_000 });
    return await watch(client);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

type MeshRun = { cfg: JobConfig; r: JobOutcome };

async function benchModel(
  base: JobConfig,
  syncs: string[],
  bucketMb: number,
  transports: JobConfig["collTransport"][],
  codecs: string[],
  device: DeviceChoice,
): Promise<TrainerBenchResult[]> {
  const meshRuns: MeshRun[] = [];
  const runs = syncs.flatMap((sync) =>
    (sync === "allreduce" ? transports : ["auto" as const]).flatMap((collTransport) =>
      codecs.map((compress) => ({ sync, collTransport, compress })),
    ),
  );
  for (const { sync, collTransport, compress } of runs) {
    const cfg = parseJobConfig({
      ...base,
      job: `bench.trainer-${base.model.kind}-${sync}-${Date.now()}`,
      sync,
      staleness: sync === "ssp" ? 2 : 0,
      bucketMb,
      collTransport,
      compress,
    });
    const r = await onLocalMesh(
      cfg,
      cfg.job,
      { tmpPrefix: "mt-bench-trainer-", env: { MT_DEVICE: device } },
      (client) => watchJob(client, cfg.job, { quiet: true }),
    );
    meshRuns.push({ cfg, r });
  }
  const steps = meshRuns[0]?.r.record.totalSteps ?? 50;
  const single = singleProcessRate(base, steps, device);
  const rows = meshRuns.map((run) => meshRow(run, meshRuns, single.rate, single.params));
  rows.push({
    model: modelName(base),
    run: "single process",
    steps: single.done,
    samples_per_s: round(single.rate, 0),
    data_wait_ms: 0,
    pull_ms: 0,
    compute_ms: round((1000 * base.batchSize * base.trainers) / single.rate, 2),
    push_ms: 0,
    comm_ms: 0,
    exposed_ms: 0,
    exposed_share: 0,
    ratio: 1,
    compress: "none",
    wire_kb: 0,
    wire_ratio: 0,
    wire_theory: 0,
    quality: 0,
  });
  return rows;
}

/** One mesh run's row: its step's split, its rate against the single process's, its wire bytes
 *  against the uncompressed run's of the same sync and transport (in `all`) and against theory. */
function meshRow(
  { cfg: c, r }: MeshRun,
  all: readonly MeshRun[],
  singleRate: number,
  params: number,
): TrainerBenchResult {
  const s = r.split;
  const stepMs = (1000 * c.batchSize * c.trainers) / r.samplesPerS;
  const f32Wire =
    all.find((m) => m.cfg.sync === c.sync && m.cfg.collTransport === c.collTransport && m.cfg.compress === "none")?.r
      .wireBytesPerStep ?? 0;
  const where = usesShards(c)
    ? `${c.trainers} trainers x ${c.shards} shards`
    : `${c.trainers} trainers, ${c.bucketMb} MB buckets, ${c.collTransport === "auto" ? "shared memory" : "NATS"}`;
  return {
    model: modelName(c),
    run: `mesh ${c.sync} ${where}`,
    steps: r.record.totalSteps,
    samples_per_s: round(r.samplesPerS, 0),
    data_wait_ms: round(s.dataWaitMs, 2),
    pull_ms: round(s.pullMs, 2),
    compute_ms: round(s.computeMs, 2),
    push_ms: round(s.pushMs, 2),
    comm_ms: round(s.commMs, 2),
    exposed_ms: round(s.exposedCommMs, 2),
    exposed_share: round(s.exposedCommMs / stepMs, 3),
    ratio: round(r.samplesPerS / singleRate, 3),
    compress: c.compress,
    wire_kb: round(r.wireBytesPerStep / 1024, 1),
    wire_ratio: f32Wire > 0 ? round(r.wireBytesPerStep / f32Wire, 3) : 0,
    wire_theory: round(wireTheory(c, params, r.record.totalSteps), 3),
    quality: round(c.model.kind === "gpt" ? r.record.loss : r.record.accuracy, 4),
  };
}

export interface SnapshotBenchResult {
  model: string;
  run: string;
  snapshots: string;
  steps: number;
  samples_per_s: number;
  step_ms: number;
  /** rank 0's wait at a snapshot's boundary, per snapshot */
  stall_ms: number;
  /** all snapshot waits over all step time (rank 0) */
  stall_share: number;
  /** samples/s against the synchronous snapshots' run */
  ratio: number;
}

export interface LayoutBenchResult {
  layout: string;
  trainers: number;
  steps: number;
  samples_per_s: number;
  /** samples/s against the first layout's (1x1x1 by default) */
  ratio: number;
  /** the most any rank holds: parameters; parameters, gradients and optimizer state; activations */
  params_kb: number;
  state_kb: number;
  arena_peak_kb: number;
  /** the speaking ranks' share of a step spent waiting for their neighbour stages and the tensor all-reduces */
  idle_share: number;
  bubble_theory: number;
  val_loss: number;
}

type Layout3 = { data: number; stages: number; tensor: number };

function parseLayouts(text: string): Layout3[] {
  return text.split(",").map((l) => {
    const m = /^(\d+)x(\d+)x(\d+)$/.exec(l.trim());
    if (!m)
      throw new ConfigError(`--layouts takes DxPxT layouts (data x pipeline x tensor), comma-separated: got "${l}"`);
    const [data, stages, tensor] = [Number(m[1]), Number(m[2]), Number(m[3])];
    if (!(data >= 1 && stages >= 1 && tensor >= 1 && data * stages * tensor <= 16))
      throw new ConfigError(`--layouts: ${l} needs 1 to 16 trainers`);
    return { data, stages, tensor };
  });
}

const layoutColumns: readonly (keyof LayoutBenchResult)[] = [
  "layout",
  "trainers",
  "steps",
  "samples_per_s",
  "ratio",
  "params_kb",
  "state_kb",
  "arena_peak_kb",
  "idle_share",
  "bubble_theory",
  "val_loss",
];

/** The GPT in each layout of data x pipeline x tensor parallelism on the mesh, the same global batch and steps. */
async function layoutBench(
  layouts: Layout3[],
  steps: number,
  micro: number,
  schedule: "1f1b" | "gpipe",
  jsonOnly: boolean,
): Promise<LayoutBenchResult[]> {
  const rows: LayoutBenchResult[] = [];
  const globalBatch = 32;
  for (const l of layouts) {
    const trainers = l.data * l.stages * l.tensor;
    if (globalBatch % (l.data * micro) !== 0)
      throw new ConfigError(
        `--layouts ${l.data}x..: ${l.data} copies x ${micro} micro-batches do not divide ${globalBatch} windows`,
      );
    const cfg = parseJobConfig({
      ...gptJobDefaults,
      job: "bench.layouts",
      sync: "allreduce",
      trainers,
      pipelineStages: l.stages,
      tensorParallel: l.tensor,
      pipeSchedule: schedule,
      batchSize: globalBatch / l.data,
      accumSteps: micro,
      epochs: 1,
      maxSteps: steps,
      checkpointEvery: 0,
      evalEvery: 0,
    });
    const job = `${cfg.job}-${Date.now()}`;
    const { r, ranks, idleShare } = await onLocalMesh(cfg, job, { tmpPrefix: "mt-bench-layouts-" }, (client) =>
      watchLayout(client, job, steps),
    );
    const kb = (b: number) => round(b / 1024, 1);
    rows.push({
      layout: `${l.data}x${l.stages}x${l.tensor}`,
      trainers,
      steps: r.record.totalSteps,
      samples_per_s: round(r.samplesPerS, 1),
      ratio: 1,
      params_kb: kb(Math.max(0, ...ranks.map((t) => t.paramBytes))),
      state_kb: kb(Math.max(0, ...ranks.map((t) => t.paramBytes + t.gradBytes + t.optimizerBytes))),
      arena_peak_kb: kb(Math.max(0, ...ranks.map((t) => t.arenaPeakBytes))),
      idle_share: idleShare,
      bubble_theory: round((l.stages - 1) / (micro + l.stages - 1), 3),
      val_loss: round(r.record.loss, 4),
    });
  }
  for (const row of rows) row.ratio = round(row.samples_per_s / rows[0]!.samples_per_s, 3);
  printReport({
    bench: "trainer-layouts",
    header:
      `model-parallel layouts (data x pipeline x tensor) of the GPT on the mesh, ${globalBatch} windows a step in ${micro} micro-batches a copy, ${schedule}, ` +
      `${steps} steps, all on this machine (${navigator.hardwareConcurrency} cores); per-rank memory is the most any rank holds (from its allocations); ` +
      "idle = the share of a step the copies' speaking ranks waited for their neighbour stages and in the tensor ranks' all-reduces",
    rows,
    columns: layoutColumns,
    quiet: jsonOnly,
  });
  return rows;
}

/** A layout's job watched to its end: its outcome, what its ranks held halfway (from the mesh's
 *  status), and the share of a step its speaking ranks waited for their neighbours. */
async function watchLayout(client: MeshClient, job: string, steps: number) {
  let status: Promise<JobStatus> | null = null;
  let idle = 0,
    busy = 0;
  const r = await watchJob(client, job, {
    quiet: true,
    onEvent: (e) => {
      if (e.kind !== EventKind.Step || e.samplesPerS <= 0) return;
      if (status === null && e.step >= Math.floor(steps / 2)) status = client.status(job);
      if (e.step < 2) return; // the first steps include the connections' start
      idle += e.commMs;
      busy += (1000 * e.count) / e.samplesPerS;
    },
  });
  const st = status === null ? null : await (status as Promise<JobStatus>).catch(() => null);
  const ranks = (st?.trainers ?? []).flatMap((t) => ("error" in t ? [] : [t]));
  return { r, ranks, idleShare: round(idle / Math.max(busy, 1e-9), 3) };
}

const snapshotColumns: readonly (keyof SnapshotBenchResult)[] = [
  "model",
  "run",
  "snapshots",
  "steps",
  "samples_per_s",
  "step_ms",
  "stall_ms",
  "stall_share",
  "ratio",
];

/** Snapshot stalls: every model and sync mode with a snapshot every `every` steps, background writes against synchronous ones. */
async function snapshotBench(
  models: string[],
  syncs: string[],
  epochs: number,
  gptSteps: number,
  every: number,
  jsonOnly: boolean,
): Promise<SnapshotBenchResult[]> {
  const rows: SnapshotBenchResult[] = [];
  for (const kind of models)
    for (const sync of syncs) {
      const cfg = modelJob(kind, epochs, gptSteps, {
        job: "bench.snapshots",
        checkpointEvery: every,
        sync,
        // staleness 2 for the MLP's ssp runs; the GPT's keep the default
        ...(kind === "mlp" ? { staleness: sync === "ssp" ? 2 : 0 } : {}),
      });
      const pair: SnapshotBenchResult[] = [];
      for (const background of [false, true]) pair.push(await snapshotRun(cfg, sync, every, background));
      for (const row of pair) row.ratio = round(row.samples_per_s / pair[0]!.samples_per_s, 3);
      rows.push(...pair);
    }
  printReport({
    bench: "trainer-snapshots",
    header:
      "snapshot stall: rank 0's wait at each snapshot's step boundary (the state staged, or written too), per snapshot and as a share of all its step time; ratio = samples/s against the run whose snapshots are written before the answer",
    rows,
    columns: snapshotColumns,
    quiet: jsonOnly,
  });
  return rows;
}

/** One run of `cfg` with snapshots written in the background or before the save is answered, and rank 0's waits for them. */
async function snapshotRun(
  cfg: JobConfig,
  sync: string,
  every: number,
  background: boolean,
): Promise<SnapshotBenchResult> {
  const job = `${cfg.job}-${Date.now()}`;
  const env = { MT_SYNC_SNAPSHOTS: String(!background) };
  return await onLocalMesh(cfg, job, { tmpPrefix: "mt-bench-snapshots-", env }, async (client) => {
    let stall = 0,
      stepMs = 0,
      taken = 0;
    const r = await watchJob(client, job, {
      quiet: true,
      onEvent: (e) => {
        if (e.kind !== EventKind.Step || e.rank !== 0 || e.samplesPerS <= 0) return;
        stepMs += (1000 * e.count) / e.samplesPerS;
        if (e.snapshotMs > 0) {
          stall += e.snapshotMs;
          taken++;
        }
      },
    });
    return {
      model: modelName(cfg),
      run: `mesh ${sync}`,
      snapshots: background
        ? `every ${every} steps, written in the background`
        : `every ${every} steps, written before the answer`,
      steps: r.record.totalSteps,
      samples_per_s: round(r.samplesPerS, 0),
      step_ms: round(stepMs / Math.max(r.record.totalSteps, 1), 2),
      stall_ms: round(stall / Math.max(taken, 1), 2),
      stall_share: round(stall / Math.max(stepMs, 1e-9), 4),
      ratio: 1,
    };
  });
}

/**
 * The bytes a codec should move per trainer step against f32, for `n` parameters. Parameter
 * server: pulls (f32, or 16-bit with bf16/fp16) plus pushes (chunks as encoded) against 2 x 4n.
 * All-reduce: every rank's encoding all-gathered, (N-1) slots, against the f32 ring's 2(N-1)/N x 4n
 * (one bucket per 25 MB: these models fit one).
 */
export function wireTheory(c: JobConfig, n: number, steps: number): number {
  const comp = parseCompression(c.compress);
  if (comp.kind === "none") return 1;
  // the mean over the run's steps (top-k is denser over the learning rate's warm-up)
  let sum = 0;
  for (let s = 0; s < steps; s++) sum += wireAt(c, comp, n, s);
  return sum / Math.max(steps, 1);
}

function wireAt(c: JobConfig, comp: Compression, n: number, step: number): number {
  if (c.sync === "allreduce") {
    const codec = new Codec(comp);
    codec.atStep(step, c.warmupSteps);
    return ((c.trainers - 1) * codec.slotBytes(n)) / (((2 * (c.trainers - 1)) / c.trainers) * 4 * n);
  }
  const chunk = c.chunkBytes / 4;
  const codec = new Codec(comp, chunk);
  codec.atStep(step, c.warmupSteps);
  let push = 0;
  for (let at = 0; at < n; at += chunk) {
    const m = Math.min(chunk, n - at);
    push += comp.kind === "int8" ? m + 4 : comp.kind === "bf16" || comp.kind === "fp16" ? 2 * m : codec.slotBytes(m);
  }
  const pull = (comp.kind === "bf16" || comp.kind === "fp16" ? 2 : 4) * n;
  return (pull + push) / (8 * n);
}

/** Samples/s of the single-process trainer: the same model and optimizer at the mesh's global batch, `steps` steps. */
function singleProcessRate(
  cfg: JobConfig,
  steps: number,
  device: DeviceChoice = "cpu",
): { rate: number; done: number; params: number } {
  const global = cfg.batchSize * cfg.trainers;
  const backend = device === "cpu" ? new CpuBackend() : openBackend(device).backend;
  const ctx = new Context(backend, { seed: cfg.seed, precision: cfg.precision });
  let batches: () => HostBatch;
  let plan = { vocabSize: 0, vocab: [] as number[] };
  if (cfg.model.kind === "mlp") {
    const batcher = new ImageBatcher(loadMnist().train, global);
    let it = batcher.epoch(cfg.seed, 0, true, true),
      epoch = 0;
    batches = () => {
      let n = it.next();
      if (n.done) n = (it = batcher.epoch(cfg.seed, ++epoch, true, true)).next();
      return n.value as HostBatch;
    };
  } else {
    const corpus = loadCorpus({ valFraction: cfg.valFraction });
    plan = { vocabSize: corpus.vocabSize, vocab: [] };
    const batcher = new TokenBatcher(corpus.train, global, cfg.model.blockSize, corpus.vocabSize),
      rng = new Rng(cfg.seed);
    batches = () => batcher.random(rng);
  }
  const model = buildModel(ctx, cfg, plan);
  const optimizer = optimizerOf(ctx, model.store, cfg.optimizer);
  const trainer = new TrainStep(ctx, model, optimizer, {
    lr: cfg.lr,
    schedule: { kind: "constant" },
    gradClip: cfg.gradClip,
    accumSteps: 1,
  });
  trainer.run([batches()]); // warm-up: first-touch allocations, as the mesh's first step is not counted either
  const t0 = performance.now();
  for (let i = 0; i < steps; i++) trainer.run([batches()]);
  backend.synchronize(); // a GPU's queued work is part of the time
  const rate = (steps * global) / ((performance.now() - t0) / 1000);
  const params = model.store.paramCount;
  ctx.dispose();
  backend.dispose();
  return { rate, done: steps, params };
}
