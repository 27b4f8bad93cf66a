// `meshtrain run`: the README's main job. Starts a local mesh sized for the job (embedded
// nats-server plus the services of deploy/docker-compose.yml as processes: as many trainers and
// shards as the job has), submits an MNIST job, shows its progress, and prints the final test
// accuracy and where the model, snapshots and logs went. The mesh is stopped at the end, and on
// Ctrl-C (after a snapshot), with nothing left running or behind.
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { JobState } from "../../schemas/messages/job.ts";
import { CheckpointStore } from "../../services/checkpoint/store.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { BadRequestError, DeadlineError } from "../../services/runtime/mesh/errors.ts";
import { probeCuda } from "../../ffi/cuda/driver.ts";
import type { DeviceChoice } from "../../ffi/select.ts";
import { attentionDeviceProblem } from "../../services/runtime/job/attention.ts";
import { planDevice, planReport } from "../plan.ts";
import { type JobConfig, jobConfigFromJson, parseJobConfig, usesShards } from "../../services/runtime/job/config.ts";
import { defaultOwner, otherOwnerProblem, ownerOfJob, qualifyJob } from "../../services/runtime/job/subjects.ts";
import { checkResume, MeshClient, type PreviousRun, resumedWorld } from "../client.ts";
import { LocalMesh, membersWaitMs } from "../local-mesh.ts";
import { checkedJobName, type JobFlags, jobConfigOf } from "./job-options.ts";
import { exitCodes } from "./exit.ts";
import { configSummary, outcomeLines } from "../report.ts";
import { checkOutDir, defaultRunDir, runCommandName, shownPath } from "../user-paths.ts";
import { StopRequests } from "../signals.ts";
import { Dashboard } from "../dashboard/server.ts";
import { JobFailedError, watchJob } from "../watch.ts";

export interface MeshRunOptions {
  /** the job options the user typed */
  flags: JobFlags;
  /** folder for the jobs' folders (absolute) */
  dir: string;
  /** stop waiting after this long */
  timeoutMin: number;
  /** the port of the job's live web page on 127.0.0.1 (0, and by default: a free one); null: no page */
  dashboardPort?: number | null;
  /** --device-memory: a trainer's device memory for the fit check (default: the GPU's, or this machine's) */
  deviceMemory?: number | null;
}

/** How long a stop waits for the snapshot it asks for before stopping anyway. */
const stopSnapshotMs = 30_000;

/**
 * The job's earlier run, from its newest snapshot in the jobs folder (a local run's mesh is new
 * each time), else from the config it wrote at start (a run that failed before any snapshot).
 */
function previousOnDisk(jobsDir: string, job: string): PreviousRun | null {
  const snapshot = new CheckpointStore(jobsDir).list(job).at(-1) ?? null;
  if (snapshot) return { config: jobConfigFromJson(snapshot.configJson), record: null, snapshot, orphaned: false };
  const started = join(jobsDir, job, "logs", "job.json");
  return existsSync(started)
    ? { config: jobConfigFromJson(readFileSync(started, "utf8")), record: null, snapshot: null, orphaned: false }
    : null;
}

