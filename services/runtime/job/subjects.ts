// The names on the mesh: a job's identity (two subject tokens, <owner>.<name>), the NATS
// subjects of a job and their checks, and the tags of its restores.
import { BadRequestError } from "../mesh/errors.ts";

/**
 * A job's identity on the mesh is `<owner>.<name>`: two subject tokens, so that NATS permissions
 * can give a client user the jobs of its owner only (mt.<owner>.*.…, roles.ts). The name a user
 * gives may leave the owner out; the SDK adds its own (qualifyJob).
 */
export const jobOwnerPattern = /^[A-Za-z0-9_-]{1,32}$/;
export const jobNamePattern = /^[A-Za-z0-9_-]{1,64}$/;
/** A job's full identity, `<owner>.<name>`. */
export const jobIdPattern = /^[A-Za-z0-9_-]{1,32}\.[A-Za-z0-9_-]{1,64}$/;
/** What a job may be called: a name, or a name with its owner. */
export const jobNameOrIdPattern = /^([A-Za-z0-9_-]{1,32}\.)?[A-Za-z0-9_-]{1,64}$/;
export const jobNameRule =
  "a job is <name> or <owner>.<name>: the name 1-64 letters, digits, _ or -; the owner 1-32 of them";
/** The owner of a client that names none (an open mesh's, and the local mesh's one client). */
export const defaultOwner = "default";
/** Owners that would read as the mesh's own subjects (mt.ctl.…). */
const reservedOwners = new Set(["ctl"]);

/** Why `owner` cannot own jobs; null when it can. */
export function ownerProblem(owner: string): string | null {
  if (!jobOwnerPattern.test(owner)) return `${JSON.stringify(owner)} is not an owner: 1-32 letters, digits, _ or -`;
  if (reservedOwners.has(owner))
    return `the owner ${JSON.stringify(owner)} is reserved (mt.${owner}.… are the mesh's own subjects)`;
  return null;
}

/** A job's full identity: `job` as it is when it names its owner, else `<owner>.<job>`. */
export function qualifyJob(job: string, owner: string): string {
  if (!jobNameOrIdPattern.test(job))
    throw new BadRequestError(`${JSON.stringify(job)} is not a job name: ${jobNameRule}`);
  const id = job.includes(".") ? job : `${owner}.${job}`;
  const problem = ownerProblem(ownerOfJob(id));
  if (problem !== null) throw new BadRequestError(problem);
  return id;
}

/** The owner of a full job identity. */
export const ownerOfJob = (id: string): string => id.slice(0, id.indexOf("."));

/** Why a client acting for `owner` cannot take `job`, a name with a dot (read as <owner>.<name>,
 *  which a name like lr-0.01 was not meant as). */
export const otherOwnerProblem = (job: string, owner: string): string => {
  const id = job.includes(".") ? job : `${owner}.${job}`;
  return (
    `"${job}" is job "${id.slice(id.indexOf(".") + 1)}" of owner "${ownerOfJob(id)}" (a job is <owner>.<name>), ` +
    `and this client acts for owner "${owner}": a name without a dot is one of its own (${job.replaceAll(".", "_")})`
  );
};

/** The trainer rank a push or pull subject names (its last token); BadRequestError when the message names another. */
export function trainerOfRequest(subject: string, messageTrainer: number): number {
  const token = subject.slice(subject.lastIndexOf(".") + 1);
  const rank = /^\d{1,3}$/.test(token) ? Number(token) : Number.NaN;
  if (rank !== messageTrainer)
    throw new BadRequestError(`message of trainer ${messageTrainer} sent on trainer ${token}'s subject ${subject}`);
  return rank;
}

/**
 * The job a request is for: the job tokens of `mt.<owner>.<name>.…`, which must be the job the
 * message names (a message sent on another job's subject is refused, not served for the wrong job).
 */
export function jobOfRequest(subject: string, messageJob: string): string {
  const job = subject.split(".").slice(1, 3).join(".");
  if (messageJob !== job)
    throw new BadRequestError(`message for job "${messageJob}" sent on a subject of job "${job}"`);
  return job;
}

/** The tag of the restore a parameter-server shard asks for when it opens a job (it may be a
 *  restarted shard, or a resumed job): the checkpoint service reads the shard index back. */
export const shardOpenedTag = (shard: number): string => `shard ${shard} opened the job`;
export const shardOfOpenedTag = (tag: string): number | null => {
  const m = /^shard (\d{1,2}) opened the job$/.exec(tag);
  return m ? Number(m[1]) : null;
};

/** The same for a trainer rank of an all-reduce job (its replica is loaded by the restore). */
export const trainerOpenedTag = (rank: number): string => `trainer ${rank} opened the job`;
export const trainerOfOpenedTag = (tag: string): number | null => {
  const m = /^trainer (\d{1,2}) opened the job$/.exec(tag);
  return m ? Number(m[1]) : null;
};

/** Who asks for a recovery, as the last token of its ckpt.recover subject. */
export const recoverAsker = {
  trainer: (rank: number): string => `trainer-${rank}`,
  shard: (shard: number): string => `shard-${shard}`,
};
/** The asker a ckpt.recover subject names, or null when its last token names none. */
export function recoverAskerOf(subject: string): { kind: "trainer" | "shard"; index: number } | null {
  const m = /\.(trainer|shard)-(\d{1,4})$/.exec(subject);
  return m ? { kind: m[1] as "trainer" | "shard", index: Number(m[2]) } : null;
}

