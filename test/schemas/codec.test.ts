import { describe, expect, test } from "bun:test";
import { Builder } from "flatbuffers";
import { staleFiles } from "../../schemas/build.ts";
import {
  chunkRanges,
  createBytes,
  finishBytes,
  packByBytes,
  schemaVersion,
  WireFormatError,
} from "../../schemas/codec.ts";
import { CollPhase, decodeCollPiece, encodeCollPiece } from "../../schemas/messages/trainer.ts";
import {
  decodeDataPlan,
  encodeDataPlan,
  decodeBatch,
  decodeBatchRequest,
  encodeBatch,
  encodeBatchRequest,
  pixelsToX,
  Split,
} from "../../schemas/messages/data-loader.ts";
import {
  decodeJobRecord,
  encodeJobRecord,
  JobState,
  decodeEvent,
  decodeJobSpec,
  emptyEvent,
  encodeEvent,
  encodeJobSpec,
  EventKind,
  SyncPolicy,
} from "../../schemas/messages/job.ts";
import {
  chunkF32,
  decodePullReply,
  decodePullRequest,
  decodePushReply,
  decodePushRequest,
  decodeShardState,
  DType,
  encodePullReply,
  encodePullRequest,
  encodePushReply,
  encodePushRequest,
  encodeShardState,
  shardStateChecksum,
  withChecksum,
  f32Chunk,
} from "../../schemas/messages/parameter-server.ts";
import { decodeErrorReply, encodeErrorReply, isErrorReply } from "../../schemas/messages/runtime.ts";
import { decodeManifest, encodeManifest } from "../../schemas/messages/checkpoint.ts";
import { CollPiece as CollPieceT, PushRequest as PushRequestT } from "../../schemas/wire.ts";
import { pieceFromOne } from "../helpers/coll-piece.ts";
import { expectThrown } from "../helpers/errors.ts";

const limit = 8 << 20;
const floats = (n: number, seed = 1) => Float32Array.from({ length: n }, (_, i) => Math.sin(i * 0.37 + seed));

/** The same bytes at an odd offset, as NATS hands them out. */
function unaligned(bytes: Uint8Array): Uint8Array {
  const buf = new Uint8Array(bytes.byteLength + 3);
  buf.set(bytes, 3);
  return buf.subarray(3);
}

test("schemas/generated matches what flatc generates from schemas/*.fbs (run `bun run schemas` when this fails)", () => {
  expect(staleFiles()).toEqual([]);
});

