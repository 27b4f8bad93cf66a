// What training a GPT holds in memory, counted from its shape: the analytic count that
// docs/MEMORY.md derives, that `train gpt` and `bench engine` print beside the measured peak,
// and that test/engine/memory.test.ts holds to the measurement (within 10%).
//
// Letters: B micro-batch, T context, C width, H heads, L layers, V vocabulary, P parameters.
// "Activations" is one pass's working memory (the arena, engine/arena.ts): what forward keeps
// for backward, and what backward holds at its peak. Parameters, gradients and optimizer state
// live for the whole run beside it.
import type { GptConfig } from "./models/gpt.ts";
import { gptParamSpecs } from "./models/gpt.ts";
import type { Precision } from "./mixed.ts";

export type OptimizerKind = "adamw" | "sgd";

export interface GptMemoryOptions {
  /** sequences per micro-batch */
  batch: number;
  precision: Precision;
  recompute: boolean;
  optimizer: OptimizerKind;
  /** tensor-parallel ranks the blocks' matrices are cut across (default 1) */
  tensor?: number;
}

/** Bytes, each a whole number. */
export interface GptMemory {
  parameters: number;
  /** the gradient slab (f32, like the master parameters) */
  gradients: number;
  /** AdamW's two moments, SGD's momentum (f32) */
  optimizer: number;
  /** what a training pass's forward keeps for backward */
  activationsSaved: number;
  /** the most a training pass holds at once (forward's saved tensors plus backward's peak) */
  activationsPeak: number;
  /** under autocast, the parameters' 2-byte copy the GEMMs read (cast once a step; engine/params.ts) */
  weightCopies: number;
  /** parameters + gradients + optimizer + weightCopies + activationsPeak */
  total: number;
}

export const gptParamCount = (config: GptConfig): number =>
  gptParamSpecs(config).reduce((n, s) => n + s.shape.reduce((a, b) => a * b, 1), 0);

/** The terms of a GPT pass's activations (docs/MEMORY.md derives each). */
export interface GptActivationTerms {
  /** what one block keeps for backward, its input included */
  perLayer: number;
  /** what the head keeps (the last block's output, ln_f, the logits, the loss's lse) */
  head: number;
  /** backward's peak above what forward kept: at the head, and at the last block's c_fc */
  headExtra: number;
  mlpExtra: number;
  /** recomputation's block replay and its c_fc backward, beyond the kept inputs */
  replay: number;
  replayInner: number;
  BTC: number;
}

export function gptActivationTerms(config: GptConfig, o: GptMemoryOptions): GptActivationTerms {
  const { blockSize: T, nEmbd: C, nHead: H, vocabSize: V } = config;
  const B = o.batch;
  const R = o.tensor ?? 1;
  const half = o.precision === "bf16" || o.precision === "f16";
  const BTC = B * T * C,
    BT = B * T,
    BTV = B * T * V;
  // per layer in f32: the block's input x, ln_1's output, qkv, attention's output, the residual
  // sum, ln_2's output, c_fc's pre-activation and its GELU (64 BTC), LayerNorms' mean and rstd and
  // attention's log-sum-exp (4 BT + B H T). Under autocast (bf16 activations, engine/mixed.ts)
  // all but x and the residual sum are stored in the 2-byte type: 4 + 2 + 6 + 2 + 4 + 2 + 8 + 8 =
  // 36 BTC (the weights' 2-byte copy is outside the pass: gptMemory's weightCopies). Cut over R
  // tensor ranks (forwardAsync, which keeps the replicated LayerNorm outputs in f32 and copies
  // them for the GEMMs), qkv, attention's output and the MLP's 4C are 1/R on a rank; x, the
  // LayerNorms' outputs and the residual sum are whole.
  const stats = 4 * (4 * BT + (B * H * T) / R);
  const perLayerBTC = !half ? 16 + 48 / R : R === 1 ? 36 : 12 + 32 / R;
  const perLayer = perLayerBTC * BTC + stats;
  // the head: the last block's output, ln_f's output (bf16 under autocast), its mean and rstd,
  // the logits (bf16 under autocast), the loss's lse
  const head = 4 * BTC + (half ? 2 * BTC : 4 * BTC) + 4 * (2 * BT) + (half ? 2 : 4) * BTV + 4 * BT;
  // backward's peak above what forward kept, at one of two places:
  // - the head: ln_f output's gradient (2 bytes under autocast; the logits' gradient is written
  //   over the logits, in their type);
  // - the last block's c_proj backward (f32: c_fc's), once the logits, ln_f's output and its
  //   statistics, the loss's lse and the last block's output are freed: the residual's gradient
  //   and the add's copy of it (8), the GELU output's gradient (8; f32 16) and the output
  //   gradient's 2-byte copy (2)
  const headExtra = (half ? 2 : 4) * BTC;
  const mlpExtra = !half ? 16 * BTC - 4 * BTV : R === 1 ? 12 * BTC - 2 * BTV - 12 * BT : 34 * BTC - 2 * BTV;
  // recomputation: one block's forward again (its output too) and its c_proj backward
  const replayInner = !half ? 40 * BTC - 16 * BTC : R === 1 ? 18 * BTC : 48 * BTC - 8 * BTC;
  return { perLayer, head, headExtra, mlpExtra, replay: perLayer, replayInner, BTC };
}

