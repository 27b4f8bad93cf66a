// Limits of the checkpoint service.

/** Checkpoint format version written into every manifest; a reader refuses others. */
export const formatVersion = 1;
/** Largest file of a snapshot read back (one shard's parameters and optimizer state). */
export const fileBytesMax = 1 << 30;
/** Manifests are small: config text and a file table. */
export const manifestBytesMax = 4 << 20;
/** Snapshots kept per job at most, whatever keepLast says (disk is finite). */
export const snapshotsMax = 1000;
/** A shard's state request: the shard copies its memory out, the transfer is the cost. */
export const stateTimeoutMs = 60_000;
/** A cut (a shard's, a replica's or a ZeRO partition's) is asked again after this, then at twice
 *  the wait (at most cutReaskMs) while unanswered: one that reached a shard or a trainer as it was
 *  SIGKILLed is never answered, and the restarted process (up within a second or two) refuses it
 *  while it waits for its restore, which this save holds up (the service takes a job's saves and
 *  restores one at a time). Asked once, such a save held the job 60 s (the chaos test under load:
 *  60.2 s before the first step after the restore). A cut asked twice is made twice, the same. */
export const cutReaskFirstMs = 2_000;
export const cutReaskMs = 10_000;
/** A resize: how long it waits for the snapshot it asks the ranks for (then it resumes from the newest one). */
export const resizeSnapshotWaitMs = 60_000;
/** A resize: how long every service gets to close the job once it is paused. */
export const resizeCloseWaitMs = 60_000;
/** A resize: the data-loader's plan of the resized job. */
export const resizePlanTimeoutMs = 60_000;
