// `bun run bench <name> [options]`: the per-component benchmarks.
import { ConfigError } from "../ffi/errors.ts";
import { NativeLibraryError } from "../ffi/errors.ts";
// Each benchmark's module is imported when it runs: a run loads only its own (the CLI and the
// tests start this program once per benchmark).
type Bench = (argv: string[]) => unknown;
export const benches: Record<string, () => Promise<Bench>> = {
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

if (import.meta.main) {
  const [name, ...rest] = process.argv.slice(2);
  const load = name !== undefined && Object.hasOwn(benches, name) ? benches[name] : undefined;
  if (load === undefined) {
    console.error(`usage: bun run bench <${Object.keys(benches).join("|")}> [options]`);
    process.exit(2);
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
