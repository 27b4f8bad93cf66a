// The model a job trains, as the services need it: the trainer builds it to compute; the
// parameter server takes only its initial flat parameter vector and the decay boundary, so
// every process agrees on the layout of the vector without exchanging it. A GPT's size depends
// on its vocabulary, which the job's plan carries (plan.ts).
import type { Backend } from "../../../ffi/backend.ts";
import { CpuBackend } from "../../../ffi/cpu/backend.ts";
import { loadHfFolder } from "../../../engine/hf-gpt2.ts";
import { saveModelFile } from "../../../engine/modelfile.ts";
import { type GptConfig, GptModel } from "../../../engine/models/gpt.ts";
import { type MlpConfig, MlpModel } from "../../../engine/models/mlp.ts";
import type { Model } from "../../../engine/models/model.ts";
import { Context } from "../../../engine/context.ts";
import type { DataPlan } from "../../../schemas/messages/data-loader.ts";
import type { ShardState } from "../../../schemas/messages/parameter-server.ts";
import { CorruptDataError } from "../mesh/errors.ts";
import type { JobConfig } from "./config.ts";
import { buildLayout } from "./layout.ts";

/** What a plan must say for the model to be built: the vocabulary of token data. */
export type ModelPlan = Pick<DataPlan, "vocabSize" | "vocab"> & { tokenizer?: string };

export function modelConfigOf(cfg: JobConfig, plan: ModelPlan): MlpConfig | GptConfig {
  const m = cfg.model;
  if (m.kind === "mlp") return { widths: m.widths, activation: "relu", dropout: m.dropout };
  if (plan.vocabSize < 1) throw new CorruptDataError(`the plan of gpt job ${cfg.job} has no vocabulary size`);
  return {
    vocabSize: plan.vocabSize,
    blockSize: m.blockSize,
    nLayer: m.nLayer,
    nHead: m.nHead,
    nEmbd: m.nEmbd,
    dropout: m.dropout,
  };
}

/** The job's model as it starts: from the seed, or (initFrom) a Hugging Face GPT-2 folder's
 *  tensors. `fresh` false: from the seed whatever the job says (its values are about to be
 *  replaced, or only its layout is wanted). */
export function buildModel(ctx: Context, cfg: JobConfig, plan: ModelPlan, fresh = true): Model {
  const config = modelConfigOf(cfg, plan);
  if (cfg.model.kind === "mlp") return new MlpModel(ctx, config as MlpConfig, cfg.seed);
  const gpt = new GptModel(ctx, config as GptConfig, cfg.seed);
  gpt.recompute = cfg.recompute;
  if (fresh && cfg.initFrom !== "") {
    const values = gpt.store.readValues();
    loadHfFolder(cfg.initFrom, gpt.store.entries, values);
    gpt.store.writeValues(values);
  }
  return gpt;
}

/** The model file's header fields for a job's model (a GPT's character vocabulary, for sampling). */
export function modelFileFields(
  cfg: JobConfig,
  plan: ModelPlan,
): { kind: "mlp" | "gpt"; config: object; vocab?: string[]; tokenizer?: "gpt2" } {
  const config = modelConfigOf(cfg, plan);
  if (cfg.model.kind === "mlp") return { kind: "mlp", config };
  return {
    kind: "gpt",
    config,
    ...(plan.vocab.length > 0 ? { vocab: plan.vocab.map((c) => String.fromCodePoint(c)) } : {}),
    ...(plan.tokenizer === "gpt2" ? { tokenizer: "gpt2" as const } : {}),
  };
}

export interface InitialParameters {
  /** the whole slab, padding included (what trainers push and pull) */
  values: Float32Array;
  /** leading elements that take weight decay */
  decayElems: number;
  paramCount: number;
}

export function initialParameters(
  cfg: JobConfig,
  plan: ModelPlan,
  backend: Backend = new CpuBackend(),
  fresh = true,
): InitialParameters {
  const ctx = new Context(backend, { seed: cfg.seed });
  try {
    const model = buildModel(ctx, cfg, plan, fresh);
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
export function exportModelFile(
  cfg: JobConfig,
  plan: ModelPlan,
  states: readonly ShardState[],
  path: string,
  step: number,
): void {
  const ctx = new Context(new CpuBackend(), { seed: cfg.seed });
  try {
    const model = buildModel(ctx, cfg, plan, false);
    const store = model.store;
    const layout = buildLayout(cfg.job, store.slabNumel, store.decayRange.numel, cfg.chunkBytes, cfg.shards);
    const slab = new Float32Array(store.slabNumel);
    const seen = new Set<number>();
    for (const s of states) {
      for (const c of s.chunks) {
        const info = layout.chunks[c.id];
        if (!info || c.params.length !== info.count || seen.has(c.id)) {
          throw new CorruptDataError(
            `shard ${s.shard}'s state holds chunk ${c.id} with ${c.params.length} values, which the job's layout does not have`,
          );
        }
        slab.set(c.params, info.offset);
        seen.add(c.id);
      }
    }
    if (seen.size !== layout.chunks.length)
      throw new CorruptDataError(`the shards' states hold ${seen.size} of the job's ${layout.chunks.length} chunks`);
    store.writeValues(slab);
    saveModelFile(path, store, { ...modelFileFields(cfg, plan), step, training: cfg });
  } finally {
    ctx.dispose();
  }
}
