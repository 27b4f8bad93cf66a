// The option table (services/runtime/job/options.ts) as the CLI uses it: a row's flag reaches
// its config key, flags of another model or optimizer are refused, a resumed job's flags are
// laid over its earlier config and the resume rules come from the rows, and the single-process
// commands share the mesh's defaults. The mesh running --init-from: test/sdk/export.test.ts.
import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Command } from "commander";
import { DataFileError } from "../../engine/data/errors.ts";
import { type JobFlags, jobConfigOf, jobOptions } from "../../sdk/cli/job-options.ts";
import { gptRunDefaults } from "../../sdk/local/train-gpt.ts";
import { mlpRunDefaults } from "../../sdk/local/train-mlp.ts";
import { gptJobDefaults, type JobConfig, jobDefaults } from "../../services/runtime/job/config.ts";
import { allJobOptions, flagRows, valueAt } from "../../services/runtime/job/options.ts";
import { resumableKeys, trajectoryDiff } from "../../services/runtime/job/resume.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { expectThrown } from "../helpers/errors.ts";

/** `run`'s options as commander parses them. */
function flags(...args: string[]): JobFlags {
  const cmd = jobOptions(new Command("run"))
    .exitOverride()
    .configureOutput({ writeErr: () => {}, writeOut: () => {} });
  cmd.parse(args, { from: "user" });
  return cmd.opts() as JobFlags;
}
const config = (...args: string[]): JobConfig => jobConfigOf(flags("--job", "t", ...args));

describe("the option table", () => {
  test("a row's flag reaches its key: each flag given a value other than its default", () => {
    const cases: [string[], string, unknown][] = [
      [["--lr", "0.3"], "lr", 0.3],
      [["--warmup", "7"], "warmupSteps", 7],
      [["--accum", "2"], "accumSteps", 2],
      [["--micro-batches", "4"], "accumSteps", 4],
      [["--model", "gpt", "--beta2", "0.95"], "optimizer.beta2", 0.95],
      [["--optimizer", "adamw", "--beta2", "0.9"], "optimizer.beta2", 0.9],
      [["--momentum", "0"], "optimizer.nesterov", false],
      [["--model", "gpt", "--n-layer", "3"], "model.nLayer", 3],
      [["--zero", "2", "--sync", "allreduce"], "zero", 2],
      [["--sync", "ssp"], "staleness", 2],
      [["--sync", "ssp", "--staleness", "5"], "staleness", 5],
      [["--shrink-after", "30"], "shrinkAfterS", 30],
    ];
    for (const [args, key, value] of cases) expect([args, valueAt(config(...args), key)]).toEqual([args, value]);
  });

  test("the defaults follow the model and the optimizer", () => {
    expect(config().optimizer).toEqual(jobDefaults.optimizer);
    expect(config("--model", "gpt").optimizer).toEqual(gptJobDefaults.optimizer);
    expect(config("--optimizer", "adamw").optimizer).toMatchObject({ kind: "adamw", beta2: 0.999, weightDecay: 5e-4 });
    expect(config("--model", "gpt", "--optimizer", "sgd").optimizer).toMatchObject({ kind: "sgd", weightDecay: 0.1 });
  });

  test("a flag of another model or optimizer is refused, naming it", () => {
    expectThrown(() => config("--beta2", "0.9"), ConfigError, "--beta2 is not for --optimizer sgd");
    expectThrown(
      () => config("--model", "gpt", "--momentum", "0.5"),
      ConfigError,
      "--momentum is not for --optimizer adamw",
    );
    expectThrown(() => config("--init-from", "x"), ConfigError, "--init-from is not for --model mlp");
    expectThrown(
      () => config("--n-layer", "2", "--recompute"),
      ConfigError,
      "--n-layer, --recompute are not for --model mlp",
    );
  });

  test("--init-from takes a Hugging Face folder: one without config.json is refused, naming it", () => {
    const dir = mkdtempSync(join(tmpdir(), "meshtrain-init-"));
    try {
      expectThrown(() => config("--model", "gpt", "--init-from", dir), DataFileError, "has no config.json");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test("every flag is a row's, once", () => {
    const flagsOfRows = allJobOptions.flatMap((r) => (r.flag ? [r.flag] : []));
    expect(new Set(flagsOfRows).size).toBe(flagsOfRows.length);
    expect(flagRows.size).toBe(flagsOfRows.length);
  });
});

describe("resuming", () => {
  test("the resumable keys are the rows that say why", () => {
    expect([...resumableKeys].sort()).toEqual(
      [...new Set(allJobOptions.filter((r) => r.resumable).map((r) => r.key))].sort(),
    );
    expect(resumableKeys).toContain("zero");
    expect(resumableKeys).not.toContain("lr");
  });

  test("a resumed job's flags are checked against its own sync mode, and its config's errors name the flags", () => {
    const prev = config("--sync", "allreduce", "--trainers", "2");
    // allreduce's options, resumable: refused on a new bsp job, taken on the all-reduce job resumed
    expectThrown(() => config("--replica-check-every", "50"), ConfigError, "does nothing under --sync bsp");
    expect(jobConfigOf(flags("--replica-check-every", "50", "--coll-transport", "nats"), prev).replicaCheckEvery).toBe(
      50,
    );
    expectThrown(
      () => jobConfigOf(flags("--shards", "3"), prev),
      ConfigError,
      "--shards does nothing under --sync allreduce",
    );
    expectThrown(
      () => jobConfigOf(flags("--batch-size", "100", "--micro-batches", "3"), prev),
      ConfigError,
      "--batch-size (100) must be a multiple of --micro-batches (3)",
    );
  });

  test("flags are laid over the earlier config; a changed trajectory is named", () => {
    const prev = config("--model", "gpt", "--lr", "0.001");
    const kept = jobConfigOf(flags("--eval-every", "5"), prev);
    expect(kept.lr).toBe(0.001);
    expect(kept.evalEvery).toBe(5);
    expect(kept.job).toBe(prev.job);
    expect(trajectoryDiff(prev, kept)).toEqual([]);
    expect(trajectoryDiff(prev, jobConfigOf(flags("--beta2", "0.9"), prev))).toEqual(["optimizer.beta2: 0.99 -> 0.9"]);
  });
});

describe("the single-process commands share the mesh's rows", () => {
  test("one default each", () => {
    expect(mlpRunDefaults.lr).toBe(jobDefaults.lr);
    expect(mlpRunDefaults.warmup).toBe(jobDefaults.warmupSteps);
    expect(gptRunDefaults.lr).toBe(gptJobDefaults.lr);
    expect(gptRunDefaults.beta2).toBe((gptJobDefaults.optimizer as { beta2: number }).beta2);
  });
});
