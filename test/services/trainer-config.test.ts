// The trainer service's device key: validated with the rest of its config, before it connects.
import { expect, test } from "bun:test";
import { join } from "node:path";
import { configExitCode } from "../../services/runtime/mesh/service.ts";

const main = join(import.meta.dir, "..", "..", "services", "trainer", "main.ts");

test.each([
  ["--device tpu", ["--device", "tpu"], {}, "device (from --device): Invalid option"],
  ["MT_DEVICE=gpu", [], { MT_DEVICE: "gpu" }, "device (from $MT_DEVICE): Invalid option"],
])("a bad device (%s) is one clear start-up error", (_, args, env, fragment) => {
  const p = Bun.spawnSync([process.execPath, main, ...args], {
    env: { ...process.env, ...env, MT_CONNECT_RETRY_MS_MAX: "0", MT_LOG_LEVEL: "silent" },
    stdout: "pipe",
    stderr: "pipe",
  });
  // a configuration error: no restart can fix it, so the launcher does not restart it
  expect(p.exitCode).toBe(configExitCode);
  expect(p.stderr.toString()).toContain(fragment);
  expect(p.stderr.toString()).toContain(`expected one of "auto"|"cpu"|"cuda"`);
});
