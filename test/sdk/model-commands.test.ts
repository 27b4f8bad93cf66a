// meshtrain eval and sample on model files trained here, as a user runs them: real processes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { closeSync, existsSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { mobyDickPath, readTextFile } from "../../engine/data/text.ts";
import { writeTokenFile } from "../../engine/data/tokens.ts";
import { readModelFile } from "../../engine/modelfile.ts";
import { runSample } from "../../sdk/index.ts";
import { tinyGptTraining } from "../helpers/cli-options.ts";

const root = join(import.meta.dir, "..", "..");
const cliPath = join(root, "sdk", "cli", "main.ts");
const dir = mkdtempSync(join(tmpdir(), "meshtrain-models-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The environment of a command run from `initCwd` through `npm run` (INIT_CWD set), or directly (unset). */
function env(initCwd?: string): Record<string, string | undefined> {
  const e: Record<string, string | undefined> = { ...process.env };
  delete e.INIT_CWD;
  delete e.npm_package_json;
  if (initCwd !== undefined) Object.assign(e, { INIT_CWD: initCwd, npm_package_json: join(root, "package.json") });
  return e;
}

/** Runs the CLI from the package root, as `npm run meshtrain` does; the user's folder is `dir`. */
function cli(...args: string[]) {
  const p = Bun.spawnSync([process.execPath, cliPath, ...args], {
    cwd: root,
    env: env(dir),
    stdout: "pipe",
    stderr: "pipe",
  });
  return { code: p.exitCode, out: p.stdout.toString(), err: p.stderr.toString() };
}

/** each test spawns a few CLI processes, of a second or so each on 2 idle cores */
const timeoutMs = 60_000;
const lastLines = (text: string, n: number) => text.trimEnd().split("\n").slice(-n);
const number = (re: RegExp, text: string) => Number(re.exec(text)?.[1]);

// Trained once for the file (about a second each on 2 cores); relative --out paths, so both
// trainings also check that the user's folder (INIT_CWD), not the package root, receives them.
let mlpTrain = "";
let gptTrain = "";
const mlpModel = join(dir, "mlp", "model.mtm");
const gptModel = join(dir, "gpt", "model.mtm");

beforeAll(() => {
  const mlp = cli("train", "mlp", "--epochs", "1", "--widths", "784,64,10", "--out", "mlp/model.mtm");
  expect(mlp.code).toBe(0);
  mlpTrain = mlp.out;
  const gpt = cli(...tinyGptTraining({ out: "gpt/model.mtm" }));
  expect(gpt.code).toBe(0);
  gptTrain = gpt.out;
}, 120_000);

describe("training ends by naming the model file and the commands that use it", () => {
  test("mlp", () => {
    expect(existsSync(mlpModel)).toBe(true);
    expect(existsSync(join(root, "mlp", "model.mtm"))).toBe(false);
    expect(lastLines(mlpTrain, 2)).toEqual(["model: mlp/model.mtm", "next: npx meshtrain eval --model mlp/model.mtm"]);
  });
  test("gpt", () => {
    expect(existsSync(gptModel)).toBe(true);
    expect(lastLines(gptTrain, 3)).toEqual([
      "model: gpt/model.mtm",
      "next: npx meshtrain sample --model gpt/model.mtm --prompt 'Call me'",
      "next: npx meshtrain eval --model gpt/model.mtm",
    ]);
  });
});

/** The CLI started; `until` waits for its output to match, `ended` for its whole output once it ends. */
function started(args: string[]) {
  const p = Bun.spawn([process.execPath, cliPath, ...args], {
    cwd: root,
    env: env(dir),
    stdout: "pipe",
    stderr: "pipe",
  });
  let out = "";
  const waiting: { re: RegExp; resolve: () => void }[] = [];
  const ended = (async () => {
    const decoder = new TextDecoder();
    for await (const chunk of p.stdout) {
      out += decoder.decode(chunk, { stream: true });
      for (const w of waiting.filter((x) => x.re.test(out))) w.resolve();
    }
    return out;
  })();
  const until = (re: RegExp) =>
    re.test(out)
      ? Promise.resolve()
      : Promise.race([
          new Promise<void>((resolve) => waiting.push({ re, resolve })),
          ended.then(async () => {
            throw new Error(`ended before ${re}: ${out}${await new Response(p.stderr).text()}`);
          }),
        ]);
  return { p, until, ended };
}

describe("Ctrl-C during train: the run ends after its step, evaluated and written, and exits 130", () => {
  const runs: [string, string[]][] = [
    ["mlp", ["train", "mlp", "--epochs", "100", "--widths", "784,64,10"]],
    ["gpt", tinyGptTraining({ "max-steps": 100_000, "eval-every": 100_000, "eval-batches": 4 })],
  ];
  test.each(runs)(
    "%s",
    async (kind, args) => {
      const model = join(dir, `stopped-${kind}.mtm`);
      const { p, until, ended } = started([...args, "--out", model]);
      await until(/^parameters: /m);
      await Bun.sleep(1000); // some steps
      p.kill("SIGINT");
      expect(await p.exited).toBe(130);
      const out = await ended;
      expect(out).toMatch(
        /^Ctrl-C: stopping after step \d+; the model is evaluated and written \(Ctrl-C again stops at once, without it\)$/m,
      );
      const steps = Number(/^stopped by Ctrl-C after (\d+) (?:steps )?of \d+/m.exec(out)?.[1]);
      expect(steps).toBeGreaterThan(0);
      expect(out).toContain(`after ${steps} steps in `);
      expect(out).toContain(`model: stopped-${kind}.mtm`);
      // the model written is the one evaluated, at the step it stopped
      expect(readModelFile(model).header.step).toBe(steps);
    },
    timeoutMs,
  );

  test(
    "a second Ctrl-C while the model is evaluated stops at once, writing nothing",
    async () => {
      const model = join(dir, "stopped-twice.mtm");
      // a long final evaluation: the whole validation split (--eval-batches 0), seconds
      const args = tinyGptTraining({ "max-steps": 100_000, "eval-every": 100_000, "eval-batches": 0 });
      const { p, until, ended } = started([...args, "--out", model]);
      await until(/^parameters: /m);
      await Bun.sleep(500);
      p.kill("SIGINT");
      // the first is handled between steps; the second comes while the evaluation runs
      await until(/^Ctrl-C: stopping after step /m);
      p.kill("SIGINT");
      await p.exited;
      expect(p.signalCode).toBe("SIGINT");
      expect(await ended).not.toContain("validation loss: ");
      expect(existsSync(model)).toBe(false);
    },
    timeoutMs,
  );
});

describe("eval", () => {
  test(
    "an mlp: the test accuracy and loss training printed, on the 10,000 MNIST test samples",
    () => {
      const r = cli("eval", "--model", mlpModel);
      expect(r.code).toBe(0);
      expect(r.err).toBe("");
      expect(r.out).toMatch(/^device: (cpu \(no GPU found\)|cuda:0, picked by auto \(.+\))\n/);
      // a path inside the user's folder is shown as they would type it from there
      expect(r.out).toContain("model: mlp/model.mtm: mlp 784-64-10, 50,890 parameters, 468 steps trained");
      const trained = number(/^test accuracy: ([\d.]+)%/m, mlpTrain);
      expect(trained).toBeGreaterThan(90);
      expect(number(/^test accuracy: ([\d.]+)% \(error [\d.]+%\) on 10,000 MNIST test samples$/m, r.out)).toBe(trained);
      expect(number(/^test loss: ([\d.]+)$/m, r.out)).toBe(number(/test loss ([\d.]+), test accuracy/, mlpTrain));
    },
    timeoutMs,
  );

  test(
    "a gpt: the validation loss training printed, over the same split in the same batches (its micro-batch of 16 windows)",
    () => {
      const all = cli("eval", "--model", gptModel);
      expect(all.code).toBe(0);
      const trained = number(/^validation loss: ([\d.]+) nats\/token/m, gptTrain);
      expect(trained).toBeLessThan(Math.log(83)); // it learned something: uniform over 83 characters is 4.42
      expect(number(/^validation loss: ([\d.]+) nats\/char on [\d,]+ characters of Moby Dick/m, all.out)).toBe(trained);
      expect(all.out).toContain("its last 10% (233 batches of 16 windows, all)");
      // --eval-batches bounds the pass, and the report says so
      const some = cli("eval", "--model", gptModel, "--eval-batches", "2");
      expect(some.code).toBe(0);
      expect(some.out).toContain("nats/char on 1,024 characters of Moby Dick");
      expect(some.out).toContain("its last 10% (the first 2 of 233 batches of 16 windows; --eval-batches 0 for all)");
      expect(Math.abs(number(/^validation loss: ([\d.]+)/m, some.out) - trained)).toBeLessThan(0.5);
    },
    timeoutMs,
  );

  test(
    "a gpt on token files: the recorded --tokens's val.bin, or another one; a text is refused",
    () => {
      const tokens = (n: number) => Uint16Array.from({ length: n }, (_, i) => (i * 3) % 7);
      mkdirSync(join(dir, "tok"));
      writeTokenFile(join(dir, "tok", "train.bin"), tokens(4000));
      writeTokenFile(join(dir, "tok", "val.bin"), tokens(1000), "raw");
      const model = join(dir, "tok.mtm");
      const train = cli(
        "train",
        "gpt",
        "--tokens",
        "tok",
        "--vocab-size",
        "8",
        "--max-steps",
        "10",
        "--eval-every",
        "10",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "8",
        "--batch-size",
        "8",
        "--warmup",
        "2",
        "--out",
        "tok.mtm",
      );
      expect(train.code).toBe(0);
      expect(lastLines(train.out, 2)).toEqual(["model: tok.mtm", "next: npx meshtrain eval --model tok.mtm"]); // no vocabulary: no sample
      const r = cli("eval", "--model", model);
      expect(r.code).toBe(0);
      const trained = number(/^validation loss: ([\d.]+) nats\/token/m, train.out);
      expect(
        number(
          /^validation loss: ([\d.]+) nats\/token on 992 tokens of tok\/val\.bin \(16 batches of 8 windows, all\)$/m,
          r.out,
        ),
      ).toBe(trained);
      mkdirSync(join(dir, "tok2"));
      writeTokenFile(join(dir, "tok2", "val.bin"), tokens(200));
      expect(cli("eval", "--model", model, "--tokens", "tok2").out).toContain(
        "nats/token on 192 tokens of tok2/val.bin (3 batches of 8 windows, all)",
      );
      const text = cli("eval", "--model", model, "--text", "a.txt");
      expect(text.code).toBe(1);
      expect(text.err).toBe(
        "meshtrain: ConfigError: tok.mtm was trained on token files and has no character vocabulary: pass --tokens <dir> (with val.bin)\n",
      );
    },
    timeoutMs,
  );

  test(
    "a relative --model resolves against the user's folder (INIT_CWD), or the working directory without it",
    () => {
      const viaNpm = cli("eval", "--model", "mlp/model.mtm");
      expect(viaNpm.code).toBe(0);
      expect(viaNpm.out).toContain("model: mlp/model.mtm: mlp 784-64-10");
      const direct = Bun.spawnSync([process.execPath, cliPath, "eval", "--model", join("mlp", "model.mtm")], {
        cwd: dir,
        env: env(),
        stdout: "pipe",
        stderr: "pipe",
      });
      expect(direct.exitCode).toBe(0);
      expect(direct.stdout.toString()).toContain("model: mlp/model.mtm: mlp 784-64-10");
    },
    timeoutMs,
  );
});

describe("bad input: a typed error on one line and exit 1", () => {
  /** stderr of eval is the error alone (its device line is on stdout); sample's device line goes first */
  const failure = (r: { code: number | null; err: string }) => {
    expect(r.code).toBe(1);
    return lastLines(r.err, 1)[0]!;
  };

  test.each(["eval", "sample"])(
    "%s: a missing model file",
    (command) => {
      const absent = join(dir, "absent.mtm");
      const r = cli(command, "--model", absent);
      expect(failure(r)).toBe(`meshtrain: DataFileError: ${absent}: file not found`);
      if (command === "eval") expect(r.err.trim().split("\n")).toHaveLength(1);
    },
    timeoutMs,
  );

  test.each(["eval", "sample"])(
    "%s: a truncated model file",
    (command) => {
      const cut = join(dir, "truncated.mtm");
      const bytes = readFileSync(gptModel);
      writeFileSync(cut, bytes.subarray(0, bytes.length - 100));
      expect(failure(cli(command, "--model", cut))).toBe(
        `meshtrain: DataFileError: ${cut}: truncated or corrupt: expected ${bytes.length} bytes, file has ${bytes.length - 100}`,
      );
    },
    timeoutMs,
  );

  test(
    "sample on an mlp: it is a classifier, and eval is the command for it",
    () => {
      expect(failure(cli("sample", "--model", "mlp/model.mtm"))).toBe(
        `meshtrain: DataFileError: ${mlpModel}: is an MLP classifier (784-64-10), ` +
          "not a text model; sample needs a gpt model. To see how good it is: meshtrain eval --model mlp/model.mtm",
      );
    },
    timeoutMs,
  );

  test(
    "eval: data options for the other kind of model",
    () => {
      expect(failure(cli("eval", "--model", gptModel, "--data-dir", dir))).toBe(
        "meshtrain: ConfigError: --data-dir cannot be used on gpt/model.mtm: it is a GPT, which takes --text or --tokens",
      );
      expect(failure(cli("eval", "--model", mlpModel, "--text", "a.txt", "--tokens", "t"))).toBe(
        "meshtrain: ConfigError: --text and --tokens cannot be used on mlp/model.mtm: it is an MLP classifier, which takes --data-dir (MNIST idx files)",
      );
      expect(failure(cli("eval", "--model", gptModel, "--text", "a.txt", "--tokens", "t"))).toBe(
        "meshtrain: ConfigError: --text and --tokens exclude each other: pass one",
      );
    },
    timeoutMs,
  );

  test(
    "eval: data that does not fit the model",
    () => {
      const other = join(dir, "other.txt");
      writeFileSync(other, "Ахав ".repeat(100));
      expect(failure(cli("eval", "--model", gptModel, "--text", "other.txt"))).toBe(
        `meshtrain: DataFileError: ${other}: character "А" (U+410) at position 0 is not in the vocabulary: the model was trained on another text`,
      );
      expect(failure(cli("eval", "--model", mlpModel, "--data-dir", "nowhere"))).toBe(
        `meshtrain: DataFileError: ${join(dir, "nowhere", "t10k-images-idx3-ubyte")}: file not found`,
      );
      const negative = cli("eval", "--model", gptModel, "--eval-batches", "-1");
      expect(negative.code).toBe(1);
      expect(negative.err).toStartWith(
        "error: option '--eval-batches <n>' argument '-1' is invalid. expected an integer >= 0 (every option: meshtrain eval --help)\n",
      ); // then the help
    },
    timeoutMs,
  );
});

describe("sample", () => {
  test(
    "stdout carries the prompt and the sample alone, ending in a newline; the device line is on stderr",
    () => {
      const r = cli("sample", "--model", gptModel, "--prompt", "Call me", "--length", "40", "--seed", "3");
      expect(r.code).toBe(0);
      expect(r.out).toStartWith("Call me");
      expect(r.out).toEndWith("\n");
      expect([...r.out].length).toBe(7 + 40 + 1);
      expect(r.err).toMatch(
        /^device: (cpu \(no GPU found\)|cuda:0, picked by auto \(.+\))\nsampled 40 tokens in [\d.]+ s: [\d.]+ tokens\/s \(KV cache\)\n$/,
      );
      // the whole window's forward per token gives the same sample
      const full = cli(
        "sample",
        "--model",
        gptModel,
        "--prompt",
        "Call me",
        "--length",
        "40",
        "--seed",
        "3",
        "--no-kv-cache",
      );
      expect(full.out).toBe(r.out);
      expect(full.err).toContain("tokens/s (whole window per token)");
      // both streams on one terminal: the sample's newline comes before the closing line
      const both = join(dir, "sample-both.txt");
      const fd = openSync(both, "w");
      try {
        const p = Bun.spawnSync([process.execPath, cliPath, "sample", "--model", gptModel, "--length", "5"], {
          cwd: root,
          env: env(dir),
          stdout: fd,
          stderr: fd,
        });
        expect(p.exitCode).toBe(0);
      } finally {
        closeSync(fd);
      }
      expect(readFileSync(both, "utf8")).toMatch(/\nsampled 5 tokens in [\d.]+ s: [\d.]+ tokens\/s \(KV cache\)\n$/);
    },
    timeoutMs,
  );

  test(
    "top-p: in (0, 1], else refused with the reason; near 0 it takes the most likely token",
    () => {
      for (const bad of ["0", "1.5", "-0.1", "x"]) {
        const r = cli("sample", "--model", gptModel, "--top-p", bad);
        expect(r.code).toBe(1);
        expect(r.err).toStartWith(`error: option '--top-p <p>' argument '${bad}' is invalid.`);
      }
      const greedy = (seed: string) =>
        cli("sample", "--model", gptModel, "--prompt", "Call me", "--length", "20", "--top-p", "1e-9", "--seed", seed);
      expect(greedy("1").out).toBe(greedy("2").out);
      const topK1 = cli("sample", "--model", gptModel, "--prompt", "Call me", "--length", "20", "--top-k", "1");
      expect(greedy("1").out).toBe(topK1.out);
    },
    timeoutMs,
  );

  test(
    "a Hugging Face folder that export wrote: the same sample and validation loss as its model file",
    () => {
      expect(cli("export", "--model", gptModel, "--out", "gpt/hf").code).toBe(0);
      const args = ["--prompt", "Call me", "--length", "30", "--seed", "4", "--top-p", "0.9"];
      const fromFile = cli("sample", "--model", gptModel, ...args);
      const fromFolder = cli("sample", "--model", "gpt/hf", ...args);
      expect(fromFile.code).toBe(0);
      expect(fromFolder.out).toBe(fromFile.out);
      // the SDK's runSample, in this process, on the folder: the same text
      const sdkSample = runSample({
        model: join(dir, "gpt", "hf"),
        prompt: "Call me",
        length: 30,
        seed: 4,
        temperature: 0.8,
        topK: 0,
        topP: 0.9,
        device: "cpu",
      });
      expect(`${sdkSample}\n`).toBe(fromFile.out);
      // the folder records no training: its text is named, here the start of the one it was trained on
      writeFileSync(join(dir, "moby-start.txt"), readTextFile(mobyDickPath()).slice(0, 20_000));
      const loss = (model: string) => {
        const r = cli("eval", "--model", model, "--text", "moby-start.txt");
        expect(r.code).toBe(0);
        return number(/^validation loss: ([\d.]+) nats\/char on 1,984 characters/m, r.out);
      };
      expect(loss("gpt/hf")).toBe(loss(gptModel));
      expect(loss(gptModel)).toBeGreaterThan(0);
      // a folder that is not one: what it lacks
      mkdirSync(join(dir, "empty"), { recursive: true });
      const r = cli("sample", "--model", "empty");
      expect(r.code).toBe(1);
      expect(lastLines(r.err, 1)[0]).toBe(
        `meshtrain: DataFileError: ${join(dir, "empty")}: has no config.json: a Hugging Face GPT-2 folder (what meshtrain export writes) has one`,
      );
    },
    timeoutMs,
  );

  test(
    "characters arrive on stdout while it is still generating",
    async () => {
      // a million characters would take minutes: the process is stopped once the first arrive
      await using p = Bun.spawn(
        [process.execPath, cliPath, "sample", "--model", gptModel, "--prompt", "Call me", "--length", "1000000"],
        {
          cwd: root,
          env: env(dir),
          stdout: "pipe",
          stderr: "ignore",
        },
      );
      const reader = p.stdout.getReader();
      let text = "";
      const decoder = new TextDecoder();
      while (text.length <= "Call me".length) {
        const { value, done } = await reader.read();
        expect(done).toBe(false);
        text += decoder.decode(value, { stream: true });
      }
      expect(text).toStartWith("Call me");
      expect(p.exitCode).toBe(null);
      p.kill();
      await p.exited;
      expect(p.signalCode).toBe("SIGTERM"); // it was stopped, not finished
    },
    timeoutMs,
  );
});
