// embedding: out (...,C) = table (V,C) [ids (...)]; ids are i32 in [0,V).
import { IndexRangeError, ShapeError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";
import { checkDType, checkInputs } from "./check.ts";

export function embedding(table: Tensor, ids: Tensor): Tensor {
  const ctx = checkInputs("embedding", [table, ids]);
  checkDType("embedding", table, "f32");
  checkDType("embedding", ids, "i32");
  if (table.shape.length !== 2) throw new ShapeError("embedding", [table.shape, ids.shape], "table must be (V,C)");
  const [V, C] = table.shape as [number, number];
  const N = ids.numel;
  const be = ctx.backend;
  const out = ctx.empty([...ids.shape, C]);
  // ids known on the host to be in range need no count (on a GPU: no wait in the forward pass)
  const invalid = be.embeddingForward(out.ptr, ids.ptr, table.ptr, N, C, V, ids.knownInRange(V));
  if (invalid > 0) throw new IndexRangeError("embedding", invalid, V, ids.shape);
  ctx.record(
    "embedding",
    [table],
    out,
    () => {
      // forward was: out[n,:] = table[ids[n],:]  =>  dtable[ids[n],:] += dout[n,:]
      be.embeddingBackward(table.ensureGrad().ptr, ids.ptr, out.grad!.ptr, N, C);
    },
    [ids],
  );
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

export function embeddingReference(table: Float64Array, ids: Int32Array, C: number): Float64Array {
  const out = new Float64Array(ids.length * C);
  for (let n = 0; n < ids.length; n++) for (let c = 0; c < C; c++) out[n * C + c] = table[ids[n]! * C + c]!;
  return out;
}

export function embeddingBackwardReference(ids: Int32Array, dout: Float64Array, V: number, C: number): Float64Array {
  const dtable = new Float64Array(V * C);
  for (let n = 0; n < ids.length; n++) {
    for (let c = 0; c < C; c++) dtable[ids[n]! * C + c] = dtable[ids[n]! * C + c]! + dout[n * C + c]!;
  }
  return dtable;
}
