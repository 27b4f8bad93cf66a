#!/usr/bin/env bun
// The SDK end to end: connect to a mesh, submit a job, follow its events, take and list
// snapshots, then cancel it; then run a second job to its end and read its outcome. Without
// --nats-url it starts a local mesh of its own (every service a process, an embedded NATS).
//
//   bun examples/sdk.ts [--nats-url nats://127.0.0.1:4222]   (with MT_NATS_NKEY=<client.nk> on a mesh with roles)
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { EventKind, jobConfig, LocalMesh, MeshClient, watchJob } from "../sdk/index.ts";

const { values } = parseArgs({ options: { "nats-url": { type: "string" } } });
const dir = mkdtempSync(join(tmpdir(), "meshtrain-sdk-example-"));
await using mesh =
  values["nats-url"] === undefined
    ? await LocalMesh.start({ jobsDir: join(dir, "jobs"), logDir: join(dir, "logs"), trainers: 2, shards: 2 })
    : null;
// a mesh with roles (the local one): connect as its client user (elsewhere: MT_NATS_NKEY)
await using client = await MeshClient.connect(values["nats-url"] ?? mesh!.url, mesh ? mesh.auth("client") : {});

// 1. submit, follow the events, save a snapshot mid-run, cancel
const first = jobConfig("mlp", { job: `sdk-example-${Date.now()}`, maxSteps: 400, checkpointEvery: 0 });
await client.submit(first);
for await (const e of client.events(first.job)) {
  if (e.kind === EventKind.Step && e.rank === 0 && e.step % 50 === 0)
    console.log(`step ${e.step}: loss ${e.loss.toFixed(4)}`);
  if (e.kind === EventKind.Step && e.step === 100 && e.rank === 0) {
    const saved = await client.saveCheckpoint(first.job);
    console.log(`snapshot: ${saved.text}`);
    break;
  }
}
console.log(`snapshots: ${(await client.checkpoints(first.job)).map((m) => `${m.id} (step ${m.step})`).join(", ")}`);
const cancelled = await client.cancel(first.job);
console.log(`cancelled: ${first.job} is ${cancelled.reason || "cancelled"}`);

// 2. a job followed to its end
const second = jobConfig("mlp", { job: `sdk-example-end-${Date.now()}`, maxSteps: 100, checkpointEvery: 50 });
await client.submit(second);
const outcome = await watchJob(client, second.job, { quiet: true });
console.log(
  `done: ${second.job} reached ${(outcome.record.accuracy * 100).toFixed(2)}% test accuracy; model ${outcome.record.modelPath}`,
);
