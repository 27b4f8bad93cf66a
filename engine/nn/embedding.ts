// Embedding: a (V,C) table looked up by i32 ids.
import { embedding } from "../ops/embedding.ts";
import type { Init, Param, ParamBuilder } from "../params.ts";
import type { Tensor } from "../tensor.ts";

export class Embedding {
  readonly weight: Param;

  constructor(
    pb: ParamBuilder,
    name: string,
    readonly count: number,
    readonly dim: number,
    init: Init = { kind: "normal", std: 0.02 },
  ) {
    this.weight = pb.add(`${name}.weight`, [count, dim], init, true);
  }

  forward(ids: Tensor): Tensor {
    return embedding(this.weight.tensor, ids);
  }
}
