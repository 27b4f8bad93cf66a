// The model a job trains, as the services need it: the trainer builds it to compute; the
// parameter server takes only its initial flat parameter vector and the decay boundary, so
// every process agrees on the layout of the vector without exchanging it.
import type { Backend } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import { Context } from "../../engine/tensor.ts";
import type { JobConfig } from "./job.ts";

export function buildModel(ctx: Context, cfg: JobConfig): MlpModel {
  return new MlpModel(ctx, { widths: cfg.model.widths, activation: "relu", dropout: cfg.model.dropout }, cfg.seed);
}

export interface InitialParameters {
  /** the whole slab, padding included (what trainers push and pull) */
  values: Float32Array;
  /** leading elements that take weight decay */
  decayElems: number;
  paramCount: number;
}

export function initialParameters(cfg: JobConfig, backend: Backend = new CpuBackend()): InitialParameters {
  const ctx = new Context(backend, { seed: cfg.seed });
  try {
    const model = buildModel(ctx, cfg);
    const values = new Float32Array(model.store.slabNumel);
    backend.download(model.store.values.ptr, values);
    return { values, decayElems: model.store.decayRange.numel, paramCount: model.store.paramCount };
  } finally {
    ctx.dispose();
  }
}
