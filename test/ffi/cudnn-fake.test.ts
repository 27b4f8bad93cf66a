// cuDNN's fused causal attention without a GPU, in every CI. The binding (ffi/cuda/cudnn.ts)
// builds the graphs of ffi/cuda/sdpa-graph.ts against fixtures/fake-cudnn.c, a fake libcudnn
// that checks what it receives as cuDNN's documentation states it (descriptor types, attribute
// types and element counts, the fused flash-attention pattern with its causal mask, shapes,
// strides, data types) and computes attention on the host from the buffers the variant pack
// binds (the layouts sdpa-graph.ts's header states, with no library at all: sdpa-graph.test.ts).
// Checked here:
//   - structure, for bf16 and half, head sizes 64 and 128, T in {1, 77, 100, 256}: the fake
//     received exactly the graph (every op, mode, axis, tensor, type, dim, stride and flag), its
//     own pattern matcher gives each uid the role the graph names, the variant pack binds every
//     non-virtual uid, and the numbers match the float64 definition;
//   - refusals, of the fake (so a binding that regresses is caught) and of the binding, and the
//     router's answers where cuDNN is missing or refuses;
//   - the CUDA backend emulated on the host with attention "cudnn" against attention
//     "reference" and float64 (test/helpers/emulated-cuda.ts).
// Letters: B batch, H heads, T time, D head size, C = H*D. Device memory is host memory here.
import { afterAll, describe, expect, test } from "bun:test";
import { ptr } from "bun:ffi";
import type { ElemType, Ptr } from "../../ffi/backend.ts";
import { type AttentionDevice, AttentionRouter, backwardWorkspace } from "../../ffi/cuda/attention-path.ts";
import type { CudaBackend } from "../../ffi/cuda/backend.ts";
import { Cudnn, CudnnError, type CudnnPlan, CudnnUnsupportedError, loadCudnn } from "../../ffi/cuda/cudnn.ts";
import {
  type GraphTensor,
  type SdpaGraph,
  type SdpaShape,
  sdpaBackwardGraph,
  sdpaBackwardPack,
  sdpaForwardGraph,
  sdpaForwardPack,
  sdpaUids,
} from "../../ffi/cuda/sdpa-graph.ts";
import { NativeLibraryError } from "../../ffi/errors.ts";
import { emulatedCuda, type FakeCudnn, fakeCudnn } from "../helpers/emulated-cuda.ts";
import { attentionCase, attentionOn, attentionTolerance } from "../helpers/attention.ts";
import { type HalfElem, relErr, widen16 } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";
import { tensorOf } from "../helpers/sdpa-graphs.ts";

const toolsMissing =
  Bun.which("g++") === null || Bun.which("cc") === null ? "g++ and cc are needed to build the fake cuDNN" : null;
const fake: FakeCudnn | null = toolsMissing === null ? await fakeCudnn() : null;
const emulated = toolsMissing === null ? await emulatedCuda() : { ok: false as const, reason: toolsMissing };

/** fake-cuda.c's only stream, which the emulated backend hands cuDNN */
const fakeCudaStream = 0x5000;
/** what the emulated backend's reference kernels take per test (every CUDA thread is a host thread) */
const emulatedTimeoutMs = 120_000;
/** the fake's loops and the float64 references in JS at T = 256, on a busy machine */
const hostTimeoutMs = 60_000;

type Dtype = SdpaShape["dtype"];
const elemOf = (dtype: Dtype): HalfElem => (dtype === "half" ? "f16" : "bf16");

// ---- what the fake received -----------------------------------------------------------------------

/** The ops as fake-cudnn.c dumps them, from the graph's own description. */
function expectedOps(g: SdpaGraph): Record<string, string | number>[] {
  const uid = (name: string) => tensorOf(g, name).uid;
  return g.ops.map((op): Record<string, string | number> => {
    switch (op.kind) {
      case "matmul":
        return { op: "matmul", compute: "float", a: uid(op.a), b: uid(op.b), c: uid(op.c) };
      case "reduction":
        return { op: "reduction", mode: op.mode, compute: "float", x: uid(op.x), y: uid(op.y) };
      case "reshape":
        return { op: "reshape", x: uid(op.x), y: uid(op.y) };
      case "pointwise":
        return {
          op: "pointwise",
          mode: op.mode,
          compute: op.compute,
          x: uid(op.x),
          ...(op.b === undefined ? {} : { b: uid(op.b) }),
          ...(op.t === undefined ? {} : { t: uid(op.t) }),
          y: uid(op.y),
          ...(op.axis === undefined ? {} : { axis: op.axis }),
          alpha1: 1,
          alpha2: 1,
        };
    }
  });
}

