// The NCCL binding without a GPU: the shim, and every call against a fake libnccl
// (fixtures/fake-nccl.c, compiled here) that records what it receives -- the 128-byte id
// passed BY VALUE above all, the bug the shim exists for. Plus library discovery, and a
// one-rank communicator on a real GPU where there is one.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { dlopen } from "bun:ffi";
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Backend, Ptr } from "../../ffi/backend.ts";
import { NativeLibraryError } from "../../ffi/errors.ts";
import { findLibrary, librarySearchDirs, tryFindLibrary } from "../../ffi/find-library.ts";
import { ensureNcclShim } from "../../ffi/cuda/nccl-build.ts";
import {
  findNccl,
  getUniqueId,
  NcclComm,
  type NcclDType,
  ncclDataTypes,
  NcclError,
  NcclLibrary,
  ncclLibrarySpec,
  type NcclRedOp,
  ncclRedOps,
  ncclUniqueIdBytes,
  ncclVersion,
  shimConfigLayout,
} from "../../ffi/cuda/nccl.ts";
import {
  CollectiveClosedError,
  CollectiveTimeoutError,
  CollectiveTransportError,
} from "../../engine/parallel/collective.ts";
import { NcclCollective } from "../../engine/parallel/nccl-collective.ts";
import { expectThrown } from "../helpers/errors.ts";
import { skip } from "../helpers/skip.ts";
import { waitFor } from "../helpers/mesh.ts";

