// What a job's header says of its settings (sdk/report.ts), without a mesh: each ZeRO stage
// names what it partitions as engine/parallel/zero.ts states it (the header once said stage 3
// partitioned only the optimizer state and the gradients).
import { expect, test } from "bun:test";
import { zeroPartitions } from "../../engine/parallel/zero.ts";
import { configSummary } from "../../sdk/report.ts";
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
