// How a job's flat parameter vector (the trainer's ParamStore slab) is cut into chunks and
// which shard owns each chunk. Every service computes the same layout from the job config and
// the parameter count; nothing about it is negotiated at run time.
import { chunkRanges } from "../../../schemas/codec.ts";
import { chunkKey, HashRing } from "./hashring.ts";

export interface ChunkInfo {
  id: number;
  /** element offset in the flat vector */
  offset: number;
  count: number;
  /** leading elements of this chunk that take weight decay (the slab puts decayed params first) */
  decayCount: number;
  shard: number;
}

export interface Layout {
  job: string;
  totalElems: number;
  chunkElems: number;
  chunks: ChunkInfo[];
  /** chunk ids per shard, ascending */
  byShard: number[][];
}

export function buildLayout(
  job: string,
  totalElems: number,
  decayElems: number,
  chunkBytes: number,
  shards: number,
): Layout {
  const chunkElems = chunkBytes / 4;
  if (!Number.isInteger(chunkElems)) throw new RangeError(`chunkBytes ${chunkBytes} is not a whole number of float32`);
  const ring = new HashRing(Array.from({ length: shards }, (_, i) => i));
  const byShard: number[][] = Array.from({ length: shards }, () => []);
  const chunks = chunkRanges(totalElems, chunkElems).map(({ offset, count }, id) => {
    const shard = ring.owner(chunkKey(job, id));
    byShard[shard]!.push(id);
    return { id, offset, count, decayCount: Math.max(0, Math.min(count, decayElems - offset)), shard };
  });
  return { job, totalElems, chunkElems, chunks, byShard };
}
