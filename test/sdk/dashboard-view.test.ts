// The dashboard's view of a job (sdk/dashboard/view.ts), fed events and heartbeats by hand: its
// curves' rules (a restore cuts the loss curve back, a long curve is thinned), the evaluations
// combined over ranks, the per-rank step split, and each process's health as time passes.
import { describe, expect, test } from "bun:test";
import { emptyEvent, type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { type Heartbeat } from "../../schemas/messages/runtime.ts";
import { jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { runningRecord } from "../../services/runtime/job/ledger.ts";
import type { JobStatus } from "../../sdk/client.ts";
import { restartShownMs, seriesPointsMax, silentAfterMs } from "../../sdk/dashboard/limits.ts";
import { expectedProcesses, JobView, Series } from "../../sdk/dashboard/view.ts";
import { Dashboard } from "../../sdk/dashboard/server.ts";
import type { MeshClient } from "../../sdk/client.ts";
import { BadRequestError } from "../../services/runtime/mesh/errors.ts";

const cfg = parseJobConfig({ ...jobDefaults, job: "v", trainers: 2, shards: 1 });
const ev = (kind: EventKind, over: Partial<Event>): Event => ({ ...emptyEvent("v", kind), ...over });
const hb = (who: string, step: number, phase: string): Heartbeat => ({
  job: "v",
  who,
  step,
  phase,
  phaseMs: 0,
  stepMs: 0,
  host: "",
});
const row = (v: JobView, who: string, now: number) => v.panels(now).health.find((h) => h.who === who)!;
const status = (state: JobState): JobStatus => ({
  job: "v",
  record: { ...runningRecord("v", JSON.stringify(cfg), 1), state },
  config: cfg,
  shards: [
    {
      job: "v",
      shard: 0,
      chunks: 1,
      elements: 10,
      updates: 5,
      pushes: 10,
      duplicates: 0,
      pulls: 10,
      waiting: 0,
      clocks: [7, 5],
    },
  ],
  trainers: [],
  checkpoints: [],
});

describe("dashboard view", () => {
  test("a series cuts back to a repeated step (a restore) and halves past its limit, keeping its last point", () => {
    const s = new Series(2);
    for (let i = 0; i < 10; i++) s.add([i, i * 10]);
    s.add([4, -1]);
    expect(s.cols).toEqual([
      [0, 1, 2, 3, 4],
      [0, 10, 20, 30, -1],
    ]);
    const long = new Series(1);
    for (let i = 0; i <= seriesPointsMax; i++) long.add([i]);
    expect(long.length).toBe(seriesPointsMax / 2 + 1);
    expect(long.cols[0]!.at(-1)).toBe(seriesPointsMax);
  });

  test("rank 0's steps make the loss curve, every rank's its split row; evaluations are combined once every rank has reported", () => {
    const v = new JobView("v", "nats://x", cfg, 0);
    for (const rank of [0, 1])
      v.event(ev(EventKind.Step, { rank, step: 0, loss: 2 + rank, lr: 0.1, computeMs: 10 + rank, pullMs: 4 }), 1);
    v.event(ev(EventKind.Eval, { rank: 0, step: 0, loss: 1, accuracy: 0.5, count: 100, text: "test" }), 2);
    expect(v.appendsSince()).toEqual({ loss: [[0, 2, expect.closeTo(0.1, 6)]], evals: [], rate: [] });
    v.event(ev(EventKind.Eval, { rank: 1, step: 0, loss: 3, accuracy: 1, count: 100, text: "test" }), 3);
    expect(v.curves().evals).toEqual([[0, 2, 0.75]]);
    expect(v.appendsSince().loss).toEqual([]);
    const split = v.panels(4).split;
    expect(split.map((r) => [r.rank, r.computeMs, r.pullMs])).toEqual([
      [0, 10, 4],
      [1, 11, 4],
    ]);
    v.tick(1_000);
    expect(v.curves().rate).toHaveLength(1);
  });

  test("health: waiting, ok, silent after missed heartbeats, stalled and back, straggler, restarted, ended", () => {
    const v = new JobView("v", "nats://x", cfg, 0);
    expect(v.panels(0).health.map((h) => h.who)).toEqual(expectedProcesses(cfg));
    expect(row(v, "trainer 1", 0).state).toBe("waiting");
    v.heartbeat(hb("trainer 1", 3, "compute"), 1_000);
    expect(row(v, "trainer 1", 1_000)).toMatchObject({ level: "ok", step: 3, phase: "compute" });
    expect(row(v, "trainer 1", 1_000 + silentAfterMs)).toMatchObject({ level: "bad", state: "silent" });
    v.event(
      ev(EventKind.Stalled, {
        text: "trainer 1 has sent no heartbeat for 8 s (stopped, wedged or dead); it was at step 3, compute",
      }),
      9_000,
    );
    expect(row(v, "trainer 1", 9_000)).toMatchObject({ level: "bad", state: "stalled" });
    // a new process opens the job: a restart, heard again after its silence
    v.heartbeat(hb("trainer 1", 0, "starting"), 12_000);
    v.event(ev(EventKind.Stalled, { text: "trainer 1 is back after 11 s of silence (step 0, starting)" }), 12_000);
    expect(row(v, "trainer 1", 12_000)).toMatchObject({
      level: "bad",
      state: "restarted",
      restarts: 1,
      note: "opened the job again 0 s ago; it was at step 3, compute",
    });
    v.heartbeat(hb("trainer 1", 1, "compute"), 12_000 + restartShownMs);
    expect(row(v, "trainer 1", 12_000 + restartShownMs)).toMatchObject({ level: "ok", restarts: 1 });
    v.event(
      ev(EventKind.Straggler, { text: "trainer 1 is a straggler: its own time per step is 2.0x the other ranks'" }),
      72_500,
    );
    expect(row(v, "trainer 1", 72_500).state).toBe("straggler");
    v.event(ev(EventKind.Straggler, { text: "trainer 1 is no longer a straggler (1.0x the other ranks')" }), 73_000);
    expect(row(v, "trainer 1", 73_000).state).toBe("ok");
    expect(v.panels(73_000).log.map((l) => `${l.level}: ${l.text.split(" ").slice(0, 6).join(" ")}`)).toEqual([
      "bad: stalled: trainer 1 has sent no",
      "bad: trainer 1 opened the job again",
      "warn: trainer 1 is heard again after",
      "warn: back: trainer 1 is back after",
      "warn: trainer 1 is heard again after",
      "warn: straggler: trainer 1 is a straggler:",
      "ok: straggler: trainer 1 is no longer",
    ]);
    v.status(status(JobState.Done));
    expect(v.panels(200_000).health.every((h) => h.level === "idle")).toBe(true);
    expect(v.panels(200_000).shards).toEqual([
      { shard: 0, clocks: [7, 5], staleness: 2, updates: 5, waiting: 0, error: "" },
    ]);
  });

  test("a resize reopens the job on every process: no restart, whether their heartbeats come before or after the resize's Log event", () => {
    const v = new JobView("v", "nats://x", cfg, 0);
    for (const who of ["trainer 0", "trainer 1"]) v.heartbeat(hb(who, 40, "compute"), 1_000);
    v.heartbeat(hb("trainer 0", 0, "starting"), 3_000);
    expect(row(v, "trainer 0", 3_000)).toMatchObject({ state: "restarted", restarts: 1 });
    v.event(
      ev(EventKind.Log, {
        text: "resized from step 40 (step-000000040): trainers 2 -> 3, shards 1 -> 1; 700 steps in all",
      }),
      3_500,
    );
    v.heartbeat(hb("trainer 1", 0, "starting"), 4_000);
    for (const who of ["trainer 0", "trainer 1"])
      expect(row(v, who, 4_000)).toMatchObject({ level: "ok", restarts: 0 });
  });

  test("a job followed before it has a record learns its processes from its first status", () => {
    const v = new JobView("v", "nats://x", null, 0);
    expect(v.panels(0)).toMatchObject({ state: "waiting", health: [], config: [] });
    v.status(status(JobState.Running));
    expect(v.panels(0).state).toBe("running");
    expect(v.panels(0).health.map((h) => h.who)).toEqual(["trainer 0", "trainer 1", "shard 0", "data-loader"]);
  });
});

test("a dashboard that cannot listen where asked says so in one typed line: a port in use, an address not this machine's", () => {
  using taken = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: () => new Response("") });
  const client = {} as MeshClient; // not reached: the listen fails first
  for (const [host, port] of [
    ["127.0.0.1", taken.port!],
    ["256.1.1.1", 0],
  ] as const) {
    const e = (() => {
      try {
        Dashboard.start({ client, host, port });
      } catch (x) {
        return x as Error;
      }
    })();
    expect(e, host).toBeInstanceOf(BadRequestError);
    expect(e!.message, host).toStartWith(`the dashboard cannot listen on ${host}:${port} (E`);
    expect(e!.message, host).toEndWith(
      "its port is in use, or the host is not an address of this machine); pick another port or host",
    );
  }
});
