// The meshtrain CLI as a user runs it: real processes, real data files.
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { readModelFile } from "../../engine/modelfile.ts";
import { probeCuda } from "../../ffi/cuda/backend.ts";
import { benchHelp } from "../../bench/index.ts";
import { benchNames } from "../../sdk/cli/options.ts";
import { cliOptions, tinyGptTraining } from "../helpers/cli-options.ts";
import { skip } from "../helpers/skip.ts";
import { startNatsServer } from "../helpers/mesh.ts";

const root = join(import.meta.dir, "..", "..");
const dir = mkdtempSync(join(tmpdir(), "meshtrain-cli-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

// the user's folder is the package root (an INIT_CWD from the outer `npm test` would move where paths are shown from)
const env = { ...process.env, INIT_CWD: root, npm_package_json: join(root, "package.json") };

/** `run` writes its jobs under --dir: a folder of the test's for run's command lines. */
const runDir = (args: readonly string[]): string[] => (args[0] === "run" ? ["--dir", join(dir, "run")] : []);

function cli(...args: string[]) {
  const p = Bun.spawnSync([process.execPath, join(root, "sdk", "cli", "main.ts"), ...args], {
    cwd: root,
    env,
    stdout: "pipe",
    stderr: "pipe",
  });
  return { code: p.exitCode, out: p.stdout.toString(), err: p.stderr.toString() };
}

/** `bun run bench <args>`: its exit code, output and stdout's lines, the last parsed where it is JSON. */
function bench(...args: string[]) {
  const p = Bun.spawnSync([process.execPath, join(root, "bench", "index.ts"), ...args], {
    cwd: root,
    stdout: "pipe",
    stderr: "pipe",
  });
  const out = p.stdout.toString();
  const lines = out.trim().split("\n");
  const tail = lines[lines.length - 1] ?? "";
  return {
    code: p.exitCode,
    out,
    lines,
    last: tail.startsWith("{") ? JSON.parse(tail) : null,
    err: p.stderr.toString(),
  };
}

describe("bad input gets one clear error and a non-zero exit", () => {
  test.each([
    [["run", "--widths", "784,100,3"], "--widths must start with 784"],
    [["run", "--batch-size", "100", "--accum", "3"], "--batch-size (100) must be a multiple of --accum (3)"],
    [["run", "--job", "no spaces"], "job: a job is <name> or <owner>.<name>"],
    // a dot makes an owner: the local mesh's client acts for the default one only
    [
      ["run", "--job", "lr-0.01"],
      '"lr-0.01" is job "01" of owner "lr-0" (a job is <owner>.<name>), and this client acts for owner "default": a name without a dot is one of its own (lr-0_01)',
    ],
    [["submit", "--sync", "sometimes"], "Allowed choices are bsp, asp, ssp"],
    [
      ["run", "--precision", "f16"],
      "precision f16 runs in all-reduce mode (--sync allreduce) or a single process (meshtrain train): its loss scaler skips steps",
    ],
    [["submit", "--precision", "fp8"], "Allowed choices are f32, tf32, bf16, f16"],
    [["run", "--scale-lr", "--warmup", "0"], "--scale-lr needs --warmup > 0"],
    [["plan", "--model", "gpt", "--n-head", "3"], "--n-embd (128) must be divisible by --n-head (3)"], // the flags, not the config's keys
    [["run", "--sync", "allreduce", "--bucket-mb", "0"], "--bucket-mb"],
    [["run", "--sync", "allreduce", "--zero", "4"], "Allowed choices are 0, 1, 2, 3"],
    [["run", "--zero", "1"], "ZeRO (zero 1) partitions the trainers' replicas, so it needs sync allreduce"],
    [["run", "--shards", "0"], "expected an integer >= 1"],
    [["run", "--compress", "int4"], "compression must be none, bf16, fp16, int8 or topk:<fraction in (0, 1]>"],
    [["run", "--compress", "topk:0"], "topk's fraction must be in (0, 1]"],
    [["submit", "--compress", "topk:1.5"], "topk's fraction must be in (0, 1]"],
    // a flag of another sync mode, or two flags of one setting, would be dropped unsaid
    [
      ["run", "--sync", "allreduce", "--shards", "3"],
      "--shards does nothing under --sync allreduce (--shards is for bsp, asp, ssp)",
    ],
    [["plan", "--staleness", "3"], "--staleness does nothing under --sync bsp (--staleness is for ssp)"],
    [["plan", "--sync", "ssp", "--staleness", "0"], "--sync ssp with --staleness 0 is BSP"],
    [["run", "--pipe-schedule", "gpipe"], "--pipe-schedule orders a pipeline's passes, and this job has none"],
    [["plan", "--sync", "asp", "--staleness", "3"], "--staleness does nothing under --sync asp"],
    [
      ["submit", "--bucket-mb", "5", "--coll-transport", "nats"],
      "--bucket-mb, --coll-transport do nothing under --sync bsp",
    ],
    [
      ["plan", "--accum", "2", "--micro-batches", "4"],
      "--micro-batches and --accum set the same count (micro-batches a step): pass one",
    ],
    // train's own: what the run would drop
    [["train", "mlp", "--beta2", "0.9"], "--beta2 is not for --optimizer sgd"],
    [["train", "mlp", "--optimizer", "adamw", "--no-nesterov"], "--no-nesterov is not for --optimizer adamw"],
    [
      ["train", "gpt", "--tokens", "d", "--val-fraction", "0.3"],
      "--val-fraction is for --text: a --tokens folder's validation split is its val.bin, or the val shards prepare wrote",
    ],
    [
      ["train", "gpt", "--text", "a.txt", "--vocab-size", "5"],
      "--vocab-size is for --tokens folders without vocab.json",
    ],
    [
      ["train", "gpt", "--n-embd", "128", "--n-head", "3"],
      "ConfigError: --n-embd (128) must be divisible by --n-head (3)",
    ],
  ])("job options %p", (args, fragment) => {
    const r = cli(...args);
    expect(r.code).not.toBe(0);
    expect(r.err).toContain(fragment);
  });

  test("an out-of-range option", () => {
    const r = cli("train", "mlp", "--lr", "-1");
    expect(r.code).not.toBe(0);
    expect(r.err).toContain("--lr");
    expect(r.err).toContain("expected a number > 0");
  });
  test("a non-integer where an integer is needed", () => {
    const r = cli("train", "gpt", "--n-layer", "2.5");
    expect(r.code).not.toBe(0);
    expect(r.err).toContain("expected an integer");
  });
  test("widths that do not fit MNIST", () => {
    const r = cli("train", "mlp", "--widths", "784,100,3");
    expect(r.code).toBe(1);
    expect(r.err).toContain("ConfigError: --widths must start with 784 (pixels) and end with 10 (classes)");
  });
  test("a missing model file", () => {
    const r = cli("sample", "--model", join(dir, "absent.mtm"));
    expect(r.code).toBe(1);
    expect(r.err).toContain(`meshtrain: DataFileError: ${join(dir, "absent.mtm")}: file not found`);
  });
  test("one error, one line: an option error carries its help hint on the same line; an input error prints no device line before it", () => {
    const empty = join(dir, "empty-folder");
    mkdirSync(empty, { recursive: true });
    const truncated = join(dir, "truncated.mtm");
    writeFileSync(truncated, "MTM1 and nothing else");
    for (const [args, fragment] of [
      [["train", "gpt", "--steps", "3"], "error: unknown option '--steps' (every option: meshtrain train gpt --help)"],
      [["run", "--trainers", "0"], "(every option: meshtrain run --help)"],
      [["train", "gpt", "--init-from", empty], `${empty}: has no config.json`],
      [["train", "mlp", "--data-dir", join(dir, "nowhere")], "train-images-idx3-ubyte: file not found"],
      [["eval", "--model", truncated], `DataFileError: ${truncated}`],
      [["sample", "--model", truncated], `DataFileError: ${truncated}`],
    ] as const) {
      const r = cli(...args);
      expect(r.code, args.join(" ")).not.toBe(0);
      expect(r.out, args.join(" ")).toBe("");
      expect(r.err, args.join(" ")).toContain(fragment);
      expect(r.err.trimEnd().split("\n"), args.join(" ")).toHaveLength(1);
    }
  });
  test("where a command writes is checked before any work: a folder for a file, a file for a folder, a path through a file; nothing is left there", () => {
    const folder = join(dir, "out-folder");
    mkdirSync(folder, { recursive: true });
    const file = join(dir, "out-file.txt");
    writeFileSync(file, "not a folder\n");
    for (const [args, line] of [
      [
        ["train", "mlp", "--out", folder],
        `--out ${folder} is a folder: name the file to write (e.g. ${join(folder, "model.mtm")})`,
      ],
      [
        ["train", "gpt", "--out", folder],
        `--out ${folder} is a folder: name the file to write (e.g. ${join(folder, "model.mtm")})`,
      ],
      [
        ["train", "mlp", "--out", join(file, "m.mtm")],
        `--out ${join(file, "m.mtm")} cannot be written: a part of its path is a file, not a folder`,
      ],
      [["prepare", "--text", file, "--out", file], `--out ${file} is a file, not a folder`],
      [["creds", "--dir", file], `--dir ${file} is a file, not a folder`],
      [["run", "--dir", file, "--max-steps", "2"], `--dir ${file} is a file, not a folder`],
    ] as const) {
      const r = cli(...args);
      expect([r.code, r.err.trim(), r.out], args.join(" ")).toEqual([1, `meshtrain: ConfigError: ${line}`, ""]);
    }
    // a command refused for another reason makes none of the folders its output would go in
    const later = join(dir, "not-made");
    const other = cli("train", "gpt", "--text", join(dir, "no-such.txt"), "--out", join(later, "a", "m.mtm"));
    expect([other.code, existsSync(later)]).toEqual([1, false]);
    expect(readdirSync(dir).filter((f) => f.includes(".tmp-") || f.includes(".meshtrain-write-test"))).toEqual([]);
  });
  test("a train gpt run that cannot fit this machine's memory is refused before it starts, saying what it needs", () => {
    const r = cli(
      ...["train", "gpt", "--device", "cpu", "--n-layer", "1", "--n-head", "2", "--n-embd", "256"],
      ...["--block-size", "1024", "--batch-size", "65536", "--out", join(dir, "never.mtm")],
    );
    expect(r.code).toBe(1);
    expect(r.err.trim()).toMatch(
      /^meshtrain: ConfigError: the run does not fit: it needs parameters .* activations [\d.]+ TiB at a pass's peak = [\d.]+ TiB \(predicted\), more than the [\d.]+ [GT]iB of this machine's memory; a smaller --batch-size/,
    );
    expect(r.out).not.toContain("step 1"); // nothing trained
  });
  test("a token folder is checked before --vocab-size is advised and before the mesh starts", () => {
    const empty = join(dir, "no-tokens");
    mkdirSync(empty, { recursive: true });
    const absent = cli("run", "--model", "gpt", "--tokens", join(dir, "nonexistent"));
    expect(absent.code).toBe(1);
    expect(absent.err.trim()).toBe(`meshtrain: ConfigError: --tokens ${join(dir, "nonexistent")}: no such folder`);
    for (const extra of [[], ["--vocab-size", "50"]]) {
      const r = cli("run", "--model", "gpt", "--tokens", empty, ...extra);
      expect(r.code).toBe(1);
      expect(r.err).toContain(`--tokens ${empty}: has no train.bin or val.bin`);
      expect(r.out).not.toContain("nats"); // nothing started
    }
  });
  test("the token folder is --tokens in train gpt and eval, as in run; the old --tokens-dir still works, with a note, and not beside --tokens", () => {
    const folder = join(dir, "no-tokens-here");
    const help = cli("train", "gpt", "--help").out;
    expect(help).toContain("--tokens <dir>");
    expect(help).not.toContain("--tokens-dir");
    const both = cli("train", "gpt", "--tokens", folder, "--tokens-dir", folder);
    expect(both.code).toBe(1);
    expect(both.err.trim()).toBe("meshtrain: ConfigError: --tokens-dir is the old name of --tokens: pass one");
    for (const flag of ["--tokens", "--tokens-dir"]) {
      const r = cli("eval", "--model", join(dir, "absent.mtm"), flag, folder);
      expect(r.code).toBe(1);
      expect(r.err.includes("note: --tokens-dir is now --tokens")).toBe(flag === "--tokens-dir");
    }
  });
  test("a missing MNIST folder", () => {
    const r = cli("train", "mlp", "--data-dir", join(dir, "nowhere"));
    expect(r.code).toBe(1);
    expect(r.err).toContain("train-images-idx3-ubyte: file not found");
  });
  test.each([
    [
      ["train", "mlp", "--device", "tpu"],
      "error: option '--device <name>' argument 'tpu' is invalid. Allowed choices are auto, cpu, cuda.",
    ],
    [
      ["train", "gpt", "--precision", "f8"],
      "error: option '--precision <p>' argument 'f8' is invalid. Allowed choices are f32, tf32, bf16, f16.",
    ],
    [
      ["sample", "--device", "gpu"],
      "error: option '--device <name>' argument 'gpu' is invalid. Allowed choices are auto, cpu, cuda.",
    ],
    [["sample", "--precision", "bf16"], "error: unknown option '--precision'"],
  ])("device and precision choices %p", (args, message) => {
    const r = cli(...args);
    expect(r.code).toBe(1);
    expect(r.err).toContain(message);
  });
  // where CUDA is present, `--device cuda` trains: the end-to-end runs cover that
  test
    .skipIf(skip("a machine without a GPU", probeCuda().ok ? "a GPU is present" : null))
    .each(["train mlp", "train gpt", "sample"])("--device cuda without a GPU: one clear line (%s)", (command) => {
    const r = cli(...command.split(" "), "--device", "cuda");
    expect(r.code).toBe(1);
    const lines = r.err.trim().split("\n");
    expect(lines).toHaveLength(1);
    expect(lines[0]).toStartWith("meshtrain: NativeLibraryError: --device cuda: ");
  });
  test.skipIf(skip("a machine without a GPU", probeCuda().ok ? "a GPU is present" : null))(
    "MT_DEVICE=cuda meshtrain run without a GPU: the trainers are not restarted, and the run ends at once naming the cause",
    () => {
      const started = performance.now();
      const p = Bun.spawnSync(
        [
          process.execPath,
          join(root, "sdk", "cli", "main.ts"),
          "run",
          "--no-dashboard",
          "--epochs",
          "1",
          "--dir",
          join(dir, "no-gpu"),
        ],
        {
          cwd: root,
          env: { ...env, MT_DEVICE: "cuda" },
          stdout: "pipe",
          stderr: "pipe",
          timeout: 60_000,
        },
      );
      const out = p.stdout.toString();
      expect(p.exitCode).toBe(1);
      expect(out).toMatch(
        /launcher: trainer-[01] cannot start: trainer failed to start: --device cuda: no CUDA driver/,
      );
      expect(out).toContain("not restarting: a configuration error");
      expect(out).not.toContain("restarting in");
      expect(p.stderr.toString()).toMatch(
        /cannot run: trainer-[01] cannot start: trainer failed to start: --device cuda: no CUDA driver/,
      );
      // a start-up failure, not minutes of restarts with backoff
      expect(performance.now() - started).toBeLessThan(30_000);
    },
  );
  test.skipIf(skip("a machine without a GPU", probeCuda().ok ? "a GPU is present" : null)).each(["engine", "kernels"])(
    "`bun run bench %s --device cuda` without a GPU: one clear line",
    (name) => {
      const r = bench(name, "--device", "cuda");
      expect(r.code).toBe(1);
      const lines = r.err.trim().split("\n");
      expect(lines).toHaveLength(1);
      expect(lines[0]).toStartWith(`bench ${name}: NativeLibraryError: --device cuda: `);
    },
  );
  test.skipIf(skip("a machine without a GPU", probeCuda().ok ? "a GPU is present" : null))(
    "`bun run bench epilogues` without a GPU, and with a wrong option: one clear line each",
    () => {
      const r = bench("epilogues");
      expect(r.code).toBe(1);
      expect(r.err.trim().split("\n")).toEqual([
        expect.stringMatching(
          /^bench epilogues: NativeLibraryError: bench epilogues needs a GPU \(on a CPU epilogues are always the kernels\): /,
        ),
      ]);
      const bad = bench("epilogues", "--rows", "0");
      expect(bad.code).toBe(2);
      expect(bad.err.trim()).toBe("bench epilogues: --rows must be a positive integer, got 0");
    },
  );
  test("--attention: an unknown path, and cudnn where it cannot run, are refused before anything starts (train gpt, run)", async () => {
    const started = performance.now();
    const refused: [string[], string][] = [
      [
        ["train", "gpt", "--attention", "fast"],
        "error: option '--attention <path>' argument 'fast' is invalid. Allowed choices are auto, cudnn, kernel, reference.",
      ],
      [
        ["train", "gpt", "--attention", "cudnn", "--device", "cpu"],
        "meshtrain: ConfigError: --attention cudnn needs bf16 or f16 autocast (--precision bf16 or f16): cuDNN's fused attention reads q, k and v in 2 bytes, and precision f32 keeps them f32",
      ],
      [
        ["train", "gpt", "--attention", "cudnn", "--precision", "bf16", "--device", "cpu"],
        "meshtrain: ConfigError: --attention cudnn needs a GPU (cuDNN's fused attention runs on one), but --device cpu asks for the CPU",
      ],
      [
        ["run", "--model", "gpt", "--attention", "fast"],
        "error: option '--attention <path>' argument 'fast' is invalid. Allowed choices are auto, cudnn, kernel, reference.",
      ],
      [
        ["run", "--model", "gpt", "--attention", "cudnn", "--precision", "tf32"],
        "meshtrain: ConfigError: invalid job config: attention cudnn needs bf16 or f16 autocast (--precision bf16 or f16)",
      ],
      [
        ["run", "--model", "gpt", "--attention", "cudnn", "--precision", "bf16"],
        "needs a GPU (cuDNN's fused attention runs on one), but the local mesh's trainers compute on the CPU (MT_DEVICE=cpu; MT_DEVICE=cuda puts them on GPUs)",
      ],
    ];
    // in parallel: each is a process that refuses at once
    const results = await Promise.all(
      refused.map(async ([args]) => {
        const p = Bun.spawn([process.execPath, join(root, "sdk", "cli", "main.ts"), ...args, ...runDir(args)], {
          cwd: root,
          env: { ...env, MT_DEVICE: "cpu" },
          stdout: "pipe",
          stderr: "pipe",
          timeout: 30_000,
        });
        const [code, out, err] = await Promise.all([
          p.exited,
          new Response(p.stdout).text(),
          new Response(p.stderr).text(),
        ]);
        return { code, out, err };
      }),
    );
    expect(results.map((r) => [r.code, r.err.split("\n")[0]])).toEqual(
      refused.map(([, message]) => [1, expect.stringContaining(message)]),
    );
    // nothing started: no training, no mesh
    for (const r of results) expect(r.out).not.toMatch(/launcher:|^step /m);
    expect(performance.now() - started).toBeLessThan(30_000);
  });
  test("gpt heads that do not divide the width", () => {
    const r = cli("train", "gpt", "--n-embd", "30", "--n-head", "4");
    expect(r.code).toBe(1);
    expect(r.err.trim()).toBe("meshtrain: ConfigError: --n-embd (30) must be divisible by --n-head (4)");
  });
});

describe("training runs end to end", () => {
  test("mlp on MNIST: one epoch reaches over 95% test accuracy and writes a model file", () => {
    const out = join(dir, "mlp.mtm");
    const r = cli("train", "mlp", "--epochs", "1", "--out", out);
    expect(r.code).toBe(0);
    const accuracy = Number(/test accuracy: ([\d.]+)%/.exec(r.out)?.[1]);
    expect(accuracy).toBeGreaterThan(95);
    // it ends by naming the model file and the command that uses it
    expect(r.out.trimEnd().split("\n").slice(-2)).toEqual([`model: ${out}`, `next: npx meshtrain eval --model ${out}`]);
    expect(r.out).toContain("parameters: 636,010");
    // short: the reason CUDA is missing (and how to install it) is for --device cuda, not for auto
    expect(r.out).toMatch(/^device: (cpu \(no GPU found\)|cuda:\d+, picked by auto \(.+\))$/m); // once, first
    expect(r.out.match(/^device: /gm)).toHaveLength(1);
    expect(r.out.startsWith("device: ")).toBe(true);
  }, 120_000);

  test("gpt on Moby Dick: loss falls well below uniform, then sample continues a prompt", () => {
    const out = join(dir, "gpt.mtm");
    const r = cli(...tinyGptTraining({ "max-steps": 60, warmup: 10, "sample-chars": 40, out }));
    expect(r.code).toBe(0);
    const val = Number(/validation loss: ([\d.]+)/.exec(r.out)?.[1]);
    expect(val).toBeLessThan(Math.log(83) - 1); // uniform over 83 characters is 4.42 nats
    const s = cli("sample", "--model", out, "--prompt", "Call me", "--length", "30", "--seed", "3");
    expect(s.code).toBe(0);
    const text = s.out.replace(/\n$/, "");
    expect(text.startsWith("Call me")).toBe(true);
    expect([...text].length).toBe(37);
    expect(cli("sample", "--model", out, "--prompt", "Call me", "--length", "30", "--seed", "3").out).toBe(s.out);
    const unknown = cli("sample", "--model", out, "--prompt", "€");
    expect(unknown.code).toBe(1);
    expect(unknown.err.trim()).toBe(
      'meshtrain: ConfigError: --prompt: character "€" (U+20AC) at position 0 is not in the vocabulary; a character-level model knows only the characters of the text it trained on',
    );
  }, 120_000);

  test("gpt --max-steps 1: one step, validated, saved and sampled (a model to look at before training); 0 is refused", () => {
    const out = join(dir, "one-step.mtm");
    const r = cli(...tinyGptTraining({ "max-steps": 1, "sample-chars": 8, out }));
    expect(r.code).toBe(0);
    expect(r.out).toMatch(/^step 1\/1 \| loss [\d.]+ \| [1-9]\d* tokens\/s/m);
    expect(r.out).toMatch(/^validation loss: [\d.]+ nats\/token after 1 step in /m);
    expect(readModelFile(out).header.step).toBe(1);
    const zero = cli(...tinyGptTraining({ "max-steps": 0, out }));
    expect(zero.code).toBe(1);
    expect(zero.err).toStartWith("error: option '--max-steps <n>' argument '0' is invalid. expected an integer >= 1");
  }, 120_000);

  test("gpt in f16 on the CPU: autocast GEMMs with loss scaling train as f32 does", () => {
    const run = (precision: "f16" | "f32", attention: string) => {
      const r = cli(
        ...tinyGptTraining({ device: "cpu", precision, attention, out: join(dir, `gpt-${precision}.mtm`) }),
      );
      expect(r.code).toBe(0);
      expect(r.out.startsWith("device: cpu (asked for)\n")).toBe(true);
      // the header says which attention runs for the precision's inputs: the CPU's kernels, whatever --attention
      expect(r.out).toContain(`\nattention: ${cpu.describeAttention(precision)}\n`);
      return { out: r.out, val: Number(/validation loss: ([\d.]+)/.exec(r.out)?.[1]) };
    };
    const cpu = new CpuBackend();
    const f16 = run("f16", "auto");
    expect(f16.out).toContain("cpu backend, f16 autocast GEMMs, f32 master weights, dynamic loss scaling");
    const f32 = run("f32", "reference");
    cpu.dispose();
    expect(Math.abs(f16.val - f32.val)).toBeLessThan(0.05 * f32.val);
  }, 120_000);
});

test("a --nats-url that cannot name a NATS server is refused as such, at once (not tried as a server that does not answer)", () => {
  for (const [url, why] of [
    ["", "is empty"],
    ["http://127.0.0.1:8080", "http:// is not a NATS server's scheme (nats:// or tls://)"],
    ["nats://127.0.0.1:99999", "is not host:port"],
    ["nats://127.0.0.1:0", "port 0 is no server's"],
    ["nats://127.0.0.1:4222,nats://a/b", "a NATS URL has no path"],
  ] as const) {
    const r = cli("status", "--nats-url", url);
    const lines = r.err.trim().split("\n");
    expect([r.code, lines.length], url).toEqual([1, 1]);
    expect(lines[0], url).toStartWith(`meshtrain: ConfigError: --nats-url ${JSON.stringify(url)}: `);
    expect(lines[0], url).toContain(why);
  }
});

test("metrics and status against a NATS server with no mesh on it say no service answers (not that metrics are off, not a subject's no responders), and fail", async () => {
  await using server = await startNatsServer({ jetstream: true });
  // (the server is its own process: a command run synchronously reaches it)
  const metrics = cli("metrics", "--nats-url", server.url);
  expect([metrics.code, metrics.out.trim()]).toEqual([
    1,
    `no meshtrain service answers on ${server.url}: is the mesh up? (meshtrain mesh up)`,
  ]);
  // status of a job there: no such job, and why nothing could be looked up (not a subject's "no responders")
  const st = cli("status", "x", "--nats-url", server.url);
  expect([st.code, st.err.trim()]).toEqual([
    1,
    `meshtrain: UnknownJobError: no job default.x on ${server.url}: no record, and no checkpoint service answers there to look for its snapshots; is the mesh up? (meshtrain mesh up)`,
  ]);
});

test("--version prints the package's version; help of a command that does not exist says so", () => {
  const version = JSON.parse(readFileSync(join(root, "package.json"), "utf8")).version as string;
  for (const flag of ["--version", "-V"]) expect(cli(flag)).toEqual({ code: 0, out: `${version}\n`, err: "" });
  const nosuch = cli("help", "nosuch");
  expect([nosuch.code, nosuch.out, nosuch.err]).toEqual([
    1,
    "",
    'error: no command "nosuch" (every command: meshtrain --help)\n',
  ]);
  expect(cli("help", "eval").out).toContain("Usage: meshtrain eval");
});

test("every benchmark's --help says what it measures and names each of its options; `meshtrain bench --help` lists them all", () => {
  for (const name of benchNames) {
    const help = benchHelp(name);
    // the options the benchmark parses (its parseBenchArgs call's keys)
    const src = readFileSync(join(root, "bench", `${name}.ts`), "utf8");
    const block = /parseBenchArgs\(argv, \{([\s\S]*?)\n {2}\}\);/.exec(src)?.[1];
    expect(block, name).toBeDefined();
    const keys = [...block!.matchAll(/^\s+"?([a-z][a-z-]*)"?: \{ type:/gm)].map((m) => m[1]!);
    expect(keys.length, name).toBeGreaterThan(0);
    for (const k of keys) expect(help, `bench ${name} --help names --${k}`).toContain(`--${k}`);
    expect(help, name).toContain(`bun run bench ${name}`);
  }
  const own = bench("ps", "--help"); // the benchmark's program answers it before running anything
  expect([own.code, own.out]).toEqual([0, benchHelp("ps")]);
  const list = cli("bench", "--help");
  expect(list.code).toBe(0);
  for (const name of benchNames) expect(list.out.replace(/\s+/g, " ")).toContain(name);
  const unknown = bench("nope");
  expect([unknown.code, unknown.err]).toEqual([2, expect.stringContaining('no benchmark is named "nope"; usage:')]);
});

test("bench engine prints a table and a last JSON line", () => {
  const { code, out, lines, last } = bench("engine", "--steps", "2");
  expect(code).toBe(0);
  expect(lines[1]).toContain("sgemm_gflops");
  expect(last.results.map((r: { model: string }) => r.model.split(" ")[0])).toEqual(["mlp", "gpt", "gpt"]);
  for (const r of last.results) {
    for (const k of ["batch", "step_ms", "samples_per_s", "achieved_gflops", "sgemm_gflops", "ratio", "peak_act_mib"])
      expect(r[k]).toBeGreaterThan(0);
  }
  // the third row recomputes the GPT's activations: the same step, less memory
  expect(last.results[2].model).toEndWith(" recompute");
  expect(last.results[2].peak_act_mib).toBeLessThan(last.results[1].peak_act_mib);
  expect(out).toContain("activation recomputation: peak pass memory");
}, 120_000);

test("bench kernels prints a table and a last JSON line", () => {
  const { code, lines, last } = bench("kernels", "--elems", "262144", "--reps", "2");
  expect(code).toBe(0);
  expect(lines[1]).toContain("memcpy_gb_per_s");
  expect(last.results.length).toBeGreaterThan(20);
  for (const r of last.results) expect(r.gb_per_s).toBeGreaterThan(0);
  const bad = bench("kernels", "--elems", "1000");
  expect(bad.code).not.toBe(0);
  expect(bad.err).toContain("bench kernels: --elems must be a positive integer and a multiple of 262144, got 1000");
  const bogus = cli("bench", "engine", "--bogus"); // the CLI runs the benchmark program and keeps its exit code
  expect([bogus.code, bogus.err.trim()]).toEqual([2, "bench engine: Unknown option '--bogus'"]);
  // the same through the CLI, options passed on to the benchmark
  const viaCli = cli("bench", "kernels", "--elems", "262144", "--reps", "1", "--json-only");
  expect(viaCli.code).toBe(0);
  expect(JSON.parse(viaCli.out.trim()).bench).toBe("kernels");
}, 120_000);

describe("service benchmarks print a table and a last JSON line (small sizes)", () => {
  test("ps: parameter-server shard processes against raw NATS on a real nats-server", () => {
    const r = bench("ps", "--sizes-mb", "1", "--shards", "1,2", "--rounds", "2");
    expect(r.code).toBe(0);
    expect(r.lines[1]).toContain("nats_gb_per_s");
    expect(r.last.results.map((x: { shards: number }) => x.shards)).toEqual([1, 2]);
    for (const x of r.last.results)
      for (const k of ["ps_gb_per_s", "nats_gb_per_s", "ratio"]) expect(x[k]).toBeGreaterThan(0);
  }, 120_000);

  test("checkpoint: save and restore against a plain write + fsync", () => {
    const r = bench("checkpoint", "--sizes-mb", "2", "--reps", "2");
    expect(r.code).toBe(0);
    for (const k of ["save_mb_per_s", "plain_write_mb_per_s", "restore_mb_per_s", "save_ratio"])
      expect(r.last.results[0][k]).toBeGreaterThan(0);
  }, 60_000);

  test("data-loader: the loader process against a trainer's step rate", () => {
    const r = bench("data-loader", "--batches", "5", "--batch-size", "32");
    expect(r.code).toBe(0);
    expect(r.last.results.map((x: { batches_per_s: number }) => x.batches_per_s > 0)).toEqual([true, true]);
  }, 60_000);

  test("allreduce: the ring among rank processes against raw NATS moving the same bytes", () => {
    const r = bench("allreduce", "--ranks", "2", "--sizes-mb", "1", "--rounds", "1");
    expect(r.code).toBe(0);
    expect(r.lines[1]).toContain("ring_busbw_gb_per_s");
    expect(r.last.rows.map((x: { transport: string; ranks: number }) => [x.transport, x.ranks])).toEqual([
      ["nats", 2],
      ["shm", 2],
    ]);
    for (const row of r.last.rows)
      for (const k of ["ring_busbw_gb_per_s", "raw_busbw_gb_per_s", "ratio"]) expect(row[k]).toBeGreaterThan(0);
  }, 120_000);

  test("bad benchmark options are one clear line", () => {
    expect(bench("ps", "--shards", "0").err).toContain("--shards must be a positive integer");
    const negative = bench("engine", "--steps", "-1"); // node's parser says this in three lines
    expect([negative.code, negative.err.trim().split("\n")]).toEqual([2, [expect.stringContaining("--steps=-XYZ")]]);
    expect(bench("trainer", "--sync", "never").err).toContain("--sync must be a list of bsp, asp, ssp, allreduce");
    expect(bench("trainer", "--bucket-mb", "0").err).toContain("--bucket-mb must be a number in (0, 1024]");
    expect(bench("allreduce", "--ranks", "1").err).toContain("--ranks: each from 2 to 16");
    expect(bench("allreduce", "--piece-kb", "x").err).toContain("--piece-kb must be a positive integer");
    expect(bench("allreduce", "--transport", "tcp").err).toContain("--transport must be a list of nats, shm");
    expect(bench("trainer", "--coll-transport", "tcp").err).toContain("--coll-transport must be a list of auto, nats");
    expect(bench("client", "--runs", "0").err).toContain("--runs must be a positive integer, got 0");
    expect(bench("stream", "--gib", "0").err).toContain("--gib must be in (0, 64], got 0");
    expect(bench("stream", "--steps", "0").err).toContain("--steps must be a positive integer, got 0");
    expect(bench("hosts", "--hosts", "1").err).toMatch(
      /--hosts must be at least 2 \(the links are what is measured\), got 1|the hosts bench makes network namespaces: /,
    );
    expect(bench("nope").err).toContain(
      "usage: bun run bench <engine|kernels|epilogues|ps|checkpoint|data-loader|prepare|trainer|allreduce|stream|client|hosts>",
    );
    // an attention that cannot run is refused before anything runs, as train gpt refuses it
    expect(bench("engine", "--config", "small", "--attention", "kernel", "--precision", "bf16").err).toContain(
      "--attention kernel cannot run this GPT: it is built for head sizes 64 and 128, not 32",
    );
    expect(bench("engine", "--config", "nanogpt-char", "--attention", "cudnn").err).toContain(
      "--attention cudnn needs bf16 or f16 autocast",
    );
    expect(bench("engine", "--attention", "reference").err).toContain("--attention goes with --config");
  });
});

describe("plan: each trainer's memory before anything starts", () => {
  const gpt2 = cliOptions({
    model: "gpt",
    sync: "allreduce",
    trainers: 4,
    "n-layer": 12,
    "n-head": 12,
    "n-embd": 768,
    "block-size": 1024,
  });
  test("a job that fits: the breakdown per trainer, and exit 0", () => {
    const r = cli(
      "plan",
      ...gpt2,
      ...cliOptions({ "batch-size": 8, precision: "bf16", device: "cuda", "device-memory": "80GB" }),
    );
    expect(r.code).toBe(0);
    expect(r.out).toContain("plan: gpt L12 H12 C768 T1024 V83, 4 trainers, allreduce, ZeRO 0, bf16, micro-batch 8");
    expect(r.out).toMatch(
      /trainers \(4\): parameters [\d.]+ MiB \+ gradients [\d.]+ MiB \+ optimizer [\d.]+ MiB \+ activations [\d.]+ GiB \+ weight copies [\d.]+ MiB = [\d.]+ GiB on the device/,
    );
    expect(r.out).toMatch(/^fits: the most a trainer holds, [\d.]+ GiB, against 80.0 GiB a GPU \(--device-memory\)$/m);
  });
  test("GPT-2's shape with its vocabulary, before its data is prepared: --vocab-size without --tokens plans it; run still asks for the tokens", () => {
    const r = cli(
      "plan",
      ...gpt2,
      ...cliOptions({ "vocab-size": 50257, "batch-size": 8, device: "cuda", "device-memory": "80GB" }),
    );
    expect(r.code).toBe(0);
    expect(r.out).toContain("plan: gpt L12 H12 C768 T1024 V50257, 4 trainers");
    // 124M values, as GPT-2 small: f32 parameters of 474 MiB
    expect(r.out).toMatch(/parameters 47\d MiB/);
    const run = cli("run", ...gpt2, "--vocab-size", "50257");
    expect(run.code).not.toBe(0);
    expect(run.out + run.err).toContain("--vocab-size is for --tokens folders without vocab.json");
  });

  test("a job that does not fit: which option would make it, and exit 3; ZeRO 3 and a pipeline split the model", () => {
    const r = cli("plan", ...gpt2, "--batch-size", "64", "--device", "cuda", "--device-memory", "24GB");
    expect(r.code).toBe(3);
    expect(r.out).toMatch(/^does not fit: the most a trainer holds, [\d.]+ GiB, against 24.0 GiB a GPU/m);
    expect(r.out).toMatch(/^--recompute brings it to [\d.]+ GiB, which fits$/m);
    const z3 = cli("plan", ...gpt2, "--batch-size", "8", "--zero", "3", "--device", "cuda", "--device-memory", "80GB");
    expect(z3.out).toMatch(/gathered [\d.]+ MiB/);
    const pp = cli(
      "plan",
      ...gpt2,
      ...cliOptions({
        "batch-size": 8,
        "pipeline-stages": 2,
        "tensor-parallel": 2,
        accum: 4,
        device: "cuda",
        "device-memory": "80GB",
      }),
    );
    expect(pp.out).toContain("stage 0 (2 trainers)");
    expect(pp.out).toContain("stage 1 (2 trainers)");
  });
  test("a bad --device-memory is refused with the reason", () => {
    const r = cli("plan", "--device-memory", "lots");
    expect(r.code).toBe(1);
    expect(r.err).toContain("--device-memory must be a size such as 80GB, 24GiB or 512MiB");
  });
  test("run refuses a job that cannot fit, before any process starts", () => {
    const started = performance.now();
    const r = cli(
      "run",
      ...cliOptions({
        model: "gpt",
        "n-layer": 48,
        "n-embd": 2048,
        "n-head": 16,
        "block-size": 1024,
        "batch-size": 64,
        dir: join(dir, "too-big"),
      }),
    );
    expect(r.code).toBe(1);
    expect(r.err).toMatch(
      /^meshtrain: ConfigError: job default\.gpt-[\w-]+ does not fit: every process together, [\d.]+ GiB, against [\d.]+ GiB/,
    );
    expect(r.out).not.toContain("launcher:");
    expect(performance.now() - started).toBeLessThan(20_000);
  });
});
