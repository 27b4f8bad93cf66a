// mlp: a multilayer perceptron classifier of any widths, e.g. 784-800-10 for MNIST.
import { ConfigError } from "../../ffi/errors.ts";
import { type Activation, MLP } from "../nn/mlp.ts";
import { softmaxCrossEntropy } from "../ops/crossentropy.ts";
import { ParamBuilder, ParamStore } from "../params.ts";
import type { Tensor } from "../tensor.ts";
import type { Context } from "../context.ts";
import { gemmFlops, type GemmShape, type Model, namesUnder } from "./model.ts";

export interface MlpConfig {
  widths: number[];
  activation: Activation;
  dropout: number;
}

export class MlpModel implements Model {
  readonly kind = "mlp";
  readonly store: ParamStore;
  readonly net: MLP;

  constructor(
    ctx: Context,
    readonly config: MlpConfig,
    seed: number,
  ) {
    if (!(config.dropout >= 0 && config.dropout < 1))
      throw new ConfigError(`mlp dropout must be in [0, 1), got ${config.dropout}`);
    const pb = new ParamBuilder();
    this.net = new MLP(pb, "mlp", config.widths, config.activation, config.dropout);
    this.store = ParamStore.build(ctx, pb, seed);
  }

  forward(x: Tensor): Tensor {
    return this.net.forward(x);
  }

  loss(x: Tensor, y: Tensor): Tensor {
    const logits = this.forward(x);
    const loss = softmaxCrossEntropy(logits, y);
    logits.drop();
    return loss;
  }

  /** loss() a layer at a time (the same ops in the same order as net.forward). */
  *lossSteps(x: Tensor, y: Tensor): Generator<readonly string[], Tensor, void> {
    const names = this.store.entries.map((e) => e.name);
    let h = x;
    for (let i = 0; i < this.net.layers.length; i++) {
      yield namesUnder(names, `mlp.${i}`);
      const next = this.net.layerForward(i, h);
      if (h !== x) h.drop();
      h = next;
    }
    const loss = softmaxCrossEntropy(h, y);
    h.drop();
    return loss;
  }

  gemmShapes(batch: number): GemmShape[] {
    const shapes: GemmShape[] = [];
    const w = this.config.widths;
    for (let i = 0; i + 1 < w.length; i++) {
      const [inF, outF] = [w[i]!, w[i + 1]!];
      shapes.push({ M: batch, N: outF, K: inF, transA: false, transB: true, batch: 1 }); // forward
      shapes.push({ M: outF, N: inF, K: batch, transA: true, transB: false, batch: 1 }); // dW
      // the first layer's input needs no gradient
      if (i > 0) shapes.push({ M: batch, N: inF, K: outF, transA: false, transB: false, batch: 1 }); // dX
    }
    return shapes;
  }

  gemmFlopsPerStep(batch: number): number {
    return gemmFlops(this.gemmShapes(batch));
  }
}
