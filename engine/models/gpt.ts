// gpt: a GPT-2 style decoder-only transformer (nanoGPT's model), with tied input/output
// embeddings. idx (B,T) i32 -> logits (B,T,V).
import { activationDType } from "../mixed.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { EngineError, ShapeError } from "../errors.ts";
import { type Allocation, dtypeBytes } from "../../ffi/backend.ts";
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
import { checkSampling, type SamplingOptions, sampleLogits, samplingDefaults } from "./sampling.ts";
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
  #embed(idx: Tensor, from = 0): Tensor {
    const T = idx.shape[1]!;
    const tok = this.wte!.forward(idx); // (B,T,C)
    const pos = this.wpe!.weight.tensor.narrowRows(from, T); // positions [from, from+T) (T,C), broadcast over B
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
   * Autoregressive sampling: extends `prompt` by up to `count` tokens, each drawn from the last
   * position's logits (engine/models/sampling.ts). `onToken` gets each new token as soon as it is
   * sampled (a caller streams the text); a drawn `stopAt` ends the sample and is not returned.
   * With the KV cache (the default) each new token runs one position's forward over the cached
   * keys and values of the earlier ones; without it, the whole window's forward (the reference
   * the cache is tested against). Both give the same tokens for the same rng.
   */
  generate(prompt: readonly number[], count: number, rng: Rng, options: GenerateOptions = {}): number[] {
    if (!this.whole)
      throw new ConfigError("generate: a pipeline stage holds part of the model; sample from the whole model's file");
    if (prompt.length === 0) throw new ConfigError("generate: the prompt needs at least one token");
    const sampling = { ...samplingDefaults, ...options };
    checkSampling(sampling);
    const ctx = this.#ctx;
    const tokens = [...prompt];
    const wasTraining = ctx.training;
    ctx.training = false;
    const cache = options.kvCache === false ? null : new KvCache(ctx, this.config);
    try {
      for (let i = 0; i < count; i++) {
        ctx.newPass();
        const logits = ctx.noGrad(() => (cache === null ? this.#lastLogits(tokens) : cache.step(this, tokens)));
        const token = sampleLogits(logits, rng, sampling);
        if (token === options.stopAt) break;
        tokens.push(token);
        options.onToken?.(token);
      }
    } finally {
      ctx.training = wasTraining;
      cache?.dispose();
    }
    return tokens.slice(prompt.length);
  }

  /** The last position's logits (V) of the whole window's forward: the last blockSize tokens. */
  #lastLogits(tokens: readonly number[]): Float32Array {
    const window = tokens.slice(-this.config.blockSize);
    const logits = this.forward(this.#ctx.fromArray(Int32Array.from(window), [1, window.length]));
    const V = this.config.vocabSize;
    return logits.toFloat32().subarray((window.length - 1) * V, window.length * V);
  }

  /**
   * The logits (1,1,V) of the last of `tokens`, at positions [pos, pos+T) after the `pos` tokens
   * whose keys and values `caches` (one (blockSize,3C) per layer) hold; their own go into it.
   * The whole model only, without gradients (generation).
   */
  forwardCached(tokens: readonly number[], caches: readonly Tensor[], pos: number): Tensor {
    const T = tokens.length;
    if (T === 0 || pos + T > this.config.blockSize || caches.length !== this.blocks.length)
      throw new ShapeError("gpt.forwardCached", [[1, T]], `1 to blockSize - pos tokens, one cache per layer`);
    let x = this.#embed(this.#ctx.fromArray(Int32Array.from(tokens), [1, T]), pos);
    for (const [l, block] of this.blocks.entries()) {
      const y = block.forwardCached(x, caches[l]!, pos);
      x.drop();
      x = y;
    }
    // only the last position's logits are sampled from: the head's GEMM reads one row
    const last =
      T === 1
        ? x
        : x
            .reshape([T, this.config.nEmbd])
            .narrowRows(T - 1, 1)
            .reshape([1, 1, this.config.nEmbd]);
    const logits = this.#head(last);
    x.drop();
    return logits;
  }
}

/** What generate() takes besides the prompt, the count and the rng. */
export interface GenerateOptions extends Partial<SamplingOptions> {
  /** a token that ends the sample when drawn (GPT-2's <|endoftext|>) */
  stopAt?: number;
  onToken?: (token: number) => void;
  /** false: the whole window's forward for every token, as before the KV cache */
  kvCache?: boolean;
}

/**
 * Generation's keys and values: one (blockSize,3C) tensor per layer of the fused q,k,v rows of the
 * tokens fed so far (the q rows are kept too, so that the cache is what the attention kernel
 * reads), and which of the sample's tokens they are.
 */
export class KvCache {
  readonly #ctx: Context;
  readonly #memory: Allocation[];
  readonly #layers: Tensor[];
  readonly #blockSize: number;
  /** tokens[start, start+pos) are cached at rows [0, pos) */
  #start = 0;
  #pos = 0;

  constructor(ctx: Context, config: GptConfig) {
    const { blockSize, nEmbd: C, nLayer } = config;
    const elem = activationDType(ctx.precision);
    this.#ctx = ctx;
    this.#blockSize = blockSize;
    this.#memory = Array.from({ length: nLayer }, () => ctx.allocPersistent(blockSize * 3 * C * dtypeBytes[elem]));
    this.#layers = this.#memory.map((m) => ctx.persistentTensor([blockSize, 3 * C], elem, m.ptr, false));
  }

  /** The logits (V) for the last of `tokens`, feeding the model those not cached yet. */
  step(model: GptModel, tokens: readonly number[]): Float32Array {
    if (tokens.length <= this.#start + this.#pos)
      throw new EngineError("KvCache.step: no new token since the last step");
    // The window slides as without the cache: once the tokens outgrow blockSize, the cache is
    // filled again from the last blockSize of them (a prefill per token from then on, the cost
    // of the whole window's forward; the tokens stay those of the full recompute).
    if (tokens.length - this.#start > this.#blockSize) {
      this.#start = tokens.length - this.#blockSize;
      this.#pos = 0;
    }
    const fresh = tokens.slice(this.#start + this.#pos);
    const logits = model.forwardCached(fresh, this.#layers, this.#pos);
    this.#pos += fresh.length;
    return logits.toFloat32();
  }

  dispose(): void {
    for (const m of this.#memory) this.#ctx.freePersistent(m);
  }
}
