// Transformer block (GPT-2, pre-norm):
//   x = x + dropout(proj(attn(ln1(x))))
//   x = x + dropout(fc2(gelu(fc1(ln2(x)))))
// x (B,T,C); attention over a fused qkv projection (C -> 3C).
import { type DType, dtypeBytes } from "../../ffi/backend.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { ShapeError } from "../errors.ts";
import { activationDType } from "../mixed.ts";
import { add } from "../ops/add.ts";
import { biasAdd } from "../ops/bias.ts";
import { linear } from "../ops/linear.ts";
import { qkvRows, shareOf, type TensorParallel, type TensorRank } from "../parallel/tensor-parallel.ts";
import { attentionDecode, causalSelfAttention } from "../ops/attention.ts";
import { dropout } from "../ops/dropout.ts";
import { residualLayerNorm } from "../ops/layernorm.ts";
import type { ParamBuilder } from "../params.ts";
import { dropAll, type Tensor } from "../tensor.ts";
import { LayerNorm } from "./layernorm.ts";
import { Linear } from "./linear.ts";

export interface BlockConfig {
  nEmbd: number;
  nHead: number;
  nLayer: number;
  dropout: number;
}

export class Block {
  readonly ln1: LayerNorm;
  readonly attn: Linear;
  readonly attnProj: Linear;
  readonly ln2: LayerNorm;
  readonly fc: Linear;
  readonly fcProj: Linear;

  /** the ranks the block's matrices are cut across (engine/parallel/tensor-parallel.ts) */
  readonly tensor: TensorRank;

  constructor(
    pb: ParamBuilder,
    name: string,
    readonly config: BlockConfig,
    tensor: TensorRank = { rank: 0, size: 1 },
  ) {
    const C = config.nEmbd;
    const T = tensor.size;
    if (config.nHead % T !== 0)
      throw new ConfigError(`tensor parallelism over ${T} ranks needs nHead (${config.nHead}) divisible by ${T}`);
    this.tensor = tensor;
    const split = T > 1;
    const std = 0.02;
    // GPT-2: residual projections scaled by 1/sqrt(2 n_layer), so the residual stream's
    // variance does not grow with depth
    const projStd = 0.02 / Math.sqrt(2 * config.nLayer);
    const zeros = { kind: "zeros" } as const;
    this.ln1 = new LayerNorm(pb, `${name}.ln_1`, C);
    // column-parallel: this rank's heads' rows of Q, K and V; row-parallel: the columns that read them
    const qkv = qkvRows(C, tensor),
      heads = shareOf(C, tensor),
      hidden = shareOf(4 * C, tensor);
    this.attn = new Linear(pb, `${name}.attn.c_attn`, C, 3 * heads.count, {
      weightInit: { kind: "normal", std },
      biasInit: zeros,
      ...(split ? { weightSlice: { shape: [3 * C, C], rows: qkv }, biasSlice: { shape: [3 * C], rows: qkv } } : {}),
    });
    this.attnProj = new Linear(pb, `${name}.attn.c_proj`, heads.count, C, {
      weightInit: { kind: "normal", std: projStd },
      biasInit: zeros,
      ...(split ? { weightSlice: { shape: [C, C], cols: heads } } : {}),
    });
    this.ln2 = new LayerNorm(pb, `${name}.ln_2`, C);
    this.fc = new Linear(pb, `${name}.mlp.c_fc`, C, hidden.count, {
      weightInit: { kind: "normal", std },
      biasInit: zeros,
      ...(split
        ? { weightSlice: { shape: [4 * C, C], rows: [hidden] }, biasSlice: { shape: [4 * C], rows: [hidden] } }
        : {}),
    });
    this.fcProj = new Linear(pb, `${name}.mlp.c_proj`, hidden.count, C, {
      weightInit: { kind: "normal", std: projStd },
      biasInit: zeros,
      ...(split ? { weightSlice: { shape: [C, 4 * C], cols: hidden } } : {}),
    });
  }

  /** The block's parameter tensors (what a recomputation of forward reads besides its input). */
  parameters(): Tensor[] {
    return [this.ln1, this.attn, this.attnProj, this.ln2, this.fc, this.fcProj].flatMap((m) =>
      [m.weight, m.bias].flatMap((p) => (p === null ? [] : [p.tensor])),
    );
  }

  /**
   * forward() with the block's matrices cut across `tp`'s ranks: each computes its heads and its
   * share of the MLP, and the row-parallel outputs are summed over the ranks before their bias.
   * With one rank it computes what forward() does.
   */
  async forwardAsync(x: Tensor, tp: TensorParallel): Promise<Tensor> {
    if (tp.size !== this.tensor.size || tp.rank !== this.tensor.rank) {
      throw new ConfigError(
        `block built for tensor rank ${this.tensor.rank} of ${this.tensor.size}, run on rank ${tp.rank} of ${tp.size}`,
      );
    }
    const heads = this.config.nHead / tp.size;
    // as forward(), dropping each tensor once read for the last time; the row-parallel layers'
    // outputs are summed over the ranks before their bias
    const h1 = this.ln1.forward(x);
    const h1c = tp.copy(h1);
    if (h1c !== h1) h1.drop();
    const qkv = this.attn.forward(h1c);
    h1c.drop();
    const a = causalSelfAttention(qkv, heads);
    qkv.drop();
    const part = linear(a, this.attnProj.weight.tensor, null);
    a.drop();
    const attnOut = await tp.reduce(part);
    if (attnOut !== part) part.drop();
    const proj = biasAdd(attnOut, this.attnProj.bias!.tensor);
    attnOut.drop();
    const { sum: x2, out: h2 } = this.#attentionResidual(x, proj);
    const h2c = tp.copy(h2);
    if (h2c !== h2) h2.drop();
    const hidden = this.fc.forward(h2c, "gelu");
    h2c.drop();
    const part2 = linear(hidden, this.fcProj.weight.tensor, null);
    hidden.drop();
    const mlpOut = await tp.reduce(part2);
    if (mlpOut !== part2) part2.drop();
    const mlp = biasAdd(mlpOut, this.fcProj.bias!.tensor);
    mlpOut.drop();
    return this.#mlpResidual(x2, mlp);
  }

