// What the dashboard knows of one job, built from its events and heartbeats as they arrive (no
// I/O here: the server feeds it and asks for the state pages draw). The curves (loss by step,
// evaluations, samples/s by time) are Series that pages keep in step with: a page gets the whole
// state once, then the points added since (appendsSince), and applies the same rules (a step
// at or before the last one cuts the curve back first: a restore replays those steps; a curve
// past seriesPointsMax drops every other point). page.mjs repeats those two rules.
import { type Event, EventKind } from "../../schemas/messages/job.ts";
import { type Heartbeat } from "../../schemas/messages/runtime.ts";
import { type Manifest } from "../../schemas/messages/checkpoint.ts";
import { EvalTally } from "../../services/runtime/job/evals.ts";
import { type JobConfig, dataRanks, usesShards } from "../../services/runtime/job/config.ts";
import { isEnded, stateName } from "../../services/runtime/job/ledger.ts";
import type { JobStatus } from "../client.ts";
import { configSummary } from "../report.ts";
import type { StepSplit } from "../watch.ts";
import {
  logLinesMax,
  processesMax,
  rateWindowMs,
  restartShownMs,
  seriesPointsMax,
  silentAfterMs,
  snapshotsShownMax,
  splitWindowSteps,
} from "./limits.ts";

/** Columns of points, the first one x (ascending). */
export class Series {
  readonly cols: number[][];

  constructor(columns: number) {
    this.cols = Array.from({ length: columns }, () => []);
  }

  get length(): number {
    return this.cols[0]!.length;
  }

  /** Adds a point; an x at or before the last one first cuts the points from x on. */
  add(row: readonly number[]): void {
    const xs = this.cols[0]!;
    const x = row[0]!;
    if (xs.length > 0 && x <= xs[xs.length - 1]!) {
      const keep = xs.findIndex((v) => v >= x);
      for (const c of this.cols) c.length = keep;
    }
    this.cols.forEach((c, i) => c.push(row[i] ?? Number.NaN));
    if (xs.length > seriesPointsMax) this.#halve();
  }

  /** Every other point, and the last one (page.mjs does the same). */
  #halve(): void {
    for (let i = 0; i < this.cols.length; i++) {
      const c = this.cols[i]!;
      this.cols[i] = c.filter((_, j) => j % 2 === 0 || j === c.length - 1);
    }
  }
}

export type Level = "ok" | "warn" | "bad" | "idle";

/** One process of the job in the health table. */
export interface HealthRow {
  who: string;
  level: Level;
  /** ok, silent, stalled, straggler, restarted, waiting, ended */
  state: string;
  step: number;
  phase: string;
  /** seconds since its last heartbeat (-1: never heard) */
  silentS: number;
  /** times it opened the job again after running (a restart; also a resize) */
  restarts: number;
  note: string;
}

/** A trainer rank's step split, averaged over its last splitWindowSteps steps (ms). */
export interface SplitRow extends StepSplit {
  rank: number;
  step: number;
  loss: number;
}

export interface ShardRow {
  shard: number;
  /** per trainer: the newest step the shard has applied from it */
  clocks: number[];
  staleness: number;
  updates: number;
  waiting: number;
  error: string;
}

export interface Panels {
  job: string;
  mesh: string;
  state: string;
  reason: string;
  steps: { seen: number; total: number };
  evaluation: string;
  config: string[];
  health: HealthRow[];
  split: SplitRow[];
  shards: ShardRow[];
  snapshots: { id: string; step: number; metric: number; bytes: number; createdMs: number; model: string }[];
  log: { ms: number; level: Level; text: string }[];
  restores: number;
  /** when this dashboard began following the job: earlier events were not seen */
  sinceMs: number;
}

/** The curves' points: loss [step, loss, lr], evals [step, loss, accuracy], rate [unix s, samples/s]. */
export interface Curves {
  loss: number[][];
  evals: number[][];
  rate: number[][];
}

interface Proc {
  hb: Heartbeat | null;
  heardMs: number;
  restarts: number;
  restartedMs: number;
  /** where it was before it opened the job again */
  restartNote: string;
  stalled: string | null;
  straggler: string | null;
  /** heard again after a silence */
  backNote: string;
}

