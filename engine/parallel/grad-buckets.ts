// The gradient buckets of data parallelism (data-parallel.ts, and ZeRO's passes in zero.ts).
//
// Parameters are grouped, in the order backward completes their gradients, into buckets of about
// `bucketMb`. The order comes from the tape of a forward pass over `probe` (the first op to read
// a parameter is the last backward op to write its gradient); every rank runs the same model, so
// every rank cuts the same buckets. A bucket's collective starts as soon as backward has written
// its last gradient; backward yields to the event loop between ops while a bucket is in flight,
// so its pieces move while the next gradients are computed.
import type { Allocation } from "../../ffi/backend.ts";
import type { Context } from "../context.ts";
import { EngineError } from "../errors.ts";
import type { Model } from "../models/model.ts";
import type { ParamEntry } from "../params.ts";
import type { Tensor } from "../tensor.ts";
import { type HostBatch, uploadBatch } from "../train.ts";
import { type Codec, ErrorFeedback } from "./compress.ts";

export interface Bucket {
  id: number;
  entries: ParamEntry[];
  /** elements over its entries */
  numel: number;
  /** the host array the bucket is reduced in (empty while the bucket takes the device path) */
  buf: Float32Array;
  /** deviceCollective: the bucket's device buffer, all-reduced in place (null until the first
   *  step on the device path) */
  dev: Allocation | null;
  /** compression: the bucket's error feedback, and the encodings it travels as (the encoded
   *  ring's scratch, or every rank's encoding all-gathered) */
  feedback: ErrorFeedback | null;
  gathered: Float32Array | null;
}

/** Each parameter of bucket b with its part of the bucket's host buffer, in order. */
export function* slices(b: Bucket): Generator<[ParamEntry, Float32Array]> {
  let at = 0;
  for (const e of b.entries) {
    yield [e, b.buf.subarray(at, at + e.numel)];
    at += e.numel;
  }
}

/** A step's collectives in flight: how many, since when, and all of them to await. */
export class InFlight {
  #pending: Promise<void>[] = [];
  #running = 0;
  /** operations started this step */
  count = 0;
  /** when the first started (Infinity: none yet) */
  firstStart = Infinity;

  add(op: Promise<void>): void {
    this.firstStart = Math.min(this.firstStart, performance.now());
    this.count++;
    this.#running++;
    const tracked = op.finally(() => this.#running--);
    tracked.catch(() => {}); // awaited by all()
    this.#pending.push(tracked);
  }

  /** Whether any is still running (backward then yields to let its pieces move). */
  get busy(): boolean {
    return this.#running > 0;
  }

  /** Waits for every operation added so far; the next ones start a new batch. */
  async all(): Promise<void> {
    const pending = this.#pending;
    this.#pending = [];
    await Promise.all(pending);
  }
}

/** What cutting the buckets reads: the model, the probe batch, the bucket size and how buckets travel. */
export interface BucketCut {
  ctx: Context;
  model: Model;
  /** a one-row batch shaped as the job's, of zeros: its forward pass orders the buckets */
  probe: HostBatch;
  bucketMb: number;
  /** the buckets' codec (compression: each bucket gets its error feedback) */
  codec: Codec;
  /** a device collective is given: which path the buckets take is known at the first step */
  onDevice: boolean;
}

/** A rank's gradient buckets, and which bucket holds each parameter. */
export class GradBuckets {
  readonly list: readonly Bucket[];
  /** the buckets each part of the forward pass reads (lossSteps on the probe batch), in order */
  readonly forwardPlan: readonly number[][];
  readonly #bucketOf: ReadonlyMap<string, Bucket>;

