// The contract between the CUDA kernels (ffi/cuda/kernels/*.cu, compiled to PTX by build.ts)
// and the CUDA backend:
//   - kernelSpecs: every kernel's module and parameter types, in order (the test checks them
//     against the compiled PTX); a kernel that mirrors an op of ffi/ops.ts takes its types from
//     the op's declaration;
//   - plans: for each non-GEMM Backend method, the launches that implement it, in stream order.
// The backend loads each module's PTX, looks kernels up by name, and launches what a plan
// returns with the arguments converted by type:
//   ptr  a CUdeviceptr (Ptr, a number)      i64  int64 (a number; sizes, strides)
//   u64  uint64 (a bigint; the dropout seed)  i32  int32 (a number; flags)   f32  float32 (a number)
//
// Methods that return a number (crossEntropyForward, embeddingForward, sumSquares,
// countNonFinite) take a first extra argument `scratch`: device memory of scratchBytes bytes
// whose contents are unspecified. Their launches initialize what they use and leave the result
// at byte offset 0: an int64 count (invalid targets, invalid ids, non-finite values) or, for
// sumSquares, a float64. The backend synchronizes and reads those 8 bytes. embeddingForward's
// plan with inRange (ids checked on the host) launches no count: the backend reads nothing.
//
// Empty inputs: a plan launches nothing when there is nothing to write (n = 0, N*C = 0, ...).
// The exception is a plan with a scalar result, which still writes it, as the CPU does: sum's
// out[0] = 0, the scratch result of sumSquares / countNonFinite / embeddingForward (0), and
// crossEntropyForward's count (0) and loss (0/0 = NaN for N = 0). Each of those is one
// single-block launch, so the backend can always read scratch after running a plan (the one
// that counts).
//
// Dimension letters as in ffi/cpu/kernels.c: N rows, C channels, V vocab, BH batch*heads, T time.
import type { Backend, Dims4, ElemType, Ptr } from "../backend.ts";
import { type ArgType, elemCodes, type OpDecl, type OpName, ops } from "../ops.ts";

export type ParamType = "ptr" | "i64" | "u64" | "i32" | "f32";

export interface KernelSpec {
  /** file stem in ffi/cuda/kernels/ */
  readonly module: string;
  readonly params: readonly ParamType[];
}

const i64x4 = ["i64", "i64", "i64", "i64"] as const;
const unary = ["ptr", "ptr", "i64"] as const; // out, inp, n
// kept dims, their inp strides and out strides; reduced dims and their inp strides
const reduceBcastParams = ["ptr", "ptr", ...i64x4, ...i64x4, ...i64x4, ...i64x4, ...i64x4] as const;
// dqkv, delta, dout, lse, qkv; B, T, C, H; scale; elem, accumulate
const attentionBackwardParams = ["ptr", "ptr", "ptr", "ptr", "ptr", ...i64x4, "f32", "i32", "i32"] as const;
const flashForwardParams = ["ptr", "ptr", "ptr", ...i64x4, "f32", "i32"] as const;

/** How an op's argument (ffi/ops.ts) reaches a kernel: flags, operators and element types as int32. */
const paramsOfArg: Readonly<Record<ArgType, readonly ParamType[]>> = {
  ptr: ["ptr"],
  i64: ["i64"],
  f32: ["f32"],
  u64: ["u64"],
  bool: ["i32"],
  binop: ["i32"],
  elem: ["i32"],
  dims4: i64x4,
};

/** The parameter types of a kernel that takes its op's arguments in the C kernel's order. */
export function opParams(decl: OpDecl): ParamType[] {
  const order = decl.cpuOrder ?? decl.args.map(([name]) => name);
  return order.flatMap((name) => paramsOfArg[decl.args.find(([n]) => n === name)![1]]);
}

/**
 * The kernels of `module` that mirror an op: each is named as the op's CPU kernel and takes the
 * op's arguments, so its parameter types come from the op's one declaration in ffi/ops.ts.
 */
function opKernels<const N extends OpName>(
  module: string,
  names: readonly N[],
): { readonly [K in N as (typeof ops)[K]["cpu"]]: KernelSpec } {
  return Object.fromEntries(names.map((n) => [ops[n].cpu, { module, params: opParams(ops[n]) }])) as never;
}

/** Every kernel: those that mirror an op, then the ones a plan adds (partial sums, counts, a
 *  split backward), whose parameters are spelled out. */
