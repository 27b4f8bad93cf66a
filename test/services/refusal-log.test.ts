// A service's refusals in its log: the first few of each handler's window one by one, the rest
// counted and said in one line when the window ends; answers ("no such job", "busy") at debug only.
import { expect, test } from "bun:test";
import pino from "pino";
import {
  BadRequestError,
  CapacityError,
  NoRespondersError,
  UnknownJobError,
} from "../../services/runtime/mesh/errors.ts";
import { RefusalLog } from "../../services/runtime/mesh/refusal-log.ts";

function capture() {
  const lines: Record<string, unknown>[] = [];
  const log = pino({ level: "debug" }, { write: (line: string) => void lines.push(JSON.parse(line)) });
  return { lines, log };
}

test("a storm of refusals: 3 lines a window for each handler, then one line with the count and the last reason", async () => {
  const { lines, log } = capture();
  const r = new RefusalLog(log, 3, 150);
  for (let i = 0; i < 50; i++) r.note("coll.j.0.*", `coll.j.0.${i % 4}`, new BadRequestError(`bad piece ${i}`));
  r.note("ps.j.push", "ps.j.push", new BadRequestError("older generation"));
  expect(lines.filter((l) => l.msg === "request refused").map((l) => l.err)).toEqual([
    "bad piece 0",
    "bad piece 1",
    "bad piece 2",
    "older generation",
  ]);
  await Bun.sleep(300);
  const summary = lines.filter((l) => l.refused !== undefined);
  expect(summary).toEqual([
    expect.objectContaining({
      level: 40,
      handler: "coll.j.0.*",
      refused: 47,
      last: { subject: "coll.j.0.1", err: "bad piece 49" },
    }),
  ]);
  // a new window logs again
  r.note("coll.j.0.*", "coll.j.0.2", new Error("does not decode"));
  expect(lines.at(-1)).toMatchObject({ msg: "request refused", err: "does not decode", subject: "coll.j.0.2" });
  r.close();
});

test("answers are not refusals: unknown job, busy and a run that ended go to debug, uncounted", () => {
  const { lines, log } = capture();
  const r = new RefusalLog(log, 1, 60_000);
  for (let i = 0; i < 10; i++) {
    r.note("h", "s", new CapacityError("busy"));
    r.note("h", "s", new UnknownJobError("no job"));
    r.note("h", "s", new NoRespondersError("trainer 0 no longer runs job default.j"));
  }
  expect(lines.every((l) => l.level === 20)).toBe(true);
  expect(lines).toHaveLength(30);
  r.note("h", "s", new BadRequestError("x"));
  expect(lines.at(-1)).toMatchObject({ level: 40, msg: "request refused" });
  r.close();
  expect(lines).toHaveLength(31); // nothing was held back: no summary
});
