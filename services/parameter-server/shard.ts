// One parameter-server shard of one job: the protocol around the chunks the hash ring gives it
// (the sync policy, versions, clocks, duplicate detection, snapshots); their parameters, optimizer
// state and arithmetic are the engine's ShardOptimizer (engine/parallel/parameter-server.ts). No
// NATS here: service.ts maps subjects to these methods.
//
// Versions: a chunk's version is the number of optimizer updates applied to it. Clocks: a
// trainer's clock on this shard is the number of steps it has pushed completely (every chunk
// this shard owns). Pull for step s waits until
//   BSP: every requested chunk has version >= s (the aggregated updates of steps < s applied),
//   SSP: the slowest trainer's clock >= s - staleness,
//   ASP: never.
// Global-norm clipping (gradClip > 0) under BSP: a step's averaged gradient is spread over the
// shards, so its norm is agreed before anyone applies it. Once every chunk of this shard has
// all W pushes of step s, the shard computes its part of the sum of squares, learns the other
// shards' parts (`agreeNorm`: service.ts asks them over `ps.<k>.norm`), scales by
// gradClip / (norm + 1e-6) when the norm exceeds gradClip, and applies. (ASP and SSP apply
// each push as it comes: there the trainer clips its own gradient, whose norm is the global
// norm of that update.)
import type { Backend } from "../../ffi/backend.ts";
import {
  DType,
  type Chunk,
  type ChunkState,
  encodePullReply,
  type PushReply,
  type PushRequest,
  type ShardState,
  shardStateChecksum,
  withChecksum,
} from "../../schemas/messages/parameter-server.ts";
import { cutShardState } from "../runtime/job/replica-parts.ts";
import { parseCompression } from "../../engine/parallel/compress.ts";
import { ShardOptimizer } from "../../engine/parallel/parameter-server.ts";
import { decodeChunk, fillParams, pushDType } from "../runtime/transport/chunk-codec.ts";
import { BadRequestError, DeadlineError, LimitExceededError } from "../runtime/mesh/errors.ts";
import { type JobConfig, lrAt, shardsClip } from "../runtime/job/config.ts";
import { worldOf } from "../runtime/job/world.ts";
import type { ChunkInfo, Layout } from "../runtime/job/layout.ts";
import { pullWaitersMax, pullWaitMsMax } from "./limits.ts";
import { implausibleStateText, plausibleState } from "../runtime/job/limits.ts";

interface ChunkSlot {
  info: ChunkInfo;
  /** this chunk's number in the shard's ShardOptimizer */
  index: number;
  version: number;
  /** highest step each trainer pushed for this chunk (-1: none) */
  lastStep: Float64Array;
}

interface Waiter {
  trainer: number;
  step: number;
  ids: Uint32Array;
  dtype: DType;
  ready: () => boolean;
  resolve: (r: Uint8Array) => void;
  reject: (e: Error) => void;
  timer: ReturnType<typeof setTimeout>;
}

const sameIds = (a: Uint32Array, b: Uint32Array): boolean => a.length === b.length && a.every((x, i) => x === b[i]);

export interface ShardOptions {
  backend: Backend;
  config: JobConfig;
  layout: Layout;
  shard: number;
  /** optimizer steps the schedule runs over */
  totalSteps: number;
  /** the job's initial flat parameter vector (each shard keeps its chunks) */
  initial: Float32Array;
  /** BSP with gradClip: the global norm of step `step`'s averaged gradient, given this shard's
   *  sum of squares (absent: this shard is the only one that owns chunks) */
  agreeNorm?: (step: number, sumSquares: number) => Promise<number>;
}