export const kernelSpecs = {
  ...opKernels("elementwise", ["add", "mul", "axpy", "scale", "addScalarFrom"]),
  ...opKernels("broadcast", ["binaryBroadcast"]),
  mt_reduce_bcast_rows_f32: { module: "broadcast", params: reduceBcastParams },
  mt_reduce_bcast_cols_f32: { module: "broadcast", params: reduceBcastParams },
  ...opKernels("layers", [
    "biasAdd",
    "biasBackward",
    "reluForward",
    "reluBackward",
    "geluForward",
    "geluBackward",
    "biasGeluForward",
    "dropoutForward",
    "dropoutBackward",
  ]),
  mt_bias_backward_partial_f32: { module: "layers", params: ["ptr", "ptr", "i64", "i64", "i64", "i32"] },
  mt_crossentropy_forward_f32: { module: "crossentropy", params: ["ptr", "ptr", "ptr", "ptr", "i64", "i64", "i32"] },
  mt_crossentropy_loss_f32: { module: "crossentropy", params: ["ptr", "ptr", "ptr", "ptr", "i64", "i64"] },
  ...opKernels("crossentropy", ["crossEntropyBackward"]),
  mt_count_correct_partial_f32: { module: "crossentropy", params: ["ptr", "ptr", "ptr", "i64", "i64", "i32"] },
  ...opKernels("layernorm", ["layerNormForward", "residualLayerNormForward"]),
  mt_layernorm_backward_f32: {
    module: "layernorm",
    params: ["ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i32"],
  },
  mt_layernorm_params_partial_f32: {
    module: "layernorm",
    params: ["ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i32"],
  },
  mt_layernorm_backward_params_f32: {
    module: "layernorm",
    params: ["ptr", "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i32"],
  },
  ...opKernels("embedding", ["embeddingForward", "embeddingBackward"]),
  mt_embedding_count_invalid_i32: { module: "embedding", params: ["ptr", "ptr", "i64", "i64"] },
  ...opKernels("attention", ["attentionForward", "attentionDecode", "stridedCopy"]),
  mt_attention_delta_f32: { module: "attention", params: ["ptr", "ptr", "ptr", "i64", "i64", "i64", "i64", "i32"] },
  mt_attention_backward_kv_f32: { module: "attention", params: attentionBackwardParams },
  mt_attention_backward_q_f32: { module: "attention", params: attentionBackwardParams },
  // tensor-core attention (flash.cu), per head size
  mt_flash_forward_d64: { module: "flash", params: flashForwardParams },
  mt_flash_forward_d128: { module: "flash", params: flashForwardParams },
  mt_flash_backward_q_d64: { module: "flash", params: attentionBackwardParams },
  mt_flash_backward_q_d128: { module: "flash", params: attentionBackwardParams },
  mt_flash_backward_kv_d64: { module: "flash", params: attentionBackwardParams },
  mt_flash_backward_kv_d128: { module: "flash", params: attentionBackwardParams },
  ...opKernels("reduce", ["sum"]),
  mt_column_partials_add_f32: { module: "reduce", params: ["ptr", "ptr", "i64", "i64"] },
  mt_sum_squares_partial_f32: { module: "reduce", params: unary },
  mt_count_nonfinite_partial_f32: { module: "reduce", params: unary },
  mt_sum_partials_f64: { module: "reduce", params: unary },
  mt_sum_partials_i64: { module: "reduce", params: unary },
  mt_hold_ns: { module: "reduce", params: ["i64"] },
  ...opKernels("optim", ["sgdStep", "adamwStep"]),
  ...opKernels("casts", ["castF32ToBF16", "castBF16ToF32", "castF32ToF16", "castF16ToF32"]),
  mt_accumulate_elem: { module: "casts", params: ["ptr", "ptr", "i64", "i32"] },
} as const satisfies Record<string, KernelSpec>;

export type KernelName = keyof typeof kernelSpecs;

export interface Launch {
  readonly kernel: KernelName;
  readonly grid: readonly [number, number, number];
  readonly block: readonly [number, number, number];
  /** dynamic shared memory; the kernels here use static shared memory only, so always 0 */
  readonly sharedBytes: number;
  readonly args: readonly (number | bigint)[];
}

/** The distinct module stems, in kernelSpecs order. */
export function kernelModules(): string[] {
  return [...new Set(Object.values(kernelSpecs).map((s) => s.module))];
}

// ---- limits -----------------------------------------------------------------------------------

/** Device scratch the backend passes to the plans that return a number. */
export const scratchBytes = 1 << 20;
// Scratch layout: the 8-byte result at 0, block partials from 256 (aligned for any access).
const scratchPartialsOffset = 256;
// Block partials of sumSquares / countNonFinite: 1024 blocks of 256 threads is about one full
// wave on a 132-SM H100 (8 such blocks per SM), enough to saturate memory bandwidth; the
// second pass sums at most 1024 values in one block. 8 KiB of scratch.
const partialsMax = 1024;

// CUDA launch limits (compute capability 8.0 and newer). Every kernel is compiled with
// __launch_bounds__(1024) (BLOCK_THREADS_MAX in kernels/common.cuh), so any block up to
// blockThreadsMax launches.
export const gridXMax = 2 ** 31 - 1;
export const gridYZMax = 65535;
export const blockThreadsMax = 1024;
/** static shared memory per block without opting in to more */
export const sharedBytesMax = 48 * 1024;

