// An all-reduce job's NCCL communicator of one generation, as a trainer rank holds it: rank 0
// makes the unique id and publishes it in the job store (services/runtime/job/nccl-id.ts), every
// other rank waits for it there, and all ranks call ncclCommInitRank with it. Operations asked for
// while the ranks connect queue behind the connection, in call order (NcclCollective keeps that
// order after). A restore or resize replaces the group with one of the next generation, under a
// key of its own, so no rank can join the communicator that failed.
//
// Faults: NCCL waits forever on a dead peer. The trainer's liveness watch calls abortFor() when a
// peer goes quiet: the communicator is aborted (ncclCommAbort), and every operation pending or
// later fails with PeerLostError naming the peer (a collective failure: every rank rewinds
// to the newest snapshot, at a new generation). close() is the restore's own abandon: its
// operations fail with CollectiveClosedError.
import type { CudaBackend, SideStream } from "../../ffi/cuda/backend.ts";
import { NcclComm, type NcclLibrary, ncclLibrary } from "../../ffi/cuda/nccl.ts";
import type { Allocation } from "../../ffi/backend.ts";
import {
  type Collective,
  PeerLostError,
  CollectiveClosedError,
  CollectiveTransportError,
  type OpKey,
  type Range,
  type ReduceOp,
} from "../../engine/parallel/collective.ts";
import { type DeviceBuffer, NcclCollective } from "../../engine/parallel/nccl-collective.ts";
import type { NcclIdExchange, NcclIdKey } from "../runtime/job/nccl-id.ts";
import { ncclConnectTimeoutMs, ncclIdRetryPauseMsMax, ncclSettleTimeoutMs } from "./limits.ts";
import { BadRequestError } from "../runtime/mesh/errors.ts";
import { WireFormatError } from "../../schemas/codec.ts";

export interface NcclGroupOptions {
  backend: CudaBackend;
  ids: NcclIdExchange;
  /** the communicator's key in the store: job, group (with the job's attempt) and generation */
  key: NcclIdKey;
  rank: number;
  ranks: number;
  /** the stream NCCL runs on beside the compute stream. Not the compute stream itself: real NCCL
   *  answers a collective with ncclInProgress and launches it from a thread of its own, and no
   *  kernel may be queued on its stream until it settles, while backward goes on queueing. */
  side: SideStream;
  /** the NCCL to load (default: the one findNccl finds) */
  library?: NcclLibrary;
  connectTimeoutMs?: number;
  settleTimeoutMs?: number;
}

export class NcclGroup implements Collective<DeviceBuffer> {
  readonly #o: NcclGroupOptions;
  readonly #ready: Promise<NcclCollective>;
  #collective: NcclCollective | null = null;
  #scratch: Allocation | null = null;
  /** why operations fail from now on (closed or aborted), or null */
  #failed: Error | null = null;
  readonly #stop = Promise.withResolvers<never>();

  constructor(o: NcclGroupOptions) {
    this.#o = o;
    this.#stop.promise.catch(() => {}); // read by the operations that race it
    this.#ready = Promise.race([this.#connect(), this.#stop.promise]);
    this.#ready.catch(() => {}); // each operation reports it
  }

  get rank(): number {
    return this.#o.rank;
  }
  get size(): number {
    return this.#o.ranks;
  }
  get generation(): number {
    return this.#o.key.generation;
  }

  /** Resolves once this rank's communicator is up (tests and logs; operations wait by themselves). */
  async connected(): Promise<void> {
    await this.#ready;
  }

