// Parameters, gradients and optimizer state, each in one contiguous slab with a table of named
// views into it (llm.c style). These slabs are what later layers shard, send and checkpoint:
// an AdamW step is one kernel call (decayed prefix and the rest), a gradient clip one reduction
// (its factor read by that call), a checkpoint one copy.
//
// Layout: parameters that take weight decay first, then the rest (biases, LayerNorm, ...), so
// each group is one contiguous range. Every parameter starts on a 64-byte boundary; the
// padding between them is zero in all slabs and stays zero under every update rule.
import type { Allocation, Ptr } from "../ffi/backend.ts";
import { ConfigError } from "../ffi/errors.ts";
import { EngineError, ShapeError } from "./errors.ts";
import { Rng } from "./rng.ts";
import { numelOf, type Shape, type Tensor } from "./tensor.ts";
import { type Context } from "./context.ts";

export type Init =
  | { kind: "normal"; std: number }
  | { kind: "uniform"; bound: number }
  | { kind: "zeros" }
  | { kind: "ones" };

/**
 * A parameter that is a slice of a larger one (a tensor-parallel rank's share of a weight): the
 * whole parameter's shape, and the rows (ranges, concatenated in order) and columns it keeps.
 * Its initial values are the whole parameter's at those places.
 */
export interface SliceOf {
  readonly shape: Shape;
  readonly rows?: readonly { offset: number; count: number }[];
  readonly cols?: { offset: number; count: number };
}

export interface ParamSpec {
  readonly name: string;
  readonly shape: Shape;
  readonly init: Init;
  /** takes weight decay (matrices and embeddings do; biases and norms do not) */
  readonly decay: boolean;
  readonly sliceOf?: SliceOf;
}

/** Writes a slice's values at their places in the whole parameter (takeSlice's inverse). */
export function putSlice(whole: Float32Array, of: SliceOf, values: Float32Array): void {
  const rowsAll = of.shape[0]!;
  const cols = of.shape.length === 1 ? 1 : whole.length / rowsAll;
  const rows = of.rows ?? [{ offset: 0, count: rowsAll }];
  const c = of.cols ?? { offset: 0, count: cols };
  if (values.length !== rows.reduce((n, r) => n + r.count, 0) * c.count)
    throw new ShapeError("putSlice", [of.shape, [values.length]], "the values are not the slice's size");
  let o = 0;
  for (const r of rows) {
    for (let i = r.offset; i < r.offset + r.count; i++, o += c.count)
      whole.set(values.subarray(o, o + c.count), i * cols + c.offset);
  }
}

/** The values of a slice (SliceOf) of a row-major parameter of `whole` values. */
export function takeSlice(whole: Float32Array, of: SliceOf): Float32Array {
  const rowsAll = of.shape[0]!;
  const cols = of.shape.length === 1 ? 1 : whole.length / rowsAll;
  const rows = of.rows ?? [{ offset: 0, count: rowsAll }];
  const c = of.cols ?? { offset: 0, count: cols };
  if (c.offset < 0 || c.offset + c.count > cols || rows.some((r) => r.offset < 0 || r.offset + r.count > rowsAll)) {
    throw new ShapeError("takeSlice", [of.shape], "the slice reaches outside the parameter");
  }
  const out = new Float32Array(rows.reduce((n, r) => n + r.count, 0) * c.count);
  let o = 0;
  for (const r of rows) {
    for (let i = r.offset; i < r.offset + r.count; i++, o += c.count)
      out.set(whole.subarray(i * cols + c.offset, i * cols + c.offset + c.count), o);
  }
  return out;
}

/** A parameter a module declared; its tensor exists once the ParamStore is built. */
export class Param {
  #tensor: Tensor | null = null;
  constructor(readonly spec: ParamSpec) {}

  get tensor(): Tensor {
    if (this.#tensor === null) throw new Error(`parameter ${this.spec.name} used before ParamStore.build()`);
    return this.#tensor;
  }
  bind(t: Tensor): void {
    this.#tensor = t;
  }
}

/** Modules declare their parameters here, in a fixed order, before any memory exists. */
export class ParamBuilder {
  readonly params: Param[] = [];
  readonly #names = new Set<string>();

