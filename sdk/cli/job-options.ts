// The job options as commander options, every one from its row of the option table
// (services/runtime/job/options.ts): `run`, `submit` and `plan` take them all; `train mlp` and
// `train gpt` take the rows they share with the mesh, with the same defaults. And the flags the
// user typed, made into a job's config: a new job's, or a resumed one's.
import { type Command, Option } from "commander";
import { type JobConfig, parseJobConfig } from "../../services/runtime/job/config.ts";
import {
  type AnyJobOption,
  defaultFor,
  draftOf,
  flagRows,
  type ModelKind,
  type OptimizerKind,
  type SyncMode,
} from "../../services/runtime/job/options.ts";
import { resumeConfig } from "../../services/runtime/job/resume.ts";
import { jobNameOrIdPattern, jobNameRule } from "../../services/runtime/job/subjects.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { stamp } from "../format.ts";
import { initFromShape } from "../local/train-gpt.ts";
import { userPath } from "../user-paths.ts";
import { asArgument } from "./options.ts";

/** The job options commander parsed: the flags the user typed, by name (nothing else: no defaults). */
export type JobFlags = Readonly<Record<string, unknown>> & {
  job?: string;
  model?: ModelKind;
  optimizer?: OptimizerKind;
  tokens?: string;
  text?: string;
  vocabSize?: number;
  sync?: SyncMode;
  accum?: number;
  microBatches?: number;
  initFrom?: string;
};

/** this process's tags: a random start, then one more per name (names a process gives never repeat
 *  among its next 65,536; two processes start at random points) */
let nextTag = crypto.getRandomValues(new Uint16Array(1))[0]!;

/** <model>-<date>-<time>-<4 hex>: two runs started in the same second still get their own name. */
export const newJobName = (model: ModelKind = "mlp"): string => {
  const tag = (nextTag++ & 0xffff).toString(16).padStart(4, "0");
  return `${model === "gpt" ? "gpt" : "mnist"}-${stamp()}-${tag}`;
};

/** The commander option of a row: its flag, help and reader; `byDefault`, commander's default. */
export function optionOf(r: AnyJobOption, help: string, byDefault?: unknown): Option {
  const o = new Option(r.type.arg === undefined ? r.flag! : `${r.flag} ${r.type.arg}`, help);
  if (r.type.choices) o.choices(r.type.choices);
  if (r.type.arg !== undefined) o.argParser(asArgument(r.type.read));
  if (byDefault !== undefined) o.default(byDefault, Array.isArray(byDefault) ? byDefault.join(",") : undefined);
  return o;
}

const shown = (v: unknown): string => (Array.isArray(v) ? v.join(",") : String(v));

/** "(default: X)", or each model's where they differ; "" where a row has none worth showing. */
function defaultText(r: AnyJobOption): string {
  if (r.defaultNote !== undefined) return ` (default: ${r.defaultNote})`;
  const [mlp, gpt] = [defaultFor(r, "mlp"), defaultFor(r, "gpt")];
  const only = r.models?.length === 1 ? r.models[0]! : null;
  const value = only === "gpt" ? gpt : only === "mlp" ? mlp : null;
  if (only !== null) return value === undefined || value === "" || value === false ? "" : ` (default: ${shown(value)})`;
  if (mlp === undefined || mlp === "" || mlp === false) return "";
  return shown(mlp) === shown(gpt) ? ` (default: ${shown(mlp)})` : ` (default: mlp ${shown(mlp)}, gpt ${shown(gpt)})`;
}

/** Whom a row's flag is for, as its help begins ("gpt: ", "adamw: "). */
const forWhom = (r: AnyJobOption): string =>
  [r.models?.length === 1 ? r.models[0] : null, r.optimizers?.length === 1 ? r.optimizers[0] : null]
    .filter(Boolean)
    .map((w) => `${w}: `)
    .join("");

/** Every job option, shared by `run`, `submit` and `plan`. No commander defaults: what the user
 *  did not type comes from the model's defaults (or, resuming, from the earlier run). */
export function jobOptions(cmd: Command): Command {
  for (const r of flagRows.values()) cmd.addOption(optionOf(r, `${forWhom(r)}${r.help}${defaultText(r)}`));
  return cmd;
}

