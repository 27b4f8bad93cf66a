// The NATS bus against a real nats-server: an answer too large for a message and an error text
// with line breaks both reach the caller as typed errors, and the serving side keeps serving.
import { afterAll, expect, test } from "bun:test";
import {
  BadRequestError,
  CapacityError,
  DeadlineError,
  LimitExceededError,
} from "../../services/runtime/mesh/errors.ts";
import { subjects } from "../../services/runtime/job/subjects.ts";
import { CollectiveStandIn } from "../../services/trainer/replica.ts";
import { closeDrainMsMax, NatsBus } from "../../services/runtime/mesh/nats.ts";
import { reconnectedSubject, subjectMatches } from "../../services/runtime/mesh/bus.ts";
import { encodeReconnected } from "../../schemas/messages/runtime.ts";
import { expectRejected } from "../helpers/errors.ts";
import { clientBus, startNatsServer } from "../helpers/mesh.ts";

const maxPayloadBytes = 64 << 10;
const server = await startNatsServer({ maxPayloadBytes });
const serving = await NatsBus.connect({
  url: server.url,
  name: "test-serving",
  service: { name: "bus-test", version: "0.0.1" },
  connectRetryMsMax: 5_000,
  connectBackoffMsMax: 500,
});
const client = await clientBus(server.url);

afterAll(async () => {
  await client.close();
  await serving.close();
  await server.stop();
});

const handler = async (data: Uint8Array) => {
  const ask = new TextDecoder().decode(data);
  if (ask === "big") return new Uint8Array(maxPayloadBytes + 1);
  if (ask === "lines") throw new BadRequestError("job a\r\nb is not\nhere");
  return new TextEncoder().encode(`ok ${ask}`);
};
serving.handle("t.handle", handler);
serving.serve({ name: "served", subject: "t.serve", handler });
// the subscriptions reach the server before the first request (another connection sends it)
await serving.nc.flush();

for (const subject of ["t.handle", "t.serve"]) {
  test(`${subject}: an answer over max_payload is a LimitExceededError naming the sizes; the next request is answered`, async () => {
    await expectRejected(
      () => client.request(subject, new TextEncoder().encode("big"), 5_000),
      LimitExceededError,
      `${maxPayloadBytes + 1} bytes`,
    );
    expect(new TextDecoder().decode(await client.request(subject, new TextEncoder().encode("x"), 5_000))).toBe("ok x");
  });

  test(`${subject}: an error text with CR/LF comes back whole as its type`, async () => {
    await expectRejected(
      () => client.request(subject, new TextEncoder().encode("lines"), 5_000),
      BadRequestError,
      "is not\nhere",
    );
    expect(new TextDecoder().decode(await client.request(subject, new TextEncoder().encode("y"), 5_000))).toBe("ok y");
  });
}

test("a request waiting when the server dies fails at once with a DeadlineError saying so, not at its timeout", async () => {
  const other = await startNatsServer();
  const quiet = await NatsBus.connect({
    url: other.url,
    name: "test-quiet",
    connectRetryMsMax: 5_000,
    connectBackoffMsMax: 500,
  });
  quiet.subscribe("t.never", () => {}); // takes the request, never answers
  const asker = await NatsBus.connect({
    url: other.url,
    name: "test-asker",
    connectRetryMsMax: 5_000,
    connectBackoffMsMax: 500,
  });
  await quiet.nc.flush();
  const waiting = asker.request("t.never", new Uint8Array(1), 60_000);
  waiting.catch(() => {}); // it may fail while the server is still stopping, before it is awaited below
  await Bun.sleep(200);
  await other.stop();
  await expectRejected(
    () => waiting,
    DeadlineError,
    "the connection to NATS dropped while waiting for the answer on t.never",
  );
  await Promise.allSettled([asker.nc.close(), quiet.nc.close()]);
}, 20_000); // the request's own timeout is 60 s: only the drop ends it within the test's 20 s