function expectedTensors(g: SdpaGraph) {
  return [...g.tensors]
    .sort((a, b) => a.uid - b.uid)
    .map((t) => ({
      uid: t.uid,
      dtype: t.dtype,
      dims: [...t.dims],
      strides: [...t.strides],
      virtual: t.virtual,
      byValue: t.byValue !== undefined,
      alignment: 16,
    }));
}

/** The mask as the fake received it: GEN_INDEX axis 2 (row) and 3 (column) of the scores it
 *  masks, CMP_GE(row, column), BINARY_SELECT(scores, -inf by value, keep). */
function expectCausalMask(dump: ReturnType<FakeCudnn["lastGraph"]>, plan: CudnnPlan): void {
  const ops = dump.ops.filter((op) => op.op === "pointwise");
  const select = ops.filter((op) => op.mode === "binarySelect");
  expect(select.length).toBe(1);
  const gens = ops.filter((op) => op.mode === "genIndex");
  expect(gens.map((op) => op.axis).sort()).toEqual([2, 3]);
  for (const g of gens) expect(g.x).toBe(select[0]!.x!);
  const row = gens.find((op) => op.axis === 2)!;
  const col = gens.find((op) => op.axis === 3)!;
  const cmp = ops.filter((op) => op.mode === "cmpGe");
  expect(cmp).toEqual([
    { op: "pointwise", mode: "cmpGe", compute: "bool", x: row.y!, b: col.y!, y: select[0]!.t!, alpha1: 1, alpha2: 1 },
  ]);
  const fill = dump.tensors.find((t) => t.uid === select[0]!.b);
  expect(fill).toMatchObject({ uid: sdpaUids.negInf, dtype: "float", dims: [1, 1, 1, 1], byValue: true });
  expect(plan.scalars.get(sdpaUids.negInf)?.[0]).toBe(Number.NEGATIVE_INFINITY);
  const types = (uid: string | number) => dump.tensors.find((t) => t.uid === uid)?.dtype;
  expect([types(row.y!), types(col.y!), types(select[0]!.t!)]).toEqual(["int32", "int32", "bool"]);
}

/** A host buffer standing in for device memory, 256-byte aligned as the caching allocator's are. */
function hostBuffer(bytes: number): { view: Uint8Array; ptr: Ptr } {
  const raw = new Uint8Array(bytes + 256);
  const skew = (256 - (ptr(raw) % 256)) % 256;
  return { view: raw.subarray(skew, skew + bytes), ptr: ptr(raw) + skew };
}

/** Buffers of one forward and backward, bound and laid out as the router does it (sdpa-graph.ts's
 *  sdpaForwardPack and sdpaBackwardPack, attention-path.ts's backwardWorkspace). */
function hostAttention(s: SdpaShape, fwd: CudnnPlan, bwd: CudnnPlan) {
  const { B, H, T, D } = s;
  const C = H * D;
  const bwdWorkspace = backwardWorkspace(s, bwd);
  const b = {
    qkv: hostBuffer(B * T * 3 * C * 2),
    out: hostBuffer(B * T * C * 2),
    lse: hostBuffer(B * H * T * 4),
    dout: hostBuffer(B * T * C * 2),
    dqkv: hostBuffer(B * T * 3 * C * 2),
    fwdWorkspace: hostBuffer(fwd.workspaceBytes),
    bwdWorkspace: hostBuffer(bwdWorkspace.bytes),
  };
  const at = { qkv: b.qkv.ptr, out: b.out.ptr, lse: b.lse.ptr };
  const fwdBuffers = sdpaForwardPack(s, at);
  const bwdBuffers = sdpaBackwardPack(s, { ...at, dout: b.dout.ptr, dqkv: b.dqkv.ptr, scratch: b.bwdWorkspace.ptr });
  return { ...b, fwdBuffers, bwdBuffers, bwdWorkspacePtr: b.bwdWorkspace.ptr + bwdWorkspace.planOffset };
}

const u16 = (b: { view: Uint8Array }) => new Uint16Array(b.view.buffer, b.view.byteOffset, b.view.length / 2);
const f32 = (b: { view: Uint8Array }) => new Float32Array(b.view.buffer, b.view.byteOffset, b.view.length / 4);

const graphShapes = [1, 77, 100, 256].flatMap((T) => [64, 128].map((D) => ({ B: 1, H: 2, T, D })));

