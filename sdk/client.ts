// The meshtrain client SDK over NATS: submit a job, stream its events, status, cancel, and
// checkpoints. The CLI is built on it; so can anyone's scripts.
//   const mesh = await MeshClient.connect("nats://127.0.0.1:4222");
//   await mesh.submit(config);
//   for await (const e of mesh.events(config.job)) console.log(e);
import {
  decodeCheckpointList, decodeEvent, decodeManifest, decodeShardStats, encodeJobRequest, type Event, EventKind, type Manifest,
  type ShardStats, SyncPolicy,
} from "../schemas/messages.ts";
import { type JobConfig, parseJobConfig, subjects } from "../services/runtime/job.ts";
import { JobStore } from "../services/runtime/jobs.ts";
import { DeadlineError } from "../services/runtime/errors.ts";
import { NatsBus } from "../services/runtime/nats.ts";

const syncPolicy = { bsp: SyncPolicy.BSP, asp: SyncPolicy.ASP, ssp: SyncPolicy.SSP } as const;
/** Events queued for a slow consumer before the oldest are dropped (counted in `dropped`). */
export const eventQueueMax = 100_000;

export interface JobStatus {
  job: string;
  config: JobConfig;
  shards: (ShardStats | { shard: number; error: string })[];
  checkpoints: Manifest[];
}

export class MeshClient implements AsyncDisposable {
  private constructor(readonly bus: NatsBus, readonly jobs: JobStore) {}

  static async connect(url: string, connectRetryMsMax = 10_000): Promise<MeshClient> {
    const bus = await NatsBus.connect({ url, name: "meshtrain-sdk", connectRetryMsMax, connectBackoffMsMax: 1000 });
    return new MeshClient(bus, await JobStore.open(bus.nc));
  }

  /** Validates the config and registers the job; every service picks it up from the bucket. */
  async submit(config: JobConfig): Promise<void> {
    const cfg = parseJobConfig(config);
    await this.jobs.put({ job: cfg.job, trainers: cfg.trainers, shards: cfg.shards, sync: syncPolicy[cfg.sync], staleness: cfg.staleness, configJson: JSON.stringify(cfg) });
  }

  /** Stops the job: services drop it (trainers after their current step). */
  async cancel(job: string): Promise<void> {
    await this.jobs.delete(job);
  }

  async list(): Promise<string[]> {
    return await this.jobs.list();
  }

  /**
   * The job's events as an async iterator, from now on. Subscribe before submitting to see
   * every event. Ends when the iterator is returned (break) or `signal` aborts.
   */
  events(job: string, signal?: AbortSignal): AsyncIterableIterator<Event> & { dropped: number } {
    const queue: Event[] = [];
    let wake: (() => void) | null = null;
    let ended = false;
    const it = {
      dropped: 0,
      [Symbol.asyncIterator]() {
        return it;
      },
      async next(): Promise<IteratorResult<Event>> {
        while (queue.length === 0 && !ended) await new Promise<void>((r) => (wake = r));
        const value = queue.shift();
        return value === undefined ? { done: true, value: undefined } : { done: false, value };
      },
      async return(): Promise<IteratorResult<Event>> {
        end();
        return { done: true, value: undefined };
      },
    };
    const sub = this.bus.subscribe(subjects.allEvents(job), (data) => {
      try {
        queue.push(decodeEvent(data, 1 << 20));
      } catch {
        return; // a malformed event is not the client's to fail on
      }
      if (queue.length > eventQueueMax) {
        queue.shift();
        it.dropped++;
      }
      wake?.();
    });
    const end = () => {
      ended = true;
      sub.unsubscribe();
      wake?.();
    };
    signal?.addEventListener("abort", end, { once: true });
    return it;
  }

  async status(job: string): Promise<JobStatus | null> {
    const spec = await this.jobs.get(job);
    if (!spec) return null;
    const config = parseJobConfig(JSON.parse(spec.configJson));
    const req = encodeJobRequest({ job, step: 0, tag: "" });
    const shards = await Promise.all(Array.from({ length: config.shards }, async (_, k) => {
      try {
        return decodeShardStats(await this.bus.request(subjects.psStats(job, k), req, 5000), 1 << 20);
      } catch (e) {
        return { shard: k, error: (e as Error).message };
      }
    }));
    let checkpoints: Manifest[] = [];
    try {
      checkpoints = await this.checkpoints(job);
    } catch {
      // no checkpoint service running: status still reports the rest
    }
    return { job, config, shards, checkpoints };
  }

  async checkpoints(job: string): Promise<Manifest[]> {
    return decodeCheckpointList(await this.bus.request(subjects.ckptList(job), encodeJobRequest({ job, step: 0, tag: "" }), 10_000), 64 << 20).items;
  }

  /**
   * Asks for a snapshot now: trainer rank 0 takes it at its next step boundary (where the
   * parameter servers are consistent). Resolves with the Checkpoint event, or rejects after
   * timeoutMs (the job is not training).
   */
  async saveCheckpoint(job: string, timeoutMs = 60_000): Promise<Event> {
    const events = this.events(job, AbortSignal.timeout(timeoutMs));
    try {
      this.bus.publish(subjects.checkpointNow(job), new Uint8Array(0));
      for await (const e of events) if (e.kind === EventKind.Checkpoint) return e;
      throw new DeadlineError(`no snapshot of ${job} within ${timeoutMs} ms; is it training?`);
    } finally {
      await events.return?.();
    }
  }

  /** Rolls the whole job back to a snapshot (the newest good one when id is empty). */
  async restore(job: string, id = ""): Promise<Manifest> {
    return decodeManifest(await this.bus.request(subjects.ckptRestore(job), encodeJobRequest({ job, step: 0, tag: id }), 120_000), 1 << 22);
  }

  async close(): Promise<void> {
    await this.bus.close();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

export { EventKind };
