// A job's plan: what follows from its config and its data set, computed once when the job is
// submitted and carried in its spec (JobSpec.plan). The data-loader computes it (it alone reads
// the data: `mt.ctl.plan`); trainers and parameter-server shards read the step count,
// the vocabulary and the parameter vector's layout from the spec, never from the data files.
import type { DataPlan } from "../../../schemas/messages/data-loader.ts";
import type { JobSpec } from "../../../schemas/messages/job.ts";
import { BadRequestError, CorruptDataError } from "../mesh/errors.ts";
import { dataRanks, type JobConfig, stepScheduleOf } from "./config.ts";
import { buildLayout, type Layout } from "./layout.ts";
import { initialParameters } from "./model.ts";

/** What the data-loader found in a job's data set. */
export interface DatasetFacts {
  /** training samples: images, or token windows of blockSize + 1 */
  train: number;
  /** held-out samples evaluated during training (0: none) */
  val: number;
  /** test samples evaluated at the end (0: the validation split is used) */
  test: number;
  /** token data: the vocabulary's size, and its characters when it has them */
  vocabSize: number;
  vocab: number[];
  /** a prepared folder's tokenizer ("gpt2"), or "" */
  tokenizer: string;
}

export const stepsPerEpochOf = (samples: number, W: number, B: number): number => Math.ceil(samples / (W * B));

/** The job's plan from its config and its data set's facts (builds the model once, on the CPU). */
export function jobPlan(cfg: JobConfig, facts: DatasetFacts): DataPlan {
  // steps per epoch with the trainers the job has now; the step count follows its whole world
  const stepsPerEpoch = stepsPerEpochOf(facts.train, dataRanks(cfg), cfg.batchSize);
  const totalSteps = facts.train > 0 ? stepScheduleOf(cfg, facts.train).totalSteps : 0;
  const partial: DataPlan = {
    job: cfg.job,
    trainSamples: facts.train,
    valSamples: facts.val,
    testSamples: facts.test,
    stepsPerEpoch,
    totalSteps,
    vocabSize: facts.vocabSize,
    vocab: facts.vocab,
    slabNumel: 0,
    decayElems: 0,
    paramCount: 0,
    tokenizer: facts.tokenizer,
  };
  // the layout only: a fine-tuned job's tensors are read where it starts, not here
  const init = initialParameters(cfg, partial, undefined, false);
  return { ...partial, slabNumel: init.values.length, decayElems: init.decayElems, paramCount: init.paramCount };
}

/** The plan a job's spec carries (a spec without one comes from an SDK older than the plan). */
export function planOfSpec(spec: JobSpec): DataPlan {
  const plan = spec.plan;
  if (!plan)
    throw new BadRequestError(
      `job spec "${spec.job}" carries no plan; submit it with this version's SDK (meshtrain submit/run), which asks the data-loader for one`,
    );
  if (plan.job !== spec.job) throw new BadRequestError(`job spec "${spec.job}" carries the plan of "${plan.job}"`);
  return plan;
}

/** The chunk layout of the job's parameter vector, as the plan states its size. */
export const planLayout = (cfg: JobConfig, plan: DataPlan): Layout =>
  buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, cfg.shards);

/** Throws when a model built here does not have the vector the plan was made for. */
export function checkPlanLayout(plan: DataPlan, slabNumel: number, decayElems: number): void {
  if (plan.slabNumel !== slabNumel || plan.decayElems !== decayElems) {
    throw new CorruptDataError(
      `the job's plan is for a parameter vector of ${plan.slabNumel} elements (${plan.decayElems} decayed), ` +
        `but its model here has ${slabNumel} (${decayElems}); the plan and the config disagree`,
    );
  }
}
