// NCCL through bun:ffi: communicators, all-reduce, reduce-scatter, all-gather, broadcast and
// group calls, for the all-reduce training mode on GPUs.
//
// What goes where:
//   - Every NCCL function that takes only pointers and integers is called directly through
//     bun:ffi's dlopen of libnccl.
//   - Communicator creation takes the 128-byte ncclUniqueId BY VALUE, which bun:ffi cannot
//     pass; it goes through ffi/cuda/nccl-shim.c (built on first use by ./nccl-build.ts).
//
// Threads and the event loop:
//   - Communicators are created non-blocking (ncclConfig_t.blocking = 0, NCCL >= 2.14): the
//     call returns at once and NcclComm.init polls ncclCommGetAsyncError on a timer with a
//     small backoff, so timers, NATS traffic and heartbeats go on while ranks rendezvous.
//     NCCL < 2.14 has no non-blocking init: the shim runs the blocking ncclCommInitRank on a
//     thread of its own and JavaScript polls that thread's result the same way.
//   - No NCCL or CUDA thread ever calls into JavaScript: there is no JSCallback anywhere.
//     Asynchronous errors are polled (pollAsyncError), never delivered.
//
// A non-blocking communicator may answer any call with ncclInProgress. NCCL's rule: "If any
// NCCL function returns ncclInProgress, users must query the communicator state until it
// becomes ncclSuccess before calling another NCCL function", and, until then, "do not issue
// CUDA kernels on streams used by NCCL" (NCCL API docs, ncclCommGetAsyncError). So a
// collective that returns ncclInProgress leaves the communicator `pending`; the caller awaits
// comm.settled() before its next NCCL call or its next kernel on that stream. Calling NCCL
// through a pending communicator is refused (a programmer error, thrown at once).
//
// Importing this module loads nothing: libnccl and the shim are found, built and dlopen'ed on
// first use.
//
// Ranks and GPUs: NCCL needs one GPU per rank (two ranks on one device fail with
// ncclInvalidUsage), so a one-GPU machine can only run a one-rank communicator. The CUDA
// context of the rank's device must be current on the JavaScript thread before init (NCCL
// takes its device from cudaGetDevice; the CUDA backend makes the device's primary context
// current when it is created).
import { CString, dlopen, type Library, type Pointer } from "bun:ffi";
import type { Ptr } from "../backend.ts";
import { NativeLibraryError } from "../errors.ts";
import { findLibrary, type LibrarySpec, type SearchEnv } from "../find-library.ts";
import { ensureNcclShim } from "./nccl-build.ts";

// ---- limits ---------------------------------------------------------------------------------
// (ffi/ has no limits.ts; these are this binding's limits, kept with it.)

/** NCCL_UNIQUE_ID_BYTES: the id every rank of a communicator must be given. */
export const ncclUniqueIdBytes = 128;
/** How long to poll on the next turns of the event loop before the first timer: on a
 *  non-blocking communicator real NCCL answers every collective with ncclInProgress
 *  (ncclGroupEnd hands the launch to a thread of its own), which settles within tens of
 *  microseconds, and a 1 ms timer after each of a step's bucket all-reduces would put
 *  milliseconds on the step. Bounded in time, not turns: a turn of an idle loop takes
 *  microseconds, and a longer spin takes a core from the threads doing the work (the emulated
 *  NCCL's 1-rank job ran 10% slower with 200 turns). */
export const pollSpinMs = 0.5;
/** First pause between two polls once the spins are spent: a one-rank init finishes within a
 *  millisecond or two. */
export const pollIntervalMsMin = 1;
/** Pauses double up to this: a 16-rank init takes seconds, and 50 ms adds at most 50 ms to it
 *  while keeping the polling cost negligible. */
export const pollIntervalMsMax = 50;
/** How long a communicator left in progress by a collective, a group or finalize may take to
 *  settle when the caller gives no timeout: enqueueing is host work (plus, the first time,
 *  connection set-up with the peers), so a minute means a peer is gone. */
