// Data-loader benchmark: the loader process on a real nats-server, asked for MNIST batches by
// two trainer ranks at once as fast as they can (the loader's rate), then by one rank that
// computes a real training step between requests (a trainer's consumption): the wait it sees
// then is the input pipeline's cost per step. Ratio = batches/s / one trainer's step rate.
//
//   bun run bench data-loader [--batches 200] [--batch-size 128] [--json-only]
import { join } from "node:path";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { Context } from "../engine/context.ts";
import { type HostBatch, lossAndGradients } from "../engine/train.ts";
import {
  type Batch,
  decodeBatch,
  decodeLoaderStats,
  encodeBatchRequest,
  Split,
} from "../schemas/messages/data-loader.ts";
import { encodeJobRequest, SyncPolicy } from "../schemas/messages/job.ts";
import { planHere } from "../services/data-loader/loader.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../services/runtime/job/config.ts";
import { subjects } from "../services/runtime/job/subjects.ts";
import { JobStore } from "../services/runtime/job/ledger.ts";
import { buildModel } from "../services/runtime/job/model.ts";
import { NatsBus } from "../services/runtime/mesh/nats.ts";
import { startNatsServer } from "../services/runtime/mesh/nats-server.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, percentile, printReport, round } from "./table.ts";

export interface DataLoaderBenchResult {
  phase: string;
  batches: number;
  batches_per_s: number;
  wait_ms_p50: number;
  wait_ms_p99: number;
  trainer_batches_per_s: number;
  ratio: number;
}

const root = join(import.meta.dir, "..");

const dataLoaderColumns: readonly (keyof DataLoaderBenchResult)[] = [
  "phase",
  "batches",
  "batches_per_s",
  "wait_ms_p50",
  "wait_ms_p99",
  "trainer_batches_per_s",
  "ratio",
];

/** One batch request, answered: the batch and the ms it took. */
type Ask = (rank: number, step: number) => Promise<{ b: Batch; ms: number }>;

/** A phase's batches/s and the waits for its batches (ms). */
type Phase = { rate: number; waits: number[] };

export async function runDataLoaderBench(argv: string[]): Promise<DataLoaderBenchResult[]> {
  const v = parseBenchArgs(argv, {
    batches: { type: "string", default: "200" },
    "batch-size": { type: "string", default: "128" },
    "json-only": { type: "boolean", default: false },
  });
  const batches = positiveInt("batches", v.batches),
    batchSize = positiveInt("batch-size", v["batch-size"]);
  const cfg = parseJobConfig({ ...jobDefaults, job: "bench.dl", trainers: 2, batchSize });
  await using server = await startNatsServer();
  const loader = Bun.spawn([process.execPath, "services/data-loader/main.ts", "--nats-url", server.url], {
    cwd: root,
    stdout: "ignore",
    stderr: "ignore",
    env: { ...process.env, OMP_NUM_THREADS: "1" },
  });
  const bus = await NatsBus.connect({
    url: server.url,
    name: "bench-dl",
    connectRetryMsMax: 10_000,
    connectBackoffMsMax: 500,
  });
  try {
    await putJobForLoader(bus, cfg);
    const ask: Ask = (rank, step) => askBatch(bus, cfg, rank, step);
    const fast = await askFast(ask, batches);
    // the trainer's step time on this machine, in this process, for this batch
    const ctx = new Context(new CpuBackend(), { seed: 1 });
    const model = buildModel(ctx, cfg, planHere(cfg));
    const { b: sample } = await ask(0, batches);
    const host = hostBatch(sample);
    const stepMs = median(
      Array.from({ length: 15 }, () => {
        const t = performance.now();
        lossAndGradients(ctx, model, [host], 0, 0);
        return performance.now() - t;
      }),
    );
    const stepped = await askWithSteps(ask, batches, (b, s) => lossAndGradients(ctx, model, [hostBatch(b)], 0, s));
    const trainerRate = 1000 / stepMs;
    const stats = decodeLoaderStats(
      await bus.request(`mt.${cfg.job}.data.stats`, encodeJobRequest({ job: cfg.job, step: 0, tag: "" }), 5000),
      1 << 16,
    );
    ctx.dispose();
    const rows = [
      phaseRow("2 ranks as fast as possible", 2 * batches, fast, trainerRate),
      phaseRow("1 rank with a training step", batches, stepped, trainerRate),
    ];
    printReport({
      bench: "data-loader",
      header:
        `data-loader benchmark: MNIST, batch ${batchSize}, 2 ranks, prefetch credits 4; trainer step ${stepMs.toFixed(2)} ms (784-800-10 forward+backward in this process); ` +
        `loader: ${stats.prefetchHits} prefetch hits, ${stats.prefetchMisses} misses; ratio = batches/s / one trainer's consumption rate`,
      rows,
      columns: dataLoaderColumns,
      quiet: v["json-only"],
    });
    return rows;
  } finally {
    await bus.close();
    loader.kill("SIGTERM");
    await loader.exited;
  }
}