describe.skipIf(skip("g++ and cc", toolsMissing))("the binding's graphs against the fake cuDNN", () => {
  const f = fake!;
  const cudnn = new Cudnn(loadCudnn(f.path), BigInt(fakeCudaStream));
  afterAll(() => cudnn.dispose());

  describe.each(["bf16", "half"] as const)("%s", (dtype) => {
    test.each(graphShapes)(
      "B=$B H=$H T=$T D=$D: the graphs as received, the variant packs, the numbers",
      (sh) => {
        const s: SdpaShape = { ...sh, dtype, scale: 1 / Math.sqrt(sh.D) };
        const C = s.H * s.D;
        const graphs = [sdpaForwardGraph(s), sdpaBackwardGraph(s)];
        const [fwd, bwd] = graphs.map((g) => {
          const plan = cudnn.plan(g);
          const dump = f.lastGraph();
          expect({ status: dump.status, error: dump.error, direction: dump.direction }).toEqual({
            status: 0,
            error: "",
            direction: g.direction,
          });
          expect(dump.ops).toEqual(expectedOps(g));
          expect(dump.tensors).toEqual(expectedTensors(g));
          // the fake's own pattern matcher found each role at the uid the graph gives it
          expect(dump.roles).toEqual(
            Object.fromEntries(g.tensors.filter((t) => !t.virtual).map((t) => [t.name, t.uid])),
          );
          expectCausalMask(dump, plan);
          const uid = (u: number) => dump.tensors.find((t) => t.uid === u);
          expect(uid(sdpaUids.k)).toMatchObject({ dims: [s.B, s.H, s.D, s.T], strides: [s.T * 3 * C, s.D, 1, 3 * C] });
          expect(uid(sdpaUids.stats)).toMatchObject({ dims: [s.B, s.H, s.T, 1], strides: [s.H * s.T, s.T, 1, 1] });
          expect(plan.workspaceBytes).toBeGreaterThan(0);
          return plan;
        }) as [CudnnPlan, CudnnPlan];

        const c = attentionCase(s, elemOf(dtype));
        const b = hostAttention(s, fwd, bwd);
        u16(b.qkv).set(c.bits.qkv);
        u16(b.dout).set(c.bits.dout);
        const executed = f.executions();
        cudnn.execute(fwd, b.fwdBuffers, b.fwdWorkspace.ptr);
        const runs = [f.lastExecution()];
        cudnn.execute(bwd, b.bwdBuffers, b.bwdWorkspacePtr);
        runs.push(f.lastExecution());
        expect(f.executions()).toBe(executed + 2);
        const scale = Math.fround(1 / Math.sqrt(s.D));
        for (const [run, plan, scalars] of [
          [runs[0]!, fwd, { scale, "-inf": "-Infinity" }],
          [runs[1]!, bwd, { scale, "1": 1, "-inf": "-Infinity" }],
        ] as const) {
          expect({ ...run, uids: [...run.uids].sort((x, y) => x - y) }).toEqual({
            direction: plan.graph.direction,
            stream: fakeCudaStream,
            engine: plan.engineIndex,
            workspaceBytes: plan.workspaceBytes,
            uids: plan.graph.tensors
              .filter((t) => !t.virtual)
              .map((t) => t.uid)
              .sort((x, y) => x - y),
            scalars,
          });
        }

        const tol = attentionTolerance(elemOf(dtype));
        expect(relErr(widen16(u16(b.out), elemOf(dtype)), c.want.out)).toBeLessThan(tol);
        expect(relErr(f32(b.lse), c.want.lse)).toBeLessThan(1e-5);
        expect(relErr(widen16(u16(b.dqkv), elemOf(dtype)), c.want.dqkv)).toBeLessThan(2 * tol);
      },
      hostTimeoutMs,
    );
  });

  test("head size 72 plans; 60 and 130 are refused by every engine (NOT_SUPPORTED_SHAPE)", () => {
    const shape = (D: number): SdpaShape => ({ B: 1, H: 2, T: 9, D, dtype: "bf16", scale: 1 / Math.sqrt(D) });
    expect(cudnn.plan(sdpaForwardGraph(shape(72))).graph.direction).toBe("forward");
    expect(cudnn.plan(sdpaBackwardGraph(shape(72))).graph.direction).toBe("backward");
    for (const D of [60, 130]) {
      for (const g of [sdpaForwardGraph(shape(D)), sdpaBackwardGraph(shape(D))])
        expect(() => cudnn.plan(g)).toThrow(
          new RegExp(`no engine for the ${g.direction}.*CUDNN_STATUS_NOT_SUPPORTED_SHAPE: head size ${D}`),
        );
    }
  });

  // ---- graphs the fake refuses, through the binding ----

  const s: SdpaShape = { B: 1, H: 2, T: 9, D: 64, dtype: "bf16", scale: 0.125 };
  const tensor = (g: SdpaGraph, name: string, change: Partial<GraphTensor>): SdpaGraph => ({
    ...g,
    tensors: g.tensors.map((t) => (t.name === name ? { ...t, ...change } : t)),
  });
  /** the graph without its mask: the ops that read the masked scores read the unmasked ones */
  const unmasked = (g: SdpaGraph): SdpaGraph => {
    const select = g.ops.find((op) => op.kind === "pointwise" && op.mode === "binarySelect");
    if (select?.kind !== "pointwise") throw new Error(`the ${g.direction} graph has no mask to remove`);
    const { x: scores, y: masked } = select;
    const gone = new Set(["mask.row", "mask.col", "mask.keep", "mask.masked"]);
    return {
      ...g,
      tensors: g.tensors.filter((t) => !gone.has(t.name)),
      ops: g.ops
        .filter((op) => op.kind === "matmul" || !gone.has(op.y))
        .map((op) => (op.kind !== "matmul" && op.x === masked ? { ...op, x: scores } : op)),
    };
  };
  /** the mask with its GEN_INDEX axes swapped: it would keep j >= i */
  const antiCausal = (g: SdpaGraph): SdpaGraph => ({
    ...g,
    ops: g.ops.map((op) =>
      op.kind === "pointwise" && op.mode === "genIndex" ? { ...op, axis: op.axis === 2 ? 3 : 2 } : op,
    ),
  });
  const C3 = 3 * s.H * s.D;

  test.each([
    ["forward without the causal mask", unmasked(sdpaForwardGraph(s)), 3001, /causal mask is missing/],
    ["backward without the causal mask", unmasked(sdpaBackwardGraph(s)), 3001, /causal mask is missing/],
    ["an anti-causal mask", antiCausal(sdpaForwardGraph(s)), 3001, /causal is row \(axis 2\) >= column \(axis 3\)/],
    [
      "a mask filling from memory, not by value",
      tensor(sdpaForwardGraph(s), "-inf", { byValue: undefined }),
      3001,
      /mask fill value \(uid 11\) must be a float scalar passed by value/,
    ],
    [
      "K^T laid out as K (its head dim strided)",
      tensor(sdpaForwardGraph(s), "K^T", { strides: [s.T * C3, s.D, C3, 1] }),
      3004,
      /K\^T \(uid 2\): the head dim has stride 384/,
    ],
    [
      "f32 inputs",
      ["Q", "K^T", "V", "O", "P"].reduce((g, n) => tensor(g, n, { dtype: "float" }), sdpaForwardGraph(s)),
      3003,
      /take half or bf16/,
    ],
    [
      "Stats of the wrong shape",
      tensor(sdpaForwardGraph(s), "Stats", { dims: [1, 2, 9, 9], strides: [162, 81, 9, 1] }),
      3001,
      /Stats \(uid 5\): dims \[1,2,9,9\], the pattern has \[1,2,9,1\]/,
    ],
  ] as const)("refused with NOT_SUPPORTED (a fallback case): %s", (_, graph, status, message) => {
    let error: unknown;
    try {
      cudnn.plan(graph);
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(CudnnUnsupportedError);
    expect((error as Error).message).toContain(`(${status})`);
    expect((error as Error).message).toMatch(message);
    expect(f.lastGraph()).toMatchObject({ status, direction: null });
  });

  test.each([
    ["two tensors sharing a uid", tensor(sdpaForwardGraph(s), "V", { uid: sdpaUids.k }), /uid 2 names two different/],
    [
      "a virtual tensor no op writes",
      {
        ...sdpaForwardGraph(s),
        ops: sdpaForwardGraph(s).ops.filter((op) => op.kind !== "reduction" || op.mode !== "max"),
      },
      /virtual tensor uid \d+ is read but no op writes it/,
    ],
  ] as const)("refused as a bad parameter (a bug, no fallback): %s", (_, graph, message) => {
    expect(() => cudnn.plan(graph)).toThrow(CudnnError);
    expect(() => cudnn.plan(graph)).toThrow(message);
  });

  test("the heuristics' configs are tried in order until one makes a plan", () => {
    try {
      f.setEngineConfigs(3, 2);
      const plan = cudnn.plan(sdpaForwardGraph(s));
      expect(plan.engineIndex).toBe(2);
      f.setEngineConfigs(12, 0);
      expect(cudnn.plan(sdpaForwardGraph(s)).engineIndex).toBe(0);
      f.setEngineConfigs(2, 2);
      expect(() => cudnn.plan(sdpaForwardGraph(s))).toThrow(
        /no engine for the forward attention graph \(2 configs from its heuristics; CUDNN_STATUS_NOT_SUPPORTED: engine 0 .*; CUDNN_STATUS_NOT_SUPPORTED: engine 1/,
      );
      f.setEngineConfigs(0, 0);
      expect(() => cudnn.plan(sdpaBackwardGraph(s))).toThrow(CudnnUnsupportedError);
      expect(() => cudnn.plan(sdpaBackwardGraph(s))).toThrow(/\(0 configs from its heuristics\)/);
    } finally {
      f.setEngineConfigs(2, 0);
    }
  });

  // ---- variant packs the fake refuses ----

  test("execution refuses a missing or NULL buffer, a misaligned one, no workspace, a workspace over a tensor", () => {
    const fwd = cudnn.plan(sdpaForwardGraph(s));
    const bwd = cudnn.plan(sdpaBackwardGraph(s));
    const b = hostAttention(s, fwd, bwd);
    const executed = f.executions();
    const run =
      (plan: CudnnPlan, change: Map<number, Ptr>, workspace = b.fwdWorkspace.ptr) =>
      () =>
        cudnn.execute(plan, new Map([...b.fwdBuffers, ...change]), workspace);
    const noStats = { ...fwd, uids: fwd.uids.filter((u) => Number(u) !== sdpaUids.stats) };
    expect(run(noStats, new Map())).toThrow(
      /CUDNN_STATUS_BAD_PARAM \(2000\): variant pack: no data pointer for tensor uid 5/,
    );
    expect(run(fwd, new Map([[sdpaUids.o, 0]]))).toThrow(
      /BAD_PARAM_NULL_POINTER \(2002\).*uid 4's data pointer is NULL/,
    );
    expect(run(fwd, new Map([[sdpaUids.o, b.out.ptr + 2]]))).toThrow(
      /BAD_PARAM_MISALIGNED_POINTER \(2003\).*uid 4 at .* not 16-byte aligned/,
    );
    expect(run(fwd, new Map(), 0)).toThrow(/BAD_PARAM_NULL_POINTER \(2002\).*needs \d+ bytes of workspace/);
    expect(run(fwd, new Map(), b.lse.ptr)).toThrow(/the workspace .* overlaps tensor uid 5 \(Stats\)/);
    expect(f.executions()).toBe(executed);
    cudnn.execute(fwd, b.fwdBuffers, b.fwdWorkspace.ptr);
    expect(f.executions()).toBe(executed + 1);
    // the engines leave garbage in their workspace; the caller keeps nothing there
    expect(b.fwdWorkspace.view.every((x) => x === 0xff)).toBe(true);
  });
});

// ---- the fake itself refuses what cuDNN's documentation refuses ----------------------------------

describe.skipIf(skip("g++ and cc", toolsMissing))("the fake cuDNN's own checks, through its C API", () => {
  const lib = toolsMissing === null ? loadCudnn(fake!.path).symbols : null;
  // cuDNN's numbers (cudnn_graph.h), as the binding uses them
  const type = { tensor: 17, pointwise: 0, opPointwise: 13, matmul: 18, opMatmul: 19, reduction: 21, opReduction: 22 };
  const attrType = { dataType: 1, boolean: 2, int64: 3, pointwiseMode: 14, descriptor: 15, reductionOperator: 18 };
  const attr = {
    pwMode: 0,
    pwMathPrec: 1,
    pwX: 751,
    pwB: 752,
    pwY: 753,
    pwDesc: 750,
    pwT: 758,
    alignment: 900,
    dataType: 901,
    dims: 902,
    strides: 903,
    uid: 906,
    isVirtual: 907,
    matmulComp: 1500,
    mmA: 1520,
    mmB: 1521,
    mmC: 1522,
    mmDesc: 1523,
    redOp: 1600,
    redComp: 1601,
    redX: 1610,
    redY: 1611,
    redDesc: 1612,
  };
  const i64 = (...v: number[]) => new BigInt64Array(v.map(BigInt));
  const i32 = (...v: number[]) => new Int32Array(v);
  const desc = (...d: bigint[]) => new BigUint64Array(d);

  const lastError = () => {
    const buf = new Uint8Array(1024);
    lib!.cudnnGetLastErrorString(ptr(buf), buf.length);
    return Buffer.from(buf.subarray(0, buf.indexOf(0))).toString();
  };

  /** the status of the first call that fails and cuDNN's message then; 0 and "" if none does */
  class Calls {
    status = 0;
    message = "";
    create(t: number): bigint {
      const out = new BigUint64Array(1);
      this.#call(lib!.cudnnBackendCreateDescriptor(t, ptr(out)));
      return out[0]!;
    }
    set(d: bigint, name: number, t: number, v: Int32Array | BigInt64Array | BigUint64Array | Uint8Array, n = v.length) {
      this.#call(lib!.cudnnBackendSetAttribute(d, name, t, n, ptr(v)));
    }
    finalize(d: bigint): bigint {
      this.#call(lib!.cudnnBackendFinalize(d));
      return d;
    }
    tensor(uid: number, dims: number[], strides = dims.map((_, i) => dims.slice(i + 1).reduce((a, b) => a * b, 1))) {
      const d = this.create(type.tensor);
      this.set(d, attr.dataType, attrType.dataType, i32(0));
      this.set(d, attr.dims, attrType.int64, i64(...dims));
      this.set(d, attr.strides, attrType.int64, i64(...strides));
      this.set(d, attr.uid, attrType.int64, i64(uid));
      this.set(d, attr.alignment, attrType.int64, i64(16));
      return this.finalize(d);
    }
    pointwise(mode: number, ports: { x: bigint; b?: bigint; t?: bigint; y: bigint }) {
      const pw = this.create(type.pointwise);
      this.set(pw, attr.pwMode, attrType.pointwiseMode, i32(mode));
      this.set(pw, attr.pwMathPrec, attrType.dataType, i32(0));
      this.finalize(pw);
      const op = this.create(type.opPointwise);
      this.set(op, attr.pwDesc, attrType.descriptor, desc(pw));
      this.set(op, attr.pwX, attrType.descriptor, desc(ports.x));
      if (ports.b !== undefined) this.set(op, attr.pwB, attrType.descriptor, desc(ports.b));
      if (ports.t !== undefined) this.set(op, attr.pwT, attrType.descriptor, desc(ports.t));
      this.set(op, attr.pwY, attrType.descriptor, desc(ports.y));
      return this.finalize(op);
    }
    #call(status: number): void {
      if (this.status !== 0 || status === 0) return;
      this.status = status;
      this.message = lastError();
    }
  }

  test.each([
    [
      "an attribute of another descriptor type",
      (c: Calls) => c.set(c.create(type.tensor), attr.matmulComp, attrType.dataType, i32(0)),
      2000,
      /CUDNN_ATTR_MATMUL_COMP_TYPE\) does not belong to a TENSOR/,
    ],
    [
      "a wrong attribute type",
      (c: Calls) => c.set(c.create(type.tensor), attr.dataType, attrType.int64, i64(0)),
      2000,
      /DATA_TYPE takes attribute type 1/,
    ],
    [
      "a wrong element count",
      (c: Calls) => c.set(c.create(type.tensor), attr.dims, attrType.int64, i64(...Array(9).fill(1))),
      2000,
      /takes 1 to 8 elements, not 9/,
    ],
    [
      "a BOOLEAN that is not a 1-byte bool",
      (c: Calls) => c.set(c.create(type.tensor), attr.isVirtual, attrType.boolean, new Uint8Array([2])),
      2000,
      /1-byte bool/,
    ],
    [
      "setting after finalize",
      (c: Calls) => c.set(c.tensor(1, [2, 3]), attr.uid, attrType.int64, i64(2)),
      2000,
      /finalized already/,
    ],
    [
      "a tensor finalized without strides",
      (c: Calls) => {
        const d = c.create(type.tensor);
        c.set(d, attr.dataType, attrType.dataType, i32(0));
        c.set(d, attr.dims, attrType.int64, i64(2, 3));
        c.set(d, attr.uid, attrType.int64, i64(1));
        c.set(d, attr.alignment, attrType.int64, i64(16));
        c.finalize(d);
      },
      2000,
      /TENSOR descriptor has no CUDNN_ATTR_TENSOR_STRIDES/,
    ],
    [
      "dims and strides of different ranks",
      (c: Calls) => c.tensor(1, [2, 3, 4], [12, 4]),
      2000,
      /3 dims but 2 strides/,
    ],
    [
      "an op naming a tensor not finalized",
      (c: Calls) => c.set(c.create(type.opPointwise), attr.pwX, attrType.descriptor, desc(c.create(type.tensor))),
      2004,
      /TENSOR descriptor is not finalized/,
    ],
    [
      "an op without its tensors",
      (c: Calls) => c.finalize(c.create(type.opMatmul)),
      2000,
      /OPERATION_MATMUL descriptor has no CUDNN_ATTR_OPERATION_MATMUL_ADESC/,
    ],
    [
      "MUL without its second input",
      (c: Calls) => c.pointwise(1, { x: c.tensor(1, [2, 3]), y: c.tensor(2, [2, 3]) }),
      2000,
      /takes a second input \(BDESC\), none given/,
    ],
    [
      "EXP with a second input",
      (c: Calls) => c.pointwise(13, { x: c.tensor(1, [2, 3]), b: c.tensor(2, [2, 3]), y: c.tensor(3, [2, 3]) }),
      2000,
      /takes one input; BDESC given/,
    ],
    [
      "BINARY_SELECT without its condition",
      (c: Calls) => c.pointwise(601, { x: c.tensor(1, [2, 3]), b: c.tensor(2, [1, 1]), y: c.tensor(3, [2, 3]) }),
      2000,
      /takes a condition \(TDESC\)/,
    ],
    [
      "GEN_INDEX without an axis",
      (c: Calls) => c.pointwise(501, { x: c.tensor(1, [2, 3]), y: c.tensor(2, [2, 3]) }),
      2000,
      /needs CUDNN_ATTR_POINTWISE_AXIS/,
    ],
    [
      "operands that do not broadcast",
      (c: Calls) => c.pointwise(0, { x: c.tensor(1, [2, 3]), b: c.tensor(2, [3, 3]), y: c.tensor(3, [2, 3]) }),
      2008,
      /dims \[3,3\] do not broadcast to y's \[2,3\]/,
    ],
    [
      "a matmul whose inner dims differ",
      (c: Calls) => {
        const mm = c.create(type.matmul);
        c.set(mm, attr.matmulComp, attrType.dataType, i32(0));
        c.finalize(mm);
        const op = c.create(type.opMatmul);
        c.set(op, attr.mmA, attrType.descriptor, desc(c.tensor(1, [1, 4, 8])));
        c.set(op, attr.mmB, attrType.descriptor, desc(c.tensor(2, [1, 7, 5])));
        c.set(op, attr.mmC, attrType.descriptor, desc(c.tensor(3, [1, 4, 5])));
        c.set(op, attr.mmDesc, attrType.descriptor, desc(mm));
        c.finalize(op);
      },
      2008,
      /matmul A \[1,4,8\] x B \[1,7,5\]: the inner dims/,
    ],
    [
      "a reduction whose output is not its input with 1s",
      (c: Calls) => {
        const r = c.create(type.reduction);
        c.set(r, attr.redOp, attrType.reductionOperator, i32(3));
        c.set(r, attr.redComp, attrType.dataType, i32(0));
        c.finalize(r);
        const op = c.create(type.opReduction);
        c.set(op, attr.redX, attrType.descriptor, desc(c.tensor(1, [2, 4, 8])));
        c.set(op, attr.redY, attrType.descriptor, desc(c.tensor(2, [2, 2, 1])));
        c.set(op, attr.redDesc, attrType.descriptor, desc(r));
        c.finalize(op);
      },
      2008,
      /reduction \[2,4,8\] -> \[2,2,1\]/,
    ],
  ] as const)("%s", (_, calls, status, message) => {
    const c = new Calls();
    calls(c);
    expect({ status: c.status, message: c.message }).toMatchObject({ status, message: expect.stringMatching(message) });
  });
});

