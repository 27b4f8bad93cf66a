// What the mesh commands do (sdk/cli/mesh-commands.ts declares them and their options): plan,
// creds, mesh up, and the client commands that talk to a mesh over NATS. Loaded when one of them
// runs, so that the commands that train in this process do not load the NATS client, the local
// mesh and the dashboard.
import { existsSync } from "node:fs";
import { join } from "node:path";
import { type Event, JobState } from "../../schemas/messages/job.ts";
import { orAfter } from "../../services/runtime/mesh/timers.ts";
import { defaultOwner, otherOwnerProblem, ownerOfJob, qualifyJob } from "../../services/runtime/job/subjects.ts";
import { jobConfigFromJson, usesShards } from "../../services/runtime/job/config.ts";
import { planDevice, planReport } from "../plan.ts";
import { MeshClient } from "../client.ts";
import { type JobFlags, jobConfigOf } from "./job-options.ts";
import { exitCodes } from "./exit.ts";
import { type MeshOptions, LocalMesh, membersWaitMs } from "../local-mesh.ts";
import { announceLocalMesh, lockMeshDir, resolveNatsUrl, resolveNkeyFile, unreachableHint } from "../mesh-address.ts";
import { clientUser, makeCredentials, roleUsers } from "../../services/runtime/job/roles.ts";
import { plural, printable, stamp } from "../format.ts";
import { checkOutDir, cliName, shownPath } from "../user-paths.ts";
import { configSummary, jobsTable, outcomeLines, statusLines } from "../report.ts";
import { Dashboard } from "../dashboard/server.ts";
import { StopRequests } from "../signals.ts";
import { JobFailedError, watchJob } from "../watch.ts";
import { NatsUnreachableError } from "../../services/runtime/mesh/nats.ts";
import { BadRequestError, CapacityError, NatsAccessError } from "../../services/runtime/mesh/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { attentionDeviceProblem } from "../../services/runtime/job/attention.ts";

/** The options every client command has (mesh-commands.ts `natsOption`; its hook has set the environment from them). */
export interface NatsFlags {
  natsUrl?: string;
}

/** Connects to the mesh the options name as `role` (on the local mesh), with a hint that says how to start one. */
async function connect(flag: string | undefined, role: "client" | "admin" = "client"): Promise<MeshClient> {
  const { url, from } = resolveNatsUrl(flag);
  const nkeyFile = resolveNkeyFile(undefined, url, role);
  try {
    return await MeshClient.connect(url, nkeyFile === undefined ? {} : { nkeyFile });
  } catch (e) {
    if (e instanceof NatsUnreachableError)
      throw new NatsUnreachableError(`cannot reach the mesh at ${url} (from ${from}): ${unreachableHint}`, {
        cause: e,
      });
    throw e;
  }
}

/** The local logs of a job, when a mesh on this machine wrote them there. */
const localLogs = (snapshotDir: string): string | null =>
  snapshotDir && existsSync(join(snapshotDir, "logs")) ? join(snapshotDir, "logs") : null;

/**
 * Follows a job the client submitted or asked to watch, printing its end. Ctrl-C stops following
 * (the job goes on) and says how to come back to it.
 */
async function follow(client: MeshClient, name: string, events?: AsyncIterableIterator<Event>): Promise<void> {
  const job = client.job(name); // its owner's name, as every other line says it
  using stop = new StopRequests(() => {
    // a mesh this client lost cannot be said to train on
    const away = client.bus.awayMs();
    const state =
      away > 0
        ? `its mesh has not answered for ${Math.round(away / 1000)} s, so whether it trains on is not known`
        : "it goes on training";
    console.log(
      `\nstopped following job ${job}; ${state}. Follow it again: ${cliName()} watch ${job}; stop it: ${cliName()} cancel ${job}`,
    );
  });
  // the watch ends at the first; should it not end at once, the second ends the command
  stop.second.signal.addEventListener("abort", () => process.exit(stop.exitCode), { once: true });
  try {
    const o = await watchJob(client, job, { signal: stop.first.signal, ...(events ? { events } : {}) });
    for (const line of outcomeLines(o, { logs: localLogs(o.record.snapshotDir) })) console.log(line);
  } catch (e) {
    if (stop.requested) process.exit(stop.exitCode);
    if (e instanceof JobFailedError && e.record) {
      const logs = localLogs(e.record.snapshotDir);
      throw new JobFailedError(`${e.message}${logs ? ` (logs: ${shownPath(logs)})` : ""}`, e.record);
    }
    throw e;
  }
}

