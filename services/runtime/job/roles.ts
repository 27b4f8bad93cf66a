// Who may do what on a mesh's NATS: one nkey user per role, each with subject permissions.
//
//   admin          everything, every owner's jobs (the operator, and the launcher itself)
//   client-<owner> submit, watch, save a snapshot of and cancel the jobs of <owner> only (a job
//                  is <owner>.<name>: its subjects mt.<owner>.<name>.…, its keys in the job
//                  store <owner>.<name>); read their status; never restore or resize, load a
//                  shard, push or pull, or talk to the collective
//   data-loader    serves mt.*.*.data.* and the plan of a job to be submitted
//   checkpoint     serves mt.*.*.ckpt.*; reads and loads shards and replicas
//   ps-<k>         serves shard k's subjects only
//   trainer-<r>    pushes and pulls as rank r only (the rank is the subjects' last token, and the
//                  shard checks it against the message); answers only rank r's subjects;
//                  reads the NCCL ids of the mt-nccl-ids bucket and writes those of the
//                  communicators it leads (their keys' r<rank> token)
//
// Every user gets its own reply inbox, _INBOX.<its public key>, and may subscribe to no other:
// no one reads another's answers. Services answer requests through allow_responses.
//
// Credentials: `makeCredentials(dir, topology)` writes <dir>/<user>.nk (the user's nkey seed,
// mode 0600, the folder 0700) and <dir>/auth.conf, the server's `authorization` block with each
// user's public key. Seeds that exist are kept, so a mesh's credentials survive its restarts.
import { chmodSync, existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { createUser } from "@nats-io/nkeys";
import { basename, join } from "node:path";
import { defaultOwner, ownerProblem, recoverAsker } from "./subjects.ts";
import { jobsBucket, recordsBucket } from "./ledger.ts";
import { ncclIdsBucket, ncclLeaderToken } from "./nccl-id.ts";
import { reconnectedSubject } from "../mesh/bus.ts";
import { type Nkey, nkeyOf } from "../mesh/nkey.ts";

/** The ranks and shards a mesh's credentials cover (a user per rank and per shard). */
export interface RoleTopology {
  trainers: number;
  shards: number;
  /** the owners that get a client user each (default: [defaultOwner]) */
  clients?: readonly string[];
}

/** Trainer ranks and shards one set of credentials may name (the services' own bounds). */
export const roleTrainersMax = 64;
export const roleShardsMax = 64;

export type RoleName =
  | "admin"
  | `client-${string}`
  | "data-loader"
  | "checkpoint"
  | `ps-${number}`
  | `trainer-${number}`;

/** The client user of an owner's jobs. */
export const clientUser = (owner: string = defaultOwner): `client-${string}` => `client-${owner}`;

/** The owner whose client user a seed file is for (<dir>/client-<owner>.nk); null for another user's. */
export function ownerOfSeedFile(file: string): string | null {
  const m = /^client-(.+)\.nk$/.exec(basename(file));
  return m && ownerProblem(m[1]!) === null ? m[1]! : null;
}

export interface Permissions {
  publish: string[];
  subscribe: string[];
  /** may answer the requests it receives, whatever their reply subjects */
  allowResponses: boolean;
}

export class CredentialsError extends Error {
  override readonly name = "CredentialsError";
}

/** Every user of a mesh of this size. */
export function roleUsers(t: RoleTopology): RoleName[] {
  if (!(Number.isInteger(t.trainers) && t.trainers >= 1 && t.trainers <= roleTrainersMax)) {
    throw new CredentialsError(`trainers must be 1..${roleTrainersMax}, not ${t.trainers}`);
  }
  if (!(Number.isInteger(t.shards) && t.shards >= 0 && t.shards <= roleShardsMax))
    throw new CredentialsError(`shards must be 0..${roleShardsMax}, not ${t.shards}`);
  const clients = t.clients ?? [defaultOwner];
  if (clients.length === 0) throw new CredentialsError("a mesh needs at least one client owner");
  for (const owner of clients) {
    const problem = ownerProblem(owner);
    if (problem !== null) throw new CredentialsError(`client ${problem}`);
  }
  if (new Set(clients).size !== clients.length)
    throw new CredentialsError(`client owners must differ: ${clients.join(", ")}`);
  return [
    "admin",
    ...clients.map((owner) => clientUser(owner)),
    "data-loader",
    "checkpoint",
    ...Array.from({ length: t.shards }, (_, k) => `ps-${k}` as const),
    ...Array.from({ length: t.trainers }, (_, r) => `trainer-${r}` as const),
  ];
}

/** The reply inbox prefix of a user: only that user may subscribe under it. */
export const inboxPrefixOf = (publicKey: string): string => `_INBOX.${publicKey}`;

/** The JetStream API and KV subjects that open, read and watch the mesh's buckets; `write` adds puts and deletes. */
function bucketSubjects(buckets: readonly string[], write: boolean): string[] {
  return buckets.flatMap((b) => [
    `$JS.API.STREAM.INFO.KV_${b}`,
    `$JS.API.STREAM.CREATE.KV_${b}`,
    `$JS.API.CONSUMER.CREATE.KV_${b}`,
    `$JS.API.CONSUMER.CREATE.KV_${b}.>`,
    `$JS.API.CONSUMER.DELETE.KV_${b}.>`,
    `$JS.API.CONSUMER.INFO.KV_${b}.>`,
    `$JS.API.DIRECT.GET.KV_${b}`,
    `$JS.API.DIRECT.GET.KV_${b}.>`,
    `$JS.API.STREAM.MSG.GET.KV_${b}`,
    ...(write ? [`$KV.${b}.>`] : []),
  ]);
}

/**
 * What a client user may do in the job store: open the buckets, and read, watch and write the
 * keys of its own owner only. Reads name the key in the API subject (a direct get's last_by_subj,
 * a consumer's one filter subject), so the server's permissions see it; the forms that carry the
 * key in the payload (STREAM.MSG.GET, a bare DIRECT.GET or CONSUMER.CREATE) are left out.
 */
function ownedBucketSubjects(buckets: readonly string[], owner: string): string[] {
  return buckets.flatMap((b) => [
    `$JS.API.STREAM.INFO.KV_${b}`,
    `$JS.API.STREAM.CREATE.KV_${b}`,
    `$JS.API.CONSUMER.CREATE.KV_${b}.*.$KV.${b}.${owner}.>`,
    `$JS.API.CONSUMER.DELETE.KV_${b}.>`,
    `$JS.API.CONSUMER.INFO.KV_${b}.>`,
    `$JS.API.DIRECT.GET.KV_${b}.$KV.${b}.${owner}.>`,
    `$KV.${b}.${owner}.>`,
  ]);
}

const jsCommon = ["$JS.API.INFO", "$JS.FC.>", "$JS.ACK.>"];
const discovery = "$SRV.>";
// a process that reconnected says so: the requests waiting on it are asked again (bus.ts)
const everyService = ["mt.*.*.events.*", "mt.*.*.hb.*", reconnectedSubject];
const jobBuckets = [jobsBucket, recordsBucket];

/** What one user may publish and subscribe to (its inbox excepted: see natsAuthorization). */
export function permissionsOf(user: RoleName): Permissions {
  const service = (publish: string[], subscribe: string[]): Permissions => ({
    publish: [...publish, ...everyService, discovery, ...jsCommon, ...bucketSubjects(jobBuckets, true)],
    subscribe: [...subscribe, ...everyService, discovery],
    allowResponses: true,
  });
  if (user === "admin") return { publish: [">"], subscribe: [">"], allowResponses: true };
  const client = /^client-(.+)$/.exec(user);
  if (client) {
    const owner = client[1]!;
    const problem = ownerProblem(owner);
    if (problem !== null) throw new CredentialsError(`no role ${user}: ${problem}`);
    const own = `mt.${owner}.*`;
    return {
      publish: [
        "mt.ctl.plan",
        `${own}.ckpt.list`,
        `${own}.ctl.checkpoint`,
        `${own}.trainer.*.stats`,
        `${own}.ps.*.stats`,
        `${own}.data.stats`,
        discovery,
        ...jsCommon,
        ...ownedBucketSubjects(jobBuckets, owner),
      ],
      // heartbeats: a watcher names a stalled rank and what it was doing
      subscribe: [`${own}.events.>`, `${own}.hb.*`, reconnectedSubject],
      allowResponses: false,
    };
  }
  if (user === "data-loader") return service([], ["mt.*.*.data.>", "mt.ctl.plan"]);
  if (user === "checkpoint") {
    return service(
      [
        "mt.*.*.ps.*.state",
        "mt.*.*.ps.*.load",
        "mt.*.*.ps.*.stats",
        "mt.*.*.replica.>",
        "mt.*.*.ctl.checkpoint",
        "mt.ctl.plan",
        "mt.*.*.data.stats",
        "mt.*.*.trainer.*.stats",
      ],
      ["mt.*.*.ckpt.>"],
    );
  }
  const ps = /^ps-(\d+)$/.exec(user);
  // a recovery is asked by the process that lost its state, as itself (the subject's last token)
  if (ps)
    return service(
      ["mt.*.*.ps.*.norm", `mt.*.*.ckpt.recover.${recoverAsker.shard(Number(ps[1]))}`],
      [`mt.*.*.ps.${ps[1]}.>`],
    );
  const trainer = /^trainer-(\d+)$/.exec(user);
  if (trainer) {
    const r = trainer[1]!;
    // NCCL ids (nccl-id.ts): every rank reads them; a rank writes only the ids of the
    // communicators it leads (the key's r<rank> token)
    const ncclIds = [
      ...bucketSubjects([ncclIdsBucket], false),
      `$KV.${ncclIdsBucket}.*.*.${ncclLeaderToken(Number(r))}.>`,
    ];
    return service(
      [
        ...ncclIds,
        "mt.*.*.data.next",
        "mt.*.*.data.plan",
        `mt.*.*.ps.*.push.${r}`,
        `mt.*.*.ps.*.pull.${r}`,
        "mt.*.*.ps.*.stats",
        "mt.*.*.ckpt.save",
        `mt.*.*.ckpt.recover.${recoverAsker.trainer(Number(r))}`,
        "mt.*.*.ckpt.list",
        // a collective piece to any rank, as this rank only (the sender is the last token)
        `mt.*.*.coll.*.${r}`,
      ],
      [
        `mt.*.*.coll.${r}.*`,
        `mt.*.*.trainer.${r}.stats`,
        "mt.*.*.replica.state",
        `mt.*.*.replica.${r}.>`,
        "mt.*.*.ctl.checkpoint",
      ],
    );
  }
  throw new CredentialsError(`no role ${user}`);
}

const quoteList = (xs: readonly string[]) => `[${xs.map((x) => JSON.stringify(x)).join(", ")}]`;

/** The nats-server `authorization` block for these users (name -> public nkey). */
export function natsAuthorization(users: ReadonlyMap<RoleName, string>): string {
  const lines = ["authorization {", "  users: ["];
  for (const [name, publicKey] of users) {
    const p = permissionsOf(name);
    lines.push(`    # ${name}`);
    lines.push(`    { nkey: ${JSON.stringify(publicKey)}, permissions: {`);
    lines.push(`        publish: { allow: ${quoteList(p.publish)} }`);
    lines.push(`        subscribe: { allow: ${quoteList([...p.subscribe, `${inboxPrefixOf(publicKey)}.>`])} }`);
    if (p.allowResponses) lines.push("        allow_responses: true");
    lines.push("    } }");
  }
  lines.push("  ]", "}");
  return lines.join("\n");
}

export interface Credentials {
  dir: string;
  /** the server's authorization block (also in <dir>/auth.conf) */
  authorization: string;
  /** the seed file of a user */
  seedFile(user: RoleName): string;
}

/** The seed file of `user` in `dir`. */
export const seedFileOf = (dir: string, user: RoleName): string => join(dir, `${user}.nk`);

/** Writes (or completes) a mesh's credentials: a seed per user, kept if it exists, and auth.conf. */
export function makeCredentials(dir: string, topology: RoleTopology): Credentials {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  chmodSync(dir, 0o700);
  const users = new Map<RoleName, string>();
  for (const user of roleUsers(topology)) {
    const file = seedFileOf(dir, user);
    if (!existsSync(file))
      writeFileSync(file, `${new TextDecoder().decode(createUser().getSeed())}\n`, { mode: 0o600 });
    chmodSync(file, 0o600);
    users.set(user, readSeed(file).publicKey);
  }
  const authorization = natsAuthorization(users);
  writeFileSync(join(dir, "auth.conf"), `${authorization}\n`, { mode: 0o600 });
  return { dir, authorization, seedFile: (user) => seedFileOf(dir, user) };
}

/** A seed file's key (its public key, and what signs a server's nonce); CredentialsError naming
 *  the file when it is not one. */
export function readSeed(file: string): Nkey {
  if (!existsSync(file)) throw new CredentialsError(`the nkey seed file ${file} does not exist`);
  const text = readFileSync(file, "utf8").trim();
  try {
    const seed = new TextEncoder().encode(text);
    return nkeyOf(seed);
  } catch (e) {
    throw new CredentialsError(`${file} holds no user nkey seed (a line starting SU...): ${(e as Error).message}`);
  }
}
