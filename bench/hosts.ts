// `bun run bench hosts`: the mesh across hosts joined by real links (testbed/hosts.ts: network
// namespaces on this machine, each link shaped with tc), against PyTorch DDP (gloo) on the same
// hosts, links and model in the same run. For each link rate it makes a bed of --hosts hosts,
// --per-host trainers on each, and runs an MLP job of --steps steps per setting:
//   - all-reduce, flat (one ring over every rank) and hierarchical (a ring per host, then the
//     hosts' leaders), without compression and with bf16, int8 and top-k;
//   - the parameter server, BSP and SSP (shards on hosts 0 and 1);
//   - ZeRO-2;
//   - DDP: bench/ddp_step.py, one rank per trainer slot, on Debian's python3-torch.
// It prints a table, samples/s and the step split into compute and exposed communication, each
// setting's speed against DDP's and against f32 at the same rate, then one JSON line. Before the
// jobs (--collective on; off: not; only: no jobs) it times the all-reduce alone of as many values as the model has
// parameters, flat and hierarchical, as f32, bf16 and int8, among rank processes on the same
// hosts: what each encoding saves on the links, against its bytes, with no compute to hide or
// bound it (a second table and JSON line). Needs
// root (namespaces). The model is an MLP wide enough that its gradients load the links, or with
// --model gpt a GPT with GPT-2's vocabulary (--gpt L,H,C,T: 6 layers, 6 heads, 384 wide, 128
// tokens, about 30M parameters) on the State of the Union prepared with GPT-2's BPE. --only
// <text> runs the settings whose names contain it; --logs <dir> keeps each setting's service logs.
//
//   bun run bench hosts [--hosts 4] [--per-host 2] [--rates 1000,10000 (Mbit/s)] [--steps 30]
//                       [--batch 64 (MLP), 4 (GPT): per trainer] [--model mlp|gpt] [--widths 784,1024,1024,10]
//                       [--gpt 6,6,384,128] [--collective on|off|only] [--only <text>] [--logs <dir>] [--quiet]
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ConfigError } from "../ffi/errors.ts";
import { MeshClient } from "../sdk/client.ts";
import { watchJob } from "../sdk/watch.ts";
import { defaultOwner, qualifyJob } from "../services/runtime/job/subjects.ts";
import { gptJobDefaults, type JobConfig, jobDefaults, parseJobConfig } from "../services/runtime/job/config.ts";
import { HostBed, testBedProblem } from "../testbed/hosts.ts";
import { HostMesh, hostLabel } from "../testbed/mesh.ts";
import { busTransportDefaults } from "../services/runtime/transport/collective-bus.ts";
import { type RankOp, type RankPlan, type RankResult, runRankProcesses } from "./collective-rank.ts";
import { prepareDefaults, runPrepare } from "../sdk/local/prepare.ts";
import { paramCountOf } from "../sdk/plan.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { torchPython } from "./engine-config.ts";
import { median, printReport, round } from "./table.ts";

interface Row {
  rate: string;
  setting: string;
  samples_per_s: number;
  step_ms: number;
  compute_ms: number;
  exposed_comm_ms: number;
  mb_per_step: number;
  vs_ddp: number | string;
  vs_f32: number | string;
}

interface Setting {
  name: string;
  cfg: Partial<JobConfig>;
  /** every trainer labelled one host: the all-reduce is one flat ring */
  flat?: boolean;
}

const settings: Setting[] = [
  { name: "all-reduce flat", cfg: { sync: "allreduce" }, flat: true },
  { name: "all-reduce hierarchical", cfg: { sync: "allreduce" } },
  { name: "hierarchical bf16", cfg: { sync: "allreduce", compress: "bf16" } },
  { name: "hierarchical int8", cfg: { sync: "allreduce", compress: "int8" } },
  // 1% from the first step: over a warm-up top-k's first steps go nearly dense, 8 bytes a value
  // from each of 8 ranks all-gathered (16x a bucket), more than 8 GPT trainers leave of 24 GB
  { name: "hierarchical top-k 1%", cfg: { sync: "allreduce", compress: "topk:0.01", warmupSteps: 0 } },
  { name: "ZeRO-2", cfg: { sync: "allreduce", zero: 2 } },
  { name: "parameter server BSP", cfg: { sync: "bsp" } },
  { name: "parameter server SSP", cfg: { sync: "ssp", staleness: 4 } },
];

