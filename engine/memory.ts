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
  /** parameters + gradients + optimizer + activationsPeak */
  total: number;
}

export const gptParamCount = (config: GptConfig): number => gptParamSpecs(config).reduce((n, s) => n + s.shape.reduce((a, b) => a * b, 1), 0);

/**
 * The count, term by term (docs/MEMORY.md says where each comes from). Under bf16/f16 autocast
 * the GEMMs' inputs are kept as 2-byte copies (the f32 originals are freed), and each layer's
 * weights are copied to 2 bytes for its pass.
 */
export function gptMemory(config: GptConfig, o: GptMemoryOptions): GptMemory {
  const { blockSize: T, nEmbd: C, nHead: H, nLayer: L, vocabSize: V } = config;
  const B = o.batch;
  const P = gptParamCount(config);
  const half = o.precision === "bf16" || o.precision === "f16";
  const BTC = B * T * C,
    BT = B * T,
    BTV = B * T * V;
  // per layer: the block's input x, ln_1's output, qkv, attention's output, the residual sum,
  // ln_2's output, c_fc's pre-activation and its GELU (16 BTC in f32), LayerNorms' mean and rstd
  // and attention's log-sum-exp (4 BT + B H T); under autocast the GEMM inputs as 2-byte copies
  // (ln_1 out, attention out beside its f32 self, ln_2 out, GELU out; qkv) and the weights too
  const stats = 4 * (4 * BT + B * H * T);
  const layerWeights16 = 2 * 12 * C * C;
  const perLayer = half ? 48 * BTC + stats + layerWeights16 : 64 * BTC + stats;
  // the head: the last block's output, ln_f's output (its 2-byte copy), its mean and rstd, the
  // logits, the loss's lse (and the tied embedding's 2-byte copy)
  const head = 4 * BTC + (half ? 2 * BTC + 2 * V * C : 4 * BTC) + 4 * (2 * BT) + 4 * BTV + 4 * BT;
  // backward's peak above what forward kept: the head's input gradient (and the logits'
  // gradient's 2-byte copy), or the last block's c_fc backward, which holds the residual's, the
  // GELU's and ln_2's gradients and the pre-activation's (and its copy) once the logits, ln_f's
  // output, the last block's output and the GELU output are freed
  const headExtra = 4 * BTC + (half ? 2 * BTV : 0);
  const mlpExtra = half ? 34 * BTC - 4 * BTV - 2 * V * C - 8 * C * C : 16 * BTC - 4 * BTV;
  let saved: number;
  let peak: number;
  if (!o.recompute) {
    saved = L * perLayer + head;
    peak = saved + Math.max(headExtra, mlpExtra);
  } else {
    // each block keeps its input; backward runs one block's forward again and its backward: the
    // block inputs, the last output's and input's gradients, the block's activations (its input
    // is already counted) and its output, and c_fc's backward as above, without the head's frees
    saved = (L + 1) * 4 * BTC + (head - 4 * BTC);
    const replay = perLayer;
    const inner = half ? 48 * BTC - 8 * BTC - 8 * C * C : 40 * BTC - 16 * BTC;
    peak = Math.max(saved + headExtra, L * 4 * BTC + 8 * BTC + replay + inner);
  }
  const parameters = 4 * P;
  const gradients = 4 * P;
  const optimizer = (o.optimizer === "adamw" ? 8 : 4) * P;
  return { parameters, gradients, optimizer, activationsSaved: saved, activationsPeak: peak, total: parameters + gradients + optimizer + peak };
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
