// The mesh commands of the CLI and their options: `run` (a local mesh for one job, the README's
// main job), `mesh up`, and the client commands that talk to any mesh over NATS (submit, watch,
// status, cancel, checkpoints, save, restore). Every one ends with an answer: a result, or one
// line naming the cause (and the log to read). What they do is in mesh-actions.ts and
// run-mesh.ts, imported when one runs: the commands that train in this process never load them.
import { type Command, Option } from "commander";
import { defaultOwner, ownerProblem } from "../../services/runtime/job/subjects.ts";
import { jobDefaults } from "../../services/runtime/job/config.ts";
import { type JobFlags, jobOptions } from "./job-options.ts";
import { roleShardsMax, roleTrainersMax } from "../../services/runtime/job/roles.ts";
import { defaultRunDir, userPath } from "../user-paths.ts";
import { float, int, ownerList, parseMemorySize } from "./options.ts";
import { BadRequestError } from "../../services/runtime/mesh/errors.ts";
import type { MeshUpFlags, NatsFlags } from "./mesh-actions.ts";

/** What the commands do: loaded when one of them runs. */
const actions = () => import("./mesh-actions.ts");

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
    .default([defaultOwner], `${defaultOwner} (the owner of a job named without one)`);

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
      ) => {
        const { runMesh } = await import("./run-mesh.ts");
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
    .action(async (opts: JobFlags & { deviceMemory?: number; device: "auto" | "cpu" | "cuda" }) =>
      (await actions()).plan(opts),
    );
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
      await (await actions()).meshUp({ ...opts, dir: userPath(opts.dir) });
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
    .action(async (opts: { dir: string; trainers: number; shards: number; clients: string[] }) =>
      (await actions()).creds({ ...opts, dir: userPath(opts.dir) }),
    );
}

/** The client commands that submit and follow jobs. */
function addJobCommands(program: Command): void {
  natsOption(
    jobOptions(program.command("submit").description("submit a job to a running mesh and follow it to the end")),
  )
    .option("--detach", "return once the job is submitted")
    .action(async (opts: JobFlags & NatsFlags & { detach?: boolean }) => (await actions()).submit(opts));

  natsOption(
    program
      .command("watch")
      .description("follow a job to its end (a job that ended is reported at once)")
      .argument("<job>"),
  ).action(async (job: string, opts: NatsFlags) => (await actions()).watch(job, opts));

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
    .action(async (job: string | undefined, opts: NatsFlags & { json?: boolean; all?: boolean }) =>
      (await actions()).status(job, opts),
    );
}

/** The client commands that act on running jobs and their snapshots. */
function addSnapshotCommands(program: Command): void {
  natsOption(
    program
      .command("cancel")
      .description("stop a running job (its snapshots stay; giving its name to run or submit resumes it)")
      .argument("<job>"),
  ).action(async (job: string, opts: NatsFlags) => (await actions()).cancel(job, opts));

  natsOption(
    program.command("checkpoints").description("list a job's snapshots (also of a job that ended)").argument("<job>"),
  ).action(async (job: string, opts: NatsFlags) => (await actions()).checkpoints(job, opts));

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
    .action(async (job: string | undefined, opts: NatsFlags & { port: number; host: string }) =>
      (await actions()).dashboard(job, opts),
    );

  natsOption(
    program
      .command("metrics")
      .description("list every service's Prometheus /metrics endpoint (from service discovery)"),
  ).action(async (opts: NatsFlags) => (await actions()).metrics(opts));

  natsOption(
    program.command("save").description("take a snapshot of a running job at its next step").argument("<job>"),
  ).action(async (job: string, opts: NatsFlags) => (await actions()).save(job, opts));

  natsOption(
    program
      .command("resize")
      .description(
        "change a running job's trainers or shards at a step boundary: it snapshots, every service reopens it with the new sizes from there (the rest of the epoch is re-split among the trainers; the shards take the chunks as the new hash ring says)",
      )
      .argument("<job>")
      .option("--trainers <n>", "trainer ranks from the next snapshot on (the mesh must run them)", int(1, 64))
      .option("--shards <n>", "parameter-server shards (parameter-server mode)", int(1, 64)),
  ).action(async (job: string, opts: NatsFlags & { trainers?: number; shards?: number }) =>
    (await actions()).resize(job, opts),
  );

  natsOption(
    program
      .command("restore")
      .description("roll a running job back to a snapshot (default: the newest that verifies)")
      .argument("<job>")
      .argument("[id]"),
  ).action(async (job: string, id: string | undefined, opts: NatsFlags) => (await actions()).restore(job, id, opts));
}
