// Follows a job to its end: a progress bar or plain lines (step, loss, accuracy, samples/s),
// evaluations combined over ranks, restores and checkpoints printed as they happen. The job
// ends with its Ended event; in case that event is lost (NATS core delivers at most once) the
// job's record is read every few seconds too. A job that ended already is answered at once.
import { MeshtrainError } from "../ffi/errors.ts";
import { type Event, EventKind, type JobRecord, JobState } from "../schemas/messages/job.ts";
import { DeadlineError, JobStateError } from "../services/runtime/mesh/errors.ts";
import { EvalTally } from "../services/runtime/job/evals.ts";
import { dataRanks, jobConfigFromJson } from "../services/runtime/job/config.ts";
import { isEnded, jobStoreLeaderWaitMsMax, resizingReasonPrefix, stateName } from "../services/runtime/job/ledger.ts";
import type { MeshClient } from "./client.ts";
import { Progress, RateMeter } from "./progress.ts";
import { orAfter } from "../services/runtime/mesh/timers.ts";
import { printable } from "./format.ts";

export class JobFailedError extends MeshtrainError {
  override readonly name = "JobFailedError";
  constructor(
    message: string,
    readonly record: JobRecord | null = null,
  ) {
    super(message);
  }
}

/** Where a trainer step's time went, in milliseconds (the heartbeats' split). */
export interface StepSplit {
  dataWaitMs: number;
  pullMs: number;
  computeMs: number;
  pushMs: number;
  commMs: number;
  exposedCommMs: number;
}

export interface JobOutcome {
  /** the job's record as it ended */
  record: JobRecord;
  seconds: number;
  restores: number;
  checkpoints: number;
  /** mean over all ranks' steps seen */
  split: StepSplit;
  /** mean per trainer step: gradient and parameter bytes on the bus, and (top-k) the summed gradient's density (-1: none) */
  wireBytesPerStep: number;
  density: number;
  /** samples trained per second, from the first step seen to the last (start-up and the final
   *  evaluation and snapshot are not in it) */
  samplesPerS: number;
  /** the newest step rank 0 reported (0 when none was seen) */
  step: number;
  /** false when the job had ended before watching began */
  watched: boolean;
}

export interface WatchOptions {
  /** no bar and no lines */
  quiet?: boolean;
  /** stop waiting (the outcome is a DeadlineError naming the reason) */
  signal?: AbortSignal;
  /** lines of the caller's (the launcher's restarts), printed above the bar; set by watchJob */
  onLine?: (print: (line: string) => void) => void;
  /** every event, as it arrives (tests, tools) */
  onEvent?: (e: Event) => void;
  /** the job's events from a subscription the caller opened before submitting (client.events),
   *  so that none sent before the watch starts is missed (a restore right after the submit) */
  events?: AsyncIterableIterator<Event>;
}

/** How often the job's record is read besides the events. */
const recordPollMs = 2_000;
/** The ledger writes a job's record before it publishes its Ended event: a watch that read the
 *  ended record first still takes the events up to Ended for this long. */
const endedGraceMs = 1_000;

