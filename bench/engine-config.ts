// `bun run bench engine --config small|nanogpt-char|gpt2-small`: one GPT training step (AdamW,
// clip 1.0) at nanoGPT's shapes, its tokens/s and its memory (the pass's measured peak beside
// the analytic count of engine/memory-estimate.ts, everything the backend holds, the process's peak RSS),
// and PyTorch on the same shape in the same run (bench/torch_step.py): on a CPU Debian's
// PyTorch at the same thread count, attention written out; on a GPU eager with attention written
// out, eager with SDPA, and torch.compile. Ratios are ours / PyTorch's.
//
// --profile adds each op's share of the step, forward, backward and update apart: every backend
// call is timed (on a GPU with a synchronize before and after, so small kernels look slower than
// they run in a stream; the shares are what to read).
import { join } from "node:path";
import type { Backend } from "../ffi/backend.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { CudaBackend } from "../ffi/cuda/backend.ts";
import { ConfigError } from "../ffi/errors.ts";
import { gptMemory } from "../engine/memory-estimate.ts";
import { autocastDType, type Precision } from "../engine/mixed.ts";
import { type GptConfig, GptModel } from "../engine/models/gpt.ts";
import { adamwDefaults } from "../engine/optim/adamw.ts";
import { optimizerOf } from "../engine/optim/choose.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/context.ts";
import { forwardPass, type HostBatch, TrainStep } from "../engine/train.ts";
import { generationLengths, generationRows } from "./generation.ts";
import { median, printTable, round } from "./table.ts";
import {
  bf16PeakFlops,
  gptStepFlops,
  HostIssueMeter,
  interceptCalls,
  opBytes,
  opFlops,
  peakBandwidth,
} from "./step-cost.ts";

/** nanoGPT's shapes: its char config (shakespeare_char: 65 characters) and GPT-2 small. */
export const engineConfigs = {
  small: { nLayer: 4, nHead: 4, nEmbd: 128, blockSize: 64, vocabSize: 83, batch: 32 },
  "nanogpt-char": { nLayer: 6, nHead: 6, nEmbd: 384, blockSize: 256, vocabSize: 65, batch: 64 },
  "gpt2-small": { nLayer: 12, nHead: 12, nEmbd: 768, blockSize: 1024, vocabSize: 50257, batch: 8 },
} as const;
export type EngineConfigName = keyof typeof engineConfigs;
export const engineConfigNames = Object.keys(engineConfigs) as EngineConfigName[];

export interface ConfigBenchRow {
  impl: string;
  config: string;
  batch: number;
  step_ms: number;
  tokens_per_s: number;
  /** the pass's working memory at its peak (ours: the arena), MiB */
  act_peak_mib: number | string;
  /** the analytic count of the same (engine/memory-estimate.ts) */
  act_predicted_mib: number | string;
  /** device memory: the most the backend held (ours: on a GPU the caching allocator's peak, cached
   *  blocks included), torch.cuda.max_memory_allocated (PyTorch) */
  device_mib: number | string;
  /** the process's peak resident memory */
  rss_mib: number | string;
}

const mib = (bytes: number) => round(bytes / 2 ** 20, 1);

/** Every backend call timed under `phase`, while `on`, between synchronizes. */
class Profiler {
  on = false;
  phase = "forward";
  readonly ms = new Map<string, number>();
  /** the bytes the calls must move (opBytes), where an op is measured in bytes */
  readonly bytes = new Map<string, number>();
  readonly backend: Backend;

  constructor(inner: Backend) {
    this.backend = interceptCalls(inner, new Set(["synchronize", "alloc", "free", "dispose"]), (name, call, args) => {
      if (!this.on) return call(...args);
      inner.synchronize();
      const t = performance.now();
      const r = call(...args);
      inner.synchronize();
      const key = `${this.phase}\u0000${name}`;
      this.ms.set(key, (this.ms.get(key) ?? 0) + performance.now() - t);
      const b = opBytes(name, args);
      if (b !== null) this.bytes.set(key, (this.bytes.get(key) ?? 0) + b);
      return r;
    });
  }
}

