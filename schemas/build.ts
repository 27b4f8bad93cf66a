// Generates the TypeScript for every schemas/*.fbs with flatc (Debian's flatbuffers-compiler)
// into schemas/generated/, which is committed. `bun run schemas` regenerates it;
// `bun schemas/build.ts --check` fails when the committed files differ from what flatc
// produces now (test/schemas/generated.test.ts runs it).
import { cpSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";

const here = import.meta.dir;
export const generatedDir = join(here, "generated");
export const flatcInstallHint = "apt-get install -y flatbuffers-compiler";

export class SchemaBuildError extends Error {
  override readonly name = "SchemaBuildError";
}

export function schemaFiles(): string[] {
  return readdirSync(here).filter((f) => f.endsWith(".fbs")).sort().map((f) => join(here, f));
}

/** Runs flatc into a fresh temporary folder and returns its path. */
export function generate(): string {
  const out = mkdtempSync(join(tmpdir(), "mt-flatc-"));
  const flatc = Bun.which("flatc");
  if (flatc === null) throw new SchemaBuildError(`flatc not found; install it with: ${flatcInstallHint}`);
  const p = Bun.spawnSync([flatc, "--ts", "-o", out, ...schemaFiles()], { cwd: here, stdout: "pipe", stderr: "pipe" });
  if (p.exitCode !== 0) throw new SchemaBuildError(`flatc failed (exit ${p.exitCode}): ${p.stderr.toString().trim()}`);
  return out;
}

function listFiles(dir: string): string[] {
  if (!existsSync(dir)) return [];
  return readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => relative(dir, join(e.parentPath, e.name)))
    .sort();
}

/** Files that differ between the committed output and a fresh flatc run (empty: up to date). */
export function staleFiles(): string[] {
  const fresh = generate();
  try {
    const a = listFiles(fresh);
    const b = listFiles(generatedDir);
    const names = [...new Set([...a, ...b])].sort();
    return names.filter((n) => !a.includes(n) || !b.includes(n) ||
      !readFileSync(join(fresh, n)).equals(readFileSync(join(generatedDir, n))));
  } finally {
    rmSync(fresh, { recursive: true, force: true });
  }
}

if (import.meta.main) {
  if (process.argv.includes("--check")) {
    const stale = staleFiles();
    if (stale.length > 0) {
      console.error(`schemas/generated is stale (${stale.join(", ")}); run: bun run schemas`);
      process.exit(1);
    }
    console.log("schemas/generated is up to date");
  } else {
    const fresh = generate();
    rmSync(generatedDir, { recursive: true, force: true });
    cpSync(fresh, generatedDir, { recursive: true }); // not rename: tmp may be another filesystem
    rmSync(fresh, { recursive: true, force: true });
    console.log(`generated ${listFiles(generatedDir).length} files from ${schemaFiles().length} schemas into schemas/generated`);
  }
}
