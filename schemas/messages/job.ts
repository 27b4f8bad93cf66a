// A job's messages, kept by services/runtime/job: its spec (the mt-jobs KV bucket every service
// follows) and its record (mt-job-records), its events (mt.<job>.events.<kind>), and the small
// request the services answer for a job (JobRequest: a snapshot, a restore, a recovery, a norm,
// a resize). The decoding contract is in common.ts.
import { finishBytes, guarded, openRoot, schemaVersion, verifyTable, WireFormatError } from "../codec.ts";
import {
  DataPlan as DataPlanT,
  Event as EventT,
  EventKind,
  JobRecord as JobRecordT,
  JobRequest as JobRequestT,
  JobSpec as JobSpecT,
  JobState,
  SyncPolicy,
} from "../wire.ts";
import { big, builder, num, root, str } from "./common.ts";
import { type DataPlan, readDataPlan, writeDataPlan } from "./data-loader.ts";

export { EventKind, JobState, SyncPolicy };

// ---- events --------------------------------------------------------------------------------

export interface Event {
  job: string;
  kind: EventKind;
  rank: number;
  step: number;
  timeMs: number;
  loss: number;
  lr: number;
  /** -1 when the event carries none */
  accuracy: number;
  samplesPerS: number;
  dataWaitMs: number;
  pullMs: number;
  computeMs: number;
  pushMs: number;
  text: string;
  /** Eval: samples evaluated */
  count: number;
  /** Step, all-reduce mode: the collectives' time, and the part the step waited for after compute */
  commMs: number;
  exposedCommMs: number;
  /** Step: gradient and parameter bytes this rank moved on the bus for the step, as encoded */
  wireBytes: number;
  /** Step, all-reduce with top-k: share of the summed gradient not zero (-1: none) */
  density: number;
  /** Step, rank 0: time the step waited at its boundary for a snapshot */
  snapshotMs: number;
  /** Restore, all-reduce mode: the communicator generation of the replica load it announces (0: any) */
  generation: number;
}

export const emptyEvent = (job: string, kind: EventKind): Event => ({
  job,
  kind,
  rank: 0,
  step: 0,
  timeMs: Date.now(),
  loss: 0,
  lr: 0,
  accuracy: -1,
  samplesPerS: 0,
  dataWaitMs: 0,
  pullMs: 0,
  computeMs: 0,
  pushMs: 0,
  text: "",
  count: 0,
  commMs: 0,
  exposedCommMs: 0,
  wireBytes: 0,
  density: -1,
  snapshotMs: 0,
  generation: 0,
});

const eventRoot = root("Event", "MTEV", (bb) => EventT.getRootAsEvent(bb));

export function encodeEvent(m: Event): Uint8Array {
  const b = builder(256 + m.text.length * 3);
  const job = str(b, m.job),
    text = str(b, m.text);
  return finishBytes(
    b,
    EventT.createEvent(
      b,
      schemaVersion,
      job,
      m.kind,
      m.rank,
      big(m.step),
      m.timeMs,
      m.loss,
      m.lr,
      m.accuracy,
      m.samplesPerS,
      m.dataWaitMs,
      m.pullMs,
      m.computeMs,
      m.pushMs,
      text,
      m.count,
      m.commMs,
      m.exposedCommMs,
      m.wireBytes,
      m.density,
      m.snapshotMs,
      big(m.generation),
    ),
    eventRoot.identifier,
  );
}

export function decodeEvent(data: Uint8Array, bytesMax: number): Event {
  const r = openRoot(data, eventRoot, bytesMax);
  return guarded("Event", () => ({
    job: r.job() ?? "",
    kind: r.kind(),
    rank: r.rank(),
    step: num(r.step()),
    timeMs: r.timeMs(),
    loss: r.loss(),
    lr: r.lr(),
    accuracy: r.accuracy(),
    samplesPerS: r.samplesPerS(),
    dataWaitMs: r.dataWaitMs(),
    pullMs: r.pullMs(),
    computeMs: r.computeMs(),
    pushMs: r.pushMs(),
    text: r.text() ?? "",
    count: r.count(),
    commMs: r.commMs(),
    exposedCommMs: r.exposedCommMs(),
    wireBytes: r.wireBytes(),
    density: r.density(),
    snapshotMs: r.snapshotMs(),
    generation: num(r.generation()),
  }));
}

// ---- job spec ------------------------------------------------------------------------------

export interface JobSpec {
  job: string;
  trainers: number;
  shards: number;
  sync: SyncPolicy;
  staleness: number;
  configJson: string;
  /** the submission of the job name this spec belongs to (its record's attempts); 0: not known */
  attempt?: number;
  /** the job's plan, computed at submission (absent: a request for one, `mt.ctl.plan`) */
  plan?: DataPlan;
}

const jobRoot = root("JobSpec", "MTJS", (bb) => JobSpecT.getRootAsJobSpec(bb));

export function encodeJobSpec(m: JobSpec): Uint8Array {
  const b = builder(512 + m.configJson.length * 3 + (m.plan?.vocab.length ?? 0) * 4);
  const job = str(b, m.job),
    config = str(b, m.configJson);
  const plan = m.plan ? writeDataPlan(b, m.plan) : 0;
  JobSpecT.startJobSpec(b);
  JobSpecT.addSchemaVersion(b, schemaVersion);
  JobSpecT.addJob(b, job);
  JobSpecT.addTrainers(b, m.trainers);
  JobSpecT.addShards(b, m.shards);
  JobSpecT.addSync(b, m.sync);
  JobSpecT.addStaleness(b, m.staleness);
  JobSpecT.addConfigJson(b, config);
  JobSpecT.addAttempt(b, m.attempt ?? 0);
  if (plan !== 0) JobSpecT.addPlan(b, plan);
  return finishBytes(b, JobSpecT.endJobSpec(b), jobRoot.identifier);
}

