// Service configuration: defaults < file (--config, YAML or JSON) < environment (MT_*) <
// flags (--kebab-case value). Validated by a zod schema; every problem is reported at once,
// naming the key and where its value came from.
import { readFileSync } from "node:fs";
import type * as Yaml from "yaml";
import type { z } from "zod";
import { ConfigError } from "../../../ffi/errors.ts";

const kebab = (key: string) => key.replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`);
const envName = (key: string) => `MT_${key.replace(/[A-Z]/g, (c) => `_${c}`).toUpperCase()}`;

/** A flag or environment value: JSON when it parses (numbers, booleans, lists), else text. */
function scalar(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

export interface ConfigSources {
  argv: readonly string[];
  env: Record<string, string | undefined>;
}

/** Loads and validates; `base` (defaults) sits below the file, environment and flags. */
export function loadConfig<S extends z.ZodObject>(schema: S, sources: ConfigSources, base: object = {}): z.infer<S> {
  const keys = Object.keys(schema.shape);
  const origin: Record<string, string> = {};
  const raw: Record<string, unknown> = { ...base };
  const flags = parseFlags(sources.argv, keys);
  const file = flags.config ?? sources.env.MT_CONFIG;
  if (typeof file === "string") {
    for (const [k, v] of Object.entries(readConfigFile(file))) {
      raw[k] = v;
      origin[k] = file;
    }
  }
  for (const k of keys) {
    const v = sources.env[envName(k)];
    if (v !== undefined) {
      raw[k] = scalar(v);
      origin[k] = `$${envName(k)}`;
    }
  }
  for (const [k, v] of Object.entries(flags.values)) {
    raw[k] = scalar(v);
    origin[k] = `--${kebab(k)}`;
  }
  const parsed = schema.strict().safeParse(raw);
  if (!parsed.success) {
    const lines = parsed.error.issues.map((i) => {
      const key = String(i.path[0] ?? "");
      return `  ${key || "(config)"}${origin[key] ? ` (from ${origin[key]})` : ""}: ${i.message}`;
    });
    throw new ConfigError(`invalid configuration:\n${lines.join("\n")}`);
  }
  return parsed.data as z.infer<S>;
}

function parseFlags(
  argv: readonly string[],
  keys: readonly string[],
): { config?: string; values: Record<string, string> } {
  const byFlag = new Map(keys.map((k) => [kebab(k), k]));
  const values: Record<string, string> = {};
  let config: string | undefined;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (!arg.startsWith("--"))
      throw new ConfigError(`unexpected argument "${arg}"; flags look like --nats-url nats://host:4222`);
    const eq = arg.indexOf("=");
    const name = arg.slice(2, eq < 0 ? undefined : eq);
    const value = eq < 0 ? argv[++i] : arg.slice(eq + 1);
    if (value === undefined) throw new ConfigError(`flag --${name} needs a value`);
    if (name === "config") {
      config = value;
      continue;
    }
    const key = byFlag.get(name);
    if (!key)
      throw new ConfigError(
        `unknown flag --${name}; known: --config, ${[...byFlag.keys()].map((f) => `--${f}`).join(", ")}`,
      );
    values[key] = value;
  }
  return config === undefined ? { values } : { config, values };
}

function readConfigFile(path: string): Record<string, unknown> {
  let text: string;
  try {
    text = readFileSync(path, "utf8");
  } catch (e) {
    throw new ConfigError(`cannot read config file ${path}: ${(e as Error).message}`);
  }
  let data: unknown;
  try {
    // YAML is a superset of JSON; the parser is loaded only here (most services read no file)
    data = (require("yaml") as typeof Yaml).parse(text);
  } catch (e) {
    throw new ConfigError(`config file ${path} is not valid YAML/JSON: ${(e as Error).message}`);
  }
  if (data === null || typeof data !== "object" || Array.isArray(data))
    throw new ConfigError(`config file ${path} must hold a mapping of keys to values`);
  return data as Record<string, unknown>;
}
