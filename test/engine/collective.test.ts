// Ring and hierarchical collectives over the in-memory transport: every operation against a
// float64 reference for 1-4 ranks and awkward sizes, bit-identical results, retries and
// duplicates, early pieces, hostile pieces, and failing peers. The encoded ring (compression):
// bit-identical sums, every value kept across steps by the error feedback (float64), and the
// bytes it saves. The same algorithms over a real
// nats-server and real processes: test/services/collective.integration.test.ts.
import { describe, expect, test } from "bun:test";
import {
  CollectiveAbortedError,
  CollectiveClosedError,
  CollectiveTimeoutError,
  type Collective,
  segment,
  type WireCoder,
} from "../../engine/parallel/collective.ts";
import { Codec, ErrorFeedback, parseCompression } from "../../engine/parallel/compress.ts";
import { HierarchicalCollective, topologyRings } from "../../engine/parallel/hierarchical.ts";
import { RingCollective } from "../../engine/parallel/ring.ts";
import { MemoryTransport, type PieceHeader } from "../../engine/parallel/transport.ts";
import { Rng } from "../../engine/rng.ts";
import { expectRejected } from "../helpers/errors.ts";

type Hook = (h: PieceHeader) => "deliver" | "drop" | "twice";

function mesh(
  n: number,
  pieceBytes: number,
  opts: { hosts?: string[]; hook?: Hook; timeoutMs?: number; earlyBytesMax?: number; chunkElems?: number } = {},
): Collective[] {
  const peers = new Map<number, MemoryTransport>();
  const ring = {
    progressTimeoutMs: opts.timeoutMs ?? 5_000,
    ...(opts.earlyBytesMax ? { earlyBytesMax: opts.earlyBytesMax } : {}),
  };
  return Array.from({ length: n }, (_, r) => {
    const t = new MemoryTransport(r, peers, pieceBytes, opts.hook ? { beforeDeliver: opts.hook } : {});
    return opts.hosts
      ? new HierarchicalCollective(t, { hosts: opts.hosts }, { ...ring, chunkElems: opts.chunkElems ?? 1 << 20 })
      : new RingCollective(t, n, ring);
  });
}

function inputs(n: number, len: number, seed: number): Float32Array[] {
  const rng = new Rng(seed);
  return Array.from({ length: n }, () => Float32Array.from({ length: len }, () => rng.normal() * 3));
}

/** The float64 sum, and the bound on an f32 ring's rounding: (N-1) additions, each at most eps relative. */
function reference(xs: Float32Array[]): { sum: Float64Array; bound: Float64Array } {
  const len = xs[0]!.length;
  const sum = new Float64Array(len),
    abs = new Float64Array(len);
  for (const x of xs)
    for (let i = 0; i < len; i++) {
      sum[i]! += x[i]!;
      abs[i]! += Math.abs(x[i]!);
    }
  const eps = 2 ** -23;
  return { sum, bound: abs.map((a) => a * eps * xs.length + 1e-30) };
}

function expectNear(
  got: Float32Array,
  ref: { sum: Float64Array; bound: Float64Array },
  range = { offset: 0, count: got.length },
): void {
  for (let i = range.offset; i < range.offset + range.count; i++) {
    if (!(Math.abs(got[i]! - ref.sum[i]!) <= ref.bound[i]!))
      throw new Error(`element ${i}: ${got[i]} vs float64 ${ref.sum[i]} (bound ${ref.bound[i]})`);
  }
}

/** The header of rank 1's first reduce-scatter piece of step 0, bucket 0 in `group`. */
const firstPieceToOne = (group: string) => ({
  group,
  to: 1,
  step: 0,
  bucket: 0,
  phase: "reduce-scatter" as const,
  hop: 0,
  piece: 0,
});

const bitsOf = (x: Float32Array) => Buffer.from(x.buffer, x.byteOffset, x.byteLength).toString("base64");

