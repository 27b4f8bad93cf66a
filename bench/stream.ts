// Streaming benchmark: a GPT trains on the mesh from a prepared token folder far larger than any
// of its processes' memory, and each process's resident set is sampled while it does. A 2 GiB
// folder (test/helpers/big-corpus.ts: GPT-2 BPE of the State of the Union, written again until
// the training split holds 2^30 tokens) is written, then `meshtrain run --model gpt --tokens` trains
// on it (windows drawn from the whole of it: each epoch is one seeded shuffle of every window),
// while every process of the mesh is read from /proc every 200 ms. It prints each process's RSS
// (after start-up, median, peak) beside the corpus's size; the baseline is the corpus itself,
// which a process that loaded it would hold whole. Exits 1 when a process's peak reaches half
// the corpus. (The trainers' memory is the model's: a 50,257-token vocabulary's logits and
// embedding; it does not grow with the corpus. The data-loader's grows only by the windows' ids
// and an epoch's shuffle of them, 8 bytes a window: 1/16 of the corpus's bytes at 64 tokens.)
//
//   bun run bench stream [--gib 2] [--steps 60] [--trainers 2] [--dir DIR] [--keep] [--json-only]
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statfsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { ConfigError } from "../ffi/errors.ts";
import { writeBigCorpus } from "../test/helpers/big-corpus.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, printTable, round } from "./table.ts";

export interface StreamBenchRow {
  process: string;
  samples: number;
  /** RSS once training had begun (the first sample after the first step), MB */
  rss_start_mb: number;
  rss_median_mb: number;
  rss_peak_mb: number;
  /** the corpus's size over the peak */
  corpus_over_peak: number;
}

const root = join(import.meta.dir, "..");
const mb = (bytes: number) => round(bytes / 1e6, 1);

/** The mesh's processes: every descendant of `pid`, named by the service it runs (and its rank). */
function descendants(pid: number): Map<number, string> {
  const parent = new Map<number, number>();
  for (const e of readdirSync("/proc")) {
    if (!/^\d+$/.test(e)) continue;
    try {
      // the fields after the command's name (which may hold spaces) in parentheses
      const stat = readFileSync(`/proc/${e}/stat`, "utf8");
      parent.set(Number(e), Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]));
    } catch {} // ended meanwhile
  }
  const out = new Map<number, string>();
  const walk = (p: number) => {
    for (const [child, pp] of parent) {
      if (pp !== p) continue;
      out.set(child, nameOf(child));
      walk(child);
    }
  };
  out.set(pid, "meshtrain run (the CLI)");
  walk(pid);
  return out;
}

function nameOf(pid: number): string {
  try {
    const argv = readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0");
    const service = argv.map((a) => /services\/([a-z-]+)\/main\.ts$/.exec(a)?.[1]).find((s) => s !== undefined);
    if (service === undefined)
      return argv.some((a) => a.endsWith("nats-server")) ? "nats-server" : argv.slice(0, 2).join(" ");
    const env = readFileSync(`/proc/${pid}/environ`, "utf8").split("\0");
    const rank =
      env.find((v) => v.startsWith("MT_RANK="))?.slice(8) ?? env.find((v) => v.startsWith("MT_SHARD="))?.slice(9);
    return rank === undefined ? service : `${service} ${rank}`;
  } catch {
    return `pid ${pid}`;
  }
}

const rssBytes = (pid: number): number | null => {
  try {
    const kb = /VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, "utf8"))?.[1];
    return kb === undefined ? null : Number(kb) * 1024;
  } catch {
    return null;
  }
};

const streamColumns: readonly (keyof StreamBenchRow)[] = [
  "process",
  "samples",
  "rss_start_mb",
  "rss_median_mb",
  "rss_peak_mb",
  "corpus_over_peak",
];

/** One RSS sample of a process: whether training had begun, and the bytes. */
type RssSample = { at: boolean; rss: number };

