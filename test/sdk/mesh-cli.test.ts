// The mesh commands as a user runs them, as real processes: `run` on any number of trainers and
// shards with paths relative to the user's folder, a data folder that cannot be read, a stop by
// SIGINT to the `run` process alone and its resume; `mesh up` with the client commands, each of
// which ends with an answer.
import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, mkdirSync, readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { defaultMnistDir } from "../../engine/data/mnist.ts";
import { freePort } from "../../services/runtime/mesh/nats-server.ts";
import { newJobName } from "../../sdk/cli/job-options.ts";
import { removeTempDirs, tempDir, waitFor } from "../helpers/mesh.ts";

/** Processes start() began: a failing test must not leave them running. */
const started = new Set<ReturnType<typeof Bun.spawn>>();
afterEach(() => {
  for (const p of started) if (p.exitCode === null) p.kill("SIGKILL"); // its children follow (the launcher's pdeathsig)
  started.clear();
});
afterAll(removeTempDirs);

const root = join(import.meta.dir, "..", "..");
const cliPath = join(root, "sdk", "cli", "main.ts");
/** A small, quick job: 784-32-10, 1000 samples per trainer and step. */
const quick = ["--widths", "784,32,10", "--batch-size", "1000", "--epochs", "1", "--warmup", "5"];

/** The child's environment: the user's folder is `cwd`. */
function env(cwd: string, extra: Record<string, string> = {}): Record<string, string> {
  const e = { ...process.env } as Record<string, string>;
  // run from the user's folder itself: an INIT_CWD inherited from an npm script (the package
  // root, where npm test ran) must not move it; npm's script name only where a test gives it
  e.INIT_CWD = root;
  e.npm_package_json = join(root, "package.json");
  delete e.npm_lifecycle_event;
  delete e.MT_NATS_URL;
  return { ...e, ...extra };
}

function cli(cwd: string, args: string[], extra: Record<string, string> = {}) {
  const p = Bun.spawnSync([process.execPath, cliPath, ...args], {
    cwd,
    env: env(cwd, extra),
    stdout: "pipe",
    stderr: "pipe",
  });
  return { code: p.exitCode, out: p.stdout.toString(), err: p.stderr.toString() };
}

/** A running CLI process whose stdout is collected as it comes. */
function start(cwd: string, args: string[], extra: Record<string, string> = {}) {
  const proc = Bun.spawn([process.execPath, cliPath, ...args], {
    cwd,
    env: env(cwd, extra),
    stdin: "ignore",
    stdout: "pipe",
    stderr: "pipe",
  });
  started.add(proc);
  let out = "",
    err = "";
  const pump = async (s: ReadableStream<Uint8Array>, add: (t: string) => void) => {
    const d = new TextDecoder();
    for await (const c of s) add(d.decode(c, { stream: true }));
  };
  const done = Promise.all([pump(proc.stdout, (t) => (out += t)), pump(proc.stderr, (t) => (err += t))]).then(
    () => proc.exited,
  );
  return { proc, out: () => out, err: () => err, done };
}

/** Processes whose command line or environment mention `text`. */
function processesMentioning(text: string): number[] {
  const pids: number[] = [];
  for (const pid of readdirSync("/proc").filter((n) => /^\d+$/.test(n))) {
    try {
      const seen = ["cmdline", "environ"].map((f) => readFileSync(`/proc/${pid}/${f}`, "utf8")).join("\0");
      if (seen.includes(text) && Number(pid) !== process.pid) pids.push(Number(pid));
    } catch {
      // gone meanwhile, or not ours to read
    }
  }
  return pids;
}

test("a wrong option: its error and one line on where help is, not the whole help", () => {
  const cwd = tempDir("mt-flag-");
  for (const [args, help] of [
    [["run", "--epochs", "x"], "meshtrain run --help"],
    [["mesh", "up", "--prot", "1"], "meshtrain mesh up --help"],
    [["submit", "--shards"], "meshtrain submit --help"],
  ] as const) {
    const r = cli(cwd, [...args]);
    const lines = r.err.trim().split("\n");
    expect([r.code, lines.at(-1)]).toEqual([
      1,
      expect.stringMatching(/^error: .* \(every option: meshtrain .* --help\)$/),
    ]);
    expect(lines.at(-1)).toEndWith(`(every option: ${help})`);
    expect(lines).toHaveLength(1); // the error, perhaps a "did you mean", the hint
  }
});