/** Follows a job to its end. Resolves with the outcome of a job that is done; throws JobFailedError for a failed or cancelled one. */
export async function watchJob(client: MeshClient, name: string, o: WatchOptions = {}): Promise<JobOutcome> {
  const job = client.job(name);
  const t0 = performance.now();
  const events = o.events ?? client.events(job, o.signal);
  // a subscription the caller opened (before submitting) ends at the signal too
  if (o.events !== undefined) o.signal?.addEventListener("abort", () => void events.return?.(), { once: true });
  let record = await client.record(job);
  const cfg = jobConfigFromJson(record.configJson);
  const w = new Watcher(dataRanks(cfg), cfg.epochs, o, cfg.model.kind === "gpt" ? "tokens" : "samples", cfg.maxSteps);
  o.onLine?.((line) => w.say(line));
  try {
    const it = events[Symbol.asyncIterator]();
    let pending: Promise<IteratorResult<Event>> | null = null;
    let lastPoll = performance.now();
    let specMissing = 0;
    /** when the job's services last said something: a job that ran moments ago and lost its spec is ending */
    let lastEventMs = -Infinity;
    const endedBefore = isEnded(record);
    let sawEnded = false;
    while (!isEnded(record)) {
      pending ??= it.next();
      const r = await orAfter(pending, recordPollMs, "tick" as const);
      if (r !== "tick") {
        pending = null;
        if (r.done) {
          if (o.signal?.aborted)
            throw new DeadlineError(`stopped following job ${job}: ${String(o.signal.reason ?? "aborted")}`);
          break;
        }
        lastEventMs = performance.now();
        o.onEvent?.(r.value);
        if (w.handle(r.value, record.totalSteps) === "ended") {
          sawEnded = true;
          record = await client.record(job);
        }
        if (record.totalSteps === 0 && r.value.kind === EventKind.Step) record = await client.record(job);
      }
      if (performance.now() - lastPoll >= recordPollMs) {
        lastPoll = performance.now();
        record = await client.record(job);
        // the ranks that report a step: one per data-parallel copy (pipeline and tensor parallel)
        w.resized(dataRanks(jobConfigFromJson(record.configJson)));
        // running on record, but no spec twice in a row: no service runs it, and none will
        // (a resize takes the spec away for a moment, and says so in the record)
        const paused = record.reason.startsWith(resizingReasonPrefix);
        specMissing = !isEnded(record) && !paused && (await client.jobs.spec(job)) === null ? specMissing + 1 : 0;
        // a job that ends deletes its spec, then writes its record: on a NATS cluster electing a
        // new leader for the records, that write can wait up to jobStoreLeaderWaitMsMax
        if (specMissing >= 2 && performance.now() - lastEventMs > jobStoreLeaderWaitMsMax) {
          throw new JobStateError(
            `job ${job} is recorded as running, but no service runs it (its submission was cut off before the mesh got it); ` +
              `submit it again to resume it: meshtrain submit --job ${job}`,
          );
        }
      }
    }
    if (!isEnded(record)) record = await client.record(job);
    // the record said so first: the events up to Ended (the final evaluation, Done) still come
    const graceUntil = performance.now() + endedGraceMs;
    while (!endedBefore && !sawEnded && !o.signal?.aborted && performance.now() < graceUntil) {
      pending ??= it.next();
      const r = await orAfter(pending, Math.max(1, graceUntil - performance.now()), "tick" as const);
      if (r === "tick" || r.done) break;
      pending = null;
      o.onEvent?.(r.value);
      sawEnded = w.handle(r.value, record.totalSteps) === "ended";
    }
  } finally {
    w.stop();
    await events.return?.();
  }
  const outcome = w.outcome(record, (performance.now() - t0) / 1000);
  if (record.state !== JobState.Done) {
    throw new JobFailedError(
      `job ${job} ${stateName(record.state)}${record.reason ? `: ${record.reason}` : ""}`,
      record,
    );
  }
  return outcome;
}

/** The state of one watch: figures gathered from the events, and the display. */
export class Watcher {
  readonly #rate = new RateMeter(40);
  #tally: EvalTally;
  readonly #split = { dataWaitMs: 0, pullMs: 0, computeMs: 0, pushMs: 0, commMs: 0, exposedCommMs: 0 };
  #wireBytes = 0;
  #density = { sum: 0, n: 0 };
  #progress: Progress | null = null;
  #step = 0;
  #loss = Number.NaN;
  #accuracy = "";
  #restores = 0;
  #checkpoints = 0;
  #stepEvents = 0;
  /** samples of the steps after the first one seen, and when the first and the last arrived */
  #samples = 0;
  #firstStepMs = 0;
  #lastStepMs = 0;
  #watched = false;

  constructor(
    public trainers: number,
    readonly epochs: number,
    readonly o: WatchOptions,
    readonly unit: "samples" | "tokens",
    /** the job's --max-steps (0: none): a run it cuts short has no epoch to name by step */
    readonly maxSteps = 0,
  ) {
    this.#tally = new EvalTally(trainers);
  }

  /** A resize changed the job's trainers: evaluations are combined over the new ranks. */
  resized(trainers: number): void {
    if (trainers === this.trainers) return;
    this.trainers = trainers;
    this.#tally = new EvalTally(trainers);
  }