/** The job of a run, checked (it fits, it may resume), its folders made and its header printed. */
function prepareRun(o: MeshRunOptions): {
  cfg: JobConfig;
  jobsDir: string;
  jobDir: string;
  logDir: string;
  resumeLine: string;
  shards: number;
} {
  checkOutDir(o.dir, "--dir");
  const jobsDir = join(o.dir, "jobs");
  // the local mesh's one client user owns the job (its name without an owner is the default's)
  const qualify = (job: string) => {
    const id = qualifyJob(job, defaultOwner);
    if (ownerOfJob(id) !== defaultOwner) throw new BadRequestError(otherOwnerProblem(job, defaultOwner));
    return id;
  };
  const prev = o.flags.job === undefined ? null : previousOnDisk(jobsDir, qualify(checkedJobName(o.flags.job)));
  let cfg = jobConfigOf(o.flags, prev?.config ?? null, qualify);
  // resumed on other trainers: the world from the snapshot's step, as the submission draws it
  if (prev) {
    cfg = resumedWorld(cfg, prev);
    checkResume(cfg, prev, shownPath(jobsDir));
  }
  // a job that cannot fit, or asks for attention its trainers cannot run, is refused before any process starts
  const device = (process.env.MT_DEVICE ?? "cpu") as DeviceChoice;
  const attention = cfg.attention === "cudnn" ? attentionDeviceProblem(cfg.attention, cpuTrainers(device)) : null;
  if (attention !== null) throw new ConfigError(`job ${cfg.job}: attention ${cfg.attention} ${attention}`);
  const { refusal } = planReport(
    cfg,
    planDevice(device === "cuda" && o.deviceMemory == null && !probeCuda().ok ? "cpu" : device, o.deviceMemory ?? null),
  );
  if (refusal !== null)
    throw new ConfigError(
      `job ${cfg.job} does not fit: ${refusal} (meshtrain plan with the same options prints each trainer's share)`,
    );
  const jobDir = join(jobsDir, cfg.job),
    logDir = join(jobDir, "logs");
  mkdirSync(logDir, { recursive: true });
  writeFileSync(join(logDir, "job.json"), `${JSON.stringify(cfg, null, 2)}\n`);

  const resumeLine = `${runCommandName()} --job ${cfg.job}${o.dir === join(process.env.INIT_CWD ?? process.cwd(), defaultRunDir()) ? "" : ` --dir ${shownPath(o.dir)}`}`;
  const from =
    prev === null
      ? ""
      : prev.snapshot
        ? `, resumed from ${prev.snapshot.id}`
        : ", started again with its settings (it has no snapshot)";
  const shards = usesShards(cfg) ? cfg.shards : 0;
  console.log(
    `meshtrain run: job ${cfg.job}${from}, on a local mesh of ${cfg.trainers} trainer` +
      `${cfg.trainers > 1 ? "s" : ""}, ${shards > 0 ? `${shards} parameter-server shard${shards > 1 ? "s" : ""}, ` : ""}a data-loader and a checkpoint service`,
  );
  for (const line of configSummary(cfg, device)) console.log(`  ${line}`);
  console.log(`  files      ${shownPath(jobDir)}/ (snapshots, model.mtm, logs/; the full config: logs/job.json)`);

  return { cfg, jobsDir, jobDir, logDir, resumeLine, shards };
}

/** Why the local mesh's trainers compute on the CPU (MT_DEVICE, as the launcher passes it on); null: on GPUs. */
function cpuTrainers(device: DeviceChoice): string | null {
  if (device === "cpu")
    return `the local mesh's trainers compute on the CPU (MT_DEVICE${process.env.MT_DEVICE === undefined ? " unset: cpu" : "=cpu"}; MT_DEVICE=cuda puts them on GPUs)`;
  if (device === "cuda") return null; // without a GPU the trainers fail to start, saying what is missing
  const probe = probeCuda();
  return probe.ok
    ? null
    : `MT_DEVICE=auto finds no GPU here (${probe.reason}), so the trainers would compute on the CPU`;
}

