// Limits of the live dashboard (sdk/dashboard/server.ts): what one process holds for the pages
// it serves, whatever the job or the number of browsers does.
import { heartbeatMs } from "../../services/runtime/control/liveness.ts";

/** Pages following a job at once (each an open event stream); one more gets 503 and a reason. */
export const dashboardClientsMax = 32;
/** Jobs followed at once by one dashboard (each a subscription and its history); the least recently viewed is dropped first. */
export const jobViewsMax = 16;
/** Messages queued for one page that reads too slowly; past it the page is cut off (its EventSource reconnects and gets the whole state again). */
export const clientQueuedMax = 256;
/** Points of one curve (loss by step, samples/s by time, evaluations): past it every other point is dropped, so a long job's curve keeps its shape in bounded memory. */
export const seriesPointsMax = 20_000;
/** Notable lines kept (restores, stalls, stragglers, snapshots, failures): the newest. */
export const logLinesMax = 200;
/** Snapshots listed on the page: the newest. */
export const snapshotsShownMax = 50;
/** Processes of a job shown in the health table (64 trainers, 64 shards, a data-loader, a spare). */
export const processesMax = 160;
/** Steps per rank whose split (data, pull, compute, push) is averaged for the per-rank bars. */
export const splitWindowSteps = 20;
/** How often the pages get what changed: batching keeps a fast job (hundreds of steps/s) from redrawing the charts per event. */
export const flushMs = 250;
/** How often a job's status (shard clocks, each trainer's step) is asked for while a page is open. */
export const statusPollMs = 2_000;
/** A process whose heartbeat (every heartbeatMs) is missing this long shows as silent: two missed beats and some slack. */
export const silentAfterMs = 2 * heartbeatMs + 1_000;
/** A process that restarted shows so this long. */
export const restartShownMs = 60_000;
/** Wall-clock window the samples/s curve averages over. */
export const rateWindowMs = 5_000;
/** An event or a heartbeat larger than this is not one (they are a few hundred bytes). */
export const messageBytesMax = 1 << 16;

if (silentAfterMs <= heartbeatMs)
  throw new Error("silentAfterMs must exceed heartbeatMs: a live process would flicker as silent");
if (flushMs >= statusPollMs) throw new Error("flushMs must be below statusPollMs");
