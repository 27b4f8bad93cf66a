// Limits of a parameter-server shard. Each has a reason; relations are asserted at load.

/** Largest message the shard accepts or sends: the server's max_payload set by the launcher
 *  (8 MB); deployments with NATS's default 1 MB set MT_PAYLOAD_BYTES_MAX and chunkBytes lower. */
export const payloadBytesMaxDefault = 8 << 20;
/** Largest chunk: a chunk must fit a message with room for headers. */
export const chunkBytesMax = 8 << 20;
/** Pulls waiting for the sync policy at once: W trainers x a few in-flight pulls each. */
export const pullWaitersMax = 1024;
/** How long a pull may wait for slower trainers before it is answered with DeadlineError. */
export const pullWaitMsMax = 120_000;
/** Jobs one shard process serves at once by default (--jobs-max). */
export const jobsMaxDefault = 16;

if (chunkBytesMax > payloadBytesMaxDefault) throw new Error("limits: chunkBytesMax must fit the default payload limit");
/** BSP clipping: how long a shard waits for the others' parts of a step's gradient norm (they
 *  wait for the same pushes its pulls do). */
export const normWaitMs = 120_000;