/** `plan`: each trainer's memory and whether the job fits; exit code doesNotFit when it does not. */
export function plan(opts: JobFlags & { deviceMemory?: number; device: "auto" | "cpu" | "cuda" }): void {
  // a GPT's shape with its vocabulary, before any data: --vocab-size without --tokens plans
  // that vocabulary (a run takes it from its data)
  const shapeOnly = opts.model === "gpt" && opts.vocabSize !== undefined && opts.tokens === undefined;
  const cfg = jobConfigOf(shapeOnly ? { ...opts, vocabSize: undefined } : opts, null, (job) =>
    qualifyJob(job, defaultOwner),
  );
  const attention = attentionDeviceProblem(
    cfg.attention,
    opts.device === "cpu" ? "--device cpu plans trainers that compute on the CPU" : null,
  );
  if (attention !== null) throw new ConfigError(`attention ${cfg.attention} ${attention}`);
  const { plan, lines } = planReport(
    cfg,
    planDevice(opts.device, opts.deviceMemory ?? null),
    shapeOnly ? opts.vocabSize : undefined,
  );
  for (const line of lines) console.log(line);
  process.exitCode = plan.fits ? exitCodes.done : exitCodes.doesNotFit;
}

/** `creds`: the mesh's NATS users' seeds and their permissions. */
export function creds(opts: { dir: string; trainers: number; shards: number; clients: string[] }): void {
  checkOutDir(opts.dir, "--dir");
  const c = makeCredentials(opts.dir, {
    trainers: opts.trainers,
    shards: opts.shards,
    clients: opts.clients,
  });
  const users = roleUsers(opts);
  console.log(
    `wrote ${users.length} users' nkey seeds to ${shownPath(c.dir)}/ (${users.join(", ")}) and their permissions to ${shownPath(join(c.dir, "auth.conf"))}`,
  );
  console.log(
    `  nats-server: include ${shownPath(join(c.dir, "auth.conf"))} in its config; a service: MT_NATS_NKEY=<its user's .nk>; the CLI: --nats-nkey ${shownPath(c.seedFile(clientUser(opts.clients[0]!)))}`,
  );
}

/** `submit`: submits (or resumes) a job and follows it, or returns once it is submitted. */
export async function submit(opts: JobFlags & NatsFlags & { detach?: boolean }): Promise<void> {
  // a new job's config the options cannot make is refused before connecting (the trainers,
  // wherever they are, refuse what their device cannot run when they open the job); a named job
  // may resume, its settings (its sync mode, ZeRO) the earlier run's: checked once that is read
  if (opts.job === undefined) jobConfigOf(opts);
  await using client = await connect(opts.natsUrl);
  const given = opts.job;
  const prev =
    given === undefined
      ? null
      : await client.previous(client.job(given)).catch((e: unknown) => {
          // another owner's job, on a mesh with roles: a name like lr-0.01 was not meant as one
          if (e instanceof NatsAccessError && ownerOfJob(client.job(given)) !== client.owner)
            throw new NatsAccessError(`${e.message}; ${otherOwnerProblem(given, client.owner)}`, { cause: e });
          throw e;
        });
  const cfg = jobConfigOf(opts, prev?.config ?? null, (job) => client.job(job));
  // subscribed first: a resumed job's Restore can come before the watch starts
  const events = opts.detach ? undefined : client.events(cfg.job);
  await client.submit(cfg);
  console.log(`${prev ? "resumed" : "submitted"} job ${cfg.job} to the mesh at ${client.url}`);
  for (const line of configSummary(cfg)) console.log(`  ${line}`);
  const plan = await client.collectivePlan(cfg);
  if (plan !== null) console.log(`  collective ${plan.text}`);
  if (opts.detach) {
    console.log(
      `follow it: ${cliName()} watch ${cfg.job} | its state: ${cliName()} status ${cfg.job} | stop it: ${cliName()} cancel ${cfg.job}`,
    );
    return;
  }
  await follow(client, cfg.job, events);
}

/** `watch`: follows a job to its end. */
export async function watch(job: string, opts: NatsFlags): Promise<void> {
  await using client = await connect(opts.natsUrl);
  await follow(client, job);
}

/** `status`: a job's state, or without a job the owner's (or with --all every owner's) jobs. */
export async function status(
  job: string | undefined,
  opts: NatsFlags & { json?: boolean; all?: boolean },
): Promise<void> {
  if (job !== undefined && opts.all) throw new BadRequestError("--all lists every owner's jobs: give no job with it");
  await using client = await connect(opts.natsUrl, opts.all ? "admin" : "client");
  if (!job) {
    const records = await client.list({ every: opts.all ?? false });
    console.log(
      opts.json
        ? JSON.stringify({ jobs: records.map((r) => ({ ...r, state: JobState[r.state].toLowerCase() })) }, null, 2)
        : jobsTable(records).join("\n"),
    );
    return;
  }
  const st = await client.status(job);
  console.log(
    opts.json
      ? JSON.stringify(
          { ...st, record: st.record && { ...st.record, state: JobState[st.record.state].toLowerCase() } },
          null,
          2,
        )
      : statusLines(st).join("\n"),
  );
}