  async allReduce(buf: DeviceBuffer, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    return (await this.#ready).allReduce(buf, key, op);
  }
  async reduceScatter(buf: DeviceBuffer, key: OpKey): Promise<Range> {
    return (await this.#ready).reduceScatter(buf, key);
  }
  async allGather(buf: DeviceBuffer, key: OpKey): Promise<void> {
    return (await this.#ready).allGather(buf, key);
  }
  async broadcast(buf: DeviceBuffer, root: number, key: OpKey): Promise<void> {
    return (await this.#ready).broadcast(buf, root, key);
  }
  async barrier(key: OpKey): Promise<void> {
    return (await this.#ready).barrier(key);
  }

  /** Compute waits for the operations settled so far (they run on the side stream); resolves when they are done. */
  async join(): Promise<void> {
    await this.#collective?.join();
  }

  /** The job abandons this generation (a restore, the end): everything pending fails, closed. */
  close(reason = "the communicator was closed"): void {
    if (this.#failed !== null && this.#collective === null) return;
    this.#fail(new CollectiveClosedError(reason));
    this.#collective?.close();
  }

  /** A peer is gone or stalled (the liveness watch): the communicator is aborted on this rank. */
  abortFor(peer: number, reason: string): void {
    if (this.#failed !== null) return;
    const e = new PeerLostError(peer, reason);
    this.#fail(e);
    this.#collective?.abort(peer, reason);
  }

  #fail(e: Error): void {
    this.#failed ??= e;
    this.#stop.reject(this.#failed);
  }

  async #connect(): Promise<NcclCollective> {
    const o = this.#o;
    const connectTimeoutMs = o.connectTimeoutMs ?? ncclConnectTimeoutMs;
    let comm: NcclComm;
    try {
      const library = o.library ?? ncclLibrary();
      const deadline = performance.now() + connectTimeoutMs;
      let id: Uint8Array;
      if (o.rank === 0) {
        const made = library.getUniqueId();
        await this.#retried("publish its id", deadline, () => o.ids.publish(o.key, made, o.ranks));
        id = made;
      } else {
        id = await this.#retried("read rank 0's id", deadline, (left) => o.ids.wait(o.key, o.ranks, left));
      }
      if (this.#failed !== null) throw this.#failed; // closed or aborted while the id was exchanged
      const leftMs = Math.max(Math.floor(deadline - performance.now()), 1);
      comm = await NcclComm.init(o.ranks, o.rank, id, { timeoutMs: leftMs, library });
    } catch (e) {
      if (this.#failed !== null) throw this.#failed;
      throw new CollectiveTransportError(
        `rank ${o.rank} of ${o.ranks} cannot set up NCCL communicator ${o.key.group} generation ${o.key.generation}: ${(e as Error).message}`,
        { cause: e },
      );
    }
    if (this.#failed !== null) {
      comm.abort(); // closed or aborted while it connected: nobody will use it
      throw this.#failed;
    }
    this.#scratch = o.backend.alloc(4);
    this.#collective = new NcclCollective(
      comm,
      o.side.stream,
      { ptr: this.#scratch.ptr, count: 1 },
      o.settleTimeoutMs ?? ncclSettleTimeoutMs,
      o.side,
    );
    return this.#collective;
  }

  /**
   * Runs a job-store call until it succeeds or `deadline` passes: the server may be busy or
   * between leaders (a JetStream request times out). A refusal no retry fixes (BadRequestError:
   * another id under this key, a rank count that differs) and a close or abort end it at once.
   */
  async #retried<T>(what: string, deadline: number, call: (leftMs: number) => Promise<T>): Promise<T> {
    for (let attempt = 1; ; attempt++) {
      const leftMs = Math.floor(deadline - performance.now());
      try {
        return await call(Math.max(leftMs, 1));
      } catch (e) {
        if (this.#failed !== null || e instanceof BadRequestError || e instanceof WireFormatError) throw e;
        if (deadline - performance.now() < ncclIdRetryPauseMsMax)
          throw new Error(
            `cannot ${what} within ${this.#o.connectTimeoutMs ?? ncclConnectTimeoutMs} ms: ${(e as Error).message}`,
            { cause: e },
          );
        await Bun.sleep(Math.min(100 * attempt, ncclIdRetryPauseMsMax));
      }
    }
  }

  /** Frees the scratch word (after close(): the communicator is gone). */
  dispose(): void {
    this.close("the trainer stopped");
    if (this.#scratch !== null) this.#o.backend.free(this.#scratch);
    this.#scratch = null;
  }
}
