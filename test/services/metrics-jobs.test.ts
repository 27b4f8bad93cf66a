// A long-lived service's metrics do not grow with every job it ran: the series of the last
// closedJobsKept jobs it closed stay (a scrape after a job's end still reads its last values),
// older ones are dropped, and a job opened again is live (not dropped while it runs).
import { expect, test } from "bun:test";
import { closedJobsKept, jobClosed, jobOpened, m, registry } from "../../services/runtime/mesh/metrics.ts";

const jobsIn = async (): Promise<Set<string>> => {
  const text = await registry.getSingleMetricAsString("mt_trainer_step");
  return new Set([...text.matchAll(/job="([^"]+)"/g)].map((x) => x[1]!));
};

test("the series of the newest closed jobs stay, older ones go; a reopened job's stay", async () => {
  const jobs = Array.from({ length: closedJobsKept + 4 }, (_, i) => `t.metrics-${i}`);
  for (const job of jobs) {
    jobOpened(job);
    m.trainerStep.set({ job }, 7);
    m.trainerPhase.set({ job, phase: "compute" }, 0.1);
  }
  // the first job is opened again (a resize) before the others close: it runs on
  for (const job of jobs.slice(1)) jobClosed(job);
  jobClosed(jobs[0]!);
  jobOpened(jobs[0]!);
  await Bun.sleep(10); // (the series are dropped once each metric is read)
  // closing 1..19 kept the newest 16 (4..19); closing 0 then dropped 4; 0 runs again
  expect([...(await jobsIn())].sort()).toEqual([jobs[0]!, ...jobs.slice(5)].sort());
  // every metric of a dropped job goes, with every label set
  const phases = await registry.getSingleMetricAsString("mt_trainer_step_seconds");
  expect(phases).not.toContain(`job="${jobs[1]}"`);
  expect(phases).toContain(`job="${jobs.at(-1)}"`);
});
