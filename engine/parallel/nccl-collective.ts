// The Collective over NCCL, for ranks on GPUs: buffers are f32 in device memory, and the
// operations run on the backend's stream. A returned promise means the operation is queued on
// that stream (every later kernel on it sees the result), not that the GPU has finished: that
// is what lets a bucket's all-reduce overlap the rest of backward. Keys are not sent: NCCL
// orders a communicator's operations by the order in which every rank calls them.
//
// NCCL's reduce-scatter and all-gather cut a buffer into equal blocks, so their counts must be
// multiples of the group size (a ZeRO partition pads its buckets to one); segment() then
// gives the same blocks as the ring's.
import type { Allocation, Backend, Ptr } from "../../ffi/backend.ts";
import type { NcclComm, NcclStream } from "../../ffi/cuda/nccl.ts";
import { NcclError } from "../../ffi/cuda/nccl.ts";
import {
  checkKey,
  type Collective,
  PeerLostError,
  CollectiveClosedError,
  CollectiveTimeoutError,
  CollectiveTransportError,
  type OpKey,
  type Range,
  type ReduceOp,
  segment,
} from "./collective.ts";

/** How a side stream is ordered against the compute stream (ffi/cuda/backend.ts SideStream). */
export interface StreamOrder {
  /** work queued on the side stream from now on runs after the compute work queued so far */
  afterCompute(): void;
  /** compute work queued from now on runs after the side stream's work queued so far */
  joinCompute(): void;
  /** whether the side stream's work up to the last joinCompute() has finished (never blocks) */
  drained(): boolean;
}

/** join() polls on the next turns of the event loop this many times before pausing 1 ms at a time. */
const joinSpinPolls = 200;

/** The elements of each rank's block of `buf` (NCCL's reduce-scatter and all-gather cut it into
 *  equal blocks); RangeError where the count is not a multiple of the ranks (pad the buffer:
 *  collective.ts blockLayout). */
export function equalBlock(buf: DeviceBuffer, ranks: number, what: string): number {
  if (buf.count % ranks !== 0)
    throw new RangeError(
      `${what} over NCCL: ${buf.count} elements is not a multiple of the ${ranks} ranks (pad the buffer)`,
    );
  return buf.count / ranks;
}

/** count f32 elements of device memory at ptr */
export interface DeviceBuffer {
  ptr: Ptr;
  count: number;
}

export class NcclCollective implements Collective<DeviceBuffer> {
  #closed = false;
  /** set by abort() or a join() past its deadline: what every operation pending or later fails with */
  #aborted: PeerLostError | CollectiveTimeoutError | null = null;
  /** the last operation started: the next one runs after it has settled */
  #tail: Promise<void> = Promise.resolve();

  /**
   * `scratch`: one f32 of device memory, for barrier(). `order`: where `stream` is not the
   * compute stream, the events between them (ffi/cuda/backend.ts SideStream): each operation
   * waits for the compute work queued before it, and join() makes compute wait for the
   * operations. Without it, `stream` is the compute stream and the order is the stream's.
   */
  constructor(
    readonly comm: NcclComm,
    readonly stream: NcclStream,
    readonly scratch: DeviceBuffer,
    readonly settleTimeoutMs = 60_000,
    readonly order: StreamOrder | null = null,
  ) {}

