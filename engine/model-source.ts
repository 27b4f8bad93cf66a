// The model a command reads (eval, sample): a meshtrain model file, or a Hugging Face GPT-2 folder
// (config.json and model.safetensors, as `meshtrain export` or transformers' save_pretrained
// write it) read into the same form: the header a model file would have and the slab in our
// layout. A folder's tokenizer: the characters of meshtrain_chars.json (a character-level model
// export wrote), else GPT-2's BPE when its vocabulary is GPT-2's 50,257 tokens. It records no
// training: its steps are unknown, and eval needs --text or --tokens.
import { existsSync, statSync } from "node:fs";
import { join } from "node:path";
import { DataFileError } from "./data/errors.ts";
import { gpt2VocabSize } from "./data/tokenizer.ts";
import { hfFolderShape, loadHfFolder } from "./hf-gpt2.ts";
import { type LoadedModelFile, type ModelFileHeader, readModelFile } from "./modelfile.ts";
import { type GptConfig, gptParamSpecs } from "./models/gpt.ts";
import { slabLayoutOf } from "./params.ts";
import { readJsonFile } from "./data/files.ts";

/** A model file, or a Hugging Face GPT-2 folder read as one. */
export function readModel(path: string): LoadedModelFile {
  return isFolder(path) ? readHfFolder(path) : readModelFile(path);
}

export function isFolder(path: string): boolean {
  return existsSync(path) && statSync(path).isDirectory();
}

function readHfFolder(dir: string): LoadedModelFile {
  // inference reads no dropout; the config says a training run's
  const config: GptConfig = { ...hfFolderShape(dir), dropout: 0 };
  const { entries, slabNumel } = slabLayoutOf(gptParamSpecs(config));
  const slab = new Float32Array(slabNumel);
  loadHfFolder(dir, entries, slab);
  const vocab = charsOf(dir);
  if (vocab !== undefined && vocab.length !== config.vocabSize)
    throw new DataFileError(
      join(dir, "meshtrain_chars.json"),
      `lists ${vocab.length} characters; config.json's vocab_size is ${config.vocabSize}`,
    );
  const header: ModelFileHeader = {
    kind: "gpt",
    config,
    ...(vocab !== undefined ? { vocab } : config.vocabSize === gpt2VocabSize ? { tokenizer: "gpt2" as const } : {}),
    entries,
    slabNumel,
    step: Number.NaN,
    slabCrc32: 0,
    createdAt: "",
  };
  return { header, slab };
}

/** meshtrain_chars.json's characters, in id order (export writes it for a character-level model). */
function charsOf(dir: string): string[] | undefined {
  const path = join(dir, "meshtrain_chars.json");
  if (!existsSync(path)) return undefined;
  const chars = (readJsonFile(path) as { chars?: unknown } | null)?.chars;
  if (!Array.isArray(chars) || !chars.every((c) => typeof c === "string"))
    throw new DataFileError(path, 'must hold {"chars": [...]}, the vocabulary\'s characters in id order');
  return chars;
}
