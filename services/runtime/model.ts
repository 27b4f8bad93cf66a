// The model a job trains, as the services need it: the trainer builds it to compute; the
// parameter server takes only its initial flat parameter vector and the decay boundary, so
// every process agrees on the layout of the vector without exchanging it.
import type { Backend } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { saveModelFile } from "../../engine/modelfile.ts";
import { type MlpConfig, MlpModel } from "../../engine/models/mlp.ts";
import { Context } from "../../engine/tensor.ts";
import type { ShardState } from "../../schemas/messages.ts";
import { CorruptDataError } from "./errors.ts";
import type { JobConfig } from "./job.ts";
import { buildLayout } from "./layout.ts";

export const modelConfigOf = (cfg: JobConfig): MlpConfig => ({ widths: cfg.model.widths, activation: "relu", dropout: cfg.model.dropout });

export function buildModel(ctx: Context, cfg: JobConfig): MlpModel {
  return new MlpModel(ctx, modelConfigOf(cfg), cfg.seed);
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

/**
 * Writes the model file (engine/modelfile.ts, what `meshtrain eval` and `train` read) of a job's
 * parameters as the shards hold them: every chunk is put back at its place in the flat vector.
 * Every chunk of the layout must be present exactly once.
 */
export function exportModelFile(cfg: JobConfig, states: readonly ShardState[], path: string, step: number): void {
  const ctx = new Context(new CpuBackend(), { seed: cfg.seed });
  try {
    const model = buildModel(ctx, cfg);
    const store = model.store;
    const layout = buildLayout(cfg.job, store.slabNumel, store.decayRange.numel, cfg.chunkBytes, cfg.shards);
    const slab = new Float32Array(store.slabNumel);
    const seen = new Set<number>();
    for (const s of states) {
      for (const c of s.chunks) {
        const info = layout.chunks[c.id];
        if (!info || c.params.length !== info.count || seen.has(c.id)) {
          throw new CorruptDataError(`shard ${s.shard}'s state holds chunk ${c.id} with ${c.params.length} values, which the job's layout does not have`);
        }
        slab.set(c.params, info.offset);
        seen.add(c.id);
      }
    }
    if (seen.size !== layout.chunks.length) throw new CorruptDataError(`the shards' states hold ${seen.size} of the job's ${layout.chunks.length} chunks`);
    store.writeValues(slab);
    saveModelFile(path, store, { kind: "mlp", config: modelConfigOf(cfg), step, training: cfg });
  } finally {
    ctx.dispose();
  }
}
