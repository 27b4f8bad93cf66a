// The README's test command runs this: `bun test` over test/ with a JUnit report next to bun's
// own console output, then, when anything skipped, one line saying why, and last one totals
// line, "N passed, N failed, N skipped" (CI reads its first two numbers). Tests say why they skip
// through test/helpers/skip.ts, which records {file, line, need, reason} in skips.jsonl.
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { type SkipRecord, skipsFileEnv } from "../test/helpers/skip.ts";

const root = join(import.meta.dir, "..");
const reportDir = join(root, ".test-results");
const report = join(reportDir, "junit.xml");
const skipsFile = join(reportDir, "skips.jsonl");
rmSync(report, { force: true });
mkdirSync(reportDir, { recursive: true });
writeFileSync(skipsFile, "");

// Per-test limit: end-to-end tests train real models for several seconds on 2 cores.
const timeoutMs = 120_000;
// Test files run in worker processes side by side: most of an e2e test's time is spent waiting
// on other processes (a mesh's services, nats-server), so two workers keep two cores busy where
// one left them idle two thirds of the time. test/timings.json holds each file's duration in a
// past run: bun sorts the files by path, cuts them into one run of files per worker of about equal
// total duration (here test/bench … test/e2e, and test/engine … test/testbed), and each worker
// runs its own files slowest first, then takes the slowest not yet started from the other. The
// durations of eight files are set by hand so that a file that mostly waits (mesh-cli's runs, the
// testbed's cut hosts) runs beside files that keep a core busy: measured alone, their
// CPU-seconds per second are 0.70 and 0.73 against 1.26 (mesh.test.ts), 1.22 (cli.test.ts) and
// 1.25 (the testbed's chaos). So the first worker runs mesh.test.ts, then the chaos and the
// fuzz; the second cli.test.ts, the testbed's chaos and mesh, then mesh-cli and the testbed's
// faults. (The fuzz's job once slept through the whole file, 0.57 CPU-s per second, and went first;
// its jobs and the chaos job now sleep only while their faults are to come.) Left to their
// measured durations, the fuzz and the testbed's faults started together, and the suite's first
// 200 s left about 100 core-seconds idle.
// MT_TEST_WORKERS=1 runs them one after another.
// Three workers left fewer cores idle (a sampled run: 25 of 1,545 core-seconds, against 156 of
// 1,680 with two; 774 s against 840 s) but overload two cores: in two such runs the fuzz's
// 10,000 messages took 66-73 s (36 s with two workers, 9 s alone) and its job ended first, a
// client's connect to NATS timed out, and a ZeRO-3 resume on fewer ranks failed ("holds no
// complete replica").
const workers = Number(process.env.MT_TEST_WORKERS ?? 2);
if (!Number.isInteger(workers) || workers < 1) {
  console.error(`MT_TEST_WORKERS must be a whole number of workers, 1 or more, not ${process.env.MT_TEST_WORKERS}`);
  process.exit(2);
}
const timings = join(root, "test", "timings.json");
// OpenMP threads (the C kernels' and OpenBLAS's) spin on a core for a while after each parallel
// region by default, which pays on a machine a process has to itself. Here the workers share the
// cores, and each runs meshes of processes besides: a waiting thread's spin takes the core from
// another test's work. Measured on 2 cores, cli.test.ts beside three engine and CLI files: 225 ->
// 119 CPU-s and 122 -> 66 s with the threads waiting passively. A value the user set is kept.
const ompWaitPolicy = process.env.OMP_WAIT_POLICY || "PASSIVE";
// Bun's allocator keeps the free holes inside its pages rather than handing each back to the kernel
// and faulting it in again on reuse, as the compose file sets for the services (it says why): the
// test workers and the CLI runs allocate and free as the services do. A value the user set is kept.
const purgeHoles = process.env.MIMALLOC_PURGE_HOLES || "0";
const parallel = workers > 1 ? [`--parallel=${workers}`, `--timings=${timings}`] : [];
const proc = Bun.spawnSync(
  [
    process.execPath,
    "test",
    `--timeout=${timeoutMs}`,
    ...parallel,
    "--reporter=junit",
    `--reporter-outfile=${report}`,
    ...process.argv.slice(2),
  ],
  {
    cwd: root,
    env: {
      ...process.env,
      OMP_WAIT_POLICY: ompWaitPolicy,
      MIMALLOC_PURGE_HOLES: purgeHoles,
      [skipsFileEnv]: skipsFile,
    },
    stdio: ["inherit", "inherit", "inherit"],
  },
);
const code = proc.exitCode ?? 1;

