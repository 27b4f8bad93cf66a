// The ncclUniqueId of an NCCL communicator travels from rank 0 to the other ranks through the
// JetStream KV bucket `mt-nccl-ids`: rank 0 makes the id (./ffi.ts getUniqueId) and publishes
// it; every other rank waits for it, then all call NcclComm.init with it. The key is
// <owner>.<name>.r<leader>.<group>.<generation>.
//
// Why KV and not a plain publish: a rank that starts waiting after rank 0 published still
// finds the id (a watch delivers the stored value first, then updates), and a rank that
// waits first is woken by the put. One key per (job, group, generation): a communicator that
// is rebuilt after a failure gets a new generation, so no rank can pick up the id of the
// communicator that died. The bucket is not `mt-jobs`: every service watches that one and
// decodes each key as a job spec.
//
// The value is a small fixed record, checked on both sides:
//   bytes 0-3   magic "MTNI"
//   byte  4     format version (1)
//   bytes 5-7   zero
//   bytes 8-11  nranks, uint32 little-endian (waiting ranks check they agree with rank 0)
//   bytes 12-139 the 128 id bytes
//
// This module moves bytes only: no bun:ffi (it was written to sit in services/, which never call
// native code).
import type { KV } from "@nats-io/kv";
import type { StoreBus } from "../mesh/bus.ts";
import { WireFormatError } from "../../../schemas/codec.ts";
import { BadRequestError, DeadlineError, JetStreamUnavailableError } from "../mesh/errors.ts";
import { jobIdPattern, jobNamePattern } from "./subjects.ts";

// ---- limits (the runtime has no limits.ts yet; these belong to this module) --------------------

export const ncclIdsBucket = "mt-nccl-ids";
/** NCCL_UNIQUE_ID_BYTES. Repeated here so that this module loads no native binding; a test checks
 *  it against the binding's constant. */
export const ncclIdBytes = 128;
const headerBytes = 12;
/** The stored record: header + id. */
export const ncclIdRecordBytes = headerBytes + ncclIdBytes;
const magic = [0x4d, 0x54, 0x4e, 0x49]; // "MTNI"
export const ncclIdFormatVersion = 1;
/** The bucket's largest message: JetStream counts the subject and headers (the expected-sequence
 *  header of a create) against it, not just the 140-byte record. Values are checked to the byte
 *  when read; this only bounds what a stray writer can store. */
export const ncclIdMessageBytesMax = 1024;
/** Far above the trainers a job may have (64); bounds the rank count read from the wire. */
export const ncclRanksMax = 1024;
/** Ids matter only while ranks set up a communicator; the server drops older ones. */
export const ncclIdTtlMs = 60 * 60_000;
/** Longest a rank may wait for rank 0's id: ranks of a large job can start minutes apart
 *  (scheduling, image pulls), but not half an hour. */
export const ncclIdWaitMsMax = 30 * 60_000;
/** Generations count communicator rebuilds within a job; a safe integer keeps keys exact. */
const generationMax = Number.MAX_SAFE_INTEGER;

if (ncclIdRecordBytes + 256 > ncclIdMessageBytesMax)
  throw new Error("limits: an NCCL id record and its headers must fit ncclIdMessageBytesMax");

/** Which communicator an id belongs to. */
export interface NcclIdKey {
  job: string;
  /** the global trainer rank that makes and publishes the id (the communicator's rank 0): a
   *  key token of its own, so that the trainer role writes only the ids it leads (roles.ts) */
  leader: number;
  /** the communicator within the job: "dp" for the data-parallel all-reduce, say */
  group: string;
  /** bumped each time the group's communicator is rebuilt */
  generation: number;
}

