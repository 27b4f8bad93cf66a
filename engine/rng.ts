// Seeded pseudo-random numbers: xoshiro128** (Blackman & Vigna), seeded through splitmix32.
// Pure 32-bit integer arithmetic, so the same seed gives the same stream on every machine;
// normals use Box-Muller on 53-bit uniforms.

function splitmix32(state: { s: number }): number {
  state.s = (state.s + 0x9e3779b9) | 0;
  let z = state.s;
  z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
  z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
  return (z ^ (z >>> 16)) >>> 0;
}

export class Rng {
  #a: number;
  #b: number;
  #c: number;
  #d: number;
  #spare: number | null = null;

  constructor(seed: number) {
    const st = { s: (seed >>> 0) ^ Math.floor(seed / 2 ** 32) };
    this.#a = splitmix32(st);
    this.#b = splitmix32(st);
    this.#c = splitmix32(st);
    this.#d = splitmix32(st);
  }

  /** uniform 32-bit unsigned integer */
  nextU32(): number {
    const result = Math.imul(rotl(Math.imul(this.#b, 5), 7), 9) >>> 0;
    const t = this.#b << 9;
    this.#c ^= this.#a;
    this.#d ^= this.#b;
    this.#b ^= this.#c;
    this.#a ^= this.#d;
    this.#c ^= t;
    this.#d = rotl(this.#d, 11);
    return result;
  }

  /** uniform in [0, 1) with 53 bits */
  uniform(): number {
    const hi = this.nextU32() >>> 5; // 27 bits
    const lo = this.nextU32() >>> 6; // 26 bits
    return (hi * 67108864 + lo) / 9007199254740992;
  }

  /** integer uniform in [0, n) without modulo bias */
  int(n: number): number {
    if (!(n > 0 && n <= 2 ** 32)) throw new RangeError(`Rng.int: n must be in (0, 2^32], got ${n}`);
    const limit = 2 ** 32 - (2 ** 32 % n);
    for (;;) {
      const x = this.nextU32();
      if (x < limit) return x % n;
    }
  }

  /** standard normal */
  normal(): number {
    if (this.#spare !== null) {
      const s = this.#spare;
      this.#spare = null;
      return s;
    }
    let u = 0;
    while (u === 0) u = this.uniform();
    const v = this.uniform();
    const r = Math.sqrt(-2 * Math.log(u));
    this.#spare = r * Math.sin(2 * Math.PI * v);
    return r * Math.cos(2 * Math.PI * v);
  }

  /** Fisher-Yates shuffle in place */
  shuffle<T extends { length: number; [i: number]: unknown }>(a: T): T {
    for (let i = a.length - 1; i > 0; i--) {
      const j = this.int(i + 1);
      const t = a[i];
      a[i] = a[j];
      a[j] = t;
    }
    return a;
  }
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k));
}
