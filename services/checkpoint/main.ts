#!/usr/bin/env bun
// checkpoint process: `bun services/checkpoint/main.ts --dir runs/checkpoints --nats-url nats://...`
import { z } from "zod";
import { JobLedger } from "../runtime/jobs.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/service.ts";
import { CheckpointService } from "./service.ts";
import { CheckpointStore } from "./store.ts";

const schema = baseConfigSchema.extend({
  /** folder that holds <job>/<snapshot>/ */
  dir: z.string().min(1),
});
type Config = BaseConfig & { dir: string };

await runService<Config>({
  name: "checkpoint",
  description: "durable, verified snapshots of whole jobs",
  schema,
  defaults: { ...baseConfigDefaults, dir: "runs/checkpoints" },
  async start({ config, log, bus }) {
    const ledger = await JobLedger.open(bus.nc, bus, log);
    const svc = new CheckpointService(bus, new CheckpointStore(config.dir), log, config.payloadBytesMax, ledger);
    svc.serve();
    const watch = await ledger.follow("checkpoint", svc);
    return {
      async stop() {
        watch.stop();
      },
    };
  },
});