describe.each([1, 2, 3, 4])("ring of %i ranks", (n) => {
  describe.each([0, 1, 3, 7, 1000, 40_003])("%i elements", (len) => {
    test("all-reduce: the float64 sum within f32 rounding, bit-identical on every rank", async () => {
      const colls = mesh(n, 64 * 4);
      const xs = inputs(n, len, 11 + len);
      const ref = reference(xs);
      const bufs = xs.map((x) => x.slice());
      await Promise.all(colls.map((c, r) => c.allReduce(bufs[r]!, { step: 3, bucket: 1 })));
      for (const b of bufs) expectNear(b, ref);
      expect(new Set(bufs.map(bitsOf)).size).toBe(1);
    });

    test("reduce-scatter leaves each rank's segment summed; all-gather spreads the segments", async () => {
      const colls = mesh(n, 128 * 4);
      const xs = inputs(n, len, 5);
      const ref = reference(xs);
      const bufs = xs.map((x) => x.slice());
      const segs = await Promise.all(colls.map((c, r) => c.reduceScatter(bufs[r]!, { step: 0, bucket: 0 })));
      segs.forEach((s, r) => {
        expect(s).toEqual(segment(len, n, r));
        expectNear(bufs[r]!, ref, s);
      });
      await Promise.all(colls.map((c, r) => c.allGather(bufs[r]!, { step: 0, bucket: 1 })));
      for (const b of bufs) expectNear(b, ref);
      expect(new Set(bufs.map(bitsOf)).size).toBe(1);
    });

    test("broadcast from every root", async () => {
      for (let root = 0; root < n; root++) {
        const colls = mesh(n, 32 * 4);
        const xs = inputs(n, len, root);
        const bufs = xs.map((x) => x.slice());
        await Promise.all(colls.map((c, r) => c.broadcast(bufs[r]!, root, { step: 1, bucket: root })));
        for (const b of bufs) expect(bitsOf(b)).toBe(bitsOf(xs[root]!));
      }
    });
  });
});

