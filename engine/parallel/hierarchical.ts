// Collectives across hosts: ranks carry a host label, and the links between hosts are the slow
// ones. With the same number of ranks L on every host, all-reduce is NCCL's two-dimensional
// ring:
//   1. a reduce-scatter within each host: local rank k holds segment k of the host's sum,
//   2. an all-reduce of segment k across the hosts, among the local ranks k (L rings at once),
//   3. an all-gather within each host.
// Each host's link then carries 2(H-1)/H of the buffer each way, against the flat ring's
// 2(N-1)/N from each of its ranks that borders another host, and every rank works at every
// stage. The buffer goes through the stages in chunks, all at once, so that the stages within a
// host overlap the links' work. With uneven hosts it is done in three stages through one leader per host:
//   1. reduce within each host to its leader (a ring reduce-scatter, then a gather),
//   2. all-reduce among the leaders, one per host (a ring across hosts),
//   3. broadcast within each host from its leader.
// Every rank ends bit-identical: each segment's ring across hosts is, and the stages within a
// host copy. An encoded all-reduce (compression) encodes the rings across hosts only, with the
// error feedback of the ranks that run them.
//
// reduceScatter is the hierarchical all-reduce followed by keeping the rank's own segment
// (correct, and no sum is done twice; ZeRO's reduce-scatter on one host takes the flat ring).
// allGather and broadcast move no sums, so they use the flat ring, ordered host by host so
// that only one link per host pair in the ring crosses between hosts.
import { type Collective, type OpKey, type Range, type ReduceOp, segment, type WireCoder } from "./collective.ts";
import { RingGroup, type RingOptions, RingsOverTransport, ringDefaults, scaleInPlace } from "./ring.ts";
import type { PeerTransport } from "./transport.ts";

/** The two-dimensional ring's chunks: 4 MB of f32, 4 pieces of 1 MB cut among 2 ranks of a host. */
const chunkElemsDefault = 1 << 20;

export interface Topology {
  /** host label of each global rank */
  hosts: readonly string[];
}

/** The rings of a topology: ranks grouped by host (labels in order of first appearance). */
export function topologyRings(hosts: readonly string[]): {
  order: number[];
  byHost: Map<string, number[]>;
  leaders: number[];
} {
  const byHost = new Map<string, number[]>();
  hosts.forEach((h, rank) => byHost.set(h, [...(byHost.get(h) ?? []), rank]));
  const order = [...byHost.values()].flat();
  const leaders = [...byHost.values()].map((ranks) => ranks[0]!);
  return { order, byHost, leaders };
}

export class HierarchicalCollective extends RingsOverTransport implements Collective {
  /** every rank, host by host */
  readonly flat: RingGroup;
  readonly local: RingGroup;
  /** every host has as many ranks: the ring across hosts of this rank's local index (null: the
   *  leaders' scheme) */
  readonly across: RingGroup | null;
  /** the leaders' ring (null on ranks that lead no host): the host path's where hosts are
   *  uneven, and NCCL's hierarchy's between hosts (nccl-hierarchical.ts) */
  readonly leaders: RingGroup | null;
  readonly #scratches = new Map<string, Float32Array>();

  /** elements per chunk of the two-dimensional ring */
  readonly chunkElems: number;

  constructor(
    transport: PeerTransport,
    topology: Topology,
    options: Partial<RingOptions> & { chunkElems?: number } = {},
  ) {
    const o = { ...ringDefaults, ...options };
    const { order, byHost, leaders } = topologyRings(topology.hosts);
    const host = topology.hosts[transport.rank];
    if (host === undefined)
      throw new RangeError(`rank ${transport.rank} has no host label (${topology.hosts.length} labels)`);
    super(transport, o.earlyBytesMax);
    this.chunkElems = options.chunkElems ?? chunkElemsDefault;
    if (!(Number.isInteger(this.chunkElems) && this.chunkElems > 0))
      throw new RangeError(`chunkElems must be a positive integer, got ${this.chunkElems}`);
    this.flat = new RingGroup("", order, transport, this.router, o);
    const mine = byHost.get(host)!;
    this.local = new RingGroup(`host:${host}`, mine, transport, this.router, o);
    const even = [...byHost.values()].every((ranks) => ranks.length === mine.length);
    const k = mine.indexOf(transport.rank);
    this.across = even
      ? new RingGroup(
          `across:${k}`,
          [...byHost.values()].map((ranks) => ranks[k]!),
          transport,
          this.router,
          o,
        )
      : null;
    this.leaders = leaders.includes(transport.rank)
      ? new RingGroup("leaders", leaders, transport, this.router, o)
      : null;
  }

