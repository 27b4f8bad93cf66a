// Linear: out (...,out) = inp (...,in) @ weight^T + bias; weight (out,in) as in PyTorch.
import { biasAdd } from "../ops/bias.ts";
import { matmul } from "../ops/matmul.ts";
import type { Init, Param, ParamBuilder } from "../params.ts";
import type { Tensor } from "../tensor.ts";

export interface LinearOptions {
  bias?: boolean;
  weightInit?: Init;
  biasInit?: Init;
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
    this.weight = pb.add(`${name}.weight`, [outFeatures, inFeatures], options.weightInit ?? { kind: "uniform", bound }, true);
    this.bias = options.bias === false ? null : pb.add(`${name}.bias`, [outFeatures], options.biasInit ?? { kind: "uniform", bound }, false);
  }

  forward(x: Tensor): Tensor {
    const y = matmul(x, this.weight.tensor, { transB: true });
    return this.bias === null ? y : biasAdd(y, this.bias.tensor);
  }
}
