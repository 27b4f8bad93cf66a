// The mesh across four hosts of a test bed (testbed/), links shaped to 1 Gbit/s: a NATS cluster
// of three servers on hosts 0, 1 and 3, the data-loader and the checkpoint service on host 0, a
// shard on each of hosts 1 and 2, two trainers on each of hosts 1 and 2 (host 2's services have
// host 3's server as their home). Up, with a client through host 0's server.
import { MeshClient } from "../../sdk/client.ts";
import { HostBed } from "../../testbed/hosts.ts";
import { HostMesh } from "../../testbed/mesh.ts";

/** how long the four hosts' trainers' ring waits for progress before it gives up */
export const collTimeoutMs = 15_000;

export async function fourHosts(): Promise<{
  bed: HostBed;
  mesh: HostMesh;
  client: MeshClient;
  [Symbol.asyncDispose](): Promise<void>;
}> {
  const bed = await HostBed.create({ hosts: 4, rateMbit: 1000 });
  const mesh = await HostMesh.start(bed, {
    natsHosts: [0, 1, 3],
    serviceHost: 0,
    shardHosts: [1, 2],
    trainerHosts: [1, 2],
    trainersPerHost: 2,
    env: { MT_COLL_TIMEOUT_MS: String(collTimeoutMs) },
  }).catch(async (e) => {
    await bed[Symbol.asyncDispose]();
    throw e;
  });
  const client = await MeshClient.connect(mesh.urls(0), { connectRetryMsMax: 30_000 });
  const down = async () => {
    await client.close();
    await mesh[Symbol.asyncDispose]();
    await bed[Symbol.asyncDispose]();
  };
  await mesh.untilUp(client).catch(async (e) => {
    await down();
    throw e;
  });
  return { bed, mesh, client, [Symbol.asyncDispose]: down };
}