// Grid-stride loops make every kernel correct for any grid, so grids are capped: 65536 blocks
// of 256 threads is 16.7M threads, ~60 waves of a 132-SM H100 (270k resident threads), which
// keeps the scheduler busy while each thread still loops a few times on huge n.
const gridBlocksMax = 65536;
// Memory-bound elementwise kernels: 256 threads (8 warps) lets 8 blocks share an SM's 2048
// threads, the usual sweet spot for occupancy against per-block overhead.
const elementwiseThreads = 256;
// Warp-per-row kernels (layernorm, causal softmax, embedding rows): 8 rows per 256-thread block.
const warpRowThreads = 256;
const warpSize = 32;
// Block-per-row kernels (cross-entropy over V): up to 512 threads (98 floats each for GPT-2's
// V = 50257), fewer for short rows so small vocabularies do not idle most of a block.
const blockRowThreadsMax = 512;
// Column reductions (biasBackward, layernorm dweight/dbias, reduceBroadcast onto an inner
// dim): 32 consecutive columns (one coalesced 128-byte read per row) by up to 32 row slices.
// The .cu files size their shared partials for these (BIAS_Y_MAX etc.).
const columnRowSlicesMax = 32;
// Split column sums (biasBackward, the LayerNorm parameter gradients): enough (chunk, row range)
// tasks for about 4 blocks of 1024 threads per SM on a 132-SM H100, each range at least
// splitRowsMin rows (shorter ones cost more in the second pass than they save); their partials
// live in scratch from columnPartialsOffset, past the scalar plans' partials.
const splitColumnBlocks = 512;
const splitRowsMin = 64;
const columnPartialsOffset = 16 * 1024;
// Attention tiles (kernels/attention.cu): 32 rows of one head per block, 4 threads a row; the
// kernels assume exactly this block, and size their shared tiles for head sizes up to 128.
export const attentionThreads = 128;
export const attentionRows = 32;
export const attentionHeadSizeMax = 128;
// Single-block passes (sum, second passes, counts): a full 1024-thread block, since one SM
// does all the work.
const singleBlockThreads = 1024;
// reduceBroadcast onto a scalar-like out: a whole 1024-thread block per out element when each
// has at least this many inputs (>= 32 per thread); below it a warp per element.
const rowsBlockGroupMin = 32768;

if (partialsMax * 8 + scratchPartialsOffset > columnPartialsOffset) throw new Error("kernels.ts: partials overlap");
if (gridBlocksMax > gridXMax) throw new Error("kernels.ts: gridBlocksMax exceeds the grid limit");
if (warpRowThreads % warpSize !== 0 || blockRowThreadsMax % warpSize !== 0) {
  throw new Error("kernels.ts: row kernels need whole warps");
}
if (columnRowSlicesMax * warpSize > blockThreadsMax || singleBlockThreads > blockThreadsMax) {
  throw new Error("kernels.ts: a block size exceeds blockThreadsMax");
}

// ---- launch construction ------------------------------------------------------------------------

const u64Max = (1n << 64n) - 1n;
const i32Min = -(2 ** 31);
const i32Max = 2 ** 31 - 1;

function checkArg(kernel: KernelName, index: number, type: ParamType, arg: number | bigint): void {
  const ok =
    type === "u64"
      ? typeof arg === "bigint" && arg >= 0n && arg <= u64Max
      : type === "f32"
        ? typeof arg === "number"
        : type === "i32"
          ? Number.isInteger(arg) && (arg as number) >= i32Min && (arg as number) <= i32Max
          : type === "ptr"
            ? Number.isSafeInteger(arg) && (arg as number) >= 0
            : Number.isSafeInteger(arg);
  if (!ok) throw new RangeError(`${kernel}: argument ${index} (${type}) is invalid: ${String(arg)}`);
}

/** A launch, with its arguments and shape checked against the spec and the CUDA limits
 *  (a failure is a programmer error in a plan or its caller). */
function launch(
  kernel: KernelName,
  grid: number,
  block: readonly [number, number, number],
  args: readonly (number | bigint)[],
): Launch {
  const params = kernelSpecs[kernel].params;
  if (args.length !== params.length) {
    throw new RangeError(`${kernel}: ${args.length} arguments for ${params.length} parameters`);
  }
  params.forEach((type, i) => checkArg(kernel, i, type, args[i]!));
  const threads = block[0] * block[1] * block[2];
  if (!(Number.isInteger(grid) && grid >= 1 && grid <= gridXMax) || !(threads >= 1 && threads <= blockThreadsMax)) {
    throw new RangeError(`${kernel}: bad launch shape grid ${grid}, block ${block.join("x")}`);
  }
  return { kernel, grid: [grid, 1, 1], block, sharedBytes: 0, args };
}

function blocksFor(items: number, perBlock: number): number {
  if (!(Number.isSafeInteger(items) && items >= 0)) throw new RangeError(`invalid size ${items}`);
  return Math.max(1, Math.min(gridBlocksMax, Math.ceil(items / perBlock)));
}