/** A row `train mlp` or `train gpt` shares with the mesh (by flag name), with the model's default
 *  (`byDefault` null: none, the option is absent unless given). */
export function sharedOption(name: string, model: ModelKind, byDefault?: null): Option {
  const r = flagRows.get(name);
  if (r === undefined) throw new Error(`no job option ${name}`);
  const value = byDefault === null ? undefined : defaultFor(r, model);
  const trainHelp = typeof r.trainHelp === "string" ? r.trainHelp : r.trainHelp?.[model];
  return optionOf(r, trainHelp ?? r.help!, value === "" ? undefined : value);
}

/** Several shared rows at once. */
export function sharedOptions(cmd: Command, model: ModelKind, names: readonly string[]): Command {
  for (const name of names) cmd.addOption(sharedOption(name, model));
  return cmd;
}

/** The options the user typed (not defaults). */
export function givenOptions(cmd: Command): Set<string> {
  return new Set(Object.keys(cmd.opts()).filter((k) => cmd.getOptionValueSource(k) === "cli"));
}

/** The flags of the job options, the paths among them made absolute (a relative path is the
 *  user's: the services run elsewhere, in another folder or on another machine). */
function typed(flags: JobFlags): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [name, r] of flagRows) {
    const v = flags[name];
    // an empty path is the default's ("--data-dir ''": the package's data)
    if (v !== undefined) out[name] = r.path && v !== "" ? userPath(v as string) : v;
  }
  return out;
}

/** Refuses flags of another model or optimizer, and data flags that do not go together, naming them. */
function checkFlags(f: JobFlags, model: ModelKind, optimizer: OptimizerKind, sync: SyncMode): void {
  const wrong = (other: (r: AnyJobOption) => boolean) =>
    [...flagRows].filter(([name, r]) => f[name] !== undefined && other(r)).map(([, r]) => r.flag!);
  const forModel = wrong((r) => !(r.models ?? [model]).includes(model));
  if (forModel.length > 0)
    throw new ConfigError(`${forModel.join(", ")} ${forModel.length > 1 ? "are" : "is"} not for --model ${model}`);
  const forOptimizer = wrong((r) => !(r.optimizers ?? [optimizer]).includes(optimizer));
  if (forOptimizer.length > 0)
    throw new ConfigError(
      `${forOptimizer.join(", ")} ${forOptimizer.length > 1 ? "are" : "is"} not for --optimizer ${optimizer}`,
    );
  const forSync = wrong((r) => !(r.syncs ?? [sync]).includes(sync));
  if (forSync.length > 0)
    throw new ConfigError(
      `${forSync.join(", ")} ${forSync.length > 1 ? "do" : "does"} nothing under --sync ${sync} (${forSync.map((flag) => `${flag} is for ${[...flagRows.values()].find((r) => r.flag === flag)!.syncs!.join(", ")}`).join("; ")})`,
    );
  // two flags of one key (--micro-batches sets --accum): the last would win unsaid
  if (f.accum !== undefined && f.microBatches !== undefined)
    throw new ConfigError("--micro-batches and --accum set the same count (micro-batches a step): pass one");
  if (f.text && f.tokens) throw new ConfigError("--text and --tokens exclude each other: pass one");
  if (f.tokens && f.valFraction !== undefined)
    throw new ConfigError(
      "--val-fraction is for --text: a --tokens folder's validation split is its val.bin, or the val shards prepare wrote (prepare --val-fraction sets it)",
    );
  if (f.vocabSize && !f.tokens)
    throw new ConfigError(
      "--vocab-size is for --tokens folders without vocab.json; a text's vocabulary is its characters",
    );
}

/**
 * `train mlp` and `train gpt`: the flags the user typed that the run would drop, refused as the
 * mesh's are (another optimizer's, --text beside --tokens, --vocab-size without --tokens).
 */
