// The ring and hierarchical collectives over a real nats-server, one process per rank
// (bench/collective-rank.ts): results against a float64 sum and bit-identical on every rank for
// 1-4 ranks and awkward sizes; ranks labelled as 2 hosts x 2; a rank SIGKILLed mid-operation
// gives the others a typed error within the timeout; the same over shared memory and over direct
// TCP links; hostile pieces on the subject, and hostile connections to the TCP link, are refused.
import { afterAll, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type RankOp, type RankPlan, type RanksRun, runRankProcesses } from "../../bench/collective-rank.ts";
import { BusTransport } from "../../services/runtime/transport/collective-bus.ts";
import { DirectLinkClient } from "../../services/runtime/transport/direct-link.ts";
import {
  ShmOutbox,
  shmDir,
  shmPath,
  shmRefusedPrefix,
  shmSocketPath,
} from "../../services/runtime/transport/collective-shm.ts";
import pino from "pino";
import { BadRequestError, DeadlineError } from "../../services/runtime/mesh/errors.ts";
import { NatsBus } from "../../services/runtime/mesh/nats.ts";
import { refusalBurst } from "../../services/runtime/mesh/refusal-log.ts";
import { subjects } from "../../services/runtime/job/subjects.ts";
import { encodeCollPiece } from "../../schemas/messages/trainer.ts";
import { pieceFromOne } from "../helpers/coll-piece.ts";
import { expectRejected } from "../helpers/errors.ts";
import { clientBus, startNatsServer } from "../helpers/mesh.ts";

// each test starts up to 4 bun processes on 2 cores
setDefaultTimeout(90_000);

let server: Awaited<ReturnType<typeof startNatsServer>>;
const dir = mkdtempSync(join(tmpdir(), "mt-coll-"));
let jobs = 0;

beforeAll(async () => {
  server = await startNatsServer();
});
afterAll(async () => {
  await server?.[Symbol.asyncDispose]();
  rmSync(dir, { recursive: true, force: true });
});

async function runRanks(
  hosts: string[],
  ops: RankOp[],
  extra: Partial<RankPlan> & { dieRank?: number } = {},
): Promise<RanksRun & { job: string }> {
  const job = `coll${++jobs}`;
  const { dieRank, dieAfterPieces, ...rest } = extra;
  const run = await runRankProcesses(
    dir,
    hosts.map((_, rank) => ({
      url: server.url,
      job,
      rank,
      hosts,
      pieceBytes: 4096,
      windowPieces: 4,
      progressTimeoutMs: 20_000,
      peerLostMs: 20_000,
      ops,
      ...rest,
      ...(dieRank === rank ? { dieAfterPieces: dieAfterPieces ?? 5 } : {}),
    })),
  );
  return { ...run, job };
}

const op = (o: Partial<RankOp> & Pick<RankOp, "op" | "len">): RankOp => ({
  seed: 1,
  step: 0,
  bucket: 0,
  check: true,
  ...o,
});

/** Every rank's result of operation i: no error, within rounding of float64, the same bits. */
function expectAgreed(run: RanksRun, i: number, sameHash = true): void {
  const rs = run.results.map((r) => r[i]!);
  for (const r of rs) {
    expect(r.error).toBeUndefined();
    expect(r.errorRatio).toBeLessThanOrEqual(1);
  }
  if (sameHash) expect(new Set(rs.map((r) => r.hash)).size).toBe(1);
}

/**
 * Three ranks over `carrier` (shared memory or TCP links): the first all-reduce completes (the
 * links are set up), rank 2 SIGKILLs itself during the second, and the other two end that one
 * with a typed error within the timeouts (3 s), not a hang.
 */
async function killedAfterItsFirstOperation(carrier: Partial<RankPlan>): Promise<RanksRun & { job: string }> {
  const started = performance.now();
  const run = await runRanks(
    ["h", "h", "h"],
    [op({ op: "allReduce", len: 3_000, step: 1 }), op({ op: "allReduce", len: 200_000, step: 2, check: false })],
    { dieRank: 2, dieAfterPieces: 12, progressTimeoutMs: 3_000, peerLostMs: 2_000, ...carrier },
  );
  expect(run.codes[2]).not.toBe(0);
  for (const r of [0, 1]) {
    expect(run.codes[r]).toBe(0);
    expect(run.results[r]![0]!.error).toBeUndefined();
    expect(run.results[r]![1]!.error?.name).toMatch(/^(PeerLostError|CollectiveTimeoutError|CollectiveAbortedError)$/);
  }
  expect(performance.now() - started).toBeLessThan(60_000);
  return run;
}