export const settleTimeoutMsDefault = 60_000;
/** Oldest NCCL supported: bfloat16 and ncclAvg arrived in 2.10. */
export const ncclVersionMin = 21000;
/** Largest error text read back from ncclGetLastError / ncclGetErrorString. */
const errorTextCharsMax = 4096;

// ---- enums ----------------------------------------------------------------------------------

export type NcclDType = "f32" | "f16" | "bf16" | "f64" | "i32" | "i8" | "u8";
/** ncclDataType_t */
export const ncclDataTypes: Readonly<Record<NcclDType, number>> = {
  i8: 0, // ncclInt8
  u8: 1, // ncclUint8
  i32: 2, // ncclInt32
  f16: 6, // ncclFloat16
  f32: 7, // ncclFloat32
  f64: 8, // ncclFloat64
  bf16: 9, // ncclBfloat16 (2.10+)
};

export type NcclRedOp = "sum" | "prod" | "max" | "min" | "avg";
/** ncclRedOp_t */
export const ncclRedOps: Readonly<Record<NcclRedOp, number>> = { sum: 0, prod: 1, max: 2, min: 3, avg: 4 /* 2.10+ */ };

const ncclSuccess = 0;
const ncclSystemError = 2;
const ncclInvalidUsage = 5;
const ncclInProgress = 7;
const ncclTimeout = 8;

/** ncclResult_t names, as nccl.h spells them. */
export const ncclResultNames: Readonly<Record<number, string>> = {
  0: "ncclSuccess",
  1: "ncclUnhandledCudaError",
  2: "ncclSystemError",
  3: "ncclInternalError",
  4: "ncclInvalidArgument",
  5: "ncclInvalidUsage",
  6: "ncclRemoteError",
  7: "ncclInProgress",
  8: "ncclTimeout",
};

export function ncclResultName(code: number): string {
  return ncclResultNames[code] ?? `ncclResult(${code})`;
}

// ---- errors ---------------------------------------------------------------------------------

/** An NCCL call failed (or a communicator did not become ready in time: code ncclTimeout). */
export class NcclError extends Error {
  override readonly name = "NcclError";
  readonly codeName: string;
  constructor(
    /** the NCCL function, e.g. "ncclAllReduce" */
    readonly call: string,
    readonly code: number,
    /** ncclGetErrorString for the code, then ncclGetLastError's text where there is one */
    readonly detail: string,
    options?: ErrorOptions,
  ) {
    const codeName = ncclResultName(code);
    super(`${call} failed: ${codeName} (${code}): ${detail}`, options);
    this.codeName = codeName;
  }
}

// ---- finding and loading the libraries ------------------------------------------------------

export const ncclInstallHint =
  "pip install nvidia-nccl-cu13 (CUDA 13; nvidia-nccl-cu12 for CUDA 12), or apt-get install -y libnccl2 from NVIDIA's CUDA apt repository";

export const ncclLibrarySpec: LibrarySpec = {
  what: "NCCL",
  envVar: "MESHTRAIN_NCCL",
  names: ["libnccl.so.2", "libnccl.so"],
  pipSubdir: "nccl",
  installHint: ncclInstallHint,
};

/** The libnccl path (MESHTRAIN_NCCL, system folders, pip wheels); NativeLibraryError if none. */
export function findNccl(env: SearchEnv = process.env): string {
  return findLibrary(ncclLibrarySpec, env);
}

function openShim() {
  return dlopen(ensureNcclShim(), {
    mt_nccl_open: { args: ["ptr", "ptr", "i32"], returns: "ptr" },
    mt_nccl_has_symbol: { args: ["ptr", "ptr"], returns: "i32" },
    mt_nccl_config_layout: { args: ["ptr"], returns: "void" },
    mt_nccl_init_rank_config: { args: ["ptr", "i32", "ptr", "i32", "i32", "ptr"], returns: "ptr" },
    mt_nccl_slot_comm: { args: ["ptr"], returns: "ptr" },
    mt_nccl_slot_free: { args: ["ptr"], returns: "void" },
    mt_nccl_init_start_legacy: { args: ["ptr", "i32", "ptr", "i32", "ptr"], returns: "ptr" },
    mt_nccl_init_poll_legacy: { args: ["ptr", "ptr", "ptr"], returns: "i32" },
    mt_nccl_init_abandon_legacy: { args: ["ptr"], returns: "void" },
  }).symbols;
}
type Shim = ReturnType<typeof openShim>;
let shimSymbols: Shim | undefined;
function shim(): Shim {
  shimSymbols ??= openShim();
  return shimSymbols;
}

