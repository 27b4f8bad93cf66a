// Engine benchmark: one full training step (forward, backward, optimizer) of the MLP
// 784-1024-1024-10 at batch 256 and of the default GPT, against the backend's GEMM (OpenBLAS
// sgemm, or cuBLAS) timed on exactly the GEMM shapes of that step, in the same run. The ratio
// is the fraction of the machine's GEMM rate the whole step achieves; the rest is overhead.
//
// On CUDA it also runs bench/torch_step.py where python3 has PyTorch with CUDA: PyTorch eager's
// step time for the same models, batch and precision, and torch.matmul on the same GEMM
// shapes, each against ours (target: our step time <= 1.1x PyTorch's).
//
//   bun run bench engine [--device auto|cpu|cuda] [--precision f32|tf32|bf16|f16] [--steps N] [--json-only]
//   bun run bench engine --config small|nanogpt-char|gpt2-small [--batch N] [--profile] [--no-torch]
//                        [--attention auto|cudnn|kernel|reference] [--torch-modes written,sdpa,compile] [...]
//     one GPT at nanoGPT's shapes against PyTorch on the same shape (bench/engine-config.ts)
import { join } from "node:path";
import { type Backend, type GemmDesc, type GemmInput, gemmInputBytes, type Ptr } from "../ffi/backend.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { configName, engineConfigs, runConfigBench, type TorchMode, torchModes, torchPython } from "./engine-config.ts";
import { median, printTable, round } from "./table.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { deviceChoices, type DeviceChoice, openBackend } from "../ffi/select.ts";
import { type AttentionChoice, attentionChoices } from "../ffi/cuda/attention-path.ts";
import { attentionDeviceProblem, attentionProblem } from "../services/runtime/job/attention.ts";
import { ConfigError } from "../ffi/errors.ts";
import { checkPrecision, type Precision } from "../engine/mixed.ts";
import { gptDefaults, GptModel } from "../engine/models/gpt.ts";
import { MlpModel } from "../engine/models/mlp.ts";
import { gemmFlops, type GemmShape, type Model } from "../engine/models/model.ts";
import { adamwDefaults } from "../engine/optim/adamw.ts";
import { optimizerOf } from "../engine/optim/choose.ts";
import { sgdDefaults } from "../engine/optim/sgd.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/context.ts";
import { type HostBatch, TrainStep } from "../engine/train.ts";

export interface EngineBenchResult {
  model: string;
  batch: number;
  step_ms: number;
  samples_per_s: number;
  achieved_gflops: number;
  sgemm_gflops: number;
  ratio: number;
  target: number;
  /** the peak of one pass's working memory (the arena: activations and their gradients), MiB */
  peak_act_mib: number;
}

/**
 * Times `reps` training steps and `reps` rounds of the step's GEMMs (every GEMM of the step
 * once, on scratch buffers of the same shapes), interleaved one of each at a time so both see
 * the same machine conditions; returns the medians in ms.
 */
function timeInterleaved(
  be: Backend,
  trainer: TrainStep,
  batch: HostBatch,
  shapes: readonly GemmShape[],
  reps: number,
  input: GemmInput,
) {
  const buffers = shapes.map((s) => ({
    a: randomMatrix(be, s.M * s.K * s.batch, input, s.M + s.N + s.K),
    b: randomMatrix(be, s.K * s.N * s.batch, input, s.M + s.N + s.K + 1),
    c: be.alloc(s.M * s.N * s.batch * 4),
  }));
  const gemmRound = () => {
    shapes.forEach((s, i) => {
      const { a, b, c } = buffers[i]!;
      be.gemm(gemmOf(s, input, a.ptr, b.ptr, c.ptr));
    });
  };
  // a GPU backend queues work: synchronize so each interval covers the work it launched
  const timed = (fn: () => void) => {
    be.synchronize();
    const t = performance.now();
    fn();
    be.synchronize();
    return performance.now() - t;
  };
  for (let i = 0; i < 3; i++) {
    trainer.run([batch]);
    gemmRound();
  }
  const stepMs: number[] = [];
  const gemmMs: number[] = [];
  for (let r = 0; r < reps; r++) {
    stepMs.push(timed(() => trainer.run([batch])));
    gemmMs.push(timed(gemmRound));
  }
  for (const { a, b, c } of buffers) [a, b, c].forEach((x) => be.free(x));
  return { stepMs: median(stepMs), gemmMs: median(gemmMs) };
}

