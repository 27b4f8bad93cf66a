#!/usr/bin/env bun
// checkpoint process: `bun services/checkpoint/main.ts --dir runs/checkpoints --nats-url nats://...`
import { z } from "zod";
import { JobLedger } from "../runtime/job/ledger.ts";
import { type BaseConfig, baseConfigDefaults, baseConfigSchema, runService } from "../runtime/mesh/service.ts";
import { CheckpointService } from "./service.ts";
import { CheckpointStore } from "./store.ts";

const schema = baseConfigSchema.extend({
  /** folder that holds <job>/<snapshot>/ */
  dir: z.string().min(1),
  /** write every snapshot before answering its save (the ranks wait for the disk); by default a
   *  snapshot is staged (copied and checked) and written in the background while training goes on */
  syncSnapshots: z.boolean(),
  /** test-only: sleep this long before each background write (a slow disk, for the tests) */
  writeDelayMs: z.number().int().min(0).max(600_000),
});
type Config = BaseConfig & { dir: string; syncSnapshots: boolean; writeDelayMs: number };

await runService<Config>({
  name: "checkpoint",
  description: "durable, verified snapshots of whole jobs",
  schema,
  defaults: { ...baseConfigDefaults, dir: "runs/checkpoints", syncSnapshots: false, writeDelayMs: 0 },
  async start({ config, log, bus }) {
    const ledger = await JobLedger.open(bus, log);
    const svc = new CheckpointService(
      bus,
      new CheckpointStore(config.dir),
      log,
      config.payloadBytesMax,
      ledger,
      config.syncSnapshots,
      config.writeDelayMs,
    );
    svc.serve();
    const watch = await ledger.follow("checkpoint", svc);
    return {
      async stop() {
        watch.stop();
        await svc.flush(); // snapshots being written are finished
      },
    };
  },
});
