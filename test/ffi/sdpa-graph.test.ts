// The layouts ffi/cuda/sdpa-graph.ts's header states, as data, with no library at all: what
// cuDNN's fused causal attention is asked for (the binding against a fake cuDNN:
// cudnn-fake.test.ts).
import { describe, expect, test } from "bun:test";
import {
  type GraphOp,
  type SdpaGraph,
  type SdpaShape,
  sdpaBackwardGraph,
  sdpaBackwardScratch,
  sdpaForwardGraph,
  sdpaUids,
  sdpaUnsupported,
} from "../../ffi/cuda/sdpa-graph.ts";
import { tensorOf } from "../helpers/sdpa-graphs.ts";

describe("sdpa-graph.ts: the layouts its header states", () => {
  const s: SdpaShape = { B: 2, H: 3, T: 5, D: 8, dtype: "bf16", scale: 0.25 };
  const C = s.H * s.D;
  const fwd = sdpaForwardGraph(s);
  const bwd = sdpaBackwardGraph(s);

  test("Q, K^T, V inside qkv (B,T,3C); O inside out (B,T,C); Stats (B,H,T) f32", () => {
    const layout = (
      g: SdpaGraph,
      name: string,
    ): { dims: number[]; strides: number[]; dtype: string; virtual: boolean } => {
      const t = tensorOf(g, name);
      return { dims: [...t.dims], strides: [...t.strides], dtype: t.dtype, virtual: t.virtual };
    };
    const qkv = { dims: [s.B, s.H, s.T, s.D], strides: [s.T * 3 * C, s.D, 3 * C, 1], dtype: "bf16", virtual: false };
    const kT = { dims: [s.B, s.H, s.D, s.T], strides: [s.T * 3 * C, s.D, 1, 3 * C], dtype: "bf16", virtual: false };
    const out = { dims: [s.B, s.H, s.T, s.D], strides: [s.T * C, s.D, C, 1], dtype: "bf16", virtual: false };
    const stats = { dims: [s.B, s.H, s.T, 1], strides: [s.H * s.T, s.T, 1, 1], dtype: "float", virtual: false };
    for (const g of [fwd, bwd]) {
      expect(layout(g, "Q")).toEqual(qkv);
      expect(layout(g, "K^T")).toEqual(kT);
      expect(layout(g, "O")).toEqual(out);
      expect(layout(g, "Stats")).toEqual(stats);
    }
    expect(layout(fwd, "V")).toEqual(qkv);
    expect(layout(bwd, "V^T")).toEqual(kT);
    for (const name of ["dQ", "dK", "dV"]) expect(layout(bwd, name)).toEqual(qkv);
    expect(layout(bwd, "dO")).toEqual(out);
    expect(layout(bwd, "rowsum(dO*O)")).toEqual(stats);
    expect(layout(bwd, "dQ (f32)")).toEqual({
      dims: [s.B, s.H, s.T, s.D],
      strides: [s.H * s.T * s.D, s.T * s.D, s.D, 1],
      dtype: "float",
      virtual: false,
    });
  });

  test("the caller binds exactly sdpaUids; the scalars go by value; every op names known tensors", () => {
    const io = (g: SdpaGraph) => Object.fromEntries(g.tensors.filter((t) => !t.virtual).map((t) => [t.name, t.uid]));
    const { q, k, v, o, stats, dO, dQ, dK, dV, scale, negInf, one, rowSum, dQAccum } = sdpaUids;
    expect(io(fwd)).toEqual({ Q: q, "K^T": k, V: v, O: o, Stats: stats, scale, "-inf": negInf });
    expect(io(bwd)).toEqual({
      Q: q,
      "K^T": k,
      "V^T": v,
      O: o,
      dO,
      Stats: stats,
      scale,
      "1": one,
      "-inf": negInf,
      dQ,
      dK,
      dV,
      "rowsum(dO*O)": rowSum,
      "dQ (f32)": dQAccum,
    });
    for (const g of [fwd, bwd]) {
      expect(new Set(g.tensors.map((t) => t.uid)).size).toBe(g.tensors.length);
      expect(g.tensors.filter((t) => t.byValue !== undefined).map((t) => [t.name, t.byValue])).toEqual(
        g.direction === "forward"
          ? [
              ["scale", 0.25],
              ["-inf", Number.NEGATIVE_INFINITY],
            ]
          : [
              ["scale", 0.25],
              ["1", 1],
              ["-inf", Number.NEGATIVE_INFINITY],
            ],
      );
      const names = new Set(g.tensors.map((t) => t.name));
      const ports = (op: GraphOp) =>
        op.kind === "matmul" ? [op.a, op.b, op.c] : op.kind === "pointwise" ? [op.x, op.b, op.t, op.y] : [op.x, op.y];
      expect(g.ops.flatMap(ports).filter((p) => p !== undefined && !names.has(p))).toEqual([]);
      const written = g.ops.map((op) => (op.kind === "matmul" ? op.c : op.y));
      // each virtual tensor is written by exactly one op
      for (const t of g.tensors.filter((x) => x.virtual)) expect(written.filter((w) => w === t.name).length).toBe(1);
    }
  });

  test("backward's scratch: the row sums, then dQ's f32 accumulator, each 256-byte aligned", () => {
    const scratch = sdpaBackwardScratch({ ...s, T: 7 });
    const rows = s.B * s.H * 7;
    expect(scratch).toEqual({
      rowSumOffset: 0,
      dQAccumOffset: Math.ceil((rows * 4) / 256) * 256,
      bytes: Math.ceil((rows * 4) / 256) * 256 + Math.ceil((rows * s.D * 4) / 256) * 256,
    });
  });

  test("sdpaUnsupported: head sizes that are multiples of 8 up to 128", () => {
    const shape = (D: number, more: Partial<SdpaShape> = {}) => sdpaUnsupported({ ...s, D, ...more });
    for (const D of [8, 64, 72, 96, 128]) expect(shape(D)).toBeNull();
    for (const D of [60, 130, 136]) expect(shape(D)).toContain(`head size ${D}`);
    expect(shape(64, { T: 0 })).toContain("T=0");
    expect(shape(64, { scale: Number.NaN })).toContain("not finite");
  });
});
