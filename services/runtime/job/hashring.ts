// Consistent hashing: a ring with virtual nodes. Each shard owns `vnodes` points on a 32-bit
// ring; a key belongs to the first point clockwise from its hash. Adding a shard to N moves
// about 1/(N+1) of the keys, all of them to the new shard (test/services/ps.test.ts measures it).

/** Points per shard: more points, more even load (spread ~ 1/sqrt(vnodes)); 160 as in ketama. */
export const vnodesDefault = 160;

const hash32 = (s: string): number => Bun.hash.murmur32v3(s, 0x6d74) >>> 0;

export class HashRing {
  readonly #points: Uint32Array;
  readonly #owners: Int32Array;

  constructor(
    readonly shards: readonly number[],
    readonly vnodes = vnodesDefault,
  ) {
    if (shards.length === 0) throw new RangeError("a hash ring needs at least one shard");
    if (new Set(shards).size !== shards.length) throw new RangeError(`shard ids repeat: ${shards.join(",")}`);
    const pts: { h: number; shard: number }[] = [];
    for (const shard of shards) for (let v = 0; v < vnodes; v++) pts.push({ h: hash32(`ps-${shard}#${v}`), shard });
    // ties (rare) break by shard id so every process builds the same ring
    pts.sort((a, b) => a.h - b.h || a.shard - b.shard);
    this.#points = Uint32Array.from(pts, (p) => p.h);
    this.#owners = Int32Array.from(pts, (p) => p.shard);
  }

  /** The shard that owns `key`. */
  owner(key: string): number {
    const h = hash32(key);
    let lo = 0,
      hi = this.#points.length; // first point >= h
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (this.#points[mid]! < h) lo = mid + 1;
      else hi = mid;
    }
    return this.#owners[lo === this.#points.length ? 0 : lo]!;
  }
}

/** Ring key of chunk `id` of a job's parameter vector. */
export const chunkKey = (job: string, id: number) => `${job}/params/${id}`;
