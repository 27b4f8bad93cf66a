// Sample text from a trained character-level GPT model file, streaming each character as it
// is sampled.
import type { Backend } from "../../ffi/backend.ts";
import { type DeviceChoice, type DeviceLog, withBackend } from "../../ffi/select.ts";
import { DataFileError } from "../../engine/data/errors.ts";
import { CharVocab } from "../../engine/data/text.ts";
import { loadSlabInto, type ModelFileHeader, readModelFile } from "../../engine/modelfile.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/tensor.ts";
import { shellWord, shownPath } from "../options.ts";

export interface SampleOptions {
  /** an absolute path (the CLI resolves what the user typed) */
  model: string;
  prompt: string;
  length: number;
  temperature: number;
  topK: number;
  seed: number;
  /** auto: CUDA when a driver and a GPU are present, else the CPU */
  device: DeviceChoice;
  /** where the device line goes (stdout carries the sample) */
  log?: DeviceLog;
  /** gets the prompt, then each sampled character as soon as it is sampled */
  write?: (text: string) => void;
}

/** Returns the prompt and its continuation (what `write` got, in one string). */
export function runSample(o: SampleOptions): string {
  return withBackend(o.device, o.log, (backend) => sample(o, backend));
}

function sample(o: SampleOptions, backend: Backend): string {
  const loaded = readModelFile(o.model);
  const { header } = loaded;
  if (header.kind !== "gpt") throw new DataFileError(o.model, notATextModel(o.model, header));
  if (header.vocab === undefined) throw new DataFileError(o.model, "has no character vocabulary (trained on token files); cannot decode samples");
  const vocab = new CharVocab(header.vocab);
  // a prompt character outside the vocabulary is an error before anything is written, not half a sample
  const prompt = vocab.encode(o.prompt === "" ? (vocab.chars.includes("\n") ? "\n" : vocab.chars[0]!) : o.prompt);
  const write = o.write ?? (() => {});
  const ctx = new Context(backend, { seed: o.seed });
  try {
    const model = new GptModel(ctx, header.config as GptConfig, 0);
    loadSlabInto(o.model, model.store, loaded);
    write(o.prompt);
    const out = model.generate([...prompt], o.length, new Rng(o.seed), o.temperature, o.topK, (token) => write(vocab.decode([token])));
    return o.prompt + vocab.decode(out);
  } finally {
    ctx.dispose();
  }
}

function notATextModel(path: string, header: ModelFileHeader): string {
  const widths = (header.config as { widths?: unknown }).widths;
  const shape = Array.isArray(widths) ? ` (${widths.join("-")})` : "";
  return (
    `is an MLP classifier${shape}, not a text model; sample needs a gpt model. ` + `To see how good it is: meshtrain eval --model ${shellWord(shownPath(path))}`
  );
}
