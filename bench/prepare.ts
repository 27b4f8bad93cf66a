// `meshtrain prepare` benchmark: the same corpus tokenized with js-tiktoken in one thread (the
// baseline, what prepare did before), with prepare's fast GPT-2 encoder in one thread, and by
// prepare end to end (reading, tokenizing on --workers threads, writing shards) with 1 and with
// every core. Ratio = tokens/s ÷ the baseline's, measured in the same run. The corpus is the
// State of the Union and Moby Dick (npm packages), copied to --mb: after its first copy the fast
// encoder has seen every piece, as it nearly has in a large real corpus (its pieces repeat).
//
//   bun run bench prepare [--mb 30] [--workers <n>] [--json-only]
import { copyFileSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { availableParallelism, tmpdir } from "node:os";
import { join } from "node:path";
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

/** A folder of copies of the two books' files, at least mb MB in all; its files and their bytes. */
function writeCorpus(dir: string, mb: number): { files: string[]; bytes: number } {
  const books = [
    mobyDickPath(),
    ...readdirSync(sotuDir)
      .filter((f) => f.endsWith(".txt"))
      .sort()
      .map((f) => join(sotuDir, f)),
  ];
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

export async function runPrepareBench(argv: string[]): Promise<PrepareBenchResult[]> {
  const v = parseBenchArgs(argv, {
    mb: { type: "string", default: "30" },
    workers: { type: "string", default: String(availableParallelism()) },
    "json-only": { type: "boolean", default: false },
  });
  const mb = positiveInt("mb", v.mb),
    workers = positiveInt("workers", v.workers);
  const dir = mkdtempSync(join(tmpdir(), "mt-bench-prepare-"));
  try {
    const src = join(dir, "corpus");
    mkdirSync(src);
    const corpus = writeCorpus(src, mb);
    const rows: PrepareBenchResult[] = [];
    const row = (path: string, threads: number, tokens: number, seconds: number) => {
      const base = rows[0]?.tokens_per_s ?? tokens / seconds;
      rows.push({
        path,
        threads,
        tokens,
        seconds: round(seconds, 2),
        tokens_per_s: Math.round(tokens / seconds),
        mb_per_s: round(corpus.bytes / 1e6 / seconds, 2),
        ratio: round(tokens / seconds / base, 2),
      });
    };
    const slow = encodeAll(gpt2Tokenizer(), corpus.files);
    row("js-tiktoken encode (baseline)", 1, slow.tokens, slow.seconds);
    const fast = encodeAll(gpt2FastTokenizer(), corpus.files);
    if (fast.tokens !== slow.tokens)
      throw new Error(`the fast encoder gave ${fast.tokens} tokens, js-tiktoken ${slow.tokens}`);
    row("fast encode", 1, fast.tokens, fast.seconds);
    for (const n of [...new Set([1, workers])]) {
      const r = await runPrepare({
        ...prepareDefaults,
        text: src,
        out: join(dir, `out-${n}`),
        workers: n,
        quiet: true,
      });
      row("prepare, end to end", n, r.manifest.tokens.train + r.manifest.tokens.val, r.seconds);
    }
    printReport({
      bench: "prepare",
      header: `prepare: ${round(corpus.bytes / 1e6, 1)} MB (${corpus.files.length} files: the State of the Union and Moby Dick, copied), GPT-2 BPE; ${availableParallelism()} cores; ratio = tokens/s ÷ js-tiktoken's in one thread`,
      rows,
      columns,
      quiet: v["json-only"] === true,
    });
    return rows;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}
