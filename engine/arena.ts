// The memory of one forward/backward pass: activations, their gradients, saved statistics and
// every op's scratch. A best-fit free list over a few large backend chunks, so that a tensor's
// memory is reused as soon as it is freed (engine/tensor.ts frees a tensor once its owner has
// dropped it and no recorded backward still needs it), and reset() frees everything at once.
//
// No allocation after the first pass. A pass that does not fit grows the arena by another
// chunk (a quarter of its size, at least). reset() then replays the pass's allocs and frees (recorded as they happened) against
// one unbounded region, and replaces the chunks by one chunk as large as that replay reached,
// if the first chunk is smaller. The allocator's choices depend only on the sequence of allocs
// and frees (best fit among the freed blocks; else the chunk's untouched tail), so the next pass
// of the same shapes makes the same choices and fits that chunk exactly: Backend.stats.allocCount
// stays constant from the second pass on (the tests check this). Passes of other shapes
// (evaluation beside training) grow it once more, to the larger of the two.
import type { Allocation, Backend, Ptr } from "../ffi/backend.ts";
import { OutOfMemoryError } from "../ffi/errors.ts";
import { EngineError } from "./errors.ts";

/** 64 bytes: a cache line, and the alignment AVX-512 loads and cuBLAS like best. */
export const arenaAlignBytes = 64;
/** First chunk size. Large enough for a small model's pass; the arena grows as needed. */
const chunkBytesMin = 16 * 1024 * 1024;
/** A limit on one pass's working memory, so that a runaway shape fails clearly. */
export const arenaBytesMax = 64 * 1024 * 1024 * 1024;

const alignUp = (n: number) => Math.ceil(n / arenaAlignBytes) * arenaAlignBytes;

/** One allocation. Tensors keep it: `freed` makes them stale; `holds` counts who still needs it
 *  (its owner, and each recorded backward that saved it). */
export class ArenaBlock {
  freed = false;
  holds = 1;
  constructor(
    readonly arena: Arena,
    readonly ptr: Ptr,
    readonly bytes: number,
    /** allocation order within the pass (marks compare it) */
    readonly seq: number,
    readonly chunk: number,
    readonly offsetBytes: number,
  ) {}
}

export interface ArenaMark {
  readonly seq: number;
  readonly usedBytes: number;
  readonly generation: number;
}

interface FreeRange {
  offset: number;
  bytes: number;
}

/** A chunk's free space: ranges freed inside it (sorted, coalesced), and its untouched tail. */
class ChunkSpace {
  readonly free: FreeRange[] = [];
  top = 0;
  constructor(readonly bytes: number) {}

  /** Takes `size` bytes at the start of free range i. */
  take(i: number, size: number): number {
    const r = this.free[i]!;
    const offset = r.offset;
    r.offset += size;
    r.bytes -= size;
    if (r.bytes === 0) this.free.splice(i, 1);
    return offset;
  }

  give(offset: number, size: number): void {
    let i = 0;
    while (i < this.free.length && this.free[i]!.offset < offset) i++;
    const prev = this.free[i - 1];
    const next = this.free[i];
    if (prev !== undefined && prev.offset + prev.bytes === offset) {
      prev.bytes += size;
      if (next !== undefined && prev.offset + prev.bytes === next.offset) {
        prev.bytes += next.bytes;
        this.free.splice(i, 1);
      }
    } else if (next !== undefined && offset + size === next.offset) {
      next.offset = offset;
      next.bytes += size;
    } else {
      this.free.splice(i, 0, { offset, bytes: size });
    }
    // a free range that reaches the tail becomes tail again
    const last = this.free[this.free.length - 1];
    if (last !== undefined && last.offset + last.bytes === this.top) {
      this.top = last.offset;
      this.free.pop();
    }
  }
}

/** The best-fit choice over chunks: the smallest freed range that holds `size` (first chunk,
 *  lowest offset on ties), else the first tail that does; null when none does. */
function place(spaces: readonly ChunkSpace[], size: number): { chunk: number; range: number } | null {
  let best: { chunk: number; range: number } | null = null;
  let bestBytes = Infinity;
  spaces.forEach((s, c) => {
    s.free.forEach((r, i) => {
      if (r.bytes >= size && r.bytes < bestBytes) {
        best = { chunk: c, range: i };
        bestBytes = r.bytes;
      }
    });
  });
  if (best !== null) return best;
  const c = spaces.findIndex((s) => s.top + size <= s.bytes);
  return c < 0 ? null : { chunk: c, range: -1 };
}

/** Runs the allocator's choices over a recorded pass in one unbounded chunk: the bytes it reached. */
function replayExtent(events: readonly number[]): number {
  const space = new ChunkSpace(Infinity);
  const offsets: number[] = [];
  const sizes: number[] = [];
  let extent = 0;
  for (const e of events) {
    if (e >= 0) {
      const at = place([space], e)!;
      const offset = at.range >= 0 ? space.take(at.range, e) : space.top;
      if (at.range < 0) space.top += e;
      offsets.push(offset);
      sizes.push(e);
      extent = Math.max(extent, space.top);
    } else {
      const k = -e - 1;
      space.give(offsets[k]!, sizes[k]!);
    }
  }
  return extent;
}

