// A message fuzzer for the mesh's request subjects: each message is a seed mutated once or a few
// times, at the byte level (bit flips, inserted and deleted bytes, truncation, NaN/Inf and
// extreme integers written over aligned words, garbage) or at the field level (a decoded field
// set to an extreme number, a hostile text, or a vector cut, grown or poisoned, then encoded).
// Every reply is classified: an answer, an error reply naming a class, or no answer in time.
//
// A mutation that yields a message a real member of the job could send (a push as one of its
// trainers with finite gradients, a restore of a snapshot that exists) is drawn again: accepting
// a well-formed message from someone who may send it is what credentials decide, not validation.
import { Rng } from "../../engine/rng.ts";
import type { Bus } from "../../services/runtime/mesh/bus.ts";
import { DeadlineError, NoRespondersError } from "../../services/runtime/mesh/errors.ts";
import { MeshtrainError } from "../../ffi/errors.ts";

export interface Target<T = unknown> {
  /** a short name for the report */
  name: string;
  subject: string;
  seeds: T[];
  encode(m: T): Uint8Array;
  /** the subject's decoder (throws on what the service would refuse as malformed) */
  decode(data: Uint8Array): T;
  /** true for a message that a member of the job may legitimately send: drawn again */
  legitimate?(m: T): boolean;
  /** numbers a field mutation writes (default: extremeNumbers) */
  numbers?: readonly number[];
  /** a field mutation may recompute what `fix` recomputes (a checksum), so that the check behind it is reached */
  fix?(m: T): T;
  /** true when an answer says the message was taken (changed state): counted in Outcome.taken */
  taken?(reply: Uint8Array): boolean;
  /** the caller's wait for an answer */
  timeoutMs: number;
}

/** Values a numeric field is set to: the edges of every integer width, NaN, infinities, tiny and huge floats. */
export const extremeNumbers: readonly number[] = [
  0,
  -1,
  1,
  0.5,
  -0,
  2 ** 31 - 1,
  -(2 ** 31),
  2 ** 32 - 1,
  2 ** 32,
  2 ** 53 - 1,
  -(2 ** 53),
  2 ** 64,
  Number.NaN,
  Number.POSITIVE_INFINITY,
  Number.NEGATIVE_INFINITY,
  1e308,
  -1e308,
  3.4e38,
  1e-45,
  Number.MIN_VALUE,
];

/** Numbers that are never valid in a state (every snapshot value is finite and within
 *  stateValueAbsMax, every count small). */
export const poisonNumbers: readonly number[] = [
  -1,
  3e38,
  -3e38,
  2 ** 65,
  2 ** 31 - 1,
  2 ** 32 - 1,
  2 ** 53 - 1,
  -(2 ** 53),
  Number.NaN,
  Number.POSITIVE_INFINITY,
  Number.NEGATIVE_INFINITY,
  1e308,
  -1e308,
];

/** Texts a string field is set to: line breaks (which NATS headers refuse), control bytes, long and odd Unicode. */
export const hostileTexts: readonly string[] = [
  "a\nb",
  "\r\n",
  "x\r\nNATS/1.0 503\r\n\r\n",
  "\u0000",
  "..",
  "*",
  ">",
  "a.b.c",
  "\u202e\ud83d\ude00\ufffd",
  "\ud800",
  "x".repeat(257),
  "y".repeat(100_000),
  "%s%n",
  "step-",
  "part -1",
  "part 99999999999",
];

/** Bit patterns written over aligned words: float NaN and infinities, all ones, the sign bit. */
const words32 = [0x7fc00000, 0x7f800000, 0xff800000, 0xffffffff, 0x80000000, 0x7fffffff, 0, 1];
const words64 = [
  0xffffffffffffffffn,
  0x7ff8000000000000n,
  0x7ff0000000000000n,
  0x001fffffffffffffn,
  0x8000000000000000n,
];