/** One elementwise launch over n items (grid-stride), or none for n = 0. */
function elementwise(kernel: KernelName, n: number, args: readonly (number | bigint)[]): Launch[] {
  if (n === 0) return [];
  return [launch(kernel, blocksFor(n, elementwiseThreads), [elementwiseThreads, 1, 1], args)];
}

/** A warp-per-row launch over `rows` rows. */
function warpRows(kernel: KernelName, rows: number, args: readonly (number | bigint)[]): Launch {
  return launch(kernel, blocksFor(rows, warpRowThreads / warpSize), [warpRowThreads, 1, 1], args);
}

/** A block-per-row launch over `rows` rows of `length` elements. */
function blockRows(kernel: KernelName, rows: number, length: number, args: readonly (number | bigint)[]): Launch {
  const threads = Math.min(blockRowThreadsMax, Math.max(warpSize, Math.ceil(length / warpSize) * warpSize));
  return launch(kernel, blocksFor(rows, 1), [threads, 1, 1], args);
}

/** A (32 columns) x (row slices) launch over C columns of N rows. */
function columns(kernel: KernelName, N: number, C: number, args: readonly (number | bigint)[]): Launch {
  const slices = Math.max(1, Math.min(columnRowSlicesMax, N));
  return launch(kernel, blocksFor(C, warpSize), [warpSize, slices, 1], args);
}

/** The (b, h, 32-row tile) tasks of an attention kernel, 0 for an empty input; a head size the
 *  kernels' shared tiles cannot hold is refused. */
function attentionTiles(B: number, T: number, C: number, H: number): number {
  if (!(Number.isSafeInteger(H) && H >= 1 && C % H === 0))
    throw new RangeError(`attention: C=${C} is not a multiple of H=${H}`);
  if (C / H > attentionHeadSizeMax) {
    throw new RangeError(
      `attention: head size ${C / H} is larger than the CUDA kernels' ${attentionHeadSizeMax} (ffi/cuda/kernels/attention.cu ATT_D_MAX)`,
    );
  }
  return B * H * Math.ceil(T / attentionRows);
}

/** A launch over attention tasks (each kernel loops over tasks, so the grid is capped). */
function attentionLaunch(kernel: KernelName, tasks: number, args: readonly (number | bigint)[]): Launch {
  return launch(kernel, Math.min(gridBlocksMax, tasks), [attentionThreads, 1, 1], args);
}

/** Head sizes the tensor-core attention of flash.cu is built for. */
export const flashHeadSizes: readonly number[] = [64, 128];
const flashRows = 64;
const flashThreads = 128;

/** Why flash.cu cannot run causal attention on these inputs, or null where it can. */
export function flashUnsupported(C: number, H: number, elem: ElemType): string | null {
  if (elem === "f32") return "it runs on 2-byte inputs (bf16 or f16 autocast), and these are f32";
  if (!(Number.isSafeInteger(H) && H >= 1 && C % H === 0)) return `C=${C} is not a multiple of H=${H}`;
  if (!flashHeadSizes.includes(C / H))
    return `it is built for head sizes ${flashHeadSizes.join(" and ")}, not ${C / H}`;
  return null;
}

/** The head size flash.cu runs these inputs at (0: nothing to run); a RangeError where it cannot. */
function flashHeadSize(B: number, T: number, C: number, H: number, elem: ElemType): number {
  const why = flashUnsupported(C, H, elem);
  if (why !== null) throw new RangeError(`tensor-core attention: ${why}`);
  return B * T === 0 ? 0 : C / H;
}

/** flash.cu stages q, k, v and dout with 16-byte copies */
function checkFlashAlignment(ptrs: Record<string, Ptr>): void {
  for (const [name, p] of Object.entries(ptrs))
    if (p % 16 !== 0) throw new RangeError(`tensor-core attention: ${name} at ${p} is not 16-byte aligned`);
}

function flashLaunch(kernel: KernelName, B: number, T: number, H: number, args: readonly (number | bigint)[]): Launch {
  return launch(kernel, Math.min(gridBlocksMax, B * H * Math.ceil(T / flashRows)), [flashThreads, 1, 1], args);
}

/** The tensor-core attention of flash.cu, as plans of the attention ops (typed as `plans`'
 *  are), so the backend runs either these or the f32 kernels' for one call. */
