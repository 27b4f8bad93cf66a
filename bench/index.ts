// `bun run bench <name> [options]`: the per-component benchmarks (`<name> --help`: what one
// measures, and its options).
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { ConfigError } from "../ffi/errors.ts";
import { NativeLibraryError } from "../ffi/errors.ts";
import type { BenchName } from "../sdk/cli/options.ts";
// Each benchmark's module is imported when it runs: a run loads only its own (the CLI and the
// tests start this program once per benchmark).
type Bench = (argv: string[]) => unknown;
export const benches: Record<BenchName, () => Promise<Bench>> = {
  engine: async () => (await import("./engine.ts")).runEngineBench,
  kernels: async () => (await import("./kernels.ts")).runKernelBench,
  epilogues: async () => (await import("./epilogues.ts")).runEpilogueBench,
  ps: async () => (await import("./ps.ts")).runPsBench,
  checkpoint: async () => (await import("./checkpoint.ts")).runCheckpointBench,
  "data-loader": async () => (await import("./data-loader.ts")).runDataLoaderBench,
  prepare: async () => (await import("./prepare.ts")).runPrepareBench,
  trainer: async () => (await import("./trainer.ts")).runTrainerBench,
  allreduce: async () => (await import("./allreduce.ts")).runAllReduceBench,
  stream: async () => (await import("./stream.ts")).runStreamBench,
  client: async () => (await import("./client.ts")).runClientBench,
  hosts: async () => (await import("./hosts.ts")).runHostsBench,
};

/**
 * A benchmark's help: the comment its module opens with (what it measures, against which
 * baseline, its usage lines), so that the help and the code's own account are one text.
 */
export function benchHelp(name: string): string {
  const text = readFileSync(join(import.meta.dir, `${name}.ts`), "utf8");
  const lines: string[] = [];
  for (const line of text.split("\n")) {
    if (!line.startsWith("//")) break;
    lines.push(line.replace(/^\/\/ ?/, ""));
  }
  return `${lines.join("\n").trim()}\n`;
}

const isHelp = (a: string) => a === "--help" || a === "-h";

if (import.meta.main) {
  const [name, ...rest] = process.argv.slice(2);
  const load = name !== undefined && Object.hasOwn(benches, name) ? benches[name as BenchName] : undefined;
  if (load === undefined) {
    const usage = `usage: bun run bench <${Object.keys(benches).join("|")}> [options]; bun run bench <name> --help says what one measures and its options`;
    // asked for help: the usage is the answer; else it is the refusal
    if (name === undefined || !isHelp(name)) {
      console.error(name === undefined ? usage : `no benchmark is named ${JSON.stringify(name)}; ${usage}`);
      process.exit(2);
    }
    console.log(usage);
    process.exit(0);
  }
  if (rest.some(isHelp)) {
    process.stdout.write(benchHelp(name!));
    process.exit(0);
  }
  try {
    await (await load())(rest);
  } catch (e) {
    // a bad option, or a device or library that is not there: one clear line (anything else is a
    // bug and keeps its stack)
    if (e instanceof ConfigError) {
      console.error(`bench ${name}: ${e.message}`);
      process.exit(2);
    }
    if (!(e instanceof NativeLibraryError)) throw e;
    console.error(`bench ${name}: ${e.name}: ${e.message}`);
    process.exit(1);
  }
}
