// LayerNorm over the last dim, weight 1 and bias 0 at init.
import { layerNorm, layerNormEps } from "../ops/layernorm.ts";
import type { Param, ParamBuilder } from "../params.ts";
import type { DType } from "../../ffi/backend.ts";
import type { Tensor } from "../tensor.ts";

export class LayerNorm {
  readonly weight: Param;
  readonly bias: Param;

  constructor(
    pb: ParamBuilder,
    name: string,
    readonly dim: number,
    readonly eps = layerNormEps,
  ) {
    this.weight = pb.add(`${name}.weight`, [dim], { kind: "ones" }, false);
    this.bias = pb.add(`${name}.bias`, [dim], { kind: "zeros" }, false);
  }

  /** `out`: f32, or the autocast type for a norm only GEMMs read (ops/layernorm.ts) */
  forward(x: Tensor, out: DType = "f32"): Tensor {
    return layerNorm(x, this.weight.tensor, this.bias.tensor, this.eps, out);
  }
}
