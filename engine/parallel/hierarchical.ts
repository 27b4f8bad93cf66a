// Collectives across hosts: ranks carry a host label, and the links between hosts are the slow
// ones. All-reduce is done in three stages so that those links carry each byte once:
//   1. reduce within each host to its leader (a ring reduce-scatter, then a gather),
//   2. all-reduce among the leaders, one per host (a ring across hosts),
//   3. broadcast within each host from its leader.
// Every rank ends bit-identical: the leaders' ring is, and the broadcast copies. An encoded
// all-reduce (compression) encodes the leaders' ring only, with the leaders' error feedback.
//
// reduceScatter is the hierarchical all-reduce followed by keeping the rank's own segment
// (correct, and no sum is done twice; ZeRO's reduce-scatter on one host takes the flat ring).
// allGather and broadcast move no sums, so they use the flat ring, ordered host by host so
// that only one link per host pair in the ring crosses between hosts.
import { type Collective, type OpKey, type Range, type ReduceOp, segment, type WireCoder } from "./collective.ts";
import { RingGroup, type RingOptions, RingsOverTransport, ringDefaults, scaleInPlace } from "./ring.ts";
import type { PeerTransport } from "./transport.ts";

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
  /** the leaders' ring; null on ranks that lead no host */
  readonly leaders: RingGroup | null;

  constructor(transport: PeerTransport, topology: Topology, options: Partial<RingOptions> = {}) {
    const o = { ...ringDefaults, ...options };
    const { order, byHost, leaders } = topologyRings(topology.hosts);
    const host = topology.hosts[transport.rank];
    if (host === undefined)
      throw new RangeError(`rank ${transport.rank} has no host label (${topology.hosts.length} labels)`);
    super(transport, o.earlyBytesMax);
    this.flat = new RingGroup("", order, transport, this.router, o);
    this.local = new RingGroup(`host:${host}`, byHost.get(host)!, transport, this.router, o);
    this.leaders = leaders.includes(transport.rank)
      ? new RingGroup("leaders", leaders, transport, this.router, o)
      : null;
  }

  protected get everyRank(): RingGroup {
    return this.flat;
  }

  async allReduce(buf: Float32Array, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    this.check();
    await this.local.reduce(buf, 0, key);
    if (this.leaders) await this.leaders.ring(buf, key, "all-reduce", true, true);
    await this.local.broadcast(buf, 0, key);
    if (op === "avg") scaleInPlace(buf, 1 / this.size);
  }

  /** Within each host in f32, as allReduce; the leaders' ring across hosts encoded. */
  async encodedAllReduce(buf: Float32Array, key: OpKey, coder: WireCoder): Promise<void> {
    this.check();
    await this.local.reduce(buf, 0, key);
    if (this.leaders) await this.leaders.encodedRing(buf, key, coder);
    await this.local.broadcast(buf, 0, key);
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