export async function runHostsBench(argv: string[]): Promise<void> {
  const a = parseBenchArgs(argv, {
    hosts: { type: "string", default: "4" },
    "per-host": { type: "string", default: "2" },
    rates: { type: "string", default: "1000,10000" },
    steps: { type: "string", default: "30" },
    batch: { type: "string", default: "" },
    model: { type: "string", default: "mlp" },
    widths: { type: "string", default: "784,1024,1024,10" },
    gpt: { type: "string", default: "6,6,384,128" },
    only: { type: "string", default: "" },
    // keep each setting's service logs (else they go with the run's temporary folder)
    logs: { type: "string", default: "" },
    // the all-reduce alone of the model's gradients, no training: what the links cost
    collective: { type: "string", default: "on" },
    quiet: { type: "boolean", default: false },
  });
  if (!["on", "off", "only"].includes(String(a.collective)))
    throw new ConfigError(`--collective is on, off or only (no jobs), not ${a.collective}`);
  const problem = testBedProblem();
  if (problem !== null) throw new ConfigError(`the hosts bench makes network namespaces: ${problem}`);
  const hosts = positiveInt("hosts", a.hosts);
  if (hosts < 2) throw new ConfigError(`--hosts must be at least 2 (the links are what is measured), got ${hosts}`);
  const perHost = positiveInt("per-host", a["per-host"]);
  const steps = positiveInt("steps", a.steps);
  if (a.model !== "mlp" && a.model !== "gpt") throw new ConfigError(`--model is mlp or gpt, not ${a.model}`);
  const batch = positiveInt("batch", a.batch === "" ? (a.model === "gpt" ? "4" : "64") : a.batch);
  const rates = String(a.rates)
    .split(",")
    .map((r) => positiveInt("rates", r));
  const widths = String(a.widths)
    .split(",")
    .map((w) => positiveInt("widths", w));
  if (widths[0] !== 784 || widths.at(-1) !== 10)
    throw new ConfigError(`--widths must start with 784 and end with 10 (MNIST), got ${a.widths}`);
  const shape = String(a.gpt)
    .split(",")
    .map((v) => positiveInt("gpt", v));
  if (shape.length !== 4 || shape[2]! % shape[1]! !== 0)
    throw new ConfigError(`--gpt is L,H,C,T (layers, heads, width, context; C a multiple of H), got ${a.gpt}`);
  const [nLayer, nHead, nEmbd, blockSize] = shape as [number, number, number, number];
  // the GPT trains on real GPT-2 tokens: the State of the Union, prepared once for the run
  const tokens = a.model === "gpt" ? mkdtempSync(join(tmpdir(), "mt-bench-hosts-")) : "";
  if (tokens !== "") {
    const sotu = join(import.meta.dir, "..", "node_modules", "@stdlib", "datasets-sotu", "data");
    await runPrepare({ ...prepareDefaults, text: sotu, out: tokens, quiet: true });
  }
  const model: ModelChoice =
    tokens === ""
      ? { kind: "mlp", widths, what: `MLP ${widths.join("-")}` }
      : {
          kind: "gpt",
          shape: { nLayer, nHead, nEmbd, blockSize },
          tokens,
          what: `GPT L${nLayer} H${nHead} C${nEmbd} T${blockSize} V${gpt2Vocab} (GPT-2's vocabulary)`,
        };
  try {
    await benchRates(
      {
        only: String(a.only),
        quiet: a.quiet === true,
        collective: a.collective as "on" | "off" | "only",
        logs: String(a.logs),
      },
      model,
      {
        hosts,
        perHost,
        steps,
        batch,
        rates,
      },
    );
  } finally {
    if (tokens !== "") rmSync(tokens, { recursive: true, force: true });
  }
}