/** Phases: forward from newPass, backward inside ctx.backward, update (clip, optimizer) after it. */
function trackPhases(ctx: Context, profiler: Profiler): void {
  const newPass = ctx.newPass.bind(ctx);
  const backward = ctx.backward.bind(ctx);
  ctx.newPass = () => {
    profiler.phase = "forward";
    newPass();
  };
  ctx.backward = (loss, dloss) => {
    profiler.phase = "backward";
    backward(loss, dloss);
    profiler.phase = "update";
  };
}

export interface ConfigBenchOptions {
  config: EngineConfigName;
  batch: number;
  steps: number;
  precision: Precision;
  profile: boolean;
  torch: boolean;
  /** PyTorch's modes on a GPU (default all three) */
  torchModes?: readonly TorchMode[];
  quiet: boolean;
}

export const torchModes = ["written", "sdpa", "compile"] as const;
export type TorchMode = (typeof torchModes)[number];

/** A row of --profile's table: an op's time per step in a phase, its share of all of it (%), for
 *  GEMMs and attention the FLOP rate that time gives, for the rest the bytes per second it moved,
 *  and either as a share of the device's peak (dense bf16 FLOP/s, memory bandwidth; % ). */
type ProfileRow = {
  phase: string;
  op: string;
  ms_per_step: number;
  share: number;
  tflops: number | string;
  gb_per_s: number | string;
  peak_pct: number | string;
};

/** The device's peaks, where known: dense bf16 FLOP/s and memory bytes/s. */
function devicePeaks(be: Backend): { flops: number | null; bytes: number | null } {
  if (!(be instanceof CudaBackend)) return { flops: null, bytes: null };
  const m = be.memoryInterface;
  return { flops: bf16PeakFlops(be.deviceName), bytes: peakBandwidth(m.clockKHz, m.busWidthBits) };
}

/** What a step costs: its FLOPs, rate and MFU, and the host's time issuing it. */
interface StepCost {
  tflop: number;
  tflops: number;
  /** against the device's dense bf16 peak; null on a CPU, an unknown GPU, or f32/tf32 */
  mfu: number | null;
  peak_tflops: number | null;
  host_issue_ms: number;
  host_calls: number;
  /** GPU only: forward+backward from an idle GPU against queued behind a hold (launchExposure) */
  launch_exposed?: { ms: number; share_pct: number; forward_backward_ms: number; gpu_only_ms: number };
}