  /**
   * Within the host, reduce-scatter; `cross` on this rank's segment across hosts; within the
   * host, all-gather. The buffer is cut into chunks of chunkElems that go through the three
   * stages each on its own, all at once, so the stages within a host overlap the links' (one
   * chunk crosses hosts while the next is reduced within the host). `cross` gets the chunk's
   * index, and the place of the segment's values in the buffer.
   */
  async #twoD(
    buf: Float32Array,
    key: OpKey,
    cross: (part: Float32Array, chunk: number, at: number) => Promise<void>,
  ): Promise<void> {
    const local = this.local;
    const chunks = Math.max(1, Math.ceil(buf.length / this.chunkElems));
    await Promise.all(
      Array.from({ length: chunks }, async (_, c) => {
        const from = segment(buf.length, chunks, c);
        const part = buf.subarray(from.offset, from.offset + from.count);
        await local.ring(part, key, `host-reduce-scatter/${c}`, true, false);
        // the segment local position p owns (ring() sums segment p at position p of the host's ring)
        const own = segment(part.length, local.size, local.ownSegment);
        await cross(part.subarray(own.offset, own.offset + own.count), c, from.offset + own.offset);
        await local.ring(part, key, `host-all-gather/${c}`, false, true);
      }),
    );
  }

  protected get everyRank(): RingGroup {
    return this.flat;
  }

  async allReduce(buf: Float32Array, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    this.check();
    const across = this.across;
    if (across !== null) await this.#twoD(buf, key, (part, c) => across.ring(part, key, `all-reduce/${c}`, true, true));
    else {
      await this.local.reduce(buf, 0, key);
      if (this.leaders) await this.leaders.ring(buf, key, "all-reduce", true, true);
      await this.local.broadcast(buf, 0, key);
    }
    if (op === "avg") scaleInPlace(buf, 1 / this.size);
  }

  /** An encoded chunk's scratch, kept per (bucket, chunk): a bucket's chunks are the same every step. */
  #scratch(bucket: number, chunk: number, words: number): Float32Array {
    const id = `${bucket}|${chunk}`;
    let s = this.#scratches.get(id);
    if (s === undefined || s.length < words) this.#scratches.set(id, (s = new Float32Array(words)));
    return s;
  }

  /** Within each host in f32, as allReduce; the rings across hosts encoded. */
  async encodedAllReduce(buf: Float32Array, key: OpKey, coder: WireCoder): Promise<void> {
    this.check();
    const across = this.across;
    if (across !== null)
      // the segment's values are elements [at, ...) of the buffer the coder's residual follows
      await this.#twoD(buf, key, (part, c, at) =>
        across.encodedRing(
          part,
          key,
          {
            ...coder,
            encode: (x, slot, i) => coder.encode(x, slot, i + at),
            // the chunks run at once: each encodes into a scratch of its own
            scratch: (words) => this.#scratch(key.bucket, c, words),
          },
          `encoded-all-reduce/${c}`,
        ),
      );
    else {
      await this.local.reduce(buf, 0, key);
      if (this.leaders) await this.leaders.encodedRing(buf, key, coder);
      await this.local.broadcast(buf, 0, key);
    }
  }

  async reduceScatter(buf: Float32Array, key: OpKey): Promise<Range> {
    await this.allReduce(buf, key);
    return segment(buf.length, this.size, this.rank);
  }

  broadcast(buf: Float32Array, root: number, key: OpKey): Promise<void> {
    this.check();
    return this.flat.broadcast(buf, this.flat.ranks.indexOf(root), key);
  }
}
