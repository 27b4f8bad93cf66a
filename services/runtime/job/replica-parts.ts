// A replica in all-reduce mode as it travels and rests: ShardState parts, each under the message
// limit. Two forms:
//   - the replica: chunks of the job's layout (`layout.chunks`, ids 0..n-1), each with its
//     parameters and optimizer state. Trainer rank 0 serves it at stage 0; every rank loads it
//     on restore; the model file is written from it.
//   - a ZeRO rank's partition (`slabRanges`): chunks are ranges of the parameter slab, `id` the
//     offset of their first element, that rank `rank` owns. Each rank serves its own at a
//     snapshot, so no rank holds another's state; the checkpoint service writes them as they
//     are and, on restore or to export the model, assembles the replica from all of them
//     (replicaFromPartitions), whatever the number of ranks and stage it is loaded into.
import { packByBytes } from "../../../schemas/codec.ts";
import {
  type ChunkState,
  type ShardState,
  shardStateChecksum,
  withChecksum,
} from "../../../schemas/messages/parameter-server.ts";
import { BadRequestError, CorruptDataError } from "../mesh/errors.ts";
import type { Layout } from "./layout.ts";

/** The tag of a state request that cuts the state (kept for the parts asked next) and answers its head. */
export const cutTag = "cut";

/** The tag of a scheduled save whose state trainer rank 0 has cut already (all-reduce without
 *  ZeRO: its replica), so the checkpoint service reads the parts without asking for a cut. */
export const precutSaveTag = "schedule, cut";

/** The part a snapshot request names in its tag, "part <n>" (BadRequestError otherwise). */
export function partOfTag(tag: string): number {
  const m = /^part (\d{1,6})$/.exec(tag);
  if (!m)
    throw new BadRequestError(
      `a state request names its part as "part <n>", not "${tag.slice(0, 64).replace(/[\r\n]+/g, " ")}"`,
    );
  return Number(m[1]);
}

/** Bytes of a part's message besides its floats. */
export const partOverheadBytes = 64 << 10;

export interface ReplicaMeta {
  job: string;
  step: number;
  optimizerSteps: number;
  /** f16: the loss scaler's scale (0: none) */
  lossScale: number;
}

/**
 * A parameter server's state (`head`: everything but its chunks) cut into parts of whole chunks
 * under partBytesMax, each numbered (part of parts) and with its checksum; a state of no chunks
 * is one part.
 */
export function cutShardState(
  head: Omit<ShardState, "chunks" | "parts" | "part" | "checksum">,
  chunks: readonly ChunkState[],
  partBytesMax: number,
): ShardState[] {
  const groups =
    chunks.length === 0
      ? [[]]
      : packByBytes(
          chunks,
          (c) => c.params.byteLength * (1 + c.state.length) + 256,
          Math.max(1, partBytesMax - partOverheadBytes),
        );
  return groups.map((g, p) => withChecksum({ ...head, parts: groups.length, part: p, chunks: g }));
}

/** Part p of `parts`: everything but its chunks. */
function partHeader(meta: ReplicaMeta, p: number, parts: number): Omit<ShardState, "chunks"> {
  return {
    job: meta.job,
    shard: p,
    parts,
    updates: meta.optimizerSteps,
    optimizerSteps: meta.optimizerSteps,
    step: meta.step,
    generation: 0,
    lossScale: meta.lossScale,
  };
}

/** The replica (values and state vectors in the slab's layout) cut along the layout's chunks into
 *  parts under partBytesMax. The parts view `values` and `states`, which they then own. */
