// Tensors and the reverse-mode autograd tape.
//
// A Tensor is a shape, a dtype and an address in backend memory; it never owns host data.
// Memory comes from one of two places (the Context, context.ts, hands out both):
//   - the context's Arena, for everything that lives for one forward/backward pass
//     (activations and their gradients). Context.newPass() recycles it, and any tensor of an
//     earlier pass becomes stale: ops refuse it (StaleTensorError) instead of reading reused
//     memory.
//   - persistent allocations (parameter, gradient and optimizer slabs; see params.ts), which
//     live until the context is disposed.
//
// Autograd: every op that has an input requiring grad records a TapeNode with a closure that
// adds the op's input gradients. Context.backward(loss) seeds d(loss) = 1 and runs the tape in
// reverse. Gradients accumulate (+=) into zero-initialized buffers, so a tensor used twice gets
// both contributions. A view (reshape, row slice) shares its base's gradient buffer, so views
// need no backward of their own.
import type { DType, Ptr } from "../ffi/backend.ts";
import { dtypeBytes } from "../ffi/backend.ts";
import type { Arena, ArenaBlock } from "./arena.ts";
import type { Context } from "./context.ts";
import { EngineError, ShapeError, StaleTensorError } from "./errors.ts";

export type Shape = readonly number[];

export function numelOf(shape: Shape): number {
  let n = 1;
  for (const d of shape) n *= d;
  return n;
}

export function sameShape(a: Shape, b: Shape): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

export function checkShape(op: string, shape: Shape): void {
  if (shape.length === 0 || shape.length > 8 || shape.some((d) => !Number.isSafeInteger(d) || d <= 0)) {
    throw new ShapeError(op, [shape], "every dimension must be a positive integer (1 to 8 dims)");
  }
}

/** generation of tensors that do not live in the arena */
export const persistentGeneration = -1;
/** the address of a persistent tensor that is bound to no memory (a ZeRO-3 parameter not gathered) */
const unbound = -1;

/** The smallest and largest value of an i32 tensor, known on the host without reading it back. */
export interface ValueRange {
  readonly min: number;
  readonly max: number;
}

export interface TapeNode {
  readonly op: string;
  readonly inputs: readonly Tensor[];
  readonly output: Tensor;
  /** adds the op's input gradients; a tensor-parallel op's may wait for a collective (then only
   *  the async runners, backwardAsync and backwardFromAsync, can run the tape) */
  readonly backward: () => void | Promise<void>;
  /** the arena tensors backward reads: each keeps its memory until this node has run */
  readonly saved: readonly Tensor[];
}

export class Tensor {
  readonly ctx: Context;
  readonly shape: Shape;
  readonly dtype: DType;
  #ptr: Ptr;
  readonly numel: number;
  /** arena generation it was allocated in, or -1 for persistent memory */
  readonly generation: number;
  /** the arena it lives in (its pass's), or null for persistent memory */
  readonly home: Arena | null;
  /** the tensor this one is a view of (its gradient aliases the base's) */
  readonly viewOf: Tensor | null;
  readonly viewOffset: number;
  requiresGrad: boolean;
  name: string | undefined;
  /**
   * For an i32 tensor copied from the host (Context.fromArray), and views of it: the range of
   * its values, so an op can check ids or targets without reading them back from a GPU. Null
   * when unknown. (Tensors are never written after the op that made them.)
   */
  readonly valueRange: ValueRange | null;
  #grad: Tensor | null = null;
  /** a base tensor's arena memory (null for views and persistent tensors) */
  readonly #block: ArenaBlock | null;
  #dropped = false;

  constructor(
    ctx: Context,
    shape: Shape,
    dtype: DType,
    ptr: Ptr,
    home: Arena | null,
    generation: number,
    requiresGrad = false,
    viewOf: Tensor | null = null,
    viewOffset = 0,
    valueRange: ValueRange | null = null,
    block: ArenaBlock | null = null,
  ) {
    this.#block = block;
    this.ctx = ctx;
    this.shape = shape;
    this.dtype = dtype;
    this.#ptr = ptr;
    this.numel = numelOf(shape);
    this.home = home;
    this.generation = generation;
    this.requiresGrad = requiresGrad;
    this.viewOf = viewOf;
    this.viewOffset = viewOffset;
    this.valueRange = valueRange;
  }

