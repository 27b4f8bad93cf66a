// Distributed sampling with the semantics of PyTorch's DistributedSampler (shuffle=True,
// seeded per epoch, disjoint slices per rank), but without padding or dropping: every
// training sample is visited exactly once per epoch across the W ranks.
//
// Step s of an epoch covers positions [s*W*B, (s+1)*W*B) of the epoch's permutation; rank r
// takes its share of that range (B each; in the last, shorter step the remainder is split as
// evenly as possible, so a rank may get fewer, or none, when fewer than W samples remain).
// A cursor is therefore just (epoch, step): nothing else is needed to resume exactly.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { defaultMnistDir } from "../../engine/data/mnist.ts";
import { epochOrder, trainValSplit } from "../../engine/data/sampler.ts";
import type { JobConfig } from "../runtime/job.ts";

export const stepsPerEpochOf = (samples: number, W: number, B: number): number => Math.ceil(samples / (W * B));

/** [start, start+count) positions of the epoch permutation that rank r trains on at step s. */
export function rankSlice(samples: number, W: number, B: number, step: number, rank: number): { start: number; count: number } {
  const base = step * W * B;
  const R = Math.max(0, Math.min(W * B, samples - base));
  const q = Math.floor(R / W), rem = R % W;
  return { start: base + rank * q + Math.min(rank, rem), count: q + (rank < rem ? 1 : 0) };
}

/** Sample counts of the job's dataset, read from the idx headers (not the data). */
export function datasetCounts(cfg: JobConfig): { train: number; test: number } {
  const dir = cfg.dataDir || defaultMnistDir();
  const count = (name: string) => {
    const bytes = readFileSync(join(dir, name)).subarray(0, 8);
    return new DataView(bytes.buffer, bytes.byteOffset, 8).getUint32(4, false);
  };
  return { train: count("train-labels-idx1-ubyte"), test: count("t10k-labels-idx1-ubyte") };
}

/** The job's training and validation sample ids (a seeded split of the training set). */
export function jobSplit(cfg: JobConfig, trainCount: number): { train: Uint32Array; val: Uint32Array } {
  return trainValSplit(trainCount, cfg.valFraction, cfg.seed);
}

export function totalSteps(cfg: JobConfig): number {
  const { train } = jobSplit(cfg, datasetCounts(cfg).train);
  return stepsPerEpochOf(train.length, cfg.trainers, cfg.batchSize) * cfg.epochs;
}

/** Sample ids of one epoch in training order (a seeded permutation of `ids`). */
export function epochIds(ids: Uint32Array, seed: number, epoch: number): Uint32Array {
  const order = epochOrder(ids.length, seed, epoch, true);
  const out = new Uint32Array(ids.length);
  for (let i = 0; i < ids.length; i++) out[i] = ids[order[i]!]!;
  return out;
}