/** Puts the job's spec in the store and waits until the loader answers for it. */
async function putJobForLoader(bus: NatsBus, cfg: JobConfig): Promise<void> {
  await (await JobStore.open(bus)).putSpec({
    job: cfg.job,
    trainers: 2,
    shards: 1,
    sync: SyncPolicy.BSP,
    staleness: 0,
    configJson: JSON.stringify(cfg),
    plan: planHere(cfg),
  });
  for (let i = 0; ; i++) {
    try {
      await bus.request(`mt.${cfg.job}.data.stats`, encodeJobRequest({ job: cfg.job, step: 0, tag: "" }), 1000);
      break;
    } catch (e) {
      if (i > 400) throw e;
      await Bun.sleep(50);
    }
  }
}

/** Asks the loader for `rank`'s batch of `step`, timed. */
async function askBatch(bus: NatsBus, cfg: JobConfig, rank: number, step: number): ReturnType<Ask> {
  const t0 = performance.now();
  const b = decodeBatch(
    await bus.request(
      subjects.dataNext(cfg.job),
      encodeBatchRequest({ job: cfg.job, rank, split: Split.Train, credits: 4, step }),
      30_000,
    ),
    8 << 20,
  );
  return { b, ms: performance.now() - t0 };
}

/** Phase 1: two ranks, `batches` each, as fast as the loader answers. */
async function askFast(ask: Ask, batches: number): Promise<Phase> {
  const waits: number[] = [];
  const t1 = performance.now();
  await Promise.all(
    [0, 1].map(async (rank) => {
      for (let s = 0; s < batches; s++) waits.push((await ask(rank, s)).ms);
    }),
  );
  return { rate: (2 * batches) / ((performance.now() - t1) / 1000), waits };
}

/** Phase 2: one rank computing a real step per batch (`step`), as a trainer does: the request for
 *  the next batch goes out before the compute (one rank only: two in this one process would each
 *  wait while the other computes). */
async function askWithSteps(ask: Ask, batches: number, step: (b: Batch, s: number) => void): Promise<Phase> {
  const waits: number[] = [];
  const t2 = performance.now();
  let next = ask(0, batches + 1);
  for (let s = batches + 1; s < 2 * batches + 1; s++) {
    const t = performance.now();
    const { b } = await next;
    waits.push(performance.now() - t);
    next = ask(0, s + 1);
    step(b, s);
  }
  await next;
  return { rate: batches / ((performance.now() - t2) / 1000), waits };
}

const hostBatch = (b: Batch): HostBatch => ({
  inputs: b.x,
  inputShape: [b.rows, b.cols],
  targets: b.y,
  targetShape: [b.rows],
});

function phaseRow(phase: string, batches: number, p: Phase, trainerRate: number): DataLoaderBenchResult {
  return {
    phase,
    batches,
    batches_per_s: round(p.rate, 1),
    wait_ms_p50: round(percentile(p.waits, 0.5), 2),
    wait_ms_p99: round(percentile(p.waits, 0.99), 2),
    trainer_batches_per_s: round(trainerRate, 1),
    ratio: round(p.rate / trainerRate, 2),
  };
}
