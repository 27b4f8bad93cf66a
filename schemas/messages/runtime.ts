// The messages services/runtime sends for every process, whatever its role: the error reply to
// a failed request (mesh/bus.ts), the notice that a connection came back (mesh/nats.ts), and
// heartbeats (control/liveness.ts). The decoding contract is in common.ts.
import { finishBytes, guarded, openRoot, schemaVersion } from "../codec.ts";
import { ErrorReply as ErrorReplyT, Heartbeat as HeartbeatT, Reconnected as ReconnectedT } from "../wire.ts";
import { big, builder, num, root, str } from "./common.ts";

// ---- ErrorReply ----------------------------------------------------------------------------

export interface ErrorReply {
  code: string;
  message: string;
  subject: string;
}

const errorRoot = root("ErrorReply", "MTER", (bb) => ErrorReplyT.getRootAsErrorReply(bb));

export function encodeErrorReply(e: ErrorReply): Uint8Array {
  const b = builder(256 + e.message.length);
  const code = str(b, e.code),
    message = str(b, e.message),
    subject = str(b, e.subject);
  return finishBytes(b, ErrorReplyT.createErrorReply(b, schemaVersion, code, message, subject), errorRoot.identifier);
}

/** True when the bytes carry the ErrorReply identifier (checked before decoding a reply). */
export const isErrorReply = (data: Uint8Array): boolean =>
  data.byteLength >= 8 && data[4] === 0x4d && data[5] === 0x54 && data[6] === 0x45 && data[7] === 0x52; // "MTER"

export function decodeErrorReply(data: Uint8Array, bytesMax: number): ErrorReply {
  const r = openRoot(data, errorRoot, bytesMax);
  return guarded("ErrorReply", () => ({
    code: r.code() ?? "",
    message: r.message() ?? "",
    subject: r.subject() ?? "",
  }));
}

// ---- heartbeats ----------------------------------------------------------------------------

export interface Heartbeat {
  job: string;
  /** "trainer 1", "shard 0", "data-loader" */
  who: string;
  step: number;
  /** data, pull, compute, push, collective, eval, checkpoint, serving, idle */
  phase: string;
  /** when the phase began (ms, the sender's clock) */
  phaseMs: number;
  /** a trainer: its last step's time (ms) */
  stepMs: number;
  /** the machine it runs on (empty: not said) */
  host: string;
}

const heartbeatRoot = root("Heartbeat", "MTHB", (bb) => HeartbeatT.getRootAsHeartbeat(bb));

export function encodeHeartbeat(m: Heartbeat): Uint8Array {
  const b = builder(128);
  const job = str(b, m.job),
    who = str(b, m.who),
    phase = str(b, m.phase),
    host = str(b, m.host);
  return finishBytes(
    b,
    HeartbeatT.createHeartbeat(b, schemaVersion, job, who, big(m.step), phase, m.phaseMs, m.stepMs, host),
    heartbeatRoot.identifier,
  );
}

export function decodeHeartbeat(data: Uint8Array, bytesMax: number): Heartbeat {
  const r = openRoot(data, heartbeatRoot, bytesMax);
  return guarded("Heartbeat", () => ({
    job: r.job() ?? "",
    who: r.who() ?? "",
    step: num(r.step()),
    phase: r.phase() ?? "",
    phaseMs: r.phaseMs(),
    stepMs: r.stepMs(),
    host: r.host() ?? "",
  }));
}

// ---- reconnected ----------------------------------------------------------------------------

export interface Reconnected {
  /** the process's connection name */
  who: string;
  /** the subjects it answers requests on (NATS wildcards) */
  subjects: string[];
}

const reconnectedRoot = root("Reconnected", "MTRC", (bb) => ReconnectedT.getRootAsReconnected(bb));

export function encodeReconnected(m: Reconnected): Uint8Array {
  const b = builder(64 + m.who.length * 3 + m.subjects.reduce((n, x) => n + 8 + x.length * 3, 0));
  const who = str(b, m.who);
  const subjects = ReconnectedT.createSubjectsVector(
    b,
    m.subjects.map((x) => str(b, x)),
  );
  return finishBytes(b, ReconnectedT.createReconnected(b, schemaVersion, who, subjects), reconnectedRoot.identifier);
}

export function decodeReconnected(data: Uint8Array, bytesMax: number): Reconnected {
  const r = openRoot(data, reconnectedRoot, bytesMax);
  return guarded("Reconnected", () => ({
    who: r.who() ?? "",
    subjects: Array.from({ length: r.subjectsLength() }, (_, i) => r.subjects(i) ?? ""),
  }));
}
