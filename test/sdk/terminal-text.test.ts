// What the CLI prints from a message stays on its line: a CR/LF, an ESC or a bidirectional
// override in an event's text, a record's reason or a snapshot's id is shown escaped, never acted
// on (a forged restore tag used to print "restored: ... (a⏎b⏎FAKE LOG LINE)" as three lines).
import { afterAll, afterEach, describe, expect, spyOn, test } from "bun:test";
import { type Event, EventKind, emptyEvent, JobState } from "../../schemas/messages/job.ts";
import { type Manifest } from "../../schemas/messages/checkpoint.ts";
import { runningRecord } from "../../services/runtime/job/ledger.ts";
import { printable } from "../../sdk/format.ts";
import { jobsTable, outcomeLines, statusLines } from "../../sdk/report.ts";
import { Command } from "commander";
import { type JobFlags, jobConfigOf, jobOptions } from "../../sdk/cli/job-options.ts";
import { Watcher } from "../../sdk/watch.ts";

const forged = "a\nb\r\nFAKE LOG LINE\x1b[2K\u202eevil\u2028more";
/** No character a terminal acts on (the escapes printable writes are plain text). */
const oneLine = /^[^\u0000-\u001f\u007f-\u009f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]*$/;

function event(kind: EventKind, text: string): Event {
  return { ...emptyEvent("default.j", kind), step: 6, text };
}

let printed: string[] = [];
const spy = spyOn(console, "log").mockImplementation((...args: unknown[]) => {
  printed.push(args.map(String).join(" "));
});
afterEach(() => {
  printed = [];
});

describe("text from the mesh, printed", () => {
  test("printable: each control character, separator and override becomes its escape; other text is kept", () => {
    expect(printable(forged)).toBe("a\\nb\\r\\nFAKE LOG LINE\\x1b[2K\\u202eevil\\u2028more");
    expect(printable("plain text, é ü 中文 — kept")).toBe("plain text, é ü 中文 — kept");
    expect(printable("\t\x00\x7f\x9b")).toBe("\\t\\x00\\x7f\\x9b");
  });

  test("a watch prints each event's text on one line: restore, log, failed, stalled, straggler", () => {
    const w = new Watcher(1, 1, {}, "samples");
    for (const kind of [EventKind.Restore, EventKind.Log, EventKind.Failed, EventKind.Stalled, EventKind.Straggler])
      w.handle(event(kind, `restored step-000000006 (${forged})`), 10);
    expect(printed).toHaveLength(5);
    for (const line of printed) {
      expect(line).toMatch(oneLine);
      expect(line).toContain("(a\\nb\\r\\nFAKE LOG LINE\\x1b[2K\\u202eevil\\u2028more)");
    }
    expect(printed[0]).toBe(
      "restored step-000000006 (a\\nb\\r\\nFAKE LOG LINE\\x1b[2K\\u202eevil\\u2028more); resuming at step 6",
    );
  });

  test("an evaluation's line names its epoch where the epochs set the steps, not where --max-steps cut the run", () => {
    const evaluation = (step: number): Event => ({
      ...emptyEvent("default.j", EventKind.Eval),
      step,
      rank: 0,
      loss: 0.5,
      accuracy: 0.9,
      count: 100,
      text: "test",
    });
    // 10 epochs of 100 steps
    new Watcher(1, 10, {}, "samples").handle(evaluation(500), 1000);
    // --max-steps 30: step 15 is in the first epoch, not the fifth
    new Watcher(1, 10, {}, "samples", 30).handle(evaluation(15), 30);
    expect(printed).toEqual([
      "step 500 (epoch 5/10): test loss 0.5000, accuracy 90.00% (100 samples over 1 trainer)",
      "step 15: test loss 0.5000, accuracy 90.00% (100 samples over 1 trainer)",
    ]);
  });

  test("status, outcome and the jobs table: a record's reason and a snapshot's id stay on their line", () => {
    const cmd = jobOptions(new Command("run")).exitOverride();
    cmd.parse(["--job", "default.j"], { from: "user" });
    const config = jobConfigOf(cmd.opts() as JobFlags);
    const record = {
      ...runningRecord("default.j", JSON.stringify(config), 1),
      state: JobState.Failed,
      reason: forged,
      snapshot: `step-1${forged}`,
      snapshotDir: "/tmp/snaps",
    };
    const manifest = {
      id: `step-000000006${forged}`,
      step: 6,
      createdMs: 0,
      metric: 0,
      files: [],
    } as unknown as Manifest;
    const lines = [
      ...statusLines({ job: "default.j", record, config, shards: [], trainers: [], checkpoints: [manifest] }),
      ...outcomeLines(
        {
          record,
          watched: false,
          seconds: 0,
          checkpoints: 0,
          restores: 0,
          samplesPerS: 0,
          wireBytesPerStep: 0,
          density: -1,
        } as unknown as Parameters<typeof outcomeLines>[0],
        { logs: null },
      ),
      ...jobsTable([{ ...record, job: `default.j${forged}` }]),
    ];
    for (const line of lines) expect(line).toMatch(oneLine);
    expect(lines).toContain("accuracy   - (it ended before its first evaluation)"); // not "yet": it ended
    expect(lines).toContainEqual(expect.stringMatching(/^job +state +accuracy +of steps +submitted +took$/));
    expect(lines.join("\n")).toContain("reason     a\\nb\\r\\nFAKE LOG LINE");
    expect(lines.join("\n")).toContain("note:      a\\nb\\r\\nFAKE LOG LINE");
  });
});

afterAll(() => spy.mockRestore());
