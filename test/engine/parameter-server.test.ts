// The parameter-server algorithm without its service: a shard's arithmetic (ShardOptimizer)
// against a float64 reference, and a trainer's push encoding (PushEncoder) against decoding.
// The protocol around them (versions, clocks, waiting pulls) is test/services/ps-shard.test.ts's.
import { describe, expect, test } from "bun:test";
import { parseCompression } from "../../engine/parallel/compress.ts";
import { decodeGradient, PushEncoder, ShardOptimizer } from "../../engine/parallel/parameter-server.ts";
import { Rng } from "../../engine/rng.ts";
import { cpu, f32, randn, relErr } from "../helpers/numeric.ts";

const chunks = [
  { count: 37, decayCount: 30 },
  { count: 100, decayCount: 0 },
];
const sgd = { kind: "sgd" as const, momentum: 0.9, nesterov: true, weightDecay: 0.01 };

describe("ShardOptimizer", () => {
  test("averages W pushes, clips by the global norm and takes an SGD step per chunk (float64 reference)", () => {
    const rng = new Rng(5);
    const init = chunks.map((c) => randn(rng, c.count));
    const pushes = [0, 1, 2].map(() => chunks.map((c) => randn(rng, c.count, 3)));
    const shard = new ShardOptimizer(cpu(), chunks, sgd, false, (i) => f32(init[i]!));
    for (const [w, push] of pushes.entries()) {
      const { at, nonFinite } = shard.stage(push.map(f32));
      expect(nonFinite).toBe(-1);
      for (const i of chunks.keys()) expect(shard.accumulate(i, at[i]!, 3)).toBe(w === 2);
    }
    const mean = chunks.map((c, i) =>
      Float64Array.from({ length: c.count }, (_, j) => pushes.reduce((s, p) => s + f32(p[i]!)[j]!, 0) / 3),
    );
    const sq = mean.reduce((s, g) => s + g.reduce((a, x) => a + x * x, 0), 0);
    expect(relErr([shard.sumSquares(chunks.keys())], [sq])).toBeLessThan(1e-5);
    const norm = Math.sqrt(sq),
      clip = norm / 2;
    const lr = 0.1;
    for (const i of chunks.keys()) shard.apply(i, lr, 0, { norm, clip });
    for (const [i, c] of chunks.entries()) {
      // first step: buf = g; nesterov p -= lr (g + m buf), g = clipped mean + wd p on the decayed part
      const want = Float64Array.from(init[i]!, (p, j) => {
        const g = (mean[i]![j]! * clip) / (norm + 1e-6) + (j < c.decayCount ? sgd.weightDecay * p : 0);
        return p - lr * (g + sgd.momentum * g);
      });
      const got = new Float32Array(c.count);
      shard.readParams(i, got);
      expect(relErr(got, want)).toBeLessThan(1e-5);
      expect(shard.pending(i)).toBe(0);
    }
    shard.dispose();
  });

  test("names the first pushed gradient that holds NaN or Inf", () => {
    const shard = new ShardOptimizer(cpu(), chunks, sgd, false, (i) => new Float32Array(chunks[i]!.count));
    const good = new Float32Array(37);
    const bad = new Float32Array(100);
    bad[99] = Number.POSITIVE_INFINITY;
    expect(shard.stage([good, bad]).nonFinite).toBe(1);
    expect(shard.stage([good, new Float32Array(100)]).nonFinite).toBe(-1);
    shard.dispose();
  });

  test("a load replaces parameters and optimizer state and drops a pending sum", () => {
    const adamw = { kind: "adamw" as const, beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0 };
    const shard = new ShardOptimizer(cpu(), chunks, adamw, true, (i) => new Float32Array(chunks[i]!.count));
    expect(shard.stateNames).toEqual(["m", "v", "age"]);
    const { at } = shard.stage([new Float32Array(37).fill(1)]);
    shard.accumulate(0, at[0]!, 2);
    expect(shard.pending(0)).toBe(1);
    const p = Float32Array.from({ length: 37 }, (_, j) => j);
    const state = [0, 1, 2].map((k) => new Float32Array(37).fill(k + 0.5));
    shard.load(0, p, state);
    expect(shard.pending(0)).toBe(0);
    const got = new Float32Array(37);
    shard.readParams(0, got);
    expect([...got]).toEqual([...p]);
    expect(shard.readState(0).map((v) => v[0])).toEqual([0.5, 1.5, 2.5]);
    shard.dispose();
  });
});

describe("PushEncoder", () => {
  for (const compress of ["none", "bf16", "int8", "topk:0.1"]) {
    test(`${compress}: what the chunks decode to plus the residual left is the gradient`, () => {
      const rng = new Rng(9);
      const g = f32(randn(rng, 300));
      const x = g.slice();
      const encoder = new PushEncoder(parseCompression(compress), 128, 300);
      encoder.begin(7, x);
      const sent = new Float32Array(300);
      for (const at of [256, 0, 128]) {
        const count = Math.min(128, 300 - at);
        decodeGradient(encoder.chunk(at, count), sent.subarray(at, at + count));
      }
      // the next step adds the residual (what was not sent) into its gradient: with a zero
      // gradient, that is the residual itself
      const next = new Float32Array(300);
      encoder.begin(8, next);
      for (let at = 0; at < 300; at += 128) encoder.chunk(at, Math.min(128, 300 - at));
      const total = Float64Array.from(sent, (s, i) => s + next[i]!);
      expect(relErr(total, g)).toBeLessThan(1e-6);
    });
  }
});
