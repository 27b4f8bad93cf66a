// `meshtrain prepare` benchmark: the same corpus tokenized with js-tiktoken in one thread (the
// baseline, what prepare did before), with prepare's fast GPT-2 encoder in one thread, and by
// prepare end to end (reading, tokenizing on --workers threads, writing shards) with 1 and with
// every core. Ratio = tokens/s ÷ the baseline's, measured in the same run. The corpus is the
// State of the Union and Moby Dick (npm packages), copied to --mb: after its first copy the fast
// encoder has seen every piece, as it nearly has in a large real corpus (its pieces repeat).
//
//   bun run bench prepare [--mb 30] [--workers <n>] [--repeats 2] [--json-only]
//
// With --memory it measures memory instead: prepare as its own process, on --workers threads, on
// one plain text file and on one .jsonl.zst, each at --mb and at 4 and 16 times that, and prints
// each run's peak resident memory. Ratio = peak ÷ the same format's peak at --mb: 1 where memory
// stays flat whatever the input's size.
//
//   bun run bench prepare --memory [--mb 30] [--workers <n>] [--json-only]
import {
  closeSync,
  copyFileSync,
  mkdirSync,
  mkdtempSync,
  openSync,
  readdirSync,
  readFileSync,
  rmSync,
  writeSync,
} from "node:fs";
import { availableParallelism, tmpdir } from "node:os";
import { join } from "node:path";
import { zstdCompressSync } from "node:zlib";
import { mobyDickPath } from "../engine/data/text.ts";
import { gpt2FastTokenizer, gpt2Tokenizer, type Tokenizer } from "../engine/data/tokenizer.ts";
import { prepareDefaults, runPrepare } from "../sdk/local/prepare.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { printReport, round } from "./table.ts";

export interface PrepareBenchResult {
  path: string;
  threads: number;
  tokens: number;
  seconds: number;
  tokens_per_s: number;
  mb_per_s: number;
  ratio: number;
}

const columns: readonly (keyof PrepareBenchResult)[] = [
  "path",
  "threads",
  "tokens",
  "seconds",
  "tokens_per_s",
  "mb_per_s",
  "ratio",
];

const sotuDir = join(import.meta.dir, "..", "node_modules", "@stdlib", "datasets-sotu", "data");

/** Moby Dick and the State of the Union's addresses, in order. */
const bookFiles = (): string[] => [
  mobyDickPath(),
  ...readdirSync(sotuDir)
    .filter((f) => f.endsWith(".txt"))
    .sort()
    .map((f) => join(sotuDir, f)),
];

/** A folder of copies of the two books' files, at least mb MB in all; its files and their bytes. */
function writeCorpus(dir: string, mb: number): { files: string[]; bytes: number } {
  const books = bookFiles();
  const files: string[] = [];
  let bytes = 0;
  for (let copy = 0; bytes < mb * 1e6; copy++)
    for (const [i, book] of books.entries()) {
      const file = join(dir, `${String(copy).padStart(3, "0")}-${String(i).padStart(4, "0")}.txt`);
      copyFileSync(book, file);
      files.push(file);
      bytes += readFileSync(file).length;
    }
  return { files, bytes };
}

/** Encodes every file in this thread: tokens and seconds. */
function encodeAll(tokenizer: Tokenizer, files: readonly string[]): { tokens: number; seconds: number } {
  const texts = files.map((f) => readFileSync(f, "utf8"));
  const t0 = performance.now();
  let tokens = 0;
  for (const t of texts) tokens += tokenizer.encode(t).length;
  return { tokens, seconds: (performance.now() - t0) / 1000 };
}

