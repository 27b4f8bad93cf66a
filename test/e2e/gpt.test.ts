// The GPT on the mesh, in both modes: character windows of Moby Dick served by the data-loader,
// the plan (vocabulary, layout, steps) made at submission, trainers and shards that never read
// the text; the final snapshot exported as a gpt model file that `meshtrain eval` reads back to
// the loss the trainers reported.
import { afterAll, describe, expect, test } from "bun:test";
import { readModelFile } from "../../engine/modelfile.ts";
import { type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { gptJobDefaults, type JobConfig, parseJobConfig } from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { runEval } from "../../sdk/local/evaluate.ts";
import { watchJob } from "../../sdk/watch.ts";
import { effectiveSteps } from "../helpers/jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { startMesh } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

/** A small GPT (1 block, width 32, context 16): 40 steps of 2 x 16 windows. */
const config = (over: Partial<JobConfig>): JobConfig =>
  parseJobConfig({
    ...gptJobDefaults,
    model: { ...gptJobDefaults.model, nLayer: 1, nHead: 2, nEmbd: 32, blockSize: 16 },
    batchSize: 16,
    maxSteps: 40,
    warmupSteps: 10,
    lr: 3e-3,
    checkpointEvery: 20,
    chunkBytes: 16 << 10,
    bucketMb: 0.016,
    ...over,
  });

describe("gpt on the mesh", () => {
  test.each([
    ["allreduce", 0],
    ["bsp", 2],
  ] as const)(
    "%s: it learns Moby Dick's characters; the exported model evaluates to the loss the trainers reported",
    async (sync, shards) => {
      await using mesh = await startMesh("mt-gpt-", { trainers: 2, shards });
      await using client = await MeshClient.connect(mesh.url, mesh.auth());
      const cfg = config({ job: `default.gpt-${sync}`, sync, shards: Math.max(shards, 1) });
      const plan = await client.plan(cfg, { waitMs: 60_000 });
      expect([plan.vocabSize, plan.vocab.length, plan.testSamples, plan.totalSteps]).toEqual([
        plan.vocab.length,
        plan.vocab.length,
        0,
        40,
      ]);
      const seen: Event[] = [];
      await client.submit(cfg, { membersWaitMs: 60_000 });
      const r = await watchJob(client, cfg.job, { quiet: true, onEvent: (e) => seen.push(e) });
      expect(r.record.state).toBe(JobState.Done);
      expect(r.record.evalSplit).toBe("val");
      // from ln(vocab) = 4.4 nats/char at initialization
      expect(r.record.loss).toBeLessThan(3.5);
      expect(r.record.evaluated).toBe(plan.valSamples * 16);
      const steps = effectiveSteps(seen, 2);
      for (const rank of [0, 1]) expect(steps[rank]).toEqual(Array.from({ length: 40 }, (_, i) => i));
      expect(seen.some((e) => e.kind === EventKind.Failed)).toBe(false);
      const file = readModelFile(r.record.modelPath);
      expect(file.header.kind).toBe("gpt");
      expect(file.header.vocab!.join("").length).toBe(plan.vocabSize);
      const e = runEval({ model: r.record.modelPath, evalBatches: 0, device: "cpu" });
      expect(e.kind).toBe("gpt");
      expect(Math.abs(e.loss - r.record.loss) / r.record.loss).toBeLessThan(1e-4);
    },
    180_000,
  );
});
