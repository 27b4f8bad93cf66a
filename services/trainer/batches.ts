// A batch from the data-loader as the model takes it: rows of images and labels, or token
// windows, whole or cut into micro-batches.
import type { HostBatch } from "../../engine/train.ts";
import type { Batch } from "../../schemas/messages/data-loader.ts";

/** Rows [r, r+n) of a batch as the model takes them: images and labels, or token windows
 *  (inputs a window's first T tokens, targets its last T). */
function hostRows(b: Batch, r: number, n: number): HostBatch {
  if (b.tokens === undefined || b.tokens.length === 0) {
    return {
      inputs: b.x.subarray(r * b.cols, (r + n) * b.cols),
      inputShape: [n, b.cols],
      targets: b.y.subarray(r, r + n),
      targetShape: [n],
    };
  }
  const T = b.cols;
  const inputs = new Int32Array(n * T),
    targets = new Int32Array(n * T);
  for (let i = 0; i < n; i++) {
    const w = b.tokens.subarray((r + i) * (T + 1), (r + i + 1) * (T + 1));
    inputs.set(w.subarray(0, T), i * T);
    targets.set(w.subarray(1), i * T);
  }
  return { inputs, inputShape: [n, T], targets, targetShape: [n, T] };
}

/** The whole batch as the model takes it. */
export const toHost = (b: Batch): HostBatch => hostRows(b, 0, b.rows);
/**
 * The step's batch cut into `k` micro-batches (gradient accumulation: each micro-batch's mean
 * loss is back-propagated with weight 1/k). A short last batch is cut into fewer.
 */
export function microBatches(b: Batch, k: number): HostBatch[] {
  const size = Math.ceil(b.rows / Math.min(k, b.rows));
  const out: HostBatch[] = [];
  for (let r = 0; r < b.rows; r += size) out.push(hostRows(b, r, Math.min(size, b.rows - r)));
  return out;
}
