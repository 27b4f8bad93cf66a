// Training progress: a live bar on a terminal (cli-progress), and on anything else (CI logs,
// pipes, files) one plain line every few seconds. The in-process training loops are
// synchronous, so nothing here may rely on timers: every render happens inside update().
//
// Lines printed while the bar runs (evaluations, restores) go above it: the bar is cleared,
// the line printed, the bar drawn again, so no stale copy of the bar stays on screen. When it
// stops, the bar gives way to one plain line with the last figures.
import cliProgress from "cli-progress";
import { formatSeconds } from "./format.ts";

export interface ProgressFields {
  loss: string;
  sps: string;
  /** shown before the eta, e.g. "acc 97.10% | " */
  extra: string;
}

/** Seconds between plain lines when stdout is not a terminal. */
const plainLineIntervalMs = 5000;
/** Steps seen before an eta is shown: the first steps include start-up and say little. */
const etaStepsMin = 5;

export class Progress {
  readonly #bar: cliProgress.SingleBar | null;
  readonly #total: number;
  readonly #unit: string;
  readonly #t0 = performance.now();
  #fields: ProgressFields = { loss: "-", sps: "-", extra: "" };
  #value = 0;
  #lastLineMs = 0;
  #lastLineValue = -1;
  /** when the first update arrived, and at which step: the eta's rate is measured from there */
  #first: { ms: number; step: number } | null = null;
  #stopped = false;

  constructor(total: number, unit: string, tty = Boolean(process.stdout.isTTY)) {
    this.#total = total;
    this.#unit = unit;
    this.#bar = tty
      ? new cliProgress.SingleBar({
          format: `{bar} step {value}/{total} | loss {loss} | {sps} ${unit}/s | {extra}eta {remaining}`,
          barCompleteChar: "█",
          barIncompleteChar: "░",
          barsize: 24,
          hideCursor: true,
          clearOnComplete: true,
          synchronousUpdate: true,
          fps: 10,
        })
      : null;
    this.#bar?.start(total, 0, this.#payload());
  }

  #eta(): string {
    const f = this.#first;
    if (f === null || this.#value - f.step < etaStepsMin) return "-";
    const perStep = (performance.now() - f.ms) / 1000 / (this.#value - f.step);
    return formatSeconds(perStep * (this.#total - this.#value));
  }

  #payload(): ProgressFields & { remaining: string } {
    return { ...this.#fields, remaining: this.#eta() };
  }

  update(step: number, fields: ProgressFields): void {
    if (this.#stopped) return;
    this.#fields = fields;
    this.#value = Math.min(step, this.#total);
    this.#first ??= { ms: performance.now(), step: this.#value };
    if (this.#bar !== null) {
      this.#bar.update(this.#value, this.#payload());
      return;
    }
    const now = performance.now();
    if (now - this.#lastLineMs >= plainLineIntervalMs || this.#value === this.#total) this.#plain(now);
  }

  #plain(now = performance.now()): void {
    if (this.#lastLineValue === this.#value) return; // that line is on screen already
    this.#lastLineMs = now;
    this.#lastLineValue = this.#value;
    console.log(this.line());
  }

  /** The current figures as one plain line. */
  line(): string {
    const f = this.#fields;
    const elapsed = (performance.now() - this.#t0) / 1000;
    return `step ${this.#value}/${this.#total} | loss ${f.loss} | ${f.sps} ${this.#unit}/s | ${f.extra}${formatSeconds(elapsed)}`;
  }

  /** Print a line above the bar (evaluations, checkpoints). */
  log(line: string): void {
    if (this.#bar === null || this.#stopped) {
      console.log(line);
      return;
    }
    // cli-progress has no "print above" for a single bar: clear it, print, draw it again
    this.#bar.stop();
    console.log(line);
    this.#bar.start(this.#total, this.#value, this.#payload());
  }

  /** Ends the display with one plain line of the last figures (once). */
  stop(): void {
    if (this.#stopped) return;
    this.#stopped = true;
    this.#bar?.stop();
    this.#plain();
  }
}

/** Samples per second over a sliding window of recent steps. */
export class RateMeter {
  readonly #times: number[] = [];
  readonly #counts: number[] = [];
  constructor(readonly window = 20) {}

  add(count: number): void {
    this.#times.push(performance.now());
    this.#counts.push(count);
    if (this.#times.length > this.window + 1) {
      this.#times.shift();
      this.#counts.shift();
    }
  }

  get rate(): number {
    if (this.#times.length < 2) return 0;
    const dt = (this.#times[this.#times.length - 1]! - this.#times[0]!) / 1000;
    const n = this.#counts.slice(1).reduce((a, b) => a + b, 0);
    return dt > 0 ? n / dt : 0;
  }
}
