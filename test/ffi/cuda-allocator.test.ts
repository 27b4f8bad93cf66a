// The caching allocator's policy against a fake raw allocator (no GPU needed): reuse, size
// rounding, the waste bound, out-of-memory retry after emptying the cache, and bad frees.
import { describe, expect, test } from "bun:test";
import { CachingAllocator, roundBlockBytes, type RawDeviceMemory } from "../../ffi/cuda/allocator.ts";
import { OutOfMemoryError } from "../../ffi/errors.ts";

/** A device of `capacity` bytes that hands out increasing fake addresses. */
function fakeDevice(capacity: number) {
  let next = 0x10000;
  let used = 0;
  const live = new Map<number, number>();
  const raw: RawDeviceMemory & { used: () => number; allocs: number; frees: number; syncs: number } = {
    allocs: 0,
    frees: 0,
    syncs: 0,
    used: () => used,
    synchronize() {
      raw.syncs++;
    },
    alloc(bytes) {
      if (used + bytes > capacity) return null;
      const ptr = next;
      next += bytes + 256;
      used += bytes;
      live.set(ptr, bytes);
      raw.allocs++;
      return ptr;
    },
    free(ptr) {
      const bytes = live.get(ptr);
      if (bytes === undefined) throw new Error(`fake device: double free of ${ptr}`);
      live.delete(ptr);
      used -= bytes;
      raw.frees++;
    },
  };
  return raw;
}

describe("roundBlockBytes", () => {
  test.each([
    [0, 512],
    [1, 512],
    [512, 512],
    [513, 1024],
    [1 << 20, 1 << 20],
    [(1 << 20) + 1, 2 << 20],
    [5 << 20, 6 << 20],
  ])("%i -> %i", (bytes, rounded) => {
    expect(roundBlockBytes(bytes)).toBe(rounded);
  });
});

describe("CachingAllocator", () => {
  test("a freed block is reused for a request of the same rounded size, without a raw allocation", () => {
    const dev = fakeDevice(1 << 30);
    const a = new CachingAllocator(dev);
    const x = a.alloc(1000);
    a.free(x.ptr);
    const y = a.alloc(900);
    expect(y.ptr).toBe(x.ptr);
    expect(dev.allocs).toBe(1);
    expect(a.stats).toEqual({
      rawAllocCount: 1,
      rawFreeCount: 0,
      liveBytes: 1024,
      cachedBytes: 0,
      peakReservedBytes: 1024,
      cacheHits: 1,
    });
  });

  test("takes the smallest cached block that fits, never one more than 25% larger", () => {
    const dev = fakeDevice(1 << 30);
    const a = new CachingAllocator(dev);
    const big = a.alloc(64 << 20);
    const small = a.alloc(4096);
    const mid = a.alloc(8192);
    for (const b of [big, small, mid]) a.free(b.ptr);
    expect(a.alloc(4000).ptr).toBe(small.ptr);
    // 8192 is more than 1.25 x 5120: a new block rather than waste
    const fresh = a.alloc(5000);
    expect([big.ptr, mid.ptr]).not.toContain(fresh.ptr);
    expect(a.alloc(60 << 20).ptr).toBe(big.ptr);
  });

  test("out of memory: empties the cache and retries once, then OutOfMemoryError", () => {
    const dev = fakeDevice(10 << 20);
    const a = new CachingAllocator(dev);
    const x = a.alloc(6 << 20);
    a.free(x.ptr); // 6 MiB cached, 4 MiB left on the device
    const y = a.alloc(8 << 20); // fits only once the cache is given back
    expect(dev.frees).toBe(1);
    expect(dev.syncs).toBe(1); // queued kernels may still use the cached block: wait first
    expect(a.stats.cachedBytes).toBe(0);
    expect(() => a.alloc(4 << 20)).toThrow(OutOfMemoryError);
    a.free(y.ptr);
    expect(a.stats.liveBytes).toBe(0);
  });

  test("a steady pattern of allocations stops touching the device after the first round", () => {
    const dev = fakeDevice(1 << 30);
    const a = new CachingAllocator(dev);
    const sizes = [100, 5000, 3 << 20, 777, 1 << 20, 9 << 20];
    for (let round = 0; round < 5; round++) {
      const blocks = sizes.map((s) => a.alloc(s));
      for (const b of blocks) a.free(b.ptr);
    }
    expect(dev.allocs).toBe(sizes.length);
  });

  test("freeing an unknown or already freed pointer is refused", () => {
    const a = new CachingAllocator(fakeDevice(1 << 20));
    const x = a.alloc(10);
    a.free(x.ptr);
    expect(() => a.free(x.ptr)).toThrow(/not a live block/);
    expect(() => a.free(12345)).toThrow(/not a live block/);
  });

  test("invalid sizes are refused", () => {
    const a = new CachingAllocator(fakeDevice(1 << 20));
    for (const bad of [-1, 1.5, NaN, Infinity]) expect(() => a.alloc(bad)).toThrow(RangeError);
  });

  test("releaseAll gives every block back to the device", () => {
    const dev = fakeDevice(1 << 30);
    const a = new CachingAllocator(dev);
    const blocks = [a.alloc(10), a.alloc(1 << 21), a.alloc(3000)];
    a.free(blocks[1]!.ptr);
    a.releaseAll();
    expect(dev.used()).toBe(0);
    expect(a.stats.liveBytes + a.stats.cachedBytes).toBe(0);
  });
});
