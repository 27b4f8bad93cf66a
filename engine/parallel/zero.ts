// ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
// Models") on the data-parallel replica: which elements of the model a rank owns.
//
// The gradient buckets are what the collective moves; each bucket is a buffer of its
// parameters' elements, in order. Rank r of N owns segment r of every bucket (the segment a
// reduce-scatter leaves summed on rank r: collective.ts's segment()), so a bucket's
// reduce-scatter hands each rank exactly the gradients it updates, and an all-gather of the
// bucket gives every rank every updated parameter. A rank's partition is the union of its
// segments, as ranges of the parameter slab (a segment that spans several parameters is cut at
// their edges), packed one after another: the layout of its optimizer state and, at stage 2, of
// the gradients it keeps.
//
//   stage 1: the optimizer state is partitioned (each rank updates only its partition, then the
//            parameters are all-gathered)
//   stage 2: the gradients too (reduce-scattered; backward writes into its scratch arena and the
//            rank keeps only its partition's sums between steps)
//   stage 3: the parameters too (each rank keeps its partition; a bucket's parameters are
//            all-gathered as forward and backward need them, and freed after)
// zeroPartitions says it in one line per stage, for the CLI's help and a job's report.
import type { UpdateRange } from "../optim/optimizer.ts";
import type { ParamEntry } from "../params.ts";
import { type Range, segment } from "./collective.ts";

export type ZeroStage = 0 | 1 | 2 | 3;

/** What each ZeRO stage partitions among the data-parallel ranks (stage 0: nothing). */
export const zeroPartitions: Readonly<Record<ZeroStage, string>> = {
  0: "nothing (every rank holds the parameters, the gradients and the optimizer state)",
  1: "the optimizer state",
  2: "the optimizer state and the gradients",
  3: "the optimizer state, the gradients and the parameters (gathered per bucket as forward and backward need them)",
};

/** A bucket as ZeRO sees it: its parameters in buffer order. */
export interface BucketEntries {
  entries: readonly ParamEntry[];
  numel: number;
}

/** One owned range: where it is in its bucket's buffer, in the slab and in the partition. */
export interface OwnedRange extends UpdateRange {
  bucket: number;
  /** offset in the bucket's buffer */
  bucketOffset: number;
}

export interface Partition {
  rank: number;
  size: number;
  /** per bucket: the rank's segment of the bucket's buffer */
  segments: Range[];
  /** per bucket: the owned ranges inside it */
  ranges: OwnedRange[][];
  /** elements owned (the length of the packed state) */
  numel: number;
}

/** Rank `rank`'s partition of `buckets` among `size` ranks. */
export function partitionOf(buckets: readonly BucketEntries[], size: number, rank: number): Partition {
  if (!(Number.isInteger(size) && size >= 1 && Number.isInteger(rank) && rank >= 0 && rank < size))
    throw new RangeError(`a partition needs 0 <= rank < size, got rank ${rank} of ${size}`);
  let packed = 0;
  const segments: Range[] = [];
  const ranges: OwnedRange[][] = [];
  buckets.forEach((b, id) => {
    const seg = segment(b.numel, size, rank);
    segments.push(seg);
    const mine: OwnedRange[] = [];
    let at = 0;
    for (const e of b.entries) {
      const from = Math.max(seg.offset, at),
        to = Math.min(seg.offset + seg.count, at + e.numel);
      if (to > from) {
        mine.push({
          bucket: id,
          bucketOffset: from,
          paramOffset: e.offset + (from - at),
          stateOffset: packed,
          numel: to - from,
          decay: e.decay,
        });
        packed += to - from;
      }
      at += e.numel;
    }
    ranges.push(mine);
  });
  return { rank, size, segments, ranges, numel: packed };
}

/** The memory a rank holds for the model, in bytes, read from its allocations. */
export interface ModelMemory {
  stage: ZeroStage;
  ranks: number;
  params: number;
  /** elements with a parameter (padding excluded): the denominator of bytes per parameter */
  paramCount: number;
  /** the gradient slab (stages 0-1) or the partition's gradients (stage 2) */
  grads: number;
  optimizer: number;
  /** host buffers the buckets travel in (one bucket's worth each) */
  buckets: number;
  /** the scratch arena's high-water mark (activations; at stage 2 the step's gradients too) */
  arenaPeak: number;
  /** offload: host memory the optimizer runs in (f32 master parameters, gradients, its state) */
  host: number;
  /** stage 3: the most parameter bytes gathered at once (0 below stage 3) */
  gatheredPeak: number;
}

/** Bytes per parameter of the model state (parameters, gradients, optimizer state). */
export function bytesPerParam(m: ModelMemory): number {
  return (m.params + m.grads + m.optimizer) / m.paramCount;
}
