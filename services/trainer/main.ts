#!/usr/bin/env bun
// trainer process of one rank: `bun services/trainer/main.ts --rank 0 --nats-url nats://...`
import { m as metrics, onScrape } from "../runtime/mesh/metrics.ts";
import { hostname } from "node:os";
import { z } from "zod";
import { type DeviceChoice, deviceChoices, openBackend } from "../../ffi/select.ts";
import { meshMembers } from "../runtime/mesh/discovery.ts";
import { JobLedger } from "../runtime/job/jobs.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/mesh/service.ts";
import { TrainerBackends } from "./backends.ts";
import { Trainer } from "./service.ts";

const schema = baseConfigSchema.extend({
  /** this process's trainer rank; jobs with `trainers` <= rank leave it idle */
  rank: z.number().int().min(0).max(63),
  /** compute device (MT_DEVICE / --device): auto picks CUDA when a driver and a GPU are present */
  device: z.enum(deviceChoices),
  /** the machine this rank runs on (MT_HOST / --host), for the collective's topology: ranks with
   *  one label reduce among themselves first; default the machine's name */
  host: z
    .string()
    .min(1)
    .max(64)
    .regex(/^[A-Za-z0-9._-]+$/, "a host label is letters, digits, '.', '_' or '-'"),
  /** test-only (MT_STEP_DELAY_MS / --step-delay-ms): sleep this long in every step's compute, to
   *  make this rank a straggler on purpose; 0 in any real run */
  stepDelayMs: z.number().int().min(0).max(60_000),
});
type Config = BaseConfig & { rank: number; device: DeviceChoice; host: string; stepDelayMs: number };

// Default cpu, not auto: a host runs several trainer ranks (the local mesh and the compose
// file start one process per rank), and auto would put every one of them on GPU 0, each with
// its own CUDA context, for a model whose step is dominated by pushing and pulling the
// parameter slab. A GPU host opts in with MT_DEVICE=auto or cuda.
const deviceDefault: DeviceChoice = "cpu";

await runService<Config>({
  name: "trainer",
  description: "the training loop: batches in, gradients out",
  schema,
  defaults: {
    ...baseConfigDefaults,
    rank: 0,
    stepDelayMs: 0,
    device: deviceDefault,
    host:
      hostname()
        .replace(/[^A-Za-z0-9._-]/g, "-")
        .slice(0, 64) || "host",
  },
  metadata: (c) => ({ rank: String(c.rank), host: c.host }),
  logFields: (c) => ({ rank: c.rank }),
  async start({ config, log, bus }) {
    // the device opens now (a bad one fails the process at start); a job's attention choice may
    // open one more backend on it when the job opens (backends.ts)
    const backends = new TrainerBackends({
      device: config.device,
      who: `trainer ${config.rank}`,
      open: (attention) =>
        openBackend(
          config.device,
          (why, detail) => log.info({ device: config.device, attention, detail }, why),
          config.rank,
          { attention },
        ),
    });
    onScrape(() => metrics.deviceMemory.set({ device: backends.first.name }, backends.liveBytes));
    const ledger = await JobLedger.open(bus.nc, bus, log);
    const trainer = new Trainer({
      bus,
      rank: config.rank,
      backendFor: (cfg) => backends.forJob(cfg),
      log,
      payloadBytesMax: config.payloadBytesMax,
      control: ledger,
      members: () => meshMembers(bus.nc),
      stepDelayMs: config.stepDelayMs,
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