/** The tag of a restarted trainer rank's second ask: the restore it was given loaded the ranks
 *  before it came back, so it holds none of it (modes.ts findStartStep). */
export const trainerLacksTag = (rank: number, id: string): string => `trainer ${rank} holds no replica of ${id}`;
export const trainerOfLacksTag = (tag: string): number | null => {
  const m = /^trainer (\d{1,4}) holds no replica of /.exec(tag);
  return m ? Number(m[1]) : null;
};

/** The tag of a trainer's recovery after a collective of `step` failed (the loop's rewind). */
export const trainerFailedTag = (rank: number, step: number): string =>
  `trainer ${rank}: a collective of step ${step} failed`;
export const trainerOfFailedTag = (tag: string): number | null => {
  const m = /^trainer (\d{1,4}): a collective of step \d+ failed$/.exec(tag);
  return m ? Number(m[1]) : null;
};

/** Subjects of one job (ARCHITECTURE.md). */
export const subjects = {
  dataNext: (job: string) => `mt.${job}.data.next`,
  /** the plan of a running job, as its spec carries it */
  dataPlan: (job: string) => `mt.${job}.data.plan`,
  /** the plan of a job about to be submitted: a JobSpec without plan in, its DataPlan out */
  planJob: "mt.ctl.plan",
  /** trainer `trainer`'s pushes and pulls: the rank is a token of the subject, so that NATS
   *  permissions let a trainer's user send only its own (services/runtime/job/roles.ts), and the
   *  shard refuses a message whose rank differs from its subject's */
  psPush: (job: string, shard: number, trainer: number) => `mt.${job}.ps.${shard}.push.${trainer}`,
  psPull: (job: string, shard: number, trainer: number) => `mt.${job}.ps.${shard}.pull.${trainer}`,
  psStats: (job: string, shard: number) => `mt.${job}.ps.${shard}.stats`,
  trainerStats: (job: string, rank: number) => `mt.${job}.trainer.${rank}.stats`,
  psState: (job: string, shard: number) => `mt.${job}.ps.${shard}.state`,
  psLoad: (job: string, shard: number) => `mt.${job}.ps.${shard}.load`,
  /** BSP clipping: the shard's sum of squares of a step's averaged gradient */
  psNorm: (job: string, shard: number) => `mt.${job}.ps.${shard}.norm`,
  /** all-reduce mode: trainer rank 0's replica (parameters and optimizer state), one part per request */
  replicaState: (job: string) => `mt.${job}.replica.state`,
  /** all-reduce mode with ZeRO: a slice of trainer `rank`'s packed optimizer state ("state <offset> <count>"), for rank 0's snapshot */
  replicaPartition: (job: string, rank: number) => `mt.${job}.replica.${rank}.partition`,
  /** all-reduce mode: a snapshot's replica loaded into trainer `rank`, one part per request */
  replicaLoad: (job: string, rank: number) => `mt.${job}.replica.${rank}.load`,
  /** a collective piece to trainer `to` from trainer `from` (all-reduce mode): the sender is a
   *  subject token, so NATS permissions keep it to that trainer's user (as a push's rank) */
  coll: (job: string, to: number, from: number) => `mt.${job}.coll.${to}.${from}`,
  /** every piece addressed to trainer `to` */
  collTo: (job: string, to: number) => `mt.${job}.coll.${to}.*`,
  ckptSave: (job: string) => `mt.${job}.ckpt.save`,
  ckptList: (job: string) => `mt.${job}.ckpt.list`,
  /** an operator's restore (admin only): the newest good snapshot, or the one the tag names */
  ckptRestore: (job: string) => `mt.${job}.ckpt.restore`,
  /** a service's ask to be restored after it (re)opened the job or lost its state: the newest
   *  good snapshot only, never one a tag names (services may recover a job, not rewind it). The
   *  asker (recoverAsker) is the last token, which NATS permissions keep to its own user */
  ckptRecover: (job: string, asker: string) => `mt.${job}.ckpt.recover.${asker}`,
  /** a running job's trainers or shards changed at a step boundary (tag "trainers <n> shards <m>") */
  ckptResize: (job: string) => `mt.${job}.ckpt.resize`,
  events: (job: string, kind: string) => `mt.${job}.events.${kind}`,
  /** a process's heartbeat (services/runtime/control/liveness.ts); who "trainer 1" -> trainer-1 */
  heartbeat: (job: string, who: string) => `mt.${job}.hb.${who.replace(/[^A-Za-z0-9_-]+/g, "-")}`,
  heartbeats: (job: string) => `mt.${job}.hb.*`,
  /** published by the SDK: trainer rank 0 takes a snapshot at its next step boundary */
  checkpointNow: (job: string) => `mt.${job}.ctl.checkpoint`,
  allEvents: (job: string) => `mt.${job}.events.>`,
};

/** A subject of every job (`mt.<owner>.<name>.<rest>`), as services subscribe to it. */
export const anyJob = (rest: string): string => `mt.*.*.${rest}`;
