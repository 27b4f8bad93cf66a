// A NATS user's nkey (an ed25519 key in NATS's encoding): its public key, and its signature of the
// nonce a server sends at connect. nkeys derives both with tweetnacl, in JavaScript: about 20 ms a
// key in a fresh process, paid by every service and CLI process for its public key, again at every
// connect, and by `creds` and a local mesh's start for each of its users. node:crypto's ed25519 is
// native and gives the same bytes (ed25519 is deterministic; test/services/nkey.test.ts compares
// them with nkeys'). nkeys still decodes and encodes the keys' text.
import { createPrivateKey, createPublicKey, sign } from "node:crypto";
import type { Authenticator } from "@nats-io/transport-node";
import { encode } from "@nats-io/nkeys";
import type * as NkeysCodec from "@nats-io/nkeys/lib/codec";

// nkeys' codec (base32 with its prefix and crc16), which its index does not export
const { Codec } = require("@nats-io/nkeys/lib/codec") as typeof NkeysCodec;

/** PKCS #8 of an ed25519 private key, before its 32-byte seed (RFC 8410). */
const pkcs8Ed25519 = Uint8Array.from([
  0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
]);
/** Bytes of an ed25519 SubjectPublicKeyInfo before its 32-byte key (RFC 8410). */
const spkiEd25519Header = 12;

export interface Nkey {
  /** the public key as NATS writes it (U... for a user) */
  readonly publicKey: string;
  /** the ed25519 signature of `data` */
  sign(data: Uint8Array): Uint8Array;
}

/** The key of an nkey seed (its text's bytes, SU... for a user); nkeys' error when it is not one. */
export function nkeyOf(seed: Uint8Array): Nkey {
  const { prefix, buf } = Codec.decodeSeed(seed);
  const key = createPrivateKey({ key: Buffer.concat([pkcs8Ed25519, buf]), format: "der", type: "pkcs8" });
  const publicRaw = createPublicKey(key).export({ format: "der", type: "spki" }).subarray(spkiEd25519Header);
  const publicKey = new TextDecoder().decode(Codec.encode(prefix, publicRaw));
  return { publicKey, sign: (data) => new Uint8Array(sign(null, data, key)) };
}

/** What nats.js's nkeyAuthenticator answers a server's nonce with, from a key derived once. */
export function nkeyAuthenticator(key: Nkey): Authenticator {
  return (nonce?: string) => ({
    nkey: key.publicKey,
    sig: nonce ? encode(key.sign(new TextEncoder().encode(nonce))) : "",
  });
}
