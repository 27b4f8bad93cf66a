// gpt: a GPT-2 style decoder-only transformer (nanoGPT's model), with tied input/output
// embeddings. idx (B,T) i32 -> logits (B,T,V).
import { activationDType } from "../mixed.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { ShapeError } from "../errors.ts";
import { Block } from "../nn/block.ts";
import { Embedding } from "../nn/embedding.ts";
import { LayerNorm } from "../nn/layernorm.ts";
import { add } from "../ops/add.ts";
import { softmaxCrossEntropy } from "../ops/crossentropy.ts";
import { dropout } from "../ops/dropout.ts";
import { matmul } from "../ops/matmul.ts";
import { ParamBuilder, type ParamSpec, ParamStore, type SliceOf } from "../params.ts";
import type { TensorParallel, TensorRank } from "../parallel/tensor-parallel.ts";
import type { Rng } from "../rng.ts";
import type { Tensor } from "../tensor.ts";
import type { Context } from "../context.ts";
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

/**
 * One stage of a pipeline of `stages`: the blocks [from, to) of stageBlocks(), the embeddings
 * with the first stage, the final norm and the tied head with the last. A stage's parameters
 * keep the whole model's names and initial values (each parameter's init is seeded by its
 * name), so the stages together are the whole model. The token embedding wte is on the first
 * stage and, tied as the head, on the last: its gradient is the sum of both stages' (the
 * pipeline adds them before the update, which keeps the two copies equal).
 */
export interface GptPart {
  readonly stage: number;
  readonly stages: number;
  /** the tensor-parallel rank: the blocks' matrices cut across its ranks (Block) */
  readonly tensor?: TensorRank;
}

export const wholeModel: GptPart = { stage: 0, stages: 1 };

/** The blocks of a stage: contiguous, as equal as they can be (earlier stages take one more). */
export function stageBlocks(nLayer: number, part: GptPart): { from: number; to: number } {
  const { stage, stages } = part;
  if (!Number.isInteger(stages) || stages < 1 || stages > nLayer) {
    throw new ConfigError(`a gpt of ${nLayer} layers cuts into 1 to ${nLayer} pipeline stages, not ${stages}`);
  }
  if (!Number.isInteger(stage) || stage < 0 || stage >= stages)
    throw new ConfigError(`stage ${stage} is not one of ${stages}`);
  const base = Math.floor(nLayer / stages),
    extra = nLayer % stages;
  const from = stage * base + Math.min(stage, extra);
  return { from, to: from + base + (stage < extra ? 1 : 0) };
}

/** Declares a GPT part's modules and their parameters (no memory yet). */
function declareGpt(pb: ParamBuilder, config: GptConfig, part: GptPart) {
  const { vocabSize: V, blockSize, nEmbd: C } = config;
  const { from, to } = stageBlocks(config.nLayer, part);
  const first = part.stage === 0,
    last = part.stage === part.stages - 1;
  const blocks: Block[] = [];
  const wte = first || last ? new Embedding(pb, "wte", V, C) : null;
  const wpe = first ? new Embedding(pb, "wpe", blockSize, C) : null;
  for (let l = from; l < to; l++) blocks.push(new Block(pb, `h.${l}`, config, part.tensor));
  const lnF = last ? new LayerNorm(pb, "ln_f", C) : null;
  return { wte, wpe, blocks, lnF };
}

/** The parameters a GPT part declares, as GptModel would, without building it. */
export function gptParamSpecs(config: GptConfig, part: GptPart = wholeModel): ParamSpec[] {
  checkGptConfig(config);
  const pb = new ParamBuilder();
  declareGpt(pb, config, part);
  return pb.params.map((p) => p.spec);
}

export class GptModel implements Model {
  readonly kind = "gpt";
  readonly store: ParamStore;
  /** the token embedding: on the first stage (input) and the last (the tied head) */
  readonly wte: Embedding | null;
  readonly wpe: Embedding | null;
  /** this stage's blocks; blocks[i] is layer blockRange.from + i */
  readonly blocks: Block[];
  readonly lnF: LayerNorm | null;
  readonly part: GptPart;
  readonly blockRange: { from: number; to: number };
  readonly first: boolean;
  readonly last: boolean;
  /** the parameters this tensor rank holds a share of, and which (the others are replicated) */
  readonly slices: ReadonlyMap<string, SliceOf>;
  readonly #ctx: Context;
  /** activation checkpointing: each block keeps only its input during forward and recomputes
   *  its activations during backward (Context.recompute); a training option, not the model's */
  recompute = false;

  constructor(
    ctx: Context,
    readonly config: GptConfig,
    seed: number,
    part: GptPart = wholeModel,
  ) {
    checkGptConfig(config);
    this.#ctx = ctx;
    this.part = part;
    this.blockRange = stageBlocks(config.nLayer, part);
    this.first = part.stage === 0;
    this.last = part.stage === part.stages - 1;
    const pb = new ParamBuilder();
    const m = declareGpt(pb, config, part);
    this.wte = m.wte;
    this.wpe = m.wpe;
    this.blocks = m.blocks;
    this.lnF = m.lnF;
    this.slices = new Map(
      pb.params.flatMap((p) => (p.spec.sliceOf === undefined ? [] : [[p.spec.name, p.spec.sliceOf] as const])),
    );
    this.store = ParamStore.build(ctx, pb, seed);
  }

