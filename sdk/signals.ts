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

  /** What the command exits with once stopped: 128 + the first signal's number. */
  get exitCode(): number {
    return signalExitCode[(this.first.signal.reason as StopSignal | undefined) ?? "SIGINT"] ?? 130;
  }

  [Symbol.dispose](): void {
    for (const s of signals) process.off(s, this.#handler);
  }
}

/**
 * Ctrl-C for a command whose work is a loop on this thread (`train`): the first signal asks the
 * loop to end after its current step, to evaluate and write what it has; the handlers then let
 * go, so that a second signal ends the process at once, as if none were handled (128 + its
 * number), even in the middle of a step. The loop must yield to the event loop between steps
 * (betweenSteps) for the first signal to reach it.
 */
export class StopAfterStep implements Disposable {
  #signal: StopSignal | null = null;
  readonly #handler = (signal: StopSignal) => {
    this.#signal = signal;
    this[Symbol.dispose]();
    this.onFirst(signal);
  };

  constructor(readonly onFirst: (signal: StopSignal) => void) {
    for (const s of signals) process.on(s, this.#handler);
  }

  /** the signal that asked for the stop, null while none has */
  get requested(): StopSignal | null {
    return this.#signal;
  }

  /** lets a pending signal's handler run (a step of a loop is synchronous) */
  async betweenSteps(): Promise<void> {
    await new Promise<void>((resolve) => setImmediate(resolve));
  }

  [Symbol.dispose](): void {
    for (const s of signals) process.off(s, this.#handler);
  }
}

/** `train`'s stop (a run of steps on this thread): says what happens through `say`, naming the
 *  step the run stops after (`step()` when the signal comes). */
export function trainStop(say: (line: string) => void, step: () => number): StopAfterStep {
  return new StopAfterStep((signal) =>
    say(
      `${stopName(signal)}: stopping after step ${step()}; the model is evaluated and written (${stopName(signal)} again stops at once, without it)`,
    ),
  );
}

/** The line of a run a signal stopped before its end. */
export const stoppedLine = (signal: StopSignal, step: number, steps: number): string =>
  `stopped by ${stopName(signal)} after ${step} of ${steps} steps`;

/** how a stop is named to the user: Ctrl-C for SIGINT */
export const stopName = (signal: StopSignal): string => (signal === "SIGINT" ? "Ctrl-C" : signal);

/** 128 + the signal's number: what a process a signal stopped exits with */
export const signalExitCode: Record<StopSignal, number> = { SIGHUP: 129, SIGINT: 130, SIGTERM: 143 };
