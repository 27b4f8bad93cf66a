// js-tiktoken's GPT-2 ranks, loaded on first use: they are 540 KB of source, which every process
// that imports the tokenizer would otherwise parse at start (a client command, a service that
// never tokenizes).
import type { TiktokenBPE } from "js-tiktoken/lite";

let ranks: TiktokenBPE | null = null;

export function gpt2Ranks(): TiktokenBPE {
  if (ranks === null) {
    const mod = require("js-tiktoken/ranks/gpt2") as TiktokenBPE | { default: TiktokenBPE };
    ranks = "default" in mod ? mod.default : mod;
  }
  return ranks;
}
