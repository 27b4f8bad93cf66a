#!/usr/bin/env bun
// parameter-server shard process: `bun services/parameter-server/main.ts --shard 0 --nats-url nats://...`
import { z } from "zod";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { JobLedger } from "../runtime/job/ledger.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/mesh/service.ts";
import { jobsMaxDefault } from "./limits.ts";
import { ParameterServer } from "./service.ts";

const schema = baseConfigSchema.extend({
  /** this process's shard index; jobs with `shards` <= index leave it idle */
  shard: z.number().int().min(0).max(63),
  /** jobs served at once; one more fails at once with the reason */
  jobsMax: z.number().int().min(1).max(1024),
});
type Config = BaseConfig & { shard: number; jobsMax: number };

await runService<Config>({
  name: "parameter-server",
  description: "sharded parameters and optimizer state; BSP/ASP/SSP",
  schema,
  defaults: { ...baseConfigDefaults, shard: 0, jobsMax: jobsMaxDefault },
  metadata: (c) => ({ shard: String(c.shard) }),
  logFields: (c) => ({ shard: c.shard }),
  async start({ config, log, bus }) {
    const backend = new CpuBackend();
    const ps = new ParameterServer(
      bus,
      config.shard,
      backend,
      log,
      config.payloadBytesMax,
      config.jobsMax,
      config.host,
    );
    ps.serve();
    const ledger = await JobLedger.open(bus, log);
    const watch = await ledger.follow(`parameter-server ${config.shard}`, ps);
    return {
      async stop() {
        watch.stop(); // shards stay allocated until exit: requests in flight still use them
      },
    };
  },
});
