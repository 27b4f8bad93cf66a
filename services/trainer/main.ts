#!/usr/bin/env bun
// trainer process of one rank: `bun services/trainer/main.ts --rank 0 --nats-url nats://...`
import { z } from "zod";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { followJobs } from "../runtime/jobs.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/service.ts";
import { Trainer } from "./service.ts";

const schema = baseConfigSchema.extend({
  /** this process's trainer rank; jobs with `trainers` <= rank leave it idle */
  rank: z.number().int().min(0).max(63),
});
type Config = BaseConfig & { rank: number };

await runService<Config>({
  name: "trainer",
  description: "the training loop: batches in, gradients out",
  schema,
  defaults: { ...baseConfigDefaults, rank: 0 },
  metadata: (c) => ({ rank: String(c.rank) }),
  logFields: (c) => ({ rank: c.rank }),
  async start({ config, log, bus }) {
    const trainer = new Trainer(bus, config.rank, new CpuBackend(), log, config.payloadBytesMax);
    const watch = await followJobs(bus.nc, log, trainer);
    return {
      async stop() {
        watch.stop();
        await trainer.stop();
      },
    };
  },
});