/** `cancel`: stops a running job. */
export async function cancel(job: string, opts: NatsFlags): Promise<void> {
  await using client = await connect(opts.natsUrl);
  const r = await client.cancel(job);
  console.log(`cancelled job ${r.job} (${printable(r.reason)}); resume it later: ${cliName()} submit --job ${r.job}`);
}

/** `checkpoints`: a job's snapshots, one line each. */
export async function checkpoints(job: string, opts: NatsFlags): Promise<void> {
  await using client = await connect(opts.natsUrl);
  const items = await client.checkpoints(job);
  if (items.length === 0) console.log(`job ${job} has no snapshots yet`);
  for (const m of items) {
    console.log(
      `${printable(m.id)}  step ${m.step}  metric ${Number.isFinite(m.metric) ? m.metric.toFixed(4) : "-"}  ${m.files.reduce((s, f) => s + f.bytes, 0)} bytes  ` +
        `${new Date(m.createdMs).toISOString()}${m.modelPath ? `  model ${printable(m.modelPath)}` : ""}`,
    );
  }
}

/** `dashboard`: serves a job's page (or the jobs' list) until Ctrl-C. */
export async function dashboard(
  job: string | undefined,
  opts: NatsFlags & { port: number; host: string },
): Promise<void> {
  await using client = await connect(opts.natsUrl);
  await serveDashboard(client, job, opts);
}

/** `metrics`: every service's /metrics endpoint. */
export async function metrics(opts: NatsFlags): Promise<void> {
  await using client = await connect(opts.natsUrl);
  const endpoints = await client.metricsEndpoints();
  if (endpoints.length === 0) {
    // no service at all (a NATS server with no mesh on it) is another cause than metrics turned off
    const m = await client.members();
    const none = m.trainers.length + m.shards.length + m.dataLoaders + m.checkpoints === 0;
    console.log(
      none
        ? `no meshtrain service answers on ${client.url}: is the mesh up? (meshtrain mesh up)`
        : "no service of this mesh serves metrics (they run with MT_METRICS_PORT=-1)",
    );
    if (none) process.exitCode = 1;
  }
  const width = Math.max(0, ...endpoints.map((e) => e.service.length));
  for (const e of endpoints) console.log(`${e.service.padEnd(width)}  ${e.url}`);
}

/** `save`: a snapshot of a running job at its next step. */
export async function save(job: string, opts: NatsFlags): Promise<void> {
  await using client = await connect(opts.natsUrl);
  const e = await client.saveCheckpoint(job);
  console.log(`${job}: ${printable(e.text)}`);
}

/** `resize`: a running job's trainers or shards from its next snapshot on. */
export async function resize(job: string, opts: NatsFlags & { trainers?: number; shards?: number }): Promise<void> {
  if (opts.trainers === undefined && opts.shards === undefined)
    throw new BadRequestError("resize needs --trainers or --shards (or both)");
  await using client = await connect(opts.natsUrl, "admin");
  const m = await client.resize(job, { trainers: opts.trainers, shards: opts.shards });
  const r = await client.record(job);
  const cfg = jobConfigFromJson(r.configJson);
  console.log(
    `resized ${client.job(job)} from ${printable(m.id)} (step ${m.step}): ${plural(cfg.trainers, "trainer")}${usesShards(cfg) ? `, ${plural(cfg.shards, "shard")}` : ""}; ${r.totalSteps} steps in all; follow it: ${cliName()} watch ${client.job(job)}`,
  );
}

/** `restore`: rolls a running job back to a snapshot (the newest that verifies without an id). */
export async function restore(job: string, id: string | undefined, opts: NatsFlags): Promise<void> {
  await using client = await connect(opts.natsUrl, "admin");
  const m = await client.restore(job, id ?? "");
  console.log(`restored ${job} to ${printable(m.id)} (step ${m.step}); its trainers resume there`);
}

/** `dashboard`: serves the pages until Ctrl-C; a job that does not exist is refused before. */
async function serveDashboard(
  client: MeshClient,
  job: string | undefined,
  o: { port: number; host: string },
): Promise<void> {
  await using dash = Dashboard.start({ client, port: o.port, host: o.host });
  if (job !== undefined) await dash.follow(job);
  console.log(
    `meshtrain dashboard of ${job === undefined ? "the jobs" : `job ${job}`} on ${client.url}: ${job === undefined ? dash.url : dash.jobUrl(job)}`,
  );
  console.log("stop it: Ctrl-C");
  using stop = new StopRequests();
  await new Promise<void>((resolve) => stop.first.signal.addEventListener("abort", () => resolve(), { once: true }));
}