/** n standard-normal elements of the GEMM input type in backend memory */
function randomMatrix(be: Backend, n: number, input: GemmInput, seed: number) {
  const rng = new Rng(seed);
  // a plain loop: Float32Array.from with a callback took most of the CPU benchmark's time
  const data = new Float32Array(n);
  for (let i = 0; i < n; i++) data[i] = rng.normal();
  const out = be.alloc(n * gemmInputBytes[input]);
  if (gemmInputBytes[input] === 4) {
    be.upload(out.ptr, data);
    return out;
  }
  const wide = be.alloc(n * 4);
  be.upload(wide.ptr, data);
  if (input === "bf16") be.castF32ToBF16(out.ptr, wide.ptr, n);
  else be.castF32ToF16(out.ptr, wide.ptr, n);
  be.free(wide);
  return out;
}

/** the GEMM input a context of this precision uses */
const gemmInputOf = (p: Precision): GemmInput => p;

/** The GEMM shapes of every model benchmarked in this process, for the PyTorch comparison. */
const benchedShapes: GemmShape[] = [];

function result(
  name: string,
  batch: number,
  model: Model,
  stepMs: number,
  gemmMs: number,
  target: number,
  peakBytes: number,
): EngineBenchResult {
  const flops = gemmFlops(model.gemmShapes(batch));
  benchedShapes.push(...model.gemmShapes(batch));
  return {
    model: name,
    batch,
    step_ms: round(stepMs, 2),
    samples_per_s: round((batch * 1000) / stepMs, 1),
    achieved_gflops: round(flops / stepMs / 1e6, 1),
    sgemm_gflops: round(flops / gemmMs / 1e6, 1),
    ratio: round(gemmMs / stepMs, 3),
    target,
    peak_act_mib: round(peakBytes / 2 ** 20, 2),
  };
}

export function benchMlp(be: Backend, steps: number, precision: Precision = "f32"): EngineBenchResult {
  const batch = 256;
  const ctx = new Context(be, { seed: 1, precision });
  const model = new MlpModel(ctx, { widths: [784, 1024, 1024, 10], activation: "relu", dropout: 0 }, 1);
  const trainer = new TrainStep(ctx, model, optimizerOf(ctx, model.store, { kind: "sgd", ...sgdDefaults }), {
    lr: 0.01,
    schedule: { kind: "constant" },
    gradClip: 0,
    accumSteps: 1,
  });
  const rng = new Rng(2);
  const hb: HostBatch = {
    inputs: Float32Array.from({ length: batch * 784 }, () => rng.normal()),
    inputShape: [batch, 784],
    targets: Int32Array.from({ length: batch }, () => rng.int(10)),
    targetShape: [batch],
  };
  const { stepMs, gemmMs } = timeInterleaved(be, trainer, hb, model.gemmShapes(batch), steps, gemmInputOf(precision));
  const peak = ctx.arena.passPeakBytes;
  ctx.dispose();
  return result("mlp 784-1024-1024-10", batch, model, stepMs, gemmMs, 0.7, peak);
}

export const gptBenchBatch = 32;

/** recompute: activation checkpointing (each block's activations recomputed in backward); its
 *  GEMM rate counts the step's GEMMs once, so the recomputed forward shows as a lower ratio */