describe("round trips, from unaligned payloads", () => {
  test("PushRequest keeps chunk data bit-exact and views it as aligned float32", () => {
    const a = floats(1000),
      b = floats(7, 2);
    const bytes = encodePushRequest({
      job: "j1",
      trainer: 3,
      step: 2 ** 40 + 5,
      chunks: [f32Chunk(4, a), f32Chunk(9, b, 17)],
    });
    const m = decodePushRequest(unaligned(bytes), limit);
    expect({
      job: m.job,
      trainer: m.trainer,
      step: m.step,
      ids: m.chunks.map((c) => c.id),
      versions: m.chunks.map((c) => c.version),
    }).toEqual({
      job: "j1",
      trainer: 3,
      step: 2 ** 40 + 5,
      ids: [4, 9],
      versions: [0, 17],
    });
    expect(chunkF32(m.chunks[0]!)).toEqual(a);
    expect(chunkF32(m.chunks[1]!)).toEqual(b);
    // decoded from the encoder's own (aligned) bytes, the data is 16-byte aligned: viewed, not copied
    const direct = decodePushRequest(bytes, limit);
    expect(direct.chunks[0]!.data.byteOffset % 16).toBe(0);
    expect(chunkF32(direct.chunks[0]!).buffer).toBe(direct.chunks[0]!.data.buffer);
  });

  test("replies, requests, batches, events, job specs, shard states and manifests", () => {
    expect(decodePushReply(unaligned(encodePushReply({ accepted: 3, duplicates: 1, updates: 2 })), limit)).toEqual({
      accepted: 3,
      duplicates: 1,
      updates: 2,
    });
    const pull = decodePullRequest(
      unaligned(encodePullRequest({ job: "j", trainer: 1, step: 9, ids: Uint32Array.of(5, 1, 7) })),
      limit,
    );
    expect({ ...pull, ids: [...pull.ids] }).toEqual({
      job: "j",
      trainer: 1,
      step: 9,
      ids: [5, 1, 7],
      dtype: DType.F32,
    });
    expect(
      decodePullRequest(
        unaligned(encodePullRequest({ job: "j", trainer: 1, step: 9, ids: Uint32Array.of(5), dtype: DType.BF16 })),
        limit,
      ).dtype,
    ).toBe(DType.BF16);
    // a sparse top-k chunk: nnz entries of (index, value), nnz <= count; a dense chunk with nnz is malformed
    const sparse = new Uint8Array(16);
    new Uint32Array(sparse.buffer, 0, 2).set([3, 9]);
    new Float32Array(sparse.buffer, 8, 2).set([0.5, -2]);
    const top = decodePushRequest(
      unaligned(
        encodePushRequest({
          job: "j",
          trainer: 0,
          step: 1,
          chunks: [{ id: 2, version: 0, dtype: DType.TopK, scale: 1, count: 10, data: sparse, nnz: 2 }],
        }),
      ),
      limit,
    ).chunks[0]!;
    expect([top.dtype, top.count, top.nnz, top.data.byteLength]).toEqual([DType.TopK, 10, 2, 16]);
    for (const [nnz, count] of [
      [3, 10],
      [2, 1],
    ]) {
      const bad = encodePushRequest({
        job: "j",
        trainer: 0,
        step: 1,
        chunks: [{ id: 2, version: 0, dtype: DType.TopK, scale: 1, count: count!, data: sparse, nnz }],
      });
      expect(() => decodePushRequest(bad, limit)).toThrow(WireFormatError);
    }
    const pr = decodePullReply(unaligned(encodePullReply(12, [f32Chunk(1, floats(33), 12)])), limit);
    expect(pr.updates).toBe(12);
    expect(chunkF32(pr.chunks[0]!)).toEqual(floats(33));
    expect(
      decodeBatchRequest(
        unaligned(encodeBatchRequest({ job: "j", rank: 1, split: Split.Val, credits: 4, step: 3 })),
        limit,
      ),
    ).toEqual({
      job: "j",
      rank: 1,
      split: Split.Val,
      credits: 4,
      step: 3,
    });
    const batch = {
      epoch: 2,
      index: 7,
      sampleIds: Uint32Array.of(9, 3),
      rows: 2,
      cols: 3,
      x: floats(6),
      y: Int32Array.of(4, 1),
      endOfEpoch: false,
    };
    expect(decodeBatch(unaligned(encodeBatch(batch)), limit)).toEqual(batch);
    // images as 8-bit pixels: x comes back as the values the pixels stand for, bit for bit
    const values = Float32Array.from({ length: 256 }, (_, v) => (v / 255 - 0.1307) / 0.3081);
    const pixels = Uint8Array.of(0, 17, 255, 128, 3, 99);
    const fromPixels = decodeBatch(
      unaligned(encodeBatch({ ...batch, x: new Float32Array(0) }, { pixels, values })),
      limit,
    );
    expect(fromPixels).toEqual({ ...batch, x: Float32Array.from(pixels, (p) => values[p]!) });
    // decoded four pixels at a time: every length, the pixels at every byte offset
    const all = Uint8Array.from({ length: 40 }, (_, i) => (i * 37 + 11) & 255);
    for (let n = 0; n <= 13; n++)
      for (let offset = 0; offset < 4; offset++) {
        const px = all.subarray(offset, offset + n);
        expect([n, offset, pixelsToX("Batch", px, values)]).toEqual([
          n,
          offset,
          Float32Array.from(px, (p) => values[p]!),
        ]);
      }
    const ev = { ...emptyEvent("j", EventKind.Step), step: 5, loss: 0.5, text: "héllo" };
    expect(decodeEvent(unaligned(encodeEvent(ev)), limit)).toEqual(ev);
    const spec = {
      job: "j",
      trainers: 2,
      shards: 3,
      sync: SyncPolicy.SSP,
      staleness: 2,
      configJson: '{"a":1}',
      attempt: 3,
    };
    expect(decodeJobSpec(unaligned(encodeJobSpec(spec)), limit)).toEqual(spec);
    const state = {
      job: "j",
      shard: 1,
      updates: 4,
      optimizerSteps: 4,
      step: 4,
      chunks: [{ id: 3, version: 4, params: floats(5), state: [{ name: "m", data: floats(5, 3) }] }],
      parts: 3,
      generation: 1_795_000_000_000,
      lossScale: 1024,
      slabRanges: false,
      rank: 0,
      part: 0,
      checksum: 0n,
    };
    expect(decodeShardState(unaligned(encodeShardState(state)), limit)).toEqual(state);
    // a parameter server's part 2 of 3, its checksum over the contents (not where it goes)
    const part = withChecksum({ ...state, part: 2 });
    expect(part.checksum).toBe(shardStateChecksum({ ...state, shard: 0, parts: 1, part: 0, generation: 9, rank: 7 }));
    expect(part.checksum).not.toBe(shardStateChecksum({ ...state, step: 5 }));
    expect(decodeShardState(unaligned(encodeShardState(part)), limit)).toEqual(part);
    // a ZeRO rank's partition: slab ranges of rank 3
    const partition = { ...state, slabRanges: true, rank: 3 };
    expect(decodeShardState(unaligned(encodeShardState(partition)), limit)).toEqual(partition);
    const manifest = {
      formatVersion: 1,
      job: "j",
      id: "step-10",
      step: 10,
      createdMs: 1.5e12,
      metric: 0.97,
      configJson: "{}",
      files: [{ name: "ps-0.bin", bytes: 123, crc32: 0xdeadbeef }],
      cursors: [10, 10],
      modelPath: "/d/j/model.mtm",
    };
    expect(decodeManifest(unaligned(encodeManifest(manifest)), limit)).toEqual(manifest);
    const plan = {
      job: "j",
      trainSamples: 60_000,
      valSamples: 0,
      testSamples: 10_000,
      stepsPerEpoch: 235,
      totalSteps: 2350,
      vocabSize: 3,
      vocab: [65, 0x1f600, 10],
      slabNumel: 1024,
      decayElems: 512,
      paramCount: 1000,
      tokenizer: "",
    };
    expect(decodeDataPlan(unaligned(encodeDataPlan(plan)), limit)).toEqual(plan);
    expect(decodeDataPlan(encodeDataPlan({ ...plan, vocab: [], tokenizer: "gpt2" }), limit).tokenizer).toBe("gpt2");
    expect(() => decodeDataPlan(encodeDataPlan({ ...plan, vocab: [], tokenizer: "sentencepiece" }), limit)).toThrow(
      WireFormatError,
    );
    const planned = {
      job: "j",
      trainers: 2,
      shards: 1,
      sync: SyncPolicy.AllReduce,
      staleness: 0,
      configJson: "{}",
      attempt: 3,
      plan,
    };
    expect(decodeJobSpec(unaligned(encodeJobSpec(planned)), limit)).toEqual(planned);
    expect(decodeJobSpec(encodeJobSpec({ ...planned, plan: undefined }), limit).plan).toBeUndefined();
    // a plan whose vocabulary disagrees with its size, or whose layout cannot be, is refused
    expect(() => decodeDataPlan(encodeDataPlan({ ...plan, vocabSize: 4 }), limit)).toThrow(WireFormatError);
    expect(() => decodeDataPlan(encodeDataPlan({ ...plan, decayElems: 2048 }), limit)).toThrow(WireFormatError);
    const rec = {
      job: "j",
      state: JobState.Failed,
      configJson: "{}",
      submittedMs: 1.7e12,
      endedMs: 1.7e12 + 5,
      totalSteps: 2350,
      evalStep: 235,
      accuracy: 0.5,
      loss: 1.25,
      evaluated: 10_000,
      evalSplit: "test",
      reason: "trainer 1: ünicode",
      snapshot: "step-000000235",
      modelPath: "/m.mtm",
      snapshotDir: "/d",
      attempts: 2,
    };
    expect(decodeJobRecord(unaligned(encodeJobRecord(rec)), limit)).toEqual(rec);
    const err = encodeErrorReply({ code: "unknown_job", message: "no job x", subject: "mt.x.ps.0.push" });
    expect(isErrorReply(err)).toBe(true);
    expect(decodeErrorReply(unaligned(err), limit)).toEqual({
      code: "unknown_job",
      message: "no job x",
      subject: "mt.x.ps.0.push",
    });
  });
});