// Device buffers and streams are declared u64, not ptr: they are device addresses and CUDA
// handles, never host memory bun:ffi could check, and u64 takes both the engine's number Ptr
// and the CUDA backend's bigint stream (same register, same ABI as a pointer on LP64).
const requiredSymbols = {
  ncclGetVersion: { args: ["ptr"], returns: "i32" },
  ncclGetUniqueId: { args: ["ptr"], returns: "i32" },
  ncclGetErrorString: { args: ["i32"], returns: "ptr" },
  ncclCommGetAsyncError: { args: ["ptr", "ptr"], returns: "i32" },
  ncclCommAbort: { args: ["ptr"], returns: "i32" },
  ncclCommDestroy: { args: ["ptr"], returns: "i32" },
  // (sendbuff, recvbuff, count, datatype, op, comm, stream)
  ncclAllReduce: { args: ["u64", "u64", "u64", "i32", "i32", "ptr", "u64"], returns: "i32" },
  // (sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
  ncclReduceScatter: { args: ["u64", "u64", "u64", "i32", "i32", "ptr", "u64"], returns: "i32" },
  // (sendbuff, recvbuff, sendcount, datatype, comm, stream)
  ncclAllGather: { args: ["u64", "u64", "u64", "i32", "ptr", "u64"], returns: "i32" },
  // (sendbuff, recvbuff, count, datatype, root, comm, stream)
  ncclBroadcast: { args: ["u64", "u64", "u64", "i32", "i32", "ptr", "u64"], returns: "i32" },
  ncclGroupStart: { args: [], returns: "i32" },
  ncclGroupEnd: { args: [], returns: "i32" },
} as const;
const optionalSymbols = {
  ncclGetLastError: { args: ["ptr"], returns: "ptr" }, // 2.13+
  ncclCommFinalize: { args: ["ptr"], returns: "i32" }, // 2.14+
} as const;
type OptionalName = keyof typeof optionalSymbols;
type AllSymbols = Library<typeof requiredSymbols & typeof optionalSymbols>["symbols"];
/** libnccl's functions; the optional ones are undefined where this NCCL lacks them. */
type NcclSymbols = Omit<AllSymbols, OptionalName> & Partial<Pick<AllSymbols, OptionalName>>;
function openNcclSymbols(path: string, optional: OptionalName[]): NcclSymbols {
  const present = Object.fromEntries(optional.map((k) => [k, optionalSymbols[k]]));
  return dlopen(path, { ...requiredSymbols, ...present }).symbols as unknown as NcclSymbols;
}

/** bun:ffi hands back addresses as numbers (bigint only above 2^53, which no address here reaches). */
function asPointer(p: Pointer | bigint | null): Pointer | null {
  if (p === null || p === 0) return null;
  return (typeof p === "bigint" ? Number(p) : p) as Pointer;
}

const cstr = (s: string) => Buffer.from(`${s}\0`);

function readCString(p: Pointer | null): string {
  if (p === null) return "";
  const s = new CString(p).toString();
  return s.length > errorTextCharsMax ? `${s.slice(0, errorTextCharsMax)}...` : s;
}

export interface NcclVersion {
  /** NCCL_VERSION_CODE: 22703 for 2.27.3 (2.8 and older: 2803-style codes) */
  code: number;
  major: number;
  minor: number;
  patch: number;
}

/** Decodes NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after. */
export function decodeNcclVersion(code: number): NcclVersion {
  const big = code >= 10000;
  const major = Math.floor(code / (big ? 10000 : 1000));
  const minor = Math.floor((code % (big ? 10000 : 1000)) / 100);
  return { code, major, minor, patch: code % 100 };
}