export function runConfigBench(be: Backend, why: string, o: ConfigBenchOptions): object {
  const shape = engineConfigs[o.config];
  const config = { ...shape, dropout: 0 };
  const B = o.batch;
  const T = shape.blockSize;
  // the host's time in each backend call (on for one step of its own), and the profiler's
  // synchronizing proxy only when asked
  const meter = new HostIssueMeter(be);
  const profiler = o.profile ? new Profiler(meter.backend) : null;
  const ctx = new Context(profiler?.backend ?? meter.backend, { seed: 1, precision: o.precision });
  if (profiler !== null) trackPhases(ctx, profiler);
  const { timeStep, forwardBackward } = gptStepTimer(be, ctx, config, B);
  // the first step allocates (the arena's chunks, the optimizer's state); the second runs as all later ones
  for (let i = 0; i < 2; i++) timeStep();
  const stepMs = median(Array.from({ length: o.steps }, timeStep));
  const predicted = gptMemory(config, { batch: B, precision: o.precision, recompute: false, optimizer: "adamw" });
  const ours: ConfigBenchRow = {
    impl: "meshtrain",
    config: o.config,
    batch: B,
    step_ms: round(stepMs, 1),
    tokens_per_s: Math.round((B * T * 1000) / stepMs),
    act_peak_mib: mib(ctx.arena.passPeakBytes),
    act_predicted_mib: mib(predicted.activationsPeak),
    // on a GPU the caching allocator's peak (what the device held at most, cached blocks and
    // library scratch included), against PyTorch's max_memory_allocated: conservative for us
    device_mib: mib(be instanceof CudaBackend ? be.allocatorStats.peakReservedBytes : be.stats.liveBytes),
    rss_mib: mib(process.resourceUsage().maxRSS * 1024),
  };
  const launches = launchesPerStep(be, timeStep);
  meter.on = true;
  const hostStepMs = timeStep();
  meter.on = false;
  const cost = stepCost(be, config, B, o.precision, hostStepMs, meter.read());
  if (be instanceof CudaBackend) {
    const e = launchExposure(be, forwardBackward);
    cost.launch_exposed = {
      ms: round(e.exposedMs, 2),
      share_pct: round((100 * e.exposedMs) / stepMs, 1),
      forward_backward_ms: round(e.wallMs, 2),
      gpu_only_ms: round(e.gpuMs, 2),
    };
  }
  const profile = profiler === null ? [] : profileSteps(profiler, timeStep, o.steps, config, B, devicePeaks(be));
  ctx.dispose();
  const torch = o.torch ? torchRows(be, o, B) : [];
  const rows = [ours, ...torch];
  const generation = generationRows(be, config, { precision: o.precision, torch: o.torch, quiet: o.quiet });
  if (!o.quiet) printConfigReport(be, why, o, rows, profile);
  if (!o.quiet) printStepCost(be, cost, ours.step_ms, launches);
  if (!o.quiet) {
    const { prompt, count } = generationLengths(shape.blockSize);
    console.log(
      `generation: a new token's time after a ${prompt}-token prompt, greedy, batch 1 (median of ${count - 1}; ratio = ours / torch):`,
    );
    printTable(generation, ["impl", "prompt_tokens", "new_tokens", "ms_per_token", "tokens_per_s", "ratio"]);
  }
  return {
    config: o.config,
    ...(launches === null ? {} : { launches_per_step: launches }),
    step_cost: cost,
    shape,
    batch: B,
    precision: o.precision,
    results: rows,
    generation,
    ...(o.profile ? { profile } : {}),
  };
}

/** The GPT of `config` with AdamW (clip 1.0) on one fixed random batch of `B` windows; returns a
 *  function that times one training step of it (ms, between synchronizes of `be`). */
function gptStepTimer(
  be: Backend,
  ctx: Context,
  config: GptConfig,
  B: number,
): { timeStep: () => number; forwardBackward: () => void } {
  const T = config.blockSize;
  const model = new GptModel(ctx, config, 1);
  const trainer = new TrainStep(
    ctx,
    model,
    optimizerOf(ctx, model.store, { kind: "adamw", ...adamwDefaults, weightDecay: 0.1 }),
    {
      lr: 1e-4,
      schedule: { kind: "constant" },
      gradClip: 1,
      accumSteps: 1,
    },
  );
  const rng = new Rng(3);
  const batch: HostBatch = {
    inputs: Int32Array.from({ length: B * T }, () => rng.int(config.vocabSize)),
    inputShape: [B, T],
    targets: Int32Array.from({ length: B * T }, () => rng.int(config.vocabSize)),
    targetShape: [B, T],
  };
  return {
    timeStep: () => {
      be.synchronize();
      const t = performance.now();
      trainer.run([batch]);
      be.synchronize();
      return performance.now() - t;
    },
    // a step's forward and backward alone (no read-back inside: they queue without waiting)
    forwardBackward: () => ctx.backward(forwardPass(ctx, model, batch)),
  };
}