describe("bad input is a WireFormatError with a code", () => {
  const good = encodePushRequest({ job: "j", trainer: 0, step: 1, chunks: [f32Chunk(0, floats(64))] });
  const code = (fn: () => unknown) => (expectThrown(fn, WireFormatError) as WireFormatError).code;
  /** A batch of 2 samples of 3 values each, less its x (which each test sets). */
  const twoByThree = {
    epoch: 0,
    index: 0,
    sampleIds: Uint32Array.of(1, 2),
    rows: 2,
    cols: 3,
    y: Int32Array.of(1, 2),
    endOfEpoch: false,
  };

  test("truncated, empty, garbage, wrong identifier, oversized", () => {
    expect(code(() => decodePushRequest(new Uint8Array(0), limit))).toBe("truncated");
    expect(code(() => decodePushRequest(good.subarray(0, 5), limit))).toBe("truncated");
    expect(code(() => decodePushRequest(crypto.getRandomValues(new Uint8Array(500)), limit))).toBe("bad_identifier");
    expect(
      code(() =>
        decodePushRequest(encodePullRequest({ job: "j", trainer: 0, step: 0, ids: new Uint32Array(1) }), limit),
      ),
    ).toBe("bad_identifier");
    expect(code(() => decodePushRequest(good, 100))).toBe("oversized");
  });

  test("a buffer cut short after the header is truncated or malformed, never a crash or silent garbage", () => {
    for (const n of [8, 16, 40, good.byteLength - 200, good.byteLength - 1]) {
      const cut = good.slice(0, n);
      expect(["truncated", "malformed"]).toContain(code(() => decodePushRequest(cut, limit)));
    }
  });

  test("random garbage behind a valid identifier is rejected", () => {
    let rejected = 0;
    for (let i = 0; i < 200; i++) {
      const bytes = crypto.getRandomValues(new Uint8Array(16 + (i % 64) * 8));
      bytes.set(new TextEncoder().encode("MTPS"), 4);
      try {
        decodePushRequest(bytes, limit);
      } catch (e) {
        expect(e).toBeInstanceOf(WireFormatError);
        rejected++;
      }
    }
    expect(rejected).toBeGreaterThan(190);
  });

  test("a schema version other than ours", () => {
    const b = new Builder(64);
    const job = b.createString("j");
    const bytes = finishBytes(b, PushRequestT.createPushRequest(b, schemaVersion + 1, job, 0, 0n, 0), "MTPS");
    expect(
      expectThrown(() => decodePushRequest(bytes, limit), WireFormatError, "schema version 2", "speaks 1"),
    ).toHaveProperty("code", "bad_version");
  });

  test("chunk byte count that disagrees with its element count", () => {
    const c = { ...f32Chunk(0, floats(8)), count: 9 };
    expect(
      code(() => decodePushRequest(encodePushRequest({ job: "j", trainer: 0, step: 0, chunks: [c] }), limit)),
    ).toBe("malformed");
    const f16 = { ...f32Chunk(0, floats(8)), dtype: DType.F16 }; // 32 bytes, 8 elements of 2 bytes is 16
    expect(
      code(() => decodePushRequest(encodePushRequest({ job: "j", trainer: 0, step: 0, chunks: [f16] }), limit)),
    ).toBe("malformed");
  });

  test("a batch whose shapes disagree", () => {
    const bad = { ...twoByThree, x: floats(5) };
    expect(code(() => decodeBatch(encodeBatch(bad), limit))).toBe("malformed");
  });

  test("a shared-memory collective piece that carries data as well", () => {
    const b = new Builder(256);
    const job = b.createString("j"),
      group = b.createString("#all-reduce"),
      reason = b.createString("");
    const data = createBytes(b, new Uint8Array(8));
    const off = CollPieceT.createCollPiece(
      b,
      schemaVersion,
      job,
      1n,
      group,
      1,
      0,
      0n,
      0,
      CollPhase.ReduceScatter,
      0,
      0,
      0n,
      2,
      data,
      reason,
      7,
      0,
    );
    expect(code(() => decodeCollPiece(finishBytes(b, off, "MTCP"), limit))).toBe("malformed");
    const ok = decodeCollPiece(
      encodeCollPiece(pieceFromOne("j", 1), new Float32Array(2), { nonce: 7, slot: 1 }),
      limit,
    );
    expect([ok.count, ok.data.byteLength, ok.shmNonce, ok.shmSlot]).toEqual([2, 0, 7, 1]);
  });

  test("a batch of pixels: too few, non-finite or missing pixel values, pixels beside x, the wrong count", () => {
    const m = { ...twoByThree, x: new Float32Array(0) };
    const pixels = Uint8Array.of(0, 1, 2, 3, 4, 255);
    const values = Float32Array.from({ length: 256 }, (_, v) => v / 10);
    const nan = values.slice();
    nan[7] = Number.NaN;
    for (const [what, batch, px] of [
      ["255 values", m, { pixels, values: values.subarray(0, 255) }],
      ["a NaN value", m, { pixels, values: nan }],
      ["no values", m, { pixels, values: new Float32Array(0) }],
      ["x as well", { ...m, x: floats(6) }, { pixels, values }],
      ["5 pixels for 2x3", m, { pixels: pixels.subarray(0, 5), values }],
    ] as const) {
      expect([what, code(() => decodeBatch(encodeBatch(batch, px), limit))]).toEqual([what, "malformed"]);
    }
  });
});

