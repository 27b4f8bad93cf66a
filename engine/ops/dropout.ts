// dropout: out = keep ? inp / (1-p) : 0, keep decided per element by a counter-based hash of
// (seed, index), so the backward recomputes the mask and no mask is stored. Each call draws a
// fresh seed from the context (seeded, so runs reproduce). The identity in evaluation or p=0.
import { ConfigError } from "../../ffi/errors.ts";
import type { Tensor } from "../tensor.ts";
import { checkDType, checkInputs } from "./check.ts";

export function dropout(inp: Tensor, p: number): Tensor {
  const ctx = checkInputs("dropout", [inp]);
  checkDType("dropout", inp, "f32");
  if (!(p >= 0 && p < 1)) throw new ConfigError(`dropout: p must be in [0, 1), got ${p}`);
  if (p === 0 || !ctx.training) return inp;
  const be = ctx.backend;
  const seed = ctx.nextDropoutSeed();
  const out = ctx.empty(inp.shape);
  be.dropoutForward(out.ptr, inp.ptr, inp.numel, p, seed);
  ctx.record(
    "dropout",
    [inp],
    out,
    () => {
      be.dropoutBackward(inp.ensureGrad().ptr, out.grad!.ptr, inp.numel, p, seed);
    },
    [],
  );
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

const mask64 = (1n << 64n) - 1n;

function splitmix64(x: bigint): bigint {
  x = (x + 0x9e3779b97f4a7c15n) & mask64;
  x = ((x ^ (x >> 30n)) * 0xbf58476d1ce4e5b9n) & mask64;
  x = ((x ^ (x >> 27n)) * 0x94d049bb133111ebn) & mask64;
  return x ^ (x >> 31n);
}

/** The kernel's uniform draw for element i: 24 bits, exact in float32. */
export function dropoutUniformReference(seed: bigint, i: number): number {
  const h = splitmix64(seed ^ ((BigInt(i) * 0xd1b54a32d192ed03n) & mask64));
  return Number(h >> 40n) / 16777216;
}

// Math.fround(p): the kernel compares against p rounded to float32.
export function dropoutReference(x: Float64Array, p: number, seed: bigint): Float64Array {
  const pf = Math.fround(p);
  return x.map((v, i) => (dropoutUniformReference(seed, i) >= pf ? v / (1 - p) : 0));
}

export function dropoutBackwardReference(dout: Float64Array, p: number, seed: bigint): Float64Array {
  return dropoutReference(dout, p, seed);
}
