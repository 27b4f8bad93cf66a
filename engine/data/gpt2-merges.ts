// GPT-2's byte-pair merges for one piece, as js-tiktoken merges them (the pair of lowest rank
// first, the leftmost of equal ranks), from the ranks js-tiktoken ships. A fast encoder's piece it
// has not seen costs this alone: js-tiktoken's encode builds its regular expressions again on
// every call, which made each new piece cost about thirty times a remembered one.
import { gpt2Ranks } from "./gpt2-ranks.ts";

/** Each token's bytes (as a string of code points 0-255) to its id. */
let ranks: Map<string, number> | null = null;

function loadRanks(): Map<string, number> {
  const m = new Map<string, number>();
  // each line: a name, the first id, then each token's bytes in base64, the ids counting up
  for (const line of gpt2Ranks().bpe_ranks.split("\n")) {
    if (line === "") continue;
    const [, first, ...tokens] = line.split(" ");
    const id0 = Number.parseInt(first!, 10);
    tokens.forEach((t, i) => m.set(Buffer.from(t, "base64").toString("latin1"), id0 + i));
  }
  return m;
}

/** The ids of one piece (a piece as GPT-2's pattern cuts text: engine/data/gpt2-pieces.ts). */
export function gpt2MergePiece(piece: string): number[] {
  ranks ??= loadRanks();
  const r = ranks;
  const bytes = Buffer.from(piece, "utf8").toString("latin1");
  const whole = r.get(bytes);
  if (whole !== undefined) return [whole];
  // the parts' starts, and the end: each merge removes the start between the pair of lowest rank
  const bounds = Array.from({ length: bytes.length + 1 }, (_, i) => i);
  while (bounds.length > 2) {
    let best = Number.POSITIVE_INFINITY;
    let at = -1;
    for (let i = 0; i + 2 < bounds.length; i++) {
      const rank = r.get(bytes.slice(bounds[i], bounds[i + 2]));
      if (rank !== undefined && rank < best) {
        best = rank;
        at = i;
      }
    }
    if (at < 0) break;
    bounds.splice(at + 1, 1);
  }
  // every single byte is a token, so every part has an id
  return bounds.slice(0, -1).map((start, i) => r.get(bytes.slice(start, bounds[i + 1]))!);
}
