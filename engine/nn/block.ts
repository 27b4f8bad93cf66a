// Transformer block (GPT-2, pre-norm):
//   x = x + dropout(proj(attn(ln1(x))))
//   x = x + dropout(fc2(gelu(fc1(ln2(x)))))
// x (B,T,C); attention over a fused qkv projection (C -> 3C).
import { add } from "../ops/add.ts";
import { causalSelfAttention } from "../ops/attention.ts";
import { dropout } from "../ops/dropout.ts";
import { gelu } from "../ops/gelu.ts";
import type { ParamBuilder } from "../params.ts";
import type { Tensor } from "../tensor.ts";
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

  constructor(
    pb: ParamBuilder,
    name: string,
    readonly config: BlockConfig,
  ) {
    const C = config.nEmbd;
    const std = 0.02;
    // GPT-2: residual projections scaled by 1/sqrt(2 n_layer), so the residual stream's
    // variance does not grow with depth
    const projStd = 0.02 / Math.sqrt(2 * config.nLayer);
    const zeros = { kind: "zeros" } as const;
    this.ln1 = new LayerNorm(pb, `${name}.ln_1`, C);
    this.attn = new Linear(pb, `${name}.attn.c_attn`, C, 3 * C, { weightInit: { kind: "normal", std }, biasInit: zeros });
    this.attnProj = new Linear(pb, `${name}.attn.c_proj`, C, C, { weightInit: { kind: "normal", std: projStd }, biasInit: zeros });
    this.ln2 = new LayerNorm(pb, `${name}.ln_2`, C);
    this.fc = new Linear(pb, `${name}.mlp.c_fc`, C, 4 * C, { weightInit: { kind: "normal", std }, biasInit: zeros });
    this.fcProj = new Linear(pb, `${name}.mlp.c_proj`, 4 * C, C, { weightInit: { kind: "normal", std: projStd }, biasInit: zeros });
  }

  /** The block's parameter tensors (what a recomputation of forward reads besides its input). */
  parameters(): Tensor[] {
    return [this.ln1, this.attn, this.attnProj, this.ln2, this.fc, this.fcProj].flatMap((m) =>
      [m.weight, m.bias].flatMap((p) => (p === null ? [] : [p.tensor])),
    );
  }

  forward(x: Tensor): Tensor {
    const p = this.config.dropout;
    const a = causalSelfAttention(this.attn.forward(this.ln1.forward(x)), this.config.nHead);
    x = add(x, dropout(this.attnProj.forward(a), p));
    const h = gelu(this.fc.forward(this.ln2.forward(x)));
    return add(x, dropout(this.fcProj.forward(h), p));
  }
}
