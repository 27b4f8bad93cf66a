// Job specs live in the JetStream KV bucket `mt-jobs`, one key per job (the JobSpec message).
// The SDK puts a spec to submit and deletes it to cancel; every service watches the bucket
// and opens or closes its part of the job.
import { Kvm, type KV } from "@nats-io/kv";
import type { NatsConnection } from "@nats-io/transport-node";
import { decodeJobSpec, encodeJobSpec, type JobSpec } from "../../schemas/messages.ts";
import { JetStreamUnavailableError } from "./errors.ts";
import type { Logger } from "./log.ts";

export const jobsBucket = "mt-jobs";
/** A job spec is config, not data. */
export const jobSpecBytesMax = 256 << 10;

export type JobChange = { job: string; spec: JobSpec | null };

export class JobStore {
  private constructor(readonly kv: KV) {}

  static async open(nc: NatsConnection): Promise<JobStore> {
    try {
      // create() opens the bucket when it exists with the same settings
      const kv = await new Kvm(nc).create(jobsBucket, { history: 1, maxValueSize: jobSpecBytesMax });
      return new JobStore(kv);
    } catch (e) {
      if ((e as Error).name !== "JetStreamNotEnabled") throw e;
      throw new JetStreamUnavailableError(`the NATS server at ${nc.getServer()} runs without JetStream, where the mesh keeps job specs ` +
        `(KV bucket ${jobsBucket}); start it with JetStream: nats-server -js (or jetstream {} in its config)`, { cause: e });
    }
  }

  async put(spec: JobSpec): Promise<void> {
    await this.kv.put(spec.job, encodeJobSpec(spec));
  }

  async delete(job: string): Promise<void> {
    await this.kv.delete(job);
  }

  async get(job: string): Promise<JobSpec | null> {
    const e = await this.kv.get(job);
    return e && e.operation === "PUT" ? decodeJobSpec(e.value, jobSpecBytesMax) : null;
  }

  async list(): Promise<string[]> {
    const keys: string[] = [];
    for await (const k of await this.kv.keys()) keys.push(k);
    return keys.sort();
  }

  /**
   * Calls onChange for every job present now and every later put or delete. A spec that does
   * not decode is logged and skipped (it cannot be run; the SDK validates before putting).
   */
  async watch(onChange: (c: JobChange) => void, log?: Logger): Promise<{ stop(): void }> {
    const it = await this.kv.watch(); // by default: the last value of every key, then changes
    void (async () => {
      for await (const e of it) {
        if (e.operation !== "PUT") {
          onChange({ job: e.key, spec: null });
          continue;
        }
        try {
          onChange({ job: e.key, spec: decodeJobSpec(e.value, jobSpecBytesMax) });
        } catch (err) {
          log?.error({ job: e.key, err: (err as Error).message }, "job spec in the KV bucket does not decode; ignored");
        }
      }
    })();
    return { stop: () => it.stop() };
  }
}

/** Opens and closes a service's part of each job as specs come and go in the bucket. */
export async function followJobs(nc: NatsConnection, log: Logger, part: { openJob(spec: JobSpec): void; closeJob(job: string): void }): Promise<{ stop(): void }> {
  const store = await JobStore.open(nc);
  return await store.watch(({ job, spec }) => {
    try {
      if (spec) part.openJob(spec);
      else part.closeJob(job);
    } catch (e) {
      log.error({ job, err: (e as Error).message }, "cannot open job");
    }
  }, log);
}
