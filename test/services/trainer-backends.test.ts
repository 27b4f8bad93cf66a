// A trainer process's backends by a job's attention choice (services/trainer/backends.ts), and the
// trainer opening a job on the backend of its choice: on a real CPU backend, and on stand-ins named
// "cuda" for the GPU's bookkeeping (which backend a choice gets, opened once, disposed of).
import { expect, test } from "bun:test";
import type { Backend } from "../../ffi/backend.ts";
import { NativeLibraryError } from "../../ffi/errors.ts";
import { type OpenedBackend, openBackend } from "../../ffi/select.ts";
import type { AttentionChoice } from "../../services/runtime/job/attention.ts";
import { gptJobDefaults, parseJobConfig, specOfConfig } from "../../services/runtime/job/config.ts";
import { MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { TrainerBackends } from "../../services/trainer/backends.ts";
import { Trainer } from "../../services/trainer/service.ts";
import { expectThrown } from "../helpers/errors.ts";

test("on the CPU every job shares the one backend; cudnn is refused, naming why the trainer is on the CPU", () => {
  const opened: AttentionChoice[] = [];
  const backends = new TrainerBackends({
    device: "cpu",
    who: "trainer 1",
    open: (attention) => {
      opened.push(attention);
      return openBackend("cpu", undefined, 1, { attention });
    },
  });
  try {
    expect(backends.first.name).toBe("cpu");
    expect(backends.forJob({ attention: "auto" })).toBe(backends.first);
    expect(backends.forJob({ attention: "reference" })).toBe(backends.first);
    expectThrown(
      () => backends.forJob({ attention: "cudnn" }),
      ConfigError,
      "attention cudnn needs a GPU (cuDNN's fused attention runs on one), but trainer 1 computes on the CPU (MT_DEVICE=cpu",
    );
    expect(opened).toEqual(["auto"]);
  } finally {
    backends.dispose();
  }
});

/** A stand-in for a CUDA backend: its name, its live bytes, whether it was disposed of. */
function standIn(liveBytes: number): Backend & { disposed: boolean } {
  const b = {
    name: "cuda",
    stats: { allocCount: 0, allocBytes: 0, liveBytes },
    disposed: false,
    dispose: () => {
      b.disposed = true;
    },
  };
  return b as unknown as Backend & { disposed: boolean };
}

test("on a GPU a choice other than auto opens its own backend at the first ask, kept for the jobs after it", () => {
  const opened: AttentionChoice[] = [];
  const made: (Backend & { disposed: boolean })[] = [];
  let cudnnLoads = false;
  const open = (attention: AttentionChoice): OpenedBackend => {
    opened.push(attention);
    if (attention === "cudnn" && !cudnnLoads)
      throw new NativeLibraryError("cuDNN not found (set MESHTRAIN_CUDNN, ...)");
    const backend = standIn(100 * (made.length + 1));
    made.push(backend);
    return { backend, why: "device: cuda:0", detail: "a GPU" };
  };
  const backends = new TrainerBackends({ device: "cuda", who: "trainer 0", open });
  const reference = backends.forJob({ attention: "reference" });
  expect(reference).not.toBe(backends.first);
  expect(backends.forJob({ attention: "reference" })).toBe(reference);
  expect(backends.forJob({ attention: "auto" })).toBe(backends.first);
  // a cuDNN that does not load fails the job that asked for it, not the process; a later ask tries again
  expectThrown(() => backends.forJob({ attention: "cudnn" }), NativeLibraryError, "cuDNN not found");
  cudnnLoads = true;
  const cudnn = backends.forJob({ attention: "cudnn" });
  expect(new Set([backends.first, reference, cudnn]).size).toBe(3);
  expect(opened).toEqual(["auto", "reference", "cudnn", "cudnn"]);
  expect(backends.liveBytes).toBe(100 + 200 + 300);
  backends.dispose();
  expect(made.map((b) => b.disposed)).toEqual([true, true, true]);
});

test("a trainer opens a job on the backend of the job's attention, and a refusal fails the opening", () => {
  const asked: string[] = [];
  const trainer = new Trainer({
    bus: new MemoryBus(),
    rank: 0,
    payloadBytesMax: 1 << 20,
    backendFor: (cfg) => {
      asked.push(cfg.attention);
      throw new ConfigError(`attention ${cfg.attention} needs a GPU`);
    },
  });
  const cfg = parseJobConfig({ ...gptJobDefaults, job: "o.g", precision: "bf16", attention: "cudnn" });
  expectThrown(() => trainer.openJob(specOfConfig(cfg)), ConfigError, "attention cudnn needs a GPU");
  // a rank the job does not use opens nothing
  const idle = new Trainer({ bus: new MemoryBus(), rank: 5, payloadBytesMax: 1 << 20, backendFor: trainerUnused });
  idle.openJob(specOfConfig(cfg));
  expect(asked).toEqual(["cudnn"]);
});

function trainerUnused(): Backend {
  throw new Error("a rank the job does not use asked for a backend");
}
