// --attention without a GPU: the mesh's job option as commander parses it into a job config (its
// default, its refusals, resuming), the header's attention line, and `train gpt`'s refusals,
// which come before anything opens or reads. The CLI as a process: test/sdk/cli.test.ts.
import { describe, expect, test } from "bun:test";
import { Command, CommanderError } from "commander";
import { probeCuda } from "../../ffi/cuda/driver.ts";
import { givenOptions, type JobFlags, jobConfigOf, jobOptions } from "../../sdk/cli/job-options.ts";
import { gptRunDefaults, runGpt } from "../../sdk/local/train-gpt.ts";
import { attentionText, configSummary } from "../../sdk/report.ts";
import { attentionChoices } from "../../services/runtime/job/attention.ts";
import type { JobConfig } from "../../services/runtime/job/config.ts";
import { trajectoryDiff } from "../../services/runtime/job/resume.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { expectRejected, expectThrown } from "../helpers/errors.ts";
import { skip } from "../helpers/skip.ts";

/** `run`'s job options parsed as commander parses them (a parse error throws CommanderError). */
function parse(...args: string[]): { flags: JobFlags; given: Set<string> } {
  const cmd = jobOptions(new Command("run"))
    .exitOverride()
    .configureOutput({ writeErr: () => {}, writeOut: () => {} });
  cmd.parse(args, { from: "user" });
  return { flags: cmd.opts() as JobFlags, given: givenOptions(cmd) };
}
const config = (...args: string[]): JobConfig => jobConfigOf(parse(...args).flags);
const gpt = ["--model", "gpt", "--job", "g"];

describe("the mesh's --attention", () => {
  test("auto unless given; each choice reaches the job config", () => {
    expect(config(...gpt).attention).toBe("auto");
    expect(config("--job", "m").attention).toBe("auto");
    // a head size of 64, which every choice takes
    const head64 = ["--n-embd", "128", "--n-head", "2"];
    for (const choice of attentionChoices)
      expect(config(...gpt, ...head64, "--precision", "bf16", "--attention", choice).attention).toBe(choice);
    expect(config(...gpt, "--precision", "f16", "--sync", "allreduce", "--attention", "cudnn").attention).toBe("cudnn");
    expect(config(...gpt, "--attention", "reference").attention).toBe("reference");
  });

  test.each([["fast"], ["CUDNN"], [""]])("an unknown choice (%p) is refused with the list", (value) => {
    expectThrown(
      () => parse(...gpt, "--attention", value),
      CommanderError,
      `argument '${value}' is invalid. Allowed choices are auto, cudnn, kernel, reference.`,
    );
  });

  test.each([["f32"], ["tf32"]])("cudnn at precision %s is refused with the reason", (precision) => {
    expectThrown(
      () => config(...gpt, "--precision", precision, "--attention", "cudnn"),
      ConfigError,
      "invalid job config: attention cudnn needs bf16 or f16 autocast (--precision bf16 or f16)",
      `precision ${precision} keeps them f32`,
    );
  });

  test("cudnn for a head size cuDNN's fused attention does not take is refused, naming it", () => {
    const shape = ["--n-embd", "40", "--n-head", "2", "--precision", "bf16", "--attention", "cudnn"];
    expectThrown(
      () => config(...gpt, ...shape),
      ConfigError,
      "head size 20: cuDNN's fused attention takes multiples of 8 up to 128",
    );
    // the kernels take it
    expect(config(...gpt, ...shape.slice(0, -1), "reference").attention).toBe("reference");
  });

  test("kernel at f32, and for a head size the tensor-core kernels are not built for, is refused with the reason", () => {
    expectThrown(
      () => config(...gpt, "--precision", "f32", "--attention", "kernel"),
      ConfigError,
      "invalid job config: attention kernel needs bf16 or f16 autocast (--precision bf16 or f16)",
    );
    expectThrown(
      () => config(...gpt, "--n-embd", "40", "--n-head", "2", "--precision", "bf16", "--attention", "kernel"),
      ConfigError,
      "it is built for head sizes 64 and 128, not 20",
    );
    expect(
      config(...gpt, "--n-embd", "128", "--n-head", "2", "--precision", "bf16", "--attention", "kernel").attention,
    ).toBe("kernel");
  });

  test("the mlp has no attention: the option is refused for it", () => {
    expectThrown(() => config("--attention", "reference"), ConfigError, "--attention is not for --model mlp");
  });

  test("a resumed job keeps its attention unless given, and may change it (it does not change the model)", () => {
    const prev = config(...gpt, "--precision", "bf16", "--attention", "cudnn");
    const kept = jobConfigOf(parse(...gpt).flags, prev);
    expect(kept.attention).toBe("cudnn");
    const changed = jobConfigOf(parse(...gpt, "--attention", "reference").flags, prev);
    expect(changed.attention).toBe("reference");
    expect(trajectoryDiff(prev, changed)).toEqual([]);
    // the resumed config is validated whole: cudnn laid over an f32 job's is refused, as a new job's would be
    const f32 = config(...gpt);
    const { precision: _, ...cudnn } = parse(...gpt, "--precision", "bf16", "--attention", "cudnn").flags;
    // only the attention is laid over
    expectThrown(() => jobConfigOf(cudnn, f32), ConfigError, "attention cudnn needs bf16");
  });

  test("the header: a gpt job's attention line, none for the mlp", () => {
    const line = (c: JobConfig, trainers?: "cpu" | "cuda") =>
      configSummary(c, trainers).find((l) => l.startsWith("attention  "));
    expect(line(config(...gpt, "--precision", "bf16"))).toBe(
      "attention  auto: cuDNN's fused flash attention on GPUs where cuDNN loads and takes the shape, else the f32-FMA kernels; the C kernels on CPU trainers; each trainer logs which runs",
    );
    expect(line(config(...gpt))).toContain(
      "auto: the f32-FMA kernels on GPUs (cuDNN's fused attention needs bf16 or f16, not f32)",
    );
    expect(line(config(...gpt, "--attention", "reference"), "cpu")).toBe(
      "attention  reference: the C kernels (the trainers compute on the CPU)",
    );
    expect(line(config(...gpt, "--precision", "bf16", "--attention", "cudnn"))).toBe(
      "attention  cudnn: cuDNN's fused flash attention on every trainer's GPU (a trainer that cannot run it fails the job, saying why); each trainer logs which runs",
    );
    expect(line(config("--job", "m"))).toBeUndefined();
    expect(attentionText({ attention: "reference", precision: "f32" }, "cuda")).toBe(
      "reference: the f32-FMA kernels on GPUs; each trainer logs which runs",
    );
  });
});

