// Service runtime pieces without a server: config sources and precedence, typed errors across
// the wire, subject matching, the job config.
import { afterAll, describe, expect, test } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { z } from "zod";
import { WireFormatError } from "../../schemas/codec.ts";
import { decodeErrorReply, encodeErrorReply } from "../../schemas/messages/runtime.ts";
import { MemoryBus, subjectMatches } from "../../services/runtime/mesh/bus.ts";
import { loadConfig } from "../../services/runtime/mesh/config.ts";
import {
  BadRequestError,
  errorReplyOf,
  InternalError,
  MeshError,
  rebuildError,
  UnknownJobError,
} from "../../services/runtime/mesh/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import {
  gptJobDefaults,
  type JobConfig,
  jobDefaults,
  parseJobConfig,
  peakLr,
  usesShards,
} from "../../services/runtime/job/config.ts";
import { resumeConfig, trajectoryDiff } from "../../services/runtime/job/resume.ts";
import { type PreviousRun, resumedWorld } from "../../sdk/client.ts";
import type { Manifest } from "../../schemas/messages/checkpoint.ts";
import { followAgain } from "../../services/runtime/job/ledger.ts";
import { capacityMessage } from "../../services/runtime/mesh/discovery.ts";
import { expectThrown } from "../helpers/errors.ts";
import { removeTempDirs, tempDir, waitFor } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const schema = z.object({
  natsUrl: z.string(),
  shard: z.number().int().min(0),
  verbose: z.boolean(),
  widths: z.array(z.number()),
});
const base = { natsUrl: "nats://a:1", shard: 0, verbose: false, widths: [1] };

describe("config", () => {
  test("defaults < file < environment < flags", () => {
    const dir = tempDir("mt-cfg-");
    const file = join(dir, "ps.yaml");
    writeFileSync(file, "natsUrl: nats://file:1\nshard: 3\nwidths: [784, 10]\n");
    expect(loadConfig(schema, { argv: ["--config", file], env: {} }, base)).toEqual({
      natsUrl: "nats://file:1",
      shard: 3,
      verbose: false,
      widths: [784, 10],
    });
    expect(loadConfig(schema, { argv: ["--config", file], env: { MT_SHARD: "5", MT_VERBOSE: "true" } }, base)).toEqual({
      natsUrl: "nats://file:1",
      shard: 5,
      verbose: true,
      widths: [784, 10],
    });
    expect(
      loadConfig(
        schema,
        { argv: ["--config", file, "--shard=7", "--nats-url", "nats://flag:2"], env: { MT_SHARD: "5" } },
        base,
      ),
    ).toEqual({
      natsUrl: "nats://flag:2",
      shard: 7,
      verbose: false,
      widths: [784, 10],
    });
  });

  test("every problem is named with its key and source", () => {
    const e = expectThrown(
      () => loadConfig(schema, { argv: ["--shard", "-2"], env: { MT_VERBOSE: "maybe" } }, base),
      ConfigError,
    );
    expect(e.message).toContain("shard (from --shard)");
    expect(e.message).toContain("verbose (from $MT_VERBOSE)");
    expectThrown(
      () => loadConfig(schema, { argv: ["--shardz", "1"], env: {} }, base),
      ConfigError,
      "unknown flag --shardz",
      "--shard",
    );
    expectThrown(() => loadConfig(schema, { argv: ["--shard"], env: {} }, base), ConfigError, "needs a value");
    expectThrown(() => loadConfig(schema, { argv: ["stray"], env: {} }, base), ConfigError, "unexpected argument");
    expectThrown(
      () => loadConfig(schema, { argv: ["--config", "/nonexistent.yaml"], env: {} }, base),
      ConfigError,
      "cannot read",
    );
    const dir = tempDir("mt-cfg-");
    writeFileSync(join(dir, "bad.yaml"), "- a list\n- not a mapping\n");
    expectThrown(
      () => loadConfig(schema, { argv: ["--config", join(dir, "bad.yaml")], env: {} }, base),
      ConfigError,
      "mapping",
    );
    writeFileSync(join(dir, "extra.yaml"), "shard: 1\ncolour: blue\n");
    expectThrown(
      () => loadConfig(schema, { argv: ["--config", join(dir, "extra.yaml")], env: {} }, base),
      ConfigError,
      "colour",
    );
  });
});

