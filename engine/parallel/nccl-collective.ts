// The Collective over NCCL, for ranks on GPUs: buffers are f32 in device memory, and the
// operations run on the backend's stream. A returned promise means the operation is queued on
// that stream (every later kernel on it sees the result), not that the GPU has finished: that
// is what lets a bucket's all-reduce overlap the rest of backward. Keys are not sent: NCCL
// orders a communicator's operations by the order in which every rank calls them.
//
// NCCL's reduce-scatter and all-gather cut a buffer into equal blocks, so their counts must be
// multiples of the group size (a ZeRO partition pads its buckets to one); segment() then
// gives the same blocks as the ring's.
import type { Ptr } from "../../ffi/backend.ts";
import type { NcclComm, NcclStream } from "../../ffi/cuda/nccl.ts";
import {
  checkKey,
  type Collective,
  CollectiveClosedError,
  type OpKey,
  type Range,
  type ReduceOp,
  segment,
} from "./collective.ts";

/** count f32 elements of device memory at ptr */
export interface DeviceBuffer {
  ptr: Ptr;
  count: number;
}

export class NcclCollective implements Collective<DeviceBuffer> {
  #closed = false;

  /** `scratch`: one f32 of device memory, for barrier(). */
  constructor(
    readonly comm: NcclComm,
    readonly stream: NcclStream,
    readonly scratch: DeviceBuffer,
    readonly settleTimeoutMs = 60_000,
  ) {}

  get rank(): number {
    return this.comm.rank;
  }
  get size(): number {
    return this.comm.nranks;
  }

  async allReduce(buf: DeviceBuffer, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    this.#enter(key);
    if (buf.count === 0) return;
    this.comm.allReduce(buf.ptr, buf.ptr, buf.count, "f32", op, this.stream);
    await this.comm.settled(this.settleTimeoutMs);
  }

  async reduceScatter(buf: DeviceBuffer, key: OpKey): Promise<Range> {
    this.#enter(key);
    const block = this.#block(buf, "reduceScatter");
    const mine = segment(buf.count, this.size, this.rank);
    if (block > 0) {
      // in place: rank r's block of the input is where its result goes (NCCL's in-place rule)
      this.comm.reduceScatter(buf.ptr, buf.ptr + mine.offset * 4, block, "f32", "sum", this.stream);
      await this.comm.settled(this.settleTimeoutMs);
    }
    return mine;
  }

  async allGather(buf: DeviceBuffer, key: OpKey): Promise<void> {
    this.#enter(key);
    const block = this.#block(buf, "allGather");
    if (block === 0) return;
    this.comm.allGather(buf.ptr + this.rank * block * 4, buf.ptr, block, "f32", this.stream);
    await this.comm.settled(this.settleTimeoutMs);
  }

  async broadcast(buf: DeviceBuffer, root: number, key: OpKey): Promise<void> {
    this.#enter(key);
    if (buf.count === 0) return;
    this.comm.broadcast(buf.ptr, buf.ptr, buf.count, "f32", root, this.stream);
    await this.comm.settled(this.settleTimeoutMs);
  }

  barrier(key: OpKey): Promise<void> {
    return this.allReduce({ ptr: this.scratch.ptr, count: 1 }, key);
  }

  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.comm.abort();
  }

  #enter(key: OpKey): void {
    checkKey(key);
    if (this.#closed) throw new CollectiveClosedError("the collective is closed");
    const failed = this.comm.pollAsyncError();
    if (failed !== null) throw failed; // a peer or link failed since the last operation
  }

  #block(buf: DeviceBuffer, what: string): number {
    if (buf.count % this.size !== 0)
      throw new RangeError(
        `${what} over NCCL: ${buf.count} elements is not a multiple of the ${this.size} ranks (pad the buffer)`,
      );
    return buf.count / this.size;
  }
}
