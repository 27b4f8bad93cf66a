// Option parsers for the CLI: each turns a string into a checked value or raises commander's
// InvalidArgumentError, which commander prints as "error: option '--x <n>' argument '...' is invalid. <reason>".
import { InvalidArgumentError } from "commander";

export function float(min = -Infinity, max = Infinity, { exclusiveMin = false } = {}) {
  return (raw: string): number => {
    const v = Number(raw);
    const low = exclusiveMin ? v > min : v >= min;
    if (raw.trim() === "" || !Number.isFinite(v) || !low || v > max) {
      throw new InvalidArgumentError(`expected a number ${exclusiveMin ? ">" : ">="} ${min}${max < Infinity ? ` and <= ${max}` : ""}`);
    }
    return v;
  };
}

export function int(min = 0, max = Number.MAX_SAFE_INTEGER) {
  return (raw: string): number => {
    const v = Number(raw);
    if (!/^-?\d+$/.test(raw.trim()) || !Number.isSafeInteger(v) || v < min || v > max) {
      throw new InvalidArgumentError(`expected an integer >= ${min}${max < Number.MAX_SAFE_INTEGER ? ` and <= ${max}` : ""}`);
    }
    return v;
  };
}

/** "784,800,10" -> [784, 800, 10] */
export function intList(raw: string): number[] {
  const parts = raw.split(",").map((s) => s.trim());
  const values = parts.map(Number);
  if (parts.length < 2 || values.some((v, i) => !/^\d+$/.test(parts[i]!) || v <= 0)) {
    throw new InvalidArgumentError("expected at least two comma-separated positive integers, e.g. 784,800,10");
  }
  return values;
}

export function choice<T extends string>(...allowed: T[]) {
  return (raw: string): T => {
    if (!(allowed as string[]).includes(raw)) throw new InvalidArgumentError(`expected one of: ${allowed.join(", ")}`);
    return raw as T;
  };
}
