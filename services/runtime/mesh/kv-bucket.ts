// A JetStream KV bucket opened by several processes at once (every service of a mesh starting
// together, every rank of a job).
//
// Replicas: a bucket is a stream, kept on `replicas` servers of a NATS cluster (JetStream
// replicates it by Raft: it survives the loss of a minority of them). Every process of a mesh
// reads the count from MT_KV_REPLICAS (default 1: a single server; 3 on a three-server cluster,
// as deploy/nats-cluster/ sets it). A bucket that exists already with fewer replicas is raised to
// the count (JetStream copies it to the new peers while it serves); one with more is left as it
// is: a process started without the setting never lowers the durability of a cluster's store.
import { type KV, type KvOptions, Kvm } from "@nats-io/kv";
import type { NatsConnection } from "@nats-io/nats-core";
import { jetstreamManager } from "@nats-io/jetstream";
import { ConfigError } from "../../../ffi/errors.ts";

/** JetStream's own ceiling on a stream's replicas. */
export const kvReplicasMax = 5;

/** The replicas of the mesh's KV buckets: MT_KV_REPLICAS, 1 when unset; ConfigError when it is not 1..kvReplicasMax. */
export function kvReplicasFromEnv(env: Record<string, string | undefined> = process.env): number {
  const text = env.MT_KV_REPLICAS;
  if (text === undefined || text === "") return 1;
  const n = Number(text);
  if (!Number.isInteger(n) || n < 1 || n > kvReplicasMax) {
    throw new ConfigError(
      `MT_KV_REPLICAS=${JSON.stringify(text)}: the replicas of the mesh's KV buckets are a whole number 1..${kvReplicasMax} (3 on a three-server cluster)`,
    );
  }
  return n;
}

/** A bucket's settings, and how this process reads it: `leaderReads` from the stream's leader
 *  (STREAM.MSG.GET) rather than from any replica (a direct get, which nats.js uses by default and
 *  the bucket keeps allowing for others: a client's role may read only that way). */
export type BucketOptions = Partial<KvOptions> & { leaderReads?: boolean };

/**
 * Creates the bucket, or opens it when it exists (raising its replicas to `options.replicas`,
 * default kvReplicasFromEnv()). Processes that create it at the same moment race in the server
 * ("subjects overlap with an existing stream", "stream name already in use"): the loser tries
 * again and finds the winner's bucket.
 */
export async function openBucket(nc: NatsConnection, name: string, options: BucketOptions): Promise<KV> {
  const { leaderReads = false, ...kvOptions } = options;
  const replicas = kvOptions.replicas ?? kvReplicasFromEnv();
  const kv = await createOrOpen(nc, name, { ...kvOptions, replicas });
  await raiseReplicas(nc, name, replicas);
  // a second view of the same stream, bound without changing it, whose gets go to the leader
  return leaderReads ? await new Kvm(nc).open(name, { allow_direct: false }) : kv;
}

/** How long a bucket's creation waits for a cluster still forming to know enough peers for its replicas
 *  (a loaded machine's fresh three-server cluster took over 30 s). */
const clusterFormingMsMax = 60_000;

async function createOrOpen(
  nc: NatsConnection,
  name: string,
  options: Partial<KvOptions> & { replicas: number },
): Promise<KV> {
  const replicas = options.replicas;
  const started = Date.now();
  let races = 0;
  for (let attempt = 1; ; attempt++) {
    try {
      return await new Kvm(nc).create(name, options);
    } catch (e) {
      const why = (e as Error).message;
      // a cluster still forming knows fewer peers than it will: asked again until it has them
      if (replicas > 1 && /no suitable peers/i.test(why) && Date.now() - started < clusterFormingMsMax) {
        await Bun.sleep(Math.min(100 * attempt, 1000));
        continue;
      }
      if (replicas > 1 && /replicas|insufficient resources|non-clustered|no suitable peers/i.test(why))
        throw tooManyReplicas(name, replicas, why, e);
      if (++races >= 5 || !/subjects overlap|already in use/i.test(why)) throw e;
      await Bun.sleep(20 * races);
    }
  }
}

/** The server refused `replicas` copies of a bucket: fewer JetStream servers than that, or a single server. */
const tooManyReplicas = (bucket: string, replicas: number, why: string, cause: unknown): ConfigError =>
  new ConfigError(
    `the KV bucket ${bucket} cannot have ${replicas} replicas here (${why}): MT_KV_REPLICAS must not exceed the JetStream servers of the NATS cluster (1 on a single server)`,
    { cause },
  );

/** A bucket made with fewer replicas (before the mesh moved to a cluster) gets `replicas`. */
async function raiseReplicas(nc: NatsConnection, bucket: string, replicas: number): Promise<void> {
  const jsm = await jetstreamManager(nc);
  const stream = `KV_${bucket}`;
  const info = await jsm.streams.info(stream);
  if (info.config.num_replicas >= replicas) return;
  try {
    await jsm.streams.update(stream, { num_replicas: replicas });
  } catch (e) {
    const why = (e as Error).message;
    if (/permission/i.test(why)) {
      // a service's NATS role may create and use the buckets, not change them (roles.ts)
      throw new ConfigError(
        `the KV bucket ${bucket} has ${info.config.num_replicas} replica(s), MT_KV_REPLICAS asks for ${replicas}, and this process's NATS user may not change it (${why}); ` +
          `raise it once as admin: MT_KV_REPLICAS=${replicas} MT_NATS_NKEY=<creds>/admin.nk meshtrain status --nats-url <the cluster's URLs>`,
        { cause: e },
      );
    }
    throw tooManyReplicas(bucket, replicas, `it has ${info.config.num_replicas}; raising them failed: ${why}`, e);
  }
}
