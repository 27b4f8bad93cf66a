// Collectives over device buffers for ranks on GPUs of several hosts: NCCL among the GPUs of each
// host, the ring between hosts (one leader per host, over the job's NATS transport), and NCCL
// again to spread the result:
//   1. all-reduce within the host (NCCL): every rank of the host holds the host's sum;
//   2. the leaders (each host's first rank) copy it to host memory and all-reduce it around the
//      leaders' ring (HierarchicalCollective's), then copy it back;
//   3. broadcast within the host from the leader (NCCL).
// Every rank ends bit-identical: the leaders' ring is, and the broadcast copies. The links between
// hosts carry each byte once per direction of the leaders' ring, as on the host path.
//
// The other operations are built on that all-reduce, adding zeros (exact): reduce-scatter keeps
// the rank's block of the whole sum; all-gather zeroes every block but the rank's own first;
// broadcast zeroes the buffer on every rank but the root. Operations run one after another, each
// to its end: the three stages of two operations must not interleave differently on different
// ranks (NCCL matches a communicator's calls by their order).
import type { Backend } from "../../ffi/backend.ts";
import type { Collective, GroupSum, HostGroup, OpKey, Range, ReduceOp } from "./collective.ts";
import type { HierarchicalCollective } from "./hierarchical.ts";
import type { RingGroup } from "./ring.ts";
import { type DeviceBuffer, equalBlock } from "./nccl-collective.ts";

export class NcclHierarchical implements Collective<DeviceBuffer> {
  #tail: Promise<void> = Promise.resolve();
  /** a leader's copy of the host's sum, for the ring between hosts */
  #host = new Float32Array(0);
  /** the failure of an operation: every later one fails with it */
  #failed: Error | null = null;

  constructor(
    /** NCCL among the ranks of this rank's host (its rank 0 is the host's leader) */
    readonly local: Collective<DeviceBuffer>,
    /** the job's ranks over NATS, grouped by host: its leaders' ring carries stage 2 */
    readonly between: HierarchicalCollective,
    readonly backend: Backend,
  ) {}

  get rank(): number {
    return this.between.rank;
  }
  get size(): number {
    return this.between.size;
  }

  allReduce(buf: DeviceBuffer, key: OpKey, op: ReduceOp = "sum", between?: GroupSum): Promise<void> {
    return this.#inTurn(() => this.#allReduce(buf, key, op, between));
  }

  reduceScatter(buf: DeviceBuffer, key: OpKey): Promise<Range> {
    const block = equalBlock(buf, this.size, "reduceScatter");
    return this.#inTurn(async () => {
      await this.#allReduce(buf, key, "sum");
      return { offset: this.rank * block, count: block };
    });
  }

  allGather(buf: DeviceBuffer, key: OpKey): Promise<void> {
    const block = equalBlock(buf, this.size, "allGather");
    return this.#inTurn(async () => {
      const mine = this.rank * block;
      this.backend.zero(buf.ptr, mine * 4);
      this.backend.zero(buf.ptr + (mine + block) * 4, (buf.count - mine - block) * 4);
      await this.#allReduce(buf, key, "sum");
    });
  }

  broadcast(buf: DeviceBuffer, root: number, key: OpKey): Promise<void> {
    return this.#inTurn(async () => {
      if (this.rank !== root) this.backend.zero(buf.ptr, buf.count * 4);
      await this.#allReduce(buf, key, "sum");
    });
  }

  barrier(key: OpKey): Promise<void> {
    return this.#inTurn(() => this.between.barrier(key));
  }

  async join(): Promise<void> {
    await this.local.join?.();
  }

  close(reason?: string): void {
    this.local.close(reason);
    this.between.close(reason);
  }

  async #allReduce(buf: DeviceBuffer, key: OpKey, op: ReduceOp, between?: GroupSum): Promise<void> {
    try {
      await this.local.allReduce(buf, key, "sum");
      const leaders = this.between.leaders;
      if (leaders !== null && buf.count > 0) {
        // operations run one at a time: one host array serves them all, grown to the largest
        if (this.#host.length < buf.count) this.#host = new Float32Array(buf.count);
        const host = this.#host.subarray(0, buf.count);
        await this.local.join?.();
        this.backend.download(buf.ptr, host);
        // f32 around the leaders' ring, or as the caller encodes it (compression between hosts)
        if (between === undefined) await leaders.ring(host, key, "all-reduce", true, true);
        else await between(host, this.#leaderGroup(leaders), key);
        if (op === "avg") for (let i = 0; i < host.length; i++) host[i]! /= this.size;
        this.backend.upload(buf.ptr, host);
      }
      await this.local.broadcast(buf, 0, key);
    } catch (e) {
      // This rank's calls on the host's communicator no longer match its peers' (a leader whose
      // ring failed never calls the broadcast they wait in): it fails every later operation and
      // aborts the communicator; the job restores at a new generation.
      this.#failed ??= e as Error;
      this.local.close((e as Error).message);
      throw e;
    }
  }

  /** The leaders as a HostGroup: member j is the leader j-th in rank order, as the ring's segments are. */
  #leaderGroup(leaders: RingGroup): HostGroup {
    return {
      rank: [...leaders.ranks].sort((a, b) => a - b).indexOf(this.rank),
      size: leaders.ranks.length,
      allGather: (x, key) => leaders.ring(x, key, "all-gather", false, true),
    };
  }

  #inTurn<T>(run: () => Promise<T>): Promise<T> {
    const done = this.#tail.then(() => {
      if (this.#failed !== null) throw this.#failed;
      return run();
    });
    this.#tail = done.then(
      () => {},
      () => {},
    );
    return done;
  }
}
