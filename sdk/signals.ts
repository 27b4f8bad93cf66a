// Ctrl-C, SIGTERM and SIGHUP for the commands that run a mesh or follow a job: the first asks for
// a clean stop (the command finishes what it must: a snapshot, stopping processes, saying how to
// resume); the second stops at once, still without leaving processes or folders behind.
export type StopSignal = "SIGINT" | "SIGTERM" | "SIGHUP";
const signals: StopSignal[] = ["SIGINT", "SIGTERM", "SIGHUP"];

export class StopRequests implements Disposable {
  /** aborted at the first signal */
  readonly first = new AbortController();
  /** aborted at the second */
  readonly second = new AbortController();
  #count = 0;
  readonly #handler = (signal: StopSignal) => {
    this.#count++;
    if (this.#count === 1) {
      this.onFirst?.(signal);
      this.first.abort(signal);
    } else {
      this.second.abort(signal);
    }
  };

  constructor(readonly onFirst?: (signal: StopSignal) => void) {
    for (const s of signals) process.on(s, this.#handler);
  }

  get requested(): boolean {
    return this.#count > 0;
  }

  [Symbol.dispose](): void {
    for (const s of signals) process.off(s, this.#handler);
  }
}
