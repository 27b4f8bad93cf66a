// A caching allocator for device memory. cuMemAlloc/cuMemFree are slow (cuMemFree
// synchronizes the whole device), so freed blocks are kept and handed out again, as PyTorch's
// CUDACachingAllocator does:
//   - sizes are rounded up: to 512 B below 1 MiB, to 2 MiB above (fewer distinct sizes, more reuse)
//   - a request takes the smallest cached block that fits and wastes at most a quarter of it
//     (a 1 GiB block is not spent on a 4 KiB tensor)
//   - when the device is out of memory, every cached block is released and the request tried
//     once more before OutOfMemoryError.
// Blocks are never split. All work runs on one stream, so a block freed while kernels that
// use it are still queued can be reused at once: later work on the same stream runs after them.
//
// The raw allocator is injected, so the policy is unit-tested without a GPU.
import type { Ptr } from "../backend.ts";
import { OutOfMemoryError } from "../errors.ts";

export interface RawDeviceMemory {
  /** null when the device is out of memory; other failures throw */
  alloc(bytes: number): Ptr | null;
  free(ptr: Ptr): void;
  /** wait for all queued work: called before cached blocks go back to the device, since
   *  kernels still queued may use them (a block is cached as soon as the engine frees it) */
  synchronize(): void;
}

export const smallBlockBytesMax = 1 << 20;
const smallRoundBytes = 512;
const largeRoundBytes = 2 << 20;
/** a cached block may be at most this much larger than the rounded request */
const reuseSlack = 1.25;

export function roundBlockBytes(bytes: number): number {
  const b = Math.max(bytes, 1);
  const unit = b <= smallBlockBytesMax ? smallRoundBytes : largeRoundBytes;
  return Math.ceil(b / unit) * unit;
}

export interface CachingAllocatorStats {
  /** cuMemAlloc calls that succeeded */
  readonly rawAllocCount: number;
  readonly rawFreeCount: number;
  /** bytes handed out and not yet freed (rounded block sizes) */
  readonly liveBytes: number;
  /** bytes held in the cache, free for reuse */
  readonly cachedBytes: number;
  readonly peakReservedBytes: number;
  readonly cacheHits: number;
}

export class CachingAllocator {
  readonly #raw: RawDeviceMemory;
  /** live blocks: ptr -> rounded size */
  readonly #live = new Map<Ptr, number>();
  /** cached free blocks, sorted by size ascending */
  #free: { ptr: Ptr; bytes: number }[] = [];
  #rawAllocCount = 0;
  #rawFreeCount = 0;
  #liveBytes = 0;
  #cachedBytes = 0;
  #peakReservedBytes = 0;
  #cacheHits = 0;

  constructor(
    raw: RawDeviceMemory,
    readonly backendName = "cuda",
  ) {
    this.#raw = raw;
  }

  get stats(): CachingAllocatorStats {
    return {
      rawAllocCount: this.#rawAllocCount,
      rawFreeCount: this.#rawFreeCount,
      liveBytes: this.#liveBytes,
      cachedBytes: this.#cachedBytes,
      peakReservedBytes: this.#peakReservedBytes,
      cacheHits: this.#cacheHits,
    };
  }

  /** Returns the block's address and its rounded size. */
  alloc(bytes: number): { ptr: Ptr; bytes: number } {
    if (!Number.isSafeInteger(bytes) || bytes < 0) throw new RangeError(`alloc: invalid byte count ${bytes}`);
    const size = roundBlockBytes(bytes);
    const cached = this.#takeCached(size);
    if (cached !== null) {
      this.#cacheHits++;
      return this.#markLive(cached.ptr, cached.bytes);
    }
    let ptr = this.#raw.alloc(size);
    if (ptr === null && this.#free.length > 0) {
      this.emptyCache();
      ptr = this.#raw.alloc(size);
    }
    if (ptr === null) throw new OutOfMemoryError(this.backendName, size);
    this.#rawAllocCount++;
    const block = this.#markLive(ptr, size);
    this.#peakReservedBytes = Math.max(this.#peakReservedBytes, this.#liveBytes + this.#cachedBytes);
    return block;
  }

  free(ptr: Ptr): void {
    const bytes = this.#live.get(ptr);
    if (bytes === undefined) throw new Error(`free: ${ptr} is not a live block of this allocator`);
    this.#live.delete(ptr);
    this.#liveBytes -= bytes;
    this.#insertFree({ ptr, bytes });
    this.#cachedBytes += bytes;
  }

  /** Give every cached block back to the device. */
  emptyCache(): void {
    if (this.#free.length === 0) return;
    this.#raw.synchronize();
    for (const b of this.#free) {
      this.#raw.free(b.ptr);
      this.#rawFreeCount++;
    }
    this.#free = [];
    this.#cachedBytes = 0;
  }

  /** Free everything, live blocks included (backend dispose). */
  releaseAll(): void {
    this.#raw.synchronize();
    for (const ptr of this.#live.keys()) {
      this.#raw.free(ptr);
      this.#rawFreeCount++;
    }
    this.#live.clear();
    this.#liveBytes = 0;
    this.emptyCache();
  }

  #markLive(ptr: Ptr, bytes: number): { ptr: Ptr; bytes: number } {
    this.#live.set(ptr, bytes);
    this.#liveBytes += bytes;
    return { ptr, bytes };
  }

  #takeCached(size: number): { ptr: Ptr; bytes: number } | null {
    const i = this.#lowerBound(size);
    const block = this.#free[i];
    if (block === undefined || block.bytes > size * reuseSlack) return null;
    this.#free.splice(i, 1);
    this.#cachedBytes -= block.bytes;
    return block;
  }

  #insertFree(block: { ptr: Ptr; bytes: number }): void {
    this.#free.splice(this.#lowerBound(block.bytes), 0, block);
  }

  /** index of the first cached block with bytes >= size */
  #lowerBound(size: number): number {
    let lo = 0;
    let hi = this.#free.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (this.#free[mid]!.bytes < size) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
}
