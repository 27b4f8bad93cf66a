// Limits of a trainer.

/** A pull may wait for the slowest trainer (BSP/SSP): as long as the shard lets it wait
 *  (parameter-server pullWaitMsMax) plus a margin for the transfer. */
export const pullTimeoutMs = 130_000;
/** A pull and a batch request are asked again this often while unanswered (bus.ts RequestOptions):
 *  one lost on a route to a NATS server cut off costs this, not the whole timeout. Both are
 *  idempotent; a shard keeps the waiting pulls of one trainer until they are answered together. */
export const reaskMs = 10_000;
/** A batch request is asked again sooner, first after this (then 2 s, 4 s, 8 s, 10 s): a
 *  data-loader killed while it held the ask is back within about a second, and a batch asked twice
 *  costs it one more send of a batch it holds already. */
export const batchReaskFirstMs = 1_000;
/** Messages of one push or pull a trainer keeps in flight to each shard: a shard's server
 *  buffers at most trainers x this x max_payload for it (a client whose buffer passes the
 *  server's max_pending is dropped as a slow consumer: services/runtime/mesh/nats-server.ts). */
export const psMessagesInFlight = 2;
/** Push, batch and checkpoint requests. */
export const requestTimeoutMs = 30_000;
/** A checkpoint save reads every shard and writes with fsync: allow for a large model. */
export const checkpointTimeoutMs = 120_000;
/** A snapshot rank 0 asks at a step boundary waits for the state's cut only (the write goes on in
 *  the background; with synchronous snapshots, for the write too): one not answered by then is
 *  skipped (a checkpoint service that died with the request, or is far behind), so that
 *  training stalls at most this long. */
export const scheduledSnapshotTimeoutMs = 30_000;
/** Batches a trainer lets the loader prepare ahead of it. */
export const loaderCredits = 4;
/** Batch requests a trainer keeps in flight beyond the step it runs (at most loaderCredits). */
export const batchLookAhead = 2;
/** Consecutive failed attempts of one step before the trainer gives up on the job. */
export const stepAttemptsMax = 20;
/** How long a step waits on services that answer NotReady (a shard that waits for its restore
 *  after a restart, which waits for a snapshot being written) before attempts count again: a
 *  restore's own time bound (the checkpoint service's), with room. */
export const notReadyWaitMsMax = 180_000;
/** The pause between those tries. */
export const notReadyPauseMs = 100;
/** How long a trainer waits for every shard to open a new job (a large model's shards
 *  initialize its parameters first) before it reports the job failed. */
export const jobStartWaitMsMax = 300_000;
/** How long a trainer waits for every rank and shard a new job needs to show up in service
 *  discovery (a process the launcher just restarted takes seconds) before failing the job. */
export const membersWaitMsMax = 30_000;
/** How long rank 0 waits for the other ranks' final evaluations (ASP ranks may trail). */
export const finishWaitMsMax = 600_000;
/** Pause between repeats of a finished rank's final events, until the job has ended. */
export const finalRepeatMs = 5_000;
/** Attempts at the final snapshot before the job ends without it. */
export const finalSaveAttemptsMax = 3;

/** The first timed snapshot of a run comes this soon at most (checkpointMinutes sets the rest):
 *  a job's first minutes are when faults from a bad deployment come, and a restore then should
 *  not send it back to step 0. */
export const firstTimedSnapshotMs = 60_000;

/** How long an NCCL communicator's ranks may take to find each other (rank 0's id through the job
 *  store, then ncclCommInitRank): a rank the launcher restarts after a fault loads the model and
 *  its snapshot first. The liveness watch aborts a wait on a rank that is gone before then. */
export const ncclConnectTimeoutMs = 300_000;
/** How long one NCCL operation may stay in progress: a bucket of a large model on a slow link
 *  takes seconds; a peer that stopped is named by the liveness watch within 10 s, which aborts. */
export const ncclSettleTimeoutMs = 120_000;
/** The longest pause between tries at the job store while a communicator's ranks exchange their id. */
export const ncclIdRetryPauseMsMax = 2_000;
/** The pause before asking service discovery again for ranks a reply missed (where each rank runs). */
export const placesRetryMs = 500;
