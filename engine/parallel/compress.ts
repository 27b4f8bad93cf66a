// Gradient compression (`--compress none|bf16|fp16|int8|topk:<fraction>`): how a vector of f32
// gradients (a bucket in all-reduce mode, a chunk in a parameter-server push) is cut down
// before it goes on the wire, and how a receiver reads it back.
//
//   bf16, fp16  each value rounded to 16 bits (to nearest even; fp16 overflows to Inf, which
//               the f16 loss scaler then treats as any overflow)
//   int8        each block of values (a chunk of the job's layout in a push, `int8BlockElems`
//               in a bucket) as int8 times one scale, a power of two: 2^ceil(log2(max|x|/127)).
//               Reconstruction error per value <= scale/2 < max|x|/127. The power of two costs
//               at most one bit of range and makes x - q·scale exact in f32.
//   topk:f      the ceil(f·n) values largest in magnitude, as (index, value) pairs, indices
//               ascending. Over the learning rate's warm-up the fraction falls from 1 to f
//               exponentially (f^(step/warmup)), as deep gradient compression warms up (Lin
//               et al. 2018): the first steps, whose gradients change fastest, go nearly dense.
//
// Every lossy codec runs with error feedback (Seide et al. 2014, Stich et al. 2018): what a
// rank did not send of its gradient is kept in a residual and added to its next step's
// gradient before encoding, so nothing is lost, only delayed. For each step
//   x = g + residual;  sent = decode(encode(x));  residual' = x - sent
// and sent + residual' equals x exactly (each codec's rounding leaves an f32-exact remainder:
// see the codecs above), which test/engine/compress.test.ts checks in float64 step after step.
//
// In all-reduce mode bf16, fp16 and int8 buckets go round the ring encoded (ring.ts's
// encodedRing): at each reduce-scatter hop a rank adds its values to the partial sum it received
// and encodes the new partial sum through its error feedback, so each hop's rounding stays in that
// rank's residual and comes back at its next step; a segment's owner encodes the whole sum once,
// and that encoding is all-gathered. Each link carries 2(N-1)/N·bytes(encoded), against the f32
// ring's 2(N-1)/N·4n: half with bf16 and fp16, about a quarter with int8. Top-k is all-gathered
// instead (a partial sum of sparse vectors fills in): every rank's encoded bucket goes to every
// rank, which sums the decoded contributions in rank order, (N-1)·bytes(encoded) per link, which
// pays off at 1% for any N up to 100. Either way every rank ends with the same bits.
import { hostKernels } from "../../ffi/cpu/host.ts";
import { ConfigError } from "../../ffi/errors.ts";
import type { WireCoder } from "./collective.ts";

export type Compression =
  | { kind: "none" }
  | { kind: "bf16" }
  | { kind: "fp16" }
  | { kind: "int8" }
  | { kind: "topk"; fraction: number };

/** int8 in all-reduce buckets: one scale per this many values (0.2% more bytes; a layer's
 *  gradients and the next one's rarely share a scale) */
export const int8BlockElems = 2048;

/** A value the CLI and the job config take: none, bf16, fp16, int8 or topk:<fraction in (0, 1]>. */
export const compressionPattern = /^(none|bf16|fp16|int8|topk:\d*\.?\d+(e-?\d+)?)$/;

export function parseCompression(text: string): Compression {
  if (!compressionPattern.test(text))
    throw new ConfigError(
      `compression must be none, bf16, fp16, int8 or topk:<fraction in (0, 1]> (topk:0.01 sends 1%), got "${text}"`,
    );
  if (!text.startsWith("topk:")) return { kind: text as "none" | "bf16" | "fp16" | "int8" };
  const fraction = Number(text.slice(5));
  if (!(fraction > 0 && fraction <= 1))
    throw new ConfigError(`topk's fraction must be in (0, 1], got ${text.slice(5)}`);
  return { kind: "topk", fraction };
}

export const compressionName = (c: Compression): string => (c.kind === "topk" ? `topk:${c.fraction}` : c.kind);

/** A compressed contribution that does not decode: a bug or a hostile sender. */
export class CompressionError extends Error {
  override readonly name = "CompressionError";
}

const pad4 = (bytes: number) => Math.ceil(bytes / 4) * 4;

/**
 * One codec, for vectors of any length. An encoded vector of n values takes slotBytes(n) bytes
 * (a multiple of 4), laid out as
 *   bf16/fp16  n uint16
 *   int8       ceil(n/block) f32 scales, then n int8
 *   topk       k uint32 indices (ascending), then k f32 values
 *   none       n f32
 */
export class Codec {
  readonly #k = hostKernels();
  #scratch = new Float32Array(0);
  /** topk: the fraction sent now (atStep) */
  #fraction: number;