/**
 * The count, term by term (docs/MEMORY.md says where each comes from). Under bf16/f16 autocast
 * the activations that only GEMMs and attention read are stored in the 2-byte type, and the
 * parameters have a 2-byte copy beside them (cast once a step), outside the pass's memory.
 */
export function gptMemory(config: GptConfig, o: GptMemoryOptions): GptMemory {
  const L = config.nLayer;
  const P = gptParamCount(config);
  const t = gptActivationTerms(config, o);
  let saved: number;
  let peak: number;
  if (!o.recompute) {
    saved = L * t.perLayer + t.head;
    peak = saved + Math.max(t.headExtra, t.mlpExtra);
  } else {
    // each block keeps its input; backward runs one block's forward again and its backward: the
    // block inputs, the last output's and input's gradients, the block's activations (its input
    // is already counted) and its output, and c_fc's backward as above, without the head's frees
    saved = (L + 1) * 4 * t.BTC + (t.head - 4 * t.BTC);
    peak = Math.max(saved + t.headExtra, L * 4 * t.BTC + 8 * t.BTC + t.replay + t.replayInner);
  }
  const parameters = 4 * P;
  const gradients = 4 * P;
  const optimizer = (o.optimizer === "adamw" ? 8 : 4) * P;
  const weightCopies = o.precision === "bf16" || o.precision === "f16" ? 2 * P : 0;
  return {
    parameters,
    gradients,
    optimizer,
    activationsSaved: saved,
    activationsPeak: peak,
    weightCopies,
    total: parameters + gradients + optimizer + weightCopies + peak,
  };
}

