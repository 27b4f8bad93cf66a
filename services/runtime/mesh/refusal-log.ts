// What a service refused, in its log: every request a handler answered with an error (a forged
// collective piece, a push of an older generation, a message that does not decode), with the
// subject it came on (whose last token names the sender where the subject does) and the reason.
// A storm of refusals must not flood the log or slow the service: each handler's subject gets at
// most `burst` lines a window, and the rest are counted and said in one line when it ends.
import type { Logger } from "./log.ts";
import { MeshtrainError } from "../../../ffi/errors.ts";

/** Answers, not trouble: "no such job here", "not ready yet", "busy, retry", "no longer here"
 *  (a trainer's run that ended, drained: services/trainer/loop.ts) (debug level only). */
const answerCodes = new Set(["unknown_job", "not_ready", "job_state", "capacity", "no_responders"]);

export const refusalBurst = 5;
export const refusalWindowMs = 10_000;

interface Window {
  logged: number;
  suppressed: number;
  /** the newest refusal not logged, for the summary line */
  last: { subject: string; err: string } | null;
  timer: ReturnType<typeof setTimeout>;
}

export class RefusalLog {
  readonly #windows = new Map<string, Window>();

  constructor(
    private readonly log: Logger | undefined,
    private readonly burst = refusalBurst,
    private readonly windowMs = refusalWindowMs,
  ) {}

  /** A request on `subject`, taken by the handler of `handlerSubject`, was answered with `error`. */
  note(handlerSubject: string, subject: string, error: unknown): void {
    const log = this.log;
    if (log === undefined) return;
    const err = error instanceof Error ? error.message : String(error);
    if (error instanceof MeshtrainError && answerCodes.has(error.code)) {
      log.debug({ subject, err }, "request failed");
      return;
    }
    let w = this.#windows.get(handlerSubject);
    if (w === undefined) {
      const timer = setTimeout(() => this.#end(handlerSubject), this.windowMs);
      timer.unref?.();
      w = { logged: 0, suppressed: 0, last: null, timer };
      this.#windows.set(handlerSubject, w);
    }
    if (w.logged < this.burst) {
      w.logged++;
      log.warn({ subject, err }, "request refused");
      return;
    }
    w.suppressed++;
    w.last = { subject, err };
  }

  #end(handlerSubject: string): void {
    const w = this.#windows.get(handlerSubject);
    this.#windows.delete(handlerSubject);
    if (w === undefined || w.suppressed === 0) return;
    this.log?.warn(
      { handler: handlerSubject, refused: w.suppressed, windowMs: this.windowMs, last: w.last },
      `${w.suppressed} more requests refused in ${this.windowMs / 1000} s (not logged one by one)`,
    );
  }

  /** Says what is counted and stops the windows' timers. */
  close(): void {
    for (const [subject, w] of [...this.#windows]) {
      clearTimeout(w.timer);
      this.#end(subject);
    }
  }
}