export class ParameterShard {
  readonly job: string;
  readonly shard: number;
  readonly ids: readonly number[];
  #updates = 0;
  readonly #cfg: JobConfig;
  readonly #slots = new Map<number, ChunkSlot>();
  /** the chunks' parameters, optimizer state and arithmetic */
  readonly #math: ShardOptimizer;
  /** the optimizer math of the last push, until it runs (see flush) */
  #deferred: (() => void) | null = null;
  readonly #clock: Float64Array;
  /** per trainer: step -> chunks of this shard received for it */
  readonly #received: Map<number, number>[];
  readonly #waiters = new Set<Waiter>();
  readonly #lr: (step: number) => number;
  #disposed = false;
  /** the chunk dtype this job's compression pushes (F32 is always accepted) */
  readonly #pushDType: DType;
  readonly #agreeNorm: ShardOptions["agreeNorm"];
  /** BSP clipping: chunks whose averaged gradient of the current step waits for the global norm */
  readonly #clipWait = new Set<ChunkSlot>();
  /** BSP clipping: this shard's sum of squares per recent step, and who waits for one */
  readonly #partials = new Map<number, number>();
  readonly #partialWaiters = new Map<number, { wake: (v: number) => void; fail: (e: Error) => void }[]>();
  /** bumped by a restore: a norm agreed for the state before it is dropped */
  #epoch = 0;
  readonly #totalSteps: number;