/**
 * What launching costs the step on a GPU: its forward and backward timed from an idle GPU (the
 * host queues while the GPU runs, and the GPU waits wherever the host falls behind), against the
 * GPU's own time for the same work queued behind a hold (CudaBackend.timeQueued: the host has
 * queued it all before the GPU starts, so nothing waits on the host). The difference is the
 * launch cost the step exposes there; the update after (two launches past a read-back) adds
 * at most the host's time issuing them.
 */
export function launchExposure(be: CudaBackend, forwardBackward: () => void, reps = 3) {
  const wall: number[] = [];
  const gpu: number[] = [];
  let host = 0;
  for (let i = 0; i < reps; i++) {
    be.synchronize();
    const t = performance.now();
    forwardBackward();
    be.synchronize();
    const w = performance.now() - t;
    wall.push(w);
    // hold long enough for the host to queue it all (it took at most w above)
    const q = be.timeQueued(Math.max(20, 3 * w), forwardBackward);
    gpu.push(q.gpuMs);
    host = Math.max(host, q.hostMs);
  }
  const [wallMs, gpuMs] = [median(wall), median(gpu)];
  return { wallMs, gpuMs, exposedMs: Math.max(0, wallMs - gpuMs), hostMs: host };
}

/** What one more step queues on a CUDA backend (null on the CPU). */
function launchesPerStep(
  be: Backend,
  timeStep: () => number,
): { kernels: number; gemms: number; cudnn: number } | null {
  if (!(be instanceof CudaBackend)) return null;
  const before = be.launchCounts;
  timeStep();
  const after = be.launchCounts;
  return {
    kernels: after.kernels - before.kernels,
    gemms: after.gemms - before.gemms,
    cudnn: after.cudnn - before.cudnn,
  };
}

/** Up to 5 more steps with every backend call timed: each op's time per step by phase, the largest first. */
function profileSteps(
  profiler: Profiler,
  timeStep: () => number,
  steps: number,
  config: GptConfig,
  B: number,
  peaks: { flops: number | null; bytes: number | null },
): ProfileRow[] {
  profiler.on = true;
  const reps = Math.max(1, Math.min(steps, 5));
  for (let i = 0; i < reps; i++) timeStep();
  profiler.on = false;
  const total = [...profiler.ms.values()].reduce((a, b) => a + b, 0);
  return [...profiler.ms.entries()]
    .map(([key, ms]) => {
      const [phase, op] = key.split("\u0000") as [string, string];
      const perStep = ms / reps;
      const flops = opFlops(config, B, phase, op);
      const bytes = profiler.bytes.get(key);
      // per second: FLOPs (or bytes) per step over the ms per step
      const flopRate = flops === null ? null : flops / (perStep / 1e3);
      const byteRate = bytes === undefined ? null : bytes / reps / (perStep / 1e3);
      const pct = (rate: number | null, peak: number | null) =>
        rate === null || peak === null ? null : round((100 * rate) / peak, 1);
      const peakPct = pct(flopRate, peaks.flops) ?? pct(byteRate, peaks.bytes);
      return {
        phase,
        op,
        ms_per_step: round(perStep, 2),
        share: round((100 * ms) / total, 1),
        tflops: flopRate === null ? "-" : round(flopRate / 1e12, 1),
        gb_per_s: byteRate === null ? "-" : round(byteRate / 1e9, 1),
        peak_pct: peakPct ?? "-",
      };
    })
    .sort((a, b) => b.ms_per_step - a.ms_per_step);
}

/** The step's FLOPs, rate and MFU, and the host's issuing time (from one step through the meter). */
function stepCost(
  be: Backend,
  config: GptConfig,
  B: number,
  precision: Precision,
  stepMs: number,
  host: { ms: number; calls: number },
): StepCost {
  const flops = gptStepFlops(config, B);
  const peak = be instanceof CudaBackend && autocastDType(precision) !== null ? bf16PeakFlops(be.deviceName) : null;
  const rate = flops / (stepMs / 1000);
  return {
    tflop: round(flops / 1e12, 3),
    tflops: round(rate / 1e12, 1),
    mfu: peak === null ? null : round(rate / peak, 3),
    peak_tflops: peak === null ? null : peak / 1e12,
    host_issue_ms: round(host.ms, 2),
    host_calls: host.calls,
  };
}