/** The options of `bench stream`, checked; `dir` made (a temporary one unless --dir). */
interface StreamBenchArgs {
  gib: number;
  steps: number;
  trainers: number;
  dir: string;
  /** whether `dir` is one this bench made (and removes unless --keep) */
  tempDir: boolean;
  keep: boolean;
  jsonOnly: boolean;
}

function streamArgs(argv: string[]): StreamBenchArgs {
  const v = parseBenchArgs(argv, {
    gib: { type: "string", default: "2" },
    steps: { type: "string", default: "60" },
    trainers: { type: "string", default: "2" },
    dir: { type: "string" },
    keep: { type: "boolean", default: false },
    "json-only": { type: "boolean", default: false },
  });
  const gib = Number(v.gib);
  if (!(gib > 0 && gib <= 64)) throw new ConfigError(`--gib must be in (0, 64], got ${v.gib}`);
  const steps = positiveInt("steps", v.steps),
    trainers = positiveInt("trainers", v.trainers);
  const dir = v.dir === undefined ? mkdtempSync(join(tmpdir(), "meshtrain-stream-")) : resolve(v.dir);
  mkdirSync(dir, { recursive: true });
  return { gib, steps, trainers, dir, tempDir: v.dir === undefined, keep: v.keep, jsonOnly: v["json-only"] };
}

export async function runStreamBench(argv: string[]): Promise<StreamBenchRow[]> {
  const a = streamArgs(argv);
  const { dir, steps, trainers } = a;
  const trainTokens = Math.ceil((a.gib * 2 ** 30) / 2);
  const free = statfsSync(dir).bavail * statfsSync(dir).bsize;
  if (free < 2 * trainTokens + 2 ** 28) {
    throw new ConfigError(
      `${dir} has ${mb(free)} MB free; a ${a.gib} GiB corpus needs ${mb(2 * trainTokens + 2 ** 28)} MB (--gib smaller, or --dir elsewhere)`,
    );
  }
  const log = (line: string) => {
    if (!a.jsonOnly) console.log(line);
  };
  try {
    const corpusDir = join(dir, "corpus");
    const corpus = await writeBigCorpus(corpusDir, trainTokens);
    const m = corpus.manifest;
    log(
      `corpus: ${m.tokens.train.toLocaleString("en-US")} train and ${m.tokens.val.toLocaleString("en-US")} val tokens (GPT-2 BPE), ${m.shards.length} shards, ` +
        `${mb(corpus.bytes).toLocaleString("en-US")} MB on disk, written in ${round(corpus.seconds, 1)} s`,
    );
    const args = runArgs(corpusDir, join(dir, "runs"), trainers, steps);
    log(`meshtrain ${args.join(" ")}`);
    const run = await runSampled(args);
    if (run.code !== 0) throw new Error(`meshtrain run exited ${run.code}:\n${run.output}\n${run.stderr}`);
    log(
      run.output
        .trim()
        .split("\n")
        .slice(-8)
        .map((l) => `  | ${l}`)
        .join("\n"),
    );
    const rows = rssRows(run.series, corpus.bytes);
    if (!a.jsonOnly) {
      printTable(rows, streamColumns);
      log(summary(rows, corpus.bytes, steps, trainers, run.seconds));
    }
    console.log(
      JSON.stringify({
        bench: "stream",
        corpus_mb: mb(corpus.bytes),
        train_tokens: m.tokens.train,
        steps,
        trainers,
        seconds: round(run.seconds, 1),
        results: rows,
      }),
    );
    const held = rows.filter((r) => r.corpus_over_peak < 2);
    if (held.length > 0) {
      console.error(
        `bench stream: ${held.map((r) => r.process).join(", ")} peaked at half the corpus's size or more: it holds the corpus, or the corpus is too small to tell (--gib 2)`,
      );
      process.exitCode = 1;
    }
    return rows;
  } finally {
    if (!a.keep && a.tempDir) rmSync(dir, { recursive: true, force: true });
    else log(`kept: ${dir}`);
  }
}