/** One byte-level mutation of `b` (a new array). */
export function mutateBytes(rng: Rng, b: Uint8Array): Uint8Array {
  const n = b.length;
  const at = (k = 0) => (n > k ? rng.int(n - k) : 0);
  switch (rng.int(9)) {
    case 0: {
      const out = b.slice();
      for (let i = 1 + rng.int(8); i > 0 && n > 0; i--) out[at()]! ^= 1 << rng.int(8);
      return out;
    }
    case 1: {
      const ins = randomBytes(rng, 1 + rng.int(16));
      const p = at();
      return concat(b.subarray(0, p), ins, b.subarray(p));
    }
    case 2: {
      const p = at(),
        len = 1 + rng.int(16);
      return concat(b.subarray(0, p), b.subarray(p + len));
    }
    case 3:
      return b.slice(0, at());
    case 4: {
      const out = b.slice();
      if (n >= 4) new DataView(out.buffer).setUint32(at(3) & ~3, words32[rng.int(words32.length)]!, true);
      return out;
    }
    case 5: {
      const out = b.slice();
      if (n >= 8) new DataView(out.buffer).setBigUint64(at(7) & ~7, words64[rng.int(words64.length)]!, true);
      return out;
    }
    case 6: {
      // a range repeated (a vector or a table seen twice)
      const p = at(),
        len = Math.min(n - p, 1 + rng.int(64));
      return concat(b.subarray(0, p + len), b.subarray(p, p + len), b.subarray(p + len));
    }
    case 7:
      return randomBytes(rng, rng.int(2) === 0 ? n : rng.int(4096));
    default: {
      // the 4-byte root offset or the file identifier changed
      const out = b.slice();
      if (n >= 8) out[rng.int(8)] = rng.int(256);
      return out;
    }
  }
}

/** Bytes from the seeded stream (a run is replayed from its seed). */
function randomBytes(rng: Rng, n: number): Uint8Array {
  const out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = rng.nextU32() & 0xff;
  return out;
}

function concat(...parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((s, p) => s + p.length, 0));
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.length;
  }
  return out;
}

type Leaf = { get(): unknown; set(v: unknown): void };

/** Every mutable place in a decoded message: numbers, bigints, strings, vectors and their elements. */
function leaves(o: unknown, out: Leaf[] = []): Leaf[] {
  if (o === null || typeof o !== "object") return out;
  if (ArrayBuffer.isView(o)) return out;
  for (const key of Object.keys(o)) {
    const rec = o as Record<string, unknown>;
    const v = rec[key];
    const leaf = { get: () => rec[key], set: (x: unknown) => (rec[key] = x) };
    if (
      typeof v === "number" ||
      typeof v === "bigint" ||
      typeof v === "string" ||
      ArrayBuffer.isView(v) ||
      Array.isArray(v)
    )
      out.push(leaf);
    if (typeof v === "object") leaves(v, out);
  }
  return out;
}

/** A deep copy that keeps typed arrays typed. */
function clone<T>(m: T): T {
  return structuredClone(m);
}

/** One field-level mutation of `m` (a copy). */
export function mutateFields<T>(rng: Rng, m: T, numbers: readonly number[]): T {
  const out = clone(m);
  const all = leaves(out);
  if (all.length === 0) return out;
  const leaf = all[rng.int(all.length)]!;
  const v = leaf.get();
  const pickNumber = () => numbers[rng.int(numbers.length)]!;
  if (typeof v === "number") leaf.set(pickNumber());
  else if (typeof v === "bigint") {
    const x = pickNumber();
    leaf.set(BigInt.asUintN(64, BigInt(Number.isFinite(x) ? Math.trunc(x) : -1)));
  } else if (typeof v === "string") leaf.set(hostileTexts[rng.int(hostileTexts.length)]!);
  else if (Array.isArray(v)) {
    if (v.length > 0 && rng.int(2) === 0) v.splice(rng.int(v.length), 1);
    else if (v.length > 0) v.push(clone(v[rng.int(v.length)]));
  } else if (ArrayBuffer.isView(v)) {
    const a = v as unknown as {
      length: number;
      [i: number]: number;
      slice(a: number, b?: number): unknown;
      constructor: new (n: number) => unknown;
    };
    const kind = rng.int(3);
    if (kind === 0) leaf.set(a.slice(0, rng.int(a.length + 1)));
    else if (kind === 1) {
      const grown = new a.constructor(a.length + 1 + rng.int(64)) as { set(x: unknown): void };
      grown.set(a);
      leaf.set(grown);
    } else if (a.length > 0) {
      const x = pickNumber();
      if (v instanceof Uint8Array) {
        // bytes of a float vector: a float written at an aligned place
        if (a.length >= 4)
          new DataView(v.buffer, v.byteOffset, v.byteLength).setFloat32(rng.int(a.length >> 2) * 4, x, true);
      } else a[rng.int(a.length)] = x;
    }
  }
  return out;
}

