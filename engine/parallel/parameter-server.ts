// The parameter-server algorithm (`--sync bsp|ssp|asp`), apart from the messages that carry it:
//
//   a trainer's push   the gradient vector cut into the layout's chunks, each compressed with
//                      error feedback (top-k picks its entries over the whole vector, so a chunk
//                      sends as many as it holds of them: an equal share of every chunk cost 0.23
//                      nats of GPT validation loss) — encodeSlice, topKSlice, PushEncoder;
//   a shard's update   the chunks it owns in three backend slabs (f32 master parameters, a sum of
//                      pushed gradients, optimizer state); a push is staged and checked finite,
//                      summed, averaged once enough pushes are in, clipped by the global norm the
//                      shards agree on, and applied with the job's optimizer — ShardOptimizer.
//
// The protocol around it (versions, clocks, pulls that wait, duplicates, the norm agreement
// between shards, snapshots) is services/parameter-server/shard.ts's; the requests are
// services/trainer/ps-client.ts's; chunk-codec.ts maps an EncodedGradient onto a Chunk message.
import { type OptimizerSpec, updateRule } from "../optim/choose.ts";
import type { UpdateRule } from "../optim/optimizer.ts";
import type { Allocation, Backend } from "../../ffi/backend.ts";
import { hostKernels } from "../../ffi/cpu/host.ts";
import { clipFactor } from "../optim/clip.ts";
import { checkIndices, checkScales, Codec, type Compression, ErrorFeedback } from "./compress.ts";

/** One chunk of a gradient as it travels, apart from the message around it. */
export interface EncodedGradient {
  kind: Compression["kind"];
  count: number;
  /** none: count f32; bf16/fp16: count uint16; int8: count int8; topk: nnz uint32 indices
   *  (ascending, within the chunk) then nnz f32 values */
  data: Uint8Array;
  /** int8: the chunk's one scale (1 otherwise) */
  scale: number;
  /** topk: the entries sent (0 otherwise) */
  nnz: number;
}

/** A codec for one job's chunks: int8 takes one scale per chunk. */
export const chunkCodec = (c: Compression, chunkElems: number): Codec => new Codec(c, Math.max(1, chunkElems));

/**
 * Encodes x (elements [at, at + x.length) of the feedback's vector; x is overwritten with
 * gradient + residual) in the feedback codec's format.
 */
export function encodeSlice(ef: ErrorFeedback, x: Float32Array, at: number): EncodedGradient {
  const codec = ef.codec;
  const n = x.length;
  const slot = new Uint8Array(codec.slotBytes(n));
  ef.encode(x, slot, at);
  const e: EncodedGradient = { kind: codec.kind, count: n, data: slot, scale: 1, nnz: 0 };
  switch (codec.kind) {
    case "bf16":
    case "fp16":
      return { ...e, data: slot.subarray(0, 2 * n) };
    case "int8": {
      const scales = 4 * codec.scaleCount(n);
      return {
        ...e,
        scale: n > 0 ? new Float32Array(slot.buffer, 0, 1)[0]! : 0,
        data: slot.subarray(scales, scales + n),
      };
    }
    case "topk":
      return { ...e, nnz: n > 0 ? codec.keep(n) : 0 };
    case "none":
      return e;
  }
}