test("default job names differ even when two runs start in the same second", () => {
  expect(newJobName()).toMatch(/^mnist-\d{8}-\d{6}-[0-9a-f]{4}$/);
  expect(new Set(Array.from({ length: 50 }, newJobName)).size).toBe(50);
});

describe("meshtrain run", () => {
  test("3 trainers and 3 shards, relative --dir and --data-dir in the user's folder: the header first, then the result, and where everything went", () => {
    const cwd = tempDir("mt-run3-");
    mkdirSync(join(cwd, "mnist"));
    for (const f of [
      "train-images-idx3-ubyte",
      "train-labels-idx1-ubyte",
      "t10k-images-idx3-ubyte",
      "t10k-labels-idx1-ubyte",
    ])
      copyFileSync(join(defaultMnistDir(), f), join(cwd, "mnist", f));
    const r = cli(cwd, [
      "run",
      ...quick,
      "--trainers",
      "3",
      "--shards",
      "3",
      "--job",
      "three",
      "--dir",
      "out",
      "--data-dir",
      "mnist",
    ]);
    expect(r.err).toBe("");
    expect(r.code).toBe(0);
    const lines = r.out.trim().split("\n");
    expect(lines[0]).toBe(
      "meshtrain run: job default.three, on a local mesh of 3 trainers, 3 parameter-server shards, a data-loader and a checkpoint service",
    );
    expect(r.out).toContain(`data       MNIST from ${join(cwd, "mnist")}`);
    // the job's live page, among the opening lines (test/e2e/dashboard.test.ts opens one in a browser)
    expect(r.out).toMatch(/^ {2}dashboard {2}http:\/\/127\.0\.0\.1:\d+\/jobs\/default.three /m);
    const accuracy = Number(/^test accuracy: ([\d.]+)%/m.exec(r.out)![1]);
    expect(accuracy).toBeGreaterThan(80);
    expect(lines.slice(-4)).toEqual([
      "model:     out/jobs/default.three/model.mtm",
      "snapshots: out/jobs/default.three (step-000000020 is the final one)",
      "logs:      out/jobs/default.three/logs",
      "next:      npx meshtrain eval --model out/jobs/default.three/model.mtm",
    ]);
    for (const f of [
      "model.mtm",
      "step-000000020",
      "logs/trainer-2.log",
      "logs/parameter-server-2.log",
      "logs/job.json",
    ])
      expect(existsSync(join(cwd, "out/jobs/default.three", f))).toBe(true);
    // a clean run logs no warnings or errors (normal states, such as no snapshot yet, are not warnings)
    const logs = join(cwd, "out/jobs/default.three/logs");
    const warnings = readdirSync(logs)
      .filter((f) => f.endsWith(".log") && f !== "nats-server.log")
      .flatMap((f) =>
        readFileSync(join(logs, f), "utf8")
          .split("\n")
          .filter((l) => /"level":"(warn|error|fatal)"/.test(l))
          .map((l) => `${f}: ${l}`),
      );
    expect(warnings).toEqual([]);
    // the exported model is the one the trainers evaluated
    const ev = cli(cwd, ["eval", "--model", "out/jobs/default.three/model.mtm"]);
    expect(ev.code).toBe(0);
    expect(Number(/test accuracy: ([\d.]+)%/.exec(ev.out)![1])).toBe(accuracy);
  }, 120_000);

  test("a data folder that does not exist: one line naming the file, at once, and no job is started; nothing left running", () => {
    const cwd = tempDir("mt-runbad-");
    const r = cli(cwd, ["run", ...quick, "--job", "nodata", "--dir", "out", "--data-dir", "/nonexistent"]);
    expect(r.code).toBe(1);
    // the job's plan is made when it is submitted: the data-loader's refusal is the submission's
    expect(r.err.trim().split("\n")).toEqual([
      "meshtrain: ConfigError: the data-loader cannot plan job default.nodata: /nonexistent/train-images-idx3-ubyte: file not found (from mt.ctl.plan)",
    ]);
    expect(processesMentioning(cwd)).toEqual([]);
    // fixed (the package's data): the same name runs, with the settings it was started with and the new folder
    const again = cli(cwd, ["run", "--job", "nodata", "--dir", "out", "--data-dir", "", "--no-dashboard"]);
    expect(again.code).toBe(0);
    expect(again.out.split("\n")[0]).toStartWith(
      "meshtrain run: job default.nodata, started again with its settings (it has no snapshot)",
    );
    expect(again.out).not.toContain("dashboard  http"); // --no-dashboard
    expect(again.out).toContain("model      MLP 784-32-10");
    expect(again.out).toMatch(/^test accuracy: /m);
  }, 90_000);

  test("SIGINT to the run process alone: a snapshot, how to resume, nothing running or left behind; the resume finishes the job", async () => {
    const cwd = tempDir("mt-runint-");
    const tmp = join(cwd, "tmp");
    mkdirSync(tmp);
    // 938 steps of a small model: still training when the stop has taken its snapshot (snapshots do not slow it)
    const args = [
      "run",
      "--widths",
      "784,32,10",
      "--batch-size",
      "64",
      "--epochs",
      "2",
      "--checkpoint-every",
      "50",
      "--job",
      "stopme",
      "--dir",
      "out",
    ];
    // as npm start runs it: its script is `meshtrain run` already, so the resume line adds no `run`
    const run = start(cwd, args, { TMPDIR: tmp, npm_lifecycle_event: "start" });
    await waitFor("training to start", () => /^step \d+\/\d+/m.test(run.out()), 60_000);
    run.proc.kill("SIGINT");
    expect(await run.done).toBe(130);
    expect(run.out()).toContain("SIGINT: stopping job default.stopme: a snapshot first, then the mesh");
    expect(run.out()).toMatch(/snapshot taken: saved step-\d+/);
    expect(run.out()).toContain("Resume with: npm start -- --job default.stopme --dir out");
    expect(processesMentioning(cwd)).toEqual([]); // no nats-server, no service
    expect(readdirSync(tmp)).toEqual([]); // no mt-nats-* folder
    const resumed = cli(cwd, ["run", "--job", "stopme", "--dir", "out"]);
    expect(resumed.code, resumed.err + resumed.out).toBe(0);
    expect(resumed.out.split("\n")[0]).toMatch(/^meshtrain run: job default.stopme, resumed from step-\d+,/);
    expect(resumed.out).toContain("training   2 epochs, 2 trainers × 64 samples per step"); // the stopped run's settings
    expect(resumed.out).toMatch(/^test accuracy: /m);
    const again = cli(cwd, ["run", "--job", "stopme", "--dir", "out"]);
    expect(again.code).toBe(1);
    expect(again.err).toContain("job default.stopme finished (final snapshot step-000000938");
  }, 180_000);
});