/** The config layout the shim passes to ncclCommInitRankConfig (for tests and logs). */
export function shimConfigLayout(): { sizeBytes: number; magic: number; version: number; blockingOffset: number } {
  const out = new BigInt64Array(4);
  shim().mt_nccl_config_layout(out);
  return { sizeBytes: Number(out[0]), magic: Number(out[1]), version: Number(out[2]), blockingOffset: Number(out[3]) };
}

/** One loaded libnccl. A process normally has one (ncclLibrary()); tests open a fake. */
export class NcclLibrary {
  readonly version: NcclVersion;
  /** ncclCommInitRankConfig exists (NCCL >= 2.14): init is non-blocking inside NCCL. Older
   *  versions run the blocking init on the shim's own thread. */
  readonly nonBlockingInit: boolean;
  /** @internal bun:ffi symbols of libnccl */
  readonly n: NcclSymbols;
  /** @internal the shim's handle for this library */
  readonly handle: Pointer;
  /** @internal group nesting depth and the communicators used inside the open group */
  groupDepth = 0;
  readonly groupMembers = new Set<NcclComm>();

  private constructor(readonly path: string) {
    const s = shim();
    const err = Buffer.alloc(1024);
    const handle = asPointer(s.mt_nccl_open(cstr(path), err, err.length));
    if (handle === null) {
      throw new NativeLibraryError(`cannot load NCCL from ${path}: ${err.toString("utf8", 0, err.indexOf(0))}`);
    }
    this.handle = handle;
    const has = (name: string) => s.mt_nccl_has_symbol(handle, cstr(name)) === 1;
    const missing = Object.keys(requiredSymbols).filter((k) => !has(k));
    if (missing.length > 0)
      throw new NativeLibraryError(
        `${path} lacks ${missing.join(", ")}: not a usable NCCL (meshtrain needs 2.10 or newer)`,
      );
    this.n = openNcclSymbols(path, (Object.keys(optionalSymbols) as OptionalName[]).filter(has));
    this.nonBlockingInit = has("ncclCommInitRankConfig");
    const v = new Int32Array(1);
    this.check("ncclGetVersion", this.n.ncclGetVersion(v), null);
    this.version = decodeNcclVersion(v[0]!);
    if (this.version.code < ncclVersionMin) {
      throw new NativeLibraryError(
        `${path} is NCCL ${versionText(this.version)}; meshtrain needs 2.10 or newer. Install a newer one: ${ncclInstallHint}`,
      );
    }
  }

  /** Loads the NCCL library at `path` (and the shim, building it if needed). */
  static open(path: string): NcclLibrary {
    return new NcclLibrary(path);
  }

  get versionText(): string {
    return versionText(this.version);
  }

  /** A fresh ncclUniqueId (128 bytes). Rank 0 makes it and sends it to every other rank. */
  getUniqueId(): Uint8Array {
    const id = new Uint8Array(ncclUniqueIdBytes);
    this.check("ncclGetUniqueId", this.n.ncclGetUniqueId(id), null);
    return id;
  }

