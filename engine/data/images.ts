// Batches of normalized images and their labels, built into reused host buffers.
import { hostKernels } from "../../ffi/cpu/host.ts";
import { ConfigError } from "../../ffi/errors.ts";
import type { HostBatch } from "../train.ts";
import { type MnistSplit, mnistMean, mnistStd } from "./mnist.ts";
import { epochOrder } from "./sampler.ts";

export class ImageBatcher {
  readonly features: number;
  /** batch()'s inputs, made on its first call (a data-loader sends pixels and never needs them) */
  #inputs: Float32Array | null = null;
  readonly #targets: Int32Array;
  readonly #lut = new Float32Array(256);
  #pixels: Uint8Array | null = null;

  /** the sample ids this batcher draws from (a train or validation subset), default all */
  readonly ids: Uint32Array;

  constructor(
    readonly split: MnistSplit,
    readonly batchSize: number,
    ids?: Uint32Array,
  ) {
    if (!Number.isInteger(batchSize) || batchSize < 1)
      throw new ConfigError(`batch size must be an integer >= 1, got ${batchSize}`);
    this.features = split.rows * split.cols;
    this.#targets = new Int32Array(batchSize);
    for (let v = 0; v < 256; v++) this.#lut[v] = (v / 255 - mnistMean) / mnistStd;
    // plain loops: a plan request builds three batchers of the whole split, and the callback
    // forms (Uint32Array.from, some) were most of a data-loader's time answering one
    if (ids === undefined) {
      this.ids = new Uint32Array(split.count);
      for (let i = 0; i < split.count; i++) this.ids[i] = i;
    } else {
      this.ids = ids;
      for (let i = 0; i < ids.length; i++)
        if (ids[i]! >= split.count) throw new ConfigError(`sample id outside the ${split.count} samples`);
    }
  }

  /** The batch of samples order[start .. start+batchSize) (fewer at the end). Buffers are reused. */
  batch(order: ArrayLike<number>, start: number): HostBatch {
    const n = Math.min(this.batchSize, order.length - start);
    const F = this.features;
    const { images, labels } = this.split;
    const inputs = (this.#inputs ??= new Float32Array(this.batchSize * F));
    const kernels = hostKernels();
    for (let i = 0; i < n; i++) {
      const s = order[start + i]!;
      // in C: in JavaScript this loop was a fifth of `train mlp`'s time
      kernels.lookup(inputs.subarray(i * F, (i + 1) * F), images.subarray(s * F, (s + 1) * F), this.#lut);
      this.#targets[i] = labels[s]!;
    }
    return {
      inputs: n === this.batchSize ? inputs : inputs.subarray(0, n * F),
      inputShape: [n, F],
      targets: n === this.batchSize ? this.#targets : this.#targets.subarray(0, n),
      targetShape: [n],
    };
  }

  /** The input each pixel value stands for (pixel / 255, normalized): what batch() writes. */
  get pixelValues(): Float32Array {
    return this.#lut;
  }

  /**
   * The raw 8-bit pixels of samples order[start .. start+batchSize) and their labels: the same
   * batch as batch(), a quarter of the bytes (inputs are pixelValues[pixel]). Buffers are reused.
   */
  pixelBatch(order: ArrayLike<number>, start: number): { pixels: Uint8Array; targets: Int32Array } {
    const n = Math.min(this.batchSize, order.length - start);
    const F = this.features;
    const { images, labels } = this.split;
    this.#pixels ??= new Uint8Array(this.batchSize * F);
    for (let i = 0; i < n; i++) {
      const s = order[start + i]!;
      this.#pixels.set(images.subarray(s * F, (s + 1) * F), i * F);
      this.#targets[i] = labels[s]!;
    }
    return { pixels: this.#pixels.subarray(0, n * F), targets: this.#targets.subarray(0, n) };
  }

  /** Batches per epoch: with dropLast the incomplete tail is skipped (it is reshuffled next epoch). */
  batchesPerEpoch(dropLast: boolean): number {
    return dropLast ? Math.floor(this.ids.length / this.batchSize) : Math.ceil(this.ids.length / this.batchSize);
  }

  /** This batcher's samples, in a seeded order per epoch. */
  *epoch(seed: number, epoch: number, shuffle: boolean, dropLast: boolean): Generator<HostBatch> {
    const positions = epochOrder(this.ids.length, seed, epoch, shuffle);
    const order = positions.map((p) => this.ids[p]!);
    const batches = this.batchesPerEpoch(dropLast);
    for (let b = 0; b < batches; b++) yield this.batch(order, b * this.batchSize);
  }
}