export function benchGpt(
  be: Backend,
  steps: number,
  precision: Precision = "f32",
  recompute = false,
): EngineBenchResult {
  const batch = gptBenchBatch;
  const vocabSize = 83; // Moby Dick's character count
  const ctx = new Context(be, { seed: 1, precision });
  const config = { ...gptDefaults, vocabSize };
  const model = new GptModel(ctx, config, 1);
  model.recompute = recompute;
  const trainer = new TrainStep(ctx, model, optimizerOf(ctx, model.store, { kind: "adamw", ...adamwDefaults }), {
    lr: 1e-3,
    schedule: { kind: "constant" },
    gradClip: 1,
    accumSteps: 1,
  });
  const rng = new Rng(3);
  const n = batch * config.blockSize;
  const hb: HostBatch = {
    inputs: Int32Array.from({ length: n }, () => rng.int(vocabSize)),
    inputShape: [batch, config.blockSize],
    targets: Int32Array.from({ length: n }, () => rng.int(vocabSize)),
    targetShape: [batch, config.blockSize],
  };
  const { stepMs, gemmMs } = timeInterleaved(be, trainer, hb, model.gemmShapes(batch), steps, gemmInputOf(precision));
  const peak = ctx.arena.passPeakBytes;
  ctx.dispose();
  const c = config;
  const name = `gpt L${c.nLayer} H${c.nHead} C${c.nEmbd} T${c.blockSize} V${c.vocabSize}${recompute ? " recompute" : ""}`;
  return result(name, batch, model, stepMs, gemmMs, 0.5, peak);
}

export function runEngineBench(argv: string[]): EngineBenchResult[] | object {
  const values = parseBenchArgs(argv, {
    steps: { type: "string", default: "20" },
    "json-only": { type: "boolean", default: false },
    device: { type: "string", default: "auto" },
    precision: { type: "string", default: "f32" },
    config: { type: "string" },
    batch: { type: "string" },
    profile: { type: "boolean", default: false },
    "no-torch": { type: "boolean", default: false },
    attention: { type: "string", default: "auto" },
    "torch-modes": { type: "string" },
  });
  const attention = values.attention as AttentionChoice;
  if (!(attentionChoices as readonly string[]).includes(attention))
    throw new ConfigError(`--attention must be one of ${attentionChoices.join(", ")}, got ${values.attention}`);
  const steps = positiveInt("steps", values.steps);
  const device = values.device as DeviceChoice;
  if (!deviceChoices.includes(device))
    throw new ConfigError(`--device must be one of ${deviceChoices.join(", ")}, got ${values.device}`);
  const precision = checkPrecision(values.precision as Precision);
  const quiet = values["json-only"];
  if (values.config === undefined && (values.batch !== undefined || values.profile || values["no-torch"])) {
    throw new ConfigError("--batch, --profile and --no-torch go with --config small|nanogpt-char|gpt2-small");
  }
  const modes = values["torch-modes"]?.split(",");
  const unknownMode = modes?.find((m) => !(torchModes as readonly string[]).includes(m));
  if (unknownMode !== undefined)
    throw new ConfigError(`--torch-modes takes a list of ${torchModes.join(", ")}, got ${unknownMode}`);
  if (modes !== undefined && (values.config === undefined || values["no-torch"]))
    throw new ConfigError("--torch-modes goes with --config and without --no-torch");
  if (values.config === undefined && attention !== "auto")
    throw new ConfigError("--attention goes with --config (the other benchmarks' models run their attention as is)");
  if (values.config !== undefined) {
    const config = configName(values.config);
    const batch = values.batch === undefined ? engineConfigs[config].batch : positiveInt("batch", values.batch);
    // a choice that cannot run here is refused with the reason, as train gpt refuses it
    const c = engineConfigs[config];
    const problem = attentionProblem(attention, precision, { nEmbd: c.nEmbd, nHead: c.nHead, blockSize: c.blockSize });
    if (problem !== null) throw new ConfigError(`--attention ${attention} ${problem}`);
    const { backend: be, why } = openBackend(device, undefined, 0, { attention });
    const onCpu = attentionDeviceProblem(
      attention,
      be.name === "cpu" ? `the benchmark runs on the CPU (${why})` : null,
    );
    if (onCpu !== null) {
      be.dispose();
      throw new ConfigError(`--attention ${attention} ${onCpu}`);
    }
    try {
      const out = runConfigBench(be, why, {
        config,
        batch,
        steps,
        precision,
        profile: values.profile,
        torch: !values["no-torch"],
        ...(modes === undefined ? {} : { torchModes: modes as TorchMode[] }),
        quiet,
      });
      console.log(JSON.stringify({ bench: "engine", device: be.name, ...out }));
      return out;
    } finally {
      be.dispose();
    }
  }
  const { backend: be, why } = openBackend(device);
  const gpu = be.name !== "cpu";
  const rows = [benchMlp(be, steps, precision), benchGpt(be, steps, precision), benchGpt(be, steps, precision, true)];
  if (!quiet) {
    const threads = be instanceof CpuBackend ? `, ${be.threads} threads` : "";
    console.log(
      `engine benchmark: ${why}${threads}, precision ${precision}; medians of ${steps} steps interleaved with ${steps} rounds of their GEMMs; ratio = GEMM time / step time`,
    );
    printTable(rows, [
      "model",
      "batch",
      "step_ms",
      "samples_per_s",
      "achieved_gflops",
      "sgemm_gflops",
      "ratio",
      "target",
      "peak_act_mib",
    ]);
    const [, kept, recomputed] = rows as [EngineBenchResult, EngineBenchResult, EngineBenchResult];
    console.log(
      `activation recomputation: peak pass memory ${kept.peak_act_mib} -> ${recomputed.peak_act_mib} MiB (x${round(recomputed.peak_act_mib / kept.peak_act_mib, 3)}), ` +
        `step time x${round(recomputed.step_ms / kept.step_ms, 3)}`,
    );
  }
  const torch = gpu ? compareWithTorch(be, rows, precision, steps, quiet) : null;
  be.dispose();
  console.log(
    JSON.stringify({
      bench: "engine",
      device: be.name,
      precision,
      results: rows,
      ...(torch === null ? {} : { torch }),
    }),
  );
  return rows;
}