  /**
   * ncclGetErrorString for `code`, then ncclGetLastError's text when it is new. That text is one
   * buffer for the whole process, written by any thread's warning and never cleared (NCCL
   * ignores `comm`), so it may say nothing of this call: it is labelled so, and a text already
   * given with an earlier error is not repeated.
   */
  describe(code: number, comm: Pointer | null): string {
    const text = readCString(asPointer(this.n.ncclGetErrorString(code)));
    const last = this.n.ncclGetLastError ? readCString(asPointer(this.n.ncclGetLastError(comm))) : "";
    if (last === "" || last === this.#lastSeen) return text;
    this.#lastSeen = last;
    return `${text}; NCCL's most recent warning (possibly another call's): ${last}`;
  }

  /** ncclGetLastError's text as describe() last gave it */
  #lastSeen = "";

  error(call: string, code: number, comm: Pointer | null): NcclError {
    return new NcclError(call, code, this.describe(code, comm));
  }

  /** Throws NcclError unless `code` is ncclSuccess. */
  check(call: string, code: number, comm: Pointer | null): void {
    if (code !== ncclSuccess) throw this.error(call, code, comm);
  }

  /** The communicator's state: ncclSuccess, ncclInProgress or the error it met. */
  asyncState(comm: Pointer): number {
    this.check("ncclCommGetAsyncError", this.n.ncclCommGetAsyncError(comm, this.#state), comm);
    return this.#state[0]!;
  }

  /** ncclCommGetAsyncError's out-parameter, reused: polling allocates nothing. */
  readonly #state = new Int32Array(1);
}

function versionText(v: NcclVersion): string {
  return `${v.major}.${v.minor}.${v.patch}`;
}

let defaultLibrary: NcclLibrary | undefined;

/** The process's NCCL, found and loaded on first call. */
export function ncclLibrary(): NcclLibrary {
  defaultLibrary ??= NcclLibrary.open(findNccl());
  return defaultLibrary;
}

/** The loaded NCCL's version. */
export function ncclVersion(): NcclVersion {
  return ncclLibrary().version;
}

/** A fresh 128-byte ncclUniqueId from the process's NCCL. */
export function getUniqueId(): Uint8Array {
  return ncclLibrary().getUniqueId();
}

// ---- polling --------------------------------------------------------------------------------

const pause = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

type PollResult = { done: true } | { done: false; timedOut: true };

const nextTurn = () => new Promise<void>((resolve) => setImmediate(resolve));

/**
 * Calls `probe` until it says done, yielding to the event loop between calls: its next turns
 * for the first pollSpinMs, then timers of 1 ms doubling to pollIntervalMsMax. Never blocks.
 */
async function pollUntil(probe: () => boolean, timeoutMs: number): Promise<PollResult> {
  const start = performance.now();
  const deadline = start + timeoutMs;
  let pauseMs = pollIntervalMsMin;
  for (;;) {
    if (probe()) return { done: true };
    const now = performance.now();
    const leftMs = deadline - now;
    if (leftMs <= 0) return { done: false, timedOut: true };
    if (now - start < pollSpinMs) {
      await nextTurn();
      continue;
    }
    await pause(Math.min(pauseMs, leftMs));
    pauseMs = Math.min(pauseMs * 2, pollIntervalMsMax);
  }
}

function checkTimeout(timeoutMs: number): void {
  if (!(timeoutMs > 0) || !Number.isFinite(timeoutMs))
    throw new RangeError(`timeoutMs must be a positive number of milliseconds, got ${timeoutMs}`);
}

// ---- communicators --------------------------------------------------------------------------

export interface NcclInitOptions {
  /** how long ranks may take to find each other and set up; then the communicator is aborted */
  timeoutMs: number;
  /** the NCCL to use (default: ncclLibrary()) */
  library?: NcclLibrary;
}

/** A CUDA stream handle (CUstream == cudaStream_t): the engine's number or the backend's bigint. */
export type NcclStream = Ptr | bigint;

/** What a communicator's creation takes: the library, the group's size, this rank, the id, the time allowed. */
type InitArgs = [lib: NcclLibrary, nranks: number, rank: number, id: Uint8Array, timeoutMs: number];

/** One rank's NCCL communicator. */
export class NcclComm {
  readonly #lib: NcclLibrary;
  #comm: Pointer | null;
  /** the shim's newcomm slot (non-blocking init): freed after destroy/abort */
  #slot: Pointer | null;
  #pending = false;

  private constructor(
    lib: NcclLibrary,
    comm: Pointer,
    slot: Pointer | null,
    readonly nranks: number,
    readonly rank: number,
  ) {
    this.#lib = lib;
    this.#comm = comm;
    this.#slot = slot;
  }

  /**
   * Creates this rank's communicator: every rank calls it with the same nranks and id (made by
   * rank 0 with getUniqueId and sent to the others) and its own rank. Resolves when all ranks
   * have joined; on timeoutMs the communicator is aborted and NcclError (ncclTimeout) thrown.
   */
  static async init(nranks: number, rank: number, id: Uint8Array, options: NcclInitOptions): Promise<NcclComm> {
    if (!Number.isInteger(nranks) || nranks < 1 || !Number.isInteger(rank) || rank < 0 || rank >= nranks) {
      throw new RangeError(`NcclComm.init: rank ${rank} of ${nranks} is not a valid rank`);
    }
    if (id.byteLength !== ncclUniqueIdBytes)
      throw new RangeError(`NcclComm.init: an ncclUniqueId is ${ncclUniqueIdBytes} bytes, got ${id.byteLength}`);
    checkTimeout(options.timeoutMs);
    const lib = options.library ?? ncclLibrary();
    return lib.nonBlockingInit
      ? await NcclComm.#initNonBlocking(lib, nranks, rank, id, options.timeoutMs)
      : await NcclComm.#initOnThread(lib, nranks, rank, id, options.timeoutMs);
  }

  static async #initNonBlocking(...[lib, nranks, rank, id, timeoutMs]: InitArgs): Promise<NcclComm> {
    const call = "ncclCommInitRankConfig";
    const result = new Int32Array(1);
    const slot = asPointer(shim().mt_nccl_init_rank_config(lib.handle, nranks, id, rank, 0 /* blocking */, result));
    if (slot === null) throw lib.error(call, result[0]!, null);
    const comm = asPointer(shim().mt_nccl_slot_comm(slot));
    const fail = (e: unknown): never => {
      if (comm !== null) lib.n.ncclCommAbort(comm); // the error being thrown is the one that matters
      shim().mt_nccl_slot_free(slot);
      throw e;
    };
    const r = result[0]!;
    if (r !== ncclSuccess && r !== ncclInProgress) fail(initError(lib, call, r, comm));
    if (comm === null) fail(lib.error(call, ncclInvalidUsage, null)); // success without a communicator: NCCL broke its contract
    let state = r;
    const poll = await pollUntil(() => {
      state = lib.asyncState(comm!);
      return state !== ncclInProgress;
    }, timeoutMs).catch(fail); // ncclCommGetAsyncError itself failing: still abort and free
    if (!poll.done) fail(timeoutError(call, nranks, rank, timeoutMs));
    if (state !== ncclSuccess) fail(initError(lib, call, state, comm));
    return new NcclComm(lib, comm!, slot, nranks, rank);
  }

  static async #initOnThread(...[lib, nranks, rank, id, timeoutMs]: InitArgs): Promise<NcclComm> {
    const call = "ncclCommInitRank";
    const result = new Int32Array(1);
    const job = asPointer(shim().mt_nccl_init_start_legacy(lib.handle, nranks, id, rank, result));
    if (job === null) throw lib.error(call, result[0]!, null);
    const commOut = new BigUint64Array(1);
    const poll = await pollUntil(() => shim().mt_nccl_init_poll_legacy(job, commOut, result) === 1, timeoutMs);
    if (!poll.done) {
      // The blocking init cannot be interrupted; the shim aborts its communicator if it ever finishes.
      shim().mt_nccl_init_abandon_legacy(job);
      throw timeoutError(call, nranks, rank, timeoutMs);
    }
    const comm = asPointer(commOut[0]!);
    if (result[0] !== ncclSuccess) throw initError(lib, call, result[0]!, comm);
    if (comm === null) throw lib.error(call, ncclInvalidUsage, null); // success without a communicator: NCCL broke its contract
    return new NcclComm(lib, comm, null, nranks, rank);
  }

  /** The communicator handle (ncclComm_t), for logs and tests. */
  get handle(): Pointer | null {
    return this.#comm;
  }

  /** A call returned ncclInProgress: await settled() before the next NCCL call or kernel on the stream. */
  get pending(): boolean {
    return this.#pending;
  }

  /** all-reduce `count` elements: recv = op over ranks of send (in place when send == recv). */
  allReduce(send: Ptr, recv: Ptr, count: number, dtype: NcclDType, op: NcclRedOp, stream: NcclStream): void {
    const comm = this.#enter("ncclAllReduce", count);
    this.#leave(
      "ncclAllReduce",
      this.#lib.n.ncclAllReduce(send, recv, count, dtypeOf(dtype), opOf(op), comm, stream),
      comm,
    );
  }

