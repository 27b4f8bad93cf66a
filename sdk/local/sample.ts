// Sample text from a trained character-level GPT model file.
import type { Backend } from "../../ffi/backend.ts";
import { type DeviceChoice, withBackend } from "../../ffi/select.ts";
import { DataFileError } from "../../engine/data/errors.ts";
import { CharVocab } from "../../engine/data/text.ts";
import { loadSlabInto, readModelFile } from "../../engine/modelfile.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/tensor.ts";

export interface SampleOptions {
  model: string;
  prompt: string;
  length: number;
  temperature: number;
  topK: number;
  seed: number;
  /** auto: CUDA when a driver and a GPU are present, else the CPU */
  device: DeviceChoice;
  /** where the device line goes (stdout carries the sample) */
  log?: (line: string) => void;
}

export function runSample(o: SampleOptions): string {
  return withBackend(o.device, o.log, (backend) => sample(o, backend));
}

function sample(o: SampleOptions, backend: Backend): string {
  const loaded = readModelFile(o.model);
  const { header } = loaded;
  if (header.kind !== "gpt") throw new DataFileError(o.model, `is a ${header.kind} model; sampling needs a gpt model`);
  if (header.vocab === undefined) throw new DataFileError(o.model, "has no character vocabulary (trained on token files); cannot decode samples");
  const vocab = new CharVocab(header.vocab);
  const ctx = new Context(backend, { seed: o.seed });
  try {
    const model = new GptModel(ctx, header.config as GptConfig, 0);
    loadSlabInto(o.model, model.store, loaded);
    const prompt = vocab.encode(o.prompt === "" ? (vocab.chars.includes("\n") ? "\n" : vocab.chars[0]!) : o.prompt);
    const out = model.generate([...prompt], o.length, new Rng(o.seed), o.temperature, o.topK);
    return o.prompt + vocab.decode(out);
  } finally {
    ctx.dispose();
  }
}