describe("train gpt's --attention cudnn: refused before anything opens or reads", () => {
  // a text that does not exist: a refusal that came after the data was read would be its DataFileError
  const o = { ...gptRunDefaults, text: "/nonexistent/text.txt", attention: "cudnn" as const };
  test.each([["f32"], ["tf32"]] as const)("at precision %s", async (precision) => {
    await expectRejected(
      () => runGpt({ ...o, device: "cpu", precision }),
      ConfigError,
      "--attention cudnn needs bf16 or f16 autocast (--precision bf16 or f16)",
    );
  });
  test("with --device cpu", async () => {
    await expectRejected(
      () => runGpt({ ...o, device: "cpu", precision: "bf16" }),
      ConfigError,
      "--attention cudnn needs a GPU (cuDNN's fused attention runs on one), but --device cpu asks for the CPU",
    );
  });
  test("for a head size cuDNN does not take, on any device", async () => {
    await expectRejected(
      () => runGpt({ ...o, device: "cuda", precision: "f16", nEmbd: 40, nHead: 2 }),
      ConfigError,
      "--attention cudnn cannot run this GPT: head size 20",
    );
  });
  test.skipIf(skip("a machine without a GPU", probeCuda().ok ? "a GPU is present" : null))(
    "with --device auto where there is no GPU: after the device line, naming why",
    async () => {
      await expectRejected(
        () => runGpt({ ...o, device: "auto", precision: "bf16" }),
        ConfigError,
        "--attention cudnn needs a GPU (cuDNN's fused attention runs on one), but --device auto found no GPU (no CUDA: ",
      );
    },
  );
});
