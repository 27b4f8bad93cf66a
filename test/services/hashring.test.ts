// How a job's parameter chunks are spread over the parameter-server shards: the consistent-hash
// ring (services/runtime/job/hashring.ts) and the chunk layout (layout.ts).
import { describe, expect, test } from "bun:test";
import { chunkKey, HashRing } from "../../services/runtime/job/hashring.ts";
import { buildLayout } from "../../services/runtime/job/layout.ts";

describe("consistent hashing", () => {
  test("adding a shard moves about 1/(N+1) of the chunks, all to the new shard", () => {
    const keys = Array.from({ length: 20_000 }, (_, i) => chunkKey("job", i));
    for (const n of [2, 4, 8]) {
      const before = new HashRing(Array.from({ length: n }, (_, i) => i));
      const after = new HashRing(Array.from({ length: n + 1 }, (_, i) => i));
      let moved = 0;
      for (const k of keys) {
        const a = before.owner(k),
          b = after.owner(k);
        if (a !== b) {
          moved++;
          expect(b).toBe(n);
        }
      }
      const fraction = moved / keys.length;
      expect(Math.abs(fraction - 1 / (n + 1))).toBeLessThan(0.35 / (n + 1));
    }
  });

  test("load is spread evenly and the ring is the same in every process", () => {
    const ring = new HashRing([0, 1, 2, 3]);
    const counts = [0, 0, 0, 0];
    for (let i = 0; i < 40_000; i++) counts[ring.owner(chunkKey("j", i))]!++;
    for (const c of counts) expect(Math.abs(c - 10_000)).toBeLessThan(2_000);
    expect(new HashRing([3, 1, 2, 0]).owner("x/params/5")).toBe(ring.owner("x/params/5"));
    expect(() => new HashRing([])).toThrow(RangeError);
    expect(() => new HashRing([1, 1])).toThrow("repeat");
  });

  test("the layout covers the vector once, splits the decay boundary, and assigns every chunk", () => {
    const l = buildLayout("j", 10_000, 4_100, 4096, 3);
    expect(l.chunks.map((c) => c.count).reduce((a, b) => a + b)).toBe(10_000);
    expect(l.chunks.map((c) => c.decayCount)).toEqual([1024, 1024, 1024, 1024, 4, 0, 0, 0, 0, 0]);
    expect(l.byShard.flat().sort((a, b) => a - b)).toEqual(l.chunks.map((c) => c.id));
  });
});