// ---- the router: cuDNN missing, refusing, and on the emulated backend ----------------------------

/** A device for a router that must not touch it (nothing gets as far as memory). */
const noDevice: AttentionDevice = {
  alloc: () => {
    throw new Error("the router allocated");
  },
  free: () => {},
  run: () => {
    throw new Error("the router launched kernels");
  },
  stream: 0n,
};
const call = (D: number, elem: ElemType = "bf16") => ({ B: 1, T: 9, C: 2 * D, H: 2, scale: 1 / Math.sqrt(D), elem });
const nowhere = "/nonexistent/libcudnn.so.9";

describe("the router where cuDNN is missing", () => {
  test('attention "cudnn" without cuDNN is a NativeLibraryError naming the file', () => {
    expect(() => new AttentionRouter("cudnn", noDevice, nowhere)).toThrow(NativeLibraryError);
    expect(() => new AttentionRouter("cudnn", noDevice, nowhere)).toThrow(`cannot load cuDNN from ${nowhere}`);
  });

  test('attention "auto" without cuDNN runs the kernels and says why', () => {
    const router = new AttentionRouter("auto", noDevice, nowhere);
    expect(router.usesCudnn(call(64))).toBe(false);
    expect(router.describe("bf16")).toStartWith(`f32-FMA kernels (reference): cannot load cuDNN from ${nowhere}`);
    expect(router.describe("f32")).toBe(
      "f32-FMA kernels (reference): cuDNN's fused attention needs bf16 or f16 autocast",
    );
  });
});