interface Totals {
  passed: number;
  failed: number;
  skipped: number;
  /** file and line of each skipped test case (a case in a skipped block has the block's line) */
  skippedCases: { file: string; line: number }[];
}

function readTotals(xml: string): Totals {
  const top = /<testsuites\b([^>]*)>/.exec(xml)?.[1] ?? "";
  const attr = (attrs: string, name: string) => new RegExp(`\\b${name}="([^"]*)"`).exec(attrs)?.[1];
  const count = (name: string) => Number(attr(top, name) ?? 0);
  const failed = count("failures") + count("errors");
  const skipped = count("skipped");
  const skippedCases: Totals["skippedCases"] = [];
  for (const m of xml.matchAll(/<testcase\b([^>]*?)(?:\/>|>([\s\S]*?)<\/testcase>)/g)) {
    if (!(m[2] ?? "").includes("<skipped")) continue;
    skippedCases.push({ file: unescapeXml(String(attr(m[1]!, "file") ?? "")), line: Number(attr(m[1]!, "line") ?? 0) });
  }
  return { passed: count("tests") - failed - skipped, failed, skipped, skippedCases };
}

function unescapeXml(s: string): string {
  return s
    .replace(/&quot;/g, '"')
    .replace(/&apos;/g, "'")
    .replace(/&lt;/g, "<")
    .replace(/&gt;/g, ">")
    .replace(/&amp;/g, "&");
}

/** The record that decided a skipped case: in its file, the last skip() at or above its line (a
 *  test's own, or its block's), else the first below (a skip() call wrapped onto a later line). */
function recordFor(c: { file: string; line: number }, records: SkipRecord[]): SkipRecord | undefined {
  const inFile = records.filter((r) => r.file === c.file).sort((a, b) => a.line - b.line);
  return inFile.findLast((r) => r.line <= c.line) ?? inFile[0];
}

/** "10 skipped: 6 need a GPU (why); 4 need libnccl (why)" (semicolons: the reasons hold commas) */
function skipSummary(totals: Totals, records: SkipRecord[]): string {
  const groups = new Map<string, number>();
  let unexplained = totals.skipped;
  for (const c of totals.skippedCases) {
    const r = recordFor(c, records);
    if (r === undefined) continue;
    const key = `${r.need} (${r.reason})`;
    groups.set(key, (groups.get(key) ?? 0) + 1);
    unexplained--;
  }
  const parts = [...groups].sort((a, b) => b[1] - a[1]).map(([key, n]) => `${n} ${n === 1 ? "needs" : "need"} ${key}`);
  if (unexplained > 0) parts.push(`${unexplained} with no reason recorded (test/helpers/skip.ts)`);
  return `${totals.skipped} skipped: ${parts.join("; ")}`;
}

let totals: Totals = { passed: 0, failed: 0, skipped: 0, skippedCases: [] };
try {
  totals = readTotals(readFileSync(report, "utf8"));
} catch {
  // no report: bun itself failed before running tests; counted below
}
// a non-zero exit with no failing test (a file that failed to load, say) is still a failure
if (code !== 0 && totals.failed === 0) totals.failed = 1;
if (totals.skipped > 0) {
  const records = existsSync(skipsFile)
    ? readFileSync(skipsFile, "utf8")
        .split("\n")
        .filter((l) => l !== "")
        .map((l) => JSON.parse(l) as SkipRecord)
    : [];
  console.log(skipSummary(totals, records));
}
console.log(`${totals.passed} passed, ${totals.failed} failed, ${totals.skipped} skipped`);
process.exit(code);
