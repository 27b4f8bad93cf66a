// Trainer benchmark: end-to-end samples/s of a training job on the local mesh (2 trainers,
// 2 shards, loader, checkpoint; all on this machine) against the single-process trainer on the
// same model and global batch in the same run, with the mesh step's time split.
//
//   bun run bench trainer [--epochs 1] [--sync bsp] [--json-only]
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
import { jobDefaults, parseJobConfig } from "../services/runtime/job.ts";
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
  ratio: number;
}

export async function runTrainerBench(argv: string[]): Promise<TrainerBenchResult[]> {
  const v = parseBenchArgs(argv, { epochs: { type: "string", default: "1" }, sync: { type: "string", default: "bsp" }, "json-only": { type: "boolean", default: false } });
  if (!["bsp", "asp", "ssp"].includes(String(v.sync))) throw new ConfigError(`--sync must be bsp, asp or ssp, got ${String(v.sync)}`);
  const cfg = parseJobConfig({ ...jobDefaults, job: `bench-trainer-${Date.now()}`, epochs: positiveInt("epochs", v.epochs), sync: v.sync, staleness: v.sync === "ssp" ? 2 : 0, checkpointEvery: 0 });
  const steps = jobTotalSteps(cfg);
  const dir = mkdtempSync(join(tmpdir(), "mt-bench-trainer-"));
  let mesh: Awaited<ReturnType<typeof watchJob>>;
  try {
    await using m = await LocalMesh.start({ jobsDir: join(dir, "jobs"), logDir: join(dir, "logs"), trainers: cfg.trainers, shards: cfg.shards });
    await using client = await MeshClient.connect(m.url);
    await client.submit(cfg, { membersWaitMs: 60_000 });
    mesh = await watchJob(client, cfg.job, { quiet: true });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
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
  const s = mesh.split;
  const rows: TrainerBenchResult[] = [
    { run: `mesh ${cfg.sync} 2 trainers x 2 shards`, steps, samples_per_s: round(mesh.samplesPerS, 0), data_wait_ms: round(s.dataWaitMs, 2), pull_ms: round(s.pullMs, 2), compute_ms: round(s.computeMs, 2), push_ms: round(s.pushMs, 2), ratio: round(mesh.samplesPerS / singleRate, 3) },
    { run: "single process", steps: done, samples_per_s: round(singleRate, 0), data_wait_ms: 0, pull_ms: 0, compute_ms: round((1000 * cfg.batchSize * cfg.trainers) / singleRate, 2), push_ms: 0, ratio: 1 },
  ];
  if (!v["json-only"]) {
    console.log(`trainer benchmark: MNIST ${cfg.model.widths.join("-")}, ${cfg.trainers} x ${cfg.batchSize} samples per step, ${steps} steps, all services on this machine (${navigator.hardwareConcurrency} cores); ` +
      `mesh times are per trainer step (ms); ratio = samples/s against the single-process trainer`);
    printTable(rows, ["run", "steps", "samples_per_s", "data_wait_ms", "pull_ms", "compute_ms", "push_ms", "ratio"]);
  }
  console.log(JSON.stringify({ bench: "trainer", results: rows }));
  return rows;
}
