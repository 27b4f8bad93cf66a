// Resuming a job: the config a resumed run takes (its earlier run's, with the options the user
// typed laid over it), and which of the differences its snapshots allow (the option table's
// resumable rows, and the regroupings each mode can load a snapshot into).
import type { JobConfig } from "./config.ts";
import { parseJobConfig, usesShards } from "./config.ts";
import {
  allJobOptions,
  applyOptions,
  type Draft,
  defaultDraft,
  type ModelKind,
  type OptimizerKind,
} from "./options.ts";
import { changeWorld, dataRanks, worldOf } from "./world.ts";

/**
 * Config keys a resumed job may change: where its data is read from and how often it is
 * evaluated and snapshotted. Every other key shapes the model or the trajectory, and a job's
 * snapshots are only valid for the values they were taken with, except that an all-reduce job
 * may resume on another number of trainers with the same global batch (trainers x batchSize).
 */
export const resumableKeys: readonly string[] = [
  ...new Set(allJobOptions.filter((r) => r.resumable !== undefined).map((r) => r.key)),
];

/** The trajectory-defining keys on which two configs of one job differ, as "key: a -> b". */
export function trajectoryDiff(was: JobConfig, now: JobConfig): string[] {
  const out: string[] = [];
  const walk = (a: unknown, b: unknown, path: string) => {
    if (
      a !== null &&
      b !== null &&
      typeof a === "object" &&
      typeof b === "object" &&
      !Array.isArray(a) &&
      !Array.isArray(b)
    ) {
      for (const k of [...new Set([...Object.keys(a), ...Object.keys(b)])].sort()) {
        walk((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k], path ? `${path}.${k}` : k);
      }
      return;
    }
    const [ja, jb] = [JSON.stringify(a), JSON.stringify(b)];
    if (ja !== jb) out.push(`${path}: ${ja ?? "(none)"} -> ${jb ?? "(none)"}`);
  };
  // all-reduce mode: the number of trainers may change with the same global batch (a snapshot
  // holds the whole replica, the sampler's steps cut the same samples whatever the ranks)
  const regrouped =
    was.sync === "allreduce" &&
    now.sync === "allreduce" &&
    dataRanks(was) * was.batchSize === dataRanks(now) * now.batchSize;
  // parameter-server mode: the snapshot's chunks are loaded into any number of shards (the
  // checkpoint service reshards them as the job's hash ring says)
  const resharded = usesShards(was) && usesShards(now);
  // either mode: the trainers may change at a step, which the world records (the sampler
  // re-splits the rest of the epoch among the new ranks)
  const last = worldOf(now).at(-1)!;
  const resized =
    last.from > 0 &&
    JSON.stringify(changeWorld(was, last.from, last.trainers, last.batchSize ?? was.batchSize)) ===
      JSON.stringify(worldOf(now));
  // ... and with them each trainer's batch, which the world records too (the micro-batches it is cut into follow)
  const rebatched = resized && last.batchSize !== undefined;
  const skip = new Set<string>([
    "job",
    ...resumableKeys,
    ...(regrouped ? ["trainers", "batchSize"] : []),
    ...(resharded ? ["shards"] : []),
    ...(resized ? ["trainers", "world"] : []),
    ...(rebatched ? ["batchSize", "accumSteps"] : []),
  ]);
  const strip = (c: JobConfig) => Object.fromEntries(Object.entries(c).filter(([k]) => !skip.has(k)));
  walk(strip(was), strip(now), "");
  return out;
}

/**
 * The config of a resumed run: its earlier run's, with the options the user typed (`given`, by
 * flag name) laid over it as each row lays its own; the caller then refuses any that change the
 * trajectory (trajectoryDiff), naming them.
 */
export function resumeConfig(prev: JobConfig, given: Readonly<Record<string, unknown>>): JobConfig {
  const cfg = structuredClone(prev) as unknown as Draft;
  // another model or optimizer: its defaults, under the options given (which trajectoryDiff then names)
  const model = (given.model ?? prev.model.kind) as ModelKind;
  const optimizer = (given.optimizer ?? prev.optimizer.kind) as OptimizerKind;
  if (model !== prev.model.kind || optimizer !== prev.optimizer.kind) {
    const fresh = defaultDraft(model, optimizer);
    if (model !== prev.model.kind) Object.assign(cfg, { model: fresh.model, dataset: fresh.dataset });
    cfg.optimizer = fresh.optimizer;
  }
  applyOptions(cfg, given);
  // the world the job had ends with its old trainers: resumed on others, the submission draws
  // the new world from the snapshot's step (resumedWorld in sdk/client.ts)
  if (cfg.trainers !== prev.trainers || cfg.batchSize !== prev.batchSize) cfg.world = [];
  return parseJobConfig(cfg);
}