/** Runs the job to its end; resolves with the process's exit code. */
export async function runMesh(o: MeshRunOptions): Promise<number> {
  const { cfg, jobsDir, jobDir, logDir, resumeLine, shards } = prepareRun(o);
  let print = (line: string) => console.log(line);
  using stop = new StopRequests((s) =>
    print(`${s}: stopping job ${cfg.job}: a snapshot first, then the mesh (again to stop at once)`),
  );
  let client: MeshClient | null = null;
  let dashboard: Dashboard | null = null;
  // a service that cannot start before the job is submitted: the submission stops waiting for it
  const startFailed = new AbortController();
  let submitted = false;
  const mesh = await LocalMesh.start({
    jobsDir,
    logDir,
    trainers: cfg.trainers,
    shards,
    onEvent: (line) => print(`launcher: ${line}`),
    // a service that cannot start, or keeps crashing, fails the job with its own last error
    onGiveUp: (service, lastError, log, cannotStart) => {
      const reason = `${service} ${cannotStart ? "cannot start" : "keeps crashing"}: ${lastError} (log: ${shownPath(log)})`;
      if (!submitted) startFailed.abort(reason);
      void client?.failRunning(reason).catch(() => {});
    },
  });
  stop.second.signal.addEventListener("abort", () => void mesh.stop(true), { once: true });
  try {
    // the job's own client: the client role (it submits, follows, snapshots and, when a service
    // keeps crashing, fails the job; restoring and resizing are the admin's)
    client = await MeshClient.connect(mesh.url, { ...mesh.auth("client"), owner: defaultOwner });
    dashboard = await startDashboard(client, cfg.job, o.dashboardPort === undefined ? 0 : o.dashboardPort);
    // the launcher started every rank the job needs: wait for them to register
    await client.submit(cfg, { membersWaitMs, signal: AbortSignal.any([stop.first.signal, startFailed.signal]) });
    submitted = true;
    const plan = await client.collectivePlan(cfg);
    if (plan !== null) console.log(`  collective ${plan.text}`);
    console.log("submitted; the mesh opens the job (data, parameters), then the trainers start");
    const timeout = AbortSignal.timeout(o.timeoutMin * 60_000);
    const outcome = await watchJob(client, cfg.job, {
      signal: AbortSignal.any([stop.first.signal, timeout]),
      onLine: (p) => (print = p),
    });
    for (const line of outcomeLines(outcome, { logs: logDir })) console.log(line);
    return exitCodes.done;
  } catch (e) {
    if (startFailed.signal.aborted)
      throw new JobFailedError(`job ${cfg.job} cannot run: ${String(startFailed.signal.reason)}`, null);
    // a stop asked for, unless the job itself failed meanwhile (that is the news)
    if (stop.requested && !(e instanceof JobFailedError)) {
      if (submitted && client && !stop.second.signal.aborted) await stopCleanly(client, cfg.job, stop);
      console.log(
        `stopped; files in ${shownPath(jobDir)}. ${submitted ? "Resume" : "Start it again"} with: ${resumeLine}`,
      );
      return stop.exitCode;
    }
    if (e instanceof DeadlineError)
      throw new DeadlineError(
        `${e.message}; job ${cfg.job} did not end within --timeout-min ${o.timeoutMin} (logs: ${shownPath(logDir)}); resume it with: ${resumeLine}`,
      );
    if (e instanceof JobFailedError) {
      const resumable = e.record?.state === JobState.Failed ? ` Once fixed, resume it with: ${resumeLine}` : "";
      throw new JobFailedError(`${e.message} (logs: ${shownPath(logDir)}).${resumable}`, e.record);
    }
    throw e;
  } finally {
    print = (line) => console.log(line);
    await dashboard?.stop();
    await client?.close();
    await mesh.stop();
  }
}

/** The job's live page, following the job from before its submission (so it has every event); its URL is printed. */
async function startDashboard(client: MeshClient, job: string, port: number | null): Promise<Dashboard | null> {
  if (port === null) return null;
  const d = Dashboard.start({ client, port });
  await d.follow(job, { known: false });
  console.log(`  dashboard  ${d.jobUrl(job)} (live while the job runs; --no-dashboard for none)`);
  return d;
}

/** After a stop request: a snapshot of the job at its next step, unless a second signal comes first. */
async function stopCleanly(client: MeshClient, job: string, stop: StopRequests): Promise<void> {
  try {
    const snap = client.saveCheckpoint(job, stopSnapshotMs);
    snap.catch(() => {}); // reported below, or dropped when a second signal wins
    const second = new Promise<null>((resolve) =>
      stop.second.signal.addEventListener("abort", () => resolve(null), { once: true }),
    );
    const e = await Promise.race([snap, second]);
    console.log(e ? `snapshot taken: ${e.text}` : "stopping at once; the newest snapshot is the last scheduled one");
  } catch (err) {
    console.log(
      `no snapshot on the way out (${(err as Error).message}); the newest snapshot is the last scheduled one`,
    );
  }
}