/** GPT-2's vocabulary, as `prepare` writes it (the model's is padded from the data's vocab.json). */
const gpt2Vocab = 50257;

type ModelChoice =
  | { kind: "mlp"; widths: number[]; what: string }
  | {
      kind: "gpt";
      shape: { nLayer: number; nHead: number; nEmbd: number; blockSize: number };
      tokens: string;
      what: string;
    };

async function benchRates(
  a: { only: string; quiet: boolean; collective: "on" | "off" | "only"; logs: string },
  model: ModelChoice,
  o: { hosts: number; perHost: number; steps: number; batch: number; rates: number[] },
): Promise<void> {
  const { hosts, perHost, steps, batch, rates } = o;
  const picked =
    a.collective === "only" ? [] : a.only === "" ? settings : settings.filter((s) => s.name.includes(String(a.only)));
  const trainers = hosts * perHost;
  const rows: Row[] = [];
  const collRows: CollRow[] = [];
  // as many values as the model's gradients
  const values = paramCountOf(jobModel(model), gpt2Vocab);
  for (const rate of rates) {
    const rateText = rate >= 1000 ? `${rate / 1000} Gbit/s` : `${rate} Mbit/s`;
    await using bed = await HostBed.create({ hosts, rateMbit: rate });
    if (a.collective !== "off") {
      for (const r of await runCollectives(bed, { hosts, perHost, values, rounds: 3 })) {
        collRows.push({ rate: rateText, ...r });
        if (!a.quiet) console.log(`${rateText} all-reduce ${r.all_reduce}: ${r.ms} ms`);
      }
    }
    if (a.collective === "only") continue;
    const ddp = await runDdp(bed, { perHost, steps, batch, model });
    const measured: Row[] = [];
    for (const s of picked) {
      try {
        const logDir =
          a.logs === "" ? undefined : join(a.logs, `${rateText}-${s.name}`.replace(/[^A-Za-z0-9.-]+/g, "-"));
        if (logDir !== undefined && !a.quiet) console.log(`${rateText} ${s.name}: logs in ${logDir}`);
        const r = await runSetting(bed, s, { hosts, perHost, trainers, steps, batch, model, logDir });
        measured.push({ rate: rateText, setting: s.name, ...r, vs_ddp: 0, vs_f32: "" });
        if (!a.quiet) console.log(`${rateText} ${s.name}: ${r.samples_per_s} samples/s`);
      } catch (e) {
        // one setting that fails (its job failed) is a row saying why; the others still run
        const why = (e as Error).message.split("\n")[0]!.slice(0, 160);
        if (!a.quiet) console.log(`${rateText} ${s.name}: failed: ${why}`);
        measured.push({ ...emptyRow(rateText, s.name), vs_f32: `failed: ${why}` });
      }
    }
    const f32 = measured.find((m) => m.setting === "all-reduce hierarchical")?.samples_per_s;
    for (const m of measured) {
      if (Number.isNaN(m.samples_per_s)) continue;
      m.vs_ddp = ddp === null ? "no DDP" : round(m.samples_per_s / ddp.samples_per_s, 2);
      m.vs_f32 = m.setting.startsWith("hierarchical ") && f32 ? round(m.samples_per_s / f32, 2) : "";
    }
    rows.push(
      ...measured,
      ddp === null
        ? {
            ...emptyRow(rateText, "PyTorch DDP (gloo)"),
            vs_ddp: "python3 has no torch (apt-get install -y python3-torch)",
          }
        : { rate: rateText, setting: "PyTorch DDP (gloo)", ...ddp, mb_per_step: Number.NaN, vs_ddp: 1, vs_f32: "" },
    );
  }
  if (rows.length > 0)
    printReport({
      bench: "hosts",
      header: `the mesh on ${hosts} hosts x ${perHost} trainer${perHost === 1 ? "" : "s"} (network namespaces, tc-shaped links), ${model.what}, batch ${batch} per trainer, ${steps} steps; PyTorch DDP on the same hosts and links`,
      rows,
      columns: [
        "rate",
        "setting",
        "samples_per_s",
        "step_ms",
        "compute_ms",
        "exposed_comm_ms",
        "mb_per_step",
        "vs_ddp",
        "vs_f32",
      ],
      quiet: a.quiet,
    });
  if (collRows.length > 0)
    printReport({
      bench: "hosts-collective",
      header: `the all-reduce alone of ${values.toLocaleString("en-US")} f32 values (the model's gradients) among the same ${hosts} x ${perHost} ranks, median of 3: its speed-up over f32 on the same ring, against the bytes it saves`,
      rows: collRows,
      columns: ["rate", "all_reduce", "ms", "codec_ms", "mb_between_hosts", "vs_f32", "bytes_saved"],
      quiet: a.quiet,
    });
}