export function checkTrainFlags(cmd: Command, model: ModelKind): void {
  const opts = cmd.opts();
  const given: Record<string, unknown> = Object.fromEntries([...givenOptions(cmd)].map((k) => [k, opts[k]]));
  if (given.tokensDir !== undefined) given.tokens ??= given.tokensDir;
  const optimizer = (opts.optimizer ?? defaultFor(flagRows.get("optimizer")!, model)) as OptimizerKind;
  checkFlags(given, model, optimizer, "bsp");
  if (optimizer !== "sgd" && given.nesterov !== undefined)
    throw new ConfigError(`--no-nesterov is not for --optimizer ${optimizer}`);
}

/** --job as the config's schema checks it, before an owner is added (a job that ran before is
 *  looked up by the name this returns). */
export function checkedJobName(job: string): string {
  if (!jobNameOrIdPattern.test(job)) throw new ConfigError(`invalid job config: job: ${jobNameRule}`);
  return job;
}

/**
 * The config of the options the user typed: a new job's (its model's defaults under them), or
 * with `prev`, a resumed job's (the earlier run's config under them; the caller refuses what
 * changes its trajectory). The job is named `name(flags.job or a new name)`: the caller's owner.
 */
export function jobConfigOf(
  flags: JobFlags,
  prev: JobConfig | null = null,
  name: (job: string) => string = (job) => job,
): JobConfig {
  const model = flags.model ?? prev?.model.kind ?? "mlp";
  const optimizer = (flags.optimizer ?? prev?.optimizer.kind ?? defaultFor(flagRows.get("optimizer")!, model)) as
    | "sgd"
    | "adamw";
  const sync = (flags.sync ?? prev?.sync ?? "bsp") as SyncMode;
  checkFlags(flags, model, optimizer, sync);
  // the job's name is the caller's to qualify (a resumed job keeps the one it has)
  const { job: _, ...values } = typed(flags);
  let cfg: JobConfig;
  try {
    if (prev !== null) cfg = resumeConfig(prev, values);
    else {
      const draft = draftOf(values);
      if (typeof values.initFrom === "string") {
        const { blockSize, nLayer, nHead, nEmbd } = initFromShape(values.initFrom, values);
        Object.assign(draft.model, { blockSize, nLayer, nHead, nEmbd });
      }
      draft.job = name(checkedJobName(flags.job ?? newJobName(model)));
      cfg = parseJobConfig(draft);
    }
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    throw new ConfigError(inFlags(e.message, flags), { cause: e });
  }
  checkGivenFor(flags, cfg);
  return cfg;
}

/** Flags given that the job's settings make do nothing, refused as another mode's are. */
function checkGivenFor(flags: JobFlags, cfg: JobConfig): void {
  if (flags.pipeSchedule !== undefined && cfg.pipelineStages === 1)
    throw new ConfigError("--pipe-schedule orders a pipeline's passes, and this job has none (--pipeline-stages 1)");
  if (flags.staleness !== undefined && cfg.sync === "ssp" && cfg.staleness === 0)
    throw new ConfigError("--sync ssp with --staleness 0 is BSP: --sync bsp, or a staleness of 1 or more");
}

/** Config keys that are not plain words (model.nEmbd, warmupSteps), the longest first, each with
 *  its rows' flags by name (--accum and --micro-batches set one key). */
const keyFlags: readonly { key: RegExp; flags: [name: string, flag: string][] }[] = [
  ...new Set([...flagRows.values()].map((r) => r.key).filter((k) => /[.A-Z]/.test(k))),
]
  .sort((a, b) => b.length - a.length)
  .map((k) => ({
    key: new RegExp(`(?<![\\w.-])${k.replaceAll(".", "\\.")}(?![\\w])`, "g"),
    flags: [...flagRows].filter(([, r]) => r.key === k).map(([name, r]) => [name, r.flag!]),
  }));

/** A config's error said in the flags the user typed: "model.nEmbd (128) must be divisible by
 *  model.nHead (3)" is "--n-embd (128) must be divisible by --n-head (3)"; of a key that two flags
 *  set, the one given. */
export function inFlags(message: string, given: JobFlags = {}): string {
  return keyFlags.reduce(
    (m, { key, flags }) => m.replace(key, (flags.find(([name]) => given[name] !== undefined) ?? flags[0]!)[1]),
    message,
  );
}
