// The SDK's one entry point (sdk/index.ts), as the README shows it: examples/sdk.ts submits a
// job, follows its events, saves and lists a snapshot, cancels it, then follows a second job
// to its end, on a local mesh of its own.
import { expect, test } from "bun:test";
import { join } from "node:path";
import * as sdk from "../../sdk/index.ts";

test("the SDK's entry point exports the client, the watcher, the local mesh, configs and errors", () => {
  for (const name of [
    "MeshClient",
    "watchJob",
    "LocalMesh",
    "jobConfig",
    "parseJobConfig",
    "EventKind",
    "JobState",
    "ConfigError",
    "UnknownJobError",
    "runSample",
    "runEval",
  ]) {
    expect(sdk).toHaveProperty(name);
  }
  // every error class it exports is a MeshtrainError: a program catches that, or one by its class
  const errors = Object.entries(sdk).filter(([name]) => name.endsWith("Error"));
  expect(errors.map(([name]) => name)).toEqual(
    expect.arrayContaining([
      "MeshtrainError",
      "CapacityError",
      "JobStateError",
      "NatsUnreachableError",
      "NotReadyError",
    ]),
  );
  for (const [name, cls] of errors)
    expect(
      cls === sdk.MeshtrainError || (cls as { prototype: unknown }).prototype instanceof sdk.MeshtrainError,
      name,
    ).toBe(true);
  expect(sdk.jobConfig("gpt", { job: "default.x", maxSteps: 5 }).model.kind).toBe("gpt");
  expect(() => sdk.jobConfig("mlp", { job: "no spaces" })).toThrow(sdk.ConfigError);
  // a key it does not have, or a model it does not know, would be dropped unsaid
  expect(() => sdk.jobConfig("mlp", { job: "x", maxstep: 10 } as never)).toThrow(
    'a job config has no "maxstep" (its keys: ',
  );
  expect(() => sdk.jobConfig("bogus" as never, { job: "x" })).toThrow('a job\'s model is "mlp" or "gpt", not "bogus"');
});

test("examples/sdk.ts runs: events, a snapshot, cancel, and a job to its end", () => {
  const root = join(import.meta.dir, "..", "..");
  const p = Bun.spawnSync([process.execPath, join(root, "examples", "sdk.ts")], {
    cwd: root,
    stdout: "pipe",
    stderr: "pipe",
    timeout: 170_000,
  });
  const out = p.stdout.toString();
  expect(p.exitCode, p.stderr.toString()).toBe(0);
  expect(out).toMatch(/^step 0: loss \d+\.\d{4}$/m);
  expect(out).toMatch(/^snapshot: saved step-\d{9}/m);
  expect(out).toMatch(/^snapshots: step-\d{9} \(step \d+\)/m);
  expect(out).toMatch(/^cancelled: sdk-example-\d+ is /m);
  const acc = /reached (\d+\.\d+)% test accuracy; model (\S+)$/m.exec(out);
  expect(Number(acc![1])).toBeGreaterThan(90);
}, 180_000);