function printStepCost(
  be: Backend,
  c: StepCost,
  stepMs: number,
  launches: { kernels: number; gemms: number; cudnn: number } | null,
): void {
  const mfu =
    c.mfu === null
      ? ""
      : `, MFU ${round(100 * c.mfu, 1)}% of ${be instanceof CudaBackend ? be.deviceName : "the device"}'s dense bf16 peak (${c.peak_tflops} TFLOP/s)`;
  console.log(`step: ${c.tflop} TFLOP (nanoGPT's count: 6N + 12LHDT per token), ${c.tflops} TFLOP/s${mfu}`);
  if (launches !== null)
    console.log(
      `work queued per step: ${launches.kernels} kernel launches, ${launches.gemms} cuBLAS GEMMs, ${launches.cudnn} cuDNN executions`,
    );
  // on a CPU the calls are the compute itself: nothing to tell apart
  if (be instanceof CudaBackend)
    console.log(
      `host time issuing a step: ${c.host_issue_ms} ms in ${c.host_calls} backend calls (${round((100 * c.host_issue_ms) / stepMs, 1)}% of the ${stepMs} ms step; ` +
        "the GPU runs the queue meanwhile, so this is what launching costs at most)",
    );
  if (c.launch_exposed !== undefined) {
    const e = c.launch_exposed;
    console.log(
      `launch cost exposed: ${e.ms} ms, ${e.share_pct}% of the step (forward+backward ${e.forward_backward_ms} ms from an idle GPU, ` +
        `${e.gpu_only_ms} ms with all of it queued before the GPU starts)`,
    );
  }
}

/** The table of ours (first in `rows`) and PyTorch's, ours against each PyTorch, and --profile's table. */
function printConfigReport(
  be: Backend,
  why: string,
  o: ConfigBenchOptions,
  rows: ConfigBenchRow[],
  profile: ProfileRow[],
): void {
  const [ours, ...torch] = rows as [ConfigBenchRow, ...ConfigBenchRow[]];
  const threads = be instanceof CpuBackend ? `, ${be.threads} threads` : "";
  const c = engineConfigs[o.config];
  console.log(
    `engine benchmark, ${o.config} (L${c.nLayer} H${c.nHead} C${c.nEmbd} T${c.blockSize} V${c.vocabSize}), batch ${o.batch}, ${o.precision}: ${why}${threads}; ` +
      `AdamW, clip 1.0; median of ${o.steps} steps after 2`,
  );
  console.log(`attention: ${be.describeAttention(autocastDType(o.precision) ?? "f32")}`);
  if (be instanceof CudaBackend) console.log(`linear layers: ${be.describeEpilogues()}`);
  printTable(rows, [
    "impl",
    "batch",
    "step_ms",
    "tokens_per_s",
    "act_peak_mib",
    "act_predicted_mib",
    "device_mib",
    "rss_mib",
  ]);
  for (const t of torch) {
    const mem =
      typeof t.device_mib === "number" && be.name !== "cpu"
        ? ` | device memory x${round((ours.device_mib as number) / t.device_mib, 3)}`
        : "";
    const rss =
      typeof t.rss_mib === "number" && be.name === "cpu"
        ? ` | peak RSS x${round((ours.rss_mib as number) / t.rss_mib, 3)}`
        : "";
    console.log(`ours / ${t.impl}: tokens/s x${round(ours.tokens_per_s / t.tokens_per_s, 3)}${mem}${rss}`);
  }
  if (o.profile) {
    console.log(
      `profile (${be.name === "cpu" ? "each call timed" : "each call timed between synchronizes"}): the step's time by phase and backend op`,
    );
    printTable(profile, ["phase", "op", "ms_per_step", "share", "tflops", "gb_per_s", "peak_pct"]);
    const { bytes } = devicePeaks(be);
    if (be instanceof CudaBackend)
      console.log(
        `peak_pct: of the dense bf16 peak for tflops, of the memory bandwidth (${bytes === null ? "unknown here" : `${round(bytes / 1e9, 0)} GB/s, from the driver's memory clock and bus width`}) for gb_per_s`,
      );
  }
}

