// Who is on the mesh: every service registers with NATS service discovery ($SRV) under its name,
// trainers with their rank and parameter-server shards with their index in the metadata. The SDK
// checks a job against this before submitting it, and trainers check again when the job starts,
// so a job that needs ranks the mesh does not run fails at once, naming them, instead of waiting.
import { Svcm } from "@nats-io/services";
import type { NatsConnection } from "@nats-io/transport-node";
import type { NatsBus } from "./nats.ts";
import { CapacityError } from "./errors.ts";
import { pause } from "./pause.ts";
import type { TrainerPlace } from "../job/collective-plan.ts";

export interface MeshMembers {
  trainers: number[];
  /** host label of each trainer rank that gave one (the collective's topology) */
  trainerHosts?: Record<number, string>;
  /** where each trainer rank that said so runs: host, device, GPU, NCCL (the collective's plan) */
  trainerPlaces?: Record<number, TrainerPlace>;
  shards: number[];
  dataLoaders: number;
  checkpoints: number;
}

/** How long to collect $SRV.INFO replies: every live service answers within a few ms. */
export const discoveryWaitMs = 750;

/** The metadata of every `name` service that answers within waitMs; with `enough`, the answers
 *  so far as soon as it says they are enough (a job's ranks have all answered: no reason to
 *  wait out the window). */
async function infos(
  nc: NatsConnection,
  name: string,
  waitMs: number,
  enough?: (metas: Record<string, string>[]) => boolean,
): Promise<Record<string, string>[]> {
  // @nats-io/services is built against its own copy of nats-core; the protocol object is the same
  const svcm = new Svcm(nc as unknown as ConstructorParameters<typeof Svcm>[0]);
  const out: Record<string, string>[] = [];
  if (enough?.(out)) return out;
  try {
    const it = await svcm.client({ strategy: "timer", maxWait: waitMs }).info(name);
    for await (const info of it) {
      out.push(info.metadata ?? {});
      if (enough?.(out)) break;
    }
  } catch (e) {
    // nobody answers: none of these runs (the server says so at once, before the timer), or
    // those that run did not answer within the window (a machine under load, a link cut off):
    // the same to the caller, who asks again while it waits for them
    if (!/no responders|timeout/i.test(`${(e as Error).name} ${(e as Error).message}`)) throw e;
  }
  return out;
}

const indices = (metas: Record<string, string>[], key: string): number[] =>
  [...new Set(metas.map((m) => Number(m[key])).filter((n) => Number.isInteger(n) && n >= 0))].sort((a, b) => a - b);

/** Whether the answers hold every index from 0 to n - 1 under `key`. */
const holdsIndices = (metas: Record<string, string>[], key: string, n: number): boolean =>
  indices(metas, key).filter((i) => i < n).length === n;

/**
 * Who is on the mesh: every service that answers within waitMs. With `needs`, only whether the
 * mesh runs what a job needs: each kind of service stops being waited for once the ones the job
 * needs have answered (the lists may then leave out others that run).
 */
export async function meshMembers(
  bus: NatsBus,
  o: { waitMs?: number; needs?: Omit<MeshNeeds, "job"> } = {},
): Promise<MeshMembers> {
  const nc = bus.nc;
  const waitMs = o.waitMs ?? discoveryWaitMs;
  const n = o.needs;
  const shardsNeeded = n === undefined ? 0 : n.sync === "allreduce" ? 0 : n.shards;
  const enough: Record<string, ((metas: Record<string, string>[]) => boolean) | undefined> =
    n === undefined
      ? {}
      : {
          trainer: (m) => holdsIndices(m, "rank", n.trainers),
          "parameter-server": (m) => holdsIndices(m, "shard", shardsNeeded),
          "data-loader": (m) => m.length > 0,
          checkpoint: (m) => m.length > 0,
        };
  const [trainers, shards, loaders, checkpoints] = await Promise.all(
    ["trainer", "parameter-server", "data-loader", "checkpoint"].map((name) => infos(nc, name, waitMs, enough[name])),
  );
  const trainerHosts: Record<number, string> = {};
  const trainerPlaces: Record<number, TrainerPlace> = {};
  for (const m of trainers!) {
    if (!(Number.isInteger(Number(m.rank)) && typeof m.host === "string" && m.host !== "")) continue;
    trainerHosts[Number(m.rank)] = m.host;
    // a trainer of an earlier version says nothing of its device: the plan treats it as unknown
    if (typeof m.device === "string")
      trainerPlaces[Number(m.rank)] = { host: m.host, device: m.device, gpu: m.gpu ?? "", nccl: m.nccl === "yes" };
  }
  return {
    trainers: indices(trainers!, "rank"),
    trainerHosts,
    trainerPlaces,
    shards: indices(shards!, "shard"),
    dataLoaders: loaders!.length,
    checkpoints: checkpoints!.length,
  };
}

export interface MetricsEndpoint {
  /** the service, with its rank or shard: "trainer 1", "parameter-server 0", "data-loader" */
  service: string;
  /** its Prometheus endpoint, http://host:port/metrics */
  url: string;
}

