// The whole tree type-checks under the strict tsconfig.
import { expect, test } from "bun:test";
import { join } from "node:path";

test("tsc -p . reports no errors", () => {
  const root = join(import.meta.dir, "..");
  const p = Bun.spawnSync([join(root, "node_modules", ".bin", "tsc"), "-p", "."], {
    cwd: root,
    stdout: "pipe",
    stderr: "pipe",
  });
  expect(p.stdout.toString() + p.stderr.toString()).toBe("");
  expect(p.exitCode).toBe(0);
}, 60_000);
