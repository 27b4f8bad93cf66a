// Sample text from a trained character-level GPT model file, streaming each character as it
// is sampled.
import type { Backend } from "../../ffi/backend.ts";
import { type DeviceChoice, type DeviceLog, heldDeviceLine, withBackend } from "../../ffi/select.ts";
import { DataFileError } from "../../engine/data/errors.ts";
import { CharVocab } from "../../engine/data/text.ts";
import { gpt2EndOfText, gpt2Tokenizer } from "../../engine/data/tokenizer.ts";
import { loadSlabInto, type ModelFileHeader, readModelFile } from "../../engine/modelfile.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import { shellWord, shownPath } from "../user-paths.ts";

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
  const device = heldDeviceLine(o.log ?? (() => {}));
  return withBackend(o.device, device.log, (backend) => sample(o, backend, device.flush));
}

/** `inputsRead` gives the device line to o.log once the model and the prompt are read. */
function sample(o: SampleOptions, backend: Backend, inputsRead: () => void): string {
  const loaded = readModelFile(o.model);
  const { header } = loaded;
  if (header.kind !== "gpt") throw new DataFileError(o.model, notATextModel(o.model, header));
  const tok = tokenizerOf(o.model, header);
  // a prompt character outside the vocabulary is an error before anything is written, not half a sample
  const prompt = tok.prompt(o.prompt);
  const write = o.write ?? (() => {});
  const ctx = new Context(backend, { seed: o.seed });
  try {
    const model = new GptModel(ctx, header.config as GptConfig, 0);
    loadSlabInto(o.model, model.store, loaded);
    inputsRead();
    write(o.prompt);
    const stream = tok.stream(write);
    const out = model.generate(prompt, o.length, new Rng(o.seed), {
      temperature: o.temperature,
      topK: o.topK,
      onToken: stream,
    });
    return o.prompt + tok.decode(out);
  } finally {
    ctx.dispose();
  }
}

/** A model's way from text to tokens and back: its characters, or GPT-2's BPE. */
function tokenizerOf(path: string, header: ModelFileHeader) {
  if (header.tokenizer === "gpt2") {
    const t = gpt2Tokenizer();
    return {
      // an empty prompt starts a document
      prompt: (text: string) => (text === "" ? [gpt2EndOfText] : Array.from(t.encode(text))),
      decode: (ids: ArrayLike<number>) => t.decode(ids),
      // a token can end inside a character's UTF-8 bytes: the text so far is written once it decodes whole
      stream: (write: (s: string) => void) => {
        const ids: number[] = [];
        let shown = "";
        return (token: number) => {
          ids.push(token);
          const text = t.decode(ids);
          if (text.endsWith("\uFFFD")) return;
          write(text.slice(shown.length));
          shown = text;
        };
      },
    };
  }
  if (header.vocab === undefined)
    throw new DataFileError(
      path,
      "has neither a character vocabulary nor a tokenizer (trained on token files); cannot decode samples",
    );
  const vocab = new CharVocab(header.vocab);
  return {
    prompt: (text: string) => [
      ...vocab.encode(text === "" ? (vocab.chars.includes("\n") ? "\n" : vocab.chars[0]!) : text),
    ],
    decode: (ids: ArrayLike<number>) => vocab.decode(ids),
    stream: (write: (s: string) => void) => (token: number) => write(vocab.decode([token])),
  };
}

function notATextModel(path: string, header: ModelFileHeader): string {
  const widths = (header.config as { widths?: unknown }).widths;
  const shape = Array.isArray(widths) ? ` (${widths.join("-")})` : "";
  return (
    `is an MLP classifier${shape}, not a text model; sample needs a gpt model. ` +
    `To see how good it is: meshtrain eval --model ${shellWord(shownPath(path))}`
  );
}
