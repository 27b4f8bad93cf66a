// A snapshot's parts: the files it is made of, fetched from where the job's state lives, and cut
// again into what this job's shards or ranks load.
//   fetching: a parameter-server job's shards each send their state part by part
//            (ps-<k>-<p>.mtss); an all-reduce job's trainer rank 0 its replica (replica-<p>.mtss);
//            under ZeRO every rank its partition (partition-<r>-<p>.mtss), so that no rank sends
//            another's state and none holds the whole replica to save it. Each part is verified
//            as it arrives (whose, which part of how many, which step).
//   loading: the shards' chunks as the parts each of this job's shards loads, whatever number
//            of shards wrote them; a replica's parts, or the ranks' partitions assembled into one
//            (services/runtime/job/replica-parts.ts), as the replica every rank loads.
import {
  type ChunkState,
  decodeShardState,
  type ShardState,
  shardStateChecksum,
} from "../../schemas/messages/parameter-server.ts";
import { type DataPlan } from "../../schemas/messages/data-loader.ts";
import { encodeJobRequest } from "../../schemas/messages/job.ts";
import { type Manifest } from "../../schemas/messages/checkpoint.ts";
import { BadRequestError, CorruptDataError } from "../runtime/mesh/errors.ts";
import { type JobConfig, jobConfigFromJson, partitionRanks, usesShards } from "../runtime/job/config.ts";
import { subjects } from "../runtime/job/subjects.ts";
import { buildLayout } from "../runtime/job/layout.ts";
import { cutShardState, replicaFromPartitions } from "../runtime/job/replica-parts.ts";

/** part p of shard k's state (a snapshot before parts: ps-<k>.mtss, one part) */
const shardFile = (k: number, p: number) => `ps-${k}-${p}.mtss`;
const shardFilePattern = /^ps-(\d{1,4})(?:-(\d{1,6}))?\.mtss$/;
const replicaFile = (p: number) => `replica-${p}.mtss`;
/** ZeRO: part p of rank r's partition */
const partitionFile = (r: number, p: number) => `partition-${r}-${p}.mtss`;
const partitionFilePattern = /^partition-\d{1,4}-\d{1,6}\.mtss$/;
/** Parts a replica may be cut into (a 64 GB model in 8 MB messages). */
const replicaPartsMax = 8192;

/** One file of a snapshot: its name, its bytes as they came, and the state they hold. */
export interface SnapshotPart {
  name: string;
  bytes: Uint8Array;
  state: ShardState;
}

/** The checkpoint service's request for a part of the state (given up when the job goes on
 *  without a lost host). */
export type AskState = (subject: string, req: Uint8Array) => Promise<Uint8Array>;

/** Every part of job `cfg`'s state at `step`, from where it lives (the state was cut there). */
export async function fetchParts(
  cfg: JobConfig,
  step: number,
  ask: AskState,
  payloadBytesMax: number,
): Promise<SnapshotPart[]> {
  if (usesShards(cfg))
    return (await Promise.all(Array.from({ length: cfg.shards }, (_, k) => shardParts(cfg, k, step, ask)))).flat();
  return partitionRanks(cfg) > 0
    ? await partitionParts(cfg, step, ask, payloadBytesMax)
    : await replicaParts(cfg, step, ask, payloadBytesMax);
}

/** Parameter-server mode: shard k's state at `step`, part by part, each verified before it is written. */
async function shardParts(cfg: JobConfig, k: number, step: number, ask: AskState): Promise<SnapshotPart[]> {
  const out: SnapshotPart[] = [];
  for (let p = 0, parts = 1; p < parts; p++) {
    const bytes = await ask(subjects.psState(cfg.job, k), encodeJobRequest({ job: cfg.job, step, tag: `part ${p}` }));
    const s = decodeShardState(bytes, 1 << 30);
    if (p === 0) parts = Math.max(1, s.parts ?? 0);
    if (
      s.shard !== k ||
      s.job !== cfg.job ||
      (s.part ?? 0) !== p ||
      Math.max(1, s.parts ?? 0) !== parts ||
      s.checksum !== shardStateChecksum(s)
    )
      throw new BadRequestError(
        `shard ${k} answered part ${s.part ?? 0} of ${s.parts ?? 0} of ${s.job} shard ${s.shard} for part ${p} of ${parts}, or a part whose checksum does not match`,
      );
    // every part of one cut: the same moment (another requester's cut in between would differ)
    const first = out[0]?.state;
    if (first !== undefined && (s.step !== first.step || s.updates !== first.updates))
      throw new BadRequestError(
        `shard ${k}'s part ${p} is of another moment (step ${s.step}, ${s.updates} updates) than part 0 (step ${first.step}, ${first.updates})`,
      );
    out.push({ name: shardFile(k, p), bytes, state: s });
  }
  return out;
}

/** All-reduce mode: trainer rank 0's replica at `step`, part by part, each verified. */
async function replicaParts(
  cfg: JobConfig,
  step: number,
  ask: AskState,
  payloadBytesMax: number,
): Promise<SnapshotPart[]> {
  const out: SnapshotPart[] = [];
  for (let p = 0, parts = 1; p < parts; p++) {
    const bytes = await ask(subjects.replicaState(cfg.job), encodeJobRequest({ job: cfg.job, step, tag: `part ${p}` }));
    const s = decodeShardState(bytes, payloadBytesMax);
    if (p === 0) parts = s.parts ?? 0;
    if (
      s.job !== cfg.job ||
      s.shard !== p ||
      s.parts !== parts ||
      s.step !== step ||
      !(parts >= 1 && parts <= replicaPartsMax)
    ) {
      throw new BadRequestError(
        `trainer 0 answered part ${s.shard} of ${s.parts} of job ${s.job}'s replica at step ${s.step} for part ${p} at step ${step}`,
      );
    }
    out.push({ name: replicaFile(p), bytes, state: s });
  }
  return out;
}