export interface Outcome {
  sent: number;
  /** successful replies */
  answered: number;
  /** error replies by class */
  errors: Map<string, number>;
  /** requests no service answered within the timeout, or with no service to answer */
  unanswered: { subject: string; error: string }[];
  /** replies that were neither a decodable answer nor an error the bus names */
  other: string[];
  /** mutations drawn again because they made a legitimate message */
  redrawn: number;
  /** by target name, the replies (answers or errors) that took longer than slowMs: how many, and the longest wait */
  slow: Map<string, { count: number; longestMs: number }>;
  /** successful replies by target name */
  answeredBy: Map<string, number>;
  /** answers that say the message was taken, by target name */
  taken: Map<string, number>;
}

export interface FuzzOptions {
  messages: number;
  seed: number;
  /** requests in flight at once */
  concurrency: number;
  /** stops early when it returns true (checked between messages) */
  stop?(): boolean;
}

/** A reply that took longer than this is counted in Outcome.slow: a request that waits for the job, or a service that stalled. */
const slowMs = 1_000;

/**
 * Sends `messages` mutated messages spread evenly over `targets` (round-robin, each a mutated
 * seed), `concurrency` at a time, and classifies every reply.
 */
export async function fuzz(bus: Bus, targets: readonly Target[], o: FuzzOptions): Promise<Outcome> {
  const rng = new Rng(o.seed);
  const out: Outcome = {
    sent: 0,
    answered: 0,
    errors: new Map(),
    unanswered: [],
    other: [],
    redrawn: 0,
    answeredBy: new Map(),
    taken: new Map(),
    slow: new Map(),
  };
  const draw = (t: Target): Uint8Array => {
    for (let attempt = 0; ; attempt++) {
      const seed = t.seeds[rng.int(t.seeds.length)]!;
      let bytes: Uint8Array;
      let m: unknown = seed;
      const fieldLevel = rng.int(2) === 0;
      if (fieldLevel) {
        for (let k = 1 + rng.int(2); k > 0; k--) m = mutateFields(rng, m, t.numbers ?? extremeNumbers);
        if (t.fix && rng.int(2) === 0) m = t.fix(m);
        try {
          bytes = t.encode(m);
        } catch {
          bytes = mutateBytes(rng, t.encode(seed)); // a value the encoder cannot write: mutate the bytes instead
        }
      } else {
        bytes = t.encode(seed);
        for (let k = 1 + rng.int(2); k > 0; k--) bytes = mutateBytes(rng, bytes);
      }
      if (t.legitimate) {
        let decoded: unknown = null;
        try {
          decoded = t.decode(bytes);
        } catch {
          // malformed: the service refuses it
        }
        if (decoded !== null && t.legitimate(decoded) && attempt < 1000) {
          out.redrawn++;
          continue;
        }
      }
      return bytes;
    }
  };
  let next = 0;
  const worker = async () => {
    while (next < o.messages && !o.stop?.()) {
      const t = targets[next++ % targets.length]!;
      const bytes = draw(t);
      out.sent++;
      const t0 = performance.now();
      try {
        const reply = await bus.request(t.subject, bytes, t.timeoutMs);
        if (t.taken?.(reply) ?? false) out.taken.set(t.name, (out.taken.get(t.name) ?? 0) + 1);
        out.answered++;
        out.answeredBy.set(t.name, (out.answeredBy.get(t.name) ?? 0) + 1);
      } catch (e) {
        const err = e as Error;
        if ((err instanceof DeadlineError && err.message.startsWith("no reply on")) || err instanceof NoRespondersError)
          out.unanswered.push({ subject: t.subject, error: err.message });
        else if (err instanceof MeshtrainError && err.code !== "") {
          const key = `${t.name}: ${err.constructor.name}`;
          out.errors.set(key, (out.errors.get(key) ?? 0) + 1);
        } else out.other.push(`${t.subject}: ${err.constructor.name}: ${err.message}`);
      } finally {
        const ms = performance.now() - t0;
        if (ms > slowMs) {
          const was = out.slow.get(t.name) ?? { count: 0, longestMs: 0 };
          out.slow.set(t.name, { count: was.count + 1, longestMs: Math.max(was.longestMs, ms) });
        }
      }
    }
  };
  await Promise.all(Array.from({ length: o.concurrency }, worker));
  return out;
}
