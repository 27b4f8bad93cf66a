// GPT-2's pre-tokenizer, by hand: where the piece that starts at a position ends, as GPT-2's
// pattern cuts it (js-tiktoken runs it as a JavaScript regular expression with the u flag):
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// The alternatives are tried in order at each position. The regular expression costs about four
// fifths of an encoding whose pieces are remembered; this scan over character classes (a table
// for the Basic Multilingual Plane, filled as characters come) costs a fraction of it. The same
// pieces as the pattern's: tested on two books and on the cases each alternative turns on.

const other = 0,
  letter = 1,
  digit = 2,
  space = 3;
const unknown = 0xff;

/** A code point's class by the pattern's own terms: \s, \p{L}, \p{N}, or none of them. */
function classify(cp: number): number {
  const s = String.fromCodePoint(cp);
  return /\s/u.test(s) ? space : /\p{L}/u.test(s) ? letter : /\p{N}/u.test(s) ? digit : other;
}

const bmpClass = new Uint8Array(0x10000).fill(unknown);

/** The class of the code point at i (a surrogate pair counts as one, and is never \s). */
function classAt(text: string, i: number): number {
  const c = text.charCodeAt(i);
  if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
    const lo = text.charCodeAt(i + 1);
    if (lo >= 0xdc00 && lo <= 0xdfff) return classify(((c - 0xd800) << 10) + (lo - 0xdc00) + 0x10000);
  }
  let k = bmpClass[c]!;
  if (k === unknown) k = bmpClass[c] = classify(c);
  return k;
}

/** UTF-16 units of the code point at i. */
const widthAt = (text: string, i: number): number => {
  const c = text.charCodeAt(i);
  return c >= 0xd800 && c <= 0xdbff && i + 1 < text.length && (text.charCodeAt(i + 1) & 0xfc00) === 0xdc00 ? 2 : 1;
};

/** The end of a run of one class from i (at least one code point: the caller saw its class). */
function runEnd(text: string, i: number, k: number): number {
  let j = i + widthAt(text, i);
  while (j < text.length && classAt(text, j) === k) j += widthAt(text, j);
  return j;
}

const apostrophe = 0x27,
  blank = 0x20;
/** The second (and third) characters of the contractions 's 't 'm 'd, 're 've 'll. */
const contraction2 = new Set([0x73, 0x74, 0x6d, 0x64]);
const contraction3 = new Set(["re", "ve", "ll"]);

/** Where the piece that starts at i ends (i < text.length). */
export function gpt2PieceEnd(text: string, i: number): number {
  const c = text.charCodeAt(i);
  if (c === apostrophe && i + 1 < text.length) {
    if (contraction2.has(text.charCodeAt(i + 1))) return i + 2;
    if (contraction3.has(text.slice(i + 1, i + 3))) return i + 3;
  }
  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": a run of one class, after one blank or none
  if (c === blank && i + 1 < text.length) {
    const next = classAt(text, i + 1);
    if (next !== space) return runEnd(text, i + 1, next);
  }
  const k = classAt(text, i);
  if (k !== space) return runEnd(text, i, k);
  // "\s+(?!\S)|\s+": the run of white space, less its last character where a non-space follows
  // and that leaves one at least (every \s character is one UTF-16 unit)
  let j = i + 1;
  while (j < text.length && classAt(text, j) === space) j++;
  return j < text.length && j - 1 > i ? j - 1 : j;
}