  get splitNames(): ReadonlySet<string> {
    return new Set(this.slices.keys());
  }

  /** Whether this is the whole model rather than one stage of a pipeline or a tensor rank's share. */
  get whole(): boolean {
    return this.part.stages === 1 && (this.part.tensor?.size ?? 1) === 1;
  }

  #checkInput(input: Tensor): void {
    const { blockSize, nEmbd: C } = this.config;
    const bad = this.first
      ? input.shape.length !== 2 || input.shape[1]! > blockSize
      : input.shape.length !== 3 || input.shape[1]! > blockSize || input.shape[2] !== C || input.dtype !== "f32";
    if (bad) {
      const want = this.first
        ? "idx must be (B,T)"
        : `stage ${this.part.stage}'s input must be f32 activations (B,T,${C})`;
      throw new ShapeError("gpt.forward", [input.shape], `${want} with T <= blockSize ${blockSize}`);
    }
  }

  /** The first stage: token and position embeddings of idx (B,T). */
  #embed(idx: Tensor): Tensor {
    const T = idx.shape[1]!;
    const tok = this.wte!.forward(idx); // (B,T,C)
    const pos = this.wpe!.weight.tensor.narrowRows(0, T); // (T,C), broadcast over B
    const sum = add(tok, pos);
    tok.drop();
    const out = dropout(sum, this.config.dropout);
    if (out !== sum) sum.drop();
    return out;
  }

  /** The last stage: the final norm and the tied head, (B,T,C) -> logits (B,T,V). */
  #head(x: Tensor): Tensor {
    // only the head's GEMM reads the final norm, and only the loss the logits: both in the
    // autocast type (engine/mixed.ts), which halves the largest tensor of the pass
    const act = activationDType(x.ctx.precision);
    const h = this.lnF!.forward(x, act);
    // weight tying: the output projection is the token embedding
    const logits = matmul(h, this.wte!.weight.tensor, { transB: true, out: act });
    h.drop();
    return logits;
  }

  /**
   * forward() of a tensor-parallel rank (or any model: with one rank it is forward()): each block
   * waits for its all-reduces. The context must run nothing else meanwhile.
   */
  async forwardAsync(input: Tensor, tp: TensorParallel): Promise<Tensor> {
    this.#checkInput(input);
    let x = this.first ? this.#embed(input) : input;
    for (const block of this.blocks) {
      const y = this.recompute
        ? await this.#ctx.recomputeAsync(x, block.parameters(), (h) => block.forwardAsync(h, tp))
        : await block.forwardAsync(x, tp);
      // the stage's input is its caller's; what this loop made, it drops once read
      if (x !== input) x.drop();
      x = y;
    }
    if (!this.last) return x;
    const logits = this.#head(x);
    if (x !== input) x.drop();
    return logits;
  }

  forward(idx: Tensor): Tensor {
    return drive(this.forwardSteps(idx));
  }

  /**
   * forward() a part at a time: the embeddings, each block, the final norm and the tied head.
   * A pipeline stage's input is the token ids (B,T) on the first stage, else the previous
   * stage's activations (B,T,C); its output the logits (B,T,V) on the last, else activations.
   */
  *forwardSteps(input: Tensor): Generator<readonly string[], Tensor, void> {
    this.#checkInput(input);
    const names = this.store.entries.map((e) => e.name);
    let x = input;
    if (this.first) {
      yield [...namesUnder(names, "wte"), ...namesUnder(names, "wpe")];
      x = this.#embed(input);
    }
    for (const [i, block] of this.blocks.entries()) {
      yield namesUnder(names, `h.${this.blockRange.from + i}`);
      const y = this.recompute ? this.#ctx.recompute(x, block.parameters(), (h) => block.forward(h)) : block.forward(x);
      // the stage's input is its caller's; what this loop made, it drops once read
      if (x !== input) x.drop();
      x = y;
    }
    if (!this.last) return x;
    yield [...namesUnder(names, "ln_f"), ...namesUnder(names, "wte")];
    const logits = this.#head(x); // (B,T,V)
    if (x !== input) x.drop();
    return logits;
  }

  loss(idx: Tensor, targets: Tensor): Tensor {
    return drive(this.lossSteps(idx, targets));
  }

  *lossSteps(idx: Tensor, targets: Tensor): Generator<readonly string[], Tensor, void> {
    if (!this.last)
      throw new ConfigError(
        `gpt stage ${this.part.stage} of ${this.part.stages} has no loss: the last stage computes it`,
      );
    const logits = yield* this.forwardSteps(idx);
    const loss = softmaxCrossEntropy(logits, targets);
    // the loss's backward then writes the logits' gradient over them (one (B,T,V) array, not two)
    logits.drop();
    return loss;
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
  generate(
    prompt: readonly number[],
    count: number,
    rng: Rng,
    temperature = 1,
    topK = 0,
    onToken: (token: number) => void = () => {},
  ): number[] {
    if (!this.whole)
      throw new ConfigError("generate: a pipeline stage holds part of the model; sample from the whole model's file");
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