  constructor(
    readonly compression: Compression,
    /** int8: values per scale */
    readonly block = int8BlockElems,
  ) {
    if (!(Number.isInteger(block) && block > 0)) throw new RangeError(`int8 block of ${block} values`);
    this.#fraction = compression.kind === "topk" ? compression.fraction : 1;
  }

  /** topk: sets the fraction sent at `step` of a run that warms up over `warmup` steps (every rank computes the same). */
  atStep(step: number, warmup: number): void {
    const c = this.compression;
    if (c.kind !== "topk") return;
    this.#fraction = warmup > 0 && step < warmup ? c.fraction ** (step / warmup) : c.fraction;
  }

  /** topk: the fraction sent now */
  get fraction(): number {
    return this.#fraction;
  }

  get kind(): Compression["kind"] {
    return this.compression.kind;
  }

  /** Does decode(encode(x)) differ from x (and so need error feedback)? */
  get lossy(): boolean {
    return this.kind !== "none";
  }

  /** topk: the values sent of n */
  keep(n: number): number {
    return this.kind === "topk" ? Math.min(n, Math.max(1, Math.ceil(this.#fraction * n))) : n;
  }

  scaleCount(n: number): number {
    return Math.ceil(n / this.block);
  }

  slotBytes(n: number): number {
    switch (this.kind) {
      case "none":
        return 4 * n;
      case "bf16":
      case "fp16":
        return pad4(2 * n);
      case "int8":
        return 4 * this.scaleCount(n) + pad4(n);
      case "topk":
        return n === 0 ? 0 : 8 * this.keep(n);
    }
  }

  /** f32 bytes over encoded bytes, for n values */
  ratio(n: number): number {
    return (4 * n) / Math.max(1, this.slotBytes(n));
  }

  /** Writes x's encoding into `slot` (slotBytes(x.length) bytes, 4-byte aligned). */
  encode(x: Float32Array, slot: Uint8Array): void {
    const n = x.length;
    this.#checkSlot(n, slot);
    if (n === 0) return;
    const at = slot.byteOffset,
      buf = slot.buffer;
    switch (this.kind) {
      case "none":
        new Float32Array(buf, at, n).set(x);
        return;
      case "bf16":
        this.#k.toBf16(new Uint16Array(buf, at, n), x);
        return;
      case "fp16":
        this.#k.toF16(new Uint16Array(buf, at, n), x);
        return;
      case "int8": {
        const s = this.scaleCount(n);
        this.#k.encodeI8(new Int8Array(buf, at + 4 * s, n), new Float32Array(buf, at, s), x, this.block);
        return;
      }
      case "topk": {
        const k = this.keep(n);
        this.#k.topK(new Uint32Array(buf, at, k), new Float32Array(buf, at + 4 * k, k), x, this.#scratchOf(n));
        return;
      }
    }
  }

  /**
   * out = decode(slot) (add: out += decode(slot)). A slot that does not decode (top-k indices
   * out of range or not ascending, a negative or infinite int8 scale) throws CompressionError;
   * a NaN int8 scale is a sender's overflow and decodes to NaN.
   */
  decode(slot: Uint8Array, out: Float32Array, add: boolean): void {
    const n = out.length;
    this.#checkSlot(n, slot);
    if (n === 0) return;
    const at = slot.byteOffset,
      buf = slot.buffer;
    switch (this.kind) {
      case "none": {
        const v = new Float32Array(buf, at, n);
        if (!add) out.set(v);
        else for (let i = 0; i < n; i++) out[i]! += v[i]!;
        return;
      }
      case "bf16":
        this.#k.fromBf16(out, new Uint16Array(buf, at, n), add);
        return;
      case "fp16":
        this.#k.fromF16(out, new Uint16Array(buf, at, n), add);
        return;
      case "int8": {
        const s = this.scaleCount(n);
        const scales = new Float32Array(buf, at, s);
        checkScales(scales);
        this.#k.decodeI8(out, new Int8Array(buf, at + 4 * s, n), scales, this.block, add);
        return;
      }
      case "topk": {
        const k = this.keep(n);
        const idx = new Uint32Array(buf, at, k);
        checkIndices(idx, n);
        if (!add) out.fill(0);
        this.#k.scatterAdd(out, idx, new Float32Array(buf, at + 4 * k, k));
        return;
      }
    }
  }

  /** topk: the keep(x.length) entries of x largest in magnitude, indices ascending. */
  selectTopK(x: Float32Array): { idx: Uint32Array; values: Float32Array } {
    if (this.kind !== "topk") throw new RangeError(`selectTopK on a ${this.kind} codec`);
    const k = x.length === 0 ? 0 : this.keep(x.length);
    const idx = new Uint32Array(k),
      values = new Float32Array(k);
    if (k > 0) this.#k.topK(idx, values, x, this.#scratchOf(x.length));
    return { idx, values };
  }

  #checkSlot(n: number, slot: Uint8Array): void {
    if (slot.byteLength !== this.slotBytes(n) || slot.byteOffset % 4 !== 0)
      throw new RangeError(
        `a ${this.kind} slot for ${n} values is ${this.slotBytes(n)} bytes at a 4-byte boundary, got ${slot.byteLength} at ${slot.byteOffset}`,
      );
  }

  #scratchOf(n: number): Float32Array {
    if (this.#scratch.length < n) this.#scratch = new Float32Array(n);
    return this.#scratch;
  }
}

/** int8 scales are 0, a positive finite number, or NaN (the sender's block overflowed). */
export function checkScales(scales: Float32Array): void {
  for (const s of scales)
    if (s < 0 || s === Infinity)
      throw new CompressionError(`an int8 scale of ${s}: scales are finite and >= 0 (NaN marks an overflow)`);
}

/** Top-k indices: strictly ascending, each below n. */
export function checkIndices(idx: Uint32Array, n: number): void {
  let last = -1;
  for (const i of idx) {
    if (i <= last || i >= n)
      throw new CompressionError(
        `top-k indices must ascend strictly below ${n}; got ${i} after ${last < 0 ? "the start" : last}`,
      );
    last = i;
  }
}

/**
 * Error feedback for one vector (a bucket, or the whole gradient in parameter-server mode):
 * encode x + residual, and keep what the encoding left out for the next step.
 */
export class ErrorFeedback {
  readonly residual: Float32Array;
  readonly #k = hostKernels();
  #sent: Float32Array;

  constructor(
    readonly codec: Codec,
    numel: number,
  ) {
    this.residual = new Float32Array(codec.lossy ? numel : 0);
    this.#sent = new Float32Array(0);
  }

  /**
   * Adds the residual of elements [at, at + x.length) into x (in place), encodes x into `slot`,
   * and keeps x - decode(slot) as the new residual (`becomeSent`: x then holds decode(slot)). A value that is not finite (an overflow the
   * loss scaler will skip) leaves a residual of 0 there, not a poisoned one.
   */
  encode(x: Float32Array, slot: Uint8Array, at = 0, becomeSent = false): void {
    const codec = this.codec;
    codec.encode(this.#compensate(x, at), slot);
    if (!codec.lossy) return;
    const n = x.length;
    if (this.#sent.length < n) this.#sent = new Float32Array(n);
    const sent = this.#sent.subarray(0, n);
    codec.decode(slot, sent, false);
    this.#k.residual(this.residual.subarray(at, at + n), x, sent);
    if (becomeSent) x.set(sent);
  }

  /**
   * What an encoded all-reduce sends with (collective.ts's WireCoder): each range encoded through
   * this error feedback, and left holding what its encoding decodes to; `scratch` is where the
   * operation's encodings go.
   */
  wireCoder(scratch: (words: number) => Float32Array): WireCoder {
    const codec = this.codec;
    return {
      slotBytes: (n) => codec.slotBytes(n),
      encode: (x, slot, at) => this.encode(x, slot, at, true),
      decode: (slot, out, add) => codec.decode(slot, out, add),
      scratch,
    };
  }

  /**
   * topk over the whole vector at once (a parameter-server push: the budget goes where the
   * gradient is largest, not an equal share to every chunk). Adds the residual into x (in place),
   * picks the top entries, and keeps everything else as the residual; as with encode, a value
   * that is not finite leaves a residual of 0.
   */
  selectTopK(x: Float32Array): { idx: Uint32Array; values: Float32Array } {
    const r = this.residual;
    if (x.length !== r.length) throw new RangeError(`top-k error feedback over ${x.length} values of ${r.length}`);
    const picked = this.codec.selectTopK(this.#compensate(x, 0));
    for (let i = 0; i < x.length; i++) r[i] = Number.isFinite(x[i]!) ? x[i]! : 0;
    for (const i of picked.idx) r[i] = 0;
    return picked;
  }

  #compensate(x: Float32Array, at: number): Float32Array {
    if (!this.codec.lossy) return x;
    const r = this.residual;
    if (at < 0 || at + x.length > r.length)
      throw new RangeError(`error feedback over [${at}, ${at + x.length}) of ${r.length} values`);
    const part = r.subarray(at, at + x.length);
    this.#k.addInto(x, new Uint8Array(part.buffer, part.byteOffset, part.byteLength));
    return x;
  }

  /** The residual follows a change of the loss scale (it is in the scaled gradient's units). */
  rescale(factor: number): void {
    if (factor === 1) return;
    const r = this.residual;
    for (let i = 0; i < r.length; i++) r[i]! *= factor;
  }

  reset(): void {
    this.residual.fill(0);
  }
}

/** Entries of x that are not zero, over its length (what a summed top-k bucket holds). */
export function density(x: Float32Array): number {
  let nz = 0;
  for (let i = 0; i < x.length; i++) if (x[i] !== 0) nz++;
  return x.length === 0 ? 0 : nz / x.length;
}