/** What bench/torch_step.py prints: PyTorch eager's step times of the two models and its GEMM times. */
interface TorchStep {
  mlp_step_ms: number;
  gpt_step_ms: number;
  gemm_tflops: number;
  gemm: { ms: number }[];
  device: string;
  torch: string;
  error?: string;
}

/** PyTorch eager on the same machine, models, batch and precision (bench/torch_step.py). */
function compareWithTorch(
  be: Backend,
  rows: EngineBenchResult[],
  precision: Precision,
  steps: number,
  quiet: boolean,
): object | null {
  // distinct shapes only: torch times each once, as our GEMM round does per occurrence
  const shapes = [...new Map(benchedShapes.map((s) => [JSON.stringify(s), s])).values()];
  const torch = runTorchStep(precision, steps, shapes, quiet);
  if (torch === null) return null;
  const [mlp, gpt] = rows as [EngineBenchResult, EngineBenchResult];
  const comparison = [
    {
      model: mlp.model,
      ours_step_ms: mlp.step_ms,
      torch_step_ms: round(torch.mlp_step_ms, 3),
      ratio: round(mlp.step_ms / torch.mlp_step_ms, 3),
      target: 1.1,
    },
    {
      model: gpt.model,
      ours_step_ms: gpt.step_ms,
      torch_step_ms: round(torch.gpt_step_ms, 3),
      ratio: round(gpt.step_ms / torch.gpt_step_ms, 3),
      target: 1.1,
    },
  ];
  if (!quiet) {
    console.log(
      `PyTorch ${torch.torch} eager on ${torch.device}, same models, batch and precision (ratio = ours / torch, target <= 1.1):`,
    );
    printTable(comparison, ["model", "ours_step_ms", "torch_step_ms", "ratio", "target"]);
  }
  const ours = gemmShapeTimes(be, shapes, gemmInputOf(precision), steps);
  const gemm = shapes.map((s, i) => {
    const flops = 2 * s.M * s.N * s.K * s.batch;
    const [o, t] = [ours[i]!, torch.gemm[i]!.ms];
    return {
      shape: `${s.batch}x${s.M}x${s.N}x${s.K}${s.transA ? " tA" : ""}${s.transB ? " tB" : ""}`,
      ours_tflops: round(flops / o / 1e9, 2),
      torch_tflops: round(flops / t / 1e9, 2),
      ratio: round(t / o, 3),
    };
  });
  const total = (ms: number[]) =>
    shapes.reduce((f, s) => f + 2 * s.M * s.N * s.K * s.batch, 0) / ms.reduce((a, b) => a + b, 0) / 1e9;
  const gemmTflops = { ours: round(total(ours), 2), torch: round(torch.gemm_tflops, 2) };
  if (!quiet) {
    console.log("GEMM through our cuBLAS binding against torch.matmul, same shapes (ratio = torch time / ours):");
    printTable(gemm, ["shape", "ours_tflops", "torch_tflops", "ratio"]);
    console.log(`all shapes: ours ${gemmTflops.ours} TFLOP/s, torch ${gemmTflops.torch} TFLOP/s`);
  }
  return { ...torch, comparison, gemm, gemm_tflops: gemmTflops };
}

