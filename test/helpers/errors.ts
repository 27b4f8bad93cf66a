// Asserting on thrown errors: their class and the fragments their message must contain.
import { expect } from "bun:test";

export function expectThrown(
  fn: () => unknown,
  cls: abstract new (...args: never[]) => Error,
  ...fragments: string[]
): Error {
  let error: unknown;
  try {
    fn();
  } catch (e) {
    error = e;
  }
  expect(error).toBeInstanceOf(cls);
  for (const s of fragments) expect((error as Error).message).toContain(s);
  return error as Error;
}

/** expectThrown for an async call: its promise must reject with `cls`. */
export async function expectRejected(
  fn: () => Promise<unknown>,
  cls: abstract new (...args: never[]) => Error,
  ...fragments: string[]
): Promise<Error> {
  let error: unknown;
  try {
    await fn();
  } catch (e) {
    error = e;
  }
  expect(error).toBeInstanceOf(cls);
  for (const s of fragments) expect((error as Error).message).toContain(s);
  return error as Error;
}
