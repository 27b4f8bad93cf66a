// Prometheus metrics of a service process (prom-client), served at http://<host>:<port>/metrics
// when the service's metricsPort is set (0: a port of the system's choosing, announced in the
// service's $SRV metadata as `metrics` and in its log; -1: none).
//
// What each process exposes, besides prom-client's process and runtime metrics (RSS, heap, CPU,
// event-loop lag):
//   mt_bus_messages_total, mt_bus_bytes_total      {direction: in|out, kind}  every NATS message
//       the process sent or took, by subject kind (the subject with the job and the numbers cut
//       out: mt.<job>.ps.<k>.push -> "ps.push", mt.<job>.coll.<r> -> "coll")
//   trainer  mt_trainer_step{job}, mt_trainer_loss{job}, mt_trainer_samples_per_second{job},
//            mt_trainer_step_seconds{job,phase} (the last step's split: data_wait, pull, compute,
//            push, comm, exposed_comm), mt_trainer_steps_total{job},
//            mt_collective_bytes_total{job} (values this rank's collectives delivered)
//   loader   mt_loader_batches_total{job}, mt_loader_queue_depth{job},
//            mt_loader_wait_seconds{job,quantile: 0.5|0.99}
//   shard    mt_shard_clock{job,shard,trainer} (the step each trainer pushed last),
//            mt_shard_staleness{job,shard} (fastest clock less slowest), mt_shard_updates_total{job,shard}
//   checkpoint  mt_checkpoint_bytes_total{job}, mt_checkpoint_fsync_seconds (histogram),
//            mt_checkpoint_snapshots_total{job}
//   a GPU    mt_device_memory_bytes{device} (the backend's live bytes)
// A job's series stay after the process closes the job, for the last closedJobsKept jobs.
import type * as Prom from "prom-client";

// prom-client's modules one by one, not its index: the index also loads its Pushgateway and its
// cluster aggregator, with node:http, https, url and zlib, which no service uses (the metrics are
// served by Bun.serve below). That halves its import (90 -> 48 ms of CPU), paid by every service
// process and every CLI command. The types are the package's own. prom-client's version is pinned
// (package.json); test/e2e/metrics.test.ts scrapes every metric below.
const client = {
  Registry: require("prom-client/lib/registry") as typeof Prom.Registry,
  Counter: require("prom-client/lib/counter") as typeof Prom.Counter,
  Gauge: require("prom-client/lib/gauge") as typeof Prom.Gauge,
  Histogram: require("prom-client/lib/histogram") as typeof Prom.Histogram,
  collectDefaultMetrics: require("prom-client/lib/defaultMetrics") as typeof Prom.collectDefaultMetrics,
};

export const registry = new client.Registry();
// The event loop's lag is sampled every 100 ms, not every 10 (prom-client's default): the 10-ms
// timer alone kept an idle service at 0.8% of a core against 0.27%, in every process of a mesh
// for its whole life (7,400 process-seconds in a run of the test suite). The lag's quantiles are
// of the same delays, taken ten times a second.
client.collectDefaultMetrics({ register: registry, eventLoopMonitoringPrecision: 100 });

const counter = (name: string, help: string, labelNames: string[]) =>
  new client.Counter({ name, help, labelNames, registers: [registry] });
const gauge = (name: string, help: string, labelNames: string[]) =>
  new client.Gauge({ name, help, labelNames, registers: [registry] });

export const m = {
  busMessages: counter("mt_bus_messages_total", "NATS messages this process sent (out) or took (in), by subject kind", [
    "direction",
    "kind",
  ]),
  busBytes: counter(
    "mt_bus_bytes_total",
    "bytes of NATS message payloads this process sent (out) or took (in), by subject kind",
    ["direction", "kind"],
  ),
  trainerStep: gauge("mt_trainer_step", "the step this trainer rank finished last", ["job"]),
  trainerSteps: counter("mt_trainer_steps_total", "training steps this trainer rank finished", ["job"]),
  trainerLoss: gauge("mt_trainer_loss", "the training loss of this rank's last step", ["job"]),
  trainerRate: gauge("mt_trainer_samples_per_second", "samples per second of this rank's last step", ["job"]),
  trainerPhase: gauge("mt_trainer_step_seconds", "the last step's time by phase", ["job", "phase"]),
  collectiveBytes: counter("mt_collective_bytes_total", "bytes of values this rank's collectives delivered to peers", [
    "job",
  ]),
  loaderBatches: counter("mt_loader_batches_total", "batches the data-loader answered", ["job"]),
  loaderQueue: gauge("mt_loader_queue_depth", "batches prepared and waiting, over all ranks", ["job"]),
  loaderWait: gauge("mt_loader_wait_seconds", "time from a batch request to its reply", ["job", "quantile"]),
  shardClock: gauge("mt_shard_clock", "the step each trainer pushed last to this shard", ["job", "shard", "trainer"]),
  shardStaleness: gauge(
    "mt_shard_staleness",
    "steps between the fastest and the slowest trainer's clock on this shard",
    ["job", "shard"],
  ),
  shardUpdates: gauge("mt_shard_updates_total", "updates this shard applied", ["job", "shard"]),
  checkpointBytes: counter("mt_checkpoint_bytes_total", "bytes of snapshot files written", ["job"]),
  checkpointSnapshots: counter("mt_checkpoint_snapshots_total", "snapshots written", ["job"]),
  checkpointFsync: new client.Histogram({
    name: "mt_checkpoint_fsync_seconds",
    help: "time of each fsync of a snapshot file or folder",
    buckets: [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5],
    registers: [registry],
  }),
  deviceMemory: gauge("mt_device_memory_bytes", "bytes the compute backend holds (live allocations)", ["device"]),
};

