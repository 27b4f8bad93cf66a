#!/usr/bin/env bun
// data-loader process: `bun services/data-loader/main.ts --nats-url nats://...`
import { followJobs } from "../runtime/jobs.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/service.ts";
import { DataLoader } from "./service.ts";

await runService<BaseConfig>({
  name: "data-loader",
  description: "batches by (rank, step) with distributed sampling and prefetch",
  schema: baseConfigSchema,
  defaults: baseConfigDefaults,
  async start({ config, log, bus }) {
    const loader = new DataLoader(bus, log, config.payloadBytesMax);
    loader.serve();
    const watch = await followJobs(bus.nc, log, loader);
    return { async stop() { watch.stop(); } };
  },
});
