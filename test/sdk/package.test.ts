// meshtrain as a package other projects install: what `npm pack` puts in the tarball (what a
// user needs, nothing else: no tests, no benchmarks, no builds), that every module the package
// holds imports only modules it holds too, where the native builds go, and `meshtrain doctor`.
import { describe, expect, test } from "bun:test";
import {
  copyFileSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  symlinkSync,
  utimesSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, normalize } from "node:path";
import { nativeBuildDir } from "../../ffi/build-dir.ts";
import { doctorReport, type Finding } from "../../sdk/cli/doctor.ts";

const root = join(import.meta.dir, "..", "..");
const cli = join(root, "sdk", "cli", "main.ts");

/** The files `npm pack` would put in the tarball (without running prepack: no declarations). */
function packedFiles(): string[] {
  const r = Bun.spawnSync(["npm", "pack", "--dry-run", "--json", "--ignore-scripts"], {
    cwd: root,
    stdout: "pipe",
    stderr: "pipe",
    timeout: 60_000,
  });
  expect(r.exitCode).toBe(0);
  const [pack] = JSON.parse(r.stdout.toString()) as { files: { path: string }[] }[];
  return pack!.files.map((f) => f.path);
}

describe("the package", () => {
  const files = packedFiles();
  const packed = new Set(files);

  test("holds the CLI, the SDK, the services, the engine, the native sources and the schemas", () => {
    for (const f of [
      "package.json",
      "README.md",
      "sdk/cli/main.ts",
      "sdk/index.ts",
      "sdk/dashboard/page.html",
      "services/trainer/main.ts",
      "engine/models/gpt.ts",
      "ffi/cpu/kernels.c",
      "ffi/cpu/kernels.h",
      "ffi/numerics.h",
      "ffi/cuda/nccl-shim.c",
      "schemas/messages/job.ts",
    ])
      expect(packed.has(f)).toBe(true);
    expect(files.some((f) => /^ffi\/cuda\/kernels\/.+\.cu$/.test(f))).toBe(true);
    expect(files.some((f) => f.startsWith("schemas/generated/"))).toBe(true);
    const pkg = JSON.parse(readFileSync(join(root, "package.json"), "utf8"));
    expect(pkg.private).toBeUndefined();
    expect(pkg.bin.meshtrain).toBe("sdk/cli/main.ts");
    expect(readFileSync(cli, "utf8").startsWith("#!/usr/bin/env bun\n")).toBe(true);
    expect(pkg.exports["."]).toEqual({ types: "./types/sdk/index.d.ts", default: "./sdk/index.ts" });
  });

  test("holds no tests, benchmarks, development tools, builds or deployment files but the compose file (the local mesh's topology)", () => {
    const outside = files.filter(
      (f) =>
        /^(test|bench|dev|testbed|deploy|docs|examples|scripts)\/|(^|\/)build\/|\.(py|tmp|so|ptx|stamp|fbs)$/.test(f) &&
        f !== "deploy/docker-compose.yml",
    );
    expect(outside).toEqual([]);
    expect(packed.has("deploy/docker-compose.yml")).toBe(true);
    expect(packed.has("schemas/build.ts")).toBe(false);
  });

  test("every relative import of a packaged module names a packaged file", () => {
    const missing: string[] = [];
    // the declarations (types/, written by npm pack) name the modules they describe
    for (const f of files.filter((x) => x.endsWith(".ts") && !x.startsWith("types/"))) {
      const text = readFileSync(join(root, f), "utf8");
      for (const m of text.matchAll(/(?:from|import)\s*\(?\s*"(\.{1,2}\/[^"]+)"/g)) {
        const target = normalize(join(dirname(f), m[1]!));
        if (!packed.has(target)) missing.push(`${f} -> ${m[1]}`);
      }
    }
    expect(missing).toEqual([]);
  });
});

