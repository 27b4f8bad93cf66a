// Shared memory under the collective's NATS transport, for ranks on one machine (NCCL's SHM
// transport, in spirit): a piece's values are written into a slot of a file in /dev/shm that
// sender and receiver both map, and the NATS request carries only the piece's header and the
// slot's number. The NATS server then moves a few hundred bytes per piece instead of the
// piece, and neither side encodes, copies through sockets or decodes the values: the receiver
// adds them in straight from the sender's slot.
//
// One file per (job, communicator generation, sender, receiver), written by the sender only:
// `windowPieces` slots of `pieceBytesMax`, behind a 64-byte header (magic, nonce, slot size,
// slots). A slot is the sender's until the piece's request is answered; the receiver reads the
// values before it answers (the ring copies the pieces it must hold), so the answer frees the
// slot. The receiver builds the path from the piece's checked fields (never from a path in a
// message), checks the header against the piece, and bounds-checks the slot. Once the first
// piece through a file is taken the receiver has mapped it, and the sender unlinks it: the
// memory lives as long as the two mappings, and nothing is left in /dev/shm by a crash after
// that point.
//
// Who is on the same machine is learned, not configured: every inline piece's answer carries
// the receiver's machine identity (boot id and the /dev/shm mount's device and inode, which
// differ between containers that do not share /dev/shm); a sender whose identity matches
// switches that peer to shared memory. A receiver that cannot map a file answers with
// `shmRefusedPrefix`, and the sender goes back to inline pieces for that peer.
import { closeSync, openSync, readFileSync, statSync, unlinkSync, writeSync } from "node:fs";
import { join } from "node:path";

export const shmDir = "/dev/shm";
const magic = 0x4d_54_53_4d; // "MTSM"
const headerBytes = 64;
/** An answer's error text that means "send this peer its pieces inline". */
export const shmRefusedPrefix = "shared memory unavailable: ";

let identity: string | null | undefined;

/** This machine's identity as far as shared memory goes, or null when it has no /dev/shm. */
export function shmIdentity(): string | null {
  if (identity !== undefined) return identity;
  try {
    const st = statSync(shmDir);
    let boot = "";
    try {
      boot = readFileSync("/proc/sys/kernel/random/boot_id", "utf8").trim();
    } catch {
      boot = "no-boot-id";
    }
    identity = `shm:${boot}:${st.dev}:${st.ino}`;
  } catch {
    identity = null;
  }
  return identity;
}

/** The segment's file: from the job's hash, never the name itself (any characters may be in it). */
export function shmPath(job: string, generation: number, from: number, to: number, nonce: number): string {
  const jobHash = Bun.hash(job).toString(16);
  return join(shmDir, `meshtrain-${jobHash}-g${generation}-${from}to${to}-${nonce.toString(16)}`);
}

/** Where rank `rank` of a job's communicator answers its same-machine peers (services/runtime/transport/local-link.ts). */
export function shmSocketPath(job: string, generation: number, rank: number): string {
  return join(shmDir, `meshtrain-${Bun.hash(job).toString(16)}-g${generation}-r${rank}.sock`);
}

const slotStride = (pieceBytesMax: number) => Math.ceil(pieceBytesMax / 64) * 64;

/** The sender's side: a file of slots it writes pieces into. */
export class ShmOutbox {
  readonly #map: Uint8Array;
  readonly #free: number[];
  readonly #stride: number;
  #path: string | null;

  private constructor(
    path: string,
    map: Uint8Array,
    readonly nonce: number,
    readonly slots: number,
    pieceBytesMax: number,
  ) {
    this.#path = path;
    this.#map = map;
    this.#stride = slotStride(pieceBytesMax);
    this.#free = Array.from({ length: slots }, (_, i) => slots - 1 - i);
  }

