// `bun run bench <name> [options]`: the per-component benchmarks.
import { ConfigError } from "../ffi/errors.ts";
import { NativeLibraryError } from "../ffi/errors.ts";
import { runAllReduceBench } from "./allreduce.ts";
import { runEngineBench } from "./engine.ts";
import { runEpilogueBench } from "./epilogues.ts";
import { runHostsBench } from "./hosts.ts";
import { runKernelBench } from "./kernels.ts";
import { runPsBench } from "./ps.ts";
import { runCheckpointBench } from "./checkpoint.ts";
import { runClientBench } from "./client.ts";
import { runDataLoaderBench } from "./data-loader.ts";
import { runPrepareBench } from "./prepare.ts";
import { runStreamBench } from "./stream.ts";
import { runTrainerBench } from "./trainer.ts";

export const benches = {
  engine: runEngineBench,
  kernels: runKernelBench,
  epilogues: runEpilogueBench,
  ps: runPsBench,
  checkpoint: runCheckpointBench,
  "data-loader": runDataLoaderBench,
  prepare: runPrepareBench,
  trainer: runTrainerBench,
  allreduce: runAllReduceBench,
  stream: runStreamBench,
  client: runClientBench,
  hosts: runHostsBench,
} satisfies Record<string, (argv: string[]) => unknown>;

if (import.meta.main) {
  const [name, ...rest] = process.argv.slice(2);
  const bench = name !== undefined && Object.hasOwn(benches, name) ? benches[name as keyof typeof benches] : undefined;
  if (bench === undefined) {
    console.error(`usage: bun run bench <${Object.keys(benches).join("|")}> [options]`);
    process.exit(2);
  }
  try {
    await bench(rest);
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
