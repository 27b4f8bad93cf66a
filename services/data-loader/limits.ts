// Limits of the data-loader.

/** Batches prepared ahead per rank, whatever a trainer asks for: bounds memory per rank
 *  (64 MNIST samples are 200 KB; 8 ahead is 1.6 MB) while hiding a slow step or two. */
export const prefetchMax = 8;
/** Rows of an evaluation batch (larger batches are fewer messages; 1000 x 784 x 4 = 3.1 MB). */
export const evalBatchRows = 1000;
/** Jobs one loader process serves at once by default (--jobs-max): jobs reading the same folder
 *  share one copy of it, but each holds its sampler state and prefetched batches. */
export const jobsMaxDefault = 8;
/** Request latencies kept for the p50/p99 wait statistics. */
export const waitSamplesMax = 4096;
