// The CUDA backend on a real GPU: memory, copies, the caching allocator, out-of-memory, the
// numbers that come back to JavaScript, event polling, and generation with the KV cache. Skips
// with one line without a GPU (the same code runs over a fake driver in cuda-driver.test.ts and
// on the host emulator in cuda-emulated-training.test.ts there).
import { afterAll, describe, expect, test } from "bun:test";
import { CudaBackend, probeCuda } from "../../ffi/cuda/backend.ts";
import { OutOfMemoryError } from "../../ffi/errors.ts";
import { expectCachedGeneration } from "../helpers/generation.ts";
import { skip } from "../helpers/skip.ts";

const probe = probeCuda();

let be: CudaBackend | undefined;
const backend = () => (be ??= new CudaBackend());
afterAll(() => be?.dispose());

describe.skipIf(skip("a GPU", probe.ok ? null : probe.reason))("CUDA backend on the GPU", () => {
  test("upload, copy, zero, fill and download move exactly the bytes asked, at any offset", () => {
    const b = backend();
    const n = (5 << 20) + 3; // past the first staging buffer, odd length
    const a = b.alloc(n * 4);
    const c = b.alloc(n * 4);
    const src = Float32Array.from({ length: n }, (_, i) => (i % 9973) - 4000.5);
    b.upload(a.ptr, src);
    b.copy(c.ptr, a.ptr, n * 4);
    b.zero(c.ptr + 4 * 10, 4 * 5);
    b.fill(c.ptr + 4 * 100, 7, -2.25);
    const out = new Float32Array(n);
    b.download(c.ptr, out);
    const want = Float32Array.from(src);
    want.fill(0, 10, 15);
    want.fill(-2.25, 100, 107);
    expect(out).toEqual(want);
    b.free(a);
    b.free(c);
  });

  test("alloc returns zeroed memory, also when it reuses a cached block", () => {
    const b = backend();
    const a = b.alloc(4096);
    b.fill(a.ptr, 1024, 3);
    b.free(a);
    const again = b.alloc(4096);
    const out = new Float32Array(1024);
    b.download(again.ptr, out);
    expect(out.every((x) => x === 0)).toBe(true);
    b.free(again);
  });

  test("numbers returned to JavaScript: sumSquares, countNonFinite, invalid ids and targets", () => {
    const b = backend();
    const n = 100_003;
    const x = b.alloc(n * 4);
    const data = Float32Array.from({ length: n }, (_, i) => ((i % 7) - 3) * 0.5);
    b.upload(x.ptr, data);
    const want = data.reduce((s, v) => s + v * v, 0);
    expect(Math.abs(b.sumSquares(x.ptr, n) - want) / want).toBeLessThan(1e-6);
    expect(b.countNonFinite(x.ptr, n)).toBe(0);
    b.upload(x.ptr + 4 * 17, Float32Array.of(NaN, Infinity, -Infinity));
    expect(b.countNonFinite(x.ptr, n)).toBe(3);
    const ids = b.alloc(4 * 4);
    b.upload(ids.ptr, Int32Array.of(0, 5, -1, 9));
    const table = b.alloc(10 * 2 * 4);
    const out = b.alloc(4 * 2 * 4);
    expect(b.embeddingForward(out.ptr, ids.ptr, table.ptr, 4, 2, 6)).toBe(2);
    for (const a of [x, ids, table, out]) b.free(a);
  });

  test("a request larger than the device is OutOfMemoryError, and the backend keeps working", () => {
    const b = backend();
    expect(() => b.alloc(2 ** 50)).toThrow(OutOfMemoryError);
    const a = b.alloc(1024);
    b.free(a);
  });

  test("whenIdle polls an event: timers keep firing while the GPU works", async () => {
    const b = backend();
    const n = 64 << 20;
    const a = b.alloc(n * 4);
    // ~35 ms of queued work on an H100 (200 passes over 256 MB): still running at the first poll
    for (let i = 0; i < 200; i++) b.scale(a.ptr, n, 1.0001);
    let ticks = 0;
    const timer = setInterval(() => ticks++, 0);
    await b.whenIdle();
    clearInterval(timer);
    // a blocking wait would have let no timer run before it returned
    expect(ticks).toBeGreaterThan(0);
    b.free(a);
  });

  test("the device's name is reported and the allocator counts cache hits", () => {
    const b = backend();
    expect(b.deviceName.length).toBeGreaterThan(0);
    const before = b.allocatorStats.cacheHits;
    b.free(b.alloc(777));
    b.free(b.alloc(777));
    expect(b.allocatorStats.cacheHits).toBeGreaterThan(before);
  });

  test("gpt generation with the KV cache (attentionDecode on the GPU): the tokens of the whole window's forward, its logits to rounding", () => {
    expectCachedGeneration(backend());
  });
});
