// Typed errors that cross the wire. A service answers a failed request with an ErrorReply
// carrying `code`; the caller's bus rebuilds the same class from it (rebuildError), so code on
// both sides catches `UnknownJobError`, not a string.
import { ConfigError, MeshtrainError } from "../../../ffi/errors.ts";
import { WireFormatError, type WireFormatCode } from "../../../schemas/codec.ts";
import type { ErrorReply } from "../../../schemas/messages/runtime.ts";

/** Every error a service answers with. `code` is stable: it is what crosses the wire. */
export class MeshError extends MeshtrainError {
  override name = "MeshError";
  constructor(code: string, message: string, options?: ErrorOptions) {
    super(message, options, code);
  }
}

const define = (name: string, code: string) =>
  class extends MeshError {
    override name = name;
    constructor(message: string, options?: ErrorOptions) {
      super(code, message, options);
    }
  };

/** A well-formed message whose content is wrong (a shape, a range, a rank). */
export class BadRequestError extends define("BadRequestError", "bad_request") {}
/** The message names a job this service does not run. */
export class UnknownJobError extends define("UnknownJobError", "unknown_job") {}
/** A message or request exceeds a limit of the receiving service. */
export class LimitExceededError extends define("LimitExceededError", "limit_exceeded") {}
/** The service cannot answer yet (not configured, restoring). Retry later. */
export class NotReadyError extends define("NotReadyError", "not_ready") {}
/** A request waited longer than its deadline. */
export class DeadlineError extends define("DeadlineError", "deadline") {}
/** A request whose answer will not come (the connection dropped or came back, a server of the
 *  cluster left, the process that answers it reconnected): asking again is the way on. A bus's
 *  own (it never crosses the wire; across it, a DeadlineError). */
export class RequestLostError extends DeadlineError {}
/** Nobody serves the subject (the service is down or not started yet). */
export class NoRespondersError extends define("NoRespondersError", "no_responders") {}
/** A checkpoint or data file failed its checks. */
export class CorruptDataError extends define("CorruptDataError", "corrupt_data") {}
/** A bug or an unexpected failure inside the service. */
export class InternalError extends define("InternalError", "internal") {}
/** The NATS server runs without JetStream, where the mesh keeps its job specs (KV). */
export class JetStreamUnavailableError extends define("JetStreamUnavailableError", "no_jetstream") {}
/** The job's state does not allow the request: it is not running, it ended already, or it runs. */
export class JobStateError extends define("JobStateError", "job_state") {}
/** The mesh lacks a rank or a service the job needs (a trainer rank, a shard, the data-loader). */
export class CapacityError extends define("CapacityError", "capacity") {}

const classes: Record<string, new (message: string) => MeshtrainError> = {
  bad_request: BadRequestError,
  unknown_job: UnknownJobError,
  limit_exceeded: LimitExceededError,
  not_ready: NotReadyError,
  deadline: DeadlineError,
  no_responders: NoRespondersError,
  corrupt_data: CorruptDataError,
  internal: InternalError,
  config: ConfigError,
  no_jetstream: JetStreamUnavailableError,
  job_state: JobStateError,
  capacity: CapacityError,
};

const wireCodes: readonly WireFormatCode[] = ["truncated", "oversized", "bad_identifier", "bad_version", "malformed"];

/** What a service replies for an error thrown while handling a request on `subject`. */
export function errorReplyOf(e: unknown, subject: string): ErrorReply {
  if ((e instanceof MeshtrainError && e.code !== "") || e instanceof WireFormatError)
    return { code: e.code, message: e.message, subject };
  const message = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
  return { code: "internal", message, subject };
}

/** The typed error an ErrorReply stands for, on the caller's side. */
export function rebuildError(reply: ErrorReply): Error {
  const message = `${reply.message} (from ${reply.subject})`;
  if ((wireCodes as readonly string[]).includes(reply.code))
    return new WireFormatError(reply.code as WireFormatCode, message);
  const Cls = classes[reply.code];
  return Cls ? new Cls(message) : new MeshError(reply.code, message);
}

/** No NATS server of the mesh can be reached (never, or not since it was lost): not an answer of a
 *  service's, so it crosses no wire. */
export class NatsUnreachableError extends MeshtrainError {
  override readonly name = "NatsUnreachableError";
}

/** The server refused this client (TLS or authorization, or an operation its NATS user's role
 *  does not allow): retrying cannot help. */
export class NatsAccessError extends MeshtrainError {
  override readonly name = "NatsAccessError";
}

/** `e` as NatsAccessError saying the client may not `what`, when the server refused it by the
 *  user's permissions; else `e` itself. */
export function refusedAs(e: unknown, what: string): unknown {
  const chain = [e, (e as { cause?: unknown } | undefined)?.cause];
  const denied = chain.some(
    (x) => x instanceof Error && (x.name === "PermissionViolationError" || /permissions? violation/i.test(x.message)),
  );
  return denied
    ? new NatsAccessError(`permission denied: this client's NATS user may not ${what} (its role does not allow it)`, {
        cause: e,
      })
    : e;
}
