// The checkpoint store on real files: atomic saves, verification on read, fallback to the
// previous good snapshot, retention, and leftovers of a crashed save.
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { encodeManifest } from "../../schemas/messages/checkpoint.ts";
import { CheckpointStore, manifestName, snapshotId, UnusableSnapshotsError } from "../../services/checkpoint/store.ts";
import { BadRequestError, CorruptDataError, NotReadyError } from "../../services/runtime/mesh/errors.ts";
import { expectThrown } from "../helpers/errors.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const fresh = () => new CheckpointStore(tempDir("mt-ckpt-"));
const files = (step: number) => [
  { name: "ps-0.mtss", bytes: crypto.getRandomValues(new Uint8Array(5000 + step)) },
  { name: "ps-1.mtss", bytes: crypto.getRandomValues(new Uint8Array(3000)) },
];
const save = (s: CheckpointStore, step: number, metric = Number.NaN) =>
  s.save({ job: "j", step, metric, configJson: "{}", cursors: [step, step] }, files(step));

describe("checkpoint store", () => {
  test("a saved snapshot reads back bit-exact, with checksums and cursors in its manifest", () => {
    const s = fresh();
    const f = files(10);
    const m = s.save({ job: "j", step: 10, metric: 0.5, configJson: '{"a":1}', cursors: [10, 10] }, f);
    expect(m.id).toBe(snapshotId(10));
    expect(m.files.map((x) => x.crc32)).toEqual(f.map((x) => Bun.hash.crc32(x.bytes)));
    const r = s.read("j", m.id);
    expect(r.manifest).toEqual(m);
    expect(r.files.get("ps-0.mtss")).toEqual(f[0]!.bytes);
    expect(readdirSync(join(s.root, "j"))).toEqual([m.id]); // no temporary folder left
  });

  test("a flipped byte is detected on restore, reported, and the previous good snapshot is used", () => {
    const s = fresh();
    save(s, 10);
    const newer = save(s, 20);
    const path = join(s.root, "j", newer.id, "ps-1.mtss");
    const bytes = readFileSync(path);
    bytes[1234]! ^= 0x01;
    writeFileSync(path, bytes);
    expectThrown(() => s.read("j", newer.id), CorruptDataError, "ps-1.mtss", "checksum");
    const reported: string[] = [];
    const good = s.latestGood("j", "", (id, why) => reported.push(`${id}: ${why}`));
    expect(good.manifest.step).toBe(10);
    expect(reported).toHaveLength(1);
    expect(reported[0]).toContain(newer.id);
  });

  test("a truncated file, a missing file, a garbage manifest and a future format are each caught", () => {
    const s = fresh();
    const a = save(s, 1),
      b = save(s, 2),
      c = save(s, 3),
      d = save(s, 4);
    writeFileSync(join(s.root, "j", a.id, "ps-0.mtss"), new Uint8Array(10));
    expectThrown(() => s.read("j", a.id), CorruptDataError, "10 bytes");
    Bun.spawnSync(["rm", join(s.root, "j", b.id, "ps-1.mtss")]);
    expectThrown(() => s.read("j", b.id), CorruptDataError, "missing");
    writeFileSync(join(s.root, "j", c.id, manifestName), crypto.getRandomValues(new Uint8Array(64)));
    expectThrown(() => s.read("j", c.id), CorruptDataError, "does not decode");
    writeFileSync(join(s.root, "j", d.id, manifestName), encodeManifest({ ...d, formatVersion: 99 }));
    expectThrown(() => s.read("j", d.id), CorruptDataError, "format 99");
    expectThrown(() => s.latestGood("j", "", () => {}), CorruptDataError, "every snapshot");
  });

  test("no snapshot yet is NotReady; a named one that does not exist is a bad request naming those there are", () => {
    const s = fresh();
    expectThrown(() => s.latestGood("j", "", () => {}), NotReadyError, "no snapshot yet");
    expectThrown(() => s.latestGood("j", "step-000000099", () => {}), BadRequestError, "step-000000099; it has none");
    save(s, 5);
    expectThrown(
      () => s.latestGood("j", "step-000000099", () => {}),
      BadRequestError,
      "job j has no snapshot step-000000099; it has step-000000005",
    );
    expect(s.latestGood("j", snapshotId(5), () => {}).manifest.step).toBe(5);
  });

  test("snapshots none of which can resume the job now: NotReady, of its own kind (a process that lost its state fails the job on it)", () => {
    const s = fresh();
    save(s, 5);
    save(s, 6);
    const e = expectThrown(
      () =>
        s.latestGood(
          "j",
          "",
          () => {},
          (m) => `step ${m.step} is before the world changed`,
        ),
      UnusableSnapshotsError,
      "no snapshot of job j can resume it now (step-000000006: step 6 is before the world changed; step-000000005: step 5",
    );
    expect(e).toBeInstanceOf(NotReadyError);
    // one that can is taken
    expect(
      s.latestGood(
        "j",
        "",
        () => {},
        (m) => (m.step === 6 ? "not this one" : null),
      ).manifest.step,
    ).toBe(5);
  });

  test("retention keeps the last K and the best by metric", () => {
    const s = fresh();
    for (const [step, metric] of [
      [1, 0.9],
      [2, 0.99],
      [3, 0.95],
      [4, 0.96],
      [5, Number.NaN],
      [6, 0.97],
    ] as const)
      save(s, step, metric);
    const removed = s.retain("j", 2);
    expect(removed).toEqual([snapshotId(1), snapshotId(3), snapshotId(4)]);
    expect(s.list("j").map((m) => m.step)).toEqual([2, 5, 6]);
  });

  test("a crashed save leaves a .tmp- folder that list ignores and sweep removes", () => {
    const s = fresh();
    save(s, 1);
    mkdirSync(join(s.root, "j", ".tmp-step-000000002-123"));
    expect(s.list("j").map((m) => m.step)).toEqual([1]);
    s.sweep("j");
    expect(existsSync(join(s.root, "j", ".tmp-step-000000002-123"))).toBe(false);
  });
});
