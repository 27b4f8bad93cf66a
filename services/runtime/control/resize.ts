// The control plane's resize: a running job's trainers or shards change at a step boundary.
//   1. a snapshot at the ranks' next step boundary (so that little is trained again);
//   2. the job is paused: its spec goes away, so every service closes it, and its record stays
//      running and says `resizing`;
//   3. once every service of the old sizes has closed it, the job opens again as its next
//      attempt with the new sizes, resuming from the newest snapshot that suits them. The
//      trainers change from the snapshot's step (the world: the sampler re-splits the rest of
//      the epoch); the shards take the snapshot's chunks as the new hash ring says.
// When anything fails after the job was paused, it goes on as it was. The checkpoint service
// hosts it (it holds the snapshots); what it needs of that service is the ResizeHost below.
import { decodeDataPlan, type DataPlan } from "../../../schemas/messages/data-loader.ts";
import { encodeJobRequest, encodeJobSpec } from "../../../schemas/messages/job.ts";
import { type Manifest } from "../../../schemas/messages/checkpoint.ts";
import type { Bus } from "../mesh/bus.ts";
import {
  BadRequestError,
  DeadlineError,
  JobStateError,
  NoRespondersError,
  NotReadyError,
  UnknownJobError,
} from "../mesh/errors.ts";
import type { Logger } from "../mesh/log.ts";
import { dataRanks, type JobConfig, parseJobConfig, specOfConfig, usesShards } from "../job/config.ts";
import { subjects } from "../job/subjects.ts";
import { type JobControl, resizingReasonPrefix } from "../job/ledger.ts";
import { changeWorld } from "../job/world.ts";

export interface ResizeLimits {
  /** how long it waits for the snapshot it asks the ranks for (then it resumes from the newest one) */
  snapshotWaitMs: number;
  /** how long every service gets to close the job once it is paused */
  closeWaitMs: number;
  /** the data-loader's plan of the resized job */
  planTimeoutMs: number;
}

/** What a resize needs of the service that hosts it. */
export interface ResizeHost {
  bus: Bus;
  control: JobControl | undefined;
  log: Logger | undefined;
  /** the job's running submission and its plan */
  attempt: number;
  plan: DataPlan;
  /** the step of the job's newest snapshot on disk (-1: none) */
  newestStep(): number;
  /** whether the job is still the one this resize began on (not ended or reopened) */
  current(): boolean;
  /** from now on no snapshot is taken (the ranks are about to stop) */
  stopSaves(): Promise<void>;
  /** resolves when the snapshots being written are on disk */
  written(): Promise<void>;
  /** the newest snapshot that verifies and that the job can resume from on `next`'s world */
  resumable(cfg: JobConfig): Manifest;
  /** an event for the job's followers */
  note(step: number, text: string): void;
}

/** The ranks a resize leaves behind because their host is lost: they cannot take a snapshot or close the job. */
export interface LeftBehind {
  trainers: readonly number[];
  shards: readonly number[];
}

/**
 * Resizes job `cfg` to the sizes `tag` names ("trainers <n> shards <m>"); returns the manifest it
 * resumed from. Refusals (bad sizes, a job without records, one being resized) come before
 * anything stops. With `lost`, the resize goes on without those ranks: it asks for no snapshot
 * (the others wait for the lost ones, so no step ends) and resumes from the newest one, and it
 * does not wait for the lost ranks to close the job.
 */
