// The mesh commands of the CLI: `run` (a local mesh for one job, the README's main job), `mesh
// up`, and the client commands that talk to any mesh over NATS (submit, watch, status, cancel,
// checkpoints, save, restore). Every one ends with an answer: a result, or one line naming the
// cause (and the log to read).
import { existsSync } from "node:fs";
import { join } from "node:path";
import { type Command, Option } from "commander";
import { type Event, JobState } from "../../schemas/messages/job.ts";
import { defaultOwner, ownerProblem, qualifyJob } from "../../services/runtime/job/subjects.ts";
import { jobConfigFromJson, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { parseMemorySize, planDevice, planReport } from "../plan.ts";
import { MeshClient } from "../client.ts";
import { type JobFlags, jobConfigOf, jobOptions } from "./job-options.ts";
import { exitCodes } from "./exit.ts";
import { type MeshOptions, LocalMesh, membersWaitMs } from "../local-mesh.ts";
import { announceLocalMesh, resolveNatsUrl, resolveNkeyFile, unreachableHint } from "../mesh-address.ts";
import {
  clientUser,
  makeCredentials,
  roleShardsMax,
  roleTrainersMax,
  roleUsers,
} from "../../services/runtime/job/roles.ts";
import { defaultRunDir, runMesh } from "./run-mesh.ts";
import { printable, stamp } from "../format.ts";
import { cliName, shownPath, userPath } from "../user-paths.ts";
import { float, int, ownerList } from "./options.ts";
import { configSummary, jobsTable, outcomeLines, statusLines } from "../report.ts";
import { Dashboard } from "../dashboard/server.ts";
import { StopRequests } from "../signals.ts";
import { JobFailedError, watchJob } from "../watch.ts";
import { NatsUnreachableError } from "../../services/runtime/mesh/nats.ts";
import { BadRequestError, CapacityError } from "../../services/runtime/mesh/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { attentionDeviceProblem } from "../../services/runtime/job/attention.ts";

const d = jobDefaults;

/** --device-memory: the memory a trainer's device has, for plan and run's check. */
const deviceMemoryOption = () =>
  new Option(
    "--device-memory <size>",
    "memory of a trainer's device (80GB, 24GiB, ...; default: the GPU's, or this machine's for CPU trainers)",
  ).argParser(parseMemorySize);

/** `--clients`, of `creds` and `mesh up`: a client user per owner of jobs (services/runtime/job/roles.ts). */
const clientsOption = () =>
  new Option(
    "--clients <owners>",
    "the owners of jobs, comma-separated: one client user each (client-<owner>.nk), who acts on that owner's jobs only",
  )
    .argParser(ownerList)
    .default([defaultOwner]);

const natsOption = (cmd: Command) =>
  cmd
    .option(
      "--nats-url <url>",
      "the mesh's NATS server (default: $MT_NATS_URL, else the mesh `meshtrain mesh up` runs here, else nats://127.0.0.1:4222)",
    )
    .option("--tls-ca <file>", "TLS: the CA that signed the NATS server's certificate (default: $MT_TLS_CA)")
    .option(
      "--tls-cert <file>",
      "TLS: this client's certificate, for a server that verifies clients (default: $MT_TLS_CERT)",
    )
    .option("--tls-key <file>", "TLS: the key of --tls-cert (default: $MT_TLS_KEY)")
    .option(
      "--nats-nkey <file>",
      "the nkey seed file of the NATS user to connect as (default: $MT_NATS_NKEY, else the local mesh's client user; admin for restore and resize)",
    )
    .option(
      "--owner <name>",
      "whose jobs a job name without an owner means (a job is <owner>.<name>; default: $MT_OWNER, else the owner of a client-<owner>.nk seed, else default)",
    )
    .hook("preAction", (c) => {
      // the SDK reads the TLS files from MT_TLS_* (MeshClient.connect's default)
      const o = c.opts() as { tlsCa?: string; tlsCert?: string; tlsKey?: string; natsNkey?: string; owner?: string };
      if (o.owner !== undefined) {
        const problem = ownerProblem(o.owner);
        if (problem !== null) throw new BadRequestError(`--owner: ${problem}`);
        process.env.MT_OWNER = o.owner;
      }
      if (o.natsNkey) process.env.MT_NATS_NKEY = userPath(o.natsNkey);
      if (o.tlsCa) process.env.MT_TLS_CA = userPath(o.tlsCa);
      if (o.tlsCert) process.env.MT_TLS_CERT = userPath(o.tlsCert);
      if (o.tlsKey) process.env.MT_TLS_KEY = userPath(o.tlsKey);
    });

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
async function follow(client: MeshClient, job: string, events?: AsyncIterableIterator<Event>): Promise<void> {
  using stop = new StopRequests(() =>
    console.log(
      `\nstopped following job ${job}; it goes on training. Follow it again: ${cliName()} watch ${job}; stop it: ${cliName()} cancel ${job}`,
    ),
  );
  try {
    const o = await watchJob(client, job, { signal: stop.first.signal, ...(events ? { events } : {}) });
    for (const line of outcomeLines(o, { logs: localLogs(o.record.snapshotDir) })) console.log(line);
  } catch (e) {
    if (stop.requested) process.exit(exitCodes.interrupted);
    if (e instanceof JobFailedError && e.record) {
      const logs = localLogs(e.record.snapshotDir);
      throw new JobFailedError(`${e.message}${logs ? ` (logs: ${shownPath(logs)})` : ""}`, e.record);
    }
    throw e;
  }
}

export function addMeshCommands(program: Command): void {
  addLocalCommands(program);
  addMeshUpCommands(program);
  addJobCommands(program);
  addSnapshotCommands(program);
}

/** `run` (a local mesh for one job) and `plan` (each trainer's memory, before anything starts). */
function addLocalCommands(program: Command): void {
  jobOptions(
    program
      .command("run")
      .description(
        "train MNIST on a local mesh of its own (embedded nats-server; data-loader, parameter-server shards, trainers and checkpoint as processes) and print the test accuracy",
      ),
  )
    .option("--dir <dir>", "folder for the jobs' snapshots, models and logs (<dir>/jobs/<job>/)", defaultRunDir())
    .option("--timeout-min <m>", "give up after this many minutes", float(0, Infinity, { exclusiveMin: true }), 60)
    .option("--dashboard-port <n>", "port of the job's live web page on 127.0.0.1 (0: a free one)", int(0, 65535), 0)
    .option("--no-dashboard", "no live web page of the job")
    .addOption(deviceMemoryOption())
    .action(
      async (
        opts: JobFlags & {
          dir: string;
          timeoutMin: number;
          dashboard: boolean;
          dashboardPort: number;
          deviceMemory?: number;
        },
        cmd: Command,
      ) => {
        process.exitCode = await runMesh({
          flags: opts,
          dir: userPath(opts.dir),
          timeoutMin: opts.timeoutMin,
          dashboardPort: opts.dashboard ? opts.dashboardPort : null,
          deviceMemory: opts.deviceMemory ?? null,
        });
      },
    );

  jobOptions(
    program
      .command("plan")
      .description(
        "predict each trainer's memory (parameters, gradients, optimizer state, activations; by ZeRO stage, offload, pipeline stage and tensor rank) and whether the job fits, before anything starts",
      ),
  )
    .addOption(deviceMemoryOption())
    .addOption(
      new Option(
        "--device <name>",
        "what the trainers compute on: cuda checks a trainer against the GPU's memory, cpu every process against this machine's",
      )
        .choices(["auto", "cpu", "cuda"])
        .default(process.env.MT_DEVICE ?? "cpu"),
    )
    .action((opts: JobFlags & { deviceMemory?: number; device: "auto" | "cpu" | "cuda" }) => {
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
    });
}

/** `mesh up` (a mesh that stays up) and `creds` (its NATS users). */
function addMeshUpCommands(program: Command): void {
  const mesh = program.command("mesh").description("run the mesh's services on this machine");
  mesh
    .command("up")
    .description(
      "start a local mesh (nats-server and the services of deploy/docker-compose.yml as processes) until Ctrl-C; submit jobs to it from other shells",
    )
    .option(
      "--dir <dir>",
      "folder for the jobs' snapshots, models and logs, and the mesh's NATS store",
      defaultRunDir(),
    )
    .option("--port <n>", "NATS port", int(1, 65535), 4222)
    .option("--trainers <n>", "trainer ranks to run (a job may use fewer)", int(1, 64), d.trainers)
    .option("--shards <n>", "parameter-server shards to run (a job may use fewer)", int(1, 64), d.shards)
    .option(
      "--no-auth",
      "run NATS without users: anyone who reaches its port may do anything (default: a user per role, credentials in <dir>/creds)",
    )
    .addOption(clientsOption())
    .action(async (opts: MeshUpFlags) => {
      await meshUp({ ...opts, dir: userPath(opts.dir) });
    });

  program
    .command("creds")
    .description(
      "write a mesh's NATS credentials: an nkey seed per role, rank and shard (owner-only files; seeds already there are kept) and auth.conf, the users' permissions for nats-server (include it in its config; deploy/k8s makes Secrets of them)",
    )
    .requiredOption("--dir <dir>", "the folder to write them to (created with mode 0700)")
    .option("--trainers <n>", "trainer ranks: one user each (trainer-<r>)", int(1, roleTrainersMax), d.trainers)
    .option("--shards <n>", "parameter-server shards: one user each (ps-<k>)", int(0, roleShardsMax), d.shards)
    .addOption(clientsOption())
    .action((opts: { dir: string; trainers: number; shards: number; clients: string[] }) => {
      const c = makeCredentials(userPath(opts.dir), {
        trainers: opts.trainers,
        shards: opts.shards,
        clients: opts.clients,
      });
      const users = roleUsers(opts);
      console.log(
        `wrote ${users.length} users' nkey seeds to ${shownPath(c.dir)}/ (${users.join(", ")}) and their permissions to ${shownPath(join(c.dir, "auth.conf"))}`,
      );
      console.log(
        `  nats-server: include ${shownPath(join(c.dir, "auth.conf"))} in its config; a service: MT_NATS_NKEY=<its user's .nk>; the CLI: --nats-nkey ${shownPath(c.seedFile(clientUser(opts.clients[0])))}`,
      );
    });
}

/** The client commands that submit and follow jobs. */
function addJobCommands(program: Command): void {
  natsOption(
    jobOptions(program.command("submit").description("submit a job to a running mesh and follow it to the end")),
  )
    .option("--detach", "return once the job is submitted")
    .action(async (opts: JobFlags & { natsUrl?: string; detach?: boolean }, cmd: Command) => {
      // a config the options cannot make is refused before connecting (the trainers, wherever
      // they are, refuse what their device cannot run when they open the job)
      jobConfigOf(opts);
      await using client = await connect(opts.natsUrl);
      const prev = opts.job === undefined ? null : await client.previous(client.job(opts.job));
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
    });

  natsOption(
    program
      .command("watch")
      .description("follow a job to its end (a job that ended is reported at once)")
      .argument("<job>"),
  ).action(async (job: string, opts: { natsUrl?: string }) => {
    await using client = await connect(opts.natsUrl);
    await follow(client, job);
  });

  natsOption(
    program
      .command("status")
      .description(
        "a job's state, newest accuracy, progress, snapshots and model; without a job, the owner's jobs on the mesh",
      )
      .argument("[job]"),
  )
    .option("--json", "print JSON")
    .option("--all", "without a job: every owner's jobs (on a mesh with roles, as its admin user)")
    .action(async (job: string | undefined, opts: { natsUrl?: string; json?: boolean; all?: boolean }) => {
      if (job !== undefined && opts.all)
        throw new BadRequestError("--all lists every owner's jobs: give no job with it");
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
    });
}

/** The client commands that act on running jobs and their snapshots. */
function addSnapshotCommands(program: Command): void {
  natsOption(
    program
      .command("cancel")
      .description("stop a running job (its snapshots stay; giving its name to run or submit resumes it)")
      .argument("<job>"),
  ).action(async (job: string, opts: { natsUrl?: string }) => {
    await using client = await connect(opts.natsUrl);
    const r = await client.cancel(job);
    console.log(`cancelled job ${r.job} (${printable(r.reason)}); resume it later: ${cliName()} submit --job ${r.job}`);
  });

  natsOption(
    program.command("checkpoints").description("list a job's snapshots (also of a job that ended)").argument("<job>"),
  ).action(async (job: string, opts: { natsUrl?: string }) => {
    await using client = await connect(opts.natsUrl);
    const items = await client.checkpoints(job);
    if (items.length === 0) console.log(`job ${job} has no snapshots yet`);
    for (const m of items) {
      console.log(
        `${printable(m.id)}  step ${m.step}  metric ${Number.isFinite(m.metric) ? m.metric.toFixed(4) : "-"}  ${m.files.reduce((s, f) => s + f.bytes, 0)} bytes  ` +
          `${new Date(m.createdMs).toISOString()}${m.modelPath ? `  model ${printable(m.modelPath)}` : ""}`,
      );
    }
  });

  natsOption(
    program
      .command("dashboard")
      .description(
        "serve a live web page of a job (loss and evaluation curves, samples/s, each rank's step split, shard clocks, health, snapshots) until Ctrl-C; without a job, a page listing the mesh's jobs",
      )
      .argument("[job]"),
  )
    .option("--port <n>", "HTTP port (0: a free one)", int(0, 65535), 0)
    .option(
      "--host <addr>",
      "address to listen on (0.0.0.0: every interface; whoever reaches it sees the mesh's jobs)",
      "127.0.0.1",
    )
    .action(async (job: string | undefined, opts: { natsUrl?: string; port: number; host: string }) => {
      await using client = await connect(opts.natsUrl);
      await serveDashboard(client, job, opts);
    });

  natsOption(
    program
      .command("metrics")
      .description("list every service's Prometheus /metrics endpoint (from service discovery)"),
  ).action(async (opts: { natsUrl?: string }) => {
    await using client = await connect(opts.natsUrl);
    const endpoints = await client.metricsEndpoints();
    if (endpoints.length === 0)
      console.log("no service of this mesh serves metrics (they run with MT_METRICS_PORT=-1)");
    const width = Math.max(0, ...endpoints.map((e) => e.service.length));
    for (const e of endpoints) console.log(`${e.service.padEnd(width)}  ${e.url}`);
  });

  natsOption(
    program.command("save").description("take a snapshot of a running job at its next step").argument("<job>"),
  ).action(async (job: string, opts: { natsUrl?: string }) => {
    await using client = await connect(opts.natsUrl);
    const e = await client.saveCheckpoint(job);
    console.log(`${job}: ${printable(e.text)}`);
  });

  natsOption(
    program
      .command("resize")
      .description(
        "change a running job's trainers or shards at a step boundary: it snapshots, every service reopens it with the new sizes from there (the rest of the epoch is re-split among the trainers; the shards take the chunks as the new hash ring says)",
      )
      .argument("<job>")
      .option("--trainers <n>", "trainer ranks from the next snapshot on (the mesh must run them)", int(1, 64))
      .option("--shards <n>", "parameter-server shards (parameter-server mode)", int(1, 64)),
  ).action(async (job: string, opts: { natsUrl?: string; trainers?: number; shards?: number }) => {
    if (opts.trainers === undefined && opts.shards === undefined)
      throw new BadRequestError("resize needs --trainers or --shards (or both)");
    await using client = await connect(opts.natsUrl, "admin");
    const m = await client.resize(job, { trainers: opts.trainers, shards: opts.shards });
    const r = await client.record(job);
    const cfg = jobConfigFromJson(r.configJson);
    console.log(
      `resized ${job} from ${printable(m.id)} (step ${m.step}): ${cfg.trainers} trainers${cfg.sync === "allreduce" ? "" : `, ${cfg.shards} shards`}; ${r.totalSteps} steps in all; follow it: ${cliName()} watch ${job}`,
    );
  });

  natsOption(
    program
      .command("restore")
      .description("roll a running job back to a snapshot (default: the newest that verifies)")
      .argument("<job>")
      .argument("[id]"),
  ).action(async (job: string, id: string | undefined, opts: { natsUrl?: string }) => {
    await using client = await connect(opts.natsUrl, "admin");
    const m = await client.restore(job, id ?? "");
    console.log(`restored ${job} to ${printable(m.id)} (step ${m.step}); its trainers resume there`);
  });
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
interface MeshUpFlags {
  dir: string;
  port: number;
  trainers: number;
  shards: number;
  auth: boolean;
  clients: string[];
}

/** `mesh up`: runs until Ctrl-C, leaving a note so that client commands on this machine find it. */
async function meshUp(o: MeshUpFlags): Promise<void> {
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

export { defaultRunDir };
