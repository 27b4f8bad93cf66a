// The native nkey (services/runtime/mesh/nkey.ts) against nkeys' own: the same public key and the
// same signature of a nonce for every kind of seed, the same answer to a server's nonce as nats.js's
// nkeyAuthenticator, and what is not a seed refused.
import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createAccount, createOperator, createUser, fromPublic, fromSeed } from "@nats-io/nkeys";
import { nkeyAuthenticator as natsNkeyAuthenticator } from "@nats-io/transport-node";
import { nkeyAuthenticator, nkeyOf } from "../../services/runtime/mesh/nkey.ts";
import { CredentialsError, readSeed } from "../../services/runtime/job/roles.ts";

const te = new TextEncoder();

describe("nkey", () => {
  test("a user's, an account's and an operator's seed: nkeys' public key and signatures, byte for byte", () => {
    for (const make of [createUser, createAccount, createOperator]) {
      for (let i = 0; i < 8; i++) {
        const seed = make().getSeed();
        const theirs = fromSeed(seed);
        const ours = nkeyOf(seed);
        expect(ours.publicKey).toBe(theirs.getPublicKey());
        for (const data of [te.encode(""), te.encode(`nonce-${i}`), crypto.getRandomValues(new Uint8Array(1000))]) {
          const sig = ours.sign(data);
          expect(sig).toEqual(theirs.sign(data));
          expect(fromPublic(ours.publicKey).verify(data, sig)).toBe(true);
        }
      }
    }
  });

  test("the answer to a server's nonce is nats.js's nkeyAuthenticator's, and empty without a nonce", () => {
    const seed = createUser().getSeed();
    const ours = nkeyAuthenticator(nkeyOf(seed));
    const theirs = natsNkeyAuthenticator(seed);
    for (const nonce of ["Xq0o1j2jZ9kNcw", "a", undefined]) expect(ours(nonce)).toEqual(theirs(nonce));
    expect(ours(undefined)).toEqual({ nkey: fromSeed(seed).getPublicKey(), sig: "" });
  });

  test("what is not a seed is refused: a public key, a seed with a wrong checksum, text, nothing", () => {
    const seed = new TextDecoder().decode(createUser().getSeed());
    const flipped = `${seed.slice(0, 10)}${seed[10] === "A" ? "B" : "A"}${seed.slice(11)}`;
    for (const bad of [fromSeed(te.encode(seed)).getPublicKey(), flipped, "not a seed", ""])
      expect(() => nkeyOf(te.encode(bad))).toThrow();
    const dir = mkdtempSync(join(tmpdir(), "meshtrain-nkey-"));
    try {
      const file = join(dir, "bad.nk");
      writeFileSync(file, `${flipped}\n`);
      expect(() => readSeed(file)).toThrow(CredentialsError);
      expect(() => readSeed(file)).toThrow(`${file} holds no user nkey seed`);
      writeFileSync(file, `${seed}\n`);
      expect(readSeed(file).publicKey).toBe(fromSeed(te.encode(seed)).getPublicKey());
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