export function cutReplica(
  meta: ReplicaMeta,
  layout: Layout,
  values: Float32Array,
  states: readonly { name: string; data: Float32Array }[],
  partBytesMax: number,
): ShardState[] {
  const perElem = 4 * (1 + states.length);
  const budget = Math.max(perElem * layout.chunkElems, partBytesMax - partOverheadBytes);
  const groups: (typeof layout.chunks)[] = [[]];
  let bytes = 0;
  for (const c of layout.chunks) {
    const need = c.count * perElem + 256;
    if (bytes + need > budget && groups.at(-1)!.length > 0) {
      groups.push([]);
      bytes = 0;
    }
    groups.at(-1)!.push(c);
    bytes += need;
  }
  return groups.map((chunks, p) =>
    withChecksum({
      ...partHeader(meta, p, groups.length),
      chunks: chunks.map((c) => ({
        id: c.id,
        version: meta.optimizerSteps,
        // views: the parts own `values` and `states` (every caller passes copies of its own)
        params: values.subarray(c.offset, c.offset + c.count),
        state: states.map((s) => ({ name: s.name, data: s.data.subarray(c.offset, c.offset + c.count) })),
      })),
    }),
  );
}

/**
 * A ZeRO rank's partition as parts: `ranges` (slab offset, count) with their parameters and
 * state vectors read by `read`, ranges split as needed so that each part fits partBytesMax.
 */
export function cutPartition(
  meta: ReplicaMeta & { rank: number },
  ranges: readonly { offset: number; count: number; packed: number }[],
  names: readonly string[],
  /** `count` elements at slab offset `offset`, which are at `packed` in the rank's packed state */
  read: (offset: number, count: number, packed: number) => { params: Float32Array; state: Float32Array[] },
  partBytesMax: number,
): ShardState[] {
  const perElem = 4 * (1 + names.length);
  const per = Math.max(1, Math.floor((partBytesMax - partOverheadBytes) / perElem));
  const groups: { offset: number; count: number; packed: number }[][] = [[]];
  let used = 0;
  for (const r of ranges) {
    for (let at = 0; at < r.count; ) {
      if (used >= per) {
        groups.push([]);
        used = 0;
      }
      const count = Math.min(r.count - at, per - used);
      groups.at(-1)!.push({ offset: r.offset + at, count, packed: r.packed + at });
      used += count;
      at += count;
    }
  }
  return groups.map((pieces, p) =>
    withChecksum({
      ...partHeader(meta, p, groups.length),
      slabRanges: true,
      rank: meta.rank,
      chunks: pieces.map((x) => {
        const got = read(x.offset, x.count, x.packed);
        return {
          id: x.offset,
          version: meta.optimizerSteps,
          params: got.params,
          state: got.state.map((data, i) => ({ name: names[i]!, data })),
        };
      }),
    }),
  );
}

/**
 * The replica's parts (the layout's chunks, under partBytesMax) from every part of every
 * rank's partition (`ranks` of them). Refused with CorruptDataError: a rank or part missing or
 * repeated, parts of different steps or state, a range outside the slab or overlapping another,
 * or ranges that do not add up to the model's `paramCount` elements. The slab's padding, in no
 * partition, stays 0, as it is in every replica.
 */
