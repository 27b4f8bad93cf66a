// The project says Node >= 20 (package.json's engines, the README, scripts/bootstrap.mjs), so no
// package it installs may ask for a later Node: npm ci would warn EBADENGINE on a machine the
// README says is enough.
import { expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";

const root = join(import.meta.dir, "..", "..");
const nodeMajor = 20;

/** The lowest Node major an engines range's lower bound asks for (null when it sets none). */
export function lowestMajor(range: string): number | null {
  const bounds = [...range.matchAll(/>=?\s*v?(\d+)/g)].map((m) => Number(m[1]));
  const carets = [...range.matchAll(/\^\s*v?(\d+)/g)].map((m) => Number(m[1]));
  const all = [...bounds, ...carets];
  // "a || b": the range admits the lowest of the alternatives
  return all.length === 0 ? null : Math.min(...all);
}

test("engines ranges: the lowest major each admits", () => {
  expect([">=22", ">= 18.0.0", "^20.17.0 || >=22.9.0", "*", ">=14"].map(lowestMajor)).toEqual([22, 18, 20, null, 14]);
});

test(`no installed package asks for a Node later than ${nodeMajor}`, () => {
  const lock = JSON.parse(readFileSync(join(root, "package-lock.json"), "utf8")) as {
    packages: Record<string, { engines?: { node?: string } }>;
  };
  const own = JSON.parse(readFileSync(join(root, "package.json"), "utf8")) as { engines: { node: string } };
  expect(lowestMajor(own.engines.node)).toBe(nodeMajor);
  const later = Object.entries(lock.packages)
    .filter(([, p]) => typeof p.engines?.node === "string" && (lowestMajor(p.engines.node) ?? 0) > nodeMajor)
    .map(([name, p]) => `${name} (node ${p.engines!.node})`);
  expect(later).toEqual([]);
});