/** The first position of the ascending `idx` whose index is >= at. */
function lowerBound(idx: Uint32Array, at: number): number {
  let lo = 0,
    hi = idx.length;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (idx[mid]! < at) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/**
 * Elements [at, at + count) of a top-k selection over the whole vector (ErrorFeedback.selectTopK):
 * its entries, however many fall in the slice (0 included).
 */
export function topKSlice(sel: { idx: Uint32Array; values: Float32Array }, at: number, count: number): EncodedGradient {
  const lo = lowerBound(sel.idx, at),
    hi = lowerBound(sel.idx, at + count);
  const nnz = hi - lo;
  const data = new Uint8Array(8 * nnz);
  const idx = new Uint32Array(data.buffer, 0, nnz);
  for (let j = 0; j < nnz; j++) idx[j] = sel.idx[lo + j]! - at;
  new Float32Array(data.buffer, 4 * nnz, nnz).set(sel.values.subarray(lo, hi));
  return { kind: "topk", count, data, scale: 1, nnz };
}

/** Dense f16/bf16 data as a Uint16Array (copied when the payload is not 2-byte aligned). */
const u16Of = (data: Uint8Array, n: number): Uint16Array =>
  data.byteOffset % 2 === 0
    ? new Uint16Array(data.buffer, data.byteOffset, n)
    : new Uint16Array(data.slice().buffer, 0, n);

/**
 * out = the chunk's values as f32 (out.length === e.count). One that does not decode (top-k
 * indices out of order or range, an int8 scale that is negative or infinite) throws
 * CompressionError; a NaN int8 scale decodes to NaN (a finiteness check then names it).
 */
export function decodeGradient(e: EncodedGradient, out: Float32Array): void {
  const k = hostKernels();
  const n = e.count;
  if (out.length !== n) throw new RangeError(`decodeGradient: ${out.length} outputs for a chunk of ${n}`);
  switch (e.kind) {
    case "none":
      new Uint8Array(out.buffer, out.byteOffset, 4 * n).set(e.data);
      return;
    case "bf16":
      k.fromBf16(out, u16Of(e.data, n), false);
      return;
    case "fp16":
      k.fromF16(out, u16Of(e.data, n), false);
      return;
    case "int8": {
      const scales = new Float32Array([e.scale]);
      checkScales(scales);
      k.decodeI8(out, new Int8Array(e.data.buffer, e.data.byteOffset, n), scales, Math.max(n, 1), false);
      return;
    }
    case "topk": {
      const aligned = e.data.slice(); // indices and values at 4-byte boundaries
      const idx = new Uint32Array(aligned.buffer, 0, e.nnz);
      checkIndices(idx, n);
      out.fill(0);
      k.scatterAdd(out, idx, new Float32Array(aligned.buffer, 4 * e.nnz, e.nnz));
      return;
    }
  }
}

/**
 * A trainer's side of a push: begin(step, grads) once per step, then chunk(at, count) for each
 * chunk of the layout, in any order. Uncompressed chunks are views of `grads`.
 */
export class PushEncoder {
  readonly #feedback: ErrorFeedback | null;
  #grads: Float32Array = new Float32Array(0);
  #selected: { idx: Uint32Array; values: Float32Array } | null = null;

  constructor(
    compression: Compression,
    chunkElems: number,
    /** elements of the gradient vector the chunks cover */
    numel: number,
    /** the learning rate's warm-up steps (top-k's fraction warms up with it) */
    readonly warmupSteps = 0,
  ) {
    const codec = chunkCodec(compression, chunkElems);
    this.#feedback = codec.lossy ? new ErrorFeedback(codec, numel) : null;
  }

  /** Step `step`'s gradient (compressed: overwritten with gradient + residual as chunks are encoded). */
  begin(step: number, grads: Float32Array): void {
    this.#grads = grads;
    const ef = this.#feedback;
    ef?.codec.atStep(step, this.warmupSteps);
    // top-k picks over the whole gradient, so each chunk sends what it holds of the largest
    this.#selected = ef?.codec.kind === "topk" ? ef.selectTopK(grads.subarray(0, ef.residual.length)) : null;
  }

  /** Elements [at, at + count) of the gradient begun, encoded. */
  chunk(at: number, count: number): EncodedGradient {
    if (this.#selected !== null) return topKSlice(this.#selected, at, count);
    const x = this.#grads.subarray(at, at + count);
    if (this.#feedback !== null) return encodeSlice(this.#feedback, x, at);
    return { kind: "none", count, data: new Uint8Array(x.buffer, x.byteOffset, x.byteLength), scale: 1, nnz: 0 };
  }
}

/** A chunk a shard owns: its elements, the first decayCount of which take weight decay. */
export interface ShardChunk {
  count: number;
  decayCount: number;
}

/** Chunks start at multiples of this many elements in a shard's slabs. */
const alignElems = 16;
const aligned = (n: number) => Math.ceil(n / alignElems) * alignElems;

/**
 * A shard's arithmetic over the chunks it owns (numbered 0..n-1 here): stage a push, sum and
 * average the pushes of an update, the sum of squares the global norm is agreed from, the
 * optimizer step, and the state a snapshot reads and a restore writes.
 */
export class ShardOptimizer {
  /** the optimizer state's vectors, by name (a snapshot's order) */
  readonly stateNames: readonly string[];
  readonly #be: Backend;
  readonly #rule: UpdateRule;
  /** element offset of each chunk in the slabs */
  readonly #local: number[] = [];
  readonly #chunks: readonly ShardChunk[];
  /** pushes summed into each chunk's gradient slab since its last update */
  readonly #pending: number[];
  readonly #params: Allocation;
  readonly #sums: Allocation;
  readonly #state: Allocation[];
  /** backend memory a push's gradients are uploaded to and checked in (grown, never shrunk) */
  #staging: Allocation | null = null;
  #stagingElems = 0;

  constructor(
    backend: Backend,
    chunks: readonly ShardChunk[],
    /** PyTorch's AdamW or SGD, as engine/optim/choose.ts names them (each chunk counts its own steps) */
    optimizer: OptimizerSpec,
    /** the pushes skip coordinates (top-k): AdamW keeps each one's age (engine/optim/adamw.ts) */
    sparse: boolean,
    /** chunk i's initial parameters */
    initial: (i: number) => Float32Array,
  ) {
    this.#be = backend;
    this.#chunks = chunks;
    this.#rule = updateRule(optimizer, { sparse });
    let local = 0;
    for (const c of chunks) {
      this.#local.push(local);
      local += aligned(c.count);
    }
    this.#pending = chunks.map(() => 0);
    const bytes = Math.max(local, alignElems) * 4;
    const zeroed = () => {
      const a = backend.alloc(bytes);
      backend.zero(a.ptr, bytes);
      return a;
    };
    this.#params = backend.alloc(bytes);
    this.#sums = zeroed();
    this.stateNames = this.#rule.stateNames;
    this.#state = this.stateNames.map(zeroed);
    chunks.forEach((_, i) => backend.upload(this.#at(this.#params, i), initial(i)));
  }

  #at(a: Allocation, i: number): number {
    return a.ptr + this.#local[i]! * 4;
  }

  /**
   * Uploads one push's gradients (f32, one per chunk, bytes or values) to staging memory and
   * checks them: returns where each one is staged, and the position in `grads` of the first that
   * holds NaN or Inf (-1: none). The staging memory is the next stage's: use it before then.
   */
  stage(grads: readonly (Float32Array | Uint8Array)[]): { at: number[]; nonFinite: number } {
    const elems = grads.map((g) => aligned(g.byteLength / 4));
    const total = elems.reduce((a, b) => a + b, 0);
    if (total > this.#stagingElems) {
      if (this.#staging) this.#be.free(this.#staging);
      this.#staging = this.#be.alloc(Math.max(total, alignElems) * 4);
      this.#stagingElems = total;
    }
    const at: number[] = [];
    let ptr = this.#staging?.ptr ?? 0;
    for (const [k, g] of grads.entries()) {
      this.#be.upload(ptr, g);
      at.push(ptr);
      ptr += elems[k]! * 4;
    }
    let nonFinite = -1;
    if (total > 0 && this.#be.countNonFinite(at[0]!, total) > 0)
      nonFinite = grads.findIndex((g, k) => this.#be.countNonFinite(at[k]!, g.byteLength / 4) > 0);
    return { at, nonFinite };
  }

  /** Pushes summed into chunk i since its last update. */
  pending(i: number): number {
    return this.#pending[i]!;
  }

  /**
   * Adds a staged gradient to chunk i's sum; once `need` pushes are in, the sum becomes their
   * average and this returns true (apply it, or clip it first).
   */
  accumulate(i: number, staged: number, need: number): boolean {
    const be = this.#be;
    const n = this.#chunks[i]!.count;
    const sum = this.#at(this.#sums, i);
    if (this.#pending[i] === 0) be.copy(sum, staged, n * 4);
    else be.axpy(sum, staged, n, 1);
    const pushes = ++this.#pending[i]!;
    if (pushes < need) return false;
    be.scale(sum, n, 1 / pushes);
    return true;
  }

  /** The sum of squares of the averaged gradients of `chunks` (their part of the global norm). */
  sumSquares(chunks: Iterable<number>): number {
    let s = 0;
    for (const i of chunks) s += this.#be.sumSquares(this.#at(this.#sums, i), this.#chunks[i]!.count);
    return s;
  }

  /**
   * One optimizer step of chunk i, its `version`-th (0: the first), from its averaged sum
   * clipped by the global norm `norm` at `clip` (0: no clipping), or from a staged push alone.
   */
  apply(i: number, lr: number, version: number, from: { norm: number; clip: number } | { staged: number }): void {
    let g: number;
    if ("staged" in from) g = from.staged;
    else {
      g = this.#at(this.#sums, i);
      const factor = clipFactor(from.norm, from.clip);
      if (factor !== 1) this.#be.scale(g, this.#chunks[i]!.count, factor);
      this.#pending[i] = 0;
    }
    this.#step(i, g, lr, version);
  }

  #step(i: number, g: number, lr: number, version: number): void {
    const c = this.#chunks[i]!;
    const run = { param: this.#at(this.#params, i), grad: g, numel: c.count, decayNumel: c.decayCount };
    this.#rule.step(this.#be, { ...run, state: this.#state.map((a) => this.#at(a, i)) }, lr, version + 1);
  }

  /** Chunk i's f32 parameters into `out` (host memory of its count, in bytes or values). */
  readParams(i: number, out: ArrayBufferView): void {
    this.#be.download(this.#at(this.#params, i), out);
  }

  /** Chunk i's optimizer state, one copy per vector (stateNames' order). */
  readState(i: number): Float32Array[] {
    return this.#state.map((a) => {
      const v = new Float32Array(this.#chunks[i]!.count);
      this.#be.download(this.#at(a, i), v);
      return v;
    });
  }

  /** Replaces chunk i's parameters and optimizer state (stateNames' order) and drops its pending sum. */
  load(i: number, params: Float32Array, state: readonly Float32Array[]): void {
    this.#be.upload(this.#at(this.#params, i), params);
    state.forEach((v, k) => this.#be.upload(this.#at(this.#state[k]!, i), v));
    this.#be.zero(this.#at(this.#sums, i), this.#chunks[i]!.count * 4);
    this.#pending[i] = 0;
  }

  dispose(): void {
    for (const a of [this.#params, this.#sums, ...(this.#staging ? [this.#staging] : []), ...this.#state])
      this.#be.free(a);
  }
}