  /**
   * The buckets, cut from the tape of a forward pass over a one-row batch of zeros shaped as the
   * job's (nothing is computed backward). Every rank cuts the same ones.
   */
  constructor({ ctx, model, probe, bucketMb, codec, onDevice }: BucketCut) {
    const store = model.store;
    ctx.newPass();
    const { x, y } = uploadBatch(ctx, probe);
    const parts: (readonly string[])[] = [];
    const steps = model.lossSteps(x, y);
    for (let r = steps.next(); !r.done; r = steps.next()) parts.push(r.value);
    const order = ctx.gradReadyOrder().flat();
    ctx.newPass();
    const seen = new Set<string>();
    const entries: ParamEntry[] = [];
    for (const t of order) {
      if (t.name === undefined || seen.has(t.name)) continue;
      seen.add(t.name);
      entries.push(store.entry(t.name));
    }
    // parameters no op reads have zero gradients; they ride in the last bucket
    for (const e of store.entries) if (!seen.has(e.name)) entries.push(e);
    const capElems = Math.max(1, Math.floor((bucketMb * 1e6) / 4));
    const buckets: Bucket[] = [];
    let cur: ParamEntry[] = [],
      n = 0;
    const close = () => {
      const lossy = codec.lossy;
      buckets.push({
        id: buckets.length,
        entries: cur,
        numel: n,
        // with a device collective, which path the buckets take is known at the first step
        buf: new Float32Array(onDevice ? 0 : n),
        dev: null,
        feedback: lossy ? new ErrorFeedback(codec, n) : null,
        gathered: null, // sized by the path the bucket takes, at its first step
      });
      cur = [];
      n = 0;
    };
    for (const e of entries) {
      cur.push(e);
      n += e.numel;
      if (n >= capElems) close();
    }
    if (cur.length > 0) close();
    this.list = buckets;
    const bucketOf = new Map<string, Bucket>();
    for (const bk of buckets) for (const e of bk.entries) bucketOf.set(e.name, bk);
    this.#bucketOf = bucketOf;
    this.forwardPlan = parts.map((names) => this.idsOf(names));
  }

  /** The buckets holding parameters `names`, in the order the names first come. */
  idsOf(names: readonly string[]): number[] {
    const ids: number[] = [];
    for (const n of names) {
      const b = this.#bucketOf.get(n);
      if (b !== undefined && !ids.includes(b.id)) ids.push(b.id);
    }
    return ids;
  }

  /** The bucket holding parameter `t`. */
  of(t: Tensor): Bucket {
    const b = t.name === undefined ? undefined : this.#bucketOf.get(t.name);
    if (b === undefined)
      throw new EngineError(
        `parameter ${t.name ?? "(unnamed)"} is in no gradient bucket: the tape differs from the one the buckets were cut from`,
      );
    return b;
  }

  /** With a device collective: each bucket's device buffer (`deviceBuffer`: stage 0; ZeRO's
   *  reductions on the device take their buffers from the allocator, one at a time), or its host
   *  array where this generation's communicator is on the host path, made once and kept. */
  provide(onDevice: boolean, deviceBuffer?: (bytes: number) => Allocation): void {
    for (const b of this.list) {
      if (onDevice) {
        if (deviceBuffer !== undefined) b.dev ??= deviceBuffer(Math.max(b.numel, 1) * 4);
      } else if (b.buf.length !== b.numel) b.buf = new Float32Array(b.numel);
    }
  }

  /** Each bucket's gradients left to write this pass (count them down with oneLess). */
  left(): Map<Bucket, number> {
    return new Map(this.list.map((b) => [b, b.entries.length]));
  }
}

/** Counts one more of bucket b's gradients as written; whether that was its last. */
export function oneLess(left: Map<Bucket, number>, b: Bucket): boolean {
  const n = left.get(b)! - 1;
  left.set(b, n);
  return n === 0;
}

/**
 * Backward from loss `l` (seed `seed`), one tape node at a time: each parameter gradient it
 * completes goes to `ready` (its bucket), and while buckets are in flight backward yields to
 * the event loop between nodes, so their pieces move while the next gradients are computed.
 * `gather` (ZeRO stage 3) is awaited for the parameters each node reads before it runs.
 */
export async function backwardByBucket(
  ctx: Context,
  buckets: GradBuckets,
  l: Tensor,
  seed: number,
  ready: (b: Bucket) => void,
  flight: InFlight,
  gather?: (params: readonly Tensor[]) => Promise<void>,
): Promise<void> {
  if (gather !== undefined) {
    for (const ev of ctx.backwardEvents(l, seed)) {
      if ("need" in ev) await gather(ev.need);
      else for (const t of ev.ready) ready(buckets.of(t));
      if (flight.busy) await new Promise<void>((r) => setImmediate(r));
    }
    return;
  }
  for (const done of ctx.backwardSteps(l, seed)) {
    for (const t of done) ready(buckets.of(t));
    if (flight.busy) await new Promise<void>((r) => setImmediate(r));
  }
}
