// Tokenizers for `meshtrain prepare` and for decoding a model's samples: GPT-2's byte-level BPE
// (js-tiktoken's lite encoder with the gpt2 ranks it ships: nothing is downloaded), and
// characters (a vocabulary of the corpus's distinct characters, engine/data/text.ts). prepare
// encodes GPT-2's BPE with gpt2FastTokenizer: js-tiktoken's ids, each distinct piece encoded once.
import { Tiktoken } from "js-tiktoken/lite";
import { gpt2Ranks } from "./gpt2-ranks.ts";
import { gpt2MergePiece } from "./gpt2-merges.ts";
import { gpt2PieceEnd } from "./gpt2-pieces.ts";
import { PieceTable } from "./piece-table.ts";
import { CharVocab } from "./text.ts";

export const tokenizerNames = ["gpt2", "char"] as const;
export type TokenizerName = (typeof tokenizerNames)[number];

export interface Tokenizer {
  readonly name: TokenizerName;
  readonly vocabSize: number;
  /** the id put before every document (GPT-2's <|endoftext|>), or null: documents are joined by a newline */
  readonly eot: number | null;
  encode(text: string): number[] | Uint16Array;
  decode(ids: ArrayLike<number>): string;
}

/** GPT-2's 50,257 tokens; <|endoftext|> is 50256. Text is encoded as ordinary text: a literal
 *  "<|endoftext|>" in a document is its characters, never the special token. */
export const gpt2EndOfText = 50256;
export const gpt2VocabSize = 50257;

let gpt2: Tiktoken | null = null;

export function gpt2Tokenizer(): Tokenizer {
  gpt2 ??= new Tiktoken(gpt2Ranks());
  const enc = gpt2;
  return {
    name: "gpt2",
    vocabSize: gpt2VocabSize,
    eot: gpt2EndOfText,
    encode: (text) => enc.encode(text, [], []),
    decode: (ids) => enc.decode(Array.from(ids)),
  };
}

/**
 * GPT-2's BPE, faster: the text is cut into pieces as GPT-2's pattern cuts it (by a scan,
 * engine/data/gpt2-pieces.ts), and each distinct piece is merged once (engine/data/gpt2-merges.ts)
 * and remembered (engine/data/piece-table.ts). The ids are js-tiktoken's (tested on two books). One
 * per thread: the table is not shared.
 */
export function gpt2FastTokenizer(): Tokenizer {
  const pieces = new PieceTable(gpt2MergePiece);
  return {
    ...gpt2Tokenizer(),
    encode: (text) => {
      // English takes about one id per four characters: half a character each rarely grows
      let out = new Uint16Array(Math.max(16, text.length >> 1));
      let n = 0;
      for (let i = 0; i < text.length; ) {
        const end = gpt2PieceEnd(text, i);
        const ids = pieces.ids(text, i, end);
        i = end;
        if (n + ids.length > out.length) {
          const grown = new Uint16Array(Math.max(out.length * 2, n + ids.length));
          grown.set(out.subarray(0, n));
          out = grown;
        }
        for (let k = 0; k < ids.length; k++) out[n++] = ids[k]!;
      }
      return out.subarray(0, n);
    },
  };
}

export function charTokenizer(vocab: CharVocab): Tokenizer {
  return {
    name: "char",
    vocabSize: vocab.size,
    eot: null,
    encode: (text) => vocab.encode(text),
    decode: (ids) => vocab.decode(ids),
  };
}

/**
 * Streamed decoding: `push` each token as it is sampled; `write` gets the text as soon as it
 * decodes whole. A token can end inside a character's UTF-8 bytes (GPT-2's byte-level BPE splits
 * some characters across tokens): the decoder then holds those tokens back, and writes them with
 * the token that completes the character. `end` writes what is still held (an incomplete
 * character the model never completed, as U+FFFD: what decoding all the tokens at once gives).
 */
export function streamDecoder(
  decode: (ids: ArrayLike<number>) => string,
  write: (text: string) => void,
): { push(token: number): void; end(): void } {
  let held: number[] = [];
  const flush = () => {
    if (held.length > 0) write(decode(held));
    held = [];
  };
  return {
    push(token) {
      held.push(token);
      // an incomplete character at the end decodes as U+FFFD
      if (!decode(held).endsWith("\uFFFD")) flush();
    },
    end: flush,
  };
}
