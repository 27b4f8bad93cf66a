// Heartbeats and the liveness monitor (services/runtime/control/liveness.ts) over an in-memory bus with
// a hand-moved clock: silence past the bound is one Stalled event naming the process and what it
// was doing; its return is another; hostile heartbeats are ignored.
import { describe, expect, test } from "bun:test";
import { decodeEvent, type Event, EventKind } from "../../schemas/messages/job.ts";
import { decodeHeartbeat, encodeHeartbeat } from "../../schemas/messages/runtime.ts";
import { MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { subjects } from "../../services/runtime/job/subjects.ts";
import {
  HeartbeatPublisher,
  LivenessMonitor,
  type LostHost,
  StragglerDetector,
  stalledHost,
  stalledTrainer,
} from "../../services/runtime/control/liveness.ts";

test("a publisher says its step and phase; the monitor reports silence once, then the return", () => {
  const bus = new MemoryBus();
  let now = 1_000_000;
  const events: Event[] = [];
  bus.subscribe(subjects.events("j", "stalled"), (d) => events.push(decodeEvent(d, 1 << 16)));
  const seen: string[] = [];
  bus.subscribe(subjects.heartbeats("j"), (d, subject) => seen.push(`${subject} ${decodeHeartbeat(d, 4096).phase}`));
  const monitor = new LivenessMonitor(bus, "j", 8_000, () => now);
  const hb = new HeartbeatPublisher(bus, "j", "trainer 1", "host-a", 60_000);
  hb.at(57, "pull");
  hb.publish();
  expect(seen).toEqual(["mt.j.hb.trainer-1 starting", "mt.j.hb.trainer-1 pull"]);
  now += 7_999;
  monitor.check();
  expect(events).toEqual([]);
  now += 2_001;
  monitor.check();
  monitor.check(); // once
  expect(events.map((e) => [e.kind, e.step, e.text])).toEqual([
    [
      EventKind.Stalled,
      57,
      "trainer 1 has sent no heartbeat for 10 s (stopped, wedged or dead); it was at step 57, pull",
    ],
  ]);
  expect(monitor.stalled.map((h) => h.who)).toEqual(["trainer 1"]);
  now += 5_000;
  hb.at(58, "compute");
  hb.publish();
  expect(events.at(-1)!.text).toBe("trainer 1 is back after 15 s of silence (step 58, compute)");
  expect(monitor.stalled).toEqual([]);
  hb.stop();
  monitor.close();
});

test("a host whose every sender went quiet while others speak is named once with its ranks, and again when it is heard", () => {
  const bus = new MemoryBus();
  let now = 0;
  const events: string[] = [];
  bus.subscribe(subjects.events("j", "stalled"), (d) => events.push(decodeEvent(d, 1 << 16).text));
  const monitor = new LivenessMonitor(bus, "j", 8_000, () => now);
  const senders = [
    new HeartbeatPublisher(bus, "j", "trainer 0", "host-1", 60_000),
    new HeartbeatPublisher(bus, "j", "trainer 10", "host-2", 60_000),
    new HeartbeatPublisher(bus, "j", "trainer 2", "host-2", 60_000),
    new HeartbeatPublisher(bus, "j", "shard 1", "host-2", 60_000),
  ];
  const [t0, t10, t2, s1] = senders as [HeartbeatPublisher, HeartbeatPublisher, HeartbeatPublisher, HeartbeatPublisher];
  // host-2's senders go quiet one after another; host-1's keeps speaking
  now = 3_000;
  t2.publish();
  s1.publish();
  t0.publish();
  now = 8_500;
  t0.publish();
  monitor.check();
  // trainer 10 alone is silent: a rank, not yet its host
  expect(events).toEqual([
    "trainer 10 has sent no heartbeat for 9 s (stopped, wedged or dead); it was at step 0, starting",
  ]);
  now = 11_000;
  t0.publish();
  monitor.check();
  monitor.check(); // once
  expect(events.slice(1)).toEqual([
    "trainer 2 has sent no heartbeat for 8 s (stopped, wedged or dead); it was at step 0, starting",
    "shard 1 has sent no heartbeat for 8 s (stopped, wedged or dead); it was at step 0, starting",
    "host host-2 is cut off or down: shard 1, trainer 2, trainer 10 silent for 8 s",
  ]);
  expect(stalledHost(events.at(-1)!)).toBe("host-2");
  expect(stalledTrainer(events.at(-1)!)).toBeNull();
  expect(monitor.quietHosts).toEqual(["host-2"]);
  now = 20_000;
  t2.at(5, "pull");
  t2.publish();
  expect(events.slice(-2)).toEqual([
    "trainer 2 is back after 17 s of silence (step 5, pull)",
    "host host-2 is heard again (trainer 2 first, at step 5)",
  ]);
  expect(stalledHost(events.at(-1)!)).toBeNull();
  expect(monitor.quietHosts).toEqual([]);
  for (const p of senders) p.stop();
  monitor.close();
});

test("a host silent for the lost bound is handed over once with its senders, again only after it was heard and went quiet again", () => {
  const bus = new MemoryBus();
  let now = 0;
  const handed: LostHost[] = [];
  const monitor = new LivenessMonitor(bus, "j", 8_000, () => now, { afterMs: 10_000, hand: (h) => handed.push(h) });
  const [t0, t2, s1] = [
    new HeartbeatPublisher(bus, "j", "trainer 0", "host-1", 60_000),
    new HeartbeatPublisher(bus, "j", "trainer 2", "host-2", 60_000),
    new HeartbeatPublisher(bus, "j", "shard 1", "host-2", 60_000),
  ] as const;
  const at = (ms: number) => {
    now = ms;
    t0.publish(); // host-1 keeps speaking
    monitor.check();
  };
  at(9_000); // host-2 named quiet, not yet lost
  expect(monitor.quietHosts).toEqual(["host-2"]);
  expect(handed).toEqual([]);
  at(10_000);
  at(10_500);
  expect(handed).toEqual([{ host: "host-2", who: ["shard 1", "trainer 2"], silentMs: 10_000 }]);
  // heard, then quiet again: handed again
  now = 11_000;
  t2.publish();
  s1.publish();
  at(21_000);
  expect(handed.map((h) => [h.host, h.silentMs])).toEqual([
    ["host-2", 10_000],
    ["host-2", 10_000],
  ]);
  for (const p of [t0, t2, s1]) p.stop();
  monitor.close();
});

test("when every sender is silent, no host is named: it is the watcher that is cut off", () => {
  const bus = new MemoryBus();
  let now = 0;
  const events: string[] = [];
  bus.subscribe(subjects.events("j", "stalled"), (d) => events.push(decodeEvent(d, 1 << 16).text));
  const monitor = new LivenessMonitor(bus, "j", 8_000, () => now);
  const senders = ["host-1", "host-2"].map((h, i) => new HeartbeatPublisher(bus, "j", `trainer ${i}`, h, 60_000));
  now = 9_000;
  monitor.check();
  expect(events.filter((t) => t.startsWith("host "))).toEqual([]);
  expect(events).toHaveLength(2);
  for (const p of senders) p.stop();
  monitor.close();
});

test("heartbeats of another job, oversized names or garbage change nothing", () => {
  const bus = new MemoryBus();
  let now = 0;
  const events: Event[] = [];
  bus.subscribe(subjects.events("j", "stalled"), (d) => events.push(decodeEvent(d, 1 << 16)));
  const monitor = new LivenessMonitor(bus, "j", 8_000, () => now);
  bus.publish("mt.j.hb.x", crypto.getRandomValues(new Uint8Array(64)));
  bus.publish(
    "mt.j.hb.y",
    encodeHeartbeat({ job: "other", who: "trainer 0", step: 1, phase: "pull", phaseMs: 0, stepMs: 0, host: "" }),
  );
  bus.publish(
    "mt.j.hb.z",
    encodeHeartbeat({ job: "j", who: "x".repeat(100), step: 1, phase: "pull", phaseMs: 0, stepMs: 0, host: "" }),
  );
  now += 60_000;
  monitor.check();
  expect(events).toEqual([]);
  monitor.close();
});

describe("StragglerDetector", () => {
  const step = (rank: number, s: number, compute: number) => ({
    rank,
    step: s,
    dataWaitMs: 1,
    computeMs: compute,
    pushMs: 1,
  });

  test("a rank whose own time per step is 1.5x the others' over 20 steps is named once with its split; its recovery too", () => {
    const said: [number, string][] = [];
    const d = new StragglerDetector(2, (s, text) => said.push([s, text]));
    for (let s = 0; s < 19; s++)
      for (const [rank, c] of [
        [0, 8],
        [1, 40],
      ] as const)
        d.add(step(rank, s, c));
    expect(said).toEqual([]); // not 20 steps of every rank yet
    for (let s = 19; s < 30; s++)
      for (const [rank, c] of [
        [0, 8],
        [1, 40],
      ] as const)
        d.add(step(rank, s, c));
    expect(said).toEqual([
      [
        19,
        "trainer 1 is a straggler: its own time per step is 4.2x the other ranks' over the last 20 steps (data 1.0 ms, compute 40.0 ms, push 1.0 ms; the others: data 1.0 ms, compute 8.0 ms, push 1.0 ms)",
      ],
    ]);
    for (let s = 30; s < 60; s++) for (const rank of [0, 1]) d.add(step(rank, s, 8));
    expect(said.at(-1)![1]).toBe("trainer 1 is no longer a straggler (1.0x the other ranks')");
    expect(said.length).toBe(2);
  });

  test("one rank, equal ranks, or hostile numbers: nothing is said", () => {
    const said: string[] = [];
    const one = new StragglerDetector(1, (_, t) => said.push(t));
    for (let s = 0; s < 40; s++) one.add(step(0, s, 50));
    const even = new StragglerDetector(3, (_, t) => said.push(t));
    for (let s = 0; s < 40; s++) for (const rank of [0, 1, 2]) even.add(step(rank, s, 10 + (s % 3)));
    for (const bad of [step(7, 0, 1e9), { ...step(1, 0, 1), computeMs: Number.NaN }, { ...step(1, 0, 1), pushMs: -5 }])
      even.add(bad);
    expect(said).toEqual([]);
  });
});
