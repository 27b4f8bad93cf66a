// Tensors, the context that owns their memory, and the reverse-mode autograd tape.
//
// A Tensor is a shape, a dtype and an address in backend memory; it never owns host data.
// Memory comes from one of two places:
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
import type { Allocation, Backend, DType, Ptr } from "../ffi/backend.ts";
import { dtypeBytes } from "../ffi/backend.ts";
import { Arena, type ArenaBlock, type ArenaMark } from "./arena.ts";
import { EngineError, ShapeError, StaleTensorError } from "./errors.ts";
import { checkPrecision, type Precision } from "./mixed.ts";
import { castInto } from "./ops/cast.ts";

export type Shape = readonly number[];

export function numelOf(shape: Shape): number {
  let n = 1;
  for (const d of shape) n *= d;
  return n;
}

export function sameShape(a: Shape, b: Shape): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

function checkShape(op: string, shape: Shape): void {
  if (shape.length === 0 || shape.length > 8 || shape.some((d) => !Number.isSafeInteger(d) || d <= 0)) {
    throw new ShapeError(op, [shape], "every dimension must be a positive integer (1 to 8 dims)");
  }
}

/** generation of tensors that do not live in the arena */
const persistentGeneration = -1;
/** the address of a persistent tensor that is bound to no memory (a ZeRO-3 parameter not gathered) */
const unbound = -1;

/** The smallest and largest value of an i32 tensor, known on the host without reading it back. */
export interface ValueRange {
  readonly min: number;
  readonly max: number;
}

