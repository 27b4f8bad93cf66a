#!/usr/bin/env bun
// data-loader process: `bun services/data-loader/main.ts --nats-url nats://...`
import { z } from "zod";
import { JobLedger } from "../runtime/job/ledger.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/mesh/service.ts";
import { jobsMaxDefault } from "./limits.ts";
import { DataLoader } from "./service.ts";

const schema = baseConfigSchema.extend({
  /** jobs served at once; one more fails at once with the reason */
  jobsMax: z.number().int().min(1).max(1024),
});
type Config = BaseConfig & { jobsMax: number };

await runService<Config>({
  name: "data-loader",
  description: "batches by (rank, step) with distributed sampling and prefetch",
  schema,
  defaults: { ...baseConfigDefaults, jobsMax: jobsMaxDefault },
  async start({ config, log, bus }) {
    const ledger = await JobLedger.open(bus, log);
    const loader = new DataLoader(bus, {
      payloadBytesMax: config.payloadBytesMax,
      jobsMax: config.jobsMax,
      log,
      control: ledger,
      host: config.host,
    });
    loader.serve();
    const watch = await ledger.follow("data-loader", loader);
    return {
      async stop() {
        watch.stop();
      },
    };
  },
});
