// A bump allocator over backend memory for everything that lives for one forward/backward
// pass: activations, their gradients, saved statistics. reset() makes all of it reusable.
//
// The first pass may need several chunks; reset() then replaces them with one chunk as large
// as the high-water mark, so every later pass of the same shapes runs without allocating
// (Backend.stats.allocCount stays constant; the tests check this).
import type { Allocation, Backend, Ptr } from "../ffi/backend.ts";
import { OutOfMemoryError } from "../ffi/errors.ts";
import { EngineError } from "./errors.ts";

/** 64 bytes: a cache line, and the alignment AVX-512 loads and cuBLAS like best. */
export const arenaAlignBytes = 64;
/** First chunk size. Large enough for a small model's pass; the arena grows as needed. */
const chunkBytesMin = 16 * 1024 * 1024;
/** A limit on one pass's working memory, so that a runaway shape fails clearly. */
export const arenaBytesMax = 64 * 1024 * 1024 * 1024;

export interface ArenaMark {
  readonly chunkIndex: number;
  readonly offsetBytes: number;
  readonly usedBytes: number;
  readonly generation: number;
}

const alignUp = (n: number) => Math.ceil(n / arenaAlignBytes) * arenaAlignBytes;

export class Arena {
  readonly #backend: Backend;
  #chunks: Allocation[] = [];
  #chunkIndex = 0;
  #offsetBytes = 0;
  #usedBytes = 0;
  #highWaterBytes = 0;
  #passPeakBytes = 0;
  /** bumped by every reset(); tensors remember the generation they were allocated in */
  generation = 0;

  constructor(backend: Backend) {
    this.#backend = backend;
  }

  get highWaterBytes(): number {
    return this.#highWaterBytes;
  }
  /** The most bytes in use at once since the last reset(): one pass's peak working memory. */
  get passPeakBytes(): number {
    return this.#passPeakBytes;
  }
  get usedBytes(): number {
    return this.#usedBytes;
  }
  get capacityBytes(): number {
    return this.#chunks.reduce((sum, c) => sum + c.bytes, 0);
  }

  alloc(bytes: number): Ptr {
    const size = alignUp(Math.max(bytes, 1));
    for (;;) {
      const chunk = this.#chunks[this.#chunkIndex];
      if (chunk !== undefined && this.#offsetBytes + size <= chunk.bytes) {
        const ptr = chunk.ptr + this.#offsetBytes;
        this.#offsetBytes += size;
        this.#usedBytes += size;
        this.#passPeakBytes = Math.max(this.#passPeakBytes, this.#usedBytes);
        this.#highWaterBytes = Math.max(this.#highWaterBytes, this.#usedBytes);
        return ptr;
      }
      if (chunk !== undefined && this.#chunkIndex + 1 < this.#chunks.length) {
        this.#chunkIndex++;
        this.#offsetBytes = 0;
        continue;
      }
      if (this.#usedBytes + size > arenaBytesMax) throw new OutOfMemoryError("arena", this.#usedBytes + size);
      this.#chunks.push(this.#backend.alloc(Math.max(size, chunkBytesMin, this.capacityBytes)));
      this.#chunkIndex = this.#chunks.length - 1;
      this.#offsetBytes = 0;
    }
  }

  /** Zeroed memory. */
  allocZeroed(bytes: number): Ptr {
    const ptr = this.alloc(bytes);
    this.#backend.zero(ptr, alignUp(Math.max(bytes, 1)));
    return ptr;
  }

  /** Where the next allocation goes: release(mark) frees everything allocated after it. */
  mark(): ArenaMark {
    return { chunkIndex: this.#chunkIndex, offsetBytes: this.#offsetBytes, usedBytes: this.#usedBytes, generation: this.generation };
  }

  /**
   * Frees everything allocated since `mark` (a stack: marks are released newest first). What
   * lives in that memory must be dead: activation recomputation (engine/recompute.ts) releases a
   * block's recomputed activations once its backward has run.
   */
  release(mark: ArenaMark): void {
    if (mark.generation !== this.generation || mark.usedBytes > this.#usedBytes) {
      throw new EngineError("arena: a mark of another pass, or one already released, cannot be released");
    }
    this.#chunkIndex = mark.chunkIndex;
    this.#offsetBytes = mark.offsetBytes;
    this.#usedBytes = mark.usedBytes;
  }

  reset(): void {
    if (this.#chunks.length > 1) {
      // consolidate: one chunk that holds the whole high-water mark
      for (const c of this.#chunks) this.#backend.free(c);
      this.#chunks = [this.#backend.alloc(this.#highWaterBytes)];
    }
    this.#chunkIndex = 0;
    this.#offsetBytes = 0;
    this.#usedBytes = 0;
    this.#passPeakBytes = 0;
    this.generation++;
  }

  dispose(): void {
    for (const c of this.#chunks) this.#backend.free(c);
    this.#chunks = [];
    this.generation++;
  }
}
