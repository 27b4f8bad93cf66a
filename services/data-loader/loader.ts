// The data of one job on the loader: its data set (sources.ts: MNIST images or token windows),
// and batches addressed by (rank, step) per the distributed sampler (sampler.ts).
// Prefetching: after answering step s of a rank, the loader prepares steps s+1 .. s+credits
// in the background (bounded by prefetchMax), so the next request is answered at once.
import { type DataPlan, Split } from "../../schemas/messages/data-loader.ts";
import { BadRequestError } from "../runtime/mesh/errors.ts";
import { dataRanks, type JobConfig, stepScheduleOf } from "../runtime/job/config.ts";
import { jobPlan, stepsPerEpochOf } from "../runtime/job/plan.ts";
import { prefetchMax, waitSamplesMax } from "./limits.ts";
import { epochIds, rankSlice } from "./sampler.ts";
import type { StepSchedule } from "../runtime/job/world.ts";
import { type Dataset, type JobSource, jobSource, readDataset } from "./sources.ts";

export class JobData {
  readonly stepsPerEpoch: number;
  readonly totalSteps: number;
  readonly #steps: StepSchedule;
  readonly train: Uint32Array;
  readonly val: Uint32Array;
  readonly plan: DataPlan;
  readonly #source: JobSource;
  #epochCache: { epoch: number; ids: Uint32Array } | null = null;
  /** per rank: prepared batches by step */
  readonly #ready: Map<number, Uint8Array>[];
  batches = 0;
  hits = 0;
  misses = 0;
  readonly startedMs = performance.now();
  readonly #waits: number[] = [];

  /**
   * The job's data from its data set. `plan`: the one its spec carries, which must be the plan of
   * this data (a file that changed since the job was submitted refuses the job); absent: computed.
   */
  constructor(
    readonly cfg: JobConfig,
    dataset: Dataset,
    plan?: DataPlan,
  ) {
    this.#source = jobSource(cfg, dataset);
    this.train = this.#source.train;
    this.val = this.#source.val;
    this.plan = plan ?? jobPlan(cfg, this.#source.facts);
    const f = this.#source.facts,
      p = this.plan;
    if (
      p.trainSamples !== f.train ||
      p.valSamples !== f.val ||
      p.testSamples !== f.test ||
      p.vocabSize !== f.vocabSize ||
      p.vocab.join() !== f.vocab.join()
    ) {
      throw new BadRequestError(
        `job ${cfg.job} was planned for ${p.trainSamples} training, ${p.valSamples} validation and ${p.testSamples} test samples` +
          `${p.vocabSize ? ` of a ${p.vocabSize}-token vocabulary` : ""}, but its data set now has ${f.train}, ${f.val} and ${f.test}` +
          `${f.vocabSize ? ` of ${f.vocabSize}` : ""}: the data changed since the job was submitted`,
      );
    }
    this.#steps = stepScheduleOf(cfg, f.train);
    if (
      p.stepsPerEpoch !== stepsPerEpochOf(f.train, dataRanks(cfg), cfg.batchSize) ||
      p.totalSteps !== this.#steps.totalSteps
    )
      throw new BadRequestError(
        `job ${cfg.job}'s plan has ${p.stepsPerEpoch} steps per epoch and ${p.totalSteps} in all, its config other counts`,
      );
    this.stepsPerEpoch = p.stepsPerEpoch;
    this.totalSteps = p.totalSteps;
    this.#ready = Array.from({ length: dataRanks(cfg) }, () => new Map());
  }

  get queueDepth(): number {
    return this.#ready.reduce((s, m) => s + m.size, 0);
  }

  #epoch(epoch: number): Uint32Array {
    if (this.#epochCache?.epoch !== epoch)
      this.#epochCache = { epoch, ids: epochIds(this.train, this.cfg.seed, epoch) };
    return this.#epochCache.ids;
  }

  /** The samples rank `rank` trains on at `step` (empty when the job's steps are done). */
  trainIds(rank: number, step: number): Uint32Array {
    if (step >= this.totalSteps) return new Uint32Array(0);
    const place = this.#steps.at(step);
    const { start, count } = rankSlice(place, rank);
    return this.#epoch(place.epoch).slice(start, start + count);
  }

  /** Each step's epoch, samples and world (services/runtime/job/world.ts). */
  get steps(): StepSchedule {
    return this.#steps;
  }

  #encodeTrain(rank: number, step: number): Uint8Array {
    const ids = this.trainIds(rank, step);
    if (step >= this.totalSteps) return this.#source.trainBatch(ids, this.cfg.epochs, 0, true);
    const at = this.#steps.at(step);
    return this.#source.trainBatch(ids, at.epoch, at.index, false);
  }