  /**
   * Creates and maps the file, writing every byte (tmpfs allocates on write: a full /dev/shm
   * fails here, with an error, instead of killing the process on its first piece). Null when
   * that fails: the peer gets its pieces inline.
   */
  static create(
    job: string,
    generation: number,
    from: number,
    to: number,
    slots: number,
    pieceBytesMax: number,
  ): ShmOutbox | null {
    const nonce = 1 + Math.floor(Math.random() * 0xffff_fffe);
    const path = shmPath(job, generation, from, to, nonce);
    const bytes = headerBytes + slots * slotStride(pieceBytesMax);
    let fd = -1;
    try {
      fd = openSync(path, "wx", 0o600);
      const header = new DataView(new ArrayBuffer(headerBytes));
      header.setUint32(0, magic, true);
      header.setUint32(4, nonce, true);
      header.setUint32(8, slotStride(pieceBytesMax), true);
      header.setUint32(12, slots, true);
      writeSync(fd, new Uint8Array(header.buffer));
      const zeros = new Uint8Array(Math.min(bytes - headerBytes, 4 << 20));
      for (let left = bytes - headerBytes; left > 0; left -= zeros.length)
        writeSync(fd, zeros, 0, Math.min(left, zeros.length));
      closeSync(fd);
      fd = -1;
      return new ShmOutbox(path, Bun.mmap(path, { shared: true }), nonce, slots, pieceBytesMax);
    } catch {
      if (fd >= 0) closeSync(fd);
      try {
        unlinkSync(path);
      } catch {}
      return null;
    }
  }

  /** A free slot, or null when every slot holds a piece in flight. */
  take(): number | null {
    return this.#free.pop() ?? null;
  }

  release(slot: number): void {
    this.#free.push(slot);
  }

  write(slot: number, values: Float32Array): void {
    this.#map.set(
      new Uint8Array(values.buffer, values.byteOffset, values.byteLength),
      headerBytes + slot * this.#stride,
    );
  }

  /** The receiver has mapped the file: its name is no longer needed. */
  unlink(): void {
    if (this.#path === null) return;
    try {
      unlinkSync(this.#path);
    } catch {}
    this.#path = null;
  }
}

/** The receiver's side: the files of the peers that send through shared memory, mapped. */
export class ShmInbox {
  readonly #maps = new Map<number, { nonce: number; map: Uint8Array; stride: number; slots: number }>();

  constructor(
    readonly job: string,
    readonly generation: number,
    readonly rank: number,
  ) {}

  /** The bytes of a piece in `from`'s slot; throws (with shmRefusedPrefix) what cannot be read. */
  read(from: number, nonce: number, slot: number, count: number): Uint8Array {
    let m = this.#maps.get(from);
    if (m === undefined || m.nonce !== nonce) {
      const path = shmPath(this.job, this.generation, from, this.rank, nonce);
      let map: Uint8Array;
      try {
        map = Bun.mmap(path, { shared: true });
      } catch (e) {
        throw new Error(`${shmRefusedPrefix}cannot map ${path}: ${(e as Error).message}`);
      }
      const h = new DataView(map.buffer, map.byteOffset, Math.min(map.byteLength, headerBytes));
      if (map.byteLength < headerBytes || h.getUint32(0, true) !== magic || h.getUint32(4, true) !== nonce) {
        throw new Error(`${shmRefusedPrefix}${path} is not the segment the piece names`);
      }
      const stride = h.getUint32(8, true),
        slots = h.getUint32(12, true);
      if (stride % 64 !== 0 || headerBytes + stride * slots > map.byteLength)
        throw new Error(`${shmRefusedPrefix}${path} has a bad header`);
      m = { nonce, map, stride, slots };
      this.#maps.set(from, m); // a newer file of the same sender replaces the older
    }
    if (!(slot < m.slots)) throw new RangeError(`slot ${slot} of ${m.slots}`);
    if (!(count * 4 <= m.stride)) throw new RangeError(`${count} float32 exceed the slot's ${m.stride} bytes`);
    const at = headerBytes + slot * m.stride;
    return m.map.subarray(at, at + count * 4);
  }
}
