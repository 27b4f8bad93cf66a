// The ids of the GPT-2 pieces a fast encoder has seen, found by the piece's place in the text:
// an open-addressing hash table over the piece's UTF-16 units, so that a piece seen before costs
// no string of its own (a Map's key would be a new string, hashed, for every piece; that was two
// thirds of an encoding).

/** Slots: twice the pieces held at most, so that probes stay short. */
const slotBits = 20;
/** Distinct pieces held at most: a natural corpus's pieces repeat (the State of the Union's 2M
 *  tokens come from 32k), so this holds nearly every piece of a large corpus in about 20 MB per
 *  thread; past it, a new piece is encoded each time it comes. */
export const piecesMax = 1 << (slotBits - 1);

export class PieceTable {
  readonly #mask = (1 << slotBits) - 1;
  /** each slot's piece hash (odd, so 0 is an empty slot), piece and ids */
  readonly #hashes = new Int32Array(1 << slotBits);
  readonly #pieces: string[] = new Array(1 << slotBits);
  readonly #ids: number[][] = new Array(1 << slotBits);
  #size = 0;

  constructor(
    readonly encodePiece: (piece: string) => number[],
    /** pieces held at most (tests lower it to reach the table's end) */
    readonly capacity = piecesMax,
  ) {
    if (!(capacity >= 0 && capacity <= piecesMax)) throw new RangeError(`capacity ${capacity} is past ${piecesMax}`);
  }

  /** The ids of text[start, end): remembered, or encoded (and remembered while there is room). */
  ids(text: string, start: number, end: number): number[] {
    // FNV-1a over the UTF-16 units
    let h = 0x811c9dc5 | 0;
    for (let k = start; k < end; k++) h = Math.imul(h ^ text.charCodeAt(k), 0x01000193);
    h |= 1;
    for (let slot = (h ^ (h >>> 15)) & this.#mask; ; slot = (slot + 1) & this.#mask) {
      const s = this.#hashes[slot]!;
      if (s === 0) return this.#add(slot, h, text.slice(start, end));
      if (s === h && sameUnits(this.#pieces[slot]!, text, start, end)) return this.#ids[slot]!;
    }
  }

  #add(slot: number, h: number, piece: string): number[] {
    const ids = this.encodePiece(piece);
    if (this.#size >= this.capacity) return ids;
    this.#hashes[slot] = h;
    // a copy: a slice of the text keeps the whole text alive (a batch of a megabyte or more for
    // each piece it added: a worker's memory would grow with the corpus until the table is full)
    this.#pieces[slot] = Buffer.from(piece, "utf16le").toString("utf16le");
    this.#ids[slot] = ids;
    this.#size++;
    return ids;
  }
}

const sameUnits = (piece: string, text: string, start: number, end: number): boolean => {
  if (piece.length !== end - start) return false;
  for (let k = 0; k < piece.length; k++) if (piece.charCodeAt(k) !== text.charCodeAt(start + k)) return false;
  return true;
};