function kvKey(key: NcclIdKey): string {
  if (!jobIdPattern.test(key.job))
    throw new BadRequestError(`NCCL id key: job ${JSON.stringify(key.job)} is not a job's identity (<owner>.<name>)`);
  if (!jobNamePattern.test(key.group))
    throw new BadRequestError(`NCCL id key: group ${JSON.stringify(key.group)} must be 1-64 letters, digits, _ or -`);
  if (!Number.isSafeInteger(key.generation) || key.generation < 0 || key.generation > generationMax) {
    throw new BadRequestError(`NCCL id key: generation ${key.generation} must be a non-negative integer`);
  }
  if (!Number.isInteger(key.leader) || key.leader < 0 || key.leader >= ncclRanksMax)
    throw new BadRequestError(`NCCL id key: leader ${key.leader} is not a trainer rank`);
  return `${key.job}.${ncclLeaderToken(key.leader)}.${key.group}.${key.generation}`;
}

/** The key token naming a communicator's leader: "r<rank>". */
export const ncclLeaderToken = (rank: number): string => `r${rank}`;

function checkRanks(nranks: number): void {
  if (!Number.isInteger(nranks) || nranks < 1 || nranks > ncclRanksMax)
    throw new BadRequestError(`NCCL id: nranks ${nranks} is outside 1..${ncclRanksMax}`);
}

/** The stored record for `id`; BadRequestError for an id that is not NCCL_UNIQUE_ID_BYTES long. */
export function encodeNcclId(id: Uint8Array, nranks: number): Uint8Array {
  if (id.byteLength !== ncclIdBytes)
    throw new BadRequestError(`an NCCL id is ${ncclIdBytes} bytes, got ${id.byteLength}; refusing to publish it`);
  checkRanks(nranks);
  const out = new Uint8Array(ncclIdRecordBytes);
  out.set(magic, 0);
  out[4] = ncclIdFormatVersion;
  new DataView(out.buffer).setUint32(8, nranks, true);
  out.set(id, headerBytes);
  return out;
}

/** The id and rank count in a stored record; WireFormatError for a record that is not one. */
export function decodeNcclId(data: Uint8Array): { id: Uint8Array; nranks: number } {
  if (data.byteLength < ncclIdRecordBytes)
    throw new WireFormatError("truncated", `an NCCL id record is ${ncclIdRecordBytes} bytes, got ${data.byteLength}`);
  if (data.byteLength > ncclIdRecordBytes)
    throw new WireFormatError("oversized", `an NCCL id record is ${ncclIdRecordBytes} bytes, got ${data.byteLength}`);
  if (magic.some((b, i) => data[i] !== b))
    throw new WireFormatError("bad_identifier", "not an NCCL id record (no MTNI magic)");
  if (data[4] !== ncclIdFormatVersion) {
    throw new WireFormatError(
      "bad_version",
      `NCCL id record format ${data[4]}, this build reads ${ncclIdFormatVersion}: run one meshtrain version across the job`,
    );
  }
  const nranks = new DataView(data.buffer, data.byteOffset, data.byteLength).getUint32(8, true);
  if (nranks < 1 || nranks > ncclRanksMax)
    throw new WireFormatError("malformed", `NCCL id record names ${nranks} ranks (1..${ncclRanksMax})`);
  return { id: data.slice(headerBytes, ncclIdRecordBytes), nranks };
}

const sameBytes = (a: Uint8Array, b: Uint8Array) => a.byteLength === b.byteLength && a.every((v, i) => v === b[i]);

/** What the ranks of a communicator need of the store: rank 0 publishes, the others wait. */
export type NcclIdExchange = Pick<NcclIdStore, "publish" | "wait">;

export class NcclIdStore {
  private constructor(readonly kv: KV) {}

  static async open(bus: StoreBus): Promise<NcclIdStore> {
    try {
      return new NcclIdStore(
        await bus.openBucket(ncclIdsBucket, { history: 1, maxValueSize: ncclIdMessageBytesMax, ttl: ncclIdTtlMs }),
      );
    } catch (e) {
      if ((e as Error).name !== "JetStreamNotEnabled") throw e;
      throw new JetStreamUnavailableError(
        `the NATS server at ${bus.server} runs without JetStream, where ranks exchange NCCL ids ` +
          `(KV bucket ${ncclIdsBucket}); start it with JetStream: nats-server -js (or jetstream {} in its config)`,
        { cause: e },
      );
    }
  }

