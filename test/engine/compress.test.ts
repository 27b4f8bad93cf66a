// Gradient compression (engine/parallel/compress.ts): each codec's encoding against a float64
// reference, the int8 reconstruction bound, top-k's selection, hostile slots refused, and error
// feedback's conservation (sent + residual = gradient + previous residual, exactly, in float64,
// step after step).
import { describe, expect, test } from "bun:test";
import { ConfigError } from "../../ffi/errors.ts";
import {
  Codec,
  type Compression,
  CompressionError,
  density,
  ErrorFeedback,
  parseCompression,
} from "../../engine/parallel/compress.ts";
import { Rng } from "../../engine/rng.ts";
import { decodeChunk, topKChunk } from "../../services/runtime/transport/chunk-codec.ts";

/** Gradient-like values: normal, with a few large outliers and exact zeros. */
function gradients(rng: Rng, n: number, scale = 1e-3): Float32Array {
  const x = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const u = rng.uniform();
    x[i] = u < 0.05 ? 0 : u > 0.995 ? 50 * scale * (rng.uniform() - 0.5) : scale * rng.normal();
  }
  return x;
}

const slot = (codec: Codec, n: number) => new Uint8Array(codec.slotBytes(n));
const decoded = (codec: Codec, s: Uint8Array, n: number) => {
  const out = new Float32Array(n);
  codec.decode(s, out, false);
  return out;
};

describe("parseCompression", () => {
  test("takes the five forms", () => {
    expect(parseCompression("none")).toEqual({ kind: "none" });
    expect(parseCompression("bf16")).toEqual({ kind: "bf16" });
    expect(parseCompression("fp16")).toEqual({ kind: "fp16" });
    expect(parseCompression("int8")).toEqual({ kind: "int8" });
    expect(parseCompression("topk:0.01")).toEqual({ kind: "topk", fraction: 0.01 });
    expect(parseCompression("topk:1")).toEqual({ kind: "topk", fraction: 1 });
    expect(parseCompression("topk:1e-3")).toEqual({ kind: "topk", fraction: 0.001 });
  });
  test("refuses anything else, naming the forms", () => {
    for (const bad of [
      "",
      "f16",
      "int4",
      "topk",
      "topk:",
      "topk:0",
      "topk:1.5",
      "topk:-0.1",
      "topk:abc",
      "BF16",
      "bf16 ",
    ]) {
      expect(() => parseCompression(bad)).toThrow(ConfigError);
    }
    expect(() => parseCompression("topk:2")).toThrow(/\(0, 1\]/);
  });
});

