// The tree is formatted as biome.json says (Biome, 160 columns): `npm run format` rewrites it.
import { expect, test } from "bun:test";
import { join } from "node:path";

test("biome format finds nothing to change", () => {
  const root = join(import.meta.dir, "..");
  const p = Bun.spawnSync([join(root, "node_modules", ".bin", "biome"), "format", "--max-diagnostics=20", "."], {
    cwd: root,
    stdout: "pipe",
    stderr: "pipe",
  });
  // the files it would change, and how; the fix is `npm run format`
  expect(p.exitCode === 0 ? "" : p.stdout.toString() + p.stderr.toString()).toBe("");
}, 60_000);