export const flashPlans = {
  /** Causal attention forward: out and lse from qkv, as attentionForward. */
  attentionForward(out, lse, qkv, B, T, C, H, scale, elem): Launch[] {
    const D = flashHeadSize(B, T, C, H, elem);
    if (D === 0) return [];
    checkFlashAlignment({ qkv });
    const args = [out, lse, qkv, B, T, C, H, scale, elemCodes[elem]];
    return [flashLaunch(`mt_flash_forward_d${D}` as KernelName, B, T, H, args)];
  },
  /** Its backward: the delta pre-pass (attention.cu's), then dk and dv per key tile and dq per
   *  query tile, each adding into dqkv where `accumulate`. */
  attentionBackward(dqkv, delta, dout, out, lse, qkv, B, T, C, H, scale, elem, accumulate): Launch[] {
    const D = flashHeadSize(B, T, C, H, elem);
    if (D === 0) return [];
    checkFlashAlignment({ qkv, dout });
    const args = [dqkv, delta, dout, lse, qkv, B, T, C, H, scale, elemCodes[elem], accumulate ? 1 : 0];
    return [
      warpRows("mt_attention_delta_f32", B * H * T, [delta, dout, out, B, T, C, H, elemCodes[elem]]),
      flashLaunch(`mt_flash_backward_kv_d${D}` as KernelName, B, T, H, args),
      flashLaunch(`mt_flash_backward_q_d${D}` as KernelName, B, T, H, args),
    ];
  },
} satisfies Pick<Plans, "attentionForward" | "attentionBackward">;
export const flashForward = flashPlans.attentionForward;
export const flashBackward = flashPlans.attentionBackward;

/**
 * How a column sum over N rows splits into row ranges so that about splitColumnBlocks blocks run
 * (C / 32 blocks alone leave most SMs idle: 24 for C = 768); `arrays` sums share the scratch.
 * null where one pass is enough (or the partials would not fit in scratch). Depends on N and C
 * alone, so a shape always sums in the same order.
 */
function columnSplits(N: number, C: number, arrays: number): { splits: number; rowsPer: number } | null {
  const chunks = Math.ceil(C / warpSize);
  const fit = Math.floor((scratchBytes - columnPartialsOffset) / (4 * arrays * C));
  const wanted = Math.min(Math.ceil(splitColumnBlocks / chunks), Math.ceil(N / splitRowsMin), fit);
  if (wanted < 2) return null;
  const rowsPer = Math.ceil(N / wanted);
  return { splits: Math.ceil(N / rowsPer), rowsPer };
}

/** A (32 columns) x (row slices) launch over every (column chunk, row split) task. */
function splitColumns(
  kernel: KernelName,
  C: number,
  split: { splits: number; rowsPer: number },
  args: readonly (number | bigint)[],
): Launch {
  const slices = Math.max(1, Math.min(columnRowSlicesMax, split.rowsPer));
  return launch(kernel, blocksFor(Math.ceil(C / warpSize) * split.splits, 1), [warpSize, slices, 1], args);
}

function singleBlock(kernel: KernelName, args: readonly (number | bigint)[]): Launch {
  return launch(kernel, 1, [singleBlockThreads, 1, 1], args);
}

const product = (d: Dims4): number => d[0] * d[1] * d[2] * d[3];

// ---- reduceBroadcast: split dims into kept and reduced -------------------------------------------

interface Axis {
  size: number;
  inStride: number;
  outStride: number;
}

interface ReduceShape {
  /** kept dims (out stride != 0), padded to 4 with leading 1s; inp and out strides */
  kept: { dims: number[]; inStrides: number[]; outStrides: number[] };
  /** reduced dims (out stride 0), padded to 4; inp strides */
  reduced: { dims: number[]; inStrides: number[] };
  /** whether the innermost non-trivial dim is reduced (contiguous rows to sum) */
  innerReduced: boolean;
}

/** Drops size-1 dims, merges neighbours that stay contiguous (always for two reduced dims, since
 *  inp is contiguous; for kept ones when the out strides nest too), and splits the rest. */
export function reduceShape(dims: Dims4, outStrides: Dims4): ReduceShape {
  const inStrides = [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1];
  const axes: (Axis & { kept: boolean })[] = [];
  for (let k = 0; k < 4; k++) {
    if (dims[k] === 1) continue;
    const axis = { size: dims[k]!, inStride: inStrides[k]!, outStride: outStrides[k]!, kept: outStrides[k] !== 0 };
    const last = axes[axes.length - 1];
    const nests =
      last !== undefined && last.kept === axis.kept && (!axis.kept || last.outStride === axis.size * axis.outStride);
    if (last !== undefined && nests) {
      last.size *= axis.size;
      last.inStride = axis.inStride;
      last.outStride = axis.outStride;
    } else {
      axes.push(axis);
    }
  }
  const pad = (list: number[], fill: number): number[] => [...Array(4 - list.length).fill(fill), ...list];
  const kept = axes.filter((a) => a.kept);
  const reduced = axes.filter((a) => !a.kept);
  return {
    kept: {
      dims: pad(
        kept.map((a) => a.size),
        1,
      ),
      inStrides: pad(
        kept.map((a) => a.inStride),
        0,
      ),
      outStrides: pad(
        kept.map((a) => a.outStride),
        0,
      ),
    },
    reduced: {
      dims: pad(
        reduced.map((a) => a.size),
        1,
      ),
      inStrides: pad(
        reduced.map((a) => a.inStride),
        0,
      ),
    },
    innerReduced: axes.length > 0 && !axes[axes.length - 1]!.kept,
  };
}