/** The checkpoint service's Log event after a resize reopened the job (services/checkpoint/service.ts). */
const resizedPrefix = "resized from step ";
/** Processes reopen the job within this long of the resize's Log event (before or after it). */
const resizeReopenMs = 30_000;

const whoPattern = /^(trainer \d+|shard \d+|data-loader)\b/;

export class JobView {
  readonly loss = new Series(3);
  readonly evals = new Series(3);
  readonly rate = new Series(2);
  /** points added since the pages were last sent theirs */
  #pending: Curves = { loss: [], evals: [], rate: [] };
  #tally: EvalTally;
  readonly #procs = new Map<string, Proc>();
  readonly #splits = new Map<number, { step: number; loss: number; rows: number[][] }>();
  readonly #log: Panels["log"] = [];
  /** samples of the steps seen, by arrival time, within rateWindowMs */
  readonly #samples: { ms: number; count: number }[] = [];
  #status: JobStatus | null = null;
  #restores = 0;
  #resizedMs = Number.NEGATIVE_INFINITY;
  #stepsSeen = 0;
  #totalSteps = 0;

  constructor(
    readonly job: string,
    readonly mesh: string,
    public config: JobConfig | null,
    readonly sinceMs = Date.now(),
  ) {
    this.#tally = new EvalTally(config ? dataRanks(config) : 1);
    for (const who of config ? expectedProcesses(config) : []) this.#proc(who);
  }

  get ended(): boolean {
    return this.#status?.record != null && isEnded(this.#status.record);
  }

  /** Takes one of the job's events. */
  event(e: Event, nowMs: number): void {
    switch (e.kind) {
      case EventKind.Step:
        return this.#step(e, nowMs);
      case EventKind.Eval: {
        const r = this.#tally.add(e);
        if (r) this.#add("evals", [r.step, r.loss, r.accuracy]);
        return;
      }
      case EventKind.Restore:
        this.#restores++;
        return this.#say(e.timeMs, "warn", `restore: ${e.text}; the job resumes at step ${e.step}`);
      case EventKind.Checkpoint:
        return this.#say(e.timeMs, "ok", `snapshot: ${e.text}`);
      case EventKind.Stalled:
        return this.#stalled(e);
      case EventKind.Straggler:
        return this.#straggler(e);
      case EventKind.Failed:
        return this.#say(e.timeMs, "bad", `failed: ${e.text}`);
      case EventKind.Log:
        if (e.text.startsWith(resizedPrefix)) this.#resized(nowMs);
        return this.#say(e.timeMs, "ok", e.text);
      case EventKind.Ended:
        return this.#say(e.timeMs, "idle", `ended: ${e.text}`);
    }
  }

  #step(e: Event, nowMs: number): void {
    this.#stepsSeen++;
    if (e.rank === 0) this.#add("loss", [e.step, e.loss, e.lr]);
    this.#samples.push({ ms: nowMs, count: e.count });
    let s = this.#splits.get(e.rank);
    if (s === undefined) {
      if (this.#splits.size >= processesMax) return;
      this.#splits.set(e.rank, (s = { step: 0, loss: 0, rows: [] }));
    }
    s.step = e.step;
    s.loss = e.loss;
    s.rows.push([e.dataWaitMs, e.pullMs, e.computeMs, e.pushMs, e.commMs, e.exposedCommMs]);
    if (s.rows.length > splitWindowSteps) s.rows.shift();
  }

