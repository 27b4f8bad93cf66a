// `meshtrain plan <job options>`: each rank's memory before anything starts, for the MLP and the
// GPT in every mode (parameter server, all-reduce with ZeRO 0-3 and offload, pipeline stages,
// tensor ranks, recomputation, precision), from the analytic counts of engine/memory-estimate.ts; whether
// that fits the device, and which one option to change when it does not. `meshtrain run` asks
// the same question first and refuses a job that cannot fit, before any process starts.
import { existsSync, readFileSync, statSync } from "node:fs";
import { totalmem } from "node:os";
import { join } from "node:path";
import { readManifest } from "../engine/data/shards.ts";
import { mobyDickPath, readTextFile } from "../engine/data/text.ts";
import {
  formatBytes,
  gptParamCount,
  gptStageActivations,
  mlpActivations,
  type RankMemory,
  rankMemory,
  shardMemory,
} from "../engine/memory-estimate.ts";
import type { Precision } from "../engine/mixed.ts";
import { type GptConfig, gptParamSpecs } from "../engine/models/gpt.ts";
import { probeCuda } from "../ffi/cuda/driver.ts";
import { ConfigError } from "../ffi/errors.ts";
import { dataRanks, type JobConfig, parseJobConfig, usesShards } from "../services/runtime/job/config.ts";

/** What the trainers compute on, and how much memory each has. */
export interface PlanDevice {
  kind: "cpu" | "cuda";
  /** bytes one trainer may use: a GPU's memory, or on the CPU the machine's (shared by every process) */
  bytes: number;
  /** where that number came from */
  source: string;
}

export interface RankPlan extends RankMemory {
  /** "trainer 0", "trainers 0-3", "stage 1 (trainers 2-3)" */
  who: string;
  ranks: number;
}

export interface JobPlan {
  trainers: RankPlan[];
  /** parameter-server shards: host memory each */
  shards: { count: number; bytes: number } | null;
  /** bytes the worst trainer holds on its device */
  worstDevice: number;
  /** every process of the job together (what one CPU machine running the local mesh holds) */
  allProcesses: number;
  fits: boolean;
  device: PlanDevice;
  lines: string[];
}

/** The device a plan checks against: --device-memory, else the probed GPU, else this machine's memory. */
export function planDevice(kind: "cpu" | "cuda" | "auto", deviceMemory: number | null): PlanDevice {
  const probe = kind === "cpu" ? null : probeCuda();
  const gpu = probe?.ok === true;
  if (kind === "cuda" && !gpu && deviceMemory === null) {
    throw new ConfigError(
      `--device cuda: ${probe?.reason ?? "no GPU"}; pass --device-memory to plan for a GPU that is not here`,
    );
  }
  const resolved = kind === "auto" ? (gpu ? "cuda" : "cpu") : kind;
  if (deviceMemory !== null) return { kind: resolved, bytes: deviceMemory, source: "--device-memory" };
  if (resolved === "cuda") return { kind: "cuda", bytes: probe!.totalBytes ?? 0, source: probe!.reason };
  return { kind: "cpu", bytes: totalmem(), source: "this machine's memory, shared by every process of the job" };
}

/** Why `dir` is not a token folder (no such folder, or a split file missing), or null. */
export function tokenFolderProblem(dir: string): string | null {
  if (!existsSync(dir)) return "no such folder";
  if (!statSync(dir).isDirectory()) return "is not a folder";
  const missing = ["train.bin", "val.bin"].filter((f) => !existsSync(join(dir, f)));
  return missing.length === 0
    ? null
    : `has no ${missing.join(" or ")} (a token folder holds train.bin and val.bin of uint16 tokens, or what meshtrain prepare writes)`;
}