describe("typed errors cross the wire", () => {
  // Plain names: "%p" would format each Error, stack and all, into the test's name.
  test.each([
    ["BadRequestError", new BadRequestError("shape"), BadRequestError],
    ["UnknownJobError", new UnknownJobError("who"), UnknownJobError],
    ["WireFormatError", new WireFormatError("truncated", "short"), WireFormatError],
    ["TypeError becomes InternalError", new TypeError("boom"), InternalError],
  ] as const)("%s", (_name, err, cls) => {
    const reply = decodeErrorReply(encodeErrorReply(errorReplyOf(err, "mt.j.ps.0.push")), 1 << 16);
    const back = rebuildError(reply);
    expect(back).toBeInstanceOf(cls);
    expect(back.message).toContain(err.message);
    expect(back.message).toContain("mt.j.ps.0.push");
  });

  test("an unknown code becomes a MeshError carrying it", () => {
    const e = rebuildError({ code: "from_the_future", message: "x", subject: "s" });
    expect(e).toBeInstanceOf(MeshError);
    expect((e as MeshError).code).toBe("from_the_future");
  });

  test("MemoryBus: a handler's throw reaches the caller typed; wildcards match like NATS", async () => {
    const bus = new MemoryBus();
    bus.serve({
      name: "x",
      subject: "mt.*.x",
      handler: (d) => {
        if (d.length === 0) throw new BadRequestError("empty");
        return d;
      },
    });
    expect(await bus.request("mt.j.x", Uint8Array.of(1), 100)).toEqual(Uint8Array.of(1));
    await expect(bus.request("mt.j.x", new Uint8Array(0), 100)).rejects.toBeInstanceOf(BadRequestError);
    await expect(bus.request("mt.j.y", Uint8Array.of(1), 100)).rejects.toThrow("no service");
    expect([
      subjectMatches("a.*.c", "a.b.c"),
      subjectMatches("a.>", "a.b.c"),
      subjectMatches("a.*", "a.b.c"),
      subjectMatches("a.>", "a"),
    ]).toEqual([true, true, false, false]);
  });
});