  #stalled(e: Event): void {
    const who = whoPattern.exec(e.text)?.[1];
    const back = e.text.includes(" is back after ");
    const p = who === undefined ? undefined : this.#proc(who);
    if (p) p.stalled = back ? null : e.text;
    this.#say(e.timeMs, back ? "warn" : "bad", `${back ? "back" : "stalled"}: ${e.text}`);
  }

  #straggler(e: Event): void {
    const who = whoPattern.exec(e.text)?.[1];
    const over = e.text.includes("no longer a straggler");
    const p = who === undefined ? undefined : this.#proc(who);
    if (p) p.straggler = over ? null : e.text;
    this.#say(e.timeMs, over ? "ok" : "warn", `straggler: ${e.text}`);
  }

  /** A resize reopened the job on every process: their reopening around it is no restart. */
  #resized(nowMs: number): void {
    this.#resizedMs = nowMs;
    for (const p of this.#procs.values()) {
      if (p.restarts === 0 || nowMs - p.restartedMs > resizeReopenMs) continue;
      p.restarts--;
      p.restartedMs = 0;
    }
  }

  /** Takes a heartbeat: who is alive, and who opened the job again (a restart, unless a resize reopened it). */
  heartbeat(hb: Heartbeat, nowMs: number): void {
    const p = this.#proc(hb.who);
    if (p === undefined) return;
    const was = p.hb;
    if (
      was !== null &&
      hb.phase === "starting" &&
      was.phase !== "starting" &&
      nowMs - this.#resizedMs > resizeReopenMs
    ) {
      p.restarts++;
      p.restartedMs = nowMs;
      p.restartNote = `it was at step ${was.step}, ${was.phase}`;
      this.#say(nowMs, "bad", `${hb.who} opened the job again (restarted); it was at step ${was.step}, ${was.phase}`);
    }
    const silentMs = nowMs - p.heardMs;
    if (was !== null && silentMs >= silentAfterMs && !this.ended) {
      p.backNote = `heard again after ${(silentMs / 1000).toFixed(0)} s of silence`;
      this.#say(nowMs, "warn", `${hb.who} is ${p.backNote}`);
    }
    p.hb = hb;
    p.heardMs = nowMs;
  }

  /** The job's status (record, shard clocks, snapshots), as the server last read it. */
  status(st: JobStatus): void {
    this.#status = st;
    if (st.record && st.record.totalSteps > 0) this.#totalSteps = st.record.totalSteps;
    if (this.config === null) {
      this.config = st.config;
      this.#tally = new EvalTally(dataRanks(st.config));
      for (const who of expectedProcesses(st.config)) this.#proc(who);
    }
  }

  /** Adds the samples/s point of now (once a second, while the job runs). */
  tick(nowMs: number): void {
    while (this.#samples.length > 0 && this.#samples[0]!.ms < nowMs - rateWindowMs) this.#samples.shift();
    if (this.#stepsSeen === 0 || this.ended) return;
    const span = Math.min(rateWindowMs, nowMs - this.sinceMs);
    const n = this.#samples.reduce((a, s) => a + s.count, 0);
    this.#add("rate", [nowMs / 1000, span > 0 ? (n * 1000) / span : 0]);
  }

  /** Every point of every curve (a page that connects). */
  curves(): Curves {
    const rows = (s: Series) => s.cols[0]!.map((_, i) => s.cols.map((c) => c[i]!));
    return { loss: rows(this.loss), evals: rows(this.evals), rate: rows(this.rate) };
  }

  /** The points added since the last call (what the open pages are sent next). */
  appendsSince(): Curves {
    const p = this.#pending;
    this.#pending = { loss: [], evals: [], rate: [] };
    return p;
  }

  #add(curve: keyof Curves, row: number[]): void {
    this[curve].add(row);
    const pending = this.#pending[curve];
    pending.push(row);
    // a page that misses points this far behind is sent the whole state instead
    if (pending.length > seriesPointsMax) pending.splice(0, pending.length - seriesPointsMax);
  }

  #proc(who: string): Proc | undefined {
    let p = this.#procs.get(who);
    if (p === undefined && this.#procs.size < processesMax) {
      p = {
        hb: null,
        heardMs: 0,
        restarts: 0,
        restartedMs: 0,
        restartNote: "",
        stalled: null,
        straggler: null,
        backNote: "",
      };
      this.#procs.set(who, p);
    }
    return p;
  }

  #say(ms: number, level: Level, text: string): void {
    this.#log.push({ ms, level, text });
    if (this.#log.length > logLinesMax) this.#log.shift();
  }

  /** The tables and figures of the page, as of now. */
  panels(nowMs: number): Panels {
    const rec = this.#status?.record ?? null;
    return {
      job: this.job,
      mesh: this.mesh,
      state: rec ? stateName(rec.state) : this.#status ? "snapshots only" : "waiting",
      reason: rec?.reason ?? "",
      steps: { seen: this.loss.length > 0 ? this.loss.cols[0]!.at(-1)! + 1 : 0, total: this.#totalSteps },
      evaluation:
        rec && rec.accuracy >= 0
          ? `${rec.evalSplit || "test"} at step ${rec.evalStep}: loss ${rec.loss.toFixed(4)}, accuracy ${(100 * rec.accuracy).toFixed(2)}%`
          : "",
      config: this.config ? configSummary(this.config) : [],
      health: [...this.#procs.entries()]
        .sort(([a], [b]) => processOrder(a) - processOrder(b))
        .map(([who, p]) => this.#health(who, p, nowMs)),
      split: [...this.#splits.entries()].sort(([a], [b]) => a - b).map(([rank, s]) => splitRow(rank, s)),
      shards: (this.#status?.shards ?? []).map(shardRow),
      snapshots: (this.#status?.checkpoints ?? []).slice(-snapshotsShownMax).reverse().map(snapshotRow),
      log: this.#log,
      restores: this.#restores,
      sinceMs: this.sinceMs,
    };
  }

  #health(who: string, p: Proc, nowMs: number): HealthRow {
    const silentS = p.hb === null ? -1 : Math.floor((nowMs - p.heardMs) / 1000);
    const base = { who, step: p.hb?.step ?? 0, phase: p.hb?.phase ?? "", silentS, restarts: p.restarts };
    if (this.ended) return { ...base, level: "idle", state: "ended", note: "the job ended" };
    if (p.stalled !== null) return { ...base, level: "bad", state: "stalled", note: p.stalled };
    if (p.hb !== null && nowMs - p.heardMs >= silentAfterMs)
      return {
        ...base,
        level: "bad",
        state: "silent",
        note: `no heartbeat for ${silentS} s (stopped, wedged or dead)`,
      };
    // a process that died a moment ago (or reopened the job in a resize) is not trusted yet
    if (p.restarts > 0 && nowMs - p.restartedMs < restartShownMs)
      return {
        ...base,
        level: "bad",
        state: "restarted",
        note: `opened the job again ${Math.floor((nowMs - p.restartedMs) / 1000)} s ago; ${p.restartNote}`,
      };
    if (p.straggler !== null) return { ...base, level: "warn", state: "straggler", note: p.straggler };
    if (p.hb === null) return { ...base, level: "warn", state: "waiting", note: "not heard yet" };
    return { ...base, level: "ok", state: "ok", note: p.backNote };
  }
}

/** The processes a job runs on: its trainer ranks, its shards, the data-loader. */
export function expectedProcesses(cfg: JobConfig): string[] {
  const shards = usesShards(cfg) ? Array.from({ length: cfg.shards }, (_, k) => `shard ${k}`) : [];
  return [...Array.from({ length: cfg.trainers }, (_, r) => `trainer ${r}`), ...shards, "data-loader"];
}

/** Trainers by rank, then shards, then the data-loader (heartbeats arrive in any order). */
function processOrder(who: string): number {
  const n = Number(/\d+$/.exec(who)?.[0] ?? 0);
  return who.startsWith("trainer") ? n : who.startsWith("shard") ? 1_000 + n : 2_000;
}

function splitRow(rank: number, s: { step: number; loss: number; rows: number[][] }): SplitRow {
  const mean = (i: number) => s.rows.reduce((a, r) => a + r[i]!, 0) / Math.max(1, s.rows.length);
  return {
    rank,
    step: s.step,
    loss: s.loss,
    dataWaitMs: mean(0),
    pullMs: mean(1),
    computeMs: mean(2),
    pushMs: mean(3),
    commMs: mean(4),
    exposedCommMs: mean(5),
  };
}

function shardRow(s: JobStatus["shards"][number]): ShardRow {
  if ("error" in s) return { shard: s.shard, clocks: [], staleness: 0, updates: 0, waiting: 0, error: s.error };
  const staleness = s.clocks.length > 0 ? Math.max(...s.clocks) - Math.min(...s.clocks) : 0;
  return { shard: s.shard, clocks: s.clocks, staleness, updates: s.updates, waiting: s.waiting, error: "" };
}

function snapshotRow(m: Manifest): Panels["snapshots"][number] {
  return {
    id: m.id,
    step: m.step,
    metric: m.metric,
    bytes: m.files.reduce((a, f) => a + f.bytes, 0),
    createdMs: m.createdMs,
    model: m.modelPath,
  };
}