describe("meshtrain mesh up and the client commands", () => {
  test("submit, status, watch, checkpoints, cancel, save, restore: each ends with an answer; a second mesh on the port is refused; a following submit stops at SIGTERM; Ctrl-C stops the mesh", async () => {
    const cwd = tempDir("mt-meshup-");
    const runtime = join(cwd, "runtime"); // where `mesh up` leaves its note for the client commands
    mkdirSync(runtime);
    const port = await freePort();
    const xdg = { XDG_RUNTIME_DIR: runtime };
    const up = start(
      cwd,
      ["mesh", "up", "--port", String(port), "--dir", "m", "--trainers", "2", "--shards", "2"],
      xdg,
    );
    await waitFor("the mesh to be up", () => up.out().includes("submit a job:"), 60_000);
    expect(up.out()).toContain(`mesh up: NATS at nats://127.0.0.1:${port}`);
    const c = (...args: string[]) => cli(cwd, args, xdg);

    const s = c("submit", ...quick, "--job", "j1");
    expect(s.err).toBe("");
    expect(s.out).toContain(`submitted job default.j1 to the mesh at nats://127.0.0.1:${port}`);
    expect(s.out).toMatch(/^test accuracy: [\d.]+%/m);
    expect(s.out).toContain("model:     m/jobs/default.j1/model.mtm");
    expect(s.out).toContain("logs:      m/jobs/default.j1/logs");

    const table = c("status");
    expect(table.out.split("\n")[0]).toMatch(/^job\s+state\s+accuracy\s+of steps/);
    expect(table.out).toMatch(/^default\.j1\s+done\s+\d+\.\d+%\s+30\s/m);
    expect(c("status", "--all").out).toMatch(/^default\.j1\s+done/m);
    expect(c("status", "j1").out).toMatch(/^state      done; submitted /m);
    const watched = c("watch", "j1");
    expect([watched.code, /^test accuracy: /m.test(watched.out)]).toEqual([0, true]);
    expect(c("checkpoints", "j1").out).toMatch(/^step-000000030  step 30 .* model .*model\.mtm$/m);

    const fails: [string[], string][] = [
      [["cancel", "nosuch"], "meshtrain: UnknownJobError: no job default.nosuch"],
      [["status", "a b"], 'meshtrain: BadRequestError: "a b" is not a job name'],
      [["watch", "j>"], "is not a job name"],
      [["cancel", "*"], "is not a job name"],
      [["save", "nosuch"], "meshtrain: UnknownJobError: no job default.nosuch"],
      [["status", "nosuch"], "meshtrain: UnknownJobError: no job default.nosuch"],
      [["watch", "nosuch"], "meshtrain: UnknownJobError: no job default.nosuch"],
      [["cancel", "j1"], "meshtrain: JobStateError: job default.j1 done at"],
      // another owner's job: the local mesh's client user is client-default
      [
        ["cancel", "bob.x"],
        "meshtrain: NatsAccessError: permission denied: this client's NATS user may not read the record of job bob.x",
      ],
      [["status", "--owner", "ctl"], 'meshtrain: BadRequestError: --owner: the owner "ctl" is reserved'],
      [["status", "j1", "--all"], "--all lists every owner's jobs: give no job with it"],
      [["restore", "j1"], "restore needs a running job"],
      [["submit", ...quick, "--job", "j1"], "give the new run another --job name"],
      [["submit", ...quick, "--job", "lr-0.01"], 'is job "01" of owner "lr-0" (a job is <owner>.<name>)'],
      [["submit", ...quick, "--trainers", "3"], "meshtrain mesh up --trainers 3 --shards 2"],
      [["mesh", "up", "--port", String(port), "--dir", "m2"], `meshtrain: NatsServerError: port ${port} is taken`],
      // its folder is the running mesh's (its NATS store, credentials, jobs), whatever the port
      [["mesh", "up", "--port", String(port), "--dir", "m"], "meshtrain: ConfigError: a mesh (pid "],
    ];
    for (const [args, fragment] of fails) {
      const r = c(...args);
      expect([args.join(" "), r.code, r.err.includes(fragment)]).toEqual([args.join(" "), 1, true]);
      expect(r.err.trim().split("\n")).toHaveLength(1);
    }

    const detached = c("submit", ...quick, "--epochs", "50", "--job", "j2", "--detach");
    expect(detached.out).toContain("follow it: npx meshtrain watch default.j2");
    const cancelled = c("cancel", "j2");
    expect(cancelled.out).toMatch(
      /^cancelled job default.j2 \(cancelled by .+\); resume it later: npx meshtrain submit --job default.j2$/m,
    );
    expect(c("status", "j2").out).toMatch(/^state      cancelled;/m);
    const w = c("watch", "j2");
    expect([w.code, w.err.trim()]).toEqual([
      1,
      expect.stringMatching(
        /^meshtrain: JobFailedError: job default.j2 cancelled: cancelled by .+ \(logs: m\/jobs\/default.j2\/logs\)$/,
      ),
    ]);

    // a submit that follows its job stops following at SIGTERM (128 + 15), the job trains on
    const follower = start(cwd, ["submit", ...quick, "--epochs", "50", "--job", "j3"], xdg);
    await waitFor("job j3 to train", () => /^step \d+\/\d+/m.test(follower.out()), 60_000);
    follower.proc.kill("SIGTERM");
    expect(await follower.done).toBe(143);
    expect(follower.out()).toContain(
      "stopped following job default.j3; it goes on training. Follow it again: npx meshtrain watch default.j3",
    );
    // a resize to the sizes it runs: refused at once, in the client
    const same = c("resize", "j3", "--trainers", "2");
    expect([same.code, same.err.trim()]).toEqual([
      1,
      "meshtrain: BadRequestError: job default.j3 runs 2 trainers and 2 shards already",
    ]);
    // a job still training when the mesh stops: it is named, with where it goes on
    up.proc.kill("SIGINT");
    expect(await up.done).toBe(0);
    expect(up.out()).toContain(
      "running jobs stopped with the mesh: default.j3; each resumes from its newest snapshot at the next `mesh up --dir m`",
    );
    expect(up.out()).toContain("mesh stopped");
    expect(existsSync(join(cwd, "m", "mesh.pid"))).toBe(false); // its folder is let go
    expect(readdirSync(join(runtime, readdirSync(runtime)[0]!))).toEqual([]); // its note is gone
    expect(processesMentioning(cwd)).toEqual([]);
    // no mesh now: a clear line that says how to start one
    const none = c("status");
    expect([none.code, none.err.includes("start a local mesh with: meshtrain mesh up")]).toEqual([1, true]);
  }, 240_000);
});
