// The CLI as a user runs it: `meshtrain <args>` in a folder, through `npm run` (INIT_CWD: the
// folder its relative paths are resolved against), its exit code and output.
import { join } from "node:path";

const cliPath = join(import.meta.dir, "..", "..", "sdk", "cli", "main.ts");

export function runCli(dir: string, ...args: string[]): { code: number | null; out: string; err: string } {
  const p = Bun.spawnSync([process.execPath, cliPath, ...args], {
    cwd: dir,
    env: { ...process.env, INIT_CWD: dir },
    stdout: "pipe",
    stderr: "pipe",
  });
  return { code: p.exitCode, out: p.stdout.toString(), err: p.stderr.toString() };
}