describe("job config", () => {
  test("defaults validate; bad values are named", () => {
    expect(parseJobConfig({ ...jobDefaults, job: "ok-1" }).trainers).toBe(2);
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "bad job" }), ConfigError, "job:");
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "j", trainers: 0 }), ConfigError, "trainers");
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "j", chunkBytes: 5000 }), ConfigError, "multiple of 64");
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "j", minLr: 1 }), ConfigError, "minLr");
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "j", batchPushes: 2 }), ConfigError, "batchPushes");
  });

  test("all-reduce mode: its options, refusals, and configs stored before them", () => {
    const c = parseJobConfig({ ...jobDefaults, job: "j", sync: "allreduce", bucketMb: 4, scaleLr: true });
    expect([c.bucketMb, c.scaleLr, c.replicaCheckEvery, peakLr(c)]).toEqual([4, true, 100, jobDefaults.lr * 2]);
    expect(usesShards(c)).toBe(false);
    expect(usesShards(jobDefaults)).toBe(true);
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "j", sync: "allreduce", staleness: 2 }),
      ConfigError,
      "not to allreduce",
    );
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "j", sync: "allreduce", batchPushes: 2 }),
      ConfigError,
      "not to allreduce",
    );
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "j", scaleLr: true, warmupSteps: 0 }),
      ConfigError,
      "scaleLr needs warmupSteps > 0",
    );
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "j", sync: "allreduce", bucketMb: 0 }),
      ConfigError,
      "bucketMb",
    );
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "j", sync: "ring" }), ConfigError, "sync");
    const { scaleLr: _a, bucketMb: _b, replicaCheckEvery: _c, ...older } = { ...jobDefaults, job: "j" };
    expect(parseJobConfig(older)).toEqual(parseJobConfig({ ...jobDefaults, job: "j" }));
  });

  test("gpt jobs: its defaults validate; a model and a data set that do not go together are refused, naming why", () => {
    const g = parseJobConfig({ ...gptJobDefaults, job: "g" });
    expect([g.model.kind, g.dataset, g.optimizer.kind, g.maxSteps]).toEqual(["gpt", "text", "adamw", 0]);
    expectThrown(
      () => parseJobConfig({ ...gptJobDefaults, job: "g", dataset: "mnist" }),
      ConfigError,
      "the gpt trains on dataset text",
    );
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "m", dataset: "text" }),
      ConfigError,
      "the mlp trains on dataset mnist",
    );
    expectThrown(
      () => parseJobConfig({ ...gptJobDefaults, job: "g", model: { ...gptJobDefaults.model, nHead: 3 } }),
      ConfigError,
      "divisible by model.nHead",
    );
    expectThrown(
      () => parseJobConfig({ ...gptJobDefaults, job: "g", valFraction: 0 }),
      ConfigError,
      "dataset text needs valFraction > 0",
    );
    expectThrown(
      () => parseJobConfig({ ...gptJobDefaults, job: "g", dataset: "tokens", dataDir: "/d" }),
      ConfigError,
      "valFraction must be 0",
    );
    expectThrown(
      () => parseJobConfig({ ...gptJobDefaults, job: "g", model: { ...gptJobDefaults.model, vocabSize: 50 } }),
      ConfigError,
      "model.vocabSize is for token folders",
    );
    expectThrown(
      () => parseJobConfig({ ...gptJobDefaults, job: "g", model: { ...gptJobDefaults.model, kind: "rnn" } }),
      ConfigError,
      "model.kind",
    );
    expectThrown(() => parseJobConfig({ ...gptJobDefaults, job: "g", maxSteps: -1 }), ConfigError, "maxSteps");
    expect(
      parseJobConfig({
        ...gptJobDefaults,
        job: "g",
        dataset: "tokens",
        dataDir: "/d",
        valFraction: 0,
        model: { ...gptJobDefaults.model, vocabSize: 50 },
      }).model,
    ).toMatchObject({ kind: "gpt", vocabSize: 50 });
  });

  test("precision: f32, tf32 or bf16; f16 only in all-reduce mode, refused elsewhere with the reason; a config stored without it reads as f32", () => {
    for (const p of ["f32", "tf32", "bf16"] as const)
      expect(parseJobConfig({ ...jobDefaults, job: "j", precision: p }).precision).toBe(p);
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "j", precision: "f16" }),
      ConfigError,
      "precision f16 runs in all-reduce mode (--sync allreduce)",
    );
    expect(parseJobConfig({ ...jobDefaults, job: "j", precision: "f16", sync: "allreduce" }).precision).toBe("f16");
    expectThrown(() => parseJobConfig({ ...jobDefaults, job: "j", precision: "fp8" }), ConfigError, "precision:");
    const { precision: _, ...older } = { ...jobDefaults, job: "j" };
    expect(parseJobConfig(older).precision).toBe("f32");
  });

  test("attention: auto by default and in configs stored before it; cudnn needs bf16 or f16 and a head size cuDNN takes; the mlp has none", () => {
    const gpt = (over: object) => parseJobConfig({ ...gptJobDefaults, job: "g", ...over });
    expect(gpt({}).attention).toBe("auto");
    const { attention: _, ...older } = { ...gptJobDefaults, job: "g" };
    expect(parseJobConfig(older).attention).toBe("auto");
    expect(gpt({ attention: "reference" }).attention).toBe("reference");
    expect(gpt({ attention: "cudnn", precision: "bf16" }).attention).toBe("cudnn");
    expect(gpt({ attention: "cudnn", precision: "f16", sync: "allreduce" }).attention).toBe("cudnn");
    for (const precision of ["f32", "tf32"])
      expectThrown(
        () => gpt({ attention: "cudnn", precision }),
        ConfigError,
        "invalid job config: attention cudnn needs bf16 or f16 autocast",
      );
    expectThrown(
      () => gpt({ attention: "cudnn", precision: "bf16", model: { ...gptJobDefaults.model, nEmbd: 1032, nHead: 4 } }),
      ConfigError,
      "head size 258: cuDNN's fused attention takes multiples of 8 up to 128",
    );
    expectThrown(() => gpt({ attention: "flash" }), ConfigError, "attention:");
    expectThrown(() => gpt({ attention: 1 }), ConfigError, "attention:");
    expectThrown(
      () => parseJobConfig({ ...jobDefaults, job: "m", attention: "reference" }),
      ConfigError,
      "attention reference is for the gpt",
    );
    // a resumed job may change it: it picks how attention is computed, not the model
    expect(trajectoryDiff(gpt({ precision: "bf16" }), gpt({ precision: "bf16", attention: "cudnn" }))).toEqual([]);
  });
});