  /**
   * x (B,T,C) -> the block's output. Every tensor made here is dropped once read for the last
   * time (Tensor.drop): without gradients (evaluation, sampling) it is freed at once, so a pass
   * holds about one block's activations; with them it lives while backward needs it. The
   * attention's residual add and ln_2 are one op, and so are c_fc's bias and GELU.
   */
  forward(x: Tensor): Tensor {
    if (this.tensor.size > 1)
      throw new ConfigError("a tensor-parallel block runs with forwardAsync (its outputs are summed over the ranks)");
    // what only GEMMs and attention read is stored in the autocast type (engine/mixed.ts); the
    // residual stream and the branches added into it stay f32
    const act = activationDType(x.ctx.precision);
    const h1 = this.ln1.forward(x, act);
    const qkv = this.attn.forward(h1, "none", act);
    h1.drop();
    const a = causalSelfAttention(qkv, this.config.nHead);
    qkv.drop();
    return this.#afterAttention(x, a, act);
  }

  /**
   * forward() of x (1,T,C), the tokens at positions [pos, pos+T), for generation with a KV cache:
   * their fused q,k,v rows go into `cache` (blockSize,3C) at rows [pos, pos+T), and they attend
   * over the cache's rows [0, pos+T), the earlier tokens' keys and values computed by earlier
   * calls. With pos 0 it computes what forward() does (a prefill); with T = 1 one new token,
   * whose attention (attentionDecode) reads its own query row only: O(pos), as its GEMMs are O(1).
   * Otherwise (T rows after pos > 0, which generate() does not do) the causal kernel runs over
   * every cached row and the last T rows of its output are kept.
   */
  forwardCached(x: Tensor, cache: Tensor, pos: number): Tensor {
    const act = activationDType(x.ctx.precision);
    const [, T, C] = x.shape as [number, number, number];
    if (x.shape[0] !== 1 || cache.dtype !== act || cache.shape[1] !== 3 * C || pos + T > cache.shape[0]!)
      throw new ShapeError("block.forwardCached", [x.shape, cache.shape], `x (1,T,C), cache (blockSize,3C) of ${act}`);
    const h1 = this.ln1.forward(x, act);
    const qkv = this.attn.forward(h1, "none", act); // (1,T,3C)
    h1.drop();
    x.ctx.backend.copy(cache.narrowRows(pos, T).ptr, qkv.ptr, qkv.numel * dtypeBytes[act]);
    qkv.drop();
    const seen = cache.narrowRows(0, pos + T).reshape([1, pos + T, 3 * C]);
    // one new token: its row's attention alone; a prefill (pos 0): forward's attention
    if (T === 1) return this.#afterAttention(x, attentionDecode(seen, this.config.nHead), act);
    const all = causalSelfAttention(seen, this.config.nHead);
    // a view of the last T rows: all is dropped once a is read
    const a = all
      .reshape([pos + T, C])
      .narrowRows(pos, T)
      .reshape([1, T, C]);
    const out = this.#afterAttention(x, a, act);
    all.drop();
    return out;
  }

  /** The rest of forward() after the attention's output a (B,T,C): its projection, the residuals and the MLP. */
  #afterAttention(x: Tensor, a: Tensor, act: DType): Tensor {
    const proj = this.attnProj.forward(a);
    a.drop();
    const { sum: x2, out: h2 } = this.#attentionResidual(x, proj, act);
    const hidden = this.fc.forward(h2, "gelu", act);
    h2.drop();
    const mlp = this.fcProj.forward(hidden);
    hidden.drop();
    return this.#mlpResidual(x2, mlp);
  }

  /** x + dropout(proj) and ln_2 of it (one op; its output of `out`); proj and the branch are dropped. */
  #attentionResidual(x: Tensor, proj: Tensor, out: DType = "f32"): { sum: Tensor; out: Tensor } {
    const branch = dropout(proj, this.config.dropout);
    const r = residualLayerNorm(x, branch, this.ln2.weight.tensor, this.ln2.bias.tensor, this.ln2.eps, out);
    dropAll(proj, branch);
    return r;
  }

  /** x2 + dropout(mlp), the block's output; x2, mlp and the branch are dropped. */
  #mlpResidual(x2: Tensor, mlp: Tensor): Tensor {
    const branch = dropout(mlp, this.config.dropout);
    const out = add(x2, branch);
    dropAll(x2, mlp, branch);
    return out;
  }
}