/**
 * ZeRO: every rank's partition at `step`, part by part, each verified: no rank sends another's
 * state, and no rank holds the whole replica to save it.
 */
async function partitionParts(
  cfg: JobConfig,
  step: number,
  ask: AskState,
  payloadBytesMax: number,
): Promise<SnapshotPart[]> {
  const perRank = await Promise.all(
    Array.from({ length: partitionRanks(cfg) }, async (_, r) => {
      const out: SnapshotPart[] = [];
      for (let p = 0, parts = 1; p < parts; p++) {
        const req = encodeJobRequest({ job: cfg.job, step, tag: `part ${p}` });
        const bytes = await ask(subjects.replicaPartition(cfg.job, r), req);
        const s = decodeShardState(bytes, payloadBytesMax);
        if (p === 0) parts = s.parts ?? 0;
        if (
          s.job !== cfg.job ||
          !s.slabRanges ||
          s.rank !== r ||
          s.shard !== p ||
          s.parts !== parts ||
          s.step !== step ||
          !(parts >= 1 && parts <= replicaPartsMax)
        ) {
          throw new BadRequestError(
            `trainer ${r} answered part ${s.shard} of ${s.parts} of job ${s.job}'s ${s.slabRanges ? `partition of rank ${s.rank}` : "replica"} at step ${s.step} ` +
              `for part ${p} of its partition at step ${step}`,
          );
        }
        out.push({ name: partitionFile(r, p), bytes, state: s });
      }
      return out;
    }),
  );
  return perRank.flat();
}

/**
 * Parameter-server mode: a snapshot's chunks, whatever number of shards wrote them, as the
 * parts each of this job's shards loads (the job's layout says who owns which chunk: the same
 * chunks, owned as the hash ring over cfg.shards says). Refused with CorruptDataError: a part
 * whose checksum does not match, states of different steps, a chunk missing or twice.
 */
export function reshard(
  cfg: JobConfig,
  plan: DataPlan,
  manifest: Manifest,
  files: ReadonlyMap<string, Uint8Array>,
  payloadBytesMax: number,
): ShardState[][] {
  const layout = buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, cfg.shards);
  const states = [...files.entries()]
    .filter(([name]) => shardFilePattern.test(name))
    .map(([name, bytes]) => ({ name, s: decodeShardState(bytes, 1 << 30) }));
  if (states.length === 0) throw new CorruptDataError(`snapshot ${manifest.id} has no parameter-server state`);
  const chunks = new Map<number, ChunkState>();
  let updates = 0;
  // the step is the shards' that hold chunks: a shard that owns none (the hash ring gave it
  // none) holds no state of any step (snapshots before it was cut at the asked step said 0)
  const step = (states.find((x) => x.s.chunks.length > 0) ?? states[0]!).s.step;
  for (const { name, s } of states) {
    if (s.checksum !== shardStateChecksum(s) || s.job !== cfg.job)
      throw new CorruptDataError(`snapshot ${manifest.id}: ${name} does not match its checksum or job`);
    if (s.step !== step && s.chunks.length > 0)
      throw new CorruptDataError(`snapshot ${manifest.id}: ${name} is of step ${s.step}, the others of ${step}`);
    updates = Math.max(updates, s.updates);
    for (const c of s.chunks) {
      if (chunks.has(c.id) || !layout.chunks[c.id])
        throw new CorruptDataError(`snapshot ${manifest.id}: chunk ${c.id} is repeated or not in the job's layout`);
      chunks.set(c.id, c);
    }
  }
  if (chunks.size !== layout.chunks.length)
    throw new CorruptDataError(
      `snapshot ${manifest.id} holds ${chunks.size} of the job's ${layout.chunks.length} chunks`,
    );
  const head = { job: cfg.job, updates, optimizerSteps: step, step };
  return layout.byShard.map((ids, k) =>
    cutShardState(
      { ...head, shard: k },
      ids.map((id) => chunks.get(id)!),
      payloadBytesMax,
    ),
  );
}

/**
 * All-reduce mode: the replica every rank loads from a snapshot's files: its replica parts, or a
 * ZeRO snapshot's partitions assembled into one (whatever the stage and the number of ranks now).
 * Empty when the snapshot holds neither (a parameter-server job took it).
 */
export function replicaOfSnapshot(
  cfg: JobConfig,
  plan: DataPlan,
  manifest: Manifest,
  files: ReadonlyMap<string, Uint8Array>,
  payloadBytesMax: number,
): ShardState[] {
  const states: ShardState[] = [];
  for (let p = 0; files.has(replicaFile(p)); p++)
    states.push(decodeShardState(files.get(replicaFile(p))!, payloadBytesMax));
  const partitions = [...files.keys()].filter((name) => partitionFilePattern.test(name));
  if (states.length > 0 || partitions.length === 0) return states;
  const saved = partitionRanks(jobConfigFromJson(manifest.configJson));
  return assemble(
    cfg,
    plan,
    saved,
    partitions.map((name) => decodeShardState(files.get(name)!, payloadBytesMax)),
    payloadBytesMax,
  );
}

/** The replica's chunks from the partitions of `ranks` ranks (services/runtime/job/replica-parts.ts). */
export function assemble(
  cfg: JobConfig,
  plan: DataPlan,
  ranks: number,
  parts: readonly ShardState[],
  payloadBytesMax: number,
): ShardState[] {
  return replicaFromPartitions(parts, {
    job: cfg.job,
    layout: buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, 1),
    slabNumel: plan.slabNumel,
    paramCount: plan.paramCount,
    ranks,
    partBytesMax: payloadBytesMax,
  });
}