describe("codecs against a float64 reference", () => {
  const n = 10_007;
  test("bf16 and fp16 round to nearest even, as Float16Array and the bf16 bit rule do", () => {
    const x = gradients(new Rng(1), n);
    const bf = new Codec({ kind: "bf16" }),
      fp = new Codec({ kind: "fp16" });
    expect(bf.slotBytes(n)).toBe(Math.ceil((2 * n) / 4) * 4);
    const b = decoded(
      bf,
      (() => {
        const s = slot(bf, n);
        bf.encode(x, s);
        return s;
      })(),
      n,
    );
    const f = decoded(
      fp,
      (() => {
        const s = slot(fp, n);
        fp.encode(x, s);
        return s;
      })(),
      n,
    );
    const f16 = new Float16Array(x);
    for (let i = 0; i < n; i++) {
      expect(f[i]).toBe(f16[i]!);
      // bf16: the nearest value with 8 significant bits (ties to even), in float64
      const v = x[i]!;
      const bits = new Uint32Array(new Float32Array([v]).buffer)[0]!;
      const rounded = (bits + 0x7fff + ((bits >>> 16) & 1)) & 0xffff0000;
      expect(b[i]).toBe(new Float32Array(new Uint32Array([rounded >>> 0]).buffer)[0]!);
      expect(Math.abs(b[i]! - v)).toBeLessThanOrEqual(Math.abs(v) * 2 ** -8);
    }
    // fp16 overflows to Inf (the loss scaler's business), bf16 keeps the range
    const big = new Float32Array([1e5, -1e5, 3e38]);
    const s16 = slot(fp, 3);
    fp.encode(big, s16);
    expect([...decoded(fp, s16, 3)]).toEqual([Infinity, -Infinity, Infinity]);
  });

  test("int8: a power-of-two scale per block, and |x - decoded| <= scale/2 < max|x|/127", () => {
    const block = 1000;
    const codec = new Codec({ kind: "int8" }, block);
    const x = gradients(new Rng(2), n);
    x.fill(0, 3000, 4000); // an all-zero block
    const s = slot(codec, n);
    codec.encode(x, s);
    const scales = new Float32Array(s.buffer, 0, Math.ceil(n / block));
    const d = decoded(codec, s, n);
    for (let b = 0; b < scales.length; b++) {
      const part = x.subarray(b * block, (b + 1) * block);
      const amax = part.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
      const scale = scales[b]!;
      if (amax === 0) {
        expect(scale).toBe(0);
        continue;
      }
      expect(Number.isInteger(Math.log2(scale))).toBe(true);
      expect(scale).toBeGreaterThanOrEqual(amax / 127);
      expect(scale).toBeLessThan((2 * amax) / 127);
      for (let i = b * block; i < Math.min(n, (b + 1) * block); i++) {
        const err = Math.abs(x[i]! - d[i]!);
        expect(err).toBeLessThanOrEqual(scale / 2);
        expect(err).toBeLessThan(amax / 127);
      }
    }
    // a block with a NaN or Inf is marked (scale NaN) and decodes to NaN: the overflow is seen
    x[5] = Infinity;
    codec.encode(x, s);
    const d2 = decoded(codec, s, n);
    expect(Number.isNaN(d2[0]!)).toBe(true);
    expect(Number.isFinite(d2[block]!)).toBe(true);
  });

  test("top-k keeps the k largest magnitudes, indices ascending, ties to the lowest index", () => {
    const codec = new Codec({ kind: "topk", fraction: 0.01 });
    const x = gradients(new Rng(3), n);
    const k = codec.keep(n);
    expect(k).toBe(Math.ceil(0.01 * n));
    expect(codec.slotBytes(n)).toBe(8 * k);
    const s = slot(codec, n);
    codec.encode(x, s);
    const idx = new Uint32Array(s.buffer, 0, k);
    const ref = [...x.keys()].sort((a, b) => Math.abs(x[b]!) - Math.abs(x[a]!) || a - b).slice(0, k);
    expect([...idx]).toEqual(ref.sort((a, b) => a - b));
    const d = decoded(codec, s, n);
    for (let i = 0; i < n; i++) expect(d[i]).toBe(ref.includes(i) ? x[i]! : 0);
    // ties: all equal, the lowest indices win; a NaN is always sent
    const flat = new Float32Array(100).fill(1);
    flat[77] = Number.NaN;
    const c5 = new Codec({ kind: "topk", fraction: 0.05 });
    const s5 = slot(c5, 100);
    c5.encode(flat, s5);
    expect([...new Uint32Array(s5.buffer, 0, 5)]).toEqual([0, 1, 2, 3, 77]);
  });
});

describe("hostile slots", () => {
  test("top-k indices out of range, repeated or descending are refused", () => {
    const codec = new Codec({ kind: "topk", fraction: 0.5 });
    const s = new Uint8Array(codec.slotBytes(4));
    const idx = new Uint32Array(s.buffer, 0, 2);
    for (const bad of [
      [0, 4],
      [1, 1],
      [2, 1],
      [0xffffffff, 0],
    ]) {
      idx.set(bad);
      expect(() => codec.decode(s, new Float32Array(4), true)).toThrow(CompressionError);
    }
    idx.set([1, 3]);
    const out = new Float32Array(4);
    new Float32Array(s.buffer, 8, 2).set([5, 7]);
    codec.decode(s, out, false);
    expect([...out]).toEqual([0, 5, 0, 7]);
  });
  test("int8 scales that are negative or infinite are refused; a slot of the wrong size too", () => {
    const codec = new Codec({ kind: "int8" }, 4);
    const s = new Uint8Array(codec.slotBytes(8));
    const scales = new Float32Array(s.buffer, 0, 2);
    for (const bad of [-1, Infinity]) {
      scales.set([1, bad]);
      expect(() => codec.decode(s, new Float32Array(8), false)).toThrow(CompressionError);
    }
    expect(() => codec.decode(new Uint8Array(4), new Float32Array(8), false)).toThrow(RangeError);
  });
});

