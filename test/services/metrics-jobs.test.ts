// A long-lived service's metrics do not grow with every job it ran: the series of the last
// closedJobsKept jobs it closed stay (a scrape after a job's end still reads its last values),
// older ones are dropped, and a job opened again is live (not dropped while it runs).
import { expect, test } from "bun:test";
import { closedJobsKept, jobClosed, jobOpened, m, registry } from "../../services/runtime/mesh/metrics.ts";

/** The jobs of this test that mt_trainer_step has series of. */
const jobsIn = async (): Promise<string[]> => {
  const text = await registry.getSingleMetricAsString("mt_trainer_step");
  return [...text.matchAll(/job="(t\.metrics-\d+)"/g)].map((x) => x[1]!).sort();
};
const settle = () => Bun.sleep(10); // the series are dropped once each metric is read

test("the series of the newest closed jobs stay, older ones go; a job opened again stays while it runs", async () => {
  const jobs = Array.from({ length: 3 * closedJobsKept }, (_, i) => `t.metrics-${i}`);
  const open = (job: string) => {
    jobOpened(job);
    m.trainerStep.set({ job }, 7);
    m.trainerPhase.set({ job, phase: "compute" }, 0.1);
  };
  for (const job of jobs.slice(0, closedJobsKept + 4)) open(job);
  for (const job of jobs.slice(0, closedJobsKept + 4)) jobClosed(job);
  await settle();
  // the newest closedJobsKept closed stay
  expect(await jobsIn()).toEqual(jobs.slice(4, closedJobsKept + 4).sort());
  // a closed job opened again (a resize reopens it) is live: however many close after it, it stays
  const reopened = jobs[closedJobsKept + 3]!;
  jobOpened(reopened);
  for (const job of jobs.slice(closedJobsKept + 4)) {
    open(job);
    jobClosed(job);
  }
  await settle();
  expect(await jobsIn()).toEqual([reopened, ...jobs.slice(jobs.length - closedJobsKept)].sort());
  // every metric of a dropped job goes, with every label set
  const phases = await registry.getSingleMetricAsString("mt_trainer_step_seconds");
  expect(phases).not.toContain(`job="${jobs[5]}"`);
  expect(phases).toContain(`job="${jobs.at(-1)}"`);
});
