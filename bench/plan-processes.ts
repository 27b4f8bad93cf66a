// One process per plan: each plan goes to a JSON file the script reads (its argv[2]), and each
// process prints one JSON result per line on stdout. Used by the collective and pipeline
// harnesses (bench/collective-rank.ts, bench/pipeline-stage.ts) and their tests.
import { writeFileSync } from "node:fs";
import { join } from "node:path";

export interface PlanRun<R> {
  /** per plan, the results its process printed, in order */
  results: R[][];
  codes: number[];
  stderr: string[];
}

/** Starts a plan's process (default: on this host; the hosts bench starts each in its host). */
export type PlanSpawn = (
  rank: number,
  argv: string[],
  options: { cwd: string; stdout: "pipe"; stderr: "pipe"; env: Record<string, string | undefined> },
) => Bun.Subprocess<"ignore", "pipe", "pipe">;

/** Runs `script` once per plan (plans[r].rank === r) to the end; processes left are killed. */
export async function runPlanProcesses<R>(
  script: string,
  dir: string,
  plans: readonly { job: string; rank: number }[],
  env: Record<string, string> = {},
  spawn: PlanSpawn = (_rank, argv, options) => Bun.spawn(argv, options),
): Promise<PlanRun<R>> {
  const procs = plans.map((plan) => {
    const file = join(dir, `${plan.job}-rank-${plan.rank}.json`);
    writeFileSync(file, JSON.stringify(plan));
    return spawn(plan.rank, [process.execPath, script, file], {
      cwd: join(import.meta.dir, ".."),
      stdout: "pipe",
      stderr: "pipe",
      env: { ...process.env, ...env },
    });
  });
  try {
    const outs = await Promise.all(
      procs.map(async (p) => ({
        out: await new Response(p.stdout).text(),
        err: await new Response(p.stderr).text(),
        code: await p.exited,
      })),
    );
    return {
      results: outs.map((o) =>
        o.out
          .split("\n")
          .filter((l) => l.startsWith("{"))
          .map((l) => JSON.parse(l) as R),
      ),
      codes: outs.map((o) => o.code),
      stderr: outs.map((o) => o.err),
    };
  } finally {
    for (const p of procs) if (p.exitCode === null) p.kill("SIGKILL");
  }
}