export async function resizeJob(
  cfg: JobConfig,
  tag: string,
  host: ResizeHost,
  limits: ResizeLimits,
  lost: LeftBehind = { trainers: [], shards: [] },
): Promise<Manifest> {
  const job = cfg.job;
  const pause = host.control?.pause?.bind(host.control),
    resume = host.control?.resume?.bind(host.control);
  if (!pause || !resume)
    throw new NotReadyError(`this checkpoint service keeps no job records, so it cannot resize job ${job}`);
  const { trainers, shards } = resizeSizes(cfg, tag);
  // a snapshot at the next step boundary, so that little is trained again
  if (lost.trainers.length + lost.shards.length === 0) {
    const before = host.newestStep();
    host.bus.publish(subjects.checkpointNow(job), new Uint8Array(0));
    const waitUntil = Date.now() + limits.snapshotWaitMs;
    while (host.newestStep() <= before && Date.now() < waitUntil && host.current()) await Bun.sleep(100);
  }
  if (!host.current()) throw new JobStateError(`job ${job} ended or was reopened while it was being resized`);
  await host.stopSaves(); // no save after this one: the ranks stop
  const why = `${resizingReasonPrefix}trainers ${cfg.trainers} -> ${trainers}, shards ${cfg.shards} -> ${shards}`;
  if (!(await pause(job, host.attempt, why)))
    throw new JobStateError(`job ${job} is not running as submission ${host.attempt}; nothing resized`);
  try {
    await waitClosed(host.bus, cfg, limits.closeWaitMs, lost);
    await host.written(); // the snapshot asked for is on disk
    const snap = host.resumable(cfg);
    // going on without lost ranks keeps the trajectory where it can: the same global batch
    const batch = lost.trainers.length > 0 ? keptBatch(cfg, trainers) : null;
    const next = parseJobConfig({
      ...cfg,
      trainers,
      shards,
      ...batch,
      world: changeWorld(cfg, snap.step, trainers, batch?.batchSize ?? cfg.batchSize),
    });
    const plan = decodeDataPlan(
      await host.bus.request(subjects.planJob, encodeJobSpec(specOfConfig(next)), limits.planTimeoutMs),
      1 << 20,
    );
    const written = await resume(specOfConfig(next, { attempt: host.attempt + 1, plan }), plan.totalSteps);
    if (written === null) throw new JobStateError(`job ${job} ended while it was being resized`);
    host.log?.warn({ job, step: snap.step, trainers, shards }, "job resized");
    host.note(
      snap.step,
      `resized from step ${snap.step} (${snap.id}): trainers ${cfg.trainers} -> ${trainers}, shards ${cfg.shards} -> ${shards}` +
        (batch === null
          ? ""
          : `, each trainer's batch ${cfg.batchSize} -> ${batch.batchSize} (the global batch kept)`) +
        `; ${plan.totalSteps} steps in all`,
    );
    return snap;
  } catch (err) {
    // the job goes on as it was: its own spec again (as the next attempt, so that every service opens it anew)
    host.log?.error({ job, err: (err as Error).message }, "resize failed; the job goes on with its sizes");
    await resume(specOfConfig(cfg, { attempt: host.attempt + 1, plan: host.plan }), host.plan.totalSteps).catch(
      (again: unknown) => {
        host.log?.error({ job, err: (again as Error).message }, "cannot reopen the job after a failed resize");
      },
    );
    throw err;
  }
}

/**
 * Each trainer's batch (and its micro-batches) that keeps the job's global batch on `trainers`
 * trainers, the micro-batch unchanged; null where the global batch does not split so.
 */
export function keptBatch(cfg: JobConfig, trainers: number): { batchSize: number; accumSteps: number } | null {
  const global = dataRanks(cfg) * cfg.batchSize;
  const micro = cfg.batchSize / cfg.accumSteps;
  if (global % trainers !== 0 || (global / trainers) % micro !== 0) return null;
  const batchSize = global / trainers;
  const accumSteps = batchSize / micro;
  return batchSize <= 1 << 16 && accumSteps <= 1024 ? { batchSize, accumSteps } : null;
}

/** The sizes a resize's tag names, checked against the job: they must change it and make a job. */
function resizeSizes(cfg: JobConfig, tag: string): { trainers: number; shards: number } {
  const job = cfg.job;
  const m = /^trainers (\d{1,2}) shards (\d{1,2})$/.exec(tag);
  if (m === null)
    throw new BadRequestError(
      `a resize names its sizes as "trainers <n> shards <m>", not ${JSON.stringify(tag.slice(0, 64))}`,
    );
  const trainers = Number(m[1]),
    shards = Number(m[2]);
  if (trainers === cfg.trainers && shards === cfg.shards)
    throw new BadRequestError(`job ${job} runs ${trainers} trainers and ${shards} shards already`);
  if (!usesShards(cfg) && shards !== cfg.shards)
    throw new BadRequestError(`job ${job} runs in all-reduce mode: it has no shards to resize`);
  // the new settings must make a job (refused now, before anything stops)
  parseJobConfig({ ...cfg, trainers, shards, world: changeWorld(cfg, Number.MAX_SAFE_INTEGER, trainers) });
  return { trainers, shards };
}

