// Drawing the next token from a model's logits (V) for the last position: softmax of
// logits / temperature, kept to the topK most likely tokens and then to the smallest set of them
// whose probability reaches topP (nucleus sampling), renormalized, and one draw of rng.
import { ConfigError } from "../../ffi/errors.ts";
import type { Rng } from "../rng.ts";

export interface SamplingOptions {
  /** > 0; below 1 sharpens the distribution, above 1 flattens it */
  temperature: number;
  /** keep the k most likely tokens; 0 keeps all */
  topK: number;
  /** in (0,1]: keep the most likely tokens until their probability reaches topP; 1 keeps all */
  topP: number;
}

export const samplingDefaults: SamplingOptions = { temperature: 1, topK: 0, topP: 1 };

/** Refuses settings that sample nothing or cannot be meant (a caller's input, checked where it enters). */
export function checkSampling(o: SamplingOptions): void {
  if (!(o.temperature > 0)) throw new ConfigError(`generate: temperature must be > 0, got ${o.temperature}`);
  if (!Number.isInteger(o.topK) || o.topK < 0)
    throw new ConfigError(`generate: topK must be a whole number >= 0 (0 keeps every token), got ${o.topK}`);
  if (!(o.topP > 0 && o.topP <= 1))
    throw new ConfigError(`generate: topP must be in (0, 1] (1 keeps every token), got ${o.topP}`);
}

/** logits (V) -> a token id in [0, V). Exactly one rng draw per call. */
export function sampleLogits(logits: Float32Array, rng: Rng, o: SamplingOptions): number {
  const V = logits.length;
  let threshold = -Infinity;
  if (o.topK > 0 && o.topK < V) threshold = [...logits].sort((a, b) => b - a)[o.topK - 1]!;
  let max = -Infinity;
  for (let v = 0; v < V; v++) if (logits[v]! >= threshold) max = Math.max(max, logits[v]!);
  const p = new Float64Array(V);
  let sum = 0;
  for (let v = 0; v < V; v++) {
    p[v] = logits[v]! >= threshold ? Math.exp((logits[v]! - max) / o.temperature) : 0;
    sum += p[v]!;
  }
  if (o.topP < 1) sum = keepNucleus(p, sum, o.topP);
  let r = rng.uniform() * sum;
  for (let v = 0; v < V; v++) {
    r -= p[v]!;
    if (r < 0) return v;
  }
  return V - 1;
}

/** Zeroes p (V, unnormalized, summing to sum) outside its nucleus: the most likely tokens, ties in
 *  id order, until their mass reaches topP·sum. Returns the kept mass. */
function keepNucleus(p: Float64Array, sum: number, topP: number): number {
  const order = Array.from(p.keys()).sort((a, b) => p[b]! - p[a]! || a - b);
  let kept = 0;
  let n = 0;
  while (n < order.length && kept < topP * sum) kept += p[order[n++]!]!;
  for (let i = n; i < order.length; i++) p[order[i]!] = 0;
  return kept;
}