export function decodeJobSpec(data: Uint8Array, bytesMax: number): JobSpec {
  const r = openRoot(data, jobRoot, bytesMax);
  return guarded("JobSpec", () => ({
    job: r.job() ?? "",
    trainers: r.trainers(),
    shards: r.shards(),
    sync: r.sync(),
    staleness: r.staleness(),
    configJson: r.configJson() ?? "",
    attempt: r.attempt(),
    ...planField(r.plan()),
  }));
}

function planField(p: DataPlanT | null): { plan?: DataPlan } {
  if (p === null) return {};
  verifyTable(p.bb!, p.bb_pos, "JobSpec.plan");
  return { plan: readDataPlan(p) };
}

// ---- job requests --------------------------------------------------------------------------

export interface JobRequest {
  job: string;
  step: number;
  tag: string;
  /** ps.<k>.norm's reply: a shard's sum of squares; a trainer's ckpt.recover after a failed
   *  collective: the communicator generation that failed (absent: 0) */
  value?: number;
}

const jobRequestRoot = root("JobRequest", "MTJR", (bb) => JobRequestT.getRootAsJobRequest(bb));

/** A request's job name and tag are short words (a tag names a part, a snapshot or a reason):
 *  longer ones are refused, so that no text copied from a request into an event or a log is large. */
export const jobRequestTextMax = 256;

export function encodeJobRequest(m: JobRequest): Uint8Array {
  const b = builder(128);
  const job = str(b, m.job),
    tag = str(b, m.tag);
  return finishBytes(
    b,
    JobRequestT.createJobRequest(b, schemaVersion, job, big(m.step), tag, m.value ?? 0),
    jobRequestRoot.identifier,
  );
}

export function decodeJobRequest(data: Uint8Array, bytesMax: number): JobRequest {
  const r = openRoot(data, jobRequestRoot, bytesMax);
  return guarded("JobRequest", () => {
    const value = r.value();
    const job = r.job() ?? "",
      tag = r.tag() ?? "";
    for (const [what, text] of [
      ["job name", job],
      ["tag", tag],
    ] as const)
      if (text.length > jobRequestTextMax)
        throw new WireFormatError(
          "malformed",
          `a JobRequest's ${what} of ${text.length} characters (at most ${jobRequestTextMax})`,
        );
    return { job, step: num(r.step()), tag, ...(value !== 0 ? { value } : {}) };
  });
}

// ---- job record ----------------------------------------------------------------------------

export interface JobRecord {
  job: string;
  state: JobState;
  configJson: string;
  submittedMs: number;
  /** 0 while running */
  endedMs: number;
  /** 0 until the data-loader has planned the job */
  totalSteps: number;
  /** the newest evaluation over every rank (accuracy -1: none yet) */
  evalStep: number;
  accuracy: number;
  loss: number;
  evaluated: number;
  evalSplit: string;
  reason: string;
  snapshot: string;
  modelPath: string;
  snapshotDir: string;
  attempts: number;
}

const jobRecordRoot = root("JobRecord", "MTJB", (bb) => JobRecordT.getRootAsJobRecord(bb));

export function encodeJobRecord(m: JobRecord): Uint8Array {
  const texts = [m.job, m.configJson, m.evalSplit, m.reason, m.snapshot, m.modelPath, m.snapshotDir];
  const b = builder(512 + texts.reduce((s, t) => s + t.length * 3, 0));
  const [job, config, split, reason, snapshot, modelPath, snapshotDir] = texts.map((t) => str(b, t)) as [
    number,
    number,
    number,
    number,
    number,
    number,
    number,
  ];
  return finishBytes(
    b,
    JobRecordT.createJobRecord(
      b,
      schemaVersion,
      job,
      m.state,
      config,
      m.submittedMs,
      m.endedMs,
      big(m.totalSteps),
      big(m.evalStep),
      m.accuracy,
      m.loss,
      m.evaluated,
      split,
      reason,
      snapshot,
      modelPath,
      snapshotDir,
      m.attempts,
    ),
    jobRecordRoot.identifier,
  );
}

export function decodeJobRecord(data: Uint8Array, bytesMax: number): JobRecord {
  const r = openRoot(data, jobRecordRoot, bytesMax);
  const m = guarded("JobRecord", () => ({
    job: r.job() ?? "",
    state: r.state(),
    configJson: r.configJson() ?? "",
    submittedMs: r.submittedMs(),
    endedMs: r.endedMs(),
    totalSteps: num(r.totalSteps()),
    evalStep: num(r.evalStep()),
    accuracy: r.accuracy(),
    loss: r.loss(),
    evaluated: r.evaluated(),
    evalSplit: r.evalSplit() ?? "",
    reason: r.reason() ?? "",
    snapshot: r.snapshot() ?? "",
    modelPath: r.modelPath() ?? "",
    snapshotDir: r.snapshotDir() ?? "",
    attempts: r.attempts(),
  }));
  if (JobState[m.state] === undefined) throw new WireFormatError("malformed", `JobRecord: unknown state ${m.state}`);
  return m;
}
