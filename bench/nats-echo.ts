#!/usr/bin/env bun
// Raw NATS request/reply for the ps benchmark's baseline, one process per shard like the
// parameter server: `bench.<k>.push` answers a 16-byte ack, `bench.<k>.pull` answers with a
// payload of the size the request names (4-byte little-endian). No decoding, no work.
import { connect } from "@nats-io/transport-node";

const [url, shard] = process.argv.slice(2);
const nc = await connect({ servers: url! });
const ack = new Uint8Array(16);
const payloads = new Map<number, Uint8Array>();
nc.subscribe(`bench.${shard}.push`, { callback: (_e, m) => void m.respond(ack) });
nc.subscribe(`bench.${shard}.pull`, {
  callback: (_e, m) => {
    const size = new DataView(m.data.buffer, m.data.byteOffset, 4).getUint32(0, true);
    let p = payloads.get(size);
    if (!p) payloads.set(size, (p = new Uint8Array(size)));
    m.respond(p);
  },
});
await nc.flush();
console.log("ready");
process.on("SIGTERM", () => void nc.drain().then(() => process.exit(0)));
