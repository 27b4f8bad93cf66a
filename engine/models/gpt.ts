// gpt: a GPT-2 style decoder-only transformer (nanoGPT's model), with tied input/output
// embeddings. idx (B,T) i32 -> logits (B,T,V).
import { ConfigError, ShapeError } from "../errors.ts";
import { Block } from "../nn/block.ts";
import { Embedding } from "../nn/embedding.ts";
import { LayerNorm } from "../nn/layernorm.ts";
import { add } from "../ops/add.ts";
import { softmaxCrossEntropy } from "../ops/crossentropy.ts";
import { dropout } from "../ops/dropout.ts";
import { matmul } from "../ops/matmul.ts";
import { ParamBuilder, ParamStore } from "../params.ts";
import type { Rng } from "../rng.ts";
import type { Context, Tensor } from "../tensor.ts";
import { drive, gemmFlops, type GemmShape, type Model, namesUnder } from "./model.ts";

export interface GptConfig {
  vocabSize: number;
  blockSize: number;
  nLayer: number;
  nHead: number;
  nEmbd: number;
  dropout: number;
}

/** The small default config: trains on Moby Dick (character level) on two CPU cores. */
export const gptDefaults: Omit<GptConfig, "vocabSize"> = { blockSize: 64, nLayer: 4, nHead: 4, nEmbd: 128, dropout: 0 };

export function checkGptConfig(c: GptConfig): void {
  const positive = ["vocabSize", "blockSize", "nLayer", "nHead", "nEmbd"] as const;
  for (const k of positive) {
    if (!Number.isInteger(c[k]) || c[k] <= 0) throw new ConfigError(`gpt ${k} must be a positive integer, got ${c[k]}`);
  }
  if (c.nEmbd % c.nHead !== 0) throw new ConfigError(`gpt nEmbd (${c.nEmbd}) must be divisible by nHead (${c.nHead})`);
  if (!(c.dropout >= 0 && c.dropout < 1)) throw new ConfigError(`gpt dropout must be in [0, 1), got ${c.dropout}`);
}

export class GptModel implements Model {
  readonly kind = "gpt";
  readonly store: ParamStore;
  readonly wte: Embedding;
  readonly wpe: Embedding;
  readonly blocks: Block[] = [];
  readonly lnF: LayerNorm;
  readonly #ctx: Context;

  constructor(
    ctx: Context,
    readonly config: GptConfig,
    seed: number,
  ) {
    checkGptConfig(config);
    this.#ctx = ctx;
    const pb = new ParamBuilder();
    const { vocabSize: V, blockSize, nEmbd: C, nLayer } = config;
    this.wte = new Embedding(pb, "wte", V, C);
    this.wpe = new Embedding(pb, "wpe", blockSize, C);
    for (let l = 0; l < nLayer; l++) this.blocks.push(new Block(pb, `h.${l}`, config));
    this.lnF = new LayerNorm(pb, "ln_f", C);
    this.store = ParamStore.build(ctx, pb, seed);
  }

  forward(idx: Tensor): Tensor {
    return drive(this.forwardSteps(idx));
  }

  /** forward() a part at a time: the embeddings, each block, the final norm and the tied head. */
  *forwardSteps(idx: Tensor): Generator<readonly string[], Tensor, void> {
    if (idx.shape.length !== 2 || idx.shape[1]! > this.config.blockSize) {
      throw new ShapeError("gpt.forward", [idx.shape], `idx must be (B,T) with T <= blockSize ${this.config.blockSize}`);
    }
    const names = this.store.entries.map((e) => e.name);
    const T = idx.shape[1]!;
    yield [...namesUnder(names, "wte"), ...namesUnder(names, "wpe")];
    const tok = this.wte.forward(idx); // (B,T,C)
    const pos = this.wpe.weight.tensor.narrowRows(0, T); // (T,C), broadcast over B
    let x = dropout(add(tok, pos), this.config.dropout);
    for (const [l, block] of this.blocks.entries()) {
      yield namesUnder(names, `h.${l}`);
      x = block.forward(x);
    }
    yield [...namesUnder(names, "ln_f"), ...namesUnder(names, "wte")];
    x = this.lnF.forward(x);
    // weight tying: the output projection is the token embedding
    return matmul(x, this.wte.weight.tensor, { transB: true }); // (B,T,V)
  }