// outStrides are those of a broadcast operand (engine/ops/broadcast.ts): 0 on broadcast dims, the
// operand's own strides elsewhere, so distinct kept indices address distinct out elements and
// each out element has exactly one thread group summing into it.
function reduceBroadcastPlan(out: Ptr, inp: Ptr, dims: Dims4, outStrides: Dims4): Launch[] {
  if (product(dims) === 0) return [];
  const { kept, reduced, innerReduced } = reduceShape(dims, outStrides);
  const args = [out, inp, ...kept.dims, ...kept.inStrides, ...kept.outStrides, ...reduced.dims, ...reduced.inStrides];
  const nOut = kept.dims.reduce((a, b) => a * b, 1);
  const nRed = reduced.dims.reduce((a, b) => a * b, 1);
  if (innerReduced) {
    // a group of threads per out element: a whole block when there is a lot to sum, else a warp
    const block: [number, number, number] =
      nRed >= rowsBlockGroupMin ? [singleBlockThreads, 1, 1] : [warpSize, elementwiseThreads / warpSize, 1];
    return [launch("mt_reduce_bcast_rows_f32", blocksFor(nOut, block[1]), block, args)];
  }
  return [columns("mt_reduce_bcast_cols_f32", nRed, nOut, args)];
}

// ---- scalar results in scratch ------------------------------------------------------------------

/** Block partials of a grid-stride reduction over n: a function of n alone (determinism). */
function partialCount(n: number): number {
  return Math.max(1, Math.min(partialsMax, Math.ceil(n / (elementwiseThreads * 8))));
}

/** Per-block partials into scratch, then one block sums them in order into scratch[0]. */
function twoPass(partialKernel: KernelName, finalKernel: KernelName, scratch: Ptr, x: Ptr, n: number): Launch[] {
  const partials = scratch + scratchPartialsOffset;
  if (n === 0) return [singleBlock(finalKernel, [scratch, partials, 0])];
  const count = partialCount(n);
  return [
    launch(partialKernel, count, [elementwiseThreads, 1, 1], [partials, x, n]),
    singleBlock(finalKernel, [scratch, partials, count]),
  ];
}

// ---- plans --------------------------------------------------------------------------------------

/** Every op (ffi/ops.ts) has a plan taking the method's arguments; one that returns a number to
 *  JavaScript, or is declared with `scratch`, takes `scratch` first. */
type Plan<M extends OpName> = Backend[M] extends (...args: infer A) => unknown
  ? (typeof ops)[M] extends { result: "void"; scratch?: undefined }
    ? (...args: A) => Launch[]
    : (scratch: Ptr, ...args: A) => Launch[]
  : never;

/** Whether a plan takes scratch first (see Plan). */
export const planTakesScratch = (d: OpDecl): boolean => d.result !== "void" || d.scratch === true;

export type Plans = { readonly [M in OpName]: Plan<M> };