test("a request waiting on a process that says it reconnected is failed at once (asked again), not at its timeout; a notice of other subjects, an oversized one, or garbage changes nothing", async () => {
  const quiet = await NatsBus.connect({
    url: server.url,
    name: "test-quiet-2",
    connectRetryMsMax: 5_000,
    connectBackoffMsMax: 500,
  });
  quiet.handle("t.quiet.*", () => new Promise<Uint8Array>(() => {})); // takes the request, never answers
  await quiet.nc.flush();
  const t0 = performance.now();
  const waiting = client.request("t.quiet.1", new Uint8Array(1), 60_000);
  waiting.catch(() => {});
  let settled = false;
  void waiting.then(
    () => (settled = true),
    () => (settled = true),
  );
  await Bun.sleep(100);
  const notice = (who: string, subjects: string[]) => encodeReconnected({ who, subjects });
  client.nc.publish(reconnectedSubject, notice("parameter-server-9 x", ["t.other.>", "mt.*.*.ps.9.>"]));
  client.nc.publish(reconnectedSubject, crypto.getRandomValues(new Uint8Array(40)));
  client.nc.publish(
    reconnectedSubject,
    notice(
      "x",
      Array.from({ length: 300 }, () => "t.quiet.*"),
    ),
  );
  await client.nc.flush();
  await Bun.sleep(200);
  expect(settled).toBe(false);
  // the process that answers t.quiet.* says its connection came back
  serving.nc.publish(reconnectedSubject, notice("test-quiet-2 abcd", ["t.quiet.*"]));
  await expectRejected(
    () => waiting,
    DeadlineError,
    "a process that answers t.quiet.1 (test-quiet-2 abcd) reconnected to NATS while waiting for the answer on t.quiet.1; retry",
  );
  expect(performance.now() - t0).toBeLessThan(30_000);
  expect(subjectMatches("mt.*.*.ps.1.>", "mt.a.b.ps.1.pull.3")).toBe(true);
  expect(subjectMatches("mt.*.*.ps.1.>", "mt.a.b.ps.1")).toBe(false);
  expect(subjectMatches("mt.*.*.data.next", "mt.a.b.data.next")).toBe(true);
  expect(subjectMatches("mt.*.*.data.next", "mt.a.b.data.next.x")).toBe(false);
  await quiet.close();
}, 20_000);

test("a request asked again every reaskMs: the first answer wins (a lost first ask costs reaskMs, not the timeout); with no answer at all it times out once, at its timeout", async () => {
  let asked = 0;
  serving.handle("t.reask", () => {
    asked++;
    // the first ask is lost (as one routed to a server cut off); the second is answered
    return asked === 1 ? new Promise<Uint8Array>(() => {}) : new TextEncoder().encode(`answer ${asked}`);
  });
  serving.handle("t.reask.never", () => new Promise<Uint8Array>(() => {}));
  await serving.nc.flush();
  const t0 = performance.now();
  const got = await client.request("t.reask", new Uint8Array(1), 10_000, { reaskMs: 300 });
  expect(new TextDecoder().decode(got)).toBe("answer 2");
  expect(performance.now() - t0).toBeLessThan(5_000);
  const t1 = performance.now();
  await expectRejected(
    () => client.request("t.reask.never", new Uint8Array(1), 1_000, { reaskMs: 300 }),
    DeadlineError,
    "no reply on t.reask.never within 1000 ms",
  );
  expect(performance.now() - t1).toBeGreaterThan(900);
}, 20_000);

test("reaskFirstMs: the first ask again comes that soon, each next after twice the wait before, at most reaskMs", async () => {
  const at: number[] = [];
  serving.handle("t.reask.first", () => {
    at.push(performance.now());
    // answered at the fifth ask
    return at.length < 5 ? new Promise<Uint8Array>(() => {}) : new TextEncoder().encode("fifth");
  });
  await serving.nc.flush();
  const t0 = performance.now();
  const got = await client.request("t.reask.first", new Uint8Array(1), 10_000, { reaskMs: 500, reaskFirstMs: 100 });
  expect(new TextDecoder().decode(got)).toBe("fifth");
  // asks at about 0, 100, 300 (+200), 700 (+400), 1200 (+500: the bound) ms
  const gaps = at.map((t, i) => t - (i === 0 ? t0 : at[i - 1]!));
  const want = [0, 100, 200, 400, 500];
  for (let i = 1; i < 5; i++) {
    expect(gaps[i]!).toBeGreaterThan(want[i]! - 20);
    expect(gaps[i]!).toBeLessThan(want[i]! + 1_500); // a loaded machine's timers run late, never early
  }
}, 20_000);