/** A GPT job's vocabulary as the data-loader will find it: the text's characters, a token folder's vocab.json or model.vocabSize. */
export function planVocabSize(cfg: JobConfig): number {
  if (cfg.model.kind !== "gpt") return 0;
  // a token folder is checked before anything starts, and before --vocab-size is advised: it
  // would not help a folder without tokens
  const manifest = cfg.dataset === "tokens" ? readManifest(cfg.dataDir) : null;
  if (cfg.dataset === "tokens" && manifest === null) {
    const problem = tokenFolderProblem(cfg.dataDir);
    if (problem !== null) throw new ConfigError(`--tokens ${cfg.dataDir}: ${problem}`);
  }
  if (cfg.model.vocabSize > 0) return cfg.model.vocabSize;
  if (manifest !== null) return manifest.vocabSize;
  if (cfg.dataset === "tokens") {
    const vocab = join(cfg.dataDir, "vocab.json");
    if (!existsSync(vocab)) throw new ConfigError(`${cfg.dataDir} has no vocab.json: pass --vocab-size`);
    const parsed = JSON.parse(readFileSync(vocab, "utf8")) as unknown;
    const size = Array.isArray(parsed)
      ? parsed.length
      : (parsed as { size?: unknown; chars?: unknown[] }).chars?.length;
    if (typeof size !== "number" || size <= 0) throw new ConfigError(`${vocab} names no vocabulary size`);
    return size;
  }
  return new Set(readTextFile(cfg.dataDir || mobyDickPath())).size;
}

const optimizerBytesPerParam = (cfg: JobConfig): number =>
  (cfg.optimizer.kind === "adamw" ? 8 : cfg.optimizer.momentum > 0 ? 4 : 0) +
  (cfg.compress.startsWith("topk") && cfg.optimizer.kind === "adamw" ? 4 : 0);

/** Every trainer's memory, grouped where ranks hold the same (the data-parallel copies of a stage and tensor rank). */
function trainerPlans(cfg: JobConfig, V: number): RankPlan[] {
  const mode = usesShards(cfg) ? "ps" : "allreduce";
  const D = dataRanks(cfg);
  const S = cfg.pipelineStages,
    R = cfg.tensorParallel;
  const microBatch = cfg.batchSize / cfg.accumSteps;
  const precision = cfg.precision as Precision;
  const base = {
    optimizerBytesPerParam: optimizerBytesPerParam(cfg),
    mode,
    dataRanks: D,
    zero: cfg.zero,
    offload: cfg.offload === "optimizer",
    compressed: cfg.compress !== "none",
    // under autocast the GEMMs read a 2-byte copy of the parameters, cast once a step
    weightCopyBytesPerParam: precision === "bf16" || precision === "f16" ? 2 : 0,
  } as const;
  const m = cfg.model;
  if (m.kind === "mlp") {
    const act = mlpActivations(m.widths, microBatch);
    const r = rankMemory({ ...base, paramCount: paramCountOf(cfg.model, V), activations: act.peak, gatheredBytes: 0 });
    return [{ ...r, who: D === 1 ? "trainer 0" : `trainers 0-${D - 1}`, ranks: D }];
  }
  const config = gptConfigOf(m, V);
  const out: RankPlan[] = [];
  for (let s = 0; s < S; s++) {
    const part = { stage: s, stages: S, ...(R > 1 ? { tensor: { rank: 0, size: R } } : {}) };
    const P = gptParamSpecs(config, part).reduce((n, p) => n + p.shape.reduce((a, b) => a * b, 1), 0);
    const { peak: activations } = gptStageActivations(config, {
      batch: microBatch,
      precision,
      recompute: cfg.recompute,
      optimizer: cfg.optimizer.kind === "adamw" ? "adamw" : "sgd",
      tensor: R,
      stage: s,
      stages: S,
      microBatches: S > 1 ? cfg.accumSteps : 1,
      schedule: cfg.pipeSchedule,
    });
    // stage 3 gathers a block and prefetches the next, beside the tied embedding
    const C = m.nEmbd;
    const gatheredBytes = 4 * (2 * (12 * C * C + 13 * C) + V * C);
    const r = rankMemory({ ...base, paramCount: P, activations, gatheredBytes });
    const ranks = D * R;
    const who =
      S === 1
        ? ranks === 1
          ? "trainer 0"
          : `trainers (${ranks})`
        : `stage ${s} (${ranks} trainer${ranks > 1 ? "s" : ""})`;
    out.push({ ...r, who, ranks });
  }
  return out;
}