  /** Evaluation batch `index` of rank `rank`'s share of the validation or test split. */
  #encodeEval(rank: number, split: Split, index: number): Uint8Array {
    const all = split === Split.Test ? null : this.val;
    const W = dataRanks(this.cfg),
      rows = this.#source.evalRows;
    // --eval-batches: the first evalBatches x rows samples of the split, shared as usual
    const whole = all === null ? this.plan.testSamples : all.length;
    const n = this.cfg.evalBatches > 0 ? Math.min(whole, this.cfg.evalBatches * rows) : whole;
    const lo = Math.floor((rank * n) / W),
      hi = Math.floor(((rank + 1) * n) / W);
    const start = lo + index * rows;
    const count = Math.max(0, Math.min(rows, hi - start));
    const ids =
      all === null ? Uint32Array.from({ length: count }, (_, i) => start + i) : all.slice(start, start + count);
    return this.#source.evalBatch(split, ids, index);
  }

  /** The reply to a batch request; prepares the following ones for the rank. */
  next(rank: number, split: Split, step: number, credits: number): Uint8Array {
    const ranks = dataRanks(this.cfg);
    if (!(rank < ranks))
      throw new BadRequestError(`rank ${rank} is not in job ${this.cfg.job} (ranks 0..${ranks - 1})`);
    const started = performance.now();
    if (split !== Split.Train) {
      if (split === Split.Val && this.val.length === 0)
        throw new BadRequestError(`job ${this.cfg.job} holds out no validation split (valFraction 0); ask for Test`);
      if (split === Split.Test && this.plan.testSamples === 0)
        throw new BadRequestError(`job ${this.cfg.job}'s data set has no test split; ask for Val`);
      if (split !== Split.Val && split !== Split.Test) throw new BadRequestError(`unknown split ${split}`);
      return this.#encodeEval(rank, split, step);
    }
    const ready = this.#ready[rank]!;
    let reply = ready.get(step);
    if (reply) this.hits++;
    else {
      this.misses++;
      reply = this.#encodeTrain(rank, step);
    }
    // what is behind the trainer is never asked for again (a restore asks for an older step,
    // which is prepared on demand)
    for (const s of ready.keys()) if (s <= step) ready.delete(s);
    this.batches++;
    this.#recordWait(performance.now() - started);
    this.#prefetch(rank, step, Math.min(credits, prefetchMax));
    return reply;
  }

  #prefetch(rank: number, step: number, credits: number): void {
    const ready = this.#ready[rank]!;
    const todo: number[] = [];
    for (let s = step + 1; s <= step + credits && s < this.totalSteps; s++) if (!ready.has(s)) todo.push(s);
    // one batch per macrotask, so requests of other ranks are answered in between
    const work = () => {
      const s = todo.shift();
      if (s === undefined || ready.size >= prefetchMax) return;
      ready.set(s, this.#encodeTrain(rank, s));
      setImmediate(work);
    };
    if (todo.length > 0) setImmediate(work);
  }

  #recordWait(ms: number): void {
    if (this.#waits.length >= waitSamplesMax) this.#waits.shift();
    this.#waits.push(ms);
  }

  waitPercentile(p: number): number {
    if (this.#waits.length === 0) return 0;
    const sorted = [...this.#waits].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))]!;
  }
}

/** The plan of a job whose data set is readable here (what `mt.ctl.plan` answers; benchmarks and tests). */
export const planHere = (cfg: JobConfig): DataPlan => new JobData(cfg, readDataset(cfg)).plan;
