// A JetStream KV bucket opened by several processes at once (every service of a mesh starting
// together, every rank of a job).
import { type KV, type KvOptions, Kvm } from "@nats-io/kv";
import type { NatsConnection } from "@nats-io/nats-core";

/**
 * Creates the bucket, or opens it when it exists with the same settings. Processes that create
 * it at the same moment race in the server ("subjects overlap with an existing stream", "stream
 * name already in use"): the loser tries again and finds the winner's bucket.
 */
export async function openBucket(nc: NatsConnection, name: string, options: Partial<KvOptions>): Promise<KV> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await new Kvm(nc).create(name, options);
    } catch (e) {
      if (attempt >= 5 || !/subjects overlap|already in use/i.test((e as Error).message)) throw e;
      await Bun.sleep(20 * attempt);
    }
  }
}