  constructor(o: ShardOptions) {
    this.#totalSteps = o.totalSteps;
    this.job = o.config.job;
    this.shard = o.shard;
    this.#cfg = o.config;
    const compression = parseCompression(o.config.compress);
    this.#pushDType = pushDType(compression);
    this.ids = o.layout.byShard[o.shard] ?? [];
    const W = o.config.trainers;
    const infos = this.ids.map((id) => o.layout.chunks[id]!);
    infos.forEach((info, index) =>
      this.#slots.set(info.id, { info, index, version: 0, lastStep: new Float64Array(W).fill(-1) }),
    );
    this.#math = new ShardOptimizer(o.backend, infos, o.config.optimizer, compression.kind === "topk", (i) =>
      o.initial.subarray(infos[i]!.offset, infos[i]!.offset + infos[i]!.count),
    );
    this.#clock = new Float64Array(W);
    this.#received = Array.from({ length: W }, () => new Map());
    const c = o.config;
    this.#lr = (step) => lrAt(c, o, step);
    this.#agreeNorm = o.agreeNorm;
  }

  /**
   * This shard's sum of squares of step `step`'s averaged gradient (BSP clipping), once every
   * chunk it owns has all the step's pushes; rejected after `waitMs`.
   */
  partialNorm(step: number, waitMs: number): Promise<number> {
    this.flush();
    if (!shardsClip(this.#cfg))
      throw new BadRequestError(`job ${this.job} does not clip on the shards (BSP with gradClip > 0 does)`);
    // pushes come for steps 0 to totalSteps - 1: a norm of the last pull's step would never come
    this.#checkStep(step, "the norm of", this.#totalSteps - 1);
    const known = this.#partials.get(step);
    if (known !== undefined) return Promise.resolve(known);
    const version = Math.min(...[...this.#slots.values()].map((x) => x.version));
    if (step < version - 2)
      throw new BadRequestError(`shard ${this.shard} is at step ${version}; the norm of step ${step} is forgotten`);
    let waiting = 0;
    for (const l of this.#partialWaiters.values()) waiting += l.length;
    if (waiting >= pullWaitersMax)
      throw new LimitExceededError(`${pullWaitersMax} norm requests are waiting on shard ${this.shard} already`);
    return new Promise<number>((resolve, reject) => {
      const list = this.#partialWaiters.get(step) ?? [];
      const w = {
        wake: (v: number) => {
          clearTimeout(timer);
          resolve(v);
        },
        fail: (e: Error) => {
          clearTimeout(timer);
          reject(e);
        },
      };
      const timer = setTimeout(() => {
        const l = this.#partialWaiters.get(step);
        l?.splice(l.indexOf(w) >>> 0, 1);
        if (l?.length === 0) this.#partialWaiters.delete(step);
        reject(new DeadlineError(`shard ${this.shard} has not got every push of step ${step} within ${waitMs} ms`));
      }, waitMs);
      list.push(w);
      this.#partialWaiters.set(step, list);
    });
  }

  /** A step a request names must be one of the job's (a pull or norm of a later one would only wait). */
  #checkStep(step: number, what: string, last = this.#totalSteps): void {
    if (!(Number.isSafeInteger(step) && step >= 0 && step <= last))
      throw new BadRequestError(`${what} step ${step}: job ${this.job} runs steps 0 to ${last}`);
  }

  /** parameters this shard holds */
  get elements(): number {
    let n = 0;
    for (const s of this.#slots.values()) n += s.info.count;
    return n;
  }

  get updates(): number {
    this.flush();
    return this.#updates;
  }

  /** Steps each trainer has pushed completely to this shard. */
  get clocks(): readonly number[] {
    this.flush();
    return [...this.#clock];
  }

  get waiting(): number {
    this.flush();
    return this.#waiters.size;
  }

  /**
   * Runs the optimizer math of the last accepted push, if it has not run yet. A push is
   * answered as soon as it is checked, staged and booked; its math runs right after the reply
   * is flushed (setImmediate), or first thing in the next request, whichever comes first, so
   * every request still sees every push before it fully applied.
   */
  flush(): void {
    const apply = this.#deferred;
    this.#deferred = null;
    apply?.();
  }

  #checkTrainer(trainer: number): void {
    if (!(Number.isInteger(trainer) && trainer >= 0 && trainer < this.#cfg.trainers)) {
      throw new BadRequestError(`trainer ${trainer} is not in job ${this.job} (trainers 0..${this.#cfg.trainers - 1})`);
    }
  }

  #slot(id: number): ChunkSlot {
    const slot = this.#slots.get(id);
    if (!slot) throw new BadRequestError(`chunk ${id} is not owned by shard ${this.shard} of job ${this.job}`);
    return slot;
  }

  /**
   * Applies (or aggregates) one trainer's gradients for some of this shard's chunks. Everything
   * is checked first (metadata, then finiteness on the staged data, natively): a bad push
   * changes nothing.
   */
  push(m: PushRequest): PushReply {
    this.flush(); // the staging memory is about to be reused
    this.#checkTrainer(m.trainer);
    // A trainer pushes its steps in order, each after the last was received whole (its pull of the
    // next step waits for that): a step past its clock is a push sent before a restore that came
    // after the load (its step is the old run's, ahead of the state loaded). Taken, it would be
    // averaged into the restored step's update, and book the trainer's later pushes of the steps
    // up to it as duplicates of one already applied.
    const next = this.#clock[m.trainer]!;
    if (m.step > next)
      throw new BadRequestError(
        `trainer ${m.trainer} pushed step ${m.step} to shard ${this.shard}, whose next step from it is ${next}: a push from before a restore, or out of order; refused`,
      );
    const seen = new Set<number>();
    const fresh: { slot: ChunkSlot; chunk: Chunk }[] = [];
    let duplicates = 0;
    for (const c of m.chunks) {
      const slot = this.#checkChunk(c, m);
      if (seen.has(c.id)) throw new BadRequestError(`chunk ${c.id} appears twice in one push`);
      seen.add(c.id);
      if (slot.lastStep[m.trainer]! >= m.step) {
        duplicates++; // a retried or duplicated push: applied once already
        continue;
      }
      fresh.push({ slot, chunk: c });
    }
    const staged = this.#math.stage(this.#decoded(fresh.map((f) => f.chunk)));
    if (staged.nonFinite >= 0) {
      const bad = fresh[staged.nonFinite]!;
      throw new BadRequestError(
        `chunk ${bad.chunk.id} from trainer ${m.trainer} step ${m.step}: the gradient holds NaN or Inf`,
      );
    }
    const need = this.#cfg.sync === "bsp" ? this.#cfg.trainers : this.#cfg.batchPushes;
    let updates = 0;
    for (const f of fresh) {
      f.slot.lastStep[m.trainer] = m.step; // booked now: a retry of this push is a duplicate
      if (this.#math.pending(f.slot.index) + 1 >= need) updates++;
    }
    this.#deferred = () => {
      fresh.forEach((f, k) => this.#accumulate(f.slot, staged.at[k]!, m.step));
      if (fresh.length > 0) this.#advanceClock(m.trainer, m.step, fresh.length);
      this.#wake();
    };
    setImmediate(() => this.flush());
    return { accepted: fresh.length, duplicates, updates };
  }

  /** host memory compressed chunks are decoded into (grown, never shrunk) */
  #decodeBuffer = new Float32Array(0);

  /** A push's gradients as f32: F32 chunks' bytes as they came, compressed ones decoded on the host. */
  #decoded(chunks: readonly Chunk[]): (Float32Array | Uint8Array)[] {
    const compressed = chunks.reduce((n, c) => n + (c.dtype === DType.F32 ? 0 : c.count), 0);
    if (this.#decodeBuffer.length < compressed) this.#decodeBuffer = new Float32Array(compressed);
    let at = 0;
    return chunks.map((c) => {
      if (c.dtype === DType.F32) return c.data;
      const out = this.#decodeBuffer.subarray(at, (at += c.count));
      decodeChunk(c, out);
      return out;
    });
  }

  #checkChunk(c: Chunk, m: PushRequest): ChunkSlot {
    const slot = this.#slot(c.id);
    if (c.dtype !== DType.F32 && c.dtype !== this.#pushDType) {
      const also = this.#pushDType === DType.F32 ? "" : ` or ${DType[this.#pushDType]}`;
      throw new BadRequestError(
        `chunk ${c.id}: dtype ${DType[c.dtype] ?? c.dtype} is not accepted by this job (compress ${this.#cfg.compress}: F32${also})`,
      );
    }
    if (c.count !== slot.info.count)
      throw new BadRequestError(`chunk ${c.id} has ${c.count} elements, the layout says ${slot.info.count}`);
    // under BSP a trainer pulls step s (which waits for the update of s-1) before it pushes s
    if (this.#cfg.sync === "bsp" && slot.lastStep[m.trainer]! < m.step && m.step !== slot.version) {
      throw new BadRequestError(`push for step ${m.step} of chunk ${c.id}, which is at step ${slot.version} (BSP)`);
    }
    return slot;
  }

  /**
   * Adds a staged gradient to the chunk's pending sum and applies the update once enough pushes
   * are in. With one push per update the optimizer reads the staged gradient directly.
   */
  #accumulate(slot: ChunkSlot, grad: number, step: number): void {
    const need = this.#cfg.sync === "bsp" ? this.#cfg.trainers : this.#cfg.batchPushes;
    const lr = () => this.#lr(step);
    const clip = shardsClip(this.#cfg);
    if (need === 1 && !clip) {
      this.#math.apply(slot.index, lr(), slot.version, { staged: grad });
    } else {
      if (!this.#math.accumulate(slot.index, grad, need)) return;
      if (clip) {
        // the update waits for the global norm, agreed once every chunk has its average
        this.#clipWait.add(slot);
        if (this.#clipWait.size === this.#slots.size) this.#clipAndApply(step, lr());
        return;
      }
      this.#math.apply(slot.index, lr(), slot.version, { norm: 0, clip: 0 });
    }
    slot.version++;
    this.#updates++;
  }

  /** BSP clipping: every chunk holds step `step`'s averaged gradient; agree on the norm, clip, apply. */
  #clipAndApply(step: number, lr: number): void {
    const partial = this.#math.sumSquares([...this.#clipWait].map((slot) => slot.index));
    this.#partials.set(step, partial);
    for (const k of this.#partials.keys()) if (k < step - 2) this.#partials.delete(k);
    for (const w of this.#partialWaiters.get(step) ?? []) w.wake(partial);
    this.#partialWaiters.delete(step);
    const epoch = this.#epoch;
    const apply = (norm: number) => {
      if (epoch !== this.#epoch || this.#disposed) return; // restored meanwhile: the state this was for is gone
      for (const slot of this.#clipWait) {
        this.#math.apply(slot.index, lr, slot.version, { norm, clip: this.#cfg.gradClip });
        slot.version++;
        this.#updates++;
      }
      this.#clipWait.clear();
      this.lastNorm = norm;
      this.#wake();
    };
    if (!this.#agreeNorm) return apply(Math.sqrt(partial));
    this.#agreeNorm(step, partial).then(apply, (e: unknown) => {
      // the pulls of step+1 wait; the trainers retry them, and a shard that is gone is
      // restored with the whole job
      this.onNormFailure?.(step, e as Error);
    });
  }

  /** BSP clipping: the global norm of the last step applied (before clipping). */
  lastNorm = Number.NaN;
  /** BSP clipping: told when the shards could not agree on a step's norm */
  onNormFailure: ((step: number, e: Error) => void) | undefined;

  #advanceClock(trainer: number, step: number, chunks: number): void {
    const received = this.#received[trainer]!;
    const total = (received.get(step) ?? 0) + chunks;
    if (total < this.ids.length) {
      received.set(step, total);
      return;
    }
    received.delete(step);
    this.#clock[trainer] = Math.max(this.#clock[trainer]!, step + 1);
  }

  /** Who a pull of `step` waits for: the trainers whose pushes the sync policy still needs. */
  waitingFor(step: number): string {
    this.flush();
    const need = this.#cfg.sync === "ssp" ? step - this.#cfg.staleness : step;
    const behind = [...this.#clock.keys()].filter((t) => this.#clock[t]! < need);
    return behind.length === 0
      ? "(every trainer has pushed; an update is pending)"
      : `for trainer${behind.length > 1 ? "s" : ""} ${behind.join(", ")} (their pushes of step ${need - 1})`;
  }

  #ready(step: number, ids: Uint32Array): boolean {
    switch (this.#cfg.sync) {
      case "asp":
        return true;
      case "ssp":
        return Math.min(...this.#clock) >= step - this.#cfg.staleness;
      case "bsp":
        for (const id of ids) if (this.#slots.get(id)!.version < step) return false;
        return true;
      case "allreduce":
        throw new BadRequestError("an all-reduce job has no parameter-server shards");
    }
  }

  /**
   * The PullReply message with the current parameters of `ids`, once the sync policy allows
   * trainer `trainer` to compute `step` (encoded here: parameters go from backend memory
   * straight into the message).
   */
  pull(trainer: number, step: number, ids: Uint32Array, dtype: DType = DType.F32): Promise<Uint8Array> {
    this.flush();
    this.#checkTrainer(trainer);
    this.#checkStep(step, "a pull of");
    if (dtype !== DType.F32 && dtype !== DType.F16 && dtype !== DType.BF16)
      throw new BadRequestError(
        `parameters are pulled as F32, F16 or BF16 (a lossy copy), not ${DType[dtype] ?? dtype}`,
      );
    for (const id of ids) this.#slot(id);
    if (new Set(ids).size !== ids.length) throw new BadRequestError("a pull names a chunk twice");
    if (this.#ready(step, ids)) return Promise.resolve(this.#snapshot(ids, dtype));
    // the same pull asked again (its first ask may have been lost on the way): one waiter
    // answers both, and counts once against the limit
    const same = [...this.#waiters].find(
      (w) => w.trainer === trainer && w.step === step && w.dtype === dtype && sameIds(w.ids, ids),
    );
    if (same !== undefined)
      return new Promise((resolve, reject) => {
        const [first, failed] = [same.resolve, same.reject];
        same.resolve = (r) => {
          first(r);
          resolve(r);
        };
        same.reject = (e) => {
          failed(e);
          reject(e);
        };
      });
    if (this.#waiters.size >= pullWaitersMax)
      throw new LimitExceededError(`${pullWaitersMax} pulls are waiting on shard ${this.shard} already`);
    return new Promise((resolve, reject) => {
      const w: Waiter = {
        trainer,
        step,
        ids,
        dtype,
        resolve,
        reject,
        ready: () => this.#ready(step, ids),
        timer: setTimeout(() => {
          this.#waiters.delete(w);
          w.reject(
            new DeadlineError(
              `pull for step ${step} by trainer ${trainer} waited ${pullWaitMsMax} ms ${this.waitingFor(step)}; trainer clocks on shard ${this.shard}: ${this.#clock.join(",")}`,
            ),
          );
        }, pullWaitMsMax),
      };
      this.#waiters.add(w);
    });
  }

  #wake(): void {
    for (const w of this.#waiters) {
      if (!w.ready()) continue;
      clearTimeout(w.timer);
      this.#waiters.delete(w);
      w.resolve(this.#snapshot(w.ids, w.dtype));
    }
  }

  #snapshot(ids: Uint32Array, dtype: DType): Uint8Array {
    return encodePullReply(
      this.#updates,
      [...ids].map((id) => {
        const slot = this.#slots.get(id)!;
        const fill =
          dtype === DType.F32
            ? (dst: Uint8Array) => this.#math.readParams(slot.index, dst)
            : (dst: Uint8Array) => {
                // a 16-bit copy of the f32 master parameters
                const v = new Float32Array(slot.info.count);
                this.#math.readParams(slot.index, v);
                fillParams(dtype, v, dst);
              };
        return { id, version: slot.version, count: slot.info.count, dtype, fill };
      }),
    );
  }

  /**
   * Everything needed to resume: parameters, optimizer state and versions of every chunk. Its
   * step is the trainers' slowest clock; a shard that owns no chunks (the hash ring gave it none)
   * gets no pushes, so its clocks never move, and its state is of any step: `step`, the one asked.
   */
  exportState(step?: number): ShardState {
    this.flush();
    const chunks: ChunkState[] = [...this.#slots.values()].map((slot) => {
      const params = new Float32Array(slot.info.count);
      this.#math.readParams(slot.index, params);
      const state = this.#math.readState(slot.index);
      return {
        id: slot.info.id,
        version: slot.version,
        params,
        state: this.#math.stateNames.map((name, k) => ({ name, data: state[k]! })),
      };
    });
    const at = chunks.length === 0 && step !== undefined ? step : Math.min(...this.clocks);
    return withChecksum({
      job: this.job,
      shard: this.shard,
      updates: this.#updates,
      optimizerSteps: at,
      step: at,
      chunks,
    });
  }

  /** A snapshot's parts: asked at `step`, cut from the state at part 0's ask */
  #exported: { step: number; parts: ShardState[] } | null = null;

  /**
   * Cuts this shard's state for the snapshot of `step` (a copy of its memory, cut into parts each
   * under partBytesMax, every part checksummed) and keeps it until its last part is read; answers
   * the cut's head: its step, counters and number of parts. Training goes on meanwhile: the
   * parts are of this moment.
   */
  cut(step: number, partBytesMax: number): ShardState {
    const whole = this.exportState(step);
    // a shard that owns no chunks still answers one part, with none
    const { chunks, checksum: _, ...head } = whole;
    const parts = cutShardState(head, chunks, partBytesMax);
    this.#exported = { step, parts };
    return { ...head, chunks: [], parts: parts.length, part: 0 };
  }

  /**
   * Part `part` of this shard's state for the snapshot of `step`, from the cut for that step (part
   * 0 with no cut for the step makes one), each part under partBytesMax.
   */
  exportPart(part: number, step: number, partBytesMax: number): ShardState {
    if (part === 0 && this.#exported?.step !== step) this.cut(step, partBytesMax);
    const ex = this.#exported;
    if (ex === null || ex.step !== step)
      throw new BadRequestError(
        `part ${part} of shard ${this.shard}'s state at step ${step}: cut it first (ask for part 0)`,
      );
    const s = ex.parts[part];
    if (s === undefined)
      throw new BadRequestError(
        `shard ${this.shard}'s state at step ${step} has parts 0 to ${ex.parts.length - 1}, not ${part}`,
      );
    if (part === ex.parts.length - 1) this.#exported = null;
    return s;
  }

  /** A restore's parts as they come, each checked; applied when every one is here */
  #loading: { step: number; updates: number; parts: number; got: Map<number, ShardState> } | null = null;

  /**
   * Takes part `s.part` of `s.parts` of a snapshot of this shard (a whole state is one part).
   * Each part is checked completely as it comes (its checksum, job and shard, its chunks this
   * shard's, their sizes and state, every value finite and plausible, the step within the job); nothing is
   * applied until the last part is here, and then all at once. Returns the parts still missing
   * (0: the state was applied).
   */
  loadPart(s: ShardState): number {
    const parts = Math.max(1, s.parts ?? 0),
      part = s.part ?? 0;
    if (s.checksum === undefined || s.checksum === 0n || s.checksum !== shardStateChecksum(s))
      throw new BadRequestError(
        `shard ${this.shard}: a load whose checksum does not match its contents (changed after it was cut)`,
      );
    if (!(part < parts)) throw new BadRequestError(`a load's part ${part} of ${parts}`);
    this.#checkState(s);
    const cur = this.#loading;
    // a part of another snapshot (another step or moment: its counters differ), or one already
    // here (a new attempt), starts over
    if (cur === null || cur.step !== s.step || cur.updates !== s.updates || cur.parts !== parts || cur.got.has(part))
      this.#loading = { step: s.step, updates: s.updates, parts, got: new Map() };
    const l = this.#loading!;
    l.got.set(part, s);
    if (l.got.size < parts) return parts - l.got.size;
    this.#loading = null;
    const all = [...l.got.values()];
    this.importState({ ...all[0]!, parts: 1, part: 0, chunks: all.flatMap((x) => x.chunks) });
    return 0;
  }

  /** Everything about a state but whether it covers the shard: refused with BadRequestError. */
  #checkState(s: ShardState): void {
    if (s.job !== this.job || s.shard !== this.shard)
      throw new BadRequestError(`snapshot of ${s.job} shard ${s.shard} loaded into ${this.job} shard ${this.shard}`);
    if (!Number.isSafeInteger(s.step) || s.step < 0 || s.step > this.#totalSteps)
      throw new BadRequestError(`snapshot of step ${s.step}: job ${this.job} runs steps 0 to ${this.#totalSteps}`);
    if (!Number.isSafeInteger(s.updates) || s.updates < 0)
      throw new BadRequestError(`snapshot with ${s.updates} updates`);
    const names = this.#math.stateNames.join(",");
    const seen = new Set<number>();
    for (const c of s.chunks) {
      const slot = this.#slots.get(c.id);
      if (slot === undefined)
        throw new BadRequestError(`snapshot chunk ${c.id}: shard ${this.shard} owns ${this.ids.join(",")}`);
      if (seen.has(c.id)) throw new BadRequestError(`snapshot chunk ${c.id} appears twice`);
      seen.add(c.id);
      if (
        !Number.isSafeInteger(c.version) ||
        c.version < 0 ||
        c.version > this.#totalSteps * Math.max(...worldOf(this.#cfg).map((w) => w.trainers))
      )
        throw new BadRequestError(`snapshot chunk ${c.id} at version ${c.version}`);
      if (c.params.length !== slot.info.count)
        throw new BadRequestError(
          `snapshot chunk ${c.id} has ${c.params.length} elements, expected ${slot.info.count}`,
        );
      if (c.state.map((v) => v.name).join(",") !== names)
        throw new BadRequestError(
          `snapshot chunk ${c.id} has optimizer state [${c.state.map((v) => v.name).join(",")}], this job needs [${names}]`,
        );
      for (const v of [c.params, ...c.state.map((x) => x.data)]) {
        if (v.length !== slot.info.count)
          throw new BadRequestError(
            `snapshot chunk ${c.id} has a state vector of ${v.length} elements, expected ${slot.info.count}`,
          );
        if (!plausibleState(v)) throw new BadRequestError(`snapshot chunk ${c.id} holds ${implausibleStateText}`);
      }
    }
  }

  /**
   * Replaces this shard's state with a snapshot taken when every trainer had pushed `s.step`
   * steps. Checks everything before changing anything: a bad snapshot leaves the shard as it was.
   */
  importState(s: ShardState): void {
    this.flush();
    const step = s.step;
    this.#checkState(s);
    const ids = s.chunks.map((c) => c.id).sort((a, b) => a - b);
    if (ids.join(",") !== [...this.ids].sort((a, b) => a - b).join(","))
      throw new BadRequestError(
        `snapshot holds chunks ${ids.join(",")}, shard ${this.shard} owns ${this.ids.join(",")}`,
      );
    for (const w of this.#waiters) {
      clearTimeout(w.timer);
      w.reject(new DeadlineError(`shard ${this.shard} was restored to step ${step}; pull again`));
    }
    this.#waiters.clear();
    for (const c of s.chunks) {
      const slot = this.#slots.get(c.id)!;
      this.#math.load(
        slot.index,
        c.params,
        c.state.map((v) => v.data),
      );
      slot.version = c.version;
      slot.lastStep.fill(step - 1);
    }
    this.#updates = s.updates;
    this.#clock.fill(step);
    this.#epoch++;
    this.#clipWait.clear();
    this.#partials.clear();
    for (const r of this.#received) r.clear();
  }

  dispose(): void {
    if (this.#disposed) return;
    this.#deferred = null; // its memory is freed below
    this.#disposed = true;
    for (const w of this.#waiters) {
      clearTimeout(w.timer);
      w.reject(new DeadlineError(`shard ${this.shard} of job ${this.job} stopped`));
    }
    this.#waiters.clear();
    for (const l of this.#partialWaiters.values())
      for (const w of l) w.fail(new DeadlineError(`shard ${this.shard} of job ${this.job} stopped`));
    this.#partialWaiters.clear();
    this.#math.dispose();
  }
}