/** Every service's Prometheus endpoint, from $SRV metadata (services run with metricsPort -1 have none). */
export async function metricsEndpoints(bus: NatsBus, waitMs = discoveryWaitMs): Promise<MetricsEndpoint[]> {
  const nc = bus.nc;
  const names = ["trainer", "parameter-server", "data-loader", "checkpoint"];
  const all = await Promise.all(names.map((n) => infos(nc, n, waitMs)));
  return names
    .flatMap((name, i) =>
      all[i]!.filter((m) => typeof m.metrics === "string" && m.metrics !== "").map((m) => ({
        service: m.rank !== undefined ? `${name} ${m.rank}` : m.shard !== undefined ? `${name} ${m.shard}` : name,
        url: m.metrics!,
      })),
    )
    .sort((a, b) => a.service.localeCompare(b.service, "en", { numeric: true }));
}

/** "0-2", "0,2,5": a compact list of indices. */
export function indexList(ids: readonly number[]): string {
  if (ids.length === 0) return "none";
  const runs: string[] = [];
  for (let i = 0; i < ids.length; ) {
    let j = i;
    while (j + 1 < ids.length && ids[j + 1] === ids[j]! + 1) j++;
    runs.push(i === j ? `${ids[i]}` : `${ids[i]}-${ids[j]}`);
    i = j + 1;
  }
  return runs.join(",");
}

/** What the job needs that the mesh lacks, each as a phrase; empty when it can run. */
/** What a job needs of the mesh: its ranks and shards (none in all-reduce mode). */
export interface MeshNeeds {
  job: string;
  trainers: number;
  shards: number;
  sync?: string;
}

/** A job's trainer ranks alone (and the services every job needs): what its collective's plan
 *  reads from discovery. */
export const rankNeeds = (cfg: { job: string; trainers: number }): MeshNeeds => ({
  job: cfg.job,
  trainers: cfg.trainers,
  shards: 0,
});

export function missingMembers(cfg: Omit<MeshNeeds, "job">, m: MeshMembers): string[] {
  const lack = (want: number, have: readonly number[]) =>
    Array.from({ length: want }, (_, i) => i).filter((i) => !have.includes(i));
  // an all-reduce job needs no shard
  const ranks = lack(cfg.trainers, m.trainers),
    shards = lack(cfg.sync === "allreduce" ? 0 : cfg.shards, m.shards);
  const out: string[] = [];
  if (ranks.length > 0) out.push(`trainer rank${ranks.length > 1 ? "s" : ""} ${indexList(ranks)}`);
  if (shards.length > 0) out.push(`parameter-server shard${shards.length > 1 ? "s" : ""} ${indexList(shards)}`);
  if (m.dataLoaders === 0) out.push("a data-loader");
  if (m.checkpoints === 0) out.push("a checkpoint service");
  return out;
}

/** One sentence: what the mesh runs and what the job lacks, and how to fix it. */
export function capacityMessage(cfg: MeshNeeds, m: MeshMembers, where: string, instead = "submit with"): string {
  // (an all-reduce job has no shards: --shards is refused with --sync allreduce)
  const allReduce = cfg.sync === "allreduce";
  return (
    `job ${cfg.job} needs ${missingMembers(cfg, m).join(", ")}, which the mesh at ${where} does not run ` +
    `(it runs trainer ranks ${indexList(m.trainers)}, shards ${indexList(m.shards)}, ${m.dataLoaders} data-loader(s), ${m.checkpoints} checkpoint service(s)); ` +
    `start a mesh that does (meshtrain mesh up --trainers ${Math.max(cfg.trainers, 1)}${allReduce ? "" : ` --shards ${Math.max(cfg.shards, 1)}`}), or ${instead} ` +
    `--trainers ${Math.max(m.trainers.length, 1)}${allReduce ? "" : ` --shards ${Math.max(m.shards.length, 1)}`}`
  );
}

/** Pause between looks while waiting for members to register, and the first look's window. */
const membersPollMs = 100;

/**
 * Waits until the mesh runs every rank, shard and service the job needs: true then; false when
 * `signal` aborts first; CapacityError naming what is missing when `waitMs` has passed (0: one
 * look). A busy service can miss one look's window, so callers give a few seconds at least.
 */
export async function awaitMembers(
  members: (needs?: MeshNeeds, windowMs?: number) => Promise<MeshMembers>,
  cfg: MeshNeeds,
  waitMs: number,
  where: string,
  signal?: AbortSignal,
  /** what the message offers besides a larger mesh: "submit with" (the default), "resize to" */
  instead?: string,
): Promise<boolean> {
  const deadline = Date.now() + waitMs;
  // a look's window grows while something is missing: a mesh that is starting is looked at
  // often, a busy one (slow to answer) is given discovery's whole window
  for (let windowMs = membersPollMs; ; windowMs = Math.min(2 * windowMs, discoveryWaitMs)) {
    if (signal?.aborted) return false;
    const m = await members(cfg, windowMs);
    if (missingMembers(cfg, m).length === 0) return true;
    // the message names everything the mesh runs: a look that waits for every answer
    if (Date.now() >= deadline) throw new CapacityError(capacityMessage(cfg, await members(), where, instead));
    await pause(membersPollMs, signal);
  }
}
