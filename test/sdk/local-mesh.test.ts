// The local launcher's restart policy: exponential backoff over a failure streak, a budget of
// restarts per sliding window, and giving up on a service that keeps crashing with the last error
// it wrote (against a real crashing process and nats-server).
import { afterAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { errorOfLine, LocalMesh, restartDefaults, RestartTracker } from "../../sdk/local-mesh.ts";
import { configExitCode } from "../../services/runtime/mesh/service.ts";
import { removeTempDirs, tempDir, waitFor } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

describe("RestartTracker", () => {
  const policy = {
    ...restartDefaults,
    baseDelayMs: 500,
    maxDelayMs: 4_000,
    budget: 5,
    windowMs: 60_000,
    healthyRunMs: 10_000,
  };

  test("quick failures in a row double the pause up to the cap; a healthy run starts over", () => {
    const t = new RestartTracker(policy);
    expect([0, 1, 2, 3].map((i) => t.next(i * 1000, 100))).toEqual([500, 1000, 2000, 4000]);
    expect(t.next(5_000, 20_000)).toBe(500); // it had run 20 s: a new streak
  });

  test("past the budget within the window it gives up; restarts that leave the window free it again", () => {
    const t = new RestartTracker({ ...policy, healthyRunMs: 1 });
    for (let i = 0; i < 5; i++) expect(t.next(i * 1000, 5)).toBe(500);
    expect(t.next(5_000, 5)).toBeNull();
    expect(t.recent).toBe(5);
    // a minute after the first restart, it has left the window
    expect(t.next(60_000, 5)).toBe(500);
  });
});

describe("errorOfLine", () => {
  test("pino error and fatal lines give their msg and err; crash lines their error; the rest nothing", () => {
    expect(errorOfLine('{"level":"error","msg":"cannot open job","err":"no such file"}')).toBe(
      "cannot open job: no such file",
    );
    expect(errorOfLine('{"level":"fatal","msg":"boom"}')).toBe("boom");
    expect(errorOfLine('{"level":"warn","msg":"slow"}')).toBeNull();
    expect(errorOfLine("InvalidArgumentError: 'payload' max_payload size exceeded")).toBe(
      "InvalidArgumentError: 'payload' max_payload size exceeded",
    );
    expect(errorOfLine("      at format (errors.js:48:16)")).toBeNull();
    expect(errorOfLine("{not json")).toBeNull();
  });
});

test("a service that keeps crashing is restarted with backoff, then given up on, naming its last error", async () => {
  const dir = tempDir("mt-launcher-");
  const events: string[] = [];
  const gaveUp: { service: string; lastError: string; log: string }[] = [];
  const crash = `console.error(JSON.stringify({ level: "error", msg: "cannot open the data", err: "truncated file" })); process.exit(3)`;
  await using mesh = await LocalMesh.start(
    {
      jobsDir: join(dir, "jobs"),
      logDir: join(dir, "logs"),
      restart: { baseDelayMs: 20, maxDelayMs: 200, budget: 3, windowMs: 60_000 },
      onEvent: (line) => events.push(line),
      onGiveUp: (service, lastError, log) => gaveUp.push({ service, lastError, log }),
    },
    [{ name: "crasher", argv: [process.execPath, "-e", crash], env: {} }],
  );
  await waitFor("the launcher to give up on the crasher", () => gaveUp.length > 0, 30_000);
  expect(gaveUp).toEqual([
    { service: "crasher", lastError: "cannot open the data: truncated file", log: mesh.logPath("crasher") },
  ]);
  const restarts = events.filter((l) => l.includes("restarting in"));
  expect(restarts.map((l) => /restarting in ([\d.]+) s/.exec(l)![1])).toEqual(["0.0", "0.0", "0.1"]);
  expect(events.at(-1)).toContain(
    "crasher died (exit 3) after 3 restarts within 1 min; not restarting. Its last error: cannot open the data: truncated file",
  );
});

test("a service that exits with the configuration code is not restarted: given up on at once with its error", async () => {
  const dir = tempDir("mt-launcher-");
  const events: string[] = [];
  const gaveUp: { service: string; lastError: string; cannotStart: boolean }[] = [];
  const fail = `console.error(JSON.stringify({ level: "fatal", msg: "trainer failed to start", err: "--device cuda: no CUDA driver" })); process.exit(${configExitCode})`;
  await using _mesh = await LocalMesh.start(
    {
      jobsDir: join(dir, "jobs"),
      logDir: join(dir, "logs"),
      restart: { baseDelayMs: 20, maxDelayMs: 200, budget: 3, windowMs: 60_000 },
      onEvent: (line) => events.push(line),
      onGiveUp: (service, lastError, _log, cannotStart) => gaveUp.push({ service, lastError, cannotStart }),
    },
    [{ name: "misconfigured", argv: [process.execPath, "-e", fail], env: {} }],
  );
  await waitFor("the launcher to give up on the service", () => gaveUp.length > 0, 30_000);
  expect(gaveUp).toEqual([
    {
      service: "misconfigured",
      lastError: "trainer failed to start: --device cuda: no CUDA driver",
      cannotStart: true,
    },
  ]);
  expect(events.some((l) => l.includes("restarting in"))).toBe(false);
  expect(events.at(-1)).toContain(
    "misconfigured cannot start: trainer failed to start: --device cuda: no CUDA driver; not restarting: a configuration error",
  );
});
