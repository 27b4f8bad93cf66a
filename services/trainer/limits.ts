// Limits of a trainer.

/** A pull may wait for the slowest trainer (BSP/SSP): as long as the shard lets it wait
 *  (parameter-server pullWaitMsMax) plus a margin for the transfer. */
export const pullTimeoutMs = 130_000;
/** Push, batch and checkpoint requests. */
export const requestTimeoutMs = 30_000;
/** A checkpoint save reads every shard and writes with fsync: allow for a large model. */
export const checkpointTimeoutMs = 120_000;
/** Batches a trainer lets the loader prepare ahead of it. */
export const loaderCredits = 4;
/** Consecutive failed attempts of one step before the trainer gives up on the job. */
export const stepAttemptsMax = 20;
/** How long a trainer waits for every shard to open a new job (a large model's shards
 *  initialize its parameters first) before it reports the job failed. */
export const jobStartWaitMsMax = 300_000;
