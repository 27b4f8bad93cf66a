// The NCCL id exchange on a real nats-server: rank 0 publishes, the other ranks (each on its
// own connection) get the very same 128 bytes whether they started waiting before or after;
// wrong sizes, a rank-count mismatch, a reused generation and a timeout are typed errors.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Kvm } from "@nats-io/kv";
import { type WireFormatCode, WireFormatError } from "../../schemas/codec.ts";
import { ncclUniqueIdBytes } from "../../ffi/cuda/nccl.ts";
import { BadRequestError, DeadlineError } from "../../services/runtime/mesh/errors.ts";
import {
  decodeNcclId,
  encodeNcclId,
  ncclIdBytes,
  ncclIdRecordBytes,
  ncclIdsBucket,
  NcclIdStore,
} from "../../services/runtime/job/nccl-id.ts";
import { clientBus, startNatsServer } from "../helpers/mesh.ts";

const timeoutMs = 10_000;

function idOf(seed: number): Uint8Array {
  return Uint8Array.from({ length: ncclIdBytes }, (_, i) => (i * 31 + seed) & 0xff);
}

async function rejection(p: Promise<unknown>): Promise<Error> {
  const e = await p.then(
    () => null,
    (x: unknown) => x,
  );
  if (!(e instanceof Error)) throw new Error("expected the promise to reject");
  return e;
}

