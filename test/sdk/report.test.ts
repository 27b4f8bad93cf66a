// What a job's header says of its settings (sdk/report.ts), without a mesh: each ZeRO stage
// names what it partitions as engine/parallel/zero.ts states it (the header once said stage 3
// partitioned only the optimizer state and the gradients).
import { expect, test } from "bun:test";
import { zeroPartitions } from "../../engine/parallel/zero.ts";
import { configSummary, statusLines } from "../../sdk/report.ts";
import { warmupNote } from "../../sdk/local/precision.ts";
import { runningRecord } from "../../services/runtime/job/ledger.ts";
import type { TrainerStats } from "../../schemas/messages/trainer.ts";
import { jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";

test.each([1, 2, 3] as const)("ZeRO stage %d: the header names what it partitions", (zero) => {
  const c = parseJobConfig({ ...jobDefaults, job: "default.z", sync: "allreduce", zero });
  const header = configSummary(c).join("\n");
  expect(header).toContain(`ZeRO stage ${zero}: ${zeroPartitions[zero]} partitioned among the trainers`);
  expect(header.includes("the parameters")).toBe(zero === 3);
});

test("no ZeRO: the header says nothing of it", () => {
  const c = parseJobConfig({ ...jobDefaults, job: "default.z", sync: "allreduce" });
  expect(configSummary(c).join("\n")).not.toContain("ZeRO");
});

test("the header names compression, offload and where the optimizer runs", () => {
  const c = (over: object) => configSummary(parseJobConfig({ ...jobDefaults, job: "default.z", ...over })).join("\n");
  expect(c({ sync: "allreduce", zero: 3, compress: "int8" })).toContain(
    "compressed to int8 with error feedback where they cross hosts",
  );
  expect(c({ sync: "allreduce", zero: 1 })).toContain("on every trainer, for its partition (ZeRO)");
  expect(c({ sync: "allreduce", offload: "optimizer" })).toContain(
    "in every trainer's replica, in host memory (--offload optimizer)",
  );
  expect(c({ sync: "bsp", compress: "bf16" })).toContain(
    "BSP (every step waits for all trainers; pushes compressed to bf16 with error feedback, pulls a bf16 copy)",
  );
  expect(c({ sync: "ssp", staleness: 2, compress: "topk:0.01" })).toContain(
    "SSP (at most 2 steps ahead; pushes compressed to topk:0.01 with error feedback)",
  );
  const gpt = { model: { kind: "gpt", vocabSize: 0, blockSize: 32, nLayer: 2, nHead: 2, nEmbd: 32, dropout: 0 } };
  expect(
    c({
      ...gpt,
      sync: "allreduce",
      dataset: "text",
      valFraction: 0.1,
      trainers: 2,
      pipelineStages: 2,
      microBatches: 2,
    }),
  ).toContain("on every rank, for its part of the model");
});

test("status of a running all-reduce job: its step is its trainers' slowest (it has no shard clocks)", () => {
  const config = parseJobConfig({ ...jobDefaults, job: "default.ar", sync: "allreduce", trainers: 2 });
  const record = { ...runningRecord("default.ar", JSON.stringify(config), 1), totalSteps: 1000 };
  const trainers = [697, 698].map((step, rank) => ({ rank, step }) as TrainerStats);
  const lines = statusLines({ job: "default.ar", record, config, shards: [], trainers, checkpoints: [] });
  expect(lines).toContain("step       697 of 1000");
  const none = statusLines({
    job: "default.ar",
    record,
    config,
    shards: [],
    trainers: [{ rank: 0, error: "timeout" }],
    checkpoints: [],
  });
  expect(none).toContain("step       - of 1000");
});

test("train's header notes a warmup as long as the run (the learning rate never decays)", () => {
  expect(warmupNote(100, 20)).toStartWith("note: the 100 warmup steps (--warmup) are as many as the run's 20:");
  expect(warmupNote(20, 20)).not.toBeNull();
  expect(warmupNote(5, 20)).toBeNull();
});