describe.skipIf(skip("g++ and cc", toolsMissing))("the router over the fake cuDNN", () => {
  test('"auto" takes head sizes 64 and 72 and leaves 130 to the kernels; "cudnn" refuses 130', () => {
    const auto = new AttentionRouter("auto", noDevice, fake!.path);
    expect(auto.describe("bf16")).toBe("cuDNN 9.19.0 fused flash attention (bf16 on tensor cores, f32 statistics)");
    expect([64, 72, 130].map((D) => auto.usesCudnn(call(D)))).toEqual([true, true, false]);
    expect(auto.usesCudnn(call(64, "f32"))).toBe(false);
    const cudnn = new AttentionRouter("cudnn", noDevice, fake!.path);
    expect(() => cudnn.usesCudnn(call(130))).toThrow(CudnnUnsupportedError);
    expect(() => cudnn.usesCudnn(call(130))).toThrow(/--attention cudnn: head size 130/);
    expect(() => cudnn.usesCudnn(call(64, "f32"))).toThrow(/needs bf16 or f16 autocast/);
    auto.dispose();
    cudnn.dispose();
  });
});

// small: the reference kernels they are compared with run on the host emulator, a host thread
// per CUDA thread (T = 77 and 100 took 2-6 s each and loaded every core); the graph tests above
// cover T 77, 100 and 256 through the fake alone
const backendShapes = [
  { B: 2, T: 33, H: 2, D: 64 },
  { B: 1, T: 1, H: 2, D: 128 },
  { B: 1, T: 35, H: 1, D: 128 },
];

