// Benchmark option parsing: node:util parseArgs, with its errors and ours turned into
// ConfigError so both entry points (bench/index.ts and `meshtrain bench`) print one clear line.
import { parseArgs, type ParseArgsConfig } from "node:util";
import { ConfigError } from "../ffi/errors.ts";

export function parseBenchArgs<O extends NonNullable<ParseArgsConfig["options"]>>(argv: string[], options: O) {
  try {
    return parseArgs({ args: argv, options, strict: true, allowPositionals: false }).values;
  } catch (e) {
    // one line (node's message for "--steps -1" takes three)
    throw new ConfigError((e as Error).message.replace(/\s*\n\s*/g, " "));
  }
}

/** A positive integer option, or a ConfigError naming it. */
export function positiveInt(name: string, raw: unknown, multipleOf = 1): number {
  const v = Number(raw);
  if (!Number.isInteger(v) || v < 1 || v % multipleOf !== 0) {
    throw new ConfigError(
      `--${name} must be a positive integer${multipleOf > 1 ? ` and a multiple of ${multipleOf}` : ""}, got ${String(raw)}`,
    );
  }
  return v;
}