/** 1234567890 -> "1.15 GiB" */
export function formatBytes(bytes: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = bytes;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v >= 100 || u === 0 ? v.toFixed(0) : v.toFixed(v >= 10 ? 1 : 2)} ${units[u]}`;
}

/** An MLP's pass: each hidden layer keeps its pre-activation and its activation (2 b w), the
 *  input, the logits, the targets and the loss's lse their own; backward's peak adds one hidden
 *  layer's gradient. Each tensor takes whole 64-byte blocks of the arena. */
export function mlpActivations(widths: readonly number[], batch: number): { saved: number; peak: number } {
  const block = (floats: number) => Math.ceil((4 * floats) / 64) * 64;
  const hidden = widths.slice(1, -1);
  const saved =
    block(batch * widths[0]!) +
    2 * hidden.reduce((a, w) => a + block(batch * w), 0) +
    block(batch * widths[widths.length - 1]!) +
    2 * block(batch);
  return { saved, peak: saved + block(batch * Math.max(0, ...hidden)) };
}

/** What one rank of a job holds, in bytes: on its device, and in host memory beside it. */
export interface RankMemory {
  parameters: number;
  gradients: number;
  optimizer: number;
  activations: number;
  /** ZeRO stage 3: parameters gathered at once (a block, the next one prefetched, the embedding) */
  gathered: number;
  /** under autocast, the parameters' 2-byte copy the GEMMs read (cast once a step) */
  weightCopies: number;
  device: number;
  /** offload: the f32 master parameters, gradients and optimizer state the host updates */
  hostOptimizer: number;
  /** the collective's host buffers (a bucket each, and compression's residuals) */
  hostBuffers: number;
  host: number;
}

export interface RankModelState {
  /** the rank's parameters (its pipeline stage's, its tensor rank's share) */
  paramCount: number;
  /** optimizer state per parameter: AdamW 8, SGD with momentum 4, plain SGD 0 (top-k ages +4) */
  optimizerBytesPerParam: number;
  /** "ps": the shards hold the optimizer; "allreduce": every rank holds a replica */
  mode: "single" | "ps" | "allreduce";
  /** ranks the ZeRO partition is over (data-parallel copies) */
  dataRanks: number;
  zero: 0 | 1 | 2 | 3;
  offload: boolean;
  /** a compressed all-reduce keeps an error-feedback residual of the gradient */
  compressed: boolean;
  /** activations at the pass's peak (gptMemory, with pipelining's micro-batches in flight) */
  activations: number;
  /** stage 3: the bytes gathered at once */
  gatheredBytes: number;
  /** the 2-byte weight copy per parameter: 2 under bf16/f16 autocast, else 0 (default 0) */
  weightCopyBytesPerParam?: number;
}

/**
 * A rank's model state as the ZeRO paper counts it, and as test/services/zero.test.ts measures
 * it from the allocations: parameters, gradients and optimizer state 4 + 4 + K bytes a parameter
 * at stage 0; the optimizer state partitioned over N ranks at stage 1, the gradients too at 2,
 * the parameters too at 3. Offload keeps parameters and gradients on the device and the master
 * copy, the gradients and the optimizer state in host memory. In parameter-server mode a
 * trainer holds parameters and gradients; the shards hold the rest.
 */
export function rankMemory(s: RankModelState): RankMemory {
  const P = s.paramCount;
  const N = s.mode === "allreduce" ? Math.max(1, s.dataRanks) : 1;
  const zero = s.mode === "allreduce" ? s.zero : 0;
  const parameters = 4 * (zero >= 3 ? P / N : P);
  // offloaded stages 2 and 3 keep the partition's gradients on the host only
  const gradients = s.offload && zero >= 2 ? 0 : 4 * (zero >= 2 ? P / N : P);
  const optimizerAll = s.mode === "ps" ? 0 : s.optimizerBytesPerParam * (zero >= 1 ? P / N : P);
  const optimizer = s.offload ? 0 : optimizerAll;
  // offload: the host's master copy, gradients and state (under ZeRO, of the rank's partition)
  const hostOptimizer = s.offload ? ((4 + 4) * P) / (zero >= 1 ? N : 1) + optimizerAll : 0;
  const hostBuffers = s.mode === "allreduce" && N > 1 ? 4 * P * (s.compressed ? 2 : 1) : 0;
  const gathered = zero >= 3 ? s.gatheredBytes : 0;
  // stage 3 binds the parameters to gathered buffers: their copies are made per op, in the pass
  const weightCopies = zero >= 3 ? 0 : (s.weightCopyBytesPerParam ?? 0) * P;
  const device = parameters + gradients + optimizer + s.activations + gathered + weightCopies;
  return {
    parameters: Math.round(parameters),
    gradients: Math.round(gradients),
    optimizer: Math.round(optimizer),
    activations: s.activations,
    gathered,
    weightCopies,
    device: Math.round(device),
    hostOptimizer,
    hostBuffers,
    host: hostOptimizer + hostBuffers,
  };
}

/** A parameter-server shard's host memory: its chunks' parameters, optimizer state and (BSP) the
 *  sum of the step's pushes. */
export function shardMemory(paramCount: number, shards: number, optimizerBytesPerParam: number): number {
  return Math.round(((4 + optimizerBytesPerParam + 4) * paramCount) / shards);
}

/**
 * Activations of pipeline stage `stage` of `stages` (a tensor rank of `tensor`): its blocks'
 * saved tensors (its input among them) for each micro-batch in flight (1F1B: up to stages -
 * stage; GPipe: all of them), with the head's on the last stage and the output it sent on the
 * others, plus one backward's peak.
 */
export function gptStageActivations(
  config: GptConfig,
  o: GptMemoryOptions & { stage: number; stages: number; microBatches: number; schedule: "1f1b" | "gpipe" },
): { perMicroBatch: number; inFlight: number; extra: number; peak: number } {
  const L = config.nLayer;
  const layers = Math.floor(L / o.stages) + (o.stage < L % o.stages ? 1 : 0);
  const t = gptActivationTerms(config, o);
  const last = o.stage === o.stages - 1;
  const kept = o.recompute ? (layers + 1) * 4 * t.BTC : layers * t.perLayer;
  const perMicroBatch = kept + (last ? t.head - 4 * t.BTC : 4 * t.BTC);
  const inFlight = o.schedule === "gpipe" ? o.microBatches : Math.min(o.microBatches, o.stages - o.stage);
  const extra = o.recompute
    ? 8 * t.BTC + t.replay + t.replayInner - 4 * t.BTC
    : last
      ? Math.max(t.headExtra, t.mlpExtra)
      : Math.max(4 * t.BTC, t.mlpExtra + 8 * t.BTC);
  return { perMicroBatch, inFlight, extra, peak: Math.round(inFlight * perMicroBatch + extra) };
}