function rangeOf(data: Int32Array): ValueRange {
  let min = Infinity;
  let max = -Infinity;
  for (let i = 0; i < data.length; i++) {
    const v = data[i]!;
    if (v < min) min = v;
    if (v > max) max = v;
  }
  return { min, max };
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
function unhold(block: ArenaBlock): void {
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

export interface ContextOptions {
  /** base seed of dropout masks */
  seed?: number;
  /** what matmul's GEMMs read (engine/mixed.ts); default "f32" */
  precision?: Precision;
  /** fill every tensor empty() returns with NaN, so that a kernel that leaves an element
   *  unwritten fails the parity tests (tests only: it costs a fill per tensor). Default off. */
  poison?: boolean;
}

// Poison values for fill(), which writes f32 elements. A JavaScript number cannot carry a NaN
// payload into fill(), and a canonical f32 NaN (0x7fc00000) seen as two 2-byte elements is
// 0x0000 and 0x7fc0: only every other element would be poisoned. So 2-byte tensors get a
// finite f32 whose two halves are each poison: 0x7e00, an f16 NaN, for f16; and for bf16
// 0x7f7f, the largest finite bf16 (3.4e38), because an f32 whose upper half is a bf16 NaN is
// itself a NaN.
const f32OfBits = (bits: number) => new Float32Array(new Uint32Array([bits]).buffer)[0]!;
const poisonValue: Readonly<Record<DType, number>> = {
  f32: NaN,
  i32: NaN,
  f16: f32OfBits(0x7e007e00),
  bf16: f32OfBits(0x7f7f7f7f),
};

/**
 * The memory and the tape of one forward/backward pass. A context has one of its own, which
 * newPass() recycles; a pipeline stage keeps one open per micro-batch in flight (openPass), so
 * that a micro-batch's activations live from its forward to its backward and are freed then,
 * whatever the order of the others.
 */
export class Pass {
  readonly arena: Arena;
  tape: TapeNode[] = [];

  constructor(backend: Backend) {
    this.arena = new Arena(backend);
  }
}

export class Context {
  readonly backend: Backend;
  readonly #own: Pass;
  /** the pass ops allocate in and record on */
  #pass: Pass;
  readonly #open = new Set<Pass>();
  readonly #idle: Pass[] = [];
  /** false inside noGrad(): ops record nothing */
  gradEnabled = true;
  /** false in evaluation: dropout is the identity */
  training = true;
  /** what matmul's GEMMs read; may be changed between passes (engine/mixed.ts) */
  precision: Precision;
  readonly poison: boolean;
  readonly #persistent: Allocation[] = [];
  #scalars: Allocation | null = null;
  #dropoutSeed: bigint;
  #dropoutCalls = 0n;

  constructor(backend: Backend, options: ContextOptions = {}) {
    this.backend = backend;
    this.#own = new Pass(backend);
    this.#pass = this.#own;
    this.#dropoutSeed = BigInt.asUintN(64, BigInt(options.seed ?? 0));
    this.precision = checkPrecision(options.precision ?? "f32");
    this.poison = options.poison ?? false;
  }

  /** The ops recorded since the pass began (backward empties it). */
  get tape(): readonly TapeNode[] {
    return this.#pass.tape;
  }

  /** The current pass's memory. */
  get arena(): Arena {
    return this.#pass.arena;
  }

  /** Start a new forward/backward pass: recycle the arena and clear the tape. */
  newPass(): void {
    if (this.#pass !== this.#own)
      throw new EngineError("newPass: inside another pass (inPass); close that pass instead");
    this.#own.tape.length = 0;
    this.#own.arena.reset();
    if (!this.keepWeightCopies) this.weightCopySerial++;
  }

  /**
   * The parameters' 2-byte copies (engine/params.ts weightCopy) are cast again in a pass whose
   * serial differs from the one they were cast at: every new pass moves it, unless
   * keepWeightCopies says that no parameter was written since (a step's later micro-batches).
   */
  weightCopySerial = 0;
  keepWeightCopies = false;

  /** A pass of its own memory and tape, beside the context's (a pipeline stage's micro-batch):
   *  ops run in it inside inPass(), and its memory lives until closePass(). */
  openPass(): Pass {
    if (!this.keepWeightCopies) this.weightCopySerial++;
    const pass = this.#idle.pop() ?? new Pass(this.backend);
    this.#open.add(pass);
    return pass;
  }

  /** Runs fn with ops allocating in, and recording on, `pass`. */
  inPass<T>(pass: Pass, fn: () => T): T {
    if (!this.#open.has(pass)) throw new EngineError("inPass: that pass is not open in this context");
    const previous = this.#pass;
    this.#pass = pass;
    try {
      return fn();
    } finally {
      this.#pass = previous;
    }
  }

  /** Frees a pass's memory (its tensors become stale) and keeps it for the next openPass(). */
  closePass(pass: Pass): void {
    if (!this.#open.delete(pass)) throw new EngineError("closePass: that pass is not open in this context");
    if (this.#pass === pass) throw new EngineError("closePass: the pass is running (inside inPass)");
    pass.tape.length = 0;
    pass.arena.reset();
    this.#idle.push(pass);
  }

  /** Bytes in use now in the context's pass and every open one: the activations held. */
  get heldBytes(): number {
    let sum = this.#own.arena.usedBytes;
    for (const p of this.#open) sum += p.arena.usedBytes;
    return sum;
  }

  /** The passes open now (micro-batches whose activations are held). */
  get openPasses(): number {
    return this.#open.size;
  }

  empty(shape: Shape, dtype: DType = "f32"): Tensor {
    checkShape("empty", shape);
    return this.#arenaTensor(shape, dtype, null);
  }

  #arenaTensor(shape: Shape, dtype: DType, valueRange: ValueRange | null, zeroed = false): Tensor {
    const bytes = numelOf(shape) * dtypeBytes[dtype];
    const arena = this.arena;
    if (this.poison && arena.onFree === null) arena.onFree = (b) => this.backend.fill(b.ptr, b.bytes / 4, NaN);
    const block = arena.allocBlock(bytes);
    // arena blocks are 64-byte aligned, so rounding up to whole f32s stays inside the block
    if (zeroed) this.backend.zero(block.ptr, block.bytes);
    else if (this.poison) this.backend.fill(block.ptr, Math.ceil(bytes / 4), poisonValue[dtype]);
    return new Tensor(this, shape, dtype, block.ptr, arena, arena.generation, false, null, 0, valueRange, block);
  }

  zeros(shape: Shape, dtype: DType = "f32"): Tensor {
    checkShape("zeros", shape);
    return this.#arenaTensor(shape, dtype, null, true);
  }

  /** An arena tensor holding a copy of host data. */
  fromArray(data: Float32Array | Int32Array, shape: Shape): Tensor {
    const dtype: DType = data instanceof Float32Array ? "f32" : "i32";
    checkShape("fromArray", shape);
    if (numelOf(shape) !== data.length) {
      throw new ShapeError("fromArray", [shape], `data has ${data.length} elements, shape needs ${numelOf(shape)}`);
    }
    const t = this.#arenaTensor(shape, dtype, data instanceof Int32Array ? rangeOf(data) : null);
    this.backend.upload(t.ptr, data);
    return t;
  }

  /** Backend memory that lives until dispose() (slabs). Zeroed. */
  allocPersistent(bytes: number): Allocation {
    const a = this.backend.alloc(bytes);
    this.#persistent.push(a);
    return a;
  }

  /** Gives persistent memory back before dispose(). */
  freePersistent(a: Allocation): void {
    const i = this.#persistent.indexOf(a);
    if (i < 0) throw new EngineError("freePersistent: not a persistent allocation of this context");
    this.#persistent.splice(i, 1);
    this.backend.free(a);
  }

  /**
   * Persistent backend memory for n f32 scalars, the same on every call (regrown when n outgrows
   * it): where a training step gathers its micro-batches' losses, so that reading them back is
   * one wait on a GPU rather than one per micro-batch. The contents last until the next call.
   */
  scalarSlots(n: number): Ptr {
    const bytes = 4 * n;
    if (this.#scalars === null || this.#scalars.bytes < bytes) {
      if (this.#scalars !== null) {
        this.#persistent.splice(this.#persistent.indexOf(this.#scalars), 1);
        this.backend.free(this.#scalars);
      }
      this.#scalars = this.allocPersistent(Math.max(bytes, 64));
    }
    return this.#scalars.ptr;
  }

  /** A tensor over persistent memory at ptr (a slab view). */
  persistentTensor(shape: Shape, dtype: DType, ptr: Ptr, requiresGrad: boolean): Tensor {
    checkShape("persistentTensor", shape);
    return new Tensor(this, shape, dtype, ptr, null, persistentGeneration, requiresGrad);
  }

  /** The seed of the next dropout mask: distinct for every call over the context's life. */
  nextDropoutSeed(): bigint {
    this.#dropoutCalls++;
    return BigInt.asUintN(64, this.#dropoutSeed * 0x9e3779b97f4a7c15n + this.#dropoutCalls * 0xbf58476d1ce4e5b9n);
  }

  /**
   * Record an op on the tape if gradients are wanted; sets output.requiresGrad. `saved`: the
   * tensors its backward reads (default: its inputs); each keeps its memory until the node has
   * run, even when its owner drops it first. An op drops its own scratch after recording, so
   * that what backward does not read is freed at once. Returns whether it recorded.
   */
  record(
    op: string,
    inputs: readonly Tensor[],
    output: Tensor,
    backward: () => void | Promise<void>,
    saved: readonly Tensor[] = inputs,
  ): boolean {
    if (!this.gradEnabled) return false;
    if (!inputs.some((t) => t.requiresGrad)) return false;
    output.requiresGrad = true;
    for (const t of saved) {
      const block = t.block;
      if (block !== null && !block.freed) block.holds++;
    }
    this.#pass.tape.push({ op, inputs, output, backward, saved });
    return true;
  }

  /** A node is done (run, or skipped for want of a gradient): what it saved may be freed, and so
   *  may its output's gradient, which only its own backward reads. */
  #finishNode(node: TapeNode): void {
    for (const t of node.saved) {
      const block = t.block;
      if (block !== null) unhold(block);
    }
    node.output.freeGrad();
  }

  /** Empties the tape, letting go of what its nodes still hold (a tape cut short by an error). */
  #clearTape(from: number): void {
    const tape = this.#pass.tape;
    for (let i = from; i >= 0; i--) {
      for (const t of tape[i]!.saved) {
        const block = t.block;
        if (block !== null) unhold(block);
      }
    }
    tape.length = 0;
  }

  /** Run reverse-mode autodiff from a scalar loss. dloss seeds d(loss) (a loss scale). */
  backward(loss: Tensor, dloss = 1): void {
    this.#seedLoss(loss, dloss);
    this.#runTape();
  }

  #seedLoss(loss: Tensor, dloss: number): void {
    if (loss.numel !== 1) throw new ShapeError("backward", [loss.shape], "loss must have exactly one element");
    if (!loss.requiresGrad) throw new EngineError("backward: loss does not depend on any tensor that requires grad");
    this.backend.fill(loss.ensureGrad().ptr, 1, dloss);
  }

  /** Run reverse-mode autodiff from any output, seeding its gradient with `grad` (same shape):
   *  a pipeline stage's backward, or an op test's upstream gradient. */
  backwardFrom(output: Tensor, grad: Tensor): void {
    if (!sameShape(output.shape, grad.shape))
      throw new ShapeError("backwardFrom", [output.shape, grad.shape], "grad shape differs");
    if (!output.requiresGrad)
      throw new EngineError("backwardFrom: output does not depend on any tensor that requires grad");
    this.#seedGrad(output, grad);
    this.#runTape();
  }

  /** output's gradient = grad, cast to output's type where they differ (an f32 gradient rounded
   *  into an activation stored in the autocast type, or a 2-byte one widened; ops/cast.ts). */
  #seedGrad(output: Tensor, grad: Tensor): void {
    const into = output.ensureGrad();
    if (grad.dtype === into.dtype) this.backend.copy(into.ptr, grad.ptr, grad.bytes);
    else castInto(into, grad, "backwardFrom");
  }

  /** backward() for a tape whose ops may wait (tensor parallelism's collectives). */
  async backwardAsync(loss: Tensor, dloss = 1): Promise<void> {
    this.#seedLoss(loss, dloss);
    await this.#runTapeAsync();
  }

  /** backwardFrom() for a tape whose ops may wait. */
  async backwardFromAsync(output: Tensor, grad: Tensor): Promise<void> {
    if (!sameShape(output.shape, grad.shape))
      throw new ShapeError("backwardFrom", [output.shape, grad.shape], "grad shape differs");
    if (!output.requiresGrad)
      throw new EngineError("backwardFrom: output does not depend on any tensor that requires grad");
    this.#seedGrad(output, grad);
    await this.#runTapeAsync();
  }

  #runTape(): void {
    let pending = this.#pass.tape.length - 1;
    try {
      for (; pending >= 0; pending--) this.#runNode(pending);
    } finally {
      this.#clearTape(pending);
    }
  }

  async #runTapeAsync(): Promise<void> {
    const tape = this.#pass.tape;
    let pending = tape.length - 1;
    try {
      for (; pending >= 0; pending--) {
        const node = tape[pending]!;
        if (node.output.grad !== null) await node.backward();
        this.#finishNode(node);
      }
    } finally {
      this.#clearTape(pending);
    }
  }

  /** Runs node i's backward, then finishes it. */
  #runNode(i: number): void {
    const node = this.#pass.tape[i]!;
    // an output no later op used (and that is not the loss) has no gradient: skip it
    if (node.output.grad !== null) {
      const r = node.backward();
      if (r instanceof Promise) {
        r.catch(() => {});
        throw new EngineError(
          `backward: op ${node.op} waits for a collective (tensor parallelism); run the tape with backwardAsync`,
        );
      }
    }
    this.#finishNode(node);
  }

  /** Tape index -> the parameters whose gradient is complete once that node's backward has run
   *  (it is the earliest node reading them). */
  #gradReadyAt(): Map<number, Tensor[]> {
    const firstUse = new Map<Tensor, number>();
    this.#pass.tape.forEach((node, i) => {
      // a node's backward completes its inputs' gradients last to first (a layer's bias, then
      // its weight), so they are listed in that order
      for (const t of [...node.inputs].reverse()) {
        const base = t.viewOf ?? t;
        if (base.generation === persistentGeneration && base.requiresGrad && !firstUse.has(base)) firstUse.set(base, i);
      }
    });
    const readyAt = new Map<number, Tensor[]>();
    for (const [t, i] of firstUse) readyAt.set(i, [...(readyAt.get(i) ?? []), t]);
    return readyAt;
  }

  /** The parameters read by the recorded tape, grouped in the order backward would complete their
   *  gradients (what backwardSteps yields), without running anything. */
  gradReadyOrder(): Tensor[][] {
    const readyAt = this.#gradReadyAt();
    return [...readyAt.keys()].sort((a, b) => b - a).map((i) => readyAt.get(i)!);
  }

  /**
   * backward() one tape node at a time: after each node it yields the persistent tensors
   * (parameters) whose gradient is now complete, because no earlier op of the tape reads them.
   * A data-parallel trainer starts reducing a bucket of gradients as soon as its last one is
   * complete, while the rest of backward goes on. Every persistent tensor that requires grad
   * and that some op read is yielded exactly once; the caller drives the generator to its end.
   */
  *backwardSteps(loss: Tensor, dloss = 1): Generator<Tensor[], void, void> {
    const readyAt = this.#gradReadyAt();
    this.#seedLoss(loss, dloss);
    // the first node not finished yet (a consumer may stop the generator between nodes)
    let pending = this.#pass.tape.length - 1;
    try {
      for (let i = pending; i >= 0; i--) {
        this.#runNode(i);
        pending = i - 1;
        const ready = readyAt.get(i);
        if (ready) yield ready;
      }
    } finally {
      this.#clearTape(pending);
    }
  }

  /**
   * backwardSteps with the parameters each node reads announced before it runs: yields
   * { need } (the parameters a node's backward may read: its persistent inputs) before the node,
   * and { ready } (parameters whose gradient is complete) after it. ZeRO stage 3 gathers a
   * parameter on `need` and frees it once its bucket is `ready`.
   */
  *backwardEvents(loss: Tensor, dloss = 1): Generator<{ need: Tensor[] } | { ready: Tensor[] }, void, void> {
    const readyAt = this.#gradReadyAt();
    this.#seedLoss(loss, dloss);
    let pending = this.#pass.tape.length - 1;
    try {
      for (let i = pending; i >= 0; i--) {
        const node = this.#pass.tape[i]!;
        if (node.output.grad !== null) {
          const need = [
            ...new Set(
              node.inputs
                .map((t) => t.viewOf ?? t)
                .filter((t) => t.generation === persistentGeneration && t.name !== undefined),
            ),
          ];
          if (need.length > 0) yield { need };
          node.backward();
        }
        this.#finishNode(node);
        pending = i - 1;
        const ready = readyAt.get(i);
        if (ready) yield { ready };
      }
    } finally {
      this.#clearTape(pending);
    }
  }

  /**
   * Activation recomputation: out = fn(x), keeping only x and out. fn runs without recording,
   * and what it allocated is freed at once; backward runs fn again from x (with the same dropout
   * masks) and back-propagates out's gradient through that second run, into x and `params` (what
   * fn reads that needs a gradient), then frees it too. fn must give a result of x's shape (a
   * residual block). Gradients equal fn's own; the pass's peak memory holds one fn's
   * activations instead of every call's.
   */
  recompute(x: Tensor, params: readonly Tensor[], fn: (x: Tensor) => Tensor): Tensor {
    if (!this.gradEnabled || !(x.requiresGrad || params.some((t) => t.requiresGrad))) return fn(x);
    const dropoutCalls = this.#dropoutCalls;
    const out = this.empty(x.shape, x.dtype);
    const mark = this.arena.mark();
    this.#keepOnly(
      x,
      this.noGrad(() => fn(x)),
      out,
      mark,
    );
    this.record("recompute", [x, ...params], out, () => {
      const replay = this.#replay(x, params, dropoutCalls);
      try {
        this.backwardFrom(fn(x), out.grad!);
      } finally {
        replay.end();
      }
    });
    return out;
  }

  /** recompute's forward: `out` takes fn's result y, and what fn allocated after `mark` is freed. */
  #keepOnly(x: Tensor, y: Tensor, out: Tensor, mark: ArenaMark): void {
    if (!sameShape(y.shape, x.shape) || y.dtype !== x.dtype) {
      throw new ShapeError(
        "recompute",
        [x.shape, y.shape],
        "the recomputed function must keep its input's shape and dtype",
      );
    }
    this.backend.copy(out.ptr, y.ptr, y.bytes);
    this.arena.release(mark);
  }

  /**
   * recompute's backward begins: the gradient buffers backward adds into are made first (they
   * outlive the release), then fn runs again on a tape of its own with forward's dropout masks;
   * end() puts the pass's tape and dropout counter back and frees the rerun.
   */
  #replay(x: Tensor, params: readonly Tensor[], dropoutCalls: bigint): { end(): void } {
    if (x.requiresGrad) x.ensureGrad();
    for (const t of params) if (t.requiresGrad) t.ensureGrad();
    const again = this.arena.mark();
    const outer = this.#pass.tape;
    const dropoutCallsNow = this.#dropoutCalls;
    this.#pass.tape = [];
    this.#dropoutCalls = dropoutCalls;
    return {
      end: () => {
        this.#pass.tape = outer;
        this.#dropoutCalls = dropoutCallsNow;
        this.arena.release(again);
      },
    };
  }

  /** recompute() of an fn that waits (a tensor-parallel block, whose forward all-reduces). The
   *  context must run nothing else meanwhile: the pass, the tape and noGrad span fn's waits. */
  async recomputeAsync(x: Tensor, params: readonly Tensor[], fn: (x: Tensor) => Promise<Tensor>): Promise<Tensor> {
    if (!this.gradEnabled || !(x.requiresGrad || params.some((t) => t.requiresGrad))) return fn(x);
    const dropoutCalls = this.#dropoutCalls;
    const out = this.empty(x.shape, x.dtype);
    const mark = this.arena.mark();
    this.gradEnabled = false;
    let y: Tensor;
    try {
      y = await fn(x);
    } finally {
      this.gradEnabled = true;
    }
    this.#keepOnly(x, y, out, mark);
    this.record("recompute", [x, ...params], out, async () => {
      const replay = this.#replay(x, params, dropoutCalls);
      try {
        await this.backwardFromAsync(await fn(x), out.grad!);
      } finally {
        replay.end();
      }
    });
    return out;
  }

  /** Runs fn in `pass` across its waits (a tensor-parallel forward); as inPass, the context
   *  must run nothing else meanwhile. */
  async inPassAsync<T>(pass: Pass, fn: () => Promise<T>): Promise<T> {
    if (!this.#open.has(pass)) throw new EngineError("inPass: that pass is not open in this context");
    const previous = this.#pass;
    this.#pass = pass;
    try {
      return await fn();
    } finally {
      this.#pass = previous;
    }
  }

  /** Run fn without recording (evaluation, sampling). */
  noGrad<T>(fn: () => T): T {
    const previous = this.gradEnabled;
    this.gradEnabled = false;
    try {
      return fn();
    } finally {
      this.gradEnabled = previous;
    }
  }

  dispose(): void {
    for (const p of [this.#own, ...this.#open, ...this.#idle]) p.arena.dispose();
    this.#open.clear();
    this.#idle.length = 0;
    for (const a of this.#persistent) this.backend.free(a);
    this.#persistent.length = 0;
    this.#scalars = null;
  }
}