const fixture = join(import.meta.dir, "fixtures", "fake-nccl.c");
const dir = mkdtempSync(join(tmpdir(), "mt-nccl-test-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function compileFake(name: string, defines: string[]): string {
  const out = join(dir, name);
  const r = Bun.spawnSync([
    "cc",
    "-O1",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-pthread",
    ...defines,
    "-o",
    out,
    fixture,
  ]);
  if (r.exitCode !== 0) throw new Error(`compiling the fake NCCL failed:\n${r.stderr.toString()}`);
  return out;
}

function openControls(path: string) {
  return dlopen(path, {
    fake_reset: { args: [], returns: "void" },
    fake_set_init_polls: { args: ["i32", "i32", "i32"], returns: "void" },
    fake_fail_next: { args: ["i32"], returns: "void" },
    fake_in_progress_next: { args: ["i32"], returns: "void" },
    fake_set_async_state: { args: ["i32"], returns: "void" },
    fake_release_legacy_init: { args: [], returns: "void" },
    fake_init_id: { args: ["ptr"], returns: "void" },
    fake_init_record: { args: ["ptr"], returns: "void" },
    fake_coll_record: { args: ["ptr"], returns: "void" },
    fake_counts: { args: ["ptr"], returns: "void" },
    fake_comm_handle: { args: [], returns: "ptr" },
  }).symbols;
}
type Controls = ReturnType<typeof openControls>;

function initRecord(f: Controls) {
  const id = new Uint8Array(ncclUniqueIdBytes);
  f.fake_init_id(id);
  const fields = [
    "nranks",
    "rank",
    "configSize",
    "magic",
    "version",
    "blocking",
    "cgaClusterSizeBytes",
    "cgaClusterSize",
    "calls",
  ] as const;
  return { id, ...readNamed(fields, (out) => f.fake_init_record(out)) };
}

function collRecord(f: Controls) {
  const v = new BigInt64Array(8);
  f.fake_coll_record(v);
  const [send, recv, count, dtype, op, root, comm, stream] = [...v];
  return { send, recv, count, dtype, op, root, comm, stream };
}

type CollCall = ReturnType<typeof collRecord>;

/** The record of a collective on `comm` and `stream` that takes no op and no root, with `over` (its buffers, count and type at least) on top. */
function collCall(
  comm: NcclComm,
  stream: bigint,
  over: Pick<CollCall, "send" | "recv" | "count" | "dtype"> & Partial<CollCall>,
): CollCall {
  return { op: -1n, root: -1n, comm: BigInt(comm.handle!), stream, ...over };
}

function counts(f: Controls) {
  return readNamed(["aborts", "destroys", "finalizes", "groupStarts", "groupEnds", "asyncPolls"] as const, (out) =>
    f.fake_counts(out),
  );
}

/** The int64 values a fake_ function writes, by name, as numbers (all small). */
function readNamed<K extends string>(names: readonly K[], read: (out: BigInt64Array) => void): Record<K, number> {
  const out = new BigInt64Array(names.length);
  read(out);
  return Object.fromEntries(names.map((k, i) => [k, Number(out[i])])) as Record<K, number>;
}

/** An id whose every byte differs from its neighbours, with zeros inside (a C string copy would stop there). */
function distinctiveId(): Uint8Array {
  const id = new Uint8Array(ncclUniqueIdBytes);
  for (let i = 0; i < id.length; i++) id[i] = (i * 37 + 11) & 0xff;
  id[5] = 0;
  id[64] = 0;
  id[127] = 0xff;
  return id;
}

const timeoutMs = 10_000;

// ---- library discovery ----------------------------------------------------------------------

describe("findLibrary", () => {
  const env = (extra: Record<string, string>) => ({ HOME: join(dir, "home"), PATH: process.env.PATH, ...extra });

  test("the override variable wins; a set variable naming a missing file is an error naming it", () => {
    const lib = join(dir, "override-libnccl.so.2");
    writeFileSync(lib, "");
    expect(findLibrary(ncclLibrarySpec, env({ MESHTRAIN_NCCL: lib }))).toBe(lib);
    expectThrown(
      () => findNccl(env({ MESHTRAIN_NCCL: join(dir, "nope.so") })),
      NativeLibraryError,
      "MESHTRAIN_NCCL=",
      "does not exist",
    );
  });

  test("finds a pip wheel's library under a virtualenv's site-packages", () => {
    const venv = join(dir, "venv");
    const wheelLib = join(venv, "lib", "python3.12", "site-packages", "nvidia", "nccl", "lib");
    mkdirSync(wheelLib, { recursive: true });
    writeFileSync(join(wheelLib, "libmt-wheel-test.so.2"), "");
    const spec = { ...ncclLibrarySpec, names: ["libmt-wheel-test.so.2"] };
    expect(findLibrary(spec, env({ VIRTUAL_ENV: venv }))).toBe(join(wheelLib, "libmt-wheel-test.so.2"));
  });

  test("several wheel folders (CUDA 13 wheels share nvidia/cu13/lib) and LD_LIBRARY_PATH first", () => {
    const venv = join(dir, "venv13");
    const cu13 = join(venv, "lib", "python3.11", "site-packages", "nvidia", "cu13", "lib");
    mkdirSync(cu13, { recursive: true });
    writeFileSync(join(cu13, "libmt-cublas-test.so.13"), "");
    const spec = {
      what: "cuBLAS",
      envVar: "MESHTRAIN_CUBLAS_TEST",
      names: ["libmt-cublas-test.so.13"],
      pipSubdir: ["cu13", "cublas"],
      installHint: "pip install nvidia-cublas",
    };
    expect(findLibrary(spec, env({ VIRTUAL_ENV: venv }))).toBe(join(cu13, "libmt-cublas-test.so.13"));
    const ld = join(dir, "ld");
    mkdirSync(ld, { recursive: true });
    writeFileSync(join(ld, "libmt-cublas-test.so.13"), "");
    expect(findLibrary(spec, env({ VIRTUAL_ENV: venv, LD_LIBRARY_PATH: ld }))).toBe(
      join(ld, "libmt-cublas-test.so.13"),
    );
    expect(librarySearchDirs(spec, env({ LD_LIBRARY_PATH: ld }))[0]).toBe(ld);
  });

  test("a missing libnccl is a NativeLibraryError naming every place, MESHTRAIN_NCCL and the pip package", () => {
    const venv = join(dir, "venv-empty");
    mkdirSync(join(venv, "lib", "python3.12", "site-packages"), { recursive: true });
    const spec = { ...ncclLibrarySpec, names: ["libnccl-absent-for-test.so.2"] };
    expect(tryFindLibrary(spec, env({ VIRTUAL_ENV: venv }))).toBeNull();
    expectThrown(
      () => findLibrary(spec, env({ VIRTUAL_ENV: venv })),
      NativeLibraryError,
      "NCCL not found",
      "MESHTRAIN_NCCL",
      "pip install nvidia-nccl-cu13",
      "/usr/local/cuda/lib64",
      join(venv, "lib", "python3.12", "site-packages", "nvidia", "nccl", "lib"),
    );
  });

  const installed = tryFindLibrary(ncclLibrarySpec);
  test.skipIf(skip("a machine without libnccl", installed === null ? null : `libnccl is installed (${installed})`))(
    "without libnccl, the first NCCL use says how to install it",
    () => {
      expectThrown(() => ncclVersion(), NativeLibraryError, "MESHTRAIN_NCCL", "pip install nvidia-nccl-cu13");
    },
  );

  test("importing the binding loads no native library", () => {
    const script = `await import(${JSON.stringify(join(import.meta.dir, "..", "..", "ffi", "cuda", "nccl.ts"))});
      const maps = require("node:fs").readFileSync("/proc/self/maps", "utf8");
      console.log(/libmtnccl|libnccl/.test(maps) ? "loaded" : "clean");`;
    const r = Bun.spawnSync([process.execPath, "-e", script], { stdout: "pipe", stderr: "pipe" });
    expect(r.stderr.toString()).toBe("");
    expect(r.stdout.toString().trim()).toBe("clean");
  });
});

// ---- the shim -------------------------------------------------------------------------------

describe("shim", () => {
  test("builds without nccl.h, and passes NCCL 2.14's ncclConfig_t", () => {
    expect(existsSync(ensureNcclShim())).toBe(true);
    // size, magic and version exactly as 2.14's NCCL_CONFIG_INITIALIZER writes them
    expect(shimConfigLayout()).toEqual({ sizeBytes: 24, magic: 0xcafebeef, version: 21400, blockingOffset: 16 });
  });
});

// ---- against the fake libnccl ---------------------------------------------------------------

describe("NCCL binding against a fake libnccl", () => {
  let lib: NcclLibrary;
  let fake: Controls;
  let comm: NcclComm;

  beforeAll(async () => {
    const path = compileFake("libfakenccl.so", []);
    fake = openControls(path);
    lib = NcclLibrary.open(path);
    fake.fake_reset();
    comm = await NcclComm.init(4, 1, distinctiveId(), { timeoutMs, library: lib });
  });

  afterAll(() => comm?.abort());

  test("version and capabilities", () => {
    expect(lib.version).toEqual({ code: 22703, major: 2, minor: 27, patch: 3 });
    expect(lib.versionText).toBe("2.27.3");
    expect(lib.nonBlockingInit).toBe(true);
  });

  test("getUniqueId returns NCCL's 128 bytes", () => {
    const id = lib.getUniqueId();
    expect(id.length).toBe(ncclUniqueIdBytes);
    expect([...id]).toEqual(Array.from({ length: 128 }, (_, i) => (i * 7 + 3) & 0xff));
  });

  test("the id arrives intact BY VALUE, with nranks and rank", async () => {
    fake.fake_reset();
    const id = distinctiveId();
    await using c = await NcclComm.init(3, 2, id, { timeoutMs, library: lib });
    const r = initRecord(fake);
    expect([...r.id]).toEqual([...id]);
    expect({ nranks: r.nranks, rank: r.rank, calls: r.calls }).toEqual({ nranks: 3, rank: 2, calls: 1 });
    expect(Number(c.handle)).toBe(Number(fake.fake_comm_handle()));
  });

  test("the config asks for a non-blocking communicator, with NCCL's size, magic and version", async () => {
    fake.fake_reset();
    await using _ = await NcclComm.init(2, 0, distinctiveId(), { timeoutMs, library: lib });
    const r = initRecord(fake);
    expect({ configSize: r.configSize, magic: r.magic, version: r.version, blocking: r.blocking }).toEqual({
      configSize: 24,
      magic: 0xcafebeef,
      version: 21400,
      blocking: 0,
    });
    // NCCL >= 2.17 copies all 24 bytes, so its cgaClusterSize (offset 20) comes from our tail
    // padding: the shim zeroes it, and the version gate (21400 < 2.17) resets it to UNDEF.
    expect({ bytes: r.cgaClusterSizeBytes, effective: r.cgaClusterSize }).toEqual({ bytes: 0, effective: -(2 ** 31) });
  });

  test("init polls without blocking the event loop: a timer set meanwhile fires first", async () => {
    fake.fake_reset();
    // in progress until a timer (a heartbeat, say) has run: past the polls on the loop's next
    // turns (its first pollSpinMs), init must let timers run
    fake.fake_set_init_polls(1 << 30, 0, 0);
    let initDone = false;
    let timerFiredDuringInit = false;
    setTimeout(() => {
      timerFiredDuringInit = !initDone;
      fake.fake_set_init_polls(0, 0, 0);
    }, 0);
    await using c = await NcclComm.init(2, 1, distinctiveId(), { timeoutMs, library: lib });
    initDone = true;
    expect(timerFiredDuringInit).toBe(true);
    expect(counts(fake).asyncPolls).toBeGreaterThanOrEqual(2); // "in progress", then success
    expect(c.pending).toBe(false);
  });

  test("an init that never finishes is aborted at the timeout: NcclError ncclTimeout", async () => {
    fake.fake_reset();
    fake.fake_set_init_polls(0, 1, 0);
    const e = await NcclComm.init(2, 0, distinctiveId(), { timeoutMs: 30, library: lib }).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(NcclError);
    expect({ name: (e as NcclError).name, codeName: (e as NcclError).codeName, call: (e as NcclError).call }).toEqual({
      name: "NcclError",
      codeName: "ncclTimeout",
      call: "ncclCommInitRankConfig",
    });
    expect((e as Error).message).toContain("aborted");
    expect(counts(fake).aborts).toBe(1);
  });

  test("an init that fails at once is NcclError with NCCL's texts", async () => {
    fake.fake_reset();
    fake.fake_fail_next(4);
    const e = (await NcclComm.init(2, 0, distinctiveId(), { timeoutMs, library: lib }).catch(
      (x: unknown) => x,
    )) as NcclError;
    expect(e).toBeInstanceOf(NcclError);
    expect({ code: e.code, codeName: e.codeName, call: e.call }).toEqual({
      code: 4,
      codeName: "ncclInvalidArgument",
      call: "ncclCommInitRankConfig",
    });
    expect(e.message).toContain("invalid argument (fake)");
    expect(e.message).toContain(
      "NCCL's most recent warning (possibly another call's): fake: ncclCommInitRankConfig was told to fail with 4",
    );
    // NCCL never clears that text: a second failure that left it as it was does not repeat it
    fake.fake_fail_next(4);
    const again = (await NcclComm.init(2, 0, distinctiveId(), { timeoutMs, library: lib }).catch(
      (x: unknown) => x,
    )) as NcclError;
    expect(again.codeName).toBe("ncclInvalidArgument");
    expect(again.message).toContain("invalid argument (fake)");
    expect(again.message).not.toContain("most recent warning");
  });

  test("an init that fails asynchronously is aborted and thrown; invalid usage says one GPU per rank", async () => {
    fake.fake_reset();
    fake.fake_set_init_polls(2, 0, 6);
    const e = (await NcclComm.init(2, 0, distinctiveId(), { timeoutMs, library: lib }).catch(
      (x: unknown) => x,
    )) as NcclError;
    expect({ name: e.name, codeName: e.codeName }).toEqual({ name: "NcclError", codeName: "ncclRemoteError" });
    expect(counts(fake).aborts).toBe(1);
    fake.fake_reset();
    fake.fake_fail_next(5);
    const usage = (await NcclComm.init(2, 1, distinctiveId(), { timeoutMs, library: lib }).catch(
      (x: unknown) => x,
    )) as NcclError;
    expect(usage.codeName).toBe("ncclInvalidUsage");
    expect(usage.message).toContain("a one-GPU machine can only run a one-rank communicator");
  });

  test("invalid arguments are refused before NCCL sees them", async () => {
    const bad = [
      () => NcclComm.init(2, 0, new Uint8Array(127), { timeoutMs, library: lib }),
      () => NcclComm.init(2, 2, distinctiveId(), { timeoutMs, library: lib }),
      () => NcclComm.init(0, 0, distinctiveId(), { timeoutMs, library: lib }),
      () => NcclComm.init(2, 0, distinctiveId(), { timeoutMs: 0, library: lib }),
    ];
    for (const f of bad) expect(await f().catch((x: unknown) => x)).toBeInstanceOf(RangeError);
    expect(() => comm.allReduce(1, 2, -1, "f32", "sum", 0)).toThrow(RangeError);
    expect(() => comm.allReduce(1, 2, 1.5, "f32", "sum", 0)).toThrow(RangeError);
    expect(() => comm.allReduce(1, 2, 4, "f17" as NcclDType, "sum", 0)).toThrow(RangeError);
    expect(() => comm.allReduce(1, 2, 4, "f32", "xor" as NcclRedOp, 0)).toThrow(RangeError);
    expect(() => comm.broadcast(1, 2, 4, "f32", 4, 0)).toThrow(RangeError);
  });

  // Addresses above 2^32 and a bigint stream, as the CUDA backend hands them over.
  const send: Ptr = 0x7f12_3456_7000;
  const recv: Ptr = 0x7f12_3456_9000;
  const stream = 0x5612_0000_1230n;
  const dtypes = Object.keys(ncclDataTypes) as NcclDType[];
  const ops = Object.keys(ncclRedOps) as NcclRedOp[];

  describe.each(dtypes)("collectives with dtype %s", (dtype) => {
    /** The record of a collective of this dtype from `send` to `recv` on `stream`, with `over` on top. */
    const call = (over: Pick<CollCall, "count"> & Partial<CollCall>) =>
      collCall(comm, stream, { send: BigInt(send), recv: BigInt(recv), dtype: BigInt(ncclDataTypes[dtype]), ...over });

    test.each(ops)("allReduce op %s passes every argument through", (op) => {
      comm.allReduce(send, recv, 1_000_003, dtype, op, stream);
      expect(collRecord(fake)).toEqual(call({ count: 1_000_003n, op: BigInt(ncclRedOps[op]) }));
    });

    test("reduceScatter, allGather and broadcast pass every argument through", () => {
      comm.reduceScatter(send, recv, 4096, dtype, "avg", Number(stream));
      expect(collRecord(fake)).toEqual(call({ count: 4096n, op: 4n }));
      comm.allGather(send, recv, 77, dtype, stream);
      expect(collRecord(fake)).toEqual(call({ count: 77n }));
      // in place (recv is send), from rank 3, on the default stream
      comm.broadcast(send, send, 5, dtype, 3, 0);
      expect(collRecord(fake)).toEqual(call({ recv: BigInt(send), count: 5n, root: 3n, stream: 0n }));
    });
  });

  test("the enums are NCCL's", () => {
    expect(ncclDataTypes).toEqual({ i8: 0, u8: 1, i32: 2, f16: 6, f32: 7, f64: 8, bf16: 9 });
    expect(ncclRedOps).toEqual({ sum: 0, prod: 1, max: 2, min: 3, avg: 4 });
  });

  test.each([
    [1, "ncclUnhandledCudaError", "unhandled cuda error (fake)"],
    [2, "ncclSystemError", "unhandled system error (fake)"],
    [6, "ncclRemoteError", "remote process exited"],
  ] as const)("error code %d from a collective is NcclError %s", (code, codeName, text) => {
    fake.fake_fail_next(code);
    const e = expectThrown(
      () => comm.allReduce(send, recv, 8, "f32", "sum", stream),
      NcclError,
      codeName,
      text,
      "ncclAllReduce",
    ) as NcclError;
    expect({ name: e.name, code: e.code, codeName: e.codeName, call: e.call }).toEqual({
      name: "NcclError",
      code,
      codeName,
      call: "ncclAllReduce",
    });
  });

  test("a collective answered ncclInProgress leaves the communicator pending until settled", async () => {
    fake.fake_in_progress_next(3);
    comm.allReduce(send, recv, 8, "f32", "sum", stream);
    expect(comm.pending).toBe(true);
    // NCCL forbids any call on the communicator until it is ready again
    expectThrown(() => comm.allGather(send, recv, 8, "f32", stream), Error, "await settled()");
    await comm.settled(timeoutMs);
    expect(comm.pending).toBe(false);
    comm.allGather(send, recv, 9, "f32", stream);
    expect(collRecord(fake).count).toBe(9n);
  });

  test("pollAsyncError reports an asynchronous error as NcclError, and null when healthy", () => {
    expect(comm.pollAsyncError()).toBeNull();
    fake.fake_set_async_state(6);
    const e = comm.pollAsyncError();
    expect(e).toBeInstanceOf(NcclError);
    expect({ codeName: e?.codeName, call: e?.call }).toEqual({
      codeName: "ncclRemoteError",
      call: "ncclCommGetAsyncError",
    });
    fake.fake_set_async_state(0);
    expect(comm.pollAsyncError()).toBeNull();
  });

  test("a group that ends in progress hands back its pending communicators", async () => {
    const before = counts(fake);
    NcclComm.groupStart(lib);
    comm.allReduce(send, recv, 8, "f32", "sum", stream);
    comm.allReduce(recv, recv, 8, "bf16", "max", stream);
    fake.fake_in_progress_next(2);
    const pending = NcclComm.groupEnd(lib);
    expect(pending).toEqual([comm]);
    expect(comm.pending).toBe(true);
    await comm.settled(timeoutMs);
    const after = counts(fake);
    expect([after.groupStarts - before.groupStarts, after.groupEnds - before.groupEnds]).toEqual([1, 1]);
    NcclComm.groupStart(lib);
    comm.broadcast(send, recv, 8, "f32", 0, stream);
    expect(NcclComm.groupEnd(lib)).toEqual([]);
    expect(() => NcclComm.groupEnd(lib)).toThrow("without ncclGroupStart");
  });

  test("destroy finalizes (polled), then destroys; a destroyed communicator refuses calls", async () => {
    fake.fake_reset();
    const c = await NcclComm.init(2, 0, distinctiveId(), { timeoutMs, library: lib });
    await c.destroy(timeoutMs);
    expect(counts(fake)).toMatchObject({ finalizes: 1, destroys: 1, aborts: 0 });
    await c.destroy(timeoutMs); // idempotent
    expect(counts(fake).destroys).toBe(1);
    expectThrown(() => c.allReduce(send, recv, 8, "f32", "sum", stream), Error, "destroyed");
    const d = await NcclComm.init(2, 0, distinctiveId(), { timeoutMs, library: lib });
    d.abort();
    d.abort();
    expect(counts(fake).aborts).toBe(1);
  });
});

describe("NCCL < 2.14: the blocking init runs on the shim's thread", () => {
  let lib: NcclLibrary;
  let fake: Controls;

  beforeAll(() => {
    const path = compileFake("libfakenccl-legacy.so", ["-DFAKE_LEGACY"]);
    fake = openControls(path);
    lib = NcclLibrary.open(path);
  });

  test("the event loop runs while ncclCommInitRank blocks, and the id arrives by value", async () => {
    fake.fake_reset();
    expect({ version: lib.versionText, nonBlocking: lib.nonBlockingInit }).toEqual({
      version: "2.13.4",
      nonBlocking: false,
    });
    const id = distinctiveId();
    let done = false;
    const init = NcclComm.init(2, 1, id, { timeoutMs, library: lib }).then((c) => {
      done = true;
      return c;
    });
    await new Promise((resolve) => setTimeout(resolve, 0)); // a timer fires while init is blocked in NCCL
    expect(done).toBe(false);
    fake.fake_release_legacy_init();
    const c = await init;
    expect(initRecord(fake)).toMatchObject({ id, nranks: 2, rank: 1, calls: 1 });
    c.allReduce(0x1000, 0x2000, 16, "f32", "sum", 0);
    expect(collRecord(fake).count).toBe(16n);
    await c.destroy(timeoutMs); // no ncclCommFinalize before 2.14: straight to destroy
    expect(counts(fake)).toMatchObject({ finalizes: 0, destroys: 1 });
  });

  test("a timeout abandons the thread, which aborts the communicator when NCCL returns", async () => {
    fake.fake_reset();
    const e = (await NcclComm.init(2, 0, distinctiveId(), { timeoutMs: 20, library: lib }).catch(
      (x: unknown) => x,
    )) as NcclError;
    expect({ name: e.name, codeName: e.codeName, call: e.call }).toEqual({
      name: "NcclError",
      codeName: "ncclTimeout",
      call: "ncclCommInitRank",
    });
    fake.fake_release_legacy_init();
    await waitFor("the abandoned init to abort its communicator", () => counts(fake).aborts === 1, timeoutMs);
  });
});

// ---- a real GPU -----------------------------------------------------------------------------

/** The CUDA backend as far as these checks need it: memory, copies and its stream. */
export type StreamBackend = Backend & { readonly stream: bigint | Ptr };

/**
 * Runs every collective on a one-rank communicator and checks the results on the device
 * (with one rank, each one copies send to recv, scaled by nothing). Call it with a communicator
 * made on the backend's device (the backend's context current) and the backend itself:
 *   const comm = await NcclComm.init(1, 0, getUniqueId(), { timeoutMs: 30_000 });
 *   await runOneRankCollectives(comm, backend);
 * Throws on the first wrong result.
 */
export async function runOneRankCollectives(comm: NcclComm, backend: StreamBackend): Promise<void> {
  if (comm.nranks !== 1)
    throw new Error(`runOneRankCollectives needs a one-rank communicator, got ${comm.nranks} ranks`);
  const n = 1000;
  const input = Float32Array.from({ length: n }, (_, i) => i * 0.5 - 7);
  const src = backend.alloc(n * 4);
  const dst = backend.alloc(n * 4);
  const settle = async () => {
    if (comm.pending) await comm.settled();
  };
  const expectCopied = async (what: string) => {
    await settle();
    const out = new Float32Array(n);
    backend.download(dst.ptr, out); // synchronizes the stream
    const bad = out.findIndex((v, i) => v !== input[i]);
    if (bad >= 0) throw new Error(`${what}: element ${bad} is ${out[bad]}, expected ${input[bad]}`);
    backend.zero(dst.ptr, n * 4);
  };
  try {
    backend.upload(src.ptr, input);
    for (const op of ["sum", "prod", "max", "min", "avg"] as const) {
      comm.allReduce(src.ptr, dst.ptr, n, "f32", op, backend.stream);
      await expectCopied(`allReduce ${op}`);
    }
    comm.reduceScatter(src.ptr, dst.ptr, n, "f32", "sum", backend.stream);
    await expectCopied("reduceScatter");
    comm.allGather(src.ptr, dst.ptr, n, "f32", backend.stream);
    await expectCopied("allGather");
    comm.broadcast(src.ptr, dst.ptr, n, "f32", 0, backend.stream);
    await expectCopied("broadcast");
    NcclComm.groupStart();
    comm.allReduce(src.ptr, dst.ptr, n / 2, "f32", "sum", backend.stream);
    comm.allReduce(src.ptr + (n / 2) * 4, dst.ptr + (n / 2) * 4, n / 2, "f32", "sum", backend.stream);
    for (const c of NcclComm.groupEnd()) await c.settled();
    await expectCopied("grouped allReduce");
    const asyncError = comm.pollAsyncError();
    if (asyncError !== null) throw asyncError;
  } finally {
    backend.free(src);
    backend.free(dst);
  }
}

const realNccl = tryFindLibrary(ncclLibrarySpec);
// scripts/emulated-gpus.sh shows emulated GPUs (FAKE_CUDA_DEVICES), with the emulated NCCL as "libnccl"
const gpuPresent =
  existsSync("/dev/nvidia0") || existsSync("/dev/nvidiactl") || process.env.FAKE_CUDA_DEVICES !== undefined;
const ncclMissing = realNccl === null ? "no libnccl here (pip install nvidia-nccl-cu13, or set MESHTRAIN_NCCL)" : null;
const gpuMissing = gpuPresent ? null : "no GPU device node (/dev/nvidia0, /dev/nvidiactl)";

describe("real NCCL", () => {
  // pip's nvidia-nccl-cu13 on a machine without a GPU: the library loads, makes ids, and a
  // communicator fails cleanly (NCCL checks CUDA before it reads the id or the config).
  test.skipIf(skip("libnccl", ncclMissing) || skip("a machine without a GPU", gpuPresent ? "a GPU is present" : null))(
    "real libnccl without a GPU",
    async () => {
      const lib = NcclLibrary.open(realNccl!);
      expect(lib.nonBlockingInit).toBe(lib.version.code >= 21400);
      const id = lib.getUniqueId();
      expect(id.length).toBe(ncclUniqueIdBytes);
      expect(id.some((b) => b !== 0)).toBe(true);
      const e = (await NcclComm.init(1, 0, id, { timeoutMs, library: lib }).catch((x: unknown) => x)) as NcclError;
      expect(e).toBeInstanceOf(NcclError);
      expect({ codeName: e.codeName, call: e.call }).toEqual({
        codeName: "ncclUnhandledCudaError",
        call: lib.nonBlockingInit ? "ncclCommInitRankConfig" : "ncclCommInitRank",
      });
      expect(e.message).toContain("NCCL's most recent warning (possibly another call's): Cuda failure");
    },
  );

  test.skipIf(skip("libnccl", ncclMissing) || skip("a GPU", gpuMissing))(
    "one-rank communicator on a real GPU",
    async () => {
      const cuda = await import("../../ffi/cuda/backend.ts");
      const probe = cuda.probeCuda();
      if (!probe.ok) throw new Error(`a GPU device node exists but CUDA is not usable: ${probe.reason}`);
      const backend = new cuda.CudaBackend({ device: 0 }); // makes the device's primary context current
      try {
        const comm = await NcclComm.init(1, 0, getUniqueId(), { timeoutMs: 60_000 });
        try {
          await runOneRankCollectives(comm, backend);
        } finally {
          await comm.destroy();
        }
      } finally {
        (backend as { dispose?: () => void }).dispose?.();
      }
    },
    120_000,
  );
});

describe("NcclCollective: the Collective over a (fake) communicator", () => {
  let fake: Controls;
  let comm: NcclComm;
  let coll: NcclCollective;
  let library: NcclLibrary;
  const buf = { ptr: 0x7f00_0000_1000, count: 4 * 1000 };
  const stream = 0x5612_0000_4560n;

  beforeAll(async () => {
    const path = compileFake("libfakenccl-coll.so", []);
    fake = openControls(path);
    fake.fake_reset();
    library = NcclLibrary.open(path);
    comm = await NcclComm.init(4, 2, distinctiveId(), { timeoutMs, library });
    coll = new NcclCollective(comm, stream, { ptr: 0x7f00_0000_0040, count: 1 });
  });

  const call = (over: Parameters<typeof collCall>[2]) => collCall(comm, stream, over);

  test("all-reduce in place, sum or mean; an empty buffer calls nothing", async () => {
    await coll.allReduce(buf, { step: 1, bucket: 0 });
    expect(collRecord(fake)).toEqual(
      call({ send: BigInt(buf.ptr), recv: BigInt(buf.ptr), count: 4000n, dtype: 7n, op: 0n }),
    );
    await coll.allReduce(buf, { step: 1, bucket: 1 }, "avg");
    expect(collRecord(fake).op).toBe(4n);
    await coll.allReduce({ ptr: 0x10, count: 0 }, { step: 1, bucket: 2 });
    expect(collRecord(fake).send).toBe(BigInt(buf.ptr));
  });

  test("reduce-scatter in place into this rank's block; all-gather from it; segments as the ring's", async () => {
    const mine = await coll.reduceScatter(buf, { step: 2, bucket: 0 });
    expect(mine).toEqual({ offset: 2000, count: 1000 });
    expect(collRecord(fake)).toEqual(
      call({ send: BigInt(buf.ptr), recv: BigInt(buf.ptr + 2000 * 4), count: 1000n, dtype: 7n, op: 0n }),
    );
    await coll.allGather(buf, { step: 2, bucket: 1 });
    expect(collRecord(fake)).toEqual(
      call({ send: BigInt(buf.ptr + 2000 * 4), recv: BigInt(buf.ptr), count: 1000n, dtype: 7n }),
    );
    await expect(coll.reduceScatter({ ptr: buf.ptr, count: 4001 }, { step: 2, bucket: 2 })).rejects.toThrow(
      /not a multiple of the 4 ranks/,
    );
  });

  test("broadcast and barrier", async () => {
    await coll.broadcast(buf, 3, { step: 3, bucket: 0 });
    expect(collRecord(fake)).toEqual(
      call({ send: BigInt(buf.ptr), recv: BigInt(buf.ptr), count: 4000n, dtype: 7n, root: 3n }),
    );
    await coll.barrier({ step: 3, bucket: 1 });
    expect(collRecord(fake)).toEqual(
      call({ send: 0x7f00_0000_0040n, recv: 0x7f00_0000_0040n, count: 1n, dtype: 7n, op: 0n }),
    );
  });

  test("join() on a side stream that never drains (a peer died after connecting: real NCCL waits for it) ends at the settle timeout: the communicator aborted, CollectiveTimeoutError now and for every later call", async () => {
    const own = await NcclComm.init(4, 2, distinctiveId(), { timeoutMs, library });
    const order = { afterCompute() {}, joinCompute() {}, drained: () => false };
    const side = new NcclCollective(own, stream, { ptr: 0x7f00_0000_0040, count: 1 }, 80, order);
    const aborts = counts(fake).aborts;
    await side.allReduce(buf, { step: 1, bucket: 0 });
    const t0 = performance.now();
    const e = await side.join().then(
      () => null,
      (err: Error) => err,
    );
    expect(e).toBeInstanceOf(CollectiveTimeoutError);
    expect(e?.message).toContain("have not finished within 80 ms");
    expect(performance.now() - t0).toBeGreaterThanOrEqual(75);
    expect(counts(fake).aborts).toBe(aborts + 1);
    await expect(side.allReduce(buf, { step: 1, bucket: 1 })).rejects.toBeInstanceOf(CollectiveTimeoutError);
    await expect(side.join()).rejects.toBeInstanceOf(CollectiveTimeoutError);
  });

  test("an asynchronous error is thrown by the next operation (a transport failure: every rank rewinds); close aborts, and later calls are refused", async () => {
    fake.fake_set_async_state(3);
    const e = await coll.allReduce(buf, { step: 4, bucket: 0 }).then(
      () => null,
      (err: Error) => err,
    );
    expect(e).toBeInstanceOf(CollectiveTransportError);
    expect(e?.cause).toBeInstanceOf(NcclError);
    expect(e?.message).toContain("ncclInternalError");
    fake.fake_set_async_state(0);
    coll.close();
    expect(counts(fake).aborts).toBeGreaterThanOrEqual(1);
    await expect(coll.allReduce(buf, { step: 4, bucket: 1 })).rejects.toBeInstanceOf(CollectiveClosedError);
  });
});