  /**
   * Rank 0: stores the id for `key`. Publishing the same id again is a no-op (a retry after a
   * lost reply); a different id for a key that has one is BadRequestError: a rebuilt
   * communicator takes the next generation.
   */
  async publish(key: NcclIdKey, id: Uint8Array, nranks: number): Promise<void> {
    const k = kvKey(key);
    const record = encodeNcclId(id, nranks);
    try {
      await this.kv.create(k, record);
    } catch (e) {
      const existing = await this.kv.get(k);
      if (existing === null || existing.operation !== "PUT") throw e; // create failed for another reason
      if (sameBytes(existing.value, record)) return;
      throw new BadRequestError(
        `${k} already has a different NCCL id (${decodeNcclIdSafe(existing.value)}); a rebuilt communicator needs a new generation`,
      );
    }
  }

  /**
   * Every other rank: rank 0's id for `key`, waiting up to timeoutMs for it to be published.
   * DeadlineError on timeout; BadRequestError when rank 0 set the communicator up for a
   * different number of ranks; WireFormatError for a stored value that is not an id record.
   */
  async wait(key: NcclIdKey, nranks: number, timeoutMs: number): Promise<Uint8Array> {
    const k = kvKey(key);
    checkRanks(nranks);
    if (!Number.isFinite(timeoutMs) || timeoutMs <= 0 || timeoutMs > ncclIdWaitMsMax) {
      throw new BadRequestError(`NCCL id wait: timeoutMs ${timeoutMs} is outside (0, ${ncclIdWaitMsMax}]`);
    }
    // the stored value first (if rank 0 was quicker), then later puts
    const watcher = await this.kv.watch({ key: k, ignoreDeletes: true });
    let timer: ReturnType<typeof setTimeout> | undefined;
    const deadline = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () => reject(new DeadlineError(`no NCCL id for ${k} within ${timeoutMs} ms (is rank 0 running?)`)),
        timeoutMs,
      );
    });
    const first = (async () => {
      for await (const e of watcher) {
        if (e.operation === "PUT") return e.value;
      }
      throw new DeadlineError(`the watch on ${k} ended before an NCCL id arrived`);
    })();
    try {
      const record = decodeNcclId(await Promise.race([first, deadline]));
      if (record.nranks !== nranks) {
        throw new BadRequestError(
          `${k}: rank 0 set the communicator up for ${record.nranks} ranks, this rank expects ${nranks}`,
        );
      }
      return record.id;
    } finally {
      clearTimeout(timer);
      watcher.stop();
      // After a timeout, stopping the watch ends `first` with an error nobody waits for.
      first.catch(() => {});
    }
  }

  /** Removes the id (rank 0, once every rank has its communicator); the TTL would anyway. */
  async remove(key: NcclIdKey): Promise<void> {
    await this.kv.purge(kvKey(key));
  }
}

function decodeNcclIdSafe(data: Uint8Array): string {
  try {
    return `for ${decodeNcclId(data).nranks} ranks`;
  } catch (e) {
    return (e as Error).message;
  }
}

/** An exchange over the mesh's `mt-nccl-ids` bucket, opened at its first use (a job on the ring never opens it). */
export function ncclIdExchange(bus: StoreBus): NcclIdExchange {
  let store: Promise<NcclIdStore> | null = null;
  const open = () => {
    store ??= NcclIdStore.open(bus);
    store.catch(() => (store = null)); // the next communicator tries again
    return store;
  };
  return {
    publish: async (key, id, nranks) => (await open()).publish(key, id, nranks),
    wait: async (key, nranks, timeoutMs) => (await open()).wait(key, nranks, timeoutMs),
  };
}
