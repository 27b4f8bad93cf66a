// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): a transformer block's large matrices
// cut across T ranks, each holding 1/T of them.
//
//   attention  the fused QKV projection is column-parallel: rank t keeps the rows of its heads
//              (nHead/T of them) in each of Q, K and V, and computes its heads' attention alone;
//              the output projection is row-parallel: rank t keeps the columns that read its
//              heads, and its product is a partial sum of the output.
//   MLP        the first linear is column-parallel (4C/T of its outputs), GELU is elementwise,
//              the second linear row-parallel.
// Two operators join the ranks (the paper's f and g):
//   copy    (f) identity in forward; in backward the input's gradient is the sum of every
//               rank's (each rank's column-parallel product back-propagates a part of it)
//   reduce  (g) the sum of every rank's partial output in forward; identity in backward
// so a block costs two all-reduces in forward and two in backward. Everything else (the layer
// norms, the biases of the row-parallel layers, the embeddings, the head) is replicated: its
// inputs and gradients are the same on every rank, so its copies stay equal without a reduction.
//
// The collectives are keyed by the step and a counter every rank advances alike (the ranks run
// the same ops in the same order), so each all-reduce meets its peers'.
import { EngineError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";
import type { Collective, OpKey } from "./collective.ts";

export interface TensorRank {
  readonly rank: number;
  readonly size: number;
}

/** The rows of a column-parallel fused QKV weight (3C, C) or bias (3C) that rank t keeps. */
export function qkvRows(C: number, tp: TensorRank): { offset: number; count: number }[] {
  const w = C / tp.size;
  return [0, 1, 2].map((k) => ({ offset: k * C + tp.rank * w, count: w }));
}

/** Rank t's contiguous share of n (rows of a column-parallel weight, columns of a row-parallel one). */
export function shareOf(n: number, tp: TensorRank): { offset: number; count: number } {
  const w = n / tp.size;
  return { offset: tp.rank * w, count: w };
}

export class TensorParallel implements TensorRank {
  #step = 0;
  #seq = 0;
  /** bytes all-reduced so far (forward and backward), and the time spent waiting for them */
  wireBytes = 0;
  waitMs = 0;

  constructor(readonly group: Collective) {}

  get rank(): number {
    return this.group.rank;
  }
  get size(): number {
    return this.group.size;
  }

  /** Starts a step's keys: every rank calls it with the same step before the step's first op.
   *  `base` sets another range of keys for other passes at that step (an evaluation's). */
  begin(step: number, base = 0): void {
    this.#step = step;
    this.#seq = base;
  }

  #key(): OpKey {
    return { step: this.#step, bucket: this.#seq++ };
  }

  async #allReduce(t: Tensor, key: OpKey): Promise<Float32Array> {
    const buf = t.toFloat32();
    this.wireBytes += buf.byteLength;
    const started = performance.now();
    await this.group.allReduce(buf, key);
    this.waitMs += performance.now() - started;
    return buf;
  }

  /** f: x itself in forward; its gradient summed over the ranks in backward. */
  copy(x: Tensor): Tensor {
    const ctx = x.ctx;
    if (this.size === 1) return x;
    const out = ctx.empty(x.shape);
    ctx.backend.copy(out.ptr, x.ptr, x.bytes);
    // the key is taken in forward order; backward runs the ops in reverse, and every rank alike
    ctx.record(
      "tp.copy",
      [x],
      out,
      async () => {
        const key = this.#key();
        const sum = await this.#allReduce(out.grad!, key);
        const g = ctx.fromArray(sum, x.shape);
        ctx.backend.axpy(x.ensureGrad().ptr, g.ptr, x.numel, 1);
        g.drop();
      },
      [],
    );
    return out;
  }

  /** g: the sum of every rank's x in forward; the gradient passes through in backward. */
  async reduce(x: Tensor): Promise<Tensor> {
    const ctx = x.ctx;
    if (x.dtype !== "f32") throw new EngineError(`tensor-parallel reduce: ${x.dtype} tensors are not summed here`);
    if (this.size === 1) return x;
    const sum = await this.#allReduce(x, this.#key());
    const out = ctx.fromArray(sum, x.shape);
    ctx.record(
      "tp.reduce",
      [x],
      out,
      () => {
        ctx.backend.axpy(x.ensureGrad().ptr, out.grad!.ptr, x.numel, 1);
      },
      [],
    );
    return out;
  }
}
