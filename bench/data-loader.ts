// Data-loader benchmark: the loader process on a real nats-server, asked for MNIST batches by
// two trainer ranks at once as fast as they can (the loader's rate), then by one rank that
// computes a real training step between requests (a trainer's consumption): the wait it sees
// then is the input pipeline's cost per step. Ratio = batches/s / one trainer's step rate.
//
//   bun run bench data-loader [--batches 200] [--batch-size 128] [--json-only]
import { join } from "node:path";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { Context } from "../engine/tensor.ts";
import { lossAndGradients } from "../engine/train.ts";
import {
  decodeBatch,
  decodeLoaderStats,
  encodeBatchRequest,
  encodeJobRequest,
  Split,
  SyncPolicy,
} from "../schemas/messages.ts";
import { planHere } from "../services/data-loader/loader.ts";
import { jobDefaults, parseJobConfig, subjects } from "../services/runtime/job/job.ts";
import { JobStore } from "../services/runtime/job/jobs.ts";
import { buildModel } from "../services/runtime/job/model.ts";
import { NatsBus } from "../services/runtime/mesh/nats.ts";
import { startNatsServer } from "../services/runtime/mesh/nats-server.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, percentile, printTable, round } from "./table.ts";

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
    await (await JobStore.open(bus.nc)).putSpec({
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
    const ask = async (rank: number, step: number) => {
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
    };
    // phase 1: as fast as the loader answers
    const waits1: number[] = [];
    const t1 = performance.now();
    await Promise.all(
      [0, 1].map(async (rank) => {
        for (let s = 0; s < batches; s++) waits1.push((await ask(rank, s)).ms);
      }),
    );
    const loaderRate = (2 * batches) / ((performance.now() - t1) / 1000);
    // the trainer's step time on this machine, in this process, for this batch
    const be = new CpuBackend();
    const ctx = new Context(be, { seed: 1 });
    const model = buildModel(ctx, cfg, planHere(cfg));
    const { b: sample } = await ask(0, batches);
    const host = {
      inputs: sample.x,
      inputShape: [sample.rows, sample.cols],
      targets: sample.y,
      targetShape: [sample.rows],
    };
    const stepMs = median(
      Array.from({ length: 15 }, () => {
        const t = performance.now();
        lossAndGradients(ctx, model, [host], 0, 0);
        return performance.now() - t;
      }),
    );
    // phase 2: one rank computing a real step per batch, as a trainer does: the request for
    // the next batch goes out before the compute (one rank only: two in this one process would
    // each wait while the other computes)
    const waits2: number[] = [];
    const t2 = performance.now();
    let next = ask(0, batches + 1);
    for (let s = batches + 1; s < 2 * batches + 1; s++) {
      const t = performance.now();
      const { b } = await next;
      waits2.push(performance.now() - t);
      next = ask(0, s + 1);
      lossAndGradients(
        ctx,
        model,
        [{ inputs: b.x, inputShape: [b.rows, b.cols], targets: b.y, targetShape: [b.rows] }],
        0,
        s,
      );
    }
    await next;
    const consumeRate = batches / ((performance.now() - t2) / 1000);
    const trainerRate = 1000 / stepMs;
    const stats = decodeLoaderStats(
      await bus.request(`mt.${cfg.job}.data.stats`, encodeJobRequest({ job: cfg.job, step: 0, tag: "" }), 5000),
      1 << 16,
    );
    ctx.dispose();
    const rows: DataLoaderBenchResult[] = [
      {
        phase: "2 ranks as fast as possible",
        batches: 2 * batches,
        batches_per_s: round(loaderRate, 1),
        wait_ms_p50: round(percentile(waits1, 0.5), 2),
        wait_ms_p99: round(percentile(waits1, 0.99), 2),
        trainer_batches_per_s: round(trainerRate, 1),
        ratio: round(loaderRate / trainerRate, 2),
      },
      {
        phase: "1 rank with a training step",
        batches,
        batches_per_s: round(consumeRate, 1),
        wait_ms_p50: round(percentile(waits2, 0.5), 2),
        wait_ms_p99: round(percentile(waits2, 0.99), 2),
        trainer_batches_per_s: round(trainerRate, 1),
        ratio: round(consumeRate / trainerRate, 2),
      },
    ];
    if (!v["json-only"]) {
      console.log(
        `data-loader benchmark: MNIST, batch ${batchSize}, 2 ranks, prefetch credits 4; trainer step ${stepMs.toFixed(2)} ms (784-800-10 forward+backward in this process); ` +
          `loader: ${stats.prefetchHits} prefetch hits, ${stats.prefetchMisses} misses; ratio = batches/s / one trainer's consumption rate`,
      );
      printTable(rows, [
        "phase",
        "batches",
        "batches_per_s",
        "wait_ms_p50",
        "wait_ms_p99",
        "trainer_batches_per_s",
        "ratio",
      ]);
    }
    console.log(JSON.stringify({ bench: "data-loader", results: rows }));
    return rows;
  } finally {
    await bus.close();
    loader.kill("SIGTERM");
    await loader.exited;
  }
}