/** Which one option would make a job fit, tried in the order a user would (cheapest first). */
const remedies: {
  flag: string;
  applies: (c: JobConfig) => boolean;
  change: (c: JobConfig) => Partial<JobConfig> | null;
}[] = [
  { flag: "--recompute", applies: (c) => c.model.kind === "gpt" && !c.recompute, change: () => ({ recompute: true }) },
  {
    flag: "--precision bf16",
    applies: (c) => c.precision === "f32" || c.precision === "tf32",
    change: () => ({ precision: "bf16" }),
  },
  {
    flag: "--zero 1",
    applies: (c) => c.sync === "allreduce" && c.zero < 1 && dataRanks(c) > 1,
    change: () => ({ zero: 1 }),
  },
  {
    flag: "--zero 2",
    applies: (c) => c.sync === "allreduce" && c.zero < 2 && dataRanks(c) > 1,
    change: () => ({ zero: 2 }),
  },
  {
    flag: "--zero 3",
    applies: (c) => c.sync === "allreduce" && c.zero < 3 && dataRanks(c) > 1,
    change: () => ({ zero: 3 }),
  },
  {
    flag: "--offload optimizer",
    applies: (c) => c.sync === "allreduce" && c.offload === "none",
    change: () => ({ offload: "optimizer" }),
  },
  {
    flag: "--accum",
    applies: (c) => c.batchSize / c.accumSteps >= 2 && c.batchSize % (2 * c.accumSteps) === 0,
    change: (c) => ({ accumSteps: 2 * c.accumSteps }),
  },
];

/** A job's whole model's parameters, with a vocabulary of V (a GPT). */
export function paramCountOf(m: JobConfig["model"], V: number): number {
  if (m.kind === "mlp") return m.widths.slice(1).reduce((n, w, i) => n + (m.widths[i]! + 1) * w, 0);
  return gptParamCount(gptConfigOf(m, V));
}

/** The engine's GptConfig of a job's GPT model with a vocabulary of V. */
function gptConfigOf(m: Extract<JobConfig["model"], { kind: "gpt" }>, V: number): GptConfig {
  const { blockSize, nLayer, nHead, nEmbd, dropout } = m;
  return { vocabSize: V, blockSize, nLayer, nHead, nEmbd, dropout };
}

export function planJob(cfg: JobConfig, device: PlanDevice, V = planVocabSize(cfg)): JobPlan {
  const trainers = trainerPlans(cfg, V);
  const shards = usesShards(cfg)
    ? { count: cfg.shards, bytes: shardMemory(paramCountOf(cfg.model, V), cfg.shards, optimizerBytesPerParam(cfg)) }
    : null;
  const worstDevice = Math.max(...trainers.map((t) => t.device + (device.kind === "cpu" ? t.host : 0)));
  const allProcesses =
    trainers.reduce((n, t) => n + t.ranks * (t.device + t.host), 0) +
    (shards === null ? 0 : shards.count * shards.bytes);
  const fits = device.kind === "cuda" ? worstDevice <= device.bytes : allProcesses <= device.bytes;
  const plan: JobPlan = { trainers, shards, worstDevice, allProcesses, fits, device, lines: [] };
  plan.lines = planLines(cfg, plan, V);
  return plan;
}

/** The first single change that makes the job fit, with the worst rank's bytes after it. */
export function suggestion(cfg: JobConfig, device: PlanDevice, V: number): { flag: string; bytes: number } | null {
  for (const r of remedies) {
    if (!r.applies(cfg)) continue;
    const change = r.change(cfg);
    if (change === null) continue;
    let next: JobConfig;
    try {
      next = parseJobConfig({ ...cfg, ...change });
    } catch {
      continue;
    }
    const p = planJob(next, device, V);
    if (p.fits)
      return {
        flag: r.flag === "--accum" ? `--accum ${next.accumSteps}` : r.flag,
        bytes: device.kind === "cuda" ? p.worstDevice : p.allProcesses,
      };
  }
  return null;
}