describe("error feedback", () => {
  const codecs: Compression[] = [
    { kind: "bf16" },
    { kind: "fp16" },
    { kind: "int8" },
    { kind: "topk", fraction: 0.01 },
  ];
  for (const c of codecs) {
    test(`${c.kind}: sent + residual = gradient + previous residual, exactly in float64, for 30 steps`, () => {
      const n = 5003;
      const codec = new Codec(c, 512);
      const ef = new ErrorFeedback(codec, n);
      const rng = new Rng(7);
      const s = slot(codec, n);
      const sentTotal = new Float64Array(n),
        gradTotal = new Float64Array(n);
      let worst = 0;
      for (let step = 0; step < 30; step++) {
        const g = gradients(rng, n, 1e-3 * (1 + step / 10));
        const before = Float64Array.from(ef.residual);
        const x = g.slice();
        ef.encode(x, s); // x is now g + residual (in f32)
        const sent = decoded(codec, s, n);
        for (let i = 0; i < n; i++) {
          // the compensation is one f32 addition; everything after it is exact
          expect(Math.fround(g[i]! + before[i]!)).toBe(x[i]!);
          expect(sent[i]! + ef.residual[i]!).toBe(x[i]!);
          sentTotal[i]! += sent[i]!;
          gradTotal[i]! += g[i]!;
        }
      }
      // over the steps, what was sent plus what is held equals what was computed, up to the
      // f32 roundings of the compensations (one per step, each <= 2^-24 relative)
      for (let i = 0; i < n; i++) worst = Math.max(worst, Math.abs(sentTotal[i]! + ef.residual[i]! - gradTotal[i]!));
      expect(worst).toBeLessThan(30 * 2 ** -24 * 0.1);
    });
  }

  test("top-k over the whole vector, cut into chunks (parameter-server pushes): sent + residual = x exactly, and the chunks hold every pick", () => {
    const n = 5003,
      chunk = 700;
    const codec = new Codec({ kind: "topk", fraction: 0.01 });
    const ef = new ErrorFeedback(codec, n);
    const rng = new Rng(9);
    for (let step = 0; step < 10; step++) {
      // one chunk's gradients 100x the others': the picks go there, not 1% to every chunk
      const g = gradients(rng, n);
      for (let i = 1400; i < 2100; i++) g[i]! *= 100;
      const x = g.slice();
      const sel = ef.selectTopK(x);
      expect(sel.idx.length).toBe(codec.keep(n));
      const sent = new Float32Array(n);
      let nnz = 0;
      for (let at = 0; at < n; at += chunk) {
        const count = Math.min(chunk, n - at);
        const c = topKChunk(sel, at / chunk, at, count);
        nnz += c.nnz!;
        decodeChunk(c, sent.subarray(at, at + count));
        if (step === 0 && at !== 1400) expect(c.nnz).toBe(0);
      }
      expect(nnz).toBe(sel.idx.length);
      for (let i = 0; i < n; i++) expect(sent[i]! + ef.residual[i]!).toBe(x[i]!);
    }
    expect(() => ef.selectTopK(new Float32Array(n - 1))).toThrow(RangeError);
    expect(() => new Codec({ kind: "int8" }).selectTopK(new Float32Array(4))).toThrow(RangeError);
  });

  test("a step that overflows leaves no poisoned residual, and the residual follows the loss scale", () => {
    const codec = new Codec({ kind: "bf16" });
    const ef = new ErrorFeedback(codec, 3);
    const s = slot(codec, 3);
    ef.encode(new Float32Array([1.00390625 + 2 ** -12, Infinity, Number.NaN]), s);
    expect([...ef.residual].map((v) => Number.isFinite(v))).toEqual([true, true, true]);
    expect(ef.residual[0]).not.toBe(0);
    const r0 = ef.residual[0]!;
    ef.rescale(0.5);
    expect(ef.residual[0]).toBe(r0 / 2);
  });

  test("top-k warms up with the learning rate: dense at step 0, f^(step/warmup) in between, f from the warm-up's end", () => {
    const codec = new Codec({ kind: "topk", fraction: 0.01 });
    const at = (step: number) => {
      codec.atStep(step, 100);
      return codec.keep(10_000);
    };
    expect(at(0)).toBe(10_000);
    expect(at(50)).toBe(1000); // 0.01^0.5
    expect(at(100)).toBe(100);
    expect(at(5000)).toBe(100);
    codec.atStep(3, 0);
    expect(codec.keep(10_000)).toBe(100);
    expect(codec.slotBytes(10_000)).toBe(800);
  });

  test("density counts the entries a summed top-k bucket holds", () => {
    expect(density(new Float32Array([0, 1, 0, 2]))).toBe(0.5);
    expect(density(new Float32Array(0))).toBe(0);
  });
});
