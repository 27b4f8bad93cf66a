// Limits the services share. Each has a reason.

/**
 * The largest magnitude a loaded state value (a parameter, an optimizer moment) may have: 2^64,
 * about 1.8e19, the square root of float32's largest value. A training run cannot hold a larger
 * one and still be finite: its square (in a gradient norm, Adam's second moment, a dot product of
 * the next forward) overflows to infinity. A snapshot that holds one was not written by training:
 * a shard or replica refuses it, naming the chunk, rather than load a model that is already lost.
 */
export const stateValueAbsMax = 2 ** 64;

/** Every value finite and within ±stateValueAbsMax. */
export function plausibleState(v: Float32Array): boolean {
  for (let i = 0; i < v.length; i++) {
    const x = v[i]!;
    // NaN fails both comparisons
    if (!(x <= stateValueAbsMax && x >= -stateValueAbsMax)) return false;
  }
  return true;
}

/** What a refusal says about a value plausibleState refused. */
export const implausibleStateText = `a value that is NaN, infinite or beyond ±${stateValueAbsMax.toExponential(2)} (no training run holds one)`;
