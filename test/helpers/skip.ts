// Why a test skips. Every conditional skip goes through skip(): it says once, in the file's
// output, what is missing, and records it for the run's summary (scripts/test.ts groups the
// records: "10 skipped: 6 need a GPU (...); 4 need libnccl (...)").
import { appendFileSync } from "node:fs";
import { join, relative } from "node:path";

const root = join(import.meta.dir, "..", "..");

/** One line of the skips file (JSON lines); `line` is where skip() was called. */
export interface SkipRecord {
  readonly file: string;
  readonly line: number;
  readonly need: string;
  readonly reason: string;
}

/** The file scripts/test.ts asks the tests to record their skips in (it clears it per run). */
export const skipsFileEnv = "MESHTRAIN_SKIPS_FILE";

const said = new Set<string>();

/**
 * Whether to skip: true when `reason` (why `need` is missing here) is not null. `need` reads
 * after "N need": "a GPU", "libnccl". Call it on the line of the test or block it decides,
 * `test.skipIf(skip("libnccl", ncclMissing))("...", ...)`: the summary matches skipped tests
 * to the reasons by file and line.
 */
export function skip(need: string, reason: string | null): boolean {
  if (reason === null) return false;
  const { file, line } = callerLocation();
  const key = `${file}\n${need}\n${reason}`;
  if (!said.has(key)) {
    said.add(key);
    console.log(`skipping what needs ${need}: ${reason}`);
  }
  const path = process.env[skipsFileEnv];
  if (path !== undefined && path !== "") {
    const record: SkipRecord = { file, line, need, reason };
    appendFileSync(path, `${JSON.stringify(record)}\n`);
  }
  return true;
}

/** The file (relative to the repository root) and line that called skip(). */
function callerLocation(): { file: string; line: number } {
  const holder: { stack?: string } = {};
  Error.captureStackTrace(holder, skip); // frames from skip()'s caller down
  const frame = (holder.stack ?? "").split("\n").find((l) => l.trimStart().startsWith("at "));
  const m = frame === undefined ? null : /\(?([^()\s]+):(\d+):\d+\)?\s*$/.exec(frame);
  if (m === null) return { file: "unknown", line: 0 };
  return { file: relative(root, m[1]!), line: Number(m[2]) };
}