interface CollRow {
  rate: string;
  /** the ring (flat or hierarchical) and the encoding */
  all_reduce: string;
  ms: number;
  /** ms a rank spent encoding and decoding, on average */
  codec_ms: number;
  /** bytes of pieces a rank sent to other hosts, on average */
  mb_between_hosts: number;
  /** f32's time on the same ring over this one's */
  vs_f32: number | string;
  /** f32's bytes on the same ring over this one's */
  bytes_saved: number | string;
}

/** The job's model of a bench's choice. */
function jobModel(m: ModelChoice): JobConfig["model"] {
  return m.kind === "mlp"
    ? { kind: "mlp", widths: m.widths, dropout: 0 }
    : { kind: "gpt", ...m.shape, dropout: 0, vocabSize: 0 };
}

/**
 * The all-reduce of `values` f32 among the bed's ranks (bench/collective-rank.ts, one process per
 * rank on its host, over a NATS cluster on the first three hosts), flat and hierarchical, as f32,
 * bf16 and int8 (encoded round the ring): what the links cost without the compute around them.
 */
async function runCollectives(
  bed: HostBed,
  o: { hosts: number; perHost: number; values: number; rounds: number },
): Promise<Omit<CollRow, "rate">[]> {
  const all = Array.from({ length: o.hosts }, (_, i) => i);
  await using mesh = await HostMesh.start(bed, {
    natsHosts: all.slice(0, Math.min(3, o.hosts)),
    serviceHost: 0,
    shardHosts: [],
    trainerHosts: [],
    trainersPerHost: o.perHost,
    services: false,
  });
  const world = o.hosts * o.perHost;
  const hostOf = (rank: number) => Math.floor(rank / o.perHost);
  const encodings = [undefined, "bf16", "int8"] as const;
  const dir = mkdtempSync(join(tmpdir(), "mt-bench-hosts-coll-"));
  const rows: Omit<CollRow, "rate">[] = [];
  try {
    for (const ring of ["flat", "hierarchical"] as const) {
      const labels = Array.from({ length: world }, (_, r) => hostLabel(ring === "flat" ? 0 : hostOf(r)));
      const ops: RankOp[] = encodings.flatMap((compress, c) =>
        Array.from({ length: o.rounds }, (_, k) => ({
          op: "allReduce" as const,
          len: o.values,
          seed: 1,
          step: k,
          bucket: c,
          check: false,
          ...(compress === undefined ? {} : { compress }),
        })),
      );
      const plans: RankPlan[] = Array.from({ length: world }, (_, rank) => ({
        url: mesh.homeUrls(hostOf(rank)),
        job: `hosts-coll-${ring}`,
        rank,
        hosts: labels,
        pieceBytes: busTransportDefaults.pieceBytesMax,
        windowPieces: busTransportDefaults.windowPieces,
        progressTimeoutMs: 120_000,
        peerLostMs: 120_000,
        // as a job's ranks (--coll-transport auto): ranks of one host share memory, and the
        // hosts' ranks send straight over TCP
        sharedMemory: true,
        netAddress: bed.address(hostOf(rank)),
        ops,
      }));
      const run = await runRankProcesses(dir, plans, { OMP_NUM_THREADS: "1" }, (rank, argv, options) =>
        bed.spawn(hostOf(rank), argv, options),
      );
      const failed = run.results.flat().find((r) => r.error !== undefined);
      if (failed !== undefined || run.codes.some((c) => c !== 0) || run.results.some((r) => r.length !== ops.length))
        throw new Error(
          `the ${ring} all-reduce across hosts failed: ${
            failed?.error?.message ??
            run.stderr
              .find((e) => e.trim() !== "")
              ?.trim()
              .split("\n")
              .slice(-3)
              .join(" | ") ??
            "a rank ended early"
          }`,
        );
      const f32 = { ms: 0, bytes: 0 };
      encodings.forEach((compress, c) => {
        // an operation takes as long as its slowest rank; the median round
        const rounds = Array.from({ length: o.rounds }, (_, k) => c * o.rounds + k);
        const ms = median(rounds.map((i) => Math.max(...run.results.map((rs) => rs[i]!.ms))));
        const mean = (f: (r: RankResult) => number) =>
          median(rounds.map((i) => run.results.reduce((n, rs) => n + f(rs[i]!), 0) / world));
        // what left each host: the pieces through NATS (ranks of one host share memory)
        const bytes = mean((r) => r.inlineBytes);
        if (compress === undefined) Object.assign(f32, { ms, bytes });
        rows.push({
          all_reduce: `${ring} ${compress ?? "f32"}`,
          ms: round(ms, 0),
          codec_ms: round(
            mean((r) => r.codecMs),
            0,
          ),
          mb_between_hosts: round(bytes / 1e6, 2),
          vs_f32: compress === undefined ? "" : round(f32.ms / ms, 2),
          bytes_saved: compress === undefined ? "" : round(f32.bytes / bytes, 2),
        });
      });
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  return rows;
}

const emptyRow = (rate: string, setting: string): Row => ({
  rate,
  setting,
  samples_per_s: Number.NaN,
  step_ms: Number.NaN,
  compute_ms: Number.NaN,
  exposed_comm_ms: Number.NaN,
  mb_per_step: Number.NaN,
  vs_ddp: "",
  vs_f32: "",
});

async function runSetting(
  bed: HostBed,
  s: Setting,
  o: {
    hosts: number;
    perHost: number;
    trainers: number;
    steps: number;
    batch: number;
    model: ModelChoice;
    logDir?: string;
  },
): Promise<Omit<Row, "rate" | "setting" | "vs_ddp" | "vs_f32">> {
  const all = Array.from({ length: o.hosts }, (_, i) => i);
  await using mesh = await HostMesh.start(bed, {
    natsHosts: all.slice(0, Math.min(3, o.hosts)),
    serviceHost: 0,
    shardHosts: all.slice(0, Math.min(2, o.hosts)),
    trainerHosts: all,
    trainersPerHost: o.perHost,
    labels: s.flat ? "one" : "host",
    ...(o.logDir === undefined ? {} : { logDir: o.logDir }),
  });
  await using client = await MeshClient.connect(mesh.urls(0), { connectRetryMsMax: 30_000 });
  await mesh.untilUp(client, 120_000);
  const m = o.model;
  const cfg = parseJobConfig({
    ...(m.kind === "mlp"
      ? { ...jobDefaults, model: jobModel(m), lr: 0.01 }
      : {
          ...gptJobDefaults,
          model: jobModel(m),
          dataset: "tokens",
          dataDir: m.tokens,
          valFraction: 0,
          lr: 3e-4,
          minLr: 3e-5,
          // one batch of the validation split at the end: the bench times the steps
          evalBatches: 1,
        }),
    job: qualifyJob(`hosts-${s.name.replace(/[^a-z0-9]+/gi, "-")}`, defaultOwner),
    trainers: o.trainers,
    shards: 2,
    batchSize: o.batch,
    epochs: 1,
    maxSteps: o.steps,
    warmupSteps: 5,
    // the same for every setting, and stable also under SSP's stale gradients
    gradClip: 1,
    checkpointEvery: 0,
    ...s.cfg,
  });
  await client.submit(cfg, { membersWaitMs: 120_000 });
  const r = await watchJob(client, cfg.job, { quiet: true });
  const t = r.split;
  // all-reduce: the collective's exposed wait; parameter server: the pull (it waits for the others' pushes)
  const exposed = t.commMs > 0 ? t.exposedCommMs : t.pullMs + t.pushMs;
  const stepMs = (o.batch * o.trainers * 1000) / Math.max(r.samplesPerS, 1e-9);
  return {
    samples_per_s: sig(r.samplesPerS),
    step_ms: round(stepMs, 1),
    compute_ms: round(t.computeMs, 1),
    exposed_comm_ms: round(exposed, 1),
    mb_per_step: round(r.wireBytesPerStep / 1e6, 2),
  };
}

/** samples/s to 3 significant figures at most (a GPT's few samples/s keep their decimals). */
const sig = (x: number): number => round(x, Math.max(0, 2 - Math.floor(Math.log10(Math.max(x, 1e-9)))));

/** How long DDP's ranks may take in all. */
const ddpTimeoutMs = 600_000;

/** PyTorch DDP over the same hosts: perHost ranks on each, rank 0's host the master. */
async function runDdp(
  bed: HostBed,
  o: { perHost: number; steps: number; batch: number; model: ModelChoice },
): Promise<{ samples_per_s: number; step_ms: number; compute_ms: number; exposed_comm_ms: number } | null> {
  const python = torchPython();
  if (Bun.spawnSync([python, "-c", "import torch.distributed"], { stderr: "ignore" }).exitCode !== 0) return null;
  const world = bed.hosts.length * o.perHost;
  const master = `${bed.address(0)}:29500`;
  const script = join(import.meta.dir, "ddp_step.py");
  const procs = bed.hosts.flatMap((h) =>
    Array.from({ length: o.perHost }, (_, k) => {
      const rank = h.index * o.perHost + k;
      const argv = [python, script, "--rank", String(rank), "--world", String(world), "--master", master];
      const m = o.model;
      argv.push("--batch", String(o.batch), "--steps", String(o.steps));
      if (m.kind === "mlp") argv.push("--widths", m.widths.join(","));
      else {
        const { nLayer, nHead, nEmbd, blockSize } = m.shape;
        argv.push("--gpt", [nLayer, nHead, nEmbd, blockSize, gpt2Vocab].join(","), "--warmup", "1");
      }
      // gloo finds its address from the host name (127.0.0.1 here): the host's own interface
      const env = { ...process.env, OMP_NUM_THREADS: "1", GLOO_SOCKET_IFNAME: h.inner };
      return bed.spawn(h.index, argv, { stdout: "pipe", stderr: "pipe", env });
    }),
  );
  const killAll = () => {
    for (const p of procs) p.kill("SIGKILL");
  };
  const timer = setTimeout(killAll, ddpTimeoutMs);
  // a rank that fails leaves the others waiting for it: they go too
  for (const p of procs) void p.exited.then((code) => code !== 0 && killAll());
  const outs = await Promise.all(
    procs.map(async (p) => [
      await new Response(p.stdout as ReadableStream<Uint8Array>).text(),
      await new Response(p.stderr as ReadableStream<Uint8Array>).text(),
    ]),
  );
  await Promise.all(procs.map((p) => p.exited));
  clearTimeout(timer);
  if (procs.some((p) => p.exitCode !== 0)) {
    // the rank that failed on its own, not one killed for it
    const first = Math.max(
      0,
      procs.findIndex((p) => p.exitCode !== 0 && p.signalCode === null),
    );
    throw new Error(`DDP rank ${first} failed: ${outs[first]![1]!.trim().split("\n").slice(-3).join(" | ")}`);
  }

  const r = JSON.parse(outs[0]![0]!.trim().split("\n").at(-1)!) as Record<string, number>;
  return {
    samples_per_s: sig(r.samples_per_s!),
    step_ms: round(r.step_ms!, 1),
    compute_ms: round(r.compute_ms!, 1),
    exposed_comm_ms: round(r.exposed_comm_ms!, 1),
  };
}