  /** Prints a line of the job's: its texts came over the bus, so a control character in them
   *  (a CR/LF in a restore's tag) is shown escaped, never acted on. */
  say(text: string): void {
    if (this.o.quiet) return;
    const line = printable(text);
    if (this.#progress) this.#progress.log(line);
    else console.log(line);
  }

  /** Takes one event; "ended" when it ends the job. */
  handle(e: Event, totalSteps: number): "ended" | null {
    this.#watched = true;
    switch (e.kind) {
      case EventKind.Step:
        this.#onStep(e, totalSteps);
        break;
      case EventKind.Eval: {
        const r = this.#tally.add(e);
        if (r) {
          this.#accuracy =
            this.unit === "tokens"
              ? `${r.split} loss ${r.loss.toFixed(3)} | `
              : `${r.split} acc ${(100 * r.accuracy).toFixed(2)}% | `;
          // the epoch a step is in is step / (totalSteps / epochs) only where the epochs set the
          // total: --max-steps may end the run in its first epoch
          const byEpochs = totalSteps > 0 && !(this.maxSteps > 0 && this.maxSteps <= totalSteps);
          const epoch =
            byEpochs && r.step < totalSteps
              ? ` (epoch ${Math.round((r.step * this.epochs) / totalSteps)}/${this.epochs})`
              : "";
          this.say(
            `step ${r.step}${epoch}: ${r.split} loss ${r.loss.toFixed(4)}, accuracy ${(100 * r.accuracy).toFixed(2)}% (${r.evaluated} ${this.unit} over ${r.ranks} trainer${r.ranks === 1 ? "" : "s"})`,
          );
        }
        break;
      }
      case EventKind.Restore:
        this.#restores++;
        // the text says it: "restored step-… (why)"
        this.say(`${e.text}; resuming at step ${e.step}`);
        break;
      case EventKind.Checkpoint:
        this.#checkpoints++;
        break;
      case EventKind.Log:
        this.say(e.text);
        break;
      case EventKind.Failed:
        this.say(`failed: ${e.text}`);
        break;
      case EventKind.Stalled:
        this.say(`stalled: ${e.text}`);
        break;
      case EventKind.Straggler:
        this.say(`straggler: ${e.text}`);
        break;
      case EventKind.Ended:
        return "ended";
    }
    return null;
  }

  #onStep(e: Event, totalSteps: number): void {
    if (e.rank === 0) {
      this.#step = e.step + 1;
      this.#loss = e.loss;
    }
    this.#rate.add(e.count);
    const now = performance.now();
    if (this.#stepEvents === 0) this.#firstStepMs = now;
    else this.#samples += e.count;
    this.#lastStepMs = now;
    this.#stepEvents++;
    this.#split.dataWaitMs += e.dataWaitMs;
    this.#split.pullMs += e.pullMs;
    this.#split.computeMs += e.computeMs;
    this.#split.pushMs += e.pushMs;
    this.#split.commMs += e.commMs;
    this.#split.exposedCommMs += e.exposedCommMs;
    this.#wireBytes += e.wireBytes;
    if (e.density >= 0) {
      this.#density.sum += e.density;
      this.#density.n++;
    }
    if (this.o.quiet || totalSteps === 0) return;
    this.#progress ??= new Progress(totalSteps, "samples");
    this.#progress.update(this.#step, {
      loss: Number.isFinite(this.#loss) ? this.#loss.toFixed(4) : "-",
      sps: this.#rate.rate.toFixed(0),
      extra: this.#accuracy,
    });
  }

  stop(): void {
    this.#progress?.stop();
  }

  outcome(record: JobRecord, seconds: number): JobOutcome {
    const n = Math.max(this.#stepEvents, 1);
    const s = this.#split;
    return {
      record,
      seconds,
      restores: this.#restores,
      checkpoints: this.#checkpoints,
      step: this.#step,
      watched: this.#watched,
      split: {
        dataWaitMs: s.dataWaitMs / n,
        pullMs: s.pullMs / n,
        computeMs: s.computeMs / n,
        pushMs: s.pushMs / n,
        commMs: s.commMs / n,
        exposedCommMs: s.exposedCommMs / n,
      },
      wireBytesPerStep: this.#wireBytes / n,
      density: this.#density.n > 0 ? this.#density.sum / this.#density.n : -1,
      samplesPerS:
        this.#lastStepMs > this.#firstStepMs ? this.#samples / ((this.#lastStepMs - this.#firstStepMs) / 1000) : 0,
    };
  }
}