  loss(idx: Tensor, targets: Tensor): Tensor {
    return softmaxCrossEntropy(this.forward(idx), targets);
  }

  *lossSteps(idx: Tensor, targets: Tensor): Generator<readonly string[], Tensor, void> {
    const logits = yield* this.forwardSteps(idx);
    return softmaxCrossEntropy(logits, targets);
  }

  gemmShapes(batch: number): GemmShape[] {
    const { vocabSize: V, blockSize: T, nEmbd: C, nHead: H, nLayer } = this.config;
    const N = batch * T;
    const D = C / H;
    const linear = (inF: number, outF: number): GemmShape[] => [
      { M: N, N: outF, K: inF, transA: false, transB: true, batch: 1 }, // forward
      { M: N, N: inF, K: outF, transA: false, transB: false, batch: 1 }, // dX
      { M: outF, N: inF, K: N, transA: true, transB: false, batch: 1 }, // dW
    ];
    const bh = batch * H;
    const attention: GemmShape[] = [
      { M: T, N: T, K: D, transA: false, transB: true, batch: bh }, // q k^T
      { M: T, N: D, K: T, transA: false, transB: false, batch: bh }, // att v
      { M: T, N: T, K: D, transA: false, transB: true, batch: bh }, // datt = dy v^T
      { M: T, N: D, K: T, transA: true, transB: false, batch: bh }, // dv = att^T dy
      { M: T, N: D, K: T, transA: false, transB: false, batch: bh }, // dq = dpre k
      { M: T, N: D, K: T, transA: true, transB: false, batch: bh }, // dk = dpre^T q
    ];
    const perLayer = [...linear(C, 3 * C), ...attention, ...linear(C, C), ...linear(C, 4 * C), ...linear(4 * C, C)];
    const shapes: GemmShape[] = [];
    for (let l = 0; l < nLayer; l++) shapes.push(...perLayer);
    shapes.push(...linear(C, V)); // tied lm head: forward, dX, dW (into wte)
    return shapes;
  }

  gemmFlopsPerStep(batch: number): number {
    return gemmFlops(this.gemmShapes(batch));
  }

  /**
   * Autoregressive sampling: extends `prompt` by `count` tokens, sampling each from the
   * softmax of the last position's logits / temperature, restricted to the topK most likely.
   * `onToken` gets each new token as soon as it is sampled (a caller streams the text).
   */
  generate(prompt: readonly number[], count: number, rng: Rng, temperature = 1, topK = 0, onToken: (token: number) => void = () => {}): number[] {
    if (prompt.length === 0) throw new ConfigError("generate: the prompt needs at least one token");
    if (!(temperature > 0)) throw new ConfigError(`generate: temperature must be > 0, got ${temperature}`);
    const ctx = this.#ctx;
    const tokens = [...prompt];
    const V = this.config.vocabSize;
    const wasTraining = ctx.training;
    ctx.training = false;
    try {
      for (let i = 0; i < count; i++) {
        const window = tokens.slice(-this.config.blockSize);
        ctx.newPass();
        const logits = ctx.noGrad(() => this.forward(ctx.fromArray(Int32Array.from(window), [1, window.length])));
        const all = logits.toFloat32();
        const last = all.subarray((window.length - 1) * V, window.length * V);
        const token = sampleLogits(last, rng, temperature, topK);
        tokens.push(token);
        onToken(token);
      }
    } finally {
      ctx.training = wasTraining;
    }
    return tokens.slice(prompt.length);
  }
}

function sampleLogits(logits: Float32Array, rng: Rng, temperature: number, topK: number): number {
  const V = logits.length;
  let threshold = -Infinity;
  if (topK > 0 && topK < V) threshold = [...logits].sort((a, b) => b - a)[topK - 1]!;
  let max = -Infinity;
  for (let v = 0; v < V; v++) if (logits[v]! >= threshold) max = Math.max(max, logits[v]!);
  const p = new Float64Array(V);
  let sum = 0;
  for (let v = 0; v < V; v++) {
    p[v] = logits[v]! >= threshold ? Math.exp((logits[v]! - max) / temperature) : 0;
    sum += p[v]!;
  }
  let r = rng.uniform() * sum;
  for (let v = 0; v < V; v++) {
    r -= p[v]!;
    if (r < 0) return v;
  }
  return V - 1;
}