describe("ring: the wire misbehaves", () => {
  test("lost acks (every third piece sent again) and duplicated pieces change nothing", async () => {
    let i = 0;
    const hook: Hook = () => (++i % 3 === 0 ? "drop" : i % 5 === 0 ? "twice" : "deliver");
    const xs = inputs(4, 10_001, 9);
    const clean = xs.map((x) => x.slice()),
      noisy = xs.map((x) => x.slice());
    const a = mesh(4, 256),
      b = mesh(4, 256, { hook });
    await Promise.all(a.map((c, r) => c.allReduce(clean[r]!, { step: 0, bucket: 0 })));
    await Promise.all(b.map((c, r) => c.allReduce(noisy[r]!, { step: 0, bucket: 0 })));
    expect(noisy.map(bitsOf)).toEqual(clean.map(bitsOf));
  });

  test("pieces that arrive before a rank starts the operation wait for it, one operation after another", async () => {
    const colls = mesh(3, 400);
    const xs = inputs(3, 5_000, 2);
    const ref = reference(xs);
    const bufs = xs.map((x) => x.slice());
    // ranks 1 and 2 run ahead: their pieces for rank 0 are held until it starts
    const late = (async () => {
      await Bun.sleep(30);
      await colls[0]!.allReduce(bufs[0]!, { step: 7, bucket: 0 });
    })();
    await Promise.all([
      late,
      colls[1]!.allReduce(bufs[1]!, { step: 7, bucket: 0 }),
      colls[2]!.allReduce(bufs[2]!, { step: 7, bucket: 0 }),
    ]);
    for (const b of bufs) expectNear(b, ref);
    // buckets of one step overlap: all three started before any finished
    const ys = inputs(3, 3_000, 3).map((x) => x.slice());
    const zs = inputs(3, 2_000, 4).map((x) => x.slice());
    const refY = reference(ys.map((y) => y.slice())),
      refZ = reference(zs.map((z) => z.slice()));
    await Promise.all(
      colls.flatMap((c, r) => [
        c.allReduce(ys[r]!, { step: 8, bucket: 0 }),
        c.allReduce(zs[r]!, { step: 8, bucket: 1 }),
      ]),
    );
    for (const y of ys) expectNear(y, refY);
    for (const z of zs) expectNear(z, refZ);
  });

  test("a late rank whose every piece came early still sends its own (2-rank barrier and all-gather)", async () => {
    const colls = mesh(2, 400);
    for (let step = 0; step < 3; step++) {
      const late = (async () => {
        await Bun.sleep(5);
        await colls[0]!.barrier({ step, bucket: 0 });
      })();
      await Promise.all([late, colls[1]!.barrier({ step, bucket: 0 })]);
    }
    const bufs = inputs(2, 50, 1);
    const want = Float32Array.from([...bufs[0]!.subarray(0, 25), ...bufs[1]!.subarray(25)]);
    const late = (async () => {
      await Bun.sleep(5);
      await colls[1]!.allGather(bufs[1]!, { step: 9, bucket: 0 });
    })();
    await Promise.all([late, colls[0]!.allGather(bufs[0]!, { step: 9, bucket: 0 })]);
    for (const b of bufs) expect(bitsOf(b)).toBe(bitsOf(want));
  });

  test("a full early-piece budget makes the sender retry, not fail", async () => {
    const colls = mesh(2, 400, { earlyBytesMax: 2_000 });
    const xs = inputs(2, 20_000, 6);
    const ref = reference(xs);
    const bufs = xs.map((x) => x.slice());
    const late = (async () => {
      await Bun.sleep(50);
      await colls[1]!.allReduce(bufs[1]!, { step: 0, bucket: 0 });
    })();
    await Promise.all([colls[0]!.allReduce(bufs[0]!, { step: 0, bucket: 0 }), late]);
    for (const b of bufs) expectNear(b, ref);
  });

  test("a hostile piece is refused and the operation goes on", async () => {
    const peers = new Map<number, MemoryTransport>();
    const ts = [0, 1].map((r) => new MemoryTransport(r, peers, 400));
    const colls = ts.map((t) => new RingCollective(t, 2, { progressTimeoutMs: 5_000 }));
    // a third party that speaks as rank 0 with a wrong range, and as a rank outside the ring
    const forger = new MemoryTransport(9, peers, 400);
    const bufs = inputs(2, 1_000, 1);
    const ref = reference(bufs.map((b) => b.slice()));
    // rank 1 waits for rank 0's pieces; rank 0 starts once the forged ones were refused
    const waiting = colls[1]!.allReduce(bufs[1]!, { step: 0, bucket: 0 });
    const header = firstPieceToOne("#all-reduce");
    await expect(
      forger.send({ ...header, from: 0, offset: 3, count: 4 }, new Float32Array(4), new AbortController().signal),
    ).rejects.toThrow(/expected \[/);
    await expect(
      forger.send({ ...header, from: 9, offset: 0, count: 100 }, new Float32Array(100), new AbortController().signal),
    ).rejects.toThrow(/rank 9/);
    await Promise.all([waiting, colls[0]!.allReduce(bufs[0]!, { step: 0, bucket: 0 })]);
    for (const b of bufs) expectNear(b, ref);
  });

  test("the same key twice at once is a programmer error", async () => {
    const [a] = mesh(2, 400);
    const p = a!.allReduce(new Float32Array(10), { step: 0, bucket: 0 });
    p.catch(() => {});
    expect(() => a!.allReduce(new Float32Array(10), { step: 0, bucket: 0 })).toThrow(/already running/);
    a!.close("test over");
    await expect(p).rejects.toBeInstanceOf(CollectiveClosedError);
  });
});

describe("ring: a peer fails", () => {
  test("a rank that never joins: the others time out with a typed error", async () => {
    const colls = mesh(3, 400, { timeoutMs: 300 });
    const bufs = inputs(3, 2_000, 1);
    const started = performance.now();
    const results = await Promise.allSettled([0, 1].map((r) => colls[r]!.allReduce(bufs[r]!, { step: 0, bucket: 0 })));
    // the first to time out tells the other, which may hear that before its own deadline
    const reasons = results.map((r) => (r.status === "rejected" ? r.reason : null));
    expect(reasons.some((e) => e instanceof CollectiveTimeoutError)).toBe(true);
    for (const e of reasons)
      expect(e instanceof CollectiveTimeoutError || e instanceof CollectiveAbortedError).toBe(true);
    // the timeout names the rank it waits for: rank 0 hears from rank 2 (which never joined), rank 1 from rank 0
    const timedOut = reasons.filter((e) => e instanceof CollectiveTimeoutError).map((e) => (e as Error).message);
    expect(timedOut.every((m) => /waiting for rank \d|rank \d is gone or stuck/.test(m))).toBe(true);
    if (reasons[0] instanceof CollectiveTimeoutError) expect(reasons[0].message).toContain("from rank 2");
    // within the timeout plus the checker's period, not a hang (a bound on correctness, not speed)
    expect(performance.now() - started).toBeLessThan(10_000);
  });

  test("a rank that closes mid-operation: the others fail at once with its reason", async () => {
    let colls: Collective[] = [];
    let closed = false;
    // rank 2 leaves when the first all-gather piece moves: the reduce-scatter is over, the
    // all-gather has begun
    colls = mesh(3, 64, {
      timeoutMs: 60_000,
      hook: (h) => {
        if (h.phase === "all-gather" && !closed) {
          closed = true;
          queueMicrotask(() => colls[2]!.close("rank 2 is going away"));
        }
        return "deliver";
      },
    });
    const bufs = inputs(3, 5_000, 1);
    const ops = colls.map((c, r) => c.allReduce(bufs[r]!, { step: 0, bucket: 0 }));
    ops.forEach((p) => p.catch(() => {}));
    const e = await expectRejected(() => ops[0]!, CollectiveAbortedError, "rank 2", "going away");
    expect((e as CollectiveAbortedError).peer).toBe(2);
    await expectRejected(() => ops[1]!, CollectiveAbortedError, "rank 2");
    await expectRejected(() => ops[2]!, CollectiveClosedError);
  });
});

describe("hierarchical", () => {
  test("rings of a topology: hosts in order of first appearance, one leader each", () => {
    expect(topologyRings(["a", "b", "a", "b"])).toEqual({
      order: [0, 2, 1, 3],
      byHost: new Map([
        ["a", [0, 2]],
        ["b", [1, 3]],
      ]),
      leaders: [0, 1],
    });
  });

  test.each([[["a", "a", "b", "b"]], [["a", "b", "a", "b"]], [["x", "y", "y", "z"]]])(
    "hosts %j: all-reduce, reduce-scatter, all-gather and broadcast match the flat ring's results",
    async (hosts) => {
      for (const len of [0, 1, 5, 9_999]) {
        const xs = inputs(4, len, len);
        const ref = reference(xs);
        // chunks of 1,000: a buffer of 9,999 goes through the two-dimensional ring in 10 at once
        const h = mesh(4, 128, { hosts, chunkElems: 1_000 });
        const bufs = xs.map((x) => x.slice());
        await Promise.all(h.map((c, r) => c.allReduce(bufs[r]!, { step: 0, bucket: 0 })));
        for (const b of bufs) expectNear(b, ref);
        expect(new Set(bufs.map(bitsOf)).size).toBe(1);

        const rs = xs.map((x) => x.slice());
        const segs = await Promise.all(h.map((c, r) => c.reduceScatter(rs[r]!, { step: 1, bucket: 0 })));
        segs.forEach((s, r) => expectNear(rs[r]!, ref, s));
        await Promise.all(h.map((c, r) => c.allGather(rs[r]!, { step: 1, bucket: 1 })));
        for (const b of rs) expectNear(b, ref);

        const bc = xs.map((x) => x.slice());
        await Promise.all(h.map((c, r) => c.broadcast(bc[r]!, 2, { step: 2, bucket: 0 })));
        for (const b of bc) expect(bitsOf(b)).toBe(bitsOf(xs[2]!));
        await Promise.all(h.map((c) => c.barrier({ step: 3, bucket: 0 })));
      }
    },
  );

  test("hosts of as many ranks each take the two-dimensional ring (every rank carries its segment across hosts); uneven hosts, one leader each", async () => {
    const senders = async (hosts: string[]) => {
      const across = new Set<number>();
      const h = mesh(hosts.length, 256, {
        hosts,
        hook: (hd) => {
          if (hosts[hd.from] !== hosts[hd.to]) across.add(hd.from);
          return "deliver";
        },
      });
      const xs = inputs(hosts.length, 3_000, 9);
      const ref = reference(xs);
      await Promise.all(h.map((c, r) => c.allReduce(xs[r]!, { step: 0, bucket: 0 })));
      for (const b of xs) expectNear(b, ref);
      expect(new Set(xs.map(bitsOf)).size).toBe(1);
      return { twoD: h.map((c) => (c as HierarchicalCollective).across !== null), across: [...across].sort() };
    };
    expect(await senders(["a", "a", "b", "b", "c", "c"])).toEqual({
      twoD: Array(6).fill(true),
      across: [0, 1, 2, 3, 4, 5],
    });
    expect(await senders(["x", "y", "y", "z"])).toEqual({ twoD: Array(4).fill(false), across: [0, 1, 3] });
  });

  test("bytes between hosts: each host sends and receives 2(H-1)/H of the buffer, not the flat ring's share per rank", async () => {
    const hosts = ["a", "a", "b", "b"];
    let crossing = 0;
    const hook = (hd: PieceHeader) => {
      if (hosts[hd.from] !== hosts[hd.to]) crossing += hd.count;
      return "deliver" as const;
    };
    const len = 8_000;
    const h = mesh(4, 256, { hosts, hook });
    const bufs = inputs(4, len, 1);
    await Promise.all(h.map((c, r) => c.allReduce(bufs[r]!, { step: 0, bucket: 0 })));
    // two leaders: each sends half the buffer twice (reduce-scatter and all-gather of 2 ranks)
    expect(crossing).toBe(2 * len);
  });
});

/** One rank's coder: a codec and its error feedback over a buffer of n values. */
function coderOf(kind: string, n: number): WireCoder & { feedback: ErrorFeedback } {
  const feedback = new ErrorFeedback(new Codec(parseCompression(kind)), n);
  let scratch = new Float32Array(0);
  const coder = feedback.wireCoder((words) => {
    if (scratch.length < words) scratch = new Float32Array(words);
    return scratch;
  });
  return { ...coder, feedback };
}

describe("encoded ring (compression)", () => {
  describe.each(["bf16", "fp16", "int8"])("%s", (kind) => {
    test.each([1, 2, 3, 5])(
      "%i ranks: the same bits on every rank, near the float64 sum, and over 4 steps nothing lost (sums + residuals = gradients, float64)",
      async (n) => {
        for (const len of [0, 7, 5_000]) {
          const colls = mesh(n, 64 * 4);
          const coders = colls.map(() => coderOf(kind, len));
          const total = new Float64Array(len),
            given = new Float64Array(len),
            abs = new Float64Array(len);
          for (let step = 0; step < 4; step++) {
            const xs = inputs(n, len, 100 * step + n + len);
            const ref = reference(xs);
            for (const x of xs) for (let i = 0; i < len; i++) (given[i]! += x[i]!), (abs[i]! += Math.abs(x[i]!));
            const bufs = xs.map((x) => x.slice());
            await Promise.all(colls.map((c, r) => c.encodedAllReduce!(bufs[r]!, { step, bucket: 0 }, coders[r]!)));
            expect(new Set(bufs.map(bitsOf)).size).toBe(1);
            for (let i = 0; i < len; i++) total[i]! += bufs[0]![i]!;
            // each value and partial sum rounded once per hop: bf16 keeps 8 bits, fp16 11, int8
            // 7 against its block's largest
            let err = 0,
              mag = 0;
            for (let i = 0; i < len; i++) (err += (bufs[0]![i]! - ref.sum[i]!) ** 2), (mag += ref.sum[i]! ** 2);
            if (len > 0) expect(Math.sqrt(err / mag)).toBeLessThan(kind === "int8" ? 0.05 : 0.01);
          }
          // what the sums did not carry is in the ranks' residuals: only f32 additions are lost
          for (let i = 0; i < len; i++) {
            let kept = total[i]!;
            for (const c of coders) kept += c.feedback.residual[i]!;
            const bound = abs[i]! * 2 ** -23 * 4 * (n + 1) + 1e-30;
            if (!(Math.abs(kept - given[i]!) <= bound))
              throw new Error(`element ${i}: sums + residuals ${kept}, gradients ${given[i]} (bound ${bound})`);
          }
        }
      },
    );
  });

  test("bytes on the wire: bf16 half the f32 ring's, int8 about a quarter", async () => {
    const n = 4,
      len = 8_192;
    const words = async (kind: string | null) => {
      let sent = 0;
      const colls = mesh(n, 1024 * 4, {
        hook: (hd) => {
          sent += hd.count;
          return "deliver";
        },
      });
      const bufs = inputs(n, len, 3);
      await Promise.all(
        colls.map((c, r) =>
          kind === null
            ? c.allReduce(bufs[r]!, { step: 0, bucket: 0 })
            : c.encodedAllReduce!(bufs[r]!, { step: 0, bucket: 0 }, coderOf(kind, len)),
        ),
      );
      return sent;
    };
    const f32 = await words(null);
    expect(f32).toBe(2 * (n - 1) * len);
    expect(await words("bf16")).toBe(f32 / 2);
    const int8 = await words("int8");
    expect(int8 / f32).toBeGreaterThan(0.25);
    expect(int8 / f32).toBeLessThan(0.26);
  });

  test.each([[["a", "a", "b", "b"]], [["x", "y", "y", "z"]]])(
    "hierarchical, hosts %j: f32 within hosts, encoded across them (half the f32 bytes between hosts), the same bits everywhere, and over 3 steps nothing lost",
    async (hosts) => {
      let crossing = 0;
      const hook = (hd: PieceHeader) => {
        if (hosts[hd.from] !== hosts[hd.to]) crossing += hd.count;
        return "deliver" as const;
      };
      const len = 8_000;
      const h = mesh(4, 256, { hosts, hook, chunkElems: 3_000 });
      const coders = h.map(() => coderOf("bf16", len));
      const total = new Float64Array(len),
        given = new Float64Array(len),
        abs = new Float64Array(len);
      let f32 = 0;
      for (let step = 0; step < 3; step++) {
        const xs = inputs(4, len, 2 + step);
        const ref = reference(xs);
        for (const x of xs) for (let i = 0; i < len; i++) (given[i]! += x[i]!), (abs[i]! += Math.abs(x[i]!));
        const bufs = xs.map((x) => x.slice());
        crossing = 0;
        await Promise.all(h.map((c, r) => c.encodedAllReduce!(bufs[r]!, { step, bucket: 0 }, coders[r]!)));
        expect(new Set(bufs.map(bitsOf)).size).toBe(1);
        let err = 0;
        for (let i = 0; i < len; i++) {
          err = Math.max(err, Math.abs(bufs[0]![i]! - ref.sum[i]!) / (ref.bound[i]! * 2 ** 23));
          total[i]! += bufs[0]![i]!;
        }
        // bf16's 8 bits, at each hop and of the residuals carried from the step before
        expect(err).toBeLessThan(2 ** -6);
        if (step === 0) {
          const plain = mesh(4, 256, {
            hosts,
            hook: (hd) => {
              if (hosts[hd.from] !== hosts[hd.to]) f32 += hd.count;
              return "deliver";
            },
          });
          await Promise.all(plain.map((c, r) => c.allReduce(xs[r]!.slice(), { step, bucket: 0 })));
        }
        // half, and at most a word of padding per piece of an odd count
        expect(crossing).toBeGreaterThanOrEqual(f32 / 2);
        expect(crossing).toBeLessThanOrEqual(f32 / 2 + 16);
      }
      for (let i = 0; i < len; i++) {
        let kept = total[i]!;
        for (const c of coders) kept += c.feedback.residual[i]!;
        expect(Math.abs(kept - given[i]!)).toBeLessThanOrEqual(abs[i]! * 2 ** -23 * 4 * 5 + 1e-30);
      }
    },
  );

  test("a piece that does not decode (a negative int8 scale) or has the wrong size is refused, and the operation goes on", async () => {
    const peers = new Map<number, MemoryTransport>();
    const ts = [0, 1].map((r) => new MemoryTransport(r, peers, 4096));
    const colls = ts.map((t) => new RingCollective(t, 2, { progressTimeoutMs: 5_000 }));
    const forger = new MemoryTransport(7, peers, 4096);
    const len = 1_000;
    const bufs = inputs(2, len, 4);
    const ref = reference(bufs);
    const coders = [coderOf("int8", len), coderOf("int8", len)];
    const waiting = colls[1]!.encodedAllReduce!(bufs[1]!.slice(), { step: 0, bucket: 0 }, coders[1]!);
    // rank 1 receives segment 1 (elements 500..999) from rank 0 at hop 0: one scale, 500 int8
    const words = coders[0]!.slotBytes(500) / 4;
    const header = { ...firstPieceToOne("#encoded-all-reduce"), from: 0, offset: 500 };
    const bad = new Float32Array(words);
    bad[0] = -1;
    const never = new AbortController().signal;
    await expect(forger.send({ ...header, count: words }, bad, never)).rejects.toThrow(
      /does not decode: an int8 scale of -1/,
    );
    await expect(forger.send({ ...header, count: 500 }, new Float32Array(500), never)).rejects.toThrow(
      /expected \[500, \+126\)/,
    );
    const mine = bufs.map((b) => b.slice());
    const [, got] = await Promise.all([
      colls[0]!.encodedAllReduce!(mine[0]!, { step: 0, bucket: 0 }, coders[0]!),
      waiting.then(() => null),
    ]);
    expect(got).toBeNull();
    for (let i = 0; i < len; i++) expect(Math.abs(mine[0]![i]! - ref.sum[i]!)).toBeLessThan(0.2);
  });
});