function planLines(cfg: JobConfig, p: JobPlan, V: number): string[] {
  const f = formatBytes;
  const lines: string[] = [];
  const m = cfg.model;
  const shape =
    m.kind === "gpt" ? `gpt L${m.nLayer} H${m.nHead} C${m.nEmbd} T${m.blockSize} V${V}` : `mlp ${m.widths.join("-")}`;
  const modes = [
    usesShards(cfg)
      ? `${cfg.sync} on ${cfg.shards} shard${cfg.shards > 1 ? "s" : ""}`
      : `allreduce, ZeRO ${cfg.zero}${cfg.offload === "optimizer" ? ", optimizer offloaded" : ""}`,
    ...(cfg.pipelineStages > 1
      ? [`${cfg.pipelineStages} pipeline stages (${cfg.pipeSchedule}, ${cfg.accumSteps} micro-batches)`]
      : []),
    ...(cfg.tensorParallel > 1 ? [`tensor parallel over ${cfg.tensorParallel}`] : []),
    cfg.precision,
    ...(cfg.recompute ? ["recompute"] : []),
  ];
  lines.push(
    `plan: ${shape}, ${cfg.trainers} trainer${cfg.trainers > 1 ? "s" : ""}, ${modes.join(", ")}, micro-batch ${cfg.batchSize / cfg.accumSteps}`,
  );
  for (const t of p.trainers) {
    const parts = [
      `parameters ${f(t.parameters)}`,
      `gradients ${f(t.gradients)}`,
      `optimizer ${f(t.optimizer)}`,
      `activations ${f(t.activations)}`,
      ...(t.weightCopies > 0 ? [`weight copies ${f(t.weightCopies)}`] : []),
      ...(t.gathered > 0 ? [`gathered ${f(t.gathered)}`] : []),
    ];
    const host =
      t.host > 0
        ? `; host ${f(t.host)} (${t.hostOptimizer > 0 ? `offloaded optimizer ${f(t.hostOptimizer)}, ` : ""}collective buffers ${f(t.hostBuffers)})`
        : "";
    lines.push(`  ${t.who}: ${parts.join(" + ")} = ${f(t.device)} on the device${host}`);
  }
  if (p.shards !== null)
    lines.push(`  shards: ${f(p.shards.bytes)} each (parameters, optimizer state, the step's summed pushes)`);
  const dev = p.device;
  const against =
    dev.kind === "cuda"
      ? `the most a trainer holds, ${f(p.worstDevice)}, against ${f(dev.bytes)} a GPU (${dev.source})`
      : `every process together, ${f(p.allProcesses)}, against ${f(dev.bytes)} (${dev.source})`;
  lines.push(`${p.fits ? "fits" : "does not fit"}: ${against}`);
  return lines;
}

/** The plan's lines; when the job does not fit, the verdict and the option that would make it
 *  fit (or that none does alone) as one line too. */
export function planReport(
  cfg: JobConfig,
  device: PlanDevice,
  /** the GPT's vocabulary (default: as the job's data will give it) */
  V = planVocabSize(cfg),
): { plan: JobPlan; lines: string[]; refusal: string | null } {
  const plan = planJob(cfg, device, V);
  const lines = [...plan.lines];
  if (plan.fits) return { plan, lines, refusal: null };
  const s = suggestion(cfg, device, V);
  const advice =
    s === null
      ? "no single option makes it fit: a smaller --batch-size, fewer layers, or more trainers with --zero 3, --pipeline-stages or --tensor-parallel"
      : `${s.flag} brings it to ${formatBytes(s.bytes)}, which fits`;
  lines.push(advice);
  // the verdict line without its "does not fit: " (the caller says it)
  const verdict = plan.lines.at(-1)!.replace(/^does not fit: /, "");
  return { plan, lines, refusal: `${verdict}; ${advice}` };
}
