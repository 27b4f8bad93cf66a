// The engine benchmark's generation rows: a new token's time after a prompt, on the benchmark's
// GPT shape with random weights and greedy decoding, with meshtrain's KV cache (GptModel.generate),
// the whole-window recompute it replaced, and PyTorch with its own KV cache on the same shape
// (bench/torch_generate.py, where a python3 imports torch). Each side reports the median of its
// per-token steps; the prompt's own pass is left out.
import { join } from "node:path";
import type { Backend } from "../ffi/backend.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { type GptConfig, GptModel } from "../engine/models/gpt.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/context.ts";
import type { Precision } from "../engine/mixed.ts";
import { median, round } from "./table.ts";
import { torchPython } from "./engine-config.ts";

export interface GenerationRow {
  impl: string;
  prompt_tokens: number;
  new_tokens: number;
  ms_per_token: number;
  tokens_per_s: number;
  /** ours / PyTorch's time per token (PyTorch's row: 1) */
  ratio: number | string;
}

export interface GenerationOptions {
  precision: Precision;
  /** PyTorch's row too */
  torch: boolean;
  quiet: boolean;
}

/** Prompt and new tokens: a quarter of the window each (at most 128 and 64), within one window. */
export const generationLengths = (blockSize: number) => ({
  prompt: Math.min(128, Math.max(1, Math.floor(blockSize / 4))),
  count: Math.min(64, Math.max(2, Math.floor(blockSize / 4))),
});

/** Our per-token time (ms), with or without the KV cache: the median gap between new tokens. */
function oursPerToken(be: Backend, config: GptConfig, precision: Precision, kvCache: boolean): number {
  const ctx = new Context(be, { seed: 1, precision });
  try {
    const model = new GptModel(ctx, config, 1);
    const rng = new Rng(5);
    const { prompt, count } = generationLengths(config.blockSize);
    const ids = Array.from({ length: prompt }, () => rng.int(config.vocabSize));
    const at: number[] = [];
    model.generate(ids, count, rng, { topK: 1, kvCache, onToken: () => at.push(performance.now()) });
    return median(at.slice(1).map((t, i) => t - at[i]!));
  } finally {
    ctx.dispose();
  }
}

/** PyTorch's per-token time (ms), or null (said unless quiet) where it did not run. */
function torchPerToken(be: Backend, config: GptConfig, o: GenerationOptions): { ms: number; torch: string } | null {
  const { prompt, count } = generationLengths(config.blockSize);
  const p = Bun.spawnSync(
    [
      torchPython(),
      join(import.meta.dir, "torch_generate.py"),
      "--gpt-config",
      JSON.stringify(config),
      "--prompt-tokens",
      String(prompt),
      "--new-tokens",
      String(count),
      "--device",
      be.name === "cpu" ? "cpu" : "cuda",
      "--threads",
      String(be instanceof CpuBackend ? be.threads : 0),
    ],
    { stdout: "pipe", stderr: "pipe", env: { ...process.env, OMP_NUM_THREADS: "1" }, timeout: 600_000 },
  );
  const line = p.stdout.toString().trim().split("\n").pop() ?? "";
  let r: { ms_per_token?: number; torch?: string; error?: string };
  try {
    r = JSON.parse(line);
  } catch {
    r = { error: p.stderr.toString().trim().split("\n").pop() ?? `exit ${p.exitCode}` };
  }
  if (r.ms_per_token === undefined) {
    if (!o.quiet) console.log(`PyTorch generation skipped: ${r.error ?? "no result"}`);
    return null;
  }
  return { ms: r.ms_per_token, torch: r.torch ?? "" };
}

/** The generation rows of `config` on `be`: ours with and without the KV cache, and PyTorch's. */
export function generationRows(be: Backend, config: GptConfig, o: GenerationOptions): GenerationRow[] {
  const { prompt, count } = generationLengths(config.blockSize);
  const cached = oursPerToken(be, config, o.precision, true);
  const recompute = oursPerToken(be, config, o.precision, false);
  const torch = o.torch ? torchPerToken(be, config, o) : null;
  const row = (impl: string, ms: number): GenerationRow => ({
    impl,
    prompt_tokens: prompt,
    new_tokens: count,
    ms_per_token: round(ms, 2),
    tokens_per_s: round(1000 / ms, 1),
    ratio: torch === null ? "-" : round(ms / torch.ms, 2),
  });
  return [
    row("meshtrain, KV cache", cached),
    row("meshtrain, whole window", recompute),
    ...(torch === null ? [] : [row(`torch ${torch.torch}, KV cache`, torch.ms)]),
  ];
}
