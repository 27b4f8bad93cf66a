// Training progress: a live bar on a terminal (cli-progress), and on anything else (CI logs,
// pipes, files) one plain line every few seconds. The training loop is synchronous, so
// nothing here may rely on timers: every render happens inside update().
import cliProgress from "cli-progress";

export interface ProgressFields {
  loss: string;
  sps: string;
  extra: string;
}

/** Seconds between plain lines when stdout is not a terminal. */
const plainLineIntervalMs = 5000;

export class Progress {
  readonly #bar: cliProgress.SingleBar | null;
  readonly #total: number;
  readonly #unit: string;
  readonly #t0 = performance.now();
  #fields: ProgressFields = { loss: "-", sps: "-", extra: "" };
  #value = 0;
  #lastLineMs = 0;

  constructor(total: number, unit: string, tty = Boolean(process.stdout.isTTY)) {
    this.#total = total;
    this.#unit = unit;
    this.#bar = tty ? new cliProgress.SingleBar({
      format: `{bar} step {value}/{total} | loss {loss} | {sps} ${unit}/s | {extra}eta {eta_formatted}`,
      barCompleteChar: "█",
      barIncompleteChar: "░",
      barsize: 24,
      hideCursor: true,
      clearOnComplete: false,
      synchronousUpdate: true,
      etaBuffer: 50,
      fps: 10,
    }) : null;
    this.#bar?.start(total, 0, this.#fields);
  }

  update(step: number, fields: ProgressFields): void {
    this.#fields = fields;
    this.#value = step;
    if (this.#bar !== null) {
      this.#bar.update(step, fields);
      return;
    }
    const now = performance.now();
    if (now - this.#lastLineMs >= plainLineIntervalMs || step === this.#total) {
      this.#lastLineMs = now;
      console.log(this.#plainLine());
    }
  }

  #plainLine(): string {
    const f = this.#fields;
    const elapsed = (performance.now() - this.#t0) / 1000;
    return `step ${this.#value}/${this.#total} | loss ${f.loss} | ${f.sps} ${this.#unit}/s | ${f.extra}${elapsed.toFixed(0)} s`;
  }

  /** Print a line above the bar (evaluations, checkpoints). */
  log(line: string): void {
    if (this.#bar === null) {
      console.log(line);
      return;
    }
    // cli-progress has no "print above": stop, print, restart with the same state
    this.#bar.stop();
    console.log(line);
    this.#bar.start(this.#total, this.#value, this.#fields);
  }

  stop(): void {
    if (this.#bar !== null) this.#bar.stop();
    else if (this.#value !== this.#total) console.log(this.#plainLine());
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
