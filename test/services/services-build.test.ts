// The services' compiled executable (services/build.ts): run only while it matches what it was
// built from, and the same program as the sources when it runs.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync, utimesSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { composePath, readTopology } from "../../sdk/local-mesh.ts";
import { serviceNames } from "../../services/bin.ts";
import { fileNow, type Stamp, servicesExecutable, stampHolds } from "../../services/build.ts";
import { configExitCode } from "../../services/runtime/mesh/service.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";

afterAll(removeTempDirs);

const root = join(import.meta.dir, "..", "..");

describe("the stamp", () => {
  const dir = tempDir("mt-stamp-");
  mkdirSync(join(dir, "a"));
  const files = ["a/one.ts", "two.js"];
  for (const f of files) writeFileSync(join(dir, f), `// ${f}\n`);
  const stamp = (): Stamp => ({ bun: Bun.version, inputs: files.map((f) => fileNow(f, dir)!) });

  test("holds while every file it lists is as it was", () => {
    expect(stampHolds(stamp(), dir)).toBe(true);
  });

  test("fails once a file is changed, even to the same size, or is gone", () => {
    const s = stamp();
    writeFileSync(join(dir, "two.js"), "// TWO.js\n"); // same size, later mtime
    utimesSync(join(dir, "two.js"), new Date(), new Date(Date.now() + 5_000));
    expect(stampHolds(s, dir)).toBe(false);
    const again = stamp();
    expect(stampHolds(again, dir)).toBe(true);
    rmSync(join(dir, "a", "one.ts"));
    expect(stampHolds(again, dir)).toBe(false);
  });

  test("fails under another Bun, with no files, or with entries it did not write", () => {
    writeFileSync(join(dir, "a", "one.ts"), "// back\n");
    const s = stamp();
    expect(stampHolds({ ...s, bun: "0.0.1" }, dir)).toBe(false);
    expect(stampHolds({ ...s, inputs: [] }, dir)).toBe(false);
    expect(stampHolds({ ...s, inputs: [...s.inputs, [42, 1, 1] as unknown as Stamp["inputs"][number]] }, dir)).toBe(
      false,
    );
  });
});

const executable = servicesExecutable();
describe.skipIf(
  skip("the services' executable", executable === null ? "not built or out of date (bun services/build.ts)" : null),
)("the executable", () => {
  const exe = executable!;
  const run = (argv: string[], env: Record<string, string | undefined>) => {
    const p = Bun.spawnSync(argv, { env: { ...process.env, ...env }, stdout: "pipe", stderr: "pipe", timeout: 60_000 });
    return { code: p.exitCode, stderr: p.stderr.toString() };
  };

  test("the local mesh starts every service from it, with the package's folder", () => {
    const specs = readTopology(composePath);
    expect(new Set(specs.map((s) => s.argv[1]))).toEqual(new Set(serviceNames));
    for (const s of specs) {
      expect(s.argv[0]).toBe(exe);
      expect(s.env.MESHTRAIN_ROOT).toBe(root);
    }
  });

  test("a service refuses bad flags as from its sources: the same exit code and message", () => {
    for (const name of serviceNames) {
      const fromExe = run([exe, name, "--no-such-flag", "1"], { MESHTRAIN_ROOT: root });
      const fromSource = run([process.execPath, join(root, "services", name, "main.ts"), "--no-such-flag", "1"], {});
      expect(fromExe.code).toBe(configExitCode);
      expect(fromSource.code).toBe(configExitCode);
      const said = (s: string) => s.split("\n").find((l) => l.startsWith(`${name}: `));
      expect(said(fromExe.stderr)).toBeDefined();
      expect(said(fromExe.stderr)).toBe(said(fromSource.stderr));
    }
  }, 60_000);

  test("refuses a missing or unknown service, and a start without MESHTRAIN_ROOT, saying why", () => {
    const none = run([exe], { MESHTRAIN_ROOT: root });
    expect(none.code).toBe(2);
    expect(none.stderr).toContain("usage: meshtrain-services <data-loader|parameter-server|trainer|checkpoint>");
    expect(run([exe, "shard"], { MESHTRAIN_ROOT: root }).stderr).toContain('(not "shard")');
    const rootless = run([exe, "trainer"], { MESHTRAIN_ROOT: "" });
    expect(rootless.code).not.toBe(0);
    expect(rootless.stderr).toContain("needs MESHTRAIN_ROOT");
  }, 60_000);
});
