// The job store's retry of a KV operation (ledger.ts untilLed): JetStream electing a leader is
// waited out; a store that does not answer for the whole wait (the mesh's NATS server is gone) is
// a typed error naming what could not be done, not nats.js's bare "TimeoutError: timeout" with
// its stack (seen in `meshtrain watch` when its mesh was killed).
import { expect, test } from "bun:test";
import { JetStreamUnavailableError, NatsUnreachableError } from "../../services/runtime/mesh/errors.ts";
import { readAgain, untilLed } from "../../services/runtime/job/ledger.ts";

/** What nats.js rejects a request with when no answer comes. */
const natsTimeout = () => Object.assign(new Error("timeout"), { name: "TimeoutError" });

test("a store that answers after a few timeouts is waited for", async () => {
  let calls = 0;
  const v = await untilLed(
    async () => {
      if (++calls < 3) throw natsTimeout();
      return 7;
    },
    readAgain,
    "read the record of job default.a",
    5_000,
  );
  expect([v, calls]).toEqual([7, 3]);
});

test("a store that never answers: JetStreamUnavailableError naming the operation, after the wait", async () => {
  const t0 = performance.now();
  const e = (await untilLed(
    () => Promise.reject(natsTimeout()),
    readAgain,
    "read the record of job default.a",
    300,
  ).catch((x) => x)) as Error;
  expect(e).toBeInstanceOf(JetStreamUnavailableError);
  expect(e.message).toStartWith(
    "cannot read the record of job default.a: the job store (NATS JetStream) did not answer for ",
  );
  expect(e.message).toContain("(timeout); is the mesh up? (meshtrain status)");
  expect(performance.now() - t0).toBeGreaterThanOrEqual(300);
});

test("an error no wait mends is thrown at once, as it is", async () => {
  const other = new Error("wrong last sequence: 4");
  let calls = 0;
  const e = await untilLed(
    () => {
      calls++;
      return Promise.reject(other);
    },
    readAgain,
    "delete the spec of job default.a",
    5_000,
  ).catch((x) => x);
  expect([e, calls]).toEqual([other, 1]);
});

test("a client that lost its server longer than its bound: NatsUnreachableError at the next failure, not after the leader wait", async () => {
  let away = 0,
    asks = 0;
  const e = (await untilLed(
    async () => {
      asks++;
      away += 3_000; // each failed ask, the client has been away longer
      throw natsTimeout();
    },
    readAgain,
    "read the record of job default.a",
    60_000,
    { ms: () => away, max: 8_000, server: "127.0.0.1:4333" },
  ).catch((x) => x)) as Error;
  expect(e).toBeInstanceOf(NatsUnreachableError);
  expect(e.message).toBe(
    "cannot read the record of job default.a: lost the NATS server at 127.0.0.1:4333 9 s ago, and none answers since; is the mesh up? (meshtrain mesh up)",
  );
  expect(asks).toBe(3); // given up at the first failure past the bound, not after the minute's wait
});
