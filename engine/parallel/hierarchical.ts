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
   * The stages of the hierarchy, with `cross` for the sum across hosts: on each chunk's segment
   * of this rank, over the ring of its local index (two-dimensional), or on the whole buffer over
   * the leaders' ring (leaders only). `cross` gets the ring, the values, the chunk's index and
   * the place of the values in the buffer. The two-dimensional ring cuts the buffer into chunks
   * of chunkElems that go through the three stages each on its own, all at once, so the stages
   * within a host overlap the links' (one chunk crosses hosts while the next is reduced within
   * the host).
   */
  async #stages(
    buf: Float32Array,
    key: OpKey,
    cross: (ring: RingGroup, part: Float32Array, chunk: number, at: number) => Promise<void>,
  ): Promise<void> {
    const { local, across, leaders } = this;
    if (across === null) {
      await local.reduce(buf, 0, key);
      if (leaders !== null) await cross(leaders, buf, 0, 0);
      await local.broadcast(buf, 0, key);
      return;
    }
    await Promise.all(
      this.#chunks(buf.length).map(async ({ chunk, own }, c) => {
        const part = buf.subarray(chunk.offset, chunk.offset + chunk.count);
        await local.ring(part, key, `host-reduce-scatter/${c}`, true, false);
        await cross(across, part.subarray(own.offset, own.offset + own.count), c, chunk.offset + own.offset);
        await local.ring(part, key, `host-all-gather/${c}`, false, true);
      }),
    );
  }

  /** The two-dimensional ring's chunks of n values, each with the segment of it this rank owns
   *  after the reduce-scatter within its host (ring() sums segment p at position p). */
  #chunks(n: number): { chunk: Range; own: Range }[] {
    const count = Math.max(1, Math.ceil(n / this.chunkElems));
    return Array.from({ length: count }, (_, c) => {
      const chunk = segment(n, count, c);
      return { chunk, own: segment(chunk.count, this.local.size, this.local.ownSegment) };
    });
  }

  protected get everyRank(): RingGroup {
    return this.flat;
  }

  async allReduce(buf: Float32Array, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    this.check();
    await this.#stages(buf, key, (ring, part, c) => ring.ring(part, key, `all-reduce/${c}`, true, true));
    if (op === "avg") scaleInPlace(buf, 1 / this.size);
  }

  /** Within each host in f32, as allReduce; the rings across hosts encoded. */
  async encodedAllReduce(buf: Float32Array, key: OpKey, coder: WireCoder): Promise<void> {
    this.check();
    // the chunks run at once: each encodes into its own part of the caller's scratch
    const across = this.across;
    const from = [0];
    if (across !== null)
      for (const { own } of this.#chunks(buf.length)) from.push(from.at(-1)! + across.encodedWords(own.count, coder));
    const scratch = across === null ? null : coder.scratch(from.at(-1)!);
    await this.#stages(buf, key, (ring, part, c, at) =>
      ring.encodedRing(
        part,
        key,
        {
          ...coder,
          // the values are elements [at, ...) of the buffer the coder's residual follows
          encode: (x, slot, i) => coder.encode(x, slot, i + at),
          scratch: (n) => (scratch === null ? coder.scratch(n) : scratch.subarray(from[c]!, from[c]! + n)),
        },
        `encoded-all-reduce/${c}`,
      ),
    );
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