describe.skipIf(skip("the emulated CUDA backend", emulated.ok ? null : emulated.reason))(
  'the CUDA backend (emulated on the host) with attention "cudnn" and the fake cuDNN',
  () => {
    const backend = (choice: "cudnn" | "reference" | "auto") =>
      (emulated as { cudnnBackend: (c: typeof choice) => CudaBackend }).cudnnBackend(choice);

    describe.each(["bf16", "half"] as const)("%s", (dtype) => {
      test.each(backendShapes)(
        "B=$B T=$T H=$H D=$D: out, lse and dqkv against the reference kernels and float64",
        (sh) => {
          const elem = elemOf(dtype);
          const c = attentionCase(sh, elem);
          const tol = attentionTolerance(elem);
          for (const accumulate of [false, true]) {
            const fused = backend("cudnn");
            const before = { ...fused.launchCounts };
            const a = attentionOn(fused, c.bits, sh, elem, accumulate);
            expect(fused.launchCounts.cudnn - before.cudnn).toBe(2);
            expect(fake!.lastExecution().stream).toBe(fakeCudaStream);
            const b = attentionOn(backend("reference"), c.bits, sh, elem, accumulate);
            expect(relErr(a.out, c.want.out)).toBeLessThan(tol);
            expect(relErr(b.out, c.want.out)).toBeLessThan(tol);
            expect(relErr(a.lse, b.lse)).toBeLessThan(1e-4);
            expect(relErr(a.lse, c.want.lse)).toBeLessThan(1e-5);
            // with accumulate, the 2-byte sum's rounding (of dqkv0's size) adds to the error
            const dtol = (accumulate ? 4 : 2) * tol;
            expect(relErr(c.gradient(a.dqkv, accumulate), c.want.dqkv)).toBeLessThan(dtol);
            expect(relErr(c.gradient(b.dqkv, accumulate), c.want.dqkv)).toBeLessThan(dtol);
            expect(relErr(a.dqkv, b.dqkv)).toBeLessThan(dtol);
          }
        },
        emulatedTimeoutMs,
      );
    });

    test('"cudnn" describes cuDNN; "reference" never loads it', () => {
      expect(backend("cudnn").describeAttention("bf16")).toBe(
        "cuDNN 9.19.0 fused flash attention (bf16 on tensor cores, f32 statistics)",
      );
      expect(backend("reference").describeAttention("bf16")).toBe(
        "f32-FMA kernels (reference), as asked (--attention reference)",
      );
      expect(backend("reference").launchCounts.cudnn).toBe(0);
    });

    // Regression: when cuDNN loads but refuses a shape's graph at plan time (no engine on this
    // GPU), the first call threw instead of running the kernels; only later calls fell back.
    test(
      '"auto" falls back to the kernels on the first call when every engine refuses the graph',
      () => {
        const be = backend("auto");
        const sh = { B: 1, T: 5, H: 2, D: 8 };
        const c = attentionCase(sh, "bf16");
        const dqkv0 = new Uint16Array(c.bits.qkv.length);
        const cudnnBefore = be.launchCounts.cudnn;
        try {
          fake!.setEngineConfigs(2, 2);
          const r = attentionOn(be, { ...c.bits, dqkv0 }, sh, "bf16", false);
          expect(relErr(r.out, c.want.out)).toBeLessThan(attentionTolerance("bf16"));
          expect(be.launchCounts.cudnn).toBe(cudnnBefore);
        } finally {
          fake!.setEngineConfigs(2, 0);
        }
      },
      emulatedTimeoutMs,
    );
  },
);