  add(name: string, shape: Shape, init: Init, decay: boolean, sliceOf?: SliceOf): Param {
    if (this.#names.has(name)) throw new ConfigError(`duplicate parameter name ${name}`);
    if (shape.some((d) => !Number.isSafeInteger(d) || d <= 0)) {
      throw new ShapeError("ParamBuilder.add", [shape], `parameter ${name} needs positive integer dims`);
    }
    this.#names.add(name);
    if (
      sliceOf !== undefined &&
      takeSlice(new Float32Array(numelOf(sliceOf.shape)), sliceOf).length !== numelOf(shape)
    ) {
      throw new ShapeError(
        "ParamBuilder.add",
        [shape, sliceOf.shape],
        `parameter ${name}: the slice's size is not the parameter's`,
      );
    }
    const p = new Param({ name, shape, init, decay, ...(sliceOf === undefined ? {} : { sliceOf }) });
    this.params.push(p);
    return p;
  }
}

export interface ParamEntry {
  readonly name: string;
  readonly shape: Shape;
  /** offset into the slabs, in elements */
  readonly offset: number;
  readonly numel: number;
  readonly decay: boolean;
}

export interface ParamRange {
  readonly offset: number;
  readonly numel: number;
}

const alignElems = 16; // 64 bytes of f32

/** FNV-1a of a name: each parameter gets its own random stream, independent of the others. */
function nameHash(name: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < name.length; i++) h = Math.imul(h ^ name.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

/**
 * Where each parameter lives in the slabs: decayed ones first, each on a 64-byte boundary. What
 * a ParamStore of these parameters allocates; also computed without one (the whole model's
 * layout, which a model-parallel rank maps its share into).
 */
export function slabLayoutOf(specs: readonly ParamSpec[]): {
  entries: ParamEntry[];
  slabNumel: number;
  decayEnd: number;
  offset: number;
} {
  const ordered = [...specs.filter((p) => p.decay), ...specs.filter((p) => !p.decay)];
  let offset = 0;
  let decayEnd = 0;
  const entries: ParamEntry[] = [];
  for (const p of ordered) {
    const numel = numelOf(p.shape);
    entries.push({ name: p.name, shape: p.shape, offset, numel, decay: p.decay });
    offset += Math.ceil(numel / alignElems) * alignElems;
    if (p.decay) decayEnd = offset;
  }
  return { entries, slabNumel: Math.max(offset, alignElems), decayEnd, offset };
}

/** Values drawn per upload at initialization (16 MiB of host memory). */
const initChunkElemsMax = 4 << 20;

/** The next values of an init's stream, in order (one draw per element, as a whole-slab draw). */
function drawInit(view: Float32Array, init: Init, rng: Rng): void {
  switch (init.kind) {
    case "normal":
      for (let i = 0; i < view.length; i++) view[i] = rng.normal() * init.std;
      break;
    case "uniform":
      for (let i = 0; i < view.length; i++) view[i] = (2 * rng.uniform() - 1) * init.bound;
      break;
    case "ones":
      view.fill(1);
      break;
    case "zeros":
      view.fill(0);
      break;
  }
}

/** A store's parameter tensors bound to its slab -> the store and their entry (weightCopy). */
const slabParams = new WeakMap<Tensor, { store: ParamStore; entry: ParamEntry }>();

/**
 * The 2-byte copy of parameter t that autocast GEMMs read (engine/mixed.ts), as a view into its
 * store's copy of the whole slab; null for a tensor that is not a parameter bound to its store's
 * slab (ZeRO stage 3 binds parameters to gathered buffers: their copies are made per op).
 */
export function weightCopy(t: Tensor, dtype: "bf16" | "f16"): Tensor | null {
  const at = slabParams.get(t);
  return at === undefined ? null : at.store.weightCopy(at.entry, t, dtype);
}

export class ParamStore {
  readonly entries: readonly ParamEntry[];
  /** total slab length in elements, padding included */
  readonly slabNumel: number;
  /** parameter count, padding excluded */
  readonly paramCount: number;
  readonly decayRange: ParamRange;
  readonly noDecayRange: ParamRange;
  #values: Allocation | null;
  #valuesTensor: Tensor | null;
  #grads: Allocation | null;
  #gradsTensor: Tensor | null;
  readonly #ctx: Context;
  readonly #byName = new Map<string, ParamEntry>();
  readonly #paramByName = new Map<string, Param>();
  readonly #params: readonly Param[];
  /** the 2-byte copy of the slab autocast GEMMs read, cast at the context's weightCopySerial */
  #copy: { dtype: "bf16" | "f16"; allocation: Allocation; serial: number; views: Map<string, Tensor> } | null = null;

  /** bind: point the Params at this store's views (false: a mirror, whose Params stay where they are) */
  private constructor(ctx: Context, params: readonly Param[], bind = true) {
    this.#ctx = ctx;
    this.#params = params;
    const { entries, slabNumel, decayEnd, offset } = slabLayoutOf(params.map((p) => p.spec));
    this.entries = entries;
    this.slabNumel = slabNumel;
    this.paramCount = entries.reduce((s, e) => s + e.numel, 0);
    this.decayRange = { offset: 0, numel: decayEnd };
    this.noDecayRange = { offset: decayEnd, numel: offset - decayEnd };
    for (const e of entries) this.#byName.set(e.name, e);

    this.#values = ctx.allocPersistent(this.slabNumel * 4);
    this.#grads = ctx.allocPersistent(this.slabNumel * 4);
    this.#valuesTensor = ctx.persistentTensor([this.slabNumel], "f32", this.#values.ptr, false);
    this.#gradsTensor = ctx.persistentTensor([this.slabNumel], "f32", this.#grads.ptr, false);
    const byName = new Map(params.map((p) => [p.spec.name, p]));
    for (const e of entries) {
      const t = ctx.persistentTensor(e.shape, "f32", this.#values.ptr + e.offset * 4, true);
      t.name = e.name;
      t.bindGrad(ctx.persistentTensor(e.shape, "f32", this.#grads.ptr + e.offset * 4, false));
      if (bind) byName.get(e.name)!.bind(t);
      slabParams.set(t, { store: this, entry: e });
    }
  }

  /**
   * A store of the same layout on another context (another backend) holding a copy of the
   * values: ZeRO-Offload's host master copy, which the optimizer updates in host memory. The
   * model's Params stay bound to this store.
   */
  mirror(ctx: Context): ParamStore {
    const m = new ParamStore(ctx, this.#params, false);
    m.writeValues(this.readValues());
    return m;
  }

  /**
   * Entry e's view in the 2-byte copy of the whole slab, which one cast makes when the context's
   * weightCopySerial has moved since the last (Context.newPass moves it, except between the
   * micro-batches of one step: once per optimizer step, and whatever wrote the parameters between
   * steps is seen). null where t no longer points into this store's slab.
   */
  weightCopy(e: ParamEntry, t: Tensor, dtype: "bf16" | "f16"): Tensor | null {
    const ctx = this.#ctx;
    const values = this.#values;
    if (values === null || t.ctx !== ctx || t.ptr !== values.ptr + e.offset * 4) return null;
    let copy = this.#copy;
    if (copy === null) {
      copy = { dtype, allocation: ctx.allocPersistent(this.slabNumel * 2), serial: -1, views: new Map() };
      this.#copy = copy;
    } else if (copy.dtype !== dtype) {
      // a context whose precision changed: the same bytes, the other type
      Object.assign(copy, { dtype, serial: -1, views: new Map() });
    }
    if (copy.serial !== ctx.weightCopySerial) {
      const cast = dtype === "bf16" ? ctx.backend.castF32ToBF16 : ctx.backend.castF32ToF16;
      cast.call(ctx.backend, copy.allocation.ptr, values.ptr, this.slabNumel);
      copy.serial = ctx.weightCopySerial;
    }
    let view = copy.views.get(e.name);
    if (view === undefined) {
      view = ctx.persistentTensor(e.shape, dtype, copy.allocation.ptr + e.offset * 2, false);
      copy.views.set(e.name, view);
    }
    return view;
  }

  /** Bytes of the 2-byte weight copy (0 until autocast first reads it). */
  get weightCopyBytes(): number {
    return this.#copy?.allocation.bytes ?? 0;
  }

  /** Allocate the slabs, bind every Param to its view, and initialize from seed. */
  static build(ctx: Context, builder: ParamBuilder, seed: number): ParamStore {
    const store = new ParamStore(ctx, builder.params);
    store.initialize(seed);
    return store;
  }

  /** The parameter slab (every parameter's values, at its entry's offset). */
  get values(): Allocation {
    if (this.#values === null)
      throw new EngineError(
        "the parameter slab was released: each rank holds its partition, gathered per bucket (ZeRO stage 3)",
      );
    return this.#values;
  }

  get valuesTensor(): Tensor {
    if (this.#valuesTensor === null) throw new EngineError("the parameter slab was released (ZeRO stage 3)");
    return this.#valuesTensor;
  }

  /** Whether the parameter slab is held (false after releaseValueSlab). */
  get holdsValueSlab(): boolean {
    return this.#values !== null;
  }

  /**
   * Gives the parameter slab back (ZeRO stage 3): every parameter is unbound until bind() points
   * it at gathered memory, and a kernel that reads an unbound one throws.
   */
  releaseValueSlab(): void {
    if (this.#values === null) return;
    for (const p of this.#params) p.tensor.rebind(null);
    this.#ctx.freePersistent(this.#values);
    this.#values = null;
    this.#valuesTensor = null;
  }

  /** Points parameter `name` at memory holding its values (null: unbinds it). */
  bind(name: string, ptr: Ptr | null): void {
    this.param(name).rebind(ptr);
  }

  /** The gradient slab (backward accumulates every parameter's gradient into its view). */
  get grads(): Allocation {
    if (this.#grads === null)
      throw new EngineError("the gradient slab was released: gradients live in the step's arena (ZeRO stage 2)");
    return this.#grads;
  }

  get gradsTensor(): Tensor {
    if (this.#gradsTensor === null)
      throw new EngineError("the gradient slab was released: gradients live in the step's arena (ZeRO stage 2)");
    return this.#gradsTensor;
  }

  /** Whether the gradient slab is held (false after releaseGradSlab). */
  get holdsGradSlab(): boolean {
    return this.#grads !== null;
  }

  /**
   * Gives the gradient slab back (ZeRO stage 2): backward then writes each parameter's gradient
   * into the pass's arena, and whoever reduces them reads them with gradOf before the next pass.
   */
  releaseGradSlab(): void {
    if (this.#grads === null) return;
    for (const p of this.#params) p.tensor.unbindGrad();
    this.#ctx.freePersistent(this.#grads);
    this.#grads = null;
    this.#gradsTensor = null;
  }

  /** A parameter's gradient as the last backward left it; null when no op read the parameter. */
  gradOf(name: string): Tensor | null {
    return this.param(name).grad;
  }

  entry(name: string): ParamEntry {
    const e = this.#byName.get(name);
    if (e === undefined) throw new ConfigError(`no parameter named ${name}`);
    return e;
  }

  param(name: string): Tensor {
    this.entry(name);
    if (this.#paramByName.size === 0) for (const p of this.#params) this.#paramByName.set(p.spec.name, p);
    return this.#paramByName.get(name)!.tensor;
  }

  /** Deterministic initialization: each parameter draws from Rng(seed, hash(name)). */
  initialize(seed: number): void {
    // values are drawn into a bounded host buffer and uploaded a piece at a time, so that a model
    // of hundreds of MB never has a second copy of itself in JavaScript memory (peak RSS)
    const buffer = new Float32Array(Math.min(this.slabNumel, initChunkElemsMax));
    const specs = new Map(this.#params.map((p) => [p.spec.name, p.spec]));
    const upload = (offset: number, values: Float32Array) =>
      this.#ctx.backend.upload(this.values.ptr + 4 * offset, values);
    for (const e of this.entries) {
      const { init, sliceOf } = specs.get(e.name)!;
      const rng = new Rng((seed * 0x9e3779b1) ^ nameHash(e.name));
      if (init.kind === "zeros") continue; // the slab starts zeroed
      if (sliceOf !== undefined) {
        // a slice draws the whole parameter's values and keeps its own
        const whole = new Float32Array(numelOf(sliceOf.shape));
        drawInit(whole, init, rng);
        upload(e.offset, takeSlice(whole, sliceOf));
        continue;
      }
      for (let done = 0; done < e.numel; done += buffer.length) {
        const piece = buffer.subarray(0, Math.min(buffer.length, e.numel - done));
        drawInit(piece, init, rng);
        upload(e.offset + done, piece);
      }
    }
  }

  /** Zeroes the gradient slab; without one, drops the arena gradients of the last backward. */
  zeroGrad(): void {
    if (this.#grads === null) {
      for (const p of this.#params) p.tensor.unbindGrad();
      return;
    }
    this.#ctx.backend.zero(this.#grads.ptr, this.slabNumel * 4);
  }

  /** A host copy of the whole value slab (checkpoints, parity checks). */
  readValues(): Float32Array {
    const out = new Float32Array(this.slabNumel);
    this.#ctx.backend.download(this.values.ptr, out);
    return out;
  }

  readGrads(): Float32Array {
    const out = new Float32Array(this.slabNumel);
    this.#ctx.backend.download(this.grads.ptr, out);
    return out;
  }

  writeValues(data: Float32Array): void {
    if (data.length !== this.slabNumel) {
      throw new ShapeError("ParamStore.writeValues", [[data.length], [this.slabNumel]], "slab length differs");
    }
    this.#ctx.backend.upload(this.values.ptr, data);
  }
}