/** Jobs this process closed whose series are kept (their last values, for a scrape that comes
 *  after the end), the newest last; past closedJobsKept the oldest's series are dropped, so that a
 *  long-lived service's metrics do not grow with every job it ever ran. */
const closedJobs: string[] = [];
export const closedJobsKept = 16;

/** A job this process closed (its spec went away: it ended, or a resize reopens it). */
export function jobClosed(job: string): void {
  jobOpened(job);
  closedJobs.push(job);
  while (closedJobs.length > closedJobsKept) void dropJobSeries(closedJobs.shift()!);
}

/** A job this process opens (again): its series are live, not a closed job's. */
export function jobOpened(job: string): void {
  const i = closedJobs.indexOf(job);
  if (i >= 0) closedJobs.splice(i, 1);
}

async function dropJobSeries(job: string): Promise<void> {
  for (const metric of Object.values(m)) {
    const { values } = await metric.get();
    for (const v of values) if (v.labels.job === job) metric.remove(v.labels as Record<string, string | number>);
  }
}

/** A subject's kind: its tokens after mt.<job>, without the numbers (ranks, shards). */
export function subjectKind(subject: string): string {
  const t = subject.split(".");
  if (t[0] === "$SRV" || t[0] === "_INBOX" || t[0] === "$JS" || t[0] === "$KV")
    return t[0].toLowerCase().replace("$", "");
  if (t[0] !== "mt") return "other";
  // mt.ctl.<what> has no job tokens; a job's subjects are mt.<owner>.<name>.<what>
  const rest = t[1] === "ctl" ? t.slice(1) : t.slice(3);
  return rest.filter((x) => !/^\d+$/.test(x)).join(".") || "mt";
}

/** Counts one message on the bus. */
export function busTraffic(direction: "in" | "out", subject: string, bytes: number): void {
  const kind = subjectKind(subject);
  m.busMessages.inc({ direction, kind });
  m.busBytes.inc({ direction, kind }, bytes);
}

/** Callbacks that set gauges from the process's state when the metrics are read (a shard's
 *  clocks, the loader's queue): registered by each service, run before every scrape. */
const collectors: (() => void)[] = [];
export function onScrape(collect: () => void): void {
  collectors.push(collect);
}

/** The metrics in Prometheus's text format, as a scrape reads them. */
export async function scrape(): Promise<string> {
  for (const c of collectors) {
    try {
      c();
    } catch {
      // a collector of a job that is closing: its gauges keep their last values
    }
  }
  return registry.metrics();
}

export interface MetricsServer {
  readonly port: number;
  readonly url: string;
  stop(): Promise<void>;
}

/** Why the process is not ready to serve (null: ready); read on every GET /readyz. */
export type Readiness = () => string | null;

/** Serves the registry at /metrics on `port` (0: any free port) of `host`, and the health routes
 *  an orchestrator probes (deploy/k8s/): /healthz answers 200 while the process's event loop
 *  does (liveness), /readyz 200 when `ready` says so, else 503 with the reason (readiness). */
export function serveMetrics(port: number, host = "0.0.0.0", ready: Readiness = () => null): MetricsServer {
  const server = Bun.serve({
    port,
    hostname: host,
    async fetch(req) {
      const path = new URL(req.url).pathname;
      if (path === "/healthz") return new Response("ok\n");
      if (path === "/readyz") {
        const why = ready();
        return why === null ? new Response("ready\n") : new Response(`not ready: ${why}\n`, { status: 503 });
      }
      if (path !== "/metrics")
        return new Response("meshtrain serves /metrics, /healthz and /readyz here\n", { status: 404 });
      return new Response(await scrape(), { headers: { "content-type": registry.contentType } });
    },
  });
  const shown = host === "0.0.0.0" ? "127.0.0.1" : host;
  return { port: server.port!, url: `http://${shown}:${server.port}/metrics`, stop: () => server.stop(true) };
}