/** `mesh up`'s options. */
export interface MeshUpFlags {
  dir: string;
  port: number;
  trainers: number;
  shards: number;
  auth: boolean;
  clients: string[];
}

/** `mesh up`: runs until Ctrl-C, leaving a note so that client commands on this machine find it. */
export async function meshUp(o: MeshUpFlags): Promise<void> {
  checkOutDir(o.dir, "--dir");
  using _lock = { [Symbol.dispose]: lockMeshDir(o.dir, shownPath(o.dir)) };
  const opts: MeshOptions = {
    jobsDir: join(o.dir, "jobs"),
    logDir: join(o.dir, "logs", `mesh-${stamp()}`),
    jobLogs: true,
    trainers: o.trainers,
    shards: o.shards,
    port: o.port,
    natsStoreDir: join(o.dir, "nats"),
    auth: o.auth,
    credsDir: join(o.dir, "creds"),
    clients: o.clients,
    onEvent: (line) => console.log(`launcher: ${line}`),
  };
  using stop = new StopRequests((s) => console.log(`\n${s}: stopping the mesh (again to stop at once)`));
  let failJobs: (reason: string) => void = () => {};
  const m = await LocalMesh.start({
    ...opts,
    onGiveUp: (service, lastError, log, cannotStart) =>
      failJobs(`${service} ${cannotStart ? "cannot start" : "keeps crashing"}: ${lastError} (log: ${shownPath(log)})`),
  });
  stop.second.signal.addEventListener("abort", () => void m.stop(true), { once: true });
  let forget = () => {};
  try {
    // up means every service has registered: a job submitted now finds them all
    await using client = await MeshClient.connect(m.url, m.auth());
    failJobs = (reason) =>
      void client
        .failRunning(reason)
        .catch((e: unknown) => console.log(`launcher: cannot fail the running jobs: ${(e as Error).message}`));
    if (
      !(await client.waitForMembers(
        { job: "(any)", trainers: o.trainers, shards: o.shards },
        membersWaitMs,
        stop.first.signal,
      ))
    )
      return;
    forget = announceLocalMesh({
      url: m.url,
      pid: process.pid,
      dir: o.dir,
      ...(m.credentials ? { creds: m.credentials.dir } : {}),
    });
    console.log(`mesh up: NATS at ${m.url}; ${m.services.map((s) => s.name).join(", ")}`);
    console.log(
      `  jobs' snapshots, models and logs: ${shownPath(opts.jobsDir)}/<job>/; the services' logs: ${shownPath(opts.logDir)}`,
    );
    console.log(
      `  client commands on this machine find it; elsewhere: export MT_NATS_URL=${m.url.replace("127.0.0.1", "<this host>")}`,
    );
    if (m.credentials) {
      console.log(
        `  NATS users per role, nkey seeds in ${shownPath(m.credentials.dir)}/ (owner-only): a client elsewhere needs export MT_NATS_NKEY=<copy of client-<owner>.nk> (${o.clients.map((c) => `client-${c}.nk`).join(", ")}: each acts on its owner's jobs only; admin.nk on every owner's, and to restore or resize)`,
      );
    }
    console.log(`submit a job: ${cliName()} submit --epochs 1 | stop the mesh: Ctrl-C`);
    if (!stop.first.signal.aborted)
      await new Promise<void>((resolve) =>
        stop.first.signal.addEventListener("abort", () => resolve(), { once: true }),
      );
    // the jobs it stops in their tracks: where they go on (a look of a few seconds at most)
    const running = (await orAfter(client.list({ every: true }), 3_000, [])).filter(
      (r) => r.state === JobState.Running,
    );
    if (running.length > 0)
      console.log(
        `running jobs stopped with the mesh: ${running.map((r) => printable(r.job)).join(", ")}; each resumes from its newest snapshot at the next \`mesh up --dir ${shownPath(o.dir)}\` (or cancel it then: ${cliName()} cancel <job>)`,
      );
  } catch (e) {
    if (e instanceof CapacityError)
      throw new CapacityError(
        `the mesh's services did not all start within ${membersWaitMs / 1000} s (logs: ${shownPath(opts.logDir)}): ${e.message}`,
      );
    throw e;
  } finally {
    forget();
    await m.stop();
    console.log("mesh stopped");
  }
}
