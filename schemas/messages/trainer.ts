// The trainers' messages: the pieces of a collective between ranks (mt.<job>.coll.<rank>) and a
// trainer's memory stats (mt.<job>.trainer.<rank>.stats). The decoding contract is in common.ts.
import { bytesOf, createBytes, finishBytes, guarded, openRoot, schemaVersion, WireFormatError } from "../codec.ts";
import { CollPhase, CollPiece as CollPieceT, TrainerStats as TrainerStatsT } from "../wire.ts";
import { big, builder, num, root, str } from "./common.ts";

export { CollPhase };

// ---- trainer stats -------------------------------------------------------------------------

export interface TrainerStats {
  job: string;
  rank: number;
  step: number;
  /** ZeRO stage (0 in parameter-server mode) and the ranks the model state is cut among */
  zeroStage: number;
  ranks: number;
  paramCount: number;
  paramBytes: number;
  gradBytes: number;
  optimizerBytes: number;
  bucketBytes: number;
  arenaPeakBytes: number;
  wireBytes: number;
  /** offload: host memory the optimizer runs in */
  hostBytes: number;
  /** ZeRO stage 3: the most parameter bytes gathered at once */
  gatheredPeakBytes: number;
}

const trainerStatsRoot = root("TrainerStats", "MTTS", (bb) => TrainerStatsT.getRootAsTrainerStats(bb));

export function encodeTrainerStats(m: TrainerStats): Uint8Array {
  const b = builder(256);
  const job = str(b, m.job);
  return finishBytes(
    b,
    TrainerStatsT.createTrainerStats(
      b,
      schemaVersion,
      job,
      m.rank,
      big(m.step),
      m.zeroStage,
      m.ranks,
      big(m.paramCount),
      big(m.paramBytes),
      big(m.gradBytes),
      big(m.optimizerBytes),
      big(m.bucketBytes),
      big(m.arenaPeakBytes),
      big(m.wireBytes),
      big(m.hostBytes),
      big(m.gatheredPeakBytes),
    ),
    trainerStatsRoot.identifier,
  );
}

export function decodeTrainerStats(data: Uint8Array, bytesMax: number): TrainerStats {
  const r = openRoot(data, trainerStatsRoot, bytesMax);
  return guarded("TrainerStats", () => ({
    job: r.job() ?? "",
    rank: r.rank(),
    step: num(r.step()),
    zeroStage: r.zeroStage(),
    ranks: r.ranks(),
    paramCount: num(r.paramCount()),
    paramBytes: num(r.paramBytes()),
    gradBytes: num(r.gradBytes()),
    optimizerBytes: num(r.optimizerBytes()),
    bucketBytes: num(r.bucketBytes()),
    arenaPeakBytes: num(r.arenaPeakBytes()),
    wireBytes: num(r.wireBytes()),
    hostBytes: num(r.hostBytes()),
    gatheredPeakBytes: num(r.gatheredPeakBytes()),
  }));
}

// ---- collective pieces ---------------------------------------------------------------------

export interface CollPiece {
  job: string;
  generation: number;
  group: string;
  from: number;
  to: number;
  step: number;
  bucket: number;
  phase: CollPhase;
  hop: number;
  piece: number;
  /** element offset in the operation's buffer */
  offset: number;
  count: number;
  /** count f32 values; any byte alignment (added or copied straight from the payload) */
  data: Uint8Array;
  /** Abort: why the sender gave the operation up */
  reason: string;
  /** nonzero: data is empty; the values are in slot shmSlot of the sender's shared-memory file with this nonce */
  shmNonce: number;
  shmSlot: number;
}

const collRoot = root("CollPiece", "MTCP", (bb) => CollPieceT.getRootAsCollPiece(bb));
/** Bytes a piece's message needs besides its data. */
export const collPieceOverheadBytes = 512;

/**
 * `values` are written straight into the message (one copy); with `shm` they are in a shared
 * memory slot, and the message carries their count and the slot instead.
 */
export function encodeCollPiece(
  m: Omit<CollPiece, "data" | "count" | "shmNonce" | "shmSlot">,
  values: Float32Array,
  shm?: { nonce: number; slot: number },
): Uint8Array {
  const inline = shm === undefined ? values : new Float32Array(0);
  const b = builder(collPieceOverheadBytes + inline.byteLength + m.reason.length * 3);
  const job = str(b, m.job),
    group = str(b, m.group),
    reason = str(b, m.reason);
  const data = createBytes(b, bytesOf(inline));
  return finishBytes(
    b,
    CollPieceT.createCollPiece(
      b,
      schemaVersion,
      job,
      big(m.generation),
      group,
      m.from,
      m.to,
      big(m.step),
      m.bucket,
      m.phase,
      m.hop,
      m.piece,
      big(m.offset),
      values.length,
      data,
      reason,
      shm?.nonce ?? 0,
      shm?.slot ?? 0,
    ),
    collRoot.identifier,
  );
}

export function decodeCollPiece(data: Uint8Array, bytesMax: number): CollPiece {
  const r = openRoot(data, collRoot, bytesMax, { align: false }); // byte vectors only: no aligned copy
  const m = guarded("CollPiece", () => ({
    job: r.job() ?? "",
    generation: num(r.generation()),
    group: r.group() ?? "",
    from: r.from(),
    to: r.to(),
    step: num(r.step()),
    bucket: r.bucket(),
    phase: r.phase(),
    hop: r.hop(),
    piece: r.piece(),
    offset: num(r.offset()),
    count: r.count(),
    data: r.dataArray() ?? new Uint8Array(0),
    reason: r.reason() ?? "",
    shmNonce: r.shmNonce(),
    shmSlot: r.shmSlot(),
  }));
  if (CollPhase[m.phase] === undefined) throw new WireFormatError("malformed", `CollPiece: unknown phase ${m.phase}`);
  if (m.shmNonce !== 0) {
    if (m.data.byteLength !== 0)
      throw new WireFormatError("malformed", `CollPiece: ${m.data.byteLength} data bytes in a shared-memory piece`);
  } else if (m.data.byteLength !== m.count * 4)
    throw new WireFormatError("malformed", `CollPiece: ${m.data.byteLength} data bytes for ${m.count} float32`);
  return m;
}
