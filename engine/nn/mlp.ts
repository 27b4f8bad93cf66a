// MLP: Linear layers of the given widths with an activation between them (none after the last),
// and optional dropout after each activation.
import { ConfigError } from "../../ffi/errors.ts";
import { dropout } from "../ops/dropout.ts";
import { gelu } from "../ops/gelu.ts";
import { relu } from "../ops/relu.ts";
import type { ParamBuilder } from "../params.ts";
import type { Tensor } from "../tensor.ts";
import { Linear } from "./linear.ts";

export type Activation = "relu" | "gelu";

export class MLP {
  readonly layers: Linear[] = [];

  constructor(
    pb: ParamBuilder,
    name: string,
    readonly widths: readonly number[],
    readonly activation: Activation = "relu",
    readonly dropoutP = 0,
  ) {
    if (widths.length < 2 || widths.some((w) => !Number.isInteger(w) || w <= 0)) {
      throw new ConfigError(`MLP widths must be at least two positive integers, got [${widths.join(", ")}]`);
    }
    for (let i = 0; i + 1 < widths.length; i++) {
      const fanIn = widths[i]!;
      // He (Kaiming) normal init for layers followed by ReLU; biases start at zero
      const std = activation === "relu" && i + 2 < widths.length ? Math.sqrt(2 / fanIn) : Math.sqrt(1 / fanIn);
      this.layers.push(
        new Linear(pb, `${name}.${i}`, fanIn, widths[i + 1]!, {
          weightInit: { kind: "normal", std },
          biasInit: { kind: "zeros" },
        }),
      );
    }
  }

  forward(x: Tensor): Tensor {
    let h = x;
    for (let i = 0; i < this.layers.length; i++) {
      const next = this.layerForward(i, h);
      if (h !== x) h.drop();
      h = next;
    }
    return h;
  }

  /** Layer i, and the activation and dropout after it (none after the last); what it made and
   *  read for the last time is dropped (Tensor.drop). */
  layerForward(i: number, h: Tensor): Tensor {
    const z = this.layers[i]!.forward(h);
    if (i + 1 === this.layers.length) return z;
    const a = this.activation === "relu" ? relu(z) : gelu(z);
    z.drop();
    const d = dropout(a, this.dropoutP);
    if (d !== a) a.drop();
    return d;
  }
}