describe("ring over NATS, one process per rank", () => {
  test.each([1, 2, 3, 4])(
    "%i ranks: all-reduce of 0, 1, 7 and 10 007 elements, reduce-scatter, all-gather, broadcast",
    async (n) => {
      const ops = [
        op({ op: "allReduce", len: 0, step: 1 }),
        op({ op: "allReduce", len: 1, step: 2 }),
        op({ op: "allReduce", len: 7, step: 3 }),
        op({ op: "allReduce", len: 10_007, step: 4, seed: 5 }),
        op({ op: "reduceScatter", len: 10_007, step: 5 }),
        op({ op: "allGather", len: 9_999, step: 6 }),
        op({ op: "broadcast", len: 3_001, step: 7, root: n - 1 }),
      ];
      const run = await runRanks(Array(n).fill("h"), ops);
      expect(run.codes).toEqual(Array(n).fill(0));
      for (let i = 0; i < ops.length; i++) expectAgreed(run, i, ops[i]!.op !== "reduceScatter");
    },
  );

  test("2 hosts x 2 ranks: the hierarchical all-reduce matches float64 and agrees bit for bit", async () => {
    const ops = [
      op({ op: "allReduce", len: 20_001, step: 1 }),
      op({ op: "allReduce", len: 3, step: 2 }),
      op({ op: "reduceScatter", len: 1_001, step: 3 }),
    ];
    const run = await runRanks(["a", "a", "b", "b"], ops);
    expect(run.codes).toEqual([0, 0, 0, 0]);
    expectAgreed(run, 0);
    expectAgreed(run, 1);
    expectAgreed(run, 2, false);
  });

  test("a rank SIGKILLed mid-operation: the others end with a typed error within the timeout, not a hang", async () => {
    const started = performance.now();
    const run = await runRanks(["h", "h", "h"], [op({ op: "allReduce", len: 200_000, step: 1, check: false })], {
      dieRank: 2,
      dieAfterPieces: 5,
      progressTimeoutMs: 3_000,
      peerLostMs: 2_000,
    });
    expect(run.codes[2]).not.toBe(0);
    for (const r of [0, 1]) {
      expect(run.codes[r]).toBe(0);
      const e = run.results[r]![0]!.error;
      expect(e?.name).toMatch(/^(PeerLostError|CollectiveTimeoutError|CollectiveAbortedError)$/);
    }
    // bounded by the timeouts (3 s) plus process start-up, far below a hang
    expect(performance.now() - started).toBeLessThan(60_000);
  });
});

describe("ring with its values through shared memory, one process per rank", () => {
  const leftovers = (job: string) =>
    readdirSync(shmDir).filter((f) => f.startsWith(shmPath(job, 1, 0, 1, 1).split("/").pop()!.split("-g")[0]!));

  test.each([2, 3, 4])(
    "%i ranks: every rank switches to shared memory, results match float64 and agree bit for bit, no file is left",
    async (n) => {
      const ops = [
        op({ op: "allReduce", len: 10_007, step: 1, seed: 5 }), // inline: each rank learns its peers share its memory
        op({ op: "allReduce", len: 1, step: 2 }),
        op({ op: "allReduce", len: 30_011, step: 3, seed: 7 }),
        op({ op: "reduceScatter", len: 10_007, step: 4 }),
        op({ op: "allGather", len: 9_999, step: 5 }),
        op({ op: "broadcast", len: 3_001, step: 6, root: n - 1 }),
      ];
      const run = await runRanks(Array(n).fill("h"), ops, { sharedMemory: true });
      expect(run.codes).toEqual(Array(n).fill(0));
      for (let i = 0; i < ops.length; i++) expectAgreed(run, i, ops[i]!.op !== "reduceScatter");
      // after the first operation every rank sends to its ring neighbour through shared memory
      for (const r of run.results) expect(r.at(-1)!.shmPeers).toBeGreaterThanOrEqual(1);
      expect(leftovers(run.job)).toEqual([]);
    },
  );

  test("a rank SIGKILLed mid-operation: the others end with a typed error within the timeout, not a hang", async () => {
    const run = await killedAfterItsFirstOperation({ sharedMemory: true });
    // what a SIGKILL leaves: the dead rank's socket (a rank restarted at its place removes it);
    // every file of pieces was unlinked once mapped
    const left = shmPath(run.job, 1, 2, 0, 0).split("/").pop()!.split("-g")[0]!;
    const mine = readdirSync(shmDir).filter((f) => f.startsWith(left));
    expect(mine).toEqual([shmSocketPath(run.job, 1, 2).split("/").pop()!]);
    for (const f of mine) rmSync(join(shmDir, f), { force: true });
  });
});