export function replicaFromPartitions(
  parts: readonly ShardState[],
  o: { job: string; layout: Layout; slabNumel: number; paramCount: number; ranks: number; partBytesMax: number },
): ShardState[] {
  if (parts.length === 0) throw new CorruptDataError("no partition parts");
  const first = parts[0]!;
  const names = first.chunks[0]?.state.map((v) => v.name) ?? [];
  const seen = new Map<number, Set<number>>();
  for (const p of parts) {
    if (!p.slabRanges) throw new CorruptDataError(`part ${p.shard} of job ${p.job} is not a partition`);
    if (p.checksum !== shardStateChecksum(p))
      throw new CorruptDataError(
        `rank ${p.rank ?? 0}'s partition part ${p.shard}: its checksum does not match its contents`,
      );
    if (p.job !== o.job) throw new CorruptDataError(`a partition of job ${p.job} in job ${o.job}`);
    if (
      p.step !== first.step ||
      p.optimizerSteps !== first.optimizerSteps ||
      (p.lossScale ?? 0) !== (first.lossScale ?? 0)
    )
      throw new CorruptDataError(
        `partition parts of steps ${first.step} and ${p.step} (optimizer steps ${first.optimizerSteps}, ${p.optimizerSteps})`,
      );
    const rank = p.rank ?? 0;
    if (rank >= o.ranks) throw new CorruptDataError(`a partition of rank ${rank} in a snapshot of ${o.ranks} ranks`);
    const got = seen.get(rank) ?? new Set<number>();
    if (got.has(p.shard) || !(p.shard < (p.parts ?? 0)))
      throw new CorruptDataError(`rank ${rank}'s partition part ${p.shard} of ${p.parts} is repeated or out of range`);
    got.add(p.shard);
    seen.set(rank, got);
  }
  for (let r = 0; r < o.ranks; r++) {
    const want = parts.find((p) => (p.rank ?? 0) === r)?.parts ?? 0;
    if ((seen.get(r)?.size ?? 0) !== want || want === 0)
      throw new CorruptDataError(`rank ${r}'s partition is incomplete: ${seen.get(r)?.size ?? 0} of ${want} parts`);
  }
  const values = new Float32Array(o.slabNumel);
  const states = names.map((name) => ({ name, data: new Float32Array(o.slabNumel) }));
  const covered = new Uint8Array(o.slabNumel);
  let total = 0;
  for (const p of parts) {
    for (const c of p.chunks) {
      const n = c.params.length;
      if (!(c.id + n <= o.slabNumel))
        throw new CorruptDataError(`rank ${p.rank}'s range [${c.id}, +${n}) is outside the slab of ${o.slabNumel}`);
      if (c.state.map((v) => v.name).join(",") !== names.join(",") || c.state.some((v) => v.data.length !== n))
        throw new CorruptDataError(
          `rank ${p.rank}'s range at ${c.id} has state [${c.state.map((v) => v.name).join(",")}], the others [${names.join(",")}]`,
        );
      for (let i = c.id; i < c.id + n; i++) {
        if (covered[i]) throw new CorruptDataError(`element ${i} of the slab is in two ranks' partitions`);
        covered[i] = 1;
      }
      values.set(c.params, c.id);
      c.state.forEach((v, i) => states[i]!.data.set(v.data, c.id));
      total += n;
    }
  }
  if (total !== o.paramCount)
    throw new CorruptDataError(`the partitions hold ${total} elements; the model has ${o.paramCount} parameters`);
  const meta = { job: o.job, step: first.step, optimizerSteps: first.optimizerSteps, lossScale: first.lossScale ?? 0 };
  return cutReplica(meta, o.layout, values, states, o.partBytesMax);
}

/** The parts a rank cut of its state for a snapshot of one step, kept while the checkpoint
 *  service reads them one by one (the rank trains on meanwhile). */
export class KeptParts {
  #kept: { step: number; parts: ShardState[] } | null = null;

  /** `what` names the state in errors: "the replica", "the share" */
  constructor(readonly what: string) {}

  /** Keeps `parts` as the cut of `step`; returns their number. */
  keep(step: number, parts: ShardState[]): number {
    this.#kept = { step, parts };
    return parts.length;
  }

  has(step: number): boolean {
    return this.#kept?.step === step;
  }

  /** Drops what is kept (a restore made it stale). */
  clear(): void {
    this.#kept = null;
  }

  /** Part `part` of the cut of `step`, cut now with `cut` when none of that step is kept. */
  part(step: number, part: number, cut: () => ShardState[]): ShardState {
    if (!this.has(step)) this.keep(step, cut());
    const parts = this.#kept!.parts;
    if (!Number.isInteger(part) || part < 0 || part >= parts.length)
      throw new BadRequestError(`${this.what} has parts 0 to ${parts.length - 1}, not ${part}`);
    return parts[part]!;
  }
}