// Each plan takes its op's arguments, typed by the op's declaration through `satisfies Plans`.
export const plans = {
  // ---- elementwise ----
  add(out, a, b, n): Launch[] {
    return elementwise("mt_add_f32", n, [out, a, b, n]);
  },
  mul(out, a, b, n): Launch[] {
    return elementwise("mt_mul_f32", n, [out, a, b, n]);
  },
  axpy(y, x, n, alpha): Launch[] {
    return elementwise("mt_axpy_f32", n, [y, x, n, alpha]);
  },
  scale(x, n, s): Launch[] {
    return elementwise("mt_scale_f32", n, [x, n, s]);
  },
  addScalarFrom(dinp, dout, scale, n): Launch[] {
    return elementwise("mt_add_scalar_ptr_f32", n, [dinp, dout, scale, n]);
  },
  binaryBroadcast(op, out, a, b, dims, aStrides, bStrides): Launch[] {
    return elementwise("mt_binary_bcast_f32", product(dims), [
      op === "add" ? 0 : 1,
      out,
      a,
      b,
      ...dims,
      ...aStrides,
      ...bStrides,
    ]);
  },
  reduceBroadcast(out, inp, dims, outStrides): Launch[] {
    return reduceBroadcastPlan(out, inp, dims, outStrides);
  },

  // ---- layers ----
  biasAdd(out, inp, bias, N, C, elem): Launch[] {
    return elementwise("mt_bias_add_f32", N * C, [out, inp, bias, N, C, elemCodes[elem]]);
  },
  biasBackward(scratch, dbias, dout, N, C, elem): Launch[] {
    if (N * C === 0) return [];
    const split = columnSplits(N, C, 1);
    if (split === null) return [columns("mt_bias_backward_f32", N, C, [dbias, dout, N, C, elemCodes[elem]])];
    const partials = scratch + columnPartialsOffset;
    return [
      splitColumns("mt_bias_backward_partial_f32", C, split, [partials, dout, N, C, split.rowsPer, elemCodes[elem]]),
      ...elementwise("mt_column_partials_add_f32", C, [dbias, partials, split.splits, C]),
    ];
  },
  reluForward(out, inp, n, elem): Launch[] {
    return elementwise("mt_relu_forward_f32", n, [out, inp, n, elemCodes[elem]]);
  },
  reluBackward(dinp, inp, dout, n, elem): Launch[] {
    return elementwise("mt_relu_backward_f32", n, [dinp, inp, dout, n, elemCodes[elem]]);
  },
  geluForward(out, inp, n, elem): Launch[] {
    return elementwise("mt_gelu_forward_f32", n, [out, inp, n, elemCodes[elem]]);
  },
  geluBackward(dinp, inp, dout, n, elem): Launch[] {
    return elementwise("mt_gelu_backward_f32", n, [dinp, inp, dout, n, elemCodes[elem]]);
  },
  biasGeluForward(out, pre, bias, N, C, elem): Launch[] {
    return elementwise("mt_bias_gelu_forward_f32", N * C, [out, pre, bias, N, C, elemCodes[elem]]);
  },
  dropoutForward(out, inp, n, p, seed): Launch[] {
    return elementwise("mt_dropout_forward_f32", n, [out, inp, n, p, seed]);
  },
  dropoutBackward(dinp, dout, n, p, seed): Launch[] {
    return elementwise("mt_dropout_backward_f32", n, [dinp, dout, n, p, seed]);
  },
  // (no inRange: the loss kernel computes the count with the mean anyway; the backend just
  // does not read it when the targets were checked on the host)
  crossEntropyForward(scratch, loss, losses, lse, logits, targets, N, V, elem): Launch[] {
    const args = [losses, lse, logits, targets, N, V, elemCodes[elem]];
    const rows = N === 0 ? [] : [blockRows("mt_crossentropy_forward_f32", N, V, args)];
    return [...rows, singleBlock("mt_crossentropy_loss_f32", [loss, scratch, losses, targets, N, V])];
  },
  crossEntropyBackward(dlogits, logits, lse, targets, dloss, N, V, accumulate, elem): Launch[] {
    if (N * V === 0) return [];
    const args = [dlogits, logits, lse, targets, dloss, N, V, accumulate ? 1 : 0, elemCodes[elem]];
    return [blockRows("mt_crossentropy_backward_f32", N, V, args)];
  },
  // a block per row (grid-stride over at most partialsMax blocks, each writing its count), then
  // one block sums the counts in order into scratch[0]; N = 0 only writes that 0
  countCorrect(scratch, logits, targets, N, V, elem): Launch[] {
    const partials = scratch + scratchPartialsOffset;
    if (N === 0) return [singleBlock("mt_sum_partials_i64", [scratch, partials, 0])];
    const blocks = Math.min(partialsMax, N);
    const rows = blockRows("mt_count_correct_partial_f32", blocks, V, [
      partials,
      logits,
      targets,
      N,
      V,
      elemCodes[elem],
    ]);
    return [rows, singleBlock("mt_sum_partials_i64", [scratch, partials, blocks])];
  },
  layerNormForward(out, mean, rstd, inp, weight, bias, N, C, eps, elem): Launch[] {
    // C = 0 still writes mean and rstd (NaN, as on the CPU)
    if (N === 0) return [];
    const args = [out, mean, rstd, inp, weight, bias, N, C, eps, elemCodes[elem]];
    return [warpRows("mt_layernorm_forward_f32", N, args)];
  },
  residualLayerNormForward(sum, out, mean, rstd, x, d, weight, bias, N, C, eps, elem): Launch[] {
    if (N === 0) return [];
    const args = [sum, out, mean, rstd, x, d, weight, bias, N, C, eps, elemCodes[elem]];
    return [warpRows("mt_residual_layernorm_forward_f32", N, args)];
  },
  layerNormBackward(scratch, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, elem): Launch[] {
    if (N * C === 0) return [];
    const e = elemCodes[elem];
    const rows = warpRows("mt_layernorm_backward_f32", N, [dinp, dout, inp, weight, mean, rstd, N, C, e]);
    const split = columnSplits(N, C, 2);
    if (split === null)
      return [
        rows,
        columns("mt_layernorm_backward_params_f32", N, C, [dweight, dbias, dout, inp, mean, rstd, N, C, e]),
      ];
    const partials = scratch + columnPartialsOffset;
    const dbiasPartials = partials + 4 * split.splits * C;
    return [
      rows,
      splitColumns("mt_layernorm_params_partial_f32", C, split, [
        partials,
        dout,
        inp,
        mean,
        rstd,
        N,
        C,
        split.rowsPer,
        e,
      ]),
      ...elementwise("mt_column_partials_add_f32", C, [dweight, partials, split.splits, C]),
      ...elementwise("mt_column_partials_add_f32", C, [dbias, dbiasPartials, split.splits, C]),
    ];
  },
  embeddingForward(scratch, out, ids, table, N, C, V, inRange = false): Launch[] {
    const rows = N * C === 0 ? [] : [warpRows("mt_embedding_forward_f32", N, [out, ids, table, N, C, V])];
    // ids checked on the host: no count to compute
    return inRange ? rows : [...rows, singleBlock("mt_embedding_count_invalid_i32", [scratch, ids, N, V])];
  },
  embeddingBackward(dtable, ids, dout, N, C): Launch[] {
    return elementwise("mt_embedding_backward_f32", N * C, [dtable, ids, dout, N, C]);
  },
  attentionForward(out, lse, qkv, B, T, C, H, scale, elem): Launch[] {
    const tiles = attentionTiles(B, T, C, H);
    if (tiles === 0) return [];
    return [attentionLaunch("mt_attention_forward_f32", tiles, [out, lse, qkv, B, T, C, H, scale, elemCodes[elem]])];
  },
  attentionDecode(out, qkv, B, T, C, H, scale, elem): Launch[] {
    // a warp per (b, h); attentionTiles refuses a head larger than the kernel's o[ATT_D_MAX]
    if (attentionTiles(B, T, C, H) === 0) return [];
    return [warpRows("mt_attention_decode_f32", B * H, [out, qkv, B, T, C, H, scale, elemCodes[elem]])];
  },
  attentionBackward(dqkv, delta, dout, out, lse, qkv, B, T, C, H, scale, elem, accumulate): Launch[] {
    const tiles = attentionTiles(B, T, C, H);
    if (tiles === 0) return [];
    const args = [dqkv, delta, dout, lse, qkv, B, T, C, H, scale, elemCodes[elem], accumulate ? 1 : 0];
    return [
      warpRows("mt_attention_delta_f32", B * H * T, [delta, dout, out, B, T, C, H, elemCodes[elem]]),
      attentionLaunch("mt_attention_backward_kv_f32", tiles, args),
      attentionLaunch("mt_attention_backward_q_f32", tiles, args),
    ];
  },
  stridedCopy(out, outStrides, inp, inpStrides, dims, accumulate): Launch[] {
    return elementwise("mt_strided_copy_f32", product(dims), [
      out,
      inp,
      ...dims,
      ...outStrides,
      ...inpStrides,
      accumulate ? 1 : 0,
    ]);
  },

  // ---- reductions ----
  sum(out, inp, n): Launch[] {
    // one block: no scratch for partials (see reduce.cu); n = 0 still writes out[0] = 0
    return [singleBlock("mt_sum_f32", [out, inp, n])];
  },
  sumSquares(scratch, x, n): Launch[] {
    return twoPass("mt_sum_squares_partial_f32", "mt_sum_partials_f64", scratch, x, n);
  },
  countNonFinite(scratch, x, n): Launch[] {
    return twoPass("mt_count_nonfinite_partial_f32", "mt_sum_partials_i64", scratch, x, n);
  },

  // ---- optimizer updates ----
  sgdStep(param, grad, momentumBuf, n, lr, momentum, dampening, weightDecay, nesterov, first): Launch[] {
    return elementwise("mt_sgd_step_f32", n, [
      param,
      grad,
      momentumBuf,
      n,
      lr,
      momentum,
      dampening,
      weightDecay,
      nesterov ? 1 : 0,
      first ? 1 : 0,
    ]);
  },
  adamwStep(param, grad, m, v, age, n, decayEnd, lr, beta1, beta2, eps, weightDecay, bc1, bc2, gradScale): Launch[] {
    const args = [param, grad, m, v, age, n, decayEnd, lr, beta1, beta2, eps, weightDecay, bc1, bc2, gradScale];
    return elementwise("mt_adamw_step_f32", n, args);
  },

  // ---- casts ----
  castF32ToBF16(out, inp, n): Launch[] {
    return elementwise("mt_f32_to_bf16", n, [out, inp, n]);
  },
  castBF16ToF32(out, inp, n): Launch[] {
    return elementwise("mt_bf16_to_f32", n, [out, inp, n]);
  },
  castF32ToF16(out, inp, n): Launch[] {
    return elementwise("mt_f32_to_f16", n, [out, inp, n]);
  },
  castF16ToF32(out, inp, n): Launch[] {
    return elementwise("mt_f16_to_f32", n, [out, inp, n]);
  },
} satisfies Plans;

/** out (n) += inp (n), both of elem, summed in f32: a gradient a library wrote (cuDNN's attention
 *  backward) added into one that already holds something. */
export function accumulatePlan(out: Ptr, inp: Ptr, n: number, elem: ElemType): Launch[] {
  return elementwise("mt_accumulate_elem", n, [out, inp, n, elemCodes[elem]]);
}