describe("ring over direct TCP links (ranks on other machines), one process per rank", () => {
  test.each([2, 3, 4])(
    "%i ranks: after the first pieces over NATS every rank sends over TCP; results match float64 and agree bit for bit",
    async (n) => {
      const ops = [
        op({ op: "allReduce", len: 10_007, step: 1, seed: 5 }), // each rank learns its peers' links
        op({ op: "allReduce", len: 30_011, step: 2, seed: 7 }),
        op({ op: "reduceScatter", len: 10_007, step: 3 }),
        op({ op: "allGather", len: 9_999, step: 4 }),
        op({ op: "allReduce", len: 3_001, step: 5, check: false, compress: "bf16" }),
      ];
      const run = await runRanks(Array(n).fill("h"), ops, { netAddress: "127.0.0.1" });
      expect(run.codes).toEqual(Array(n).fill(0));
      for (let i = 0; i < ops.length - 1; i++) expectAgreed(run, i, ops[i]!.op !== "reduceScatter");
      expect(new Set(run.results.map((r) => r.at(-1)!.hash)).size).toBe(1);
      for (const r of run.results) {
        expect(r.at(-1)!.shmPeers).toBe(0);
        expect(r.at(-1)!.netPeers).toBeGreaterThanOrEqual(1);
      }
    },
  );

  test("a rank SIGKILLed mid-operation: the others end with a typed error within the timeout, not a hang", async () => {
    await killedAfterItsFirstOperation({ netAddress: "127.0.0.1" });
  });
});

