// The Context: a backend's memory for tensors (the pass's arena, the persistent slabs) and the
// autograd tape ops record on. A pass's tensors live in its arena until newPass() recycles it
// (or until their last reader has run: see ARCHITECTURE.md, "A pass's memory"); persistent
// allocations live until the context is disposed. backward() runs the tape in reverse.
import type { Allocation, Backend, DType, Ptr } from "../ffi/backend.ts";
import { dtypeBytes } from "../ffi/backend.ts";
import { Arena, type ArenaMark } from "./arena.ts";
import { EngineError, ShapeError } from "./errors.ts";
import { checkPrecision, type Precision } from "./mixed.ts";
import { castInto } from "./ops/cast.ts";
import {
  checkShape,
  numelOf,
  persistentGeneration,
  sameShape,
  type Shape,
  type TapeNode,
  Tensor,
  unhold,
  type ValueRange,
} from "./tensor.ts";

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
