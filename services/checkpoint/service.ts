// The checkpoint service: `mt.<job>.ckpt.save|list|restore`.
//   save:    reads every shard's state (`ps.<k>.state`), writes them with the job's config, step,
//            loader cursors and latest evaluation metric as one snapshot, then applies retention.
//   list:    the job's snapshots.
//   restore: the newest snapshot that verifies (or the one named), loaded into every shard
//            (`ps.<k>.load`); then a Restore event tells the trainers where to resume.
import {
  decodeJobRequest, decodeShardState, encodeCheckpointList, encodeEvent, encodeJobRequest, encodeManifest, emptyEvent, EventKind,
  decodeEvent, type JobSpec,
} from "../../schemas/messages.ts";
import type { Bus, Subscription } from "../runtime/bus.ts";
import { BadRequestError, UnknownJobError } from "../runtime/errors.ts";
import { configOfSpec, type JobConfig, jobOfRequest, subjects } from "../runtime/job.ts";
import type { Logger } from "../runtime/log.ts";
import { stateTimeoutMs } from "./limits.ts";
import { CheckpointStore } from "./store.ts";

interface JobEntry {
  cfg: JobConfig;
  /** evaluation results by step: accumulated over ranks, weighted by sample count */
  evals: Map<number, { correct: number; count: number }>;
  sub: Subscription;
  /** one save or restore at a time per job */
  busy: Promise<unknown>;
}

const shardFile = (k: number) => `ps-${k}.mtss`;

export class CheckpointService {
  readonly #jobs = new Map<string, JobEntry>();

  constructor(readonly bus: Bus, readonly store: CheckpointStore, readonly log: Logger | undefined, readonly payloadBytesMax: number) {}

  serve(): void {
    const on = (name: string, handler: (e: JobEntry, tag: string, step: number) => Promise<Uint8Array> | Uint8Array) =>
      this.bus.serve({ name, subject: `mt.*.ckpt.${name}`, handler: (data, subject) => {
        const m = decodeJobRequest(data, this.payloadBytesMax);
        const job = jobOfRequest(subject, m.job);
        const e = this.#jobs.get(job);
        if (!e) throw new UnknownJobError(`the checkpoint service runs no job "${job}"`);
        return handler(e, m.tag, m.step);
      } });
    on("save", (e, tag, step) => this.#serial(e, () => this.#save(e, step, tag)));
    on("list", (e) => encodeCheckpointList({ job: e.cfg.job, items: this.store.list(e.cfg.job) }));
    on("restore", (e, tag) => this.#serial(e, () => this.#restore(e, tag)));
  }

  #serial<T>(e: JobEntry, fn: () => Promise<T>): Promise<T> {
    const next = e.busy.then(fn, fn);
    e.busy = next.catch(() => undefined);
    return next;
  }

  async #save(e: JobEntry, step: number, why: string): Promise<Uint8Array> {
    const { cfg } = e;
    const t0 = performance.now();
    const req = encodeJobRequest({ job: cfg.job, step, tag: "" });
    const files = await Promise.all(Array.from({ length: cfg.shards }, async (_, k) => {
      const bytes = await this.bus.request(subjects.psState(cfg.job, k), req, stateTimeoutMs);
      // verify before writing: a state that does not decode is never saved
      const s = decodeShardState(bytes, 1 << 30);
      if (s.shard !== k || s.job !== cfg.job) throw new BadRequestError(`shard ${k} answered the state of ${s.job} shard ${s.shard}`);
      return { name: shardFile(k), bytes };
    }));
    const manifest = this.store.save({
      job: cfg.job, step, metric: this.#metricAt(e, step), configJson: JSON.stringify(cfg), cursors: Array(cfg.trainers).fill(step),
    }, files);
    const removed = this.store.retain(cfg.job, cfg.keepLast);
    const bytes = files.reduce((s, f) => s + f.bytes.byteLength, 0);
    const ms = performance.now() - t0;
    this.log?.info({ job: cfg.job, id: manifest.id, step, bytes, ms: Math.round(ms), removed, why }, "snapshot saved");
    this.#event(cfg.job, EventKind.Checkpoint, step, `saved ${manifest.id} (${(bytes / 1e6).toFixed(1)} MB in ${ms.toFixed(0)} ms)`);
    return encodeManifest(manifest);
  }

  /** Accuracy of the newest evaluation at or before `step` (NaN when none). */
  #metricAt(e: JobEntry, step: number): number {
    let best = -1;
    for (const s of e.evals.keys()) if (s <= step && s > best) best = s;
    const r = e.evals.get(best);
    return r && r.count > 0 ? r.correct / r.count : Number.NaN;
  }

  async #restore(e: JobEntry, tag: string): Promise<Uint8Array> {
    const { cfg } = e;
    const id = tag.startsWith("step-") ? tag : "";
    const snap = this.store.latestGood(cfg.job, id, (bad, why) => {
      this.log?.error({ job: cfg.job, id: bad, why }, "snapshot failed verification; trying the previous one");
      this.#event(cfg.job, EventKind.Log, 0, `snapshot ${bad} is corrupt: ${why}`);
    });
    await Promise.all(Array.from({ length: cfg.shards }, async (_, k) => {
      const bytes = snap.files.get(shardFile(k));
      if (!bytes) throw new BadRequestError(`snapshot ${snap.manifest.id} has no file for shard ${k}`);
      await this.bus.request(subjects.psLoad(cfg.job, k), bytes, stateTimeoutMs);
    }));
    this.log?.warn({ job: cfg.job, id: snap.manifest.id, step: snap.manifest.step, why: tag }, "job restored");
    this.#event(cfg.job, EventKind.Restore, snap.manifest.step, `restored ${snap.manifest.id} (${tag || "requested"})`);
    return encodeManifest(snap.manifest);
  }

  #event(job: string, kind: EventKind, step: number, text: string): void {
    this.bus.publish(subjects.events(job, EventKind[kind].toLowerCase()), encodeEvent({ ...emptyEvent(job, kind), step, text }));
  }

  openJob(spec: JobSpec): void {
    const cfg = configOfSpec(spec);
    this.closeJob(cfg.job);
    this.store.sweep(cfg.job);
    const evals = new Map<number, { correct: number; count: number }>();
    const sub = this.bus.subscribe(subjects.events(cfg.job, "eval"), (data) => {
      try {
        const ev = decodeEvent(data, 1 << 16);
        const r = evals.get(ev.step) ?? { correct: 0, count: 0 };
        r.correct += ev.accuracy * ev.count;
        r.count += ev.count;
        evals.set(ev.step, r);
      } catch (err) {
        this.log?.warn({ err: (err as Error).message }, "undecodable eval event ignored");
      }
    });
    this.#jobs.set(cfg.job, { cfg, evals, sub, busy: Promise.resolve() });
  }

  closeJob(job: string): void {
    this.#jobs.get(job)?.sub.unsubscribe();
    this.#jobs.delete(job);
  }
}
