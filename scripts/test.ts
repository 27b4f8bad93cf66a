// The README's test command runs this: `bun test` over test/ with a JUnit report next to bun's
// own console output, then one totals line, "N passed, N failed", which CI reads.
import { mkdirSync, readFileSync, rmSync } from "node:fs";
import { join } from "node:path";

const root = join(import.meta.dir, "..");
const reportDir = join(root, ".test-results");
const report = join(reportDir, "junit.xml");
rmSync(report, { force: true });
mkdirSync(reportDir, { recursive: true });

// Per-test limit: end-to-end tests train real models for several seconds on 2 cores.
const timeoutMs = 120_000;
const proc = Bun.spawnSync([process.execPath, "test", `--timeout=${timeoutMs}`, "--reporter=junit", `--reporter-outfile=${report}`,
  ...process.argv.slice(2)], {
  cwd: root,
  stdio: ["inherit", "inherit", "inherit"],
});
const code = proc.exitCode ?? 1;

let passed = 0;
let failed = 0;
try {
  const xml = readFileSync(report, "utf8");
  const top = /<testsuites\b([^>]*)>/.exec(xml)?.[1] ?? "";
  const attr = (name: string) => Number(new RegExp(`\\b${name}="(\\d+)"`).exec(top)?.[1] ?? 0);
  failed = attr("failures") + attr("errors");
  passed = attr("tests") - attr("failures") - attr("errors") - attr("skipped");
} catch {
  // no report: bun itself failed before running tests; counted below
}
// a non-zero exit with no failing test (a file that failed to load, say) is still a failure
if (code !== 0 && failed === 0) failed = 1;
console.log(`${passed} passed, ${failed} failed`);
process.exit(code);