describe("installed in a project", () => {
  // the tarball unpacked where npm puts it, beside the repository's dependencies (no registry)
  test("`meshtrain run` from node_modules/meshtrain trains on a local mesh of its own", () => {
    const dir = mkdtempSync(join(tmpdir(), "mt-installed-"));
    try {
      const pack = Bun.spawnSync(["npm", "pack", "--ignore-scripts", "--pack-destination", dir], {
        cwd: root,
        stdout: "pipe",
        stderr: "pipe",
        timeout: 60_000,
      });
      expect(pack.exitCode).toBe(0);
      const installed = join(dir, "proj", "node_modules", "meshtrain");
      mkdirSync(installed, { recursive: true });
      const tgz = join(dir, pack.stdout.toString().trim().split("\n").at(-1)!);
      expect(Bun.spawnSync(["tar", "xzf", tgz, "-C", installed, "--strip-components=1"]).exitCode).toBe(0);
      for (const dep of readdirSync(join(root, "node_modules")))
        if (dep !== "meshtrain") symlinkSync(join(root, "node_modules", dep), join(dir, "proj", "node_modules", dep));
      // the C kernels this checkout built, in the cache the package's build looks in: its sources
      // are the same, so the stamp matches (building them on first use is tested above)
      const kernels = join(dir, "cache", "ffi", "cpu");
      mkdirSync(kernels, { recursive: true });
      const built = nativeBuildDir(join(root, "ffi", "cpu"));
      for (const f of ["libmtkernels.so", "libmtkernels.stamp"])
        if (existsSync(join(built, f))) copyFileSync(join(built, f), join(kernels, f));
      const r = Bun.spawnSync(
        [
          process.execPath,
          join(installed, "sdk", "cli", "main.ts"),
          "run",
          "--trainers",
          "1",
          "--shards",
          "1",
          "--max-steps",
          "3",
          "--no-dashboard",
          "--dir",
          join(dir, "run"),
        ],
        {
          cwd: join(dir, "proj"),
          // the native builds go to a folder of this test's own, as a user's would go to theirs
          env: { ...process.env, MESHTRAIN_CACHE_DIR: join(dir, "cache") },
          stdout: "pipe",
          stderr: "pipe",
          timeout: 110_000,
        },
      );
      const out = r.stdout.toString();
      expect(r.exitCode, `${out}${r.stderr.toString()}`).toBe(0);
      expect(out).toMatch(/^test accuracy: [\d.]+% .* after 3 steps/m);
      expect(out).toContain(`model:     ${join(dir, "run", "jobs")}`);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);
});

describe("native builds", () => {
  test("go beside their sources in a writable checkout, or under MESHTRAIN_CACHE_DIR where it is set", () => {
    const cpu = join(root, "ffi", "cpu");
    const saved = process.env.MESHTRAIN_CACHE_DIR;
    try {
      delete process.env.MESHTRAIN_CACHE_DIR;
      expect(nativeBuildDir(cpu)).toBe(join(cpu, "build"));
      process.env.MESHTRAIN_CACHE_DIR = "/var/cache/mt";
      expect(nativeBuildDir(cpu)).toBe("/var/cache/mt/ffi/cpu");
      expect(nativeBuildDir(join(root, "ffi", "cuda"))).toBe("/var/cache/mt/ffi/cuda");
    } finally {
      if (saved === undefined) delete process.env.MESHTRAIN_CACHE_DIR;
      else process.env.MESHTRAIN_CACHE_DIR = saved;
    }
  });

  test("processes that start together build the CPU kernels once (a compose mesh's shared volume): the others wait and load it; a lock left by a builder that died is taken over", async () => {
    const cache = mkdtempSync(join(tmpdir(), "mt-kernels-"));
    try {
      // a lock left 10 minutes ago by a builder that died
      const lock = join(cache, "ffi", "cpu", "libmtkernels.lock");
      mkdirSync(dirname(lock), { recursive: true });
      writeFileSync(lock, "gone 1\n");
      const old = new Date(Date.now() - 600_000);
      utimesSync(lock, old, old);
      const runs = await Promise.all(
        [0, 1, 2].map(async () => {
          const p = Bun.spawn([process.execPath, join(root, "ffi", "cpu", "build.ts")], {
            env: { ...process.env, MESHTRAIN_CACHE_DIR: cache },
            stdout: "pipe",
            stderr: "pipe",
          });
          const [out, code] = await Promise.all([new Response(p.stdout).text(), p.exited]);
          return { out, code };
        }),
      );
      expect(runs.map((r) => r.code)).toEqual([0, 0, 0]);
      const compiles = runs.filter((r) => r.out.includes("building CPU kernels: ")).length;
      expect(compiles).toBe(1);
      for (const r of runs) expect(r.out).toContain(`CPU kernels: ${join(cache, "ffi", "cpu", "libmtkernels.so")}`);
      expect(existsSync(lock)).toBe(false);
    } finally {
      rmSync(cache, { recursive: true, force: true });
    }
  }, 120_000);
});

describe("meshtrain doctor", () => {
  const piece = (what: string, of: Finding["for"], found: boolean): Finding => ({
    what,
    for: of,
    found,
    detail: found ? `/usr/lib/${what}` : `not found; apt-get install -y ${what}`,
  });

  test("the main job runs where every CPU piece is found; a missing GPU piece is reported, not required", () => {
    const r = doctorReport(
      [piece("cc", "cpu", true), piece("openblas", "cpu", true), piece("libcuda", "gpu", false)],
      "9.9.9",
    );
    expect(r.canRun).toBe(true);
    expect(r.lines[0]).toStartWith("meshtrain 9.9.9 on ");
    expect(r.lines).toContain("  missing  libcuda   not found; apt-get install -y libcuda");
    expect(r.lines.at(-1)).toBe("the main job can run here (on the CPU)");
  });

  test("a missing CPU piece: the report says the main job cannot run", () => {
    const r = doctorReport([piece("cc", "cpu", true), piece("openblas", "cpu", false)], "9.9.9");
    expect(r.canRun).toBe(false);
    expect(r.lines).toContain("  missing  openblas  not found; apt-get install -y openblas");
    expect(r.lines.at(-1)).toBe("the main job cannot run here: install what is missing above");
  });

  test("on this machine it finds the CPU pieces and exits 0; with OpenBLAS pointed nowhere it says so and exits 1", () => {
    const run = (env: Record<string, string>) =>
      Bun.spawnSync([process.execPath, cli, "doctor"], {
        env: { ...process.env, ...env },
        stdout: "pipe",
        stderr: "pipe",
        timeout: 60_000,
      });
    const ok = run({});
    const out = ok.stdout.toString();
    expect(ok.exitCode).toBe(0);
    for (const what of ["Bun", "C compiler", "OpenBLAS", "CPU kernel library", "nats-server"])
      expect(out).toMatch(new RegExp(`^  ok {7}${what} `, "m"));
    expect(out).toContain("GPU training (optional):");
    const bad = run({ MESHTRAIN_OPENBLAS: "/nonexistent/libopenblas.so.0" });
    expect(bad.exitCode).toBe(1);
    expect(bad.stdout.toString()).toContain("missing  OpenBLAS");
    expect(bad.stdout.toString()).toContain("MESHTRAIN_OPENBLAS=/nonexistent/libopenblas.so.0 does not exist");
    expect(existsSync(cli)).toBe(true);
  });
});