/** `meshtrain run`'s arguments: a small GPT on the corpus, all-reduce, one eval at the end. */
function runArgs(corpusDir: string, runsDir: string, trainers: number, steps: number): string[] {
  return [
    ...[
      "run",
      "--model",
      "gpt",
      "--tokens",
      corpusDir,
      "--sync",
      "allreduce",
      "--trainers",
      String(trainers),
      "--job",
      "stream",
    ],
    ...[
      "--n-layer",
      "2",
      "--n-head",
      "2",
      "--n-embd",
      "64",
      "--block-size",
      "64",
      "--batch-size",
      "8",
      "--max-steps",
      String(steps),
    ],
    ...[
      "--eval-every",
      String(steps),
      "--eval-batches",
      "4",
      "--no-dashboard",
      "--dir",
      runsDir,
      "--timeout-min",
      "20",
    ],
  ];
}

/** `meshtrain <args>` run to its end, every process of its mesh's RSS sampled every 200 ms (by
 *  process, each sample marked with whether a step's line had been printed yet). */
async function runSampled(args: string[]) {
  const t0 = performance.now();
  const cli = Bun.spawn([process.execPath, "sdk/cli/main.ts", ...args], {
    cwd: root,
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, FORCE_COLOR: "0" },
  });
  // a step's line in the CLI's output marks the start of training
  let training = false;
  let output = "";
  const readOut = (async () => {
    const decoder = new TextDecoder();
    for await (const chunk of cli.stdout) {
      const text = decoder.decode(chunk);
      output += text;
      if (/\bstep\s+\d+/.test(output)) training = true;
    }
  })();
  const stderr = new Response(cli.stderr).text();
  const series = new Map<string, RssSample[]>();
  const sample = () => {
    for (const [pid, name] of descendants(cli.pid)) {
      const rss = rssBytes(pid);
      if (rss === null) continue;
      const key = `${name} (pid ${pid})`;
      if (!series.has(key)) series.set(key, []);
      series.get(key)!.push({ at: training, rss });
    }
  };
  const timer = setInterval(sample, 200);
  const code = await cli.exited;
  clearInterval(timer);
  await readOut;
  const seconds = (performance.now() - t0) / 1000;
  return { code, output, stderr: code === 0 ? "" : await stderr, seconds, series };
}

/** Each process's RSS while training (those that ended before it are left out), the largest peak first. */
function rssRows(series: Map<string, RssSample[]>, corpusBytes: number): StreamBenchRow[] {
  const rows: StreamBenchRow[] = [];
  for (const [process, s] of series) {
    const during = s.filter((x) => x.at).map((x) => x.rss);
    if (during.length === 0) continue; // a helper that ended before training
    const peak = Math.max(...during);
    rows.push({
      process,
      samples: during.length,
      rss_start_mb: mb(during[0]!),
      rss_median_mb: mb(median(during)),
      rss_peak_mb: mb(peak),
      corpus_over_peak: round(corpusBytes / peak, 2),
    });
  }
  return rows.sort((a, b) => b.rss_peak_mb - a.rss_peak_mb);
}

function summary(
  rows: StreamBenchRow[],
  corpusBytes: number,
  steps: number,
  trainers: number,
  seconds: number,
): string {
  const top = rows[0]!;
  const loader = rows.find((r) => r.process.startsWith("data-loader"));
  return (
    `corpus ${mb(corpusBytes).toLocaleString("en-US")} MB; the largest process, ${top.process}, peaked at ${top.rss_peak_mb} MB (${top.corpus_over_peak}x smaller)` +
    (loader === undefined
      ? ""
      : `; the data-loader, which reads the corpus, went ${loader.rss_start_mb} -> ${loader.rss_peak_mb} MB while training (${loader.corpus_over_peak}x smaller)`) +
    `; ${steps} steps of ${trainers} x 8 windows in ${round(seconds, 1)} s with start-up and shut-down`
  );
}