describe("a resized job resumed on other trainers (its world ended with the resize's)", () => {
  /** A job of `sync` resized from 2 trainers to 3 at step 40, then stopped; its newest snapshot is of step 282. */
  const resizedJob = (sync: "bsp" | "allreduce"): { resized: JobConfig; prev: PreviousRun } => {
    const resized = parseJobConfig({
      ...jobDefaults,
      job: "default.j",
      sync,
      trainers: 3,
      batchSize: 128,
      world: [
        { from: 0, trainers: 2 },
        { from: 40, trainers: 3 },
      ],
    });
    const snapshot = { id: "step-000000282", step: 282 } as Manifest;
    return { resized, prev: { config: resized, record: null, snapshot, orphaned: false } };
  };
  for (const sync of ["bsp", "allreduce"] as const) {
    const { resized, prev } = resizedJob(sync);
    test(`${sync}: on 2 trainers, the world goes on from the snapshot's step`, () => {
      const cfg = resumedWorld(resumeConfig(resized, { trainers: 2 }), prev);
      expect(cfg.world).toEqual([
        { from: 0, trainers: 2 },
        { from: 40, trainers: 3 },
        { from: 282, trainers: 2 },
      ]);
      expect(trajectoryDiff(resized, cfg)).toEqual([]);
      // on its 3: the world it had
      expect(resumedWorld(resumeConfig(resized, {}), prev).world).toEqual(resized.world);
    });
  }
  test("allreduce: on 2 trainers with the same global batch (2 x 192), each world's batch recorded", () => {
    const { resized, prev } = resizedJob("allreduce");
    const cfg = resumedWorld(resumeConfig(resized, { trainers: 2, batchSize: 192 }), prev);
    expect(cfg.world).toEqual([
      { from: 0, trainers: 2, batchSize: 128 },
      { from: 40, trainers: 3, batchSize: 128 },
      { from: 282, trainers: 2, batchSize: 192 },
    ]);
    expect(trajectoryDiff(resized, cfg)).toEqual([]);
  });
});

describe("which config changes a snapshot survives", () => {
  const ar = (over: object) =>
    parseJobConfig({ ...jobDefaults, job: "j", sync: "allreduce", trainers: 4, batchSize: 48, ...over });
  test("all-reduce: another number of trainers with the same global batch; the stage, offload and transport too", () => {
    expect(trajectoryDiff(ar({}), ar({ trainers: 2, batchSize: 96 }))).toEqual([]);
    expect(trajectoryDiff(ar({}), ar({ trainers: 3, batchSize: 64, zero: 3, collTransport: "nats" }))).toEqual([]);
    expect(trajectoryDiff(ar({}), ar({ offload: "optimizer" }))).toEqual([]);
  });
  test("parameter-server mode: another number of shards (the snapshot's chunks are resharded); not into all-reduce", () => {
    const ps = (over: object) => parseJobConfig({ ...jobDefaults, job: "j", shards: 2, ...over });
    expect(trajectoryDiff(ps({}), ps({ shards: 3 }))).toEqual([]);
    expect(trajectoryDiff(ps({}), ps({ shards: 1, sync: "ssp", staleness: 2 }))).toEqual([
      "staleness: 0 -> 2",
      'sync: "bsp" -> "ssp"',
    ]);
    expect(trajectoryDiff(ps({}), ar({ shards: 2 }))).toContain('sync: "bsp" -> "allreduce"');
  });
  test("another global batch, a parameter-server job's trainers, or another codec change the trajectory, and are named", () => {
    expect(trajectoryDiff(ar({}), ar({ trainers: 2 }))).toEqual(["trainers: 4 -> 2"]);
    const ps = (over: object) => parseJobConfig({ ...jobDefaults, job: "j", trainers: 4, batchSize: 48, ...over });
    expect(trajectoryDiff(ps({}), ps({ trainers: 2, batchSize: 96 }))).toEqual([
      "batchSize: 48 -> 96",
      "trainers: 4 -> 2",
    ]);
    expect(trajectoryDiff(ar({}), ar({ compress: "int8" }))).toEqual(['compress: "none" -> "int8"']);
  });
  test("either mode: other trainers from a later step, which the world records; not a rewritten past", () => {
    /** A job's world from (from step, trainers) pairs. */
    const world = (...changes: [from: number, trainers: number][]) =>
      changes.map(([from, trainers]) => ({ from, trainers }));
    for (const sync of ["bsp", "allreduce"] as const) {
      const c = (over: object) => parseJobConfig({ ...jobDefaults, job: "j", sync, trainers: 2, ...over });
      const grown = c({ trainers: 3, world: world([0, 2], [40, 3]) });
      expect(trajectoryDiff(c({}), grown)).toEqual([]);
      // and back to 2 at step 90
      expect(trajectoryDiff(grown, c({ world: world([0, 2], [40, 3], [90, 2]) }))).toEqual([]);
      // a world that says the job always had 3, or changed at another step than it did
      expect(trajectoryDiff(c({}), c({ trainers: 3 }))).toEqual(["trainers: 2 -> 3"]);
      expect(trajectoryDiff(grown, c({ trainers: 3, world: world([0, 4], [40, 3]) })).length).toBeGreaterThan(0);
      // a change before the last one replaces it (a resume from a snapshot before step 40)
      expect(trajectoryDiff(grown, c({ trainers: 4, world: world([0, 2], [30, 4]) }))).toEqual([]);
    }
  });
});