export class Arena {
  readonly #backend: Backend;
  #chunks: Allocation[] = [];
  #spaces: ChunkSpace[] = [];
  /** this pass's allocs (their sizes) and frees (-(k + 1) for the k-th alloc), for reset()'s replay */
  #events: number[] = [];
  #live = new Map<number, ArenaBlock>();
  #seq = 0;
  #marks: number[] = [];
  #usedBytes = 0;
  #highWaterBytes = 0;
  #passPeakBytes = 0;
  /** bumped by every reset(); tensors remember the generation they were allocated in */
  generation = 0;
  /** called with each block as it is freed (a test context poisons it) */
  onFree: ((block: ArenaBlock) => void) | null = null;

  constructor(backend: Backend) {
    this.#backend = backend;
  }

  /** The most bytes in use at once in any pass so far. */
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
  /** Backend memory the arena holds (peak plus what fragmentation costs). */
  get capacityBytes(): number {
    return this.#chunks.reduce((sum, c) => sum + c.bytes, 0);
  }

  /** Memory until it is freed, or until reset() or the release of a mark made before it. */
  allocBlock(bytes: number): ArenaBlock {
    const size = alignUp(Math.max(bytes, 1));
    if (this.#usedBytes + size > arenaBytesMax) throw new OutOfMemoryError("arena", this.#usedBytes + size);
    let at = place(this.#spaces, size);
    if (at === null) {
      // a quarter of what it holds: the first pass reserves at most about 1.25x its peak (doubling
      // reserved up to 2x, which on a GPU is memory other work cannot have)
      const grow = Math.max(size, chunkBytesMin, alignUp(this.capacityBytes / 4));
      this.#chunks.push(this.#backend.alloc(grow));
      this.#spaces.push(new ChunkSpace(grow));
      at = { chunk: this.#chunks.length - 1, range: -1 };
    }
    const space = this.#spaces[at.chunk]!;
    let offset: number;
    if (at.range >= 0) offset = space.take(at.range, size);
    else {
      offset = space.top;
      space.top += size;
    }
    const block = new ArenaBlock(this, this.#chunks[at.chunk]!.ptr + offset, size, this.#seq++, at.chunk, offset);
    this.#events.push(size);
    this.#live.set(block.seq, block);
    this.#usedBytes += size;
    this.#passPeakBytes = Math.max(this.#passPeakBytes, this.#usedBytes);
    this.#highWaterBytes = Math.max(this.#highWaterBytes, this.#usedBytes);
    return block;
  }

  alloc(bytes: number): Ptr {
    return this.allocBlock(bytes).ptr;
  }

  /** Zeroed memory. */
  allocZeroed(bytes: number): Ptr {
    const ptr = this.alloc(bytes);
    this.#backend.zero(ptr, alignUp(Math.max(bytes, 1)));
    return ptr;
  }

  /** Gives a block back now; what lives in it must be dead. */
  free(block: ArenaBlock): void {
    if (block.arena !== this) throw new EngineError("arena: a block of another arena cannot be freed here");
    if (block.freed) return;
    if (!this.#live.delete(block.seq)) throw new EngineError("arena: a block of an earlier pass cannot be freed");
    this.onFree?.(block);
    block.freed = true;
    this.#spaces[block.chunk]!.give(block.offsetBytes, block.bytes);
    this.#events.push(-block.seq - 1);
    this.#usedBytes -= block.bytes;
  }

  /** Where the next allocation goes: release(mark) frees everything allocated after it. */
  mark(): ArenaMark {
    this.#marks.push(this.#seq);
    return { seq: this.#seq, usedBytes: this.#usedBytes, generation: this.generation };
  }

  /**
   * Frees everything allocated since `mark` that is still live (marks are released newest
   * first). What lives in that memory must be dead: activation recomputation (Context.recompute)
   * releases a block's recomputed activations once its backward has run.
   */
  release(mark: ArenaMark): void {
    const at = this.#marks.lastIndexOf(mark.seq);
    if (mark.generation !== this.generation || at < 0) {
      throw new EngineError("arena: a mark of another pass, or one already released, cannot be released");
    }
    this.#marks.length = at;
    for (const block of [...this.#live.values()]) if (block.seq >= mark.seq) this.free(block);
  }

  reset(): void {
    for (const block of this.#live.values()) block.freed = true;
    if (this.#chunks.length > 1) {
      // one chunk in which this pass's sequence fits exactly, and never smaller than the first
      // (which other passes of the context fit)
      const bytes = Math.max(replayExtent(this.#events), this.#chunks[0]!.bytes);
      for (const c of this.#chunks) this.#backend.free(c);
      // a backend that caches freed memory (CUDA) gives the old chunks back before the one that
      // replaces them is made: it could not reuse them for it, and would hold both
      this.#backend.emptyCache();
      this.#chunks = [this.#backend.alloc(bytes)];
    }
    this.#spaces = this.#chunks.map((c) => new ChunkSpace(c.bytes));
    this.#events = [];
    this.#live.clear();
    this.#marks = [];
    this.#seq = 0;
    this.#usedBytes = 0;
    this.#passPeakBytes = 0;
    this.generation++;
  }

  dispose(): void {
    for (const block of this.#live.values()) block.freed = true;
    for (const c of this.#chunks) this.#backend.free(c);
    this.#chunks = [];
    this.#spaces = [];
    this.#events = [];
    this.#live.clear();
    this.generation++;
  }
}