  /** Whether every value is known (on the host) to lie in [0, limit). */
  /**
   * The address of the tensor's first element. A view's follows its base, so a view taken in
   * forward stays right when its base is rebound before backward (ZeRO stage 3 gathers a
   * parameter into a new buffer each time); an unbound parameter throws rather than let a kernel
   * read freed memory.
   */
  get ptr(): Ptr {
    if (this.viewOf !== null) return this.viewOf.ptr + this.viewOffset * dtypeBytes[this.dtype];
    // a freed tensor's memory may hold another tensor by now: reading it is a bug (an op that
    // did not declare what its backward reads, or a caller that read what it dropped)
    if (this.#block?.freed === true) throw new StaleTensorError("read", this.shape);
    if (this.#ptr === unbound)
      throw new EngineError(
        `parameter ${this.name ?? "(unnamed)"} is not gathered on this rank (ZeRO stage 3 binds it only while a pass reads it)`,
      );
    return this.#ptr;
  }

  /** Persistent tensors only: point at other memory, or at none (null). */
  rebind(ptr: Ptr | null): void {
    if (this.generation !== persistentGeneration || this.viewOf !== null)
      throw new EngineError("only a persistent tensor that is not a view can be rebound");
    this.#ptr = ptr ?? unbound;
  }

  /** Whether the tensor is bound to memory (a ZeRO-3 parameter only while gathered). */
  get bound(): boolean {
    return this.viewOf?.bound ?? this.#ptr !== unbound;
  }

  knownInRange(limit: number): boolean {
    return this.valueRange !== null && this.valueRange.min >= 0 && this.valueRange.max < limit;
  }

  get bytes(): number {
    return this.numel * dtypeBytes[this.dtype];
  }

  get isStale(): boolean {
    // a tensor of an earlier pass, or of another pass in flight (a pipeline stage's micro-batch),
    // or one whose memory was freed
    if (this.viewOf !== null && this.viewOf.#block?.freed === true) return true;
    return (
      this.home !== null &&
      (this.generation !== this.home.generation || this.home !== this.ctx.arena || this.#block?.freed === true)
    );
  }

  /** The arena memory this tensor reads (its base's for a view), or null for persistent memory. */
  get block(): ArenaBlock | null {
    return this.viewOf === null ? this.#block : this.viewOf.#block;
  }

  /**
   * The caller will not read this tensor again: its memory is reused as soon as no recorded
   * backward still needs it (at once in a pass without gradients). Drop the tensors an op gave
   * you, not views of them (a view's drop does nothing; its base's owner drops the base).
   * Dropping twice does nothing.
   */
  drop(): void {
    const block = this.#block;
    if (block === null || this.#dropped) return;
    this.#dropped = true;
    unhold(block);
  }

  /**
   * Makes this tensor's memory its gradient buffer, if nothing will read its values again: it is
   * a base tensor with no gradient yet, its owner has dropped it, and only the running node's
   * saved reference holds it. The caller's backward then overwrites it with the gradient (the
   * loss's logits). Returns whether it did; if not, ensureGrad() makes a buffer as usual.
   */
  gradInPlace(): boolean {
    const block = this.#block;
    if (
      block === null ||
      this.viewOf !== null ||
      this.#grad !== null ||
      !this.#dropped ||
      block.holds !== 1 ||
      block.freed
    )
      return false;
    return this.#gradOver(block, this);
  }

  /** Frees the gradient buffer once the op that made this tensor has run its backward (nothing
   *  reads an activation's gradient after that). */
  freeGrad(): void {
    if (this.viewOf !== null || this.#grad === null || this.#grad.#block === null) return;
    this.#grad.drop();
    this.#grad = null;
  }

  /** The gradient buffer, or null if no gradient has reached this tensor. */
  get grad(): Tensor | null {
    if (this.viewOf !== null) {
      const baseGrad = this.viewOf.grad;
      return baseGrad === null ? null : baseGrad.#viewAt(this.shape, this.viewOffset);
    }
    return this.#grad;
  }

  /** The gradient buffer, created zeroed (in the arena) if it does not exist yet. */
  ensureGrad(): Tensor {
    if (this.viewOf !== null) return this.viewOf.ensureGrad().#viewAt(this.shape, this.viewOffset);
    if (this.#grad === null) {
      this.#grad = this.ctx.zeros(this.shape, this.dtype);
    }
    return this.#grad;
  }

  /**
   * The gradient buffer for an op whose backward writes every element of it: when there is none
   * yet it is made without zeroing and `fresh` is true, and the caller must overwrite it (a GEMM
   * with beta 0, a copy); otherwise the caller adds into it. A view's is its base's (zeroed).
   */
  gradForWrite(): { grad: Tensor; fresh: boolean } {
    if (this.viewOf !== null || this.#grad !== null || this.#block === null)
      return { grad: this.ensureGrad(), fresh: false };
    this.#grad = this.ctx.empty(this.shape, this.dtype);
    return { grad: this.#grad, fresh: true };
  }

  /**
   * Takes `src`'s memory as this tensor's gradient, when this tensor has none yet and both are
   * base arena tensors of one shape: an add's backward passes its output's gradient on without a
   * copy (src, the output's gradient, is read by nothing after that node). Returns whether it did.
   */
  shareGrad(src: Tensor): boolean {
    const block = src.#block;
    if (
      this.viewOf !== null ||
      this.#grad !== null ||
      this.#block === null ||
      src.viewOf !== null ||
      block === null ||
      block.freed
    )
      return false;
    if (!sameShape(src.shape, this.shape) || src.dtype !== this.dtype) return false;
    return this.#gradOver(block, src);
  }

  /** Makes `block` (the memory of `owner`, of this tensor's shape and type) this tensor's gradient too. */
  #gradOver(block: ArenaBlock, owner: Tensor): true {
    block.holds++;
    this.#grad = new Tensor(
      this.ctx,
      this.shape,
      this.dtype,
      block.ptr,
      owner.home,
      owner.generation,
      false,
      null,
      0,
      null,
      block,
    );
    return true;
  }

  /** Bind a persistent gradient buffer (a view into a gradient slab). */
  bindGrad(grad: Tensor): void {
    if (!sameShape(grad.shape, this.shape))
      throw new ShapeError("bindGrad", [this.shape, grad.shape], "gradient shape differs");
    this.#grad = grad;
  }

  /** Drops the gradient buffer: the next backward makes one in the arena (ZeRO stage 2's parameters). */
  unbindGrad(): void {
    this.#grad = null;
  }

  #viewAt(shape: Shape, offset: number): Tensor {
    return new Tensor(
      this.ctx,
      shape,
      this.dtype,
      this.ptr + offset * dtypeBytes[this.dtype],
      this.home,
      this.generation,
      false,
      this,
      offset,
    );
  }

  /** A view with another shape over the same elements (row-major); no copy. */
  reshape(shape: Shape): Tensor {
    const resolved = resolveReshape(this.shape, shape);
    return this.#viewOfRange(resolved, 0);
  }

  /** Rows [start, start+count) along dim 0, as a view (contiguous); no copy. */
  narrowRows(start: number, count: number): Tensor {
    const rows = this.shape[0]!;
    if (!Number.isInteger(start) || !Number.isInteger(count) || start < 0 || count <= 0 || start + count > rows) {
      throw new ShapeError("narrowRows", [this.shape], `rows [${start}, ${start + count}) outside [0, ${rows})`);
    }
    const rowElems = this.numel / rows;
    return this.#viewOfRange([count, ...this.shape.slice(1)], start * rowElems);
  }

  #viewOfRange(shape: Shape, offset: number): Tensor {
    const base = this.viewOf ?? this;
    const baseOffset = this.viewOffset + offset;
    // a view's values are some of its base's: the base's range still bounds them
    return new Tensor(
      this.ctx,
      shape,
      this.dtype,
      base.ptr + baseOffset * dtypeBytes[this.dtype],
      this.home,
      this.generation,
      this.requiresGrad,
      base,
      baseOffset,
      this.valueRange,
    );
  }

  /** Copy to host memory (a new typed array). */
  toArray(): Float32Array | Int32Array | Uint16Array {
    const out =
      this.dtype === "f32"
        ? new Float32Array(this.numel)
        : this.dtype === "i32"
          ? new Int32Array(this.numel)
          : new Uint16Array(this.numel);
    this.ctx.backend.download(this.ptr, out);
    return out;
  }

  /** Copy to host memory as float32: an f32 tensor as it is, a 2-byte one widened (exact). */
  toFloat32(): Float32Array {
    if (this.dtype === "f32") return this.toArray() as Float32Array;
    const bits = this.toArray();
    if (this.dtype === "bf16") {
      const wide = new Uint32Array(bits.length);
      for (let i = 0; i < bits.length; i++) wide[i] = bits[i]! << 16;
      return new Float32Array(wide.buffer);
    }
    if (this.dtype === "f16") return Float32Array.from(new Float16Array((bits as Uint16Array).buffer));
    throw new EngineError(`toFloat32: tensor is ${this.dtype}`);
  }

  /** The value of a one-element tensor. */
  item(): number {
    if (this.numel !== 1) throw new ShapeError("item", [this.shape], "item() needs exactly one element");
    return this.toArray()[0]!;
  }
}

/** One holder fewer: frees the block when none is left. */
export function unhold(block: ArenaBlock): void {
  if (block.freed) return;
  if (--block.holds <= 0) block.arena.free(block);
}

/** Drops each of the tensors (an op's scratch once its kernels have run). */
export function dropAll(...tensors: readonly Tensor[]): void {
  for (const t of tensors) t.drop();
}

function resolveReshape(from: Shape, to: Shape): Shape {
  const n = numelOf(from);
  const inferred = to.indexOf(-1);
  let shape = to;
  if (inferred >= 0) {
    const known = numelOf(to.filter((_, i) => i !== inferred));
    if (known <= 0 || n % known !== 0) throw new ShapeError("reshape", [from, to], `cannot infer -1`);
    shape = to.map((d, i) => (i === inferred ? n / known : d));
  }
  checkShape("reshape", shape);
  if (numelOf(shape) !== n)
    throw new ShapeError("reshape", [from, to], `element counts differ (${n} vs ${numelOf(shape)})`);
  return shape;
}