describe("following the job specs again after a cluster change", () => {
  /** Cluster changes pushed by the test, ended by end(). */
  function changeFeed() {
    const queued: string[] = [];
    let wake: (() => void) | null = null;
    let ended = false;
    const changes: AsyncIterable<string> = {
      async *[Symbol.asyncIterator]() {
        for (;;) {
          while (queued.length > 0) yield queued.shift()!;
          if (ended) return;
          await new Promise<void>((r) => (wake = r));
        }
      },
    };
    const poke = () => {
      wake?.();
      wake = null;
    };
    return {
      changes,
      push: (why: string) => (queued.push(why), poke()),
      end: () => ((ended = true), poke()),
    };
  }

  test("a restart that fails is tried again, with growing pauses, until one succeeds; changes meanwhile make no extra restarts", async () => {
    const feed = changeFeed();
    const tries: { why: string; at: number }[] = [];
    const warnings: unknown[] = [];
    const log = { warn: (o: unknown) => warnings.push(o), info: () => {}, error: () => {} } as never;
    const t0 = Date.now();
    const running = followAgain(
      feed.changes,
      () => false,
      async (why) => {
        tries.push({ why, at: Date.now() - t0 });
        if (tries.length === 1) feed.push("reconnected to nats://a"); // arrives during the first pause
        if (tries.length <= 3) throw new Error("consumer create: temporarily unavailable");
      },
      log,
      { first: 20, max: 40 },
    );
    feed.push("nats-2 left the NATS cluster");
    await waitFor("the fourth try", () => tries.length >= 4, 5_000);
    // the change during the first pause is the next try's reason, not an extra try
    expect(tries.map((t) => t.why)).toEqual([
      "nats-2 left the NATS cluster",
      "reconnected to nats://a",
      "reconnected to nats://a",
      "reconnected to nats://a",
    ]);
    const gaps = tries.slice(1).map((t, i) => t.at - tries[i]!.at);
    expect(gaps[0]).toBeGreaterThanOrEqual(18); // 20, 40, 40 ms (timers may fire a little early)
    expect(gaps[1]).toBeGreaterThanOrEqual(38);
    expect(gaps[2]).toBeGreaterThanOrEqual(38);
    expect(warnings).toHaveLength(3);
    // after a success, the next change restarts once, at once
    feed.push("reconnected to nats://b");
    await waitFor("the fifth try", () => tries.length >= 5, 5_000);
    await Bun.sleep(100);
    expect(tries.map((t) => t.why).slice(4)).toEqual(["reconnected to nats://b"]);
    feed.end();
    await running;
  });

  test("once the watch is stopped, a failing restart is not tried again", async () => {
    const feed = changeFeed();
    let stopped = false;
    let tries = 0;
    const log = { warn: () => (stopped = true), info: () => {}, error: () => {} } as never;
    const running = followAgain(
      feed.changes,
      () => stopped,
      async () => {
        tries++;
        throw new Error("no responders");
      },
      log,
      { first: 10, max: 10 },
    );
    feed.push("reconnected to nats://b");
    await Bun.sleep(200);
    expect(tries).toBe(1);
    feed.end();
    await running;
  });
});

describe("a job the mesh cannot run", () => {
  const members = { trainers: [0, 1], shards: [0, 1], dataLoaders: 1, checkpoints: 1 };
  test("names what it lacks and the sizes that would run; an all-reduce job's advice has no --shards (refused with it)", () => {
    const ps = capacityMessage({ job: "default.j", trainers: 4, shards: 3, sync: "bsp" }, members, "nats://m:4222");
    expect(ps).toContain(
      "job default.j needs trainer ranks 2-3, parameter-server shard 2, which the mesh at nats://m:4222",
    );
    expect(ps).toEndWith("(meshtrain mesh up --trainers 4 --shards 3), or submit with --trainers 2 --shards 2");
    const ar = capacityMessage(
      { job: "default.j", trainers: 4, shards: 2, sync: "allreduce" },
      members,
      "nats://m:4222",
    );
    expect(ar).toContain("needs trainer ranks 2-3, which");
    expect(ar).toEndWith("(meshtrain mesh up --trainers 4), or submit with --trainers 2");
    // a resize's: the sizes to resize to
    expect(
      capacityMessage(
        { job: "default.j", trainers: 4, shards: 2, sync: "allreduce" },
        members,
        "nats://m:4222",
        "resize to",
      ),
    ).toEndWith("(meshtrain mesh up --trainers 4), or resize to --trainers 2");
  });
});