  /** reduce-scatter: send holds nranks * recvCount elements; rank r receives block r of the reduction. */
  reduceScatter(send: Ptr, recv: Ptr, recvCount: number, dtype: NcclDType, op: NcclRedOp, stream: NcclStream): void {
    const comm = this.#enter("ncclReduceScatter", recvCount);
    this.#leave(
      "ncclReduceScatter",
      this.#lib.n.ncclReduceScatter(send, recv, recvCount, dtypeOf(dtype), opOf(op), comm, stream),
      comm,
    );
  }

  /** all-gather: each rank sends sendCount elements; recv holds nranks * sendCount, rank order. */
  allGather(send: Ptr, recv: Ptr, sendCount: number, dtype: NcclDType, stream: NcclStream): void {
    const comm = this.#enter("ncclAllGather", sendCount);
    this.#leave("ncclAllGather", this.#lib.n.ncclAllGather(send, recv, sendCount, dtypeOf(dtype), comm, stream), comm);
  }

  /** broadcast `count` elements from root's send into every rank's recv. */
  broadcast(send: Ptr, recv: Ptr, count: number, dtype: NcclDType, root: number, stream: NcclStream): void {
    if (!Number.isInteger(root) || root < 0 || root >= this.nranks)
      throw new RangeError(`broadcast: root ${root} is not a rank of ${this.nranks}`);
    const comm = this.#enter("ncclBroadcast", count);
    this.#leave(
      "ncclBroadcast",
      this.#lib.n.ncclBroadcast(send, recv, count, dtypeOf(dtype), root, comm, stream),
      comm,
    );
  }

  /** Checks a collective's count and the communicator's state; joins an open group. */
  #enter(call: string, count: number): Pointer {
    if (!Number.isSafeInteger(count) || count < 0) throw new RangeError(`${call}: invalid element count ${count}`);
    const comm = this.#ready(call);
    if (this.#lib.groupDepth > 0) this.#lib.groupMembers.add(this);
    return comm;
  }

  /** ncclInProgress leaves the communicator pending; any other failure is NcclError. */
  #leave(call: string, r: number, comm: Pointer): void {
    if (r === ncclInProgress) {
      this.#pending = true;
      return;
    }
    this.#lib.check(call, r, comm);
  }

  /** The live, settled handle; throws (programmer error) on a destroyed or pending communicator. */
  #ready(call: string): Pointer {
    if (this.#comm === null) throw new Error(`${call}: the communicator was destroyed or aborted`);
    if (this.#pending)
      throw new Error(
        `${call}: the communicator is in progress; await settled() first (NCCL forbids any call until then)`,
      );
    return this.#comm;
  }

  /**
   * Waits (polling, never blocking) until a communicator left in progress is ready again.
   * An error state throws NcclError (abort the communicator then); not settling within
   * timeoutMs aborts it and throws NcclError (ncclTimeout).
   */
  async settled(timeoutMs: number = settleTimeoutMsDefault): Promise<void> {
    if (!this.#pending) return;
    checkTimeout(timeoutMs);
    const comm = this.#comm!;
    let state = ncclInProgress;
    const poll = await pollUntil(() => {
      if (this.#comm !== comm) return true; // aborted (by a liveness watch, say) while waiting
      state = this.#lib.asyncState(comm);
      return state !== ncclInProgress;
    }, timeoutMs);
    if (this.#comm !== comm)
      throw new NcclError(
        "ncclCommGetAsyncError",
        ncclSystemError,
        `rank ${this.rank} of ${this.nranks}: the communicator was aborted while its work was pending`,
      );
    if (!poll.done) {
      this.abort();
      throw timeoutError("ncclCommGetAsyncError", this.nranks, this.rank, timeoutMs);
    }
    this.#pending = false;
    this.#lib.check("ncclCommGetAsyncError", state, comm);
  }

  /**
   * The asynchronous error the communicator met (a peer gone, a network failure), or null.
   * Poll it between steps: NCCL reports such errors only here. Also clears `pending` once the
   * communicator is ready again.
   */
  pollAsyncError(): NcclError | null {
    if (this.#comm === null) return null;
    const state = this.#lib.asyncState(this.#comm);
    if (state === ncclSuccess) this.#pending = false;
    if (state === ncclSuccess || state === ncclInProgress) return null;
    return this.#lib.error("ncclCommGetAsyncError", state, this.#comm);
  }

  /**
   * Finishes outstanding work and frees the communicator: ncclCommFinalize (non-blocking,
   * polled) then ncclCommDestroy. NCCL < 2.14 has no finalize: its destroy blocks until the
   * communicator's work is done. Idempotent.
   */
  async destroy(timeoutMs: number = settleTimeoutMsDefault): Promise<void> {
    if (this.#comm === null) return;
    await this.settled(timeoutMs);
    const comm = this.#comm;
    const finalize = this.#lib.n.ncclCommFinalize;
    if (finalize) {
      const r = finalize(comm);
      if (r === ncclInProgress) {
        this.#pending = true;
        await this.settled(timeoutMs);
      } else {
        this.#lib.check("ncclCommFinalize", r, comm);
      }
    }
    this.#comm = null;
    const r = this.#lib.n.ncclCommDestroy(comm);
    this.#freeSlot();
    this.#lib.check("ncclCommDestroy", r, null);
  }

  /** Frees the communicator at once, abandoning its work on the GPU (after an error or a
   *  timeout; every other rank must abort too). Blocking but short. Idempotent. */
  abort(): void {
    if (this.#comm === null) return;
    const comm = this.#comm;
    this.#comm = null;
    this.#pending = false;
    this.#lib.groupMembers.delete(this);
    const r = this.#lib.n.ncclCommAbort(comm);
    this.#freeSlot(); // abort joined NCCL's init thread: nothing writes the slot any more
    this.#lib.check("ncclCommAbort", r, null);
  }

  #freeSlot(): void {
    if (this.#slot !== null) shim().mt_nccl_slot_free(this.#slot);
    this.#slot = null;
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.destroy();
  }

  /** ncclGroupStart: collectives until groupEnd are fused into one launch (and cannot block). */
  static groupStart(library: NcclLibrary = ncclLibrary()): void {
    library.check("ncclGroupStart", library.n.ncclGroupStart(), null);
    library.groupDepth++;
  }

  /**
   * ncclGroupEnd. Returns the communicators left in progress (empty when everything was
   * enqueued): await settled() on each before their next call. Non-blocking communicators
   * make ncclGroupEnd return ncclInProgress instead of waiting.
   */
  static groupEnd(library: NcclLibrary = ncclLibrary()): NcclComm[] {
    if (library.groupDepth === 0) throw new Error("ncclGroupEnd without ncclGroupStart");
    const r = library.n.ncclGroupEnd();
    library.groupDepth--;
    if (library.groupDepth > 0) {
      library.check("ncclGroupEnd", r, null); // an inner end only closes a nesting level
      return [];
    }
    const members = [...library.groupMembers];
    library.groupMembers.clear();
    if (r === ncclInProgress) {
      for (const c of members) c.#pending = c.#comm !== null;
      return members.filter((c) => c.#pending);
    }
    library.check("ncclGroupEnd", r, null);
    return [];
  }
}

function dtypeOf(dtype: NcclDType): number {
  const v = ncclDataTypes[dtype];
  if (v === undefined) throw new RangeError(`unknown NCCL dtype ${String(dtype)}`);
  return v;
}

function opOf(op: NcclRedOp): number {
  const v = ncclRedOps[op];
  if (v === undefined) throw new RangeError(`unknown NCCL reduction ${String(op)}`);
  return v;
}

function initError(lib: NcclLibrary, call: string, code: number, comm: Pointer | null): NcclError {
  const e = lib.error(call, code, comm);
  if (code !== ncclInvalidUsage) return e;
  // The usual cause: two ranks on one GPU (NCCL: "Duplicate GPU detected").
  return new NcclError(
    call,
    code,
    `${e.detail} (each rank needs its own GPU: a one-GPU machine can only run a one-rank communicator)`,
  );
}

function timeoutError(call: string, nranks: number, rank: number, timeoutMs: number): NcclError {
  return new NcclError(
    call,
    ncclTimeout,
    `rank ${rank} of ${nranks} was not ready within ${timeoutMs} ms (a rank missing or stuck?); the communicator was aborted`,
  );
}