/** PyTorch on the same shape: one process per mode, so each peak RSS is its own. */
function torchRows(be: Backend, o: ConfigBenchOptions, B: number): ConfigBenchRow[] {
  const gpu = be.name !== "cpu";
  const modes = gpu ? (o.torchModes ?? torchModes) : ["written"];
  const shape = engineConfigs[o.config];
  const threads = be instanceof CpuBackend ? be.threads : 0;
  const script = join(import.meta.dir, "torch_step.py");
  const rows: ConfigBenchRow[] = [];
  for (const mode of modes) {
    const args = [
      "--gpt-config",
      JSON.stringify({ ...shape, batch: B }),
      "--mode",
      mode,
      "--device",
      gpu ? "cuda" : "cpu",
    ];
    const p = Bun.spawnSync(
      [
        torchPython(),
        script,
        ...args,
        "--precision",
        o.precision,
        "--steps",
        String(o.steps),
        "--threads",
        String(threads),
      ],
      {
        stdout: "pipe",
        stderr: "pipe",
        // PyTorch's own threads (torch.set_num_threads, from --threads) do the work; OpenMP gets
        // one, so Debian's OpenMP OpenBLAS does not start a second team on the same cores (with
        // OMP_NUM_THREADS=2 one loaded period measured GPT-2 small's step at 19.9 s against 7.3 s)
        env: { ...process.env, OMP_NUM_THREADS: "1" },
      },
    );
    const line = p.stdout.toString().trim().split("\n").pop() ?? "";
    let r: { step_ms?: number; peak_mib?: number; rss_mib?: number; torch?: string; error?: string };
    try {
      r = JSON.parse(line);
    } catch {
      r = { error: p.stderr.toString().trim().split("\n").pop() ?? `exit ${p.exitCode}` };
    }
    if (r.error !== undefined || r.step_ms === undefined) {
      if (!o.quiet) console.log(`PyTorch (${mode}) skipped: ${r.error ?? "no result"}`);
      continue;
    }
    rows.push({
      impl: `torch ${r.torch ?? ""} ${mode}`.replace(/\s+/g, " "),
      config: o.config,
      batch: B,
      step_ms: round(r.step_ms, 1),
      tokens_per_s: Math.round((B * shape.blockSize * 1000) / r.step_ms),
      act_peak_mib: "-",
      act_predicted_mib: "-",
      device_mib: r.peak_mib ?? "-",
      rss_mib: r.rss_mib ?? "-",
    });
  }
  return rows;
}

/** The Python that has PyTorch: MESHTRAIN_PYTHON, else python3 on PATH if it imports torch (the
 *  lent GPU machines'), else Debian's /usr/bin/python3 (python3-torch), else python3 (whose
 *  error the benchmark then reports). */
export function torchPython(): string {
  const override = process.env.MESHTRAIN_PYTHON;
  if (override !== undefined && override !== "") return override;
  for (const candidate of ["python3", "/usr/bin/python3"]) {
    const p = Bun.spawnSync([candidate, "-c", "import torch"], { stdout: "ignore", stderr: "ignore" });
    if (p.exitCode === 0) return candidate;
  }
  return "python3";
}

export function configName(raw: string): EngineConfigName {
  if (!(engineConfigNames as string[]).includes(raw))
    throw new ConfigError(`--config must be one of ${engineConfigNames.join(", ")}, got ${raw}`);
  return raw as EngineConfigName;
}