/** bench/torch_step.py's result, or null (said unless `quiet`) when it did not run or reported an error. */
function runTorchStep(precision: Precision, steps: number, shapes: GemmShape[], quiet: boolean): TorchStep | null {
  const script = join(import.meta.dir, "torch_step.py");
  const p = Bun.spawnSync(
    [
      torchPython(),
      script,
      "--precision",
      precision,
      "--steps",
      String(steps),
      "--gemm-shapes",
      JSON.stringify(shapes),
    ],
    {
      stdout: "pipe",
      stderr: "pipe",
    },
  );
  const line = p.stdout.toString().trim().split("\n").pop() ?? "";
  let torch: TorchStep;
  try {
    torch = JSON.parse(line);
  } catch {
    if (!quiet)
      console.log(
        `PyTorch comparison skipped: ${script} did not run (${p.stderr.toString().trim().split("\n").pop() ?? `exit ${p.exitCode}`})`,
      );
    return null;
  }
  if (torch.error !== undefined) {
    if (!quiet) console.log(`PyTorch comparison skipped: ${torch.error}`);
    return null;
  }
  return torch;
}

/** Median ms of each GEMM shape on its own, timed as torch_step.py times torch.matmul. */
function gemmShapeTimes(be: Backend, shapes: readonly GemmShape[], input: GemmInput, reps: number): number[] {
  return shapes.map((s, i) => {
    const a = randomMatrix(be, s.M * s.K * s.batch, input, 2 * i);
    const b = randomMatrix(be, s.K * s.N * s.batch, input, 2 * i + 1);
    const c = be.alloc(s.M * s.N * s.batch * 4);
    const run = () => be.gemm(gemmOf(s, input, a.ptr, b.ptr, c.ptr));
    for (let w = 0; w < 3; w++) run();
    const ms: number[] = [];
    for (let r = 0; r < reps; r++) {
      be.synchronize();
      const t = performance.now();
      run();
      be.synchronize();
      ms.push(performance.now() - t);
    }
    [a, b, c].forEach((x) => be.free(x));
    return median(ms);
  });
}

if (import.meta.main) runEngineBench(process.argv.slice(2));

/** The GEMM of a shape (contiguous row-major operands, one after another in a batch) on buffers a, b and c. */
function gemmOf(s: GemmShape, input: GemmInput, A: Ptr, B: Ptr, C: Ptr): GemmDesc {
  const { transA, transB, M, N, K, batch } = s;
  return {
    input,
    transA,
    transB,
    M,
    N,
    K,
    A,
    lda: transA ? M : K,
    strideA: M * K,
    B,
    ldb: transB ? K : N,
    strideB: K * N,
    C,
    ldc: N,
    strideC: M * N,
    batch,
  };
}