/** Waits until every service of the job's sizes but the lost ones has closed it (`waitMs` at most). */
async function waitClosed(bus: Bus, cfg: JobConfig, waitMs: number, lost: LeftBehind): Promise<void> {
  const job = cfg.job;
  const req = encodeJobRequest({ job, step: 0, tag: "" });
  const closed = async (subject: string): Promise<boolean> => {
    try {
      await bus.request(subject, req, 2_000);
      return false;
    } catch (err) {
      return err instanceof UnknownJobError || err instanceof NoRespondersError;
    }
  };
  const who = [
    [`mt.${job}.data.stats`, "the data-loader"],
    ...Array.from({ length: cfg.trainers }, (_, r) => r)
      .filter((r) => !lost.trainers.includes(r))
      .map((r) => [subjects.trainerStats(job, r), `trainer ${r}`] as const),
    ...(usesShards(cfg) ? Array.from({ length: cfg.shards }, (_, k) => k) : [])
      .filter((k) => !lost.shards.includes(k))
      .map((k) => [subjects.psStats(job, k), `shard ${k}`] as const),
  ] as const;
  const until = Date.now() + waitMs;
  for (;;) {
    const open = (
      await Promise.all(who.map(async ([subject, name]) => ((await closed(subject)) ? null : name)))
    ).filter((x) => x !== null);
    if (open.length === 0) return;
    if (Date.now() > until)
      throw new DeadlineError(`${open.join(", ")} still run job ${job} ${waitMs} ms after it was paused for a resize`);
    await Bun.sleep(200);
  }
}

/**
 * The resize that leaves a lost host's ranks behind ("trainers <n> shards <m>" and who is left),
 * or why the job cannot go on without it. A rank is its process's identity (its subjects, its
 * NATS user), so the ranks that remain keep their numbers: only the highest trainers and shards
 * can be left behind.
 */
export function shrinkWithout(
  cfg: JobConfig,
  host: string,
  who: readonly string[],
): { tag: string; lost: LeftBehind } | { refused: string } {
  // (a rank the job does not have is no rank of it)
  const rankOf = (kind: string, of: number) =>
    who
      .flatMap((w) => {
        const m = new RegExp(`^${kind} (\\d+)$`).exec(w);
        return m === null ? [] : [Number(m[1])];
      })
      .filter((r) => r < of)
      .sort((a, b) => a - b);
  const trainers = rankOf("trainer", cfg.trainers);
  const shards = usesShards(cfg) ? rankOf("shard", cfg.shards) : [];
  const others = who.filter((w) => !/^(trainer|shard) \d+$/.test(w));
  const waits = "; the job waits for the host";
  if (others.length > 0) return { refused: `host ${host} runs the ${others.join(" and the ")}${waits}` };
  if (cfg.pipelineStages > 1 || cfg.tensorParallel > 1)
    return { refused: `host ${host} holds ranks of a model-parallel job, which is not resized${waits}` };
  if (trainers.length + shards.length === 0) return { refused: `host ${host} runs none of the job's ranks` };
  const top = (lost: number[], of: number) => lost.every((r, i) => r === of - lost.length + i);
  if (!top(trainers, cfg.trainers) || !top(shards, cfg.shards)) {
    const kept = [
      ...trainers.filter((r) => r < cfg.trainers - trainers.length).map((r) => `trainer ${r}`),
      ...shards.filter((k) => k < cfg.shards - shards.length).map((k) => `shard ${k}`),
    ];
    return {
      refused:
        `host ${host} runs ${kept.join(", ")}: a rank is its process's identity, so only the highest ` +
        `trainers and shards can be left behind${waits}`,
    };
  }
  if (trainers.length === cfg.trainers) return { refused: `host ${host} runs every trainer of the job${waits}` };
  if (usesShards(cfg) && shards.length === cfg.shards)
    return { refused: `host ${host} runs every shard of the job${waits}` };
  return {
    tag: `trainers ${cfg.trainers - trainers.length} shards ${cfg.shards - shards.length}`,
    lost: { trainers, shards },
  };
}