describe("the collective subject refuses hostile pieces", () => {
  /** Rank 0 of a 2-rank communicator of `job`, generation 3, with small pieces and short waits. */
  const rankZero = (job: string) => ({
    job,
    rank: 0,
    size: 2,
    generation: 3,
    pieceBytesMax: 64,
    windowPieces: 2,
    sendTimeoutMs: 2_000,
    peerLostMs: 2_000,
  });

  test("shared-memory pieces: no such file, a slot or count out of bounds, a rank that takes none", async () => {
    await using bus = await clientBus(server.url);
    const options = rankZero("default.hostile-shm");
    const t = new BusTransport(bus, { ...options, sharedMemory: true });
    const got: number[][] = [];
    t.listen((p) => {
      got.push([...new Float32Array(p.data.slice().buffer)]);
      return { kind: "taken" };
    });
    const out = ShmOutbox.create("default.hostile-shm", 3, 1, 0, 2, 64)!;
    expect(out).not.toBeNull();
    out.write(1, Float32Array.of(1.5, -2));
    const good = pieceFromOne("default.hostile-shm", 3);
    const two = new Float32Array(2);
    const send = (m: Uint8Array) => bus.request(subjects.coll("default.hostile-shm", 0, 1), m, 2_000);
    await expectRejected(
      () => send(encodeCollPiece(good, two, { nonce: out.nonce + 1, slot: 1 })),
      BadRequestError,
      shmRefusedPrefix,
    );
    await expectRejected(
      () => send(encodeCollPiece(good, two, { nonce: out.nonce, slot: 2 })),
      BadRequestError,
      "slot 2 of 2",
    );
    await expectRejected(
      () => send(encodeCollPiece(good, new Float32Array(17), { nonce: out.nonce, slot: 1 })),
      BadRequestError,
      "exceeds",
    );
    expect(got).toEqual([]);
    await send(encodeCollPiece(good, two, { nonce: out.nonce, slot: 1 }));
    expect(got).toEqual([[1.5, -2]]);
    out.unlink();
    t.close();
    // a rank without shared memory refuses such pieces, naming why, so the sender goes inline
    const inline = new BusTransport(bus, { ...options, job: "default.hostile-inline", sharedMemory: false });
    inline.listen(() => ({ kind: "taken" }));
    const m = encodeCollPiece({ ...good, job: "default.hostile-inline" }, two, { nonce: 5, slot: 0 });
    await expectRejected(
      () => bus.request(subjects.coll("default.hostile-inline", 0, 1), m, 2_000),
      BadRequestError,
      shmRefusedPrefix,
    );
    inline.close();
  });

  test("a storm of pieces while the rank replaces its transport again and again (restores): every request is answered at once", async () => {
    await using bus = await clientBus(server.url);
    await using rankBus = await clientBus(server.url);
    const job = "default.storm";
    let t = new BusTransport(rankBus, { ...rankZero(job), sharedMemory: false });
    t.listen(() => ({ kind: "taken" }));
    let stop = false;
    // a new generation every few ms, as back-to-back restores give: the old transport closes, a
    // new one listens
    const churn = (async () => {
      for (let g = 4; !stop; g++) {
        await Bun.sleep(3);
        t.close();
        t = new BusTransport(rankBus, { ...rankZero(job), generation: g, sharedMemory: false });
        t.listen(() => ({ kind: "taken" }));
      }
    })();
    const good = pieceFromOne(job, 3);
    let unanswered = 0;
    let answered = 0;
    const sender = async () => {
      for (let i = 0; i < 100; i++) {
        try {
          await bus.request(
            subjects.coll(job, 0, 1),
            encodeCollPiece({ ...good, piece: i }, new Float32Array(2)),
            2_000,
          );
          answered++;
        } catch (e) {
          if (e instanceof DeadlineError) unanswered++;
          else answered++;
        }
      }
    };
    await Promise.all(Array.from({ length: 16 }, sender));
    stop = true;
    await churn;
    t.close();
    expect({ answered, unanswered }).toEqual({ answered: 1600, unanswered: 0 });
  });

  test("wrong job, generation, addressee, sender (also one the subject does not name), length: error replies, logged rate-limited with the subject and the reason; the rank keeps working", async () => {
    await using bus = await clientBus(server.url);
    const logged: Record<string, unknown>[] = [];
    const log = pino({ level: "debug" }, { write: (line: string) => void logged.push(JSON.parse(line)) });
    const rankBus = await NatsBus.connect({
      url: server.url,
      name: "test-rank",
      log,
      connectRetryMsMax: 5_000,
      connectBackoffMsMax: 500,
    });
    const t = new BusTransport(rankBus, { ...rankZero("default.hostile"), sharedMemory: false });
    const taken: number[] = [];
    t.listen((p) => {
      taken.push(p.piece);
      return { kind: "taken" };
    });
    // the subscription reaches the server before the other connection's first request (a round
    // trip on the rank's own connection): without it, that request could find no responders
    await rankBus.nc.flush();
    const good = pieceFromOne("default.hostile", 3);
    const send = (m: Uint8Array, from = 1) => bus.request(subjects.coll("default.hostile", 0, from), m, 2_000);
    await expectRejected(
      () => send(encodeCollPiece({ ...good, job: "default.other" }, new Float32Array(2))),
      BadRequestError,
      "job",
    );
    await expectRejected(
      () => send(encodeCollPiece({ ...good, generation: 2 }, new Float32Array(2))),
      BadRequestError,
      "generation 2",
    );
    await expectRejected(
      () => send(encodeCollPiece({ ...good, to: 1 }, new Float32Array(2))),
      BadRequestError,
      "for rank 1",
    );
    await expectRejected(
      () => send(encodeCollPiece({ ...good, from: 0 }, new Float32Array(2)), 0),
      BadRequestError,
      "not a peer",
    );
    await expectRejected(
      () => send(encodeCollPiece({ ...good, from: 7 }, new Float32Array(2)), 7),
      BadRequestError,
      "not a peer",
    );
    // a forged sender: rank 1's piece on rank 2's subject, or rank 2's claim on rank 1's
    await expectRejected(
      () => send(encodeCollPiece(good, new Float32Array(2)), 2),
      BadRequestError,
      'piece says it is from rank 1, but came on the subject of rank "2"',
    );
    await expectRejected(
      () => send(encodeCollPiece({ ...good, from: 2 }, new Float32Array(2)), 1),
      BadRequestError,
      "from rank 2",
    );
    await expectRejected(() => send(encodeCollPiece(good, new Float32Array(100))), BadRequestError);
    await expectRejected(() => send(new Uint8Array([1, 2, 3])), Error);
    expect(taken).toEqual([]);
    await send(encodeCollPiece({ ...good, piece: 9 }, new Float32Array(2)));
    expect(taken).toEqual([9]);
    // 9 refusals: the first refusalBurst logged one by one, naming the sender's subject and why
    const refused = logged.filter((l) => l.msg === "request refused");
    expect(refused).toHaveLength(refusalBurst);
    expect(refused[0]).toMatchObject({ level: 40, subject: subjects.coll("default.hostile", 0, 1) });
    expect(String(refused[0]!.err)).toContain('piece for job "default.other"');
    expect(refused.map((l) => l.subject)).toContain(subjects.coll("default.hostile", 0, 7));
    t.close();
    await rankBus.close();
    // the rest counted, and said in one line when the bus closes (or the window ends)
    const summary = logged.filter((l) => l.refused !== undefined);
    expect(summary).toHaveLength(1);
    expect(summary[0]).toMatchObject({
      level: 40,
      refused: 9 - refusalBurst,
      handler: subjects.collTo("default.hostile", 0),
    });
  });

  test("the TCP link: a connection whose hello has no secret, a wrong one, another rank's, or a piece first is refused and closed; an oversized frame closes it; the sender it proves is the only one it may speak for", async () => {
    const job = "default.hostile-net";
    await using bus = await clientBus(server.url);
    const t = new BusTransport(bus, { ...rankZero(job), size: 3, sharedMemory: false, netAddress: "127.0.0.1" });
    const taken: number[] = [];
    t.listen((p) => {
      taken.push(p.piece);
      return { kind: "taken" };
    });
    expect(t.netPort).toBeGreaterThan(0);
    const good = pieceFromOne(job, 3);
    // rank 1's first piece over NATS (its own subject): the answer offers it the link, with its secret
    const answer = new TextDecoder().decode(
      await bus.request(subjects.coll(job, 0, 1), encodeCollPiece(good, new Float32Array(2)), 2_000),
    );
    const offer = /^tcp 127\.0\.0\.1 (\d+) ([0-9a-f]{32})$/m.exec(answer);
    expect(offer?.[1]).toBe(String(t.netPort));
    const secret = offer![2]!;
    const frameMax = t.messageBytesMax;
    const hello = (text: string) =>
      DirectLinkClient.tcp("127.0.0.1", t.netPort, new TextEncoder().encode(text), frameMax, 2_000);
    expect(await hello("")).toBeNull();
    expect(await hello(`1:${"0".repeat(32)}`)).toBeNull();
    expect(await hello(`2:${secret}`)).toBeNull(); // rank 2 has no secret yet, and this is rank 1's
    expect(await hello(`1:${secret}x`)).toBeNull();
    // a piece where the hello should be
    const raw = async (bytes: Uint8Array) => {
      const got: Uint8Array[] = [];
      const closed = Promise.withResolvers<void>();
      const s = await Bun.connect({
        hostname: "127.0.0.1",
        port: t.netPort,
        socket: { data: (_s, d) => void got.push(d), close: () => closed.resolve(), error: () => closed.resolve() },
      });
      s.write(bytes);
      await Promise.race([closed.promise, Bun.sleep(5_000)]);
      return { closed: s.readyState !== 1, got: Buffer.concat(got) };
    };
    const frameOf = (id: number, payload: Uint8Array, len = payload.byteLength) => {
      const f = new Uint8Array(8 + payload.byteLength);
      new DataView(f.buffer).setUint32(0, len, true);
      new DataView(f.buffer).setUint32(4, id, true);
      f.set(payload, 8);
      return f;
    };
    const first = await raw(frameOf(1, encodeCollPiece({ ...good, piece: 5 }, new Float32Array(2))));
    expect(first.closed).toBe(true);
    expect(first.got.toString()).toContain("hello was refused");
    // a frame longer than any message: closed without an answer
    const huge = await raw(frameOf(1, new Uint8Array(8), frameMax + 1));
    expect(huge).toEqual({ closed: true, got: Buffer.alloc(0) });
    expect(taken).toEqual([0]);
    // rank 1's link: its pieces are taken; a piece in it that says it is from rank 2 is refused
    const link = await hello(`1:${secret}`);
    expect(link).not.toBeNull();
    await link!.request(encodeCollPiece({ ...good, piece: 6 }, new Float32Array(2)), 2_000);
    await expectRejected(
      () => link!.request(encodeCollPiece({ ...good, from: 2, piece: 7 }, new Float32Array(2)), 2_000),
      BadRequestError,
      'piece says it is from rank 2, but came on the subject of rank "1"',
    );
    expect(taken).toEqual([0, 6]);
    link!.close();
    // a new communicator generation: new secrets, the old one no longer opens a link
    t.close();
    const next = new BusTransport(bus, {
      ...rankZero(job),
      generation: 4,
      size: 3,
      sharedMemory: false,
      netAddress: "127.0.0.1",
    });
    next.listen(() => ({ kind: "taken" }));
    expect(
      await DirectLinkClient.tcp("127.0.0.1", next.netPort, new TextEncoder().encode(`1:${secret}`), frameMax, 2_000),
    ).toBeNull();
    next.close();
  });
});