describe("bulk vectors", () => {
  test("createBytes writes what the generated element-by-element builder writes, aligned", () => {
    const data = new Uint8Array(floats(301).buffer);
    const b = new Builder(16);
    const off = createBytes(b, data);
    b.finish(off);
    const out = b.asUint8Array();
    const start = out.byteLength - (out.byteLength - 0); // the root is the vector itself
    const vecPos = new DataView(out.buffer, out.byteOffset).getUint32(start, true);
    expect(new DataView(out.buffer, out.byteOffset).getUint32(vecPos, true)).toBe(data.byteLength);
    expect((vecPos + 4) % 16).toBe(0);
    expect(out.subarray(vecPos + 4, vecPos + 4 + data.byteLength)).toEqual(data);
  });
});

describe("chunking", () => {
  test("chunkRanges covers the vector exactly once", () => {
    expect(chunkRanges(10, 4)).toEqual([
      { offset: 0, count: 4 },
      { offset: 4, count: 4 },
      { offset: 8, count: 2 },
    ]);
    expect(chunkRanges(0, 4)).toEqual([]);
    expect(() => chunkRanges(10, 0)).toThrow(RangeError);
  });

  test("packByBytes keeps every message under the limit and every item once, in order", () => {
    const sizes = [300, 500, 200, 900, 100, 100, 700];
    const groups = packByBytes(sizes, (s) => s, 2048);
    expect(groups.flat()).toEqual(sizes);
    for (const g of groups) expect(1024 + g.reduce((s, x) => s + x + 64, 0)).toBeLessThanOrEqual(2048);
    expect(() => packByBytes([5000], (s) => s, 2048)).toThrow("cannot fit");
  });
});