describe("NCCL id record", () => {
  test("matches the binding's id size and round-trips", () => {
    expect(ncclIdBytes).toBe(ncclUniqueIdBytes);
    const id = idOf(3);
    const record = encodeNcclId(id, 8);
    expect(record.byteLength).toBe(ncclIdRecordBytes);
    expect(decodeNcclId(record)).toEqual({ id, nranks: 8 });
  });

  test.each([0, 127, 129, 256])("a %d-byte id is refused before it is sent", (n) => {
    expect(() => encodeNcclId(new Uint8Array(n), 2)).toThrow(BadRequestError);
  });

  test("a received record that is not one is a WireFormatError with the reason", () => {
    const good = encodeNcclId(idOf(1), 2);
    const cases: [Uint8Array, WireFormatCode][] = [
      [good.slice(0, 139), "truncated"],
      [new Uint8Array([...good, 0]), "oversized"],
      [Uint8Array.from(good, (b, i) => (i === 0 ? 0x58 : b)), "bad_identifier"],
      [Uint8Array.from(good, (b, i) => (i === 4 ? 9 : b)), "bad_version"],
      [Uint8Array.from(good, (b, i) => (i >= 8 && i < 12 ? 0 : b)), "malformed"],
    ];
    for (const [data, code] of cases) {
      let error: unknown;
      try {
        decodeNcclId(data);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(WireFormatError);
      expect((error as WireFormatError).code).toBe(code);
    }
  });
});

describe("NCCL id exchange over NATS", () => {
  let server: Awaited<ReturnType<typeof startNatsServer>>;
  let buses: Awaited<ReturnType<typeof clientBus>>[];
  let ranks: NcclIdStore[];

  beforeAll(async () => {
    server = await startNatsServer();
    buses = await Promise.all([0, 1, 2].map(() => clientBus(server.url)));
    ranks = await Promise.all(buses.map((b) => NcclIdStore.open(b)));
  }, 60_000);

  afterAll(async () => {
    for (const b of buses ?? []) await b.close();
    await server?.stop();
  });

  test("ranks that wait before and after rank 0 publishes get identical bytes", async () => {
    const key = { job: "t.ncclj", leader: 0, group: "dp", generation: 0 };
    const id = idOf(7);
    const early = ranks[1]!.wait(key, 3, timeoutMs); // waiting before the id exists
    await ranks[0]!.publish(key, id, 3);
    const [a, b] = await Promise.all([early, ranks[2]!.wait(key, 3, timeoutMs)]); // and after
    expect([...a]).toEqual([...id]);
    expect([...b]).toEqual([...id]);
  });

  test("each generation has its own id; a reused generation with another id is refused", async () => {
    const gen0 = { job: "t.ncclgen", leader: 0, group: "dp", generation: 0 };
    const gen1 = { ...gen0, generation: 1 };
    await ranks[0]!.publish(gen0, idOf(1), 2);
    await ranks[0]!.publish(gen0, idOf(1), 2); // a retry of the same publish is fine
    expect(await rejection(ranks[0]!.publish(gen0, idOf(2), 2))).toBeInstanceOf(BadRequestError);
    await ranks[0]!.publish(gen1, idOf(2), 2);
    expect([...(await ranks[1]!.wait(gen1, 2, timeoutMs))]).toEqual([...idOf(2)]);
    expect([...(await ranks[1]!.wait(gen0, 2, timeoutMs))]).toEqual([...idOf(1)]);
  });

  test("a wrong-size id is refused on the sending side and on the receiving side", async () => {
    const key = { job: "t.ncclsize", leader: 0, group: "dp", generation: 0 };
    expect(await rejection(ranks[0]!.publish(key, new Uint8Array(127), 2))).toBeInstanceOf(BadRequestError);
    expect(await rejection(ranks[0]!.publish(key, new Uint8Array(129), 2))).toBeInstanceOf(BadRequestError);
    // a value written around publish (an older or foreign writer) is checked when read
    const kv = await new Kvm(buses[0]!.nc).open(ncclIdsBucket);
    await kv.put("t.ncclsize.r0.dp.0", new Uint8Array(ncclIdBytes)); // the bare id, no record header
    const e = await rejection(ranks[1]!.wait(key, 2, timeoutMs));
    expect(e).toBeInstanceOf(WireFormatError);
    expect((e as WireFormatError).code).toBe("truncated");
  });

  test("a rank expecting a different number of ranks is told so", async () => {
    const key = { job: "t.ncclnranks", leader: 0, group: "dp", generation: 0 };
    await ranks[0]!.publish(key, idOf(5), 4);
    const e = await rejection(ranks[1]!.wait(key, 2, timeoutMs));
    expect(e).toBeInstanceOf(BadRequestError);
    expect(e.message).toContain("4 ranks");
  });

  test("waiting for an id nobody publishes is a DeadlineError", async () => {
    const e = await rejection(ranks[1]!.wait({ job: "t.nccltimeout", leader: 0, group: "dp", generation: 0 }, 2, 50));
    expect(e).toBeInstanceOf(DeadlineError);
    expect(e.message).toContain("nccltimeout.r0.dp.0");
  });

  test("bad keys and limits are BadRequestError", async () => {
    const id = idOf(0);
    for (const key of [
      { job: "bad job", leader: 0, group: "dp", generation: 0 },
      { job: "no-owner", leader: 0, group: "dp", generation: 0 },
      { job: "t.ok", leader: 0, group: "a.b", generation: 0 },
      { job: "t.ok", leader: 0, group: "dp", generation: -1 },
      { job: "t.ok", leader: 0, group: "dp", generation: 0.5 },
      { job: "t.ok", leader: -1, group: "dp", generation: 0 },
      { job: "t.ok", leader: 1.5, group: "dp", generation: 0 },
    ]) {
      expect(await rejection(ranks[0]!.publish(key, id, 2))).toBeInstanceOf(BadRequestError);
    }
    expect(
      await rejection(ranks[0]!.publish({ job: "t.ok", leader: 0, group: "dp", generation: 0 }, id, 0)),
    ).toBeInstanceOf(BadRequestError);
    expect(
      await rejection(ranks[1]!.wait({ job: "t.ok", leader: 0, group: "dp", generation: 0 }, 2, 0)),
    ).toBeInstanceOf(BadRequestError);
  });

  test("remove purges the id", async () => {
    const key = { job: "t.ncclremove", leader: 0, group: "dp", generation: 0 };
    await ranks[0]!.publish(key, idOf(9), 2);
    await ranks[0]!.remove(key);
    expect(await rejection(ranks[1]!.wait(key, 2, 50))).toBeInstanceOf(DeadlineError);
  });
});
