// Trainer benchmark: end-to-end samples/s of a training job on the local mesh (2 trainers,
// loader, checkpoint, and 2 shards in parameter-server mode; all on this machine, each trainer
// limited to its share of the cores) against the single-process trainer on the same model and
// global batch in the same run, with the mesh step's time split: data wait, pull, compute,
// push, and in all-reduce mode the all-reduce's time and the part of it the step waited for
// (exposed), also as a share of the step.
//
//   bun run bench trainer [--epochs 1] [--sync bsp,allreduce] [--bucket-mb 25] [--json-only]
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { ImageBatcher } from "../engine/data/images.ts";
import { loadMnist } from "../engine/data/mnist.ts";
import { Sgd } from "../engine/optim/sgd.ts";
import { Context } from "../engine/tensor.ts";
import { TrainStep } from "../engine/train.ts";
import { ConfigError } from "../engine/errors.ts";
import { totalSteps as jobTotalSteps } from "../services/data-loader/sampler.ts";
import { type JobConfig, jobDefaults, parseJobConfig, usesShards } from "../services/runtime/job.ts";
import { buildModel } from "../services/runtime/model.ts";
import { MeshClient } from "../sdk/client.ts";
import { LocalMesh } from "../sdk/launcher.ts";
import { watchJob } from "../sdk/watch.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { printTable, round } from "./table.ts";

export interface TrainerBenchResult {
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
}

const benchSyncs = ["bsp", "asp", "ssp", "allreduce"] as const;

export async function runTrainerBench(argv: string[]): Promise<TrainerBenchResult[]> {
  const v = parseBenchArgs(argv, {
    epochs: { type: "string", default: "1" }, sync: { type: "string", default: "bsp,allreduce" }, "bucket-mb": { type: "string", default: String(jobDefaults.bucketMb) },
    "json-only": { type: "boolean", default: false },
  });
  const syncs = String(v.sync).split(",");
  for (const x of syncs) if (!(benchSyncs as readonly string[]).includes(x)) throw new ConfigError(`--sync must be a list of ${benchSyncs.join(", ")}, got ${String(v.sync)}`);
  const bucketMb = Number(v["bucket-mb"]);
  if (!(bucketMb > 0 && bucketMb <= 1024)) throw new ConfigError(`--bucket-mb must be a number in (0, 1024], got ${String(v["bucket-mb"])}`);
  const base = parseJobConfig({ ...jobDefaults, job: "bench-trainer", epochs: positiveInt("epochs", v.epochs), checkpointEvery: 0 });
  const steps = jobTotalSteps(base);
  const meshRuns: { cfg: JobConfig; r: Awaited<ReturnType<typeof watchJob>> }[] = [];
  for (const sync of syncs) {
    const cfg = parseJobConfig({ ...base, job: `bench-trainer-${sync}-${Date.now()}`, sync, staleness: sync === "ssp" ? 2 : 0, bucketMb });
    const dir = mkdtempSync(join(tmpdir(), "mt-bench-trainer-"));
    try {
      await using m = await LocalMesh.start({ jobsDir: join(dir, "jobs"), logDir: join(dir, "logs"), trainers: cfg.trainers, shards: usesShards(cfg) ? cfg.shards : 0 });
      await using client = await MeshClient.connect(m.url);
      await client.submit(cfg, { membersWaitMs: 60_000 });
      meshRuns.push({ cfg, r: await watchJob(client, cfg.job, { quiet: true }) });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
  const cfg = base;
  // single process, same model, global batch and number of steps
  const data = loadMnist();
  const ctx = new Context(new CpuBackend(), { seed: cfg.seed });
  const model = buildModel(ctx, cfg);
  const o = cfg.optimizer.kind === "sgd" ? cfg.optimizer : { momentum: 0.9, nesterov: true, weightDecay: 0 };
  const trainer = new TrainStep(ctx, model, new Sgd(ctx, model.store, { momentum: o.momentum, dampening: 0, nesterov: o.nesterov, weightDecay: o.weightDecay }),
    { lr: cfg.lr, schedule: { kind: "constant" }, gradClip: 0, accumSteps: 1 });
  const batcher = new ImageBatcher(data.train, cfg.batchSize * cfg.trainers);
  const t0 = performance.now();
  let done = 0;
  for (let epoch = 0; done < steps; epoch++) {
    for (const b of batcher.epoch(cfg.seed, epoch, true, true)) {
      trainer.run([b]);
      if (++done >= steps) break;
    }
  }
  const singleRate = (done * cfg.batchSize * cfg.trainers) / ((performance.now() - t0) / 1000);
  ctx.dispose();
  const rows: TrainerBenchResult[] = meshRuns.map(({ cfg: c, r }) => {
    const s = r.split;
    const stepMs = (1000 * c.batchSize * c.trainers) / r.samplesPerS;
    const where = usesShards(c) ? `${c.trainers} trainers x ${c.shards} shards` : `${c.trainers} trainers, ${c.bucketMb} MB buckets`;
    return {
      run: `mesh ${c.sync} ${where}`, steps, samples_per_s: round(r.samplesPerS, 0), data_wait_ms: round(s.dataWaitMs, 2), pull_ms: round(s.pullMs, 2),
      compute_ms: round(s.computeMs, 2), push_ms: round(s.pushMs, 2), comm_ms: round(s.commMs, 2), exposed_ms: round(s.exposedCommMs, 2),
      exposed_share: round(s.exposedCommMs / stepMs, 3), ratio: round(r.samplesPerS / singleRate, 3),
    };
  });
  rows.push({
    run: "single process", steps: done, samples_per_s: round(singleRate, 0), data_wait_ms: 0, pull_ms: 0, compute_ms: round((1000 * cfg.batchSize * cfg.trainers) / singleRate, 2),
    push_ms: 0, comm_ms: 0, exposed_ms: 0, exposed_share: 0, ratio: 1,
  });
  if (!v["json-only"]) {
    console.log(`trainer benchmark: MNIST ${cfg.model.widths.join("-")}, ${cfg.trainers} x ${cfg.batchSize} samples per step, ${steps} steps, all services on this machine (${navigator.hardwareConcurrency} cores); ` +
      `mesh times are per trainer step (ms); ratio = samples/s against the single-process trainer`);
    printTable(rows, ["run", "steps", "samples_per_s", "data_wait_ms", "pull_ms", "compute_ms", "push_ms", "comm_ms", "exposed_ms", "exposed_share", "ratio"]);
  }
  console.log(JSON.stringify({ bench: "trainer", results: rows }));
  return rows;
}