export async function runPrepareBench(argv: string[]): Promise<PrepareBenchResult[] | PrepareMemoryResult[]> {
  const v = parseBenchArgs(argv, {
    mb: { type: "string", default: "30" },
    workers: { type: "string", default: String(availableParallelism()) },
    repeats: { type: "string", default: "2" },
    memory: { type: "boolean", default: false },
    "json-only": { type: "boolean", default: false },
  });
  const mb = positiveInt("mb", v.mb),
    workers = positiveInt("workers", v.workers),
    repeats = positiveInt("repeats", v.repeats);
  if (v.memory === true) return runMemoryBench(mb, workers, v["json-only"] === true);
  const dir = mkdtempSync(join(tmpdir(), "mt-bench-prepare-"));
  try {
    const src = join(dir, "corpus");
    mkdirSync(src);
    const corpus = writeCorpus(src, mb);
    // each path `repeats` times, in turns, its fastest kept: these machines are shared and noisy
    const runs: { path: string; threads: number; run: () => Promise<{ tokens: number; seconds: number }> }[] = [
      { path: "js-tiktoken encode (baseline)", threads: 1, run: async () => encodeAll(gpt2Tokenizer(), corpus.files) },
      { path: "fast encode", threads: 1, run: async () => encodeAll(gpt2FastTokenizer(), corpus.files) },
      ...[...new Set([1, workers])].map((n) => ({
        path: "prepare, end to end",
        threads: n,
        run: async () => {
          const r = await runPrepare({
            ...prepareDefaults,
            text: src,
            out: join(dir, `out-${n}`),
            workers: n,
            // n threads whatever the corpus's size (prepare starts one per 32 MB of text)
            workerBytesMin: 1,
            quiet: true,
          });
          if (r.threads !== n) throw new Error(`prepare ran on ${r.threads} threads, not ${n}`);
          return { tokens: r.manifest.tokens.train + r.manifest.tokens.val, seconds: r.seconds };
        },
      })),
    ];
    const best = runs.map(() => ({ tokens: 0, seconds: Number.POSITIVE_INFINITY }));
    for (let rep = 0; rep < repeats; rep++)
      for (const [i, r] of runs.entries()) {
        const m = await r.run();
        if (m.seconds < best[i]!.seconds) best[i] = m;
      }
    // the encoders' ids are the same (tested); prepare adds an <|endoftext|> per document
    if (best[1]!.tokens !== best[0]!.tokens)
      throw new Error(`the fast encoder gave ${best[1]!.tokens} tokens, js-tiktoken ${best[0]!.tokens}`);
    const baseRate = best[0]!.tokens / best[0]!.seconds;
    const rows: PrepareBenchResult[] = runs.map((r, i) => ({
      path: r.path,
      threads: r.threads,
      tokens: best[i]!.tokens,
      seconds: round(best[i]!.seconds, 2),
      tokens_per_s: Math.round(best[i]!.tokens / best[i]!.seconds),
      mb_per_s: round(corpus.bytes / 1e6 / best[i]!.seconds, 2),
      ratio: round(best[i]!.tokens / best[i]!.seconds / baseRate, 2),
    }));
    printReport({
      bench: "prepare",
      header: `prepare: ${round(corpus.bytes / 1e6, 1)} MB (${corpus.files.length} files: the State of the Union and Moby Dick, copied), GPT-2 BPE; ${availableParallelism()} cores; ratio = tokens/s ÷ js-tiktoken's in one thread; the fastest of ${repeats} runs each`,
      rows,
      columns,
      quiet: v["json-only"] === true,
    });
    return rows;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

export interface PrepareMemoryResult {
  input: string;
  mb: number;
  threads: number;
  tokens: number;
  seconds: number;
  peak_rss_mb: number;
  ratio: number;
}

const memoryColumns: readonly (keyof PrepareMemoryResult)[] = [
  "input",
  "mb",
  "threads",
  "tokens",
  "seconds",
  "peak_rss_mb",
  "ratio",
];

/** Writes copies of the books as one plain text file and as one .jsonl.zst (a line per book,
 *  compressed a copy at a time: a zstd stream of several frames), each about mb MB of text. */
function writeSingleFiles(dir: string, mb: number): { text: string; jsonl: string; bytes: number } {
  const books = bookFiles().map((f) => readFileSync(f));
  const text = join(dir, `corpus-${mb}.txt`);
  const jsonl = join(dir, `corpus-${mb}.jsonl.zst`);
  const t = openSync(text, "w");
  const j = openSync(jsonl, "w");
  let bytes = 0;
  try {
    while (bytes < mb * 1e6) {
      const lines: string[] = [];
      for (const b of books) {
        writeSync(t, b);
        writeSync(t, "\n\n");
        lines.push(`${JSON.stringify({ text: b.toString("utf8") })}\n`);
        bytes += b.length + 2;
      }
      writeSync(j, zstdCompressSync(Buffer.from(lines.join(""))));
    }
  } finally {
    closeSync(t);
    closeSync(j);
  }
  return { text, jsonl, bytes };
}

/** What a child process runs: prepare with the options in MT_PREPARE_OPTIONS, on exactly as many
 *  threads as they say (workerBytesMin 1), and one JSON line of what it wrote and its peak
 *  resident memory (Linux's VmHWM). */
const prepareChild = `
const { prepareDefaults, runPrepare } = await import(${JSON.stringify(join(import.meta.dir, "..", "sdk", "local", "prepare.ts"))});
const r = await runPrepare({ ...prepareDefaults, ...JSON.parse(process.env.MT_PREPARE_OPTIONS), workerBytesMin: 1, quiet: true });
// the process's own high-water mark (getrusage's maxRSS would count the parent's memory at the fork)
const hwm = /VmHWM:\\s+(\\d+) kB/.exec(require("node:fs").readFileSync("/proc/self/status", "utf8"))?.[1];
console.log(JSON.stringify({ tokens: r.manifest.tokens.train + r.manifest.tokens.val, threads: r.threads, peakBytes: Number(hwm) * 1024 }));
`;

/** prepare as its own process on each input at mb, 4 mb and 16 mb, on `workers` threads: its peak memory. */
async function runMemoryBench(mb: number, workers: number, quiet: boolean): Promise<PrepareMemoryResult[]> {
  const dir = mkdtempSync(join(tmpdir(), "mt-bench-prepare-memory-"));
  try {
    const rows: PrepareMemoryResult[] = [];
    const first = new Map<string, number>();
    for (const scale of [1, 4, 16]) {
      const inputs = writeSingleFiles(dir, mb * scale);
      for (const [input, options] of [
        ["plain text, one file", { text: inputs.text }],
        [".jsonl.zst, one file", { text: inputs.jsonl, jsonl: "text" }],
      ] as const) {
        const out = join(dir, "out");
        const t0 = performance.now();
        const p = Bun.spawnSync([process.execPath, "-e", prepareChild], {
          env: { ...process.env, MT_PREPARE_OPTIONS: JSON.stringify({ ...options, out, workers }) },
          stdout: "pipe",
          stderr: "pipe",
        });
        const seconds = (performance.now() - t0) / 1000;
        if (p.exitCode !== 0)
          throw new Error(`prepare of ${options.text} exited with ${p.exitCode}: ${p.stderr.toString().trim()}`);
        const ran = JSON.parse(p.stdout.toString().trim().split("\n").at(-1)!) as {
          tokens: number;
          threads: number;
          peakBytes: number;
        };
        const peak = ran.peakBytes / 1e6;
        if (!first.has(input)) first.set(input, peak);
        rows.push({
          input,
          mb: round(inputs.bytes / 1e6, 1),
          threads: ran.threads,
          tokens: ran.tokens,
          seconds: round(seconds, 1),
          peak_rss_mb: Math.round(peak),
          ratio: round(peak / first.get(input)!, 2),
        });
        rmSync(out, { recursive: true, force: true });
      }
      rmSync(inputs.text);
      rmSync(inputs.jsonl);
    }
    printReport({
      bench: "prepare-memory",
      header: `prepare's peak memory: one process per run, tokenizing on ${workers} thread(s) whatever the input's size, GPT-2 BPE, inputs of at least --mb ${mb} MB and 4 and 16 times that (whole copies of the State of the Union and Moby Dick); ratio = peak ÷ the same input's peak at the smallest size`,
      rows,
      columns: memoryColumns,
      quiet,
    });
    return rows;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
