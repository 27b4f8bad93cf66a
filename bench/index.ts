// `bun run bench <name> [options]`: the per-component benchmarks.
import { ConfigError } from "../engine/errors.ts";
import { runEngineBench } from "./engine.ts";
import { runKernelBench } from "./kernels.ts";

const benches: Record<string, (argv: string[]) => unknown> = {
  engine: runEngineBench,
  kernels: runKernelBench,
};

const [name, ...rest] = process.argv.slice(2);
const bench = name === undefined ? undefined : benches[name];
if (bench === undefined) {
  console.error(`usage: bun run bench <${Object.keys(benches).join("|")}> [options]`);
  process.exit(2);
}
try {
  bench(rest);
} catch (e) {
  if (!(e instanceof ConfigError)) throw e;
  console.error(`bench ${name}: ${e.message}`);
  process.exit(2);
}
