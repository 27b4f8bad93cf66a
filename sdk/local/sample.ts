// Sample text from a trained GPT model (character-level or GPT-2 BPE): a model file, or a Hugging
// Face GPT-2 folder (engine/model-source.ts). Each token's text is streamed as it is sampled; a
// BPE model's sample ends at <|endoftext|>.
import type { Backend } from "../../ffi/backend.ts";
import { type DeviceChoice, type DeviceLog, heldDeviceLine, withBackend } from "../../ffi/select.ts";
import { DataFileError } from "../../engine/data/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { CharVocab } from "../../engine/data/text.ts";
import { gpt2EndOfText, gpt2Tokenizer, streamDecoder } from "../../engine/data/tokenizer.ts";
import { loadSlabInto, type ModelFileHeader } from "../../engine/modelfile.ts";
import { readModel } from "../../engine/model-source.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import type { SamplingOptions } from "../../engine/models/sampling.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import { shellWord, shownPath } from "../user-paths.ts";

export interface SampleOptions extends SamplingOptions {
  /** an absolute path (the CLI resolves what the user typed): a model file or a Hugging Face GPT-2 folder */
  model: string;
  prompt: string;
  length: number;
  seed: number;
  /** false: recompute the whole window for every token instead of keeping a KV cache (slower; the same tokens) */
  kvCache?: boolean;
  /** auto: CUDA when a driver and a GPU are present, else the CPU */
  device: DeviceChoice;
  /** where the device line and the closing tokens/s line go (stdout carries the sample) */
  log?: DeviceLog;
  /** gets the prompt, then each sampled token's text as soon as it decodes whole */
  write?: (text: string) => void;
}

/** Returns the prompt and its continuation (what `write` got, in one string). */
export function runSample(o: SampleOptions): string {
  const device = heldDeviceLine(o.log ?? (() => {}));
  return withBackend(o.device, device.log, (backend) => sample(o, backend, device.flush));
}

/** `inputsRead` gives the device line to o.log once the model and the prompt are read. */
function sample(o: SampleOptions, backend: Backend, inputsRead: () => void): string {
  const loaded = readModel(o.model);
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
    const stream = streamDecoder(tok.decode, write);
    const started = performance.now();
    const out = model.generate(prompt, o.length, new Rng(o.seed), {
      temperature: o.temperature,
      topK: o.topK,
      topP: o.topP,
      kvCache: o.kvCache ?? true,
      onToken: stream.push,
      ...(tok.stopAt === null ? {} : { stopAt: tok.stopAt }),
    });
    stream.end();
    const seconds = (performance.now() - started) / 1000;
    const stopped = out.length < o.length ? ", stopped at <|endoftext|>" : "";
    const rate = `sampled ${out.length} token${out.length === 1 ? "" : "s"} in ${seconds.toFixed(2)} s: ${(out.length / seconds).toFixed(1)} tokens/s (${o.kvCache === false ? "whole window per token" : "KV cache"}${stopped})`;
    o.log?.(rate, rate);
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
      // GPT-2's end of a document ends a sample
      stopAt: gpt2EndOfText as number | null,
    };
  }
  if (header.vocab === undefined)
    throw new DataFileError(
      path,
      "has neither a character vocabulary nor a tokenizer (a model trained on token files, or a folder with no meshtrain_chars.json and a vocabulary other than GPT-2's 50,257 tokens); cannot decode samples",
    );
  const vocab = new CharVocab(header.vocab);
  return {
    prompt: (text: string) => {
      try {
        return [...vocab.encode(text === "" ? (vocab.chars.includes("\n") ? "\n" : vocab.chars[0]!) : text)];
      } catch (e) {
        if (!(e instanceof DataFileError)) throw e;
        throw new ConfigError(
          `--prompt: ${e.reason}; a character-level model knows only the characters of the text it trained on`,
        );
      }
    },
    decode: (ids: ArrayLike<number>) => vocab.decode(ids),
    stopAt: null,
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
