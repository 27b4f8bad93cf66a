#!/usr/bin/env bun
// A uint16 token folder (train.bin, val.bin in llm.c's layout) with a vocabulary of a given size,
// made from Moby Dick: each distinct character becomes a token id spread over [0, vocab), so a
// GPT trains on real text with GPT-2's 50,257-entry embedding and head. A stand-in for real BPE
// data until `meshtrain prepare` tokenizes text itself.
//
//   bun scripts/token-folder.ts --out DIR [--vocab 50257] [--val-fraction 0.1]
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { CharVocab, mobyDickPath, readTextFile } from "../engine/data/text.ts";
import { splitTokens, writeTokenFile } from "../engine/data/tokens.ts";

const { values } = parseArgs({
  options: {
    out: { type: "string" },
    vocab: { type: "string", default: "50257" },
    "val-fraction": { type: "string", default: "0.1" },
  },
  strict: true,
});
const vocab = Number(values.vocab);
const valFraction = Number(values["val-fraction"]);
if (values.out === undefined) throw new Error("--out <dir> is required");
if (!Number.isInteger(vocab) || vocab < 256 || vocab > 65535)
  throw new Error(`--vocab must be an integer in [256, 65535], got ${values.vocab}`);
if (!(valFraction > 0 && valFraction < 0.5))
  throw new Error(`--val-fraction must be in (0, 0.5), got ${values["val-fraction"]}`);
const text = readTextFile(mobyDickPath());
const chars = new CharVocab([...new Set(text)].sort());
const ids = chars.encode(text);
// spread the characters' ids over the vocabulary (a prime multiplier that does not divide it
// keeps them distinct)
const step = vocab % 7919 === 0 ? 7927 : 7919;
const tokens = Uint16Array.from(ids, (c) => (c * step) % vocab);
const { train, val } = splitTokens(tokens, valFraction);
mkdirSync(values.out, { recursive: true });
writeTokenFile(join(values.out, "train.bin"), train);
writeTokenFile(join(values.out, "val.bin"), val);
console.log(
  `${values.out}: ${train.length.toLocaleString("en-US")} train / ${val.length.toLocaleString("en-US")} val tokens, ${chars.chars.length} distinct ids in a vocabulary of ${vocab}`,
);