  /**
   * Resolves when the operations queued so far have finished on the device. A peer that died
   * after the communicator connected leaves real NCCL's kernels waiting for it forever, and its
   * error is not this rank's (an abort reaches only the rank that calls it): the liveness watch
   * calls abort(), and should it not, the wait ends after settleTimeoutMs with the communicator
   * aborted and CollectiveTimeoutError, so no rank waits on a lost peer for good.
   */
  async join(): Promise<void> {
    const order = this.order;
    if (order === null) return;
    order.joinCompute();
    const deadline = performance.now() + this.settleTimeoutMs;
    for (let polls = 0; !order.drained(); polls++) {
      if (this.#closed) throw new CollectiveClosedError("the collective is closed");
      if (this.#aborted !== null) throw this.#aborted;
      const failed = this.comm.pollAsyncError();
      if (failed !== null) throw this.#failure(failed);
      if (performance.now() > deadline) {
        this.#aborted = new CollectiveTimeoutError(
          `rank ${this.rank}: the NCCL operations queued on its stream have not finished within ${this.settleTimeoutMs} ms (a peer is gone or stuck); the communicator is aborted`,
        );
        this.comm.abort();
        throw this.#aborted;
      }
      // the next turns of the event loop at first (an all-reduce takes microseconds to
      // milliseconds), then a millisecond at a time
      await (polls < joinSpinPolls ? new Promise<void>((r) => setImmediate(r)) : Bun.sleep(1));
    }
  }

  get rank(): number {
    return this.comm.rank;
  }
  get size(): number {
    return this.comm.nranks;
  }

  async allReduce(buf: DeviceBuffer, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    this.#start(key);
    return this.#inTurn(() => {
      if (buf.count > 0) this.comm.allReduce(buf.ptr, buf.ptr, buf.count, "f32", op, this.stream);
    });
  }

  async reduceScatter(buf: DeviceBuffer, key: OpKey): Promise<Range> {
    this.#start(key);
    const block = equalBlock(buf, this.size, "reduceScatter");
    const mine = segment(buf.count, this.size, this.rank);
    // in place: rank r's block of the input is where its result goes (NCCL's in-place rule)
    await this.#inTurn(() => {
      if (block > 0) this.comm.reduceScatter(buf.ptr, buf.ptr + mine.offset * 4, block, "f32", "sum", this.stream);
    });
    return mine;
  }

  async allGather(buf: DeviceBuffer, key: OpKey): Promise<void> {
    this.#start(key);
    const block = equalBlock(buf, this.size, "allGather");
    return this.#inTurn(() => {
      if (block > 0) this.comm.allGather(buf.ptr + this.rank * block * 4, buf.ptr, block, "f32", this.stream);
    });
  }

  async broadcast(buf: DeviceBuffer, root: number, key: OpKey): Promise<void> {
    this.#start(key);
    return this.#inTurn(() => {
      if (buf.count > 0) this.comm.broadcast(buf.ptr, buf.ptr, buf.count, "f32", root, this.stream);
    });
  }

  barrier(key: OpKey): Promise<void> {
    return this.allReduce({ ptr: this.scratch.ptr, count: 1 }, key);
  }

  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.comm.abort();
  }

  /**
   * Aborts the communicator because `peer` is gone or stalled (a liveness watch saw it): the
   * operations pending here fail with PeerLostError naming it, so the step fails as a
   * collective failure (every rank rewinds) instead of waiting on NCCL, which never gives up on
   * a dead peer by itself.
   */
  abort(peer: number, reason: string): void {
    if (this.#closed || this.#aborted !== null) return;
    this.#aborted = new PeerLostError(peer, reason);
    this.comm.abort();
  }

  #start(key: OpKey): void {
    checkKey(key);
    if (this.#closed) throw new CollectiveClosedError("the collective is closed");
    if (this.#aborted !== null) throw this.#aborted;
  }

  /** What an operation that failed with `e` throws: closed and aborted say so, NCCL's errors are transport failures. */
  #failure(e: unknown): unknown {
    if (this.#closed) return new CollectiveClosedError("the collective is closed", { cause: e });
    if (this.#aborted !== null) return this.#aborted;
    if (e instanceof NcclError) return new CollectiveTransportError(e.message, { cause: e });
    return e;
  }

  /**
   * Runs `call` (one NCCL call) once the operations before it have settled, then waits for its
   * own: NCCL forbids any call on a communicator left in progress, so the operations a caller
   * starts without awaiting (a bucket's all-reduce while backward goes on) queue here in call
   * order. Real NCCL settles at once (the work is queued on the stream); the emulated one, and
   * a communicator still connecting, take their time.
   */
  #inTurn(call: () => void): Promise<void> {
    const run = this.#tail.then(async () => {
      try {
        if (this.#closed) throw new CollectiveClosedError("the collective is closed");
        if (this.#aborted !== null) throw this.#aborted;
        const failed = this.comm.pollAsyncError();
        if (failed !== null) throw failed; // a peer or link failed since the last operation
        this.order?.afterCompute();
        call();
        await this.comm.settled(this.settleTimeoutMs);
      } catch (e) {
        throw this.#failure(e);
      }
    });
    this.#tail = run.catch(() => {});
    return run;
  }
}

/**
 * A Collective over host arrays, staged through device memory and a device collective: for the
 * host-side operations of a job whose ranks talk NCCL (the replica check; ZeRO's partitions and
 * offload, which keep their buckets in host memory), so that such a job needs no second
 * communicator. Each call uploads the array into device memory of its own, runs the device
 * operation (queued behind the ones before it: NcclCollective keeps call order) and downloads
 * the result.
 */
export class StagedCollective implements Collective<Float32Array> {
  #closed = false;

  constructor(
    readonly device: Collective<DeviceBuffer>,
    readonly backend: Backend,
  ) {}

  get rank(): number {
    return this.device.rank;
  }
  get size(): number {
    return this.device.size;
  }

  allReduce(buf: Float32Array, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    return this.#staged(buf, (d) => this.device.allReduce(d, key, op));
  }
  reduceScatter(buf: Float32Array, key: OpKey): Promise<Range> {
    return this.#blocked(buf, "reduceScatter", (d) => this.device.reduceScatter(d, key));
  }
  async allGather(buf: Float32Array, key: OpKey): Promise<void> {
    await this.#blocked(buf, "allGather", (d) => this.device.allGather(d, key));
  }
  broadcast(buf: Float32Array, root: number, key: OpKey): Promise<void> {
    return this.#staged(buf, (d) => this.device.broadcast(d, root, key));
  }
  barrier(key: OpKey): Promise<void> {
    return this.device.barrier(key);
  }

  close(reason?: string): void {
    this.#closed = true;
    this.device.close(reason);
  }

  /**
   * Reduce-scatter and all-gather: NCCL cuts the buffer into equal blocks, the ring's segments
   * (segment()) differ by one element where the length is not a multiple of the ranks. Rank j's
   * segment goes to block j of a padded device buffer (zeros after it), and comes back from
   * there, so the result is the ring's: this rank's segment reduced, or every segment gathered.
   */
  async #blocked(buf: Float32Array, op: "reduceScatter" | "allGather", run: (d: DeviceBuffer) => Promise<unknown>) {
    if (this.#closed) throw new CollectiveClosedError("the collective is closed");
    const { size, rank } = this;
    const n = buf.length;
    const block = Math.ceil(n / size);
    // not given back after a failure (see #staged)
    const scratch: Allocation = this.backend.alloc(Math.max(block * size * 4, 4));
    this.backend.zero(scratch.ptr, block * size * 4);
    const segments = Array.from({ length: size }, (_, j) => segment(n, size, j));
    for (const [j, sg] of segments.entries())
      if (sg.count > 0) this.backend.upload(scratch.ptr + j * block * 4, buf.subarray(sg.offset, sg.offset + sg.count));
    await run({ ptr: scratch.ptr, count: block * size });
    await this.device.join?.();
    for (const [j, sg] of segments.entries()) {
      if (sg.count === 0 || (op === "reduceScatter" && j !== rank)) continue;
      this.backend.download(scratch.ptr + j * block * 4, buf.subarray(sg.offset, sg.offset + sg.count));
    }
    this.backend.free(scratch);
    return segments[rank]!;
  }

  async #staged<T>(buf: Float32Array, run: (d: DeviceBuffer) => Promise<T>): Promise<T> {
    if (this.#closed) throw new CollectiveClosedError("the collective is closed");
    // The backend's allocator reuses freed blocks (a GPU's caching allocator): no cudaMalloc per
    // call. After a failure the scratch is not given back: an NCCL kernel the abort has not yet
    // stopped may still write it, and the allocator would hand it out again.
    const scratch: Allocation = this.backend.alloc(Math.max(buf.byteLength, 4));
    this.backend.upload(scratch.ptr, buf);
    const result = await run({ ptr: scratch.ptr, count: buf.length });
    await this.device.join?.();
    this.backend.download(scratch.ptr, buf);
    this.backend.free(scratch);
    return result;
  }
}
