// Linear: out (...,out) = inp (...,in) @ weight^T + bias; weight (out,in) as in PyTorch.
import { type Activation, linear } from "../ops/linear.ts";
import type { Init, Param, ParamBuilder, SliceOf } from "../params.ts";
import type { DType } from "../../ffi/backend.ts";
import type { Tensor } from "../tensor.ts";

export interface LinearOptions {
  bias?: boolean;
  weightInit?: Init;
  biasInit?: Init;
  /** a tensor-parallel rank's share of a larger layer's weight and bias (params.ts SliceOf) */
  weightSlice?: SliceOf;
  biasSlice?: SliceOf;
}

export class Linear {
  readonly weight: Param;
  readonly bias: Param | null;

  constructor(
    pb: ParamBuilder,
    name: string,
    readonly inFeatures: number,
    readonly outFeatures: number,
    options: LinearOptions = {},
  ) {
    // default: PyTorch's nn.Linear init, U(-1/sqrt(in), 1/sqrt(in))
    const bound = 1 / Math.sqrt(inFeatures);
    this.weight = pb.add(
      `${name}.weight`,
      [outFeatures, inFeatures],
      options.weightInit ?? { kind: "uniform", bound },
      true,
      options.weightSlice,
    );
    this.bias =
      options.bias === false
        ? null
        : pb.add(
            `${name}.bias`,
            [outFeatures],
            options.biasInit ?? { kind: "uniform", bound },
            false,
            options.biasSlice,
          );
  }

  /** x (...,in) -> act(x W^T + b) (...,out), one op (engine/ops/linear.ts); `out`: f32, or the
   *  autocast type for an output only GEMMs and attention read */
  forward(x: Tensor, activation: Activation = "none", out: DType = "f32"): Tensor {
    return linear(x, this.weight.tensor, this.bias?.tensor ?? null, activation, out);
  }
}
