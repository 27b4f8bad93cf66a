#!/usr/bin/env bun
// trainer process of one rank: `bun services/trainer/main.ts --rank 0 --nats-url nats://...`
import { m as metrics, onScrape } from "../runtime/mesh/metrics.ts";
import { readFileSync } from "node:fs";
import { z } from "zod";
import { type DeviceChoice, deviceChoices, openBackend } from "../../ffi/select.ts";
import { meshMembers } from "../runtime/mesh/discovery.ts";
import { JobLedger } from "../runtime/job/ledger.ts";
import { ncclIdExchange } from "../runtime/job/nccl-id.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/mesh/service.ts";
import { TrainerBackends } from "./backends.ts";
import type { Backend } from "../../ffi/backend.ts";
import { CudaBackend } from "../../ffi/cuda/backend.ts";
import { ncclInstallHint, ncclLibrarySpec } from "../../ffi/cuda/nccl.ts";
import { tryFindLibrary } from "../../ffi/find-library.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { Trainer } from "./service.ts";
import { netAddressOf } from "../runtime/transport/collective-bus.ts";
import { ringDefaults } from "../../engine/parallel/ring.ts";

const schema = baseConfigSchema.extend({
  /** this process's trainer rank; jobs with `trainers` <= rank leave it idle */
  rank: z.number().int().min(0).max(63),
  /** compute device (MT_DEVICE / --device): auto picks CUDA when a driver and a GPU are present */
  device: z.enum(deviceChoices),
  /** this rank's index among the ranks of its machine (MT_LOCAL_RANK / --local-rank): it picks
   *  the GPU (local rank mod the GPUs visible); default the rank (one machine) */
  localRank: z.number().int().min(0).max(63).optional(),
  /** test-only (MT_STEP_DELAY_MS / --step-delay-ms): sleep this long in every step's compute, to
   *  make this rank a straggler on purpose; 0 in any real run */
  stepDelayMs: z.number().int().min(0).max(60_000),
  /** test-only (MT_STEP_DELAY_FILE / --step-delay-file): a file that holds the step delay in
   *  milliseconds, read at every step in place of stepDelayMs, so that a test paces a job only
   *  while it needs to (a missing or empty file: no delay) */
  stepDelayFile: z.string().min(1).max(4096).optional(),
  /** where this rank takes collective pieces over TCP from other machines (MT_COLL_ADDRESS /
   *  --coll-address): "auto" (this machine's first address that is not loopback), "none" (its
   *  peers send through NATS), or an address of this machine */
  collAddress: z.string().regex(/^(auto|none|[0-9A-Za-z.:%-]{1,64})$/, "auto, none or an address of this machine"),
  /** how long a collective over the ring may make no progress before it fails and every rank
   *  restores from the job's newest snapshot (MT_COLL_TIMEOUT_MS / --coll-timeout-ms): a cut-off
   *  peer is given up on after it; NCCL's own watch is apart */
  collTimeoutMs: z.number().int().min(1_000).max(3_600_000),
});
type Config = BaseConfig & {
  rank: number;
  collAddress: string;
  collTimeoutMs: number;
  localRank?: number;
  device: DeviceChoice;
  stepDelayMs: number;
  stepDelayFile?: string;
};

/** The step delay a test wrote into `path`: its whole milliseconds, 0 when the file is missing
 *  or empty; a value that is not a delay (text, < 0, > 60 s) is an error the step fails with. */
function delayOfFile(path: string): number {
  let text: string;
  try {
    text = readFileSync(path, "utf8").trim();
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "ENOENT") return 0;
    throw e;
  }
  if (text === "") return 0;
  const ms = Number(text);
  if (!Number.isInteger(ms) || ms < 0 || ms > 60_000)
    throw new RangeError(`${path}: a step delay is whole milliseconds from 0 to 60000, not ${JSON.stringify(text)}`);
  return ms;
}

// Default cpu, not auto: a host runs several trainer ranks (the local mesh and the compose
// file start one process per rank), and auto would put every one of them on GPU 0, each with
// its own CUDA context, for a model whose step is dominated by pushing and pulling the
// parameter slab. A GPU host opts in with MT_DEVICE=auto or cuda.
const deviceDefault: DeviceChoice = "cpu";

/** opened by prepare(), before start() */
let backends: TrainerBackends | null = null;
function openedBackends(): TrainerBackends {
  if (backends === null) throw new Error("the trainer's backends are opened in prepare(), before start()");
  return backends;
}

/** What this trainer announces of its device: "cuda" with its GPU's UUID and whether NCCL is
 *  found, or "cpu". */
function placeMetadata(backend: Backend, log: Logger): Record<string, string> {
  if (!(backend instanceof CudaBackend)) return { device: backend.name };
  let nccl: string | null = null;
  try {
    nccl = tryFindLibrary(ncclLibrarySpec);
  } catch (e) {
    log.warn({ err: (e as Error).message }, "NCCL cannot be loaded; all-reduce jobs take the ring");
  }
  if (nccl === null) log.info(`no NCCL library found (${ncclInstallHint}); all-reduce jobs take the ring`);
  return { device: "cuda", gpu: backend.deviceUuid, nccl: nccl === null ? "no" : "yes" };
}

await runService<Config>({
  name: "trainer",
  description: "the training loop: batches in, gradients out",
  schema,
  defaults: {
    ...baseConfigDefaults,
    rank: 0,
    stepDelayMs: 0,
    device: deviceDefault,
    collAddress: "auto",
    collTimeoutMs: ringDefaults.progressTimeoutMs,
  },
  metadata: (c) => ({ rank: String(c.rank), host: c.host }),
  logFields: (c) => ({ rank: c.rank }),
  // the device opens before the process registers (a bad one fails it at start), so that its
  // $SRV metadata says where it computes: the all-reduce's plan (collective-plan.ts) reads it
  prepare({ config, log }) {
    backends = new TrainerBackends({
      device: config.device,
      who: `trainer ${config.rank}`,
      open: (attention) =>
        openBackend(
          config.device,
          (why, detail) => log.info({ device: config.device, attention, detail }, why),
          config.localRank ?? config.rank,
          { attention },
        ),
    });
    return placeMetadata(backends.first, log);
  },
  async start({ config, log, bus }) {
    // a job's attention choice may open one more backend on the device when the job opens (backends.ts)
    const backends = openedBackends();
    onScrape(() => metrics.deviceMemory.set({ device: backends.first.name }, backends.liveBytes));
    const ledger = await JobLedger.open(bus, log);
    const trainer = new Trainer({
      bus,
      rank: config.rank,
      backendFor: (cfg) => backends.forJob(cfg),
      log,
      payloadBytesMax: config.payloadBytesMax,
      control: ledger,
      members: (needs, waitMs) => meshMembers(bus, { needs, waitMs }),
      ncclIds: ncclIdExchange(bus),
      stepDelayMs:
        config.stepDelayFile !== undefined ? () => delayOfFile(config.stepDelayFile!) : () => config.stepDelayMs,
      host: config.host,
      collective: {
        transport: { netAddress: netAddressOf(config.collAddress) },
        progressTimeoutMs: config.collTimeoutMs,
      },
    });
    const watch = await ledger.follow(`trainer ${config.rank}`, trainer);
    return {
      async stop() {
        watch.stop();
        await trainer.stop();
      },
    };
  },
});