test("a process that asks once and closes its bus exits then: close() leaves no timer behind (a client command took the drain's 10 s bound every time)", async () => {
  const script = `
    import { NatsBus } from ${JSON.stringify(`${import.meta.dir}/../../services/runtime/mesh/nats.ts`)};
    const bus = await NatsBus.connect({ url: ${JSON.stringify(server.url)}, name: "test-once", connectRetryMsMax: 5000, connectBackoffMsMax: 500 });
    console.log(new TextDecoder().decode(await bus.request("t.handle", new TextEncoder().encode("once"), 5000)));
    await bus.close();
    console.log("closed");
  `;
  const t0 = performance.now();
  const child = Bun.spawn([process.execPath, "-e", script], { stdout: "pipe", stderr: "pipe" });
  const killer = setTimeout(() => child.kill("SIGKILL"), 3 * closeDrainMsMax);
  const [code, out] = await Promise.all([child.exited, new Response(child.stdout).text()]);
  clearTimeout(killer);
  const ms = performance.now() - t0;
  expect([code, out.trim().split("\n")]).toEqual([0, ["ok once", "closed"]]);
  // a bound, not a speed: the whole process, start-up included, against the drain's wait alone
  expect(ms).toBeLessThan(closeDrainMsMax);
}, 40_000);

test("a restore's collective stand-in hands its subject to the next generation's transport without dropping a piece: every piece sent across the switch is answered (retry or taken), none waits out its timeout", async () => {
  const job = "default.standin";
  const subject = subjects.collTo(job, 0);
  const standIn = new CollectiveStandIn(serving, job, 0);
  standIn.hold();
  await serving.nc.flush();
  // a sender keeps pieces in flight, retrying a refused one at once, as collective-bus.ts does
  let taken = 0,
    refused = 0;
  const lost: string[] = [];
  let sending = true;
  const sender = async () => {
    while (sending) {
      try {
        await client.request(subjects.coll(job, 0, 1), new Uint8Array(8), 2_000);
        taken++;
      } catch (e) {
        if (e instanceof CapacityError) refused++;
        else lost.push(`${(e as Error).name}: ${(e as Error).message}`);
      }
    }
  };
  const senders = Array.from({ length: 16 }, sender);
  await Bun.sleep(100);
  // the restore's reconnect: the stand-in released and the new transport subscribed in one turn
  standIn.release();
  const next = serving.handle(subject, () => new Uint8Array(0));
  await Bun.sleep(300);
  sending = false;
  await Promise.all(senders);
  next.unsubscribe();
  expect({ lost, refusedSome: refused > 0, takenSome: taken > 0 }).toEqual({
    lost: [],
    refusedSome: true,
    takenSome: true,
  });
});

test("the subjects a process answers (its reconnect notice's) are counted per subscription: a drained one is let go, one subscribed twice stays while either does, and runs that come and go leave none behind", async () => {
  const subject = "mt.default.answers.trainer.0.stats";
  const before = serving.answeredSubjects.length;
  // a stand-in drained as the next transport subscribes the same subject: it is still answered
  const standIn = serving.handle(subject, () => new Uint8Array(0));
  const next = serving.handle(subject, () => new Uint8Array(0));
  standIn.drain!();
  standIn.drain!(); // twice, or unsubscribed after: counted once
  standIn.unsubscribe();
  expect(serving.answeredSubjects).toContain(subject);
  next.unsubscribe();
  expect(serving.answeredSubjects).not.toContain(subject);
  // a long-lived trainer's runs: each subscribes its subjects, and drains them when it ends
  for (let run = 0; run < 50; run++)
    serving.handle(`mt.default.run${run}.trainer.0.stats`, () => new Uint8Array(0)).drain!();
  expect(serving.answeredSubjects.length).toBe(before);
});
