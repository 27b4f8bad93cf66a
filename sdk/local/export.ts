// `meshtrain export --model FILE --format safetensors --out DIR`: a GPT model file in Hugging
// Face's GPT-2 layout (engine/hf-gpt2.ts): model.safetensors with GPT2LMHeadModel's tensor names
// and shapes, config.json, and for a GPT-2 BPE model the tokenizer's files; a character-level
// model's characters go to meshtrain_chars.json. `train gpt --init-from DIR` reads such a folder.
// Into a folder an export wrote, the new model's files replace the old one's, and the old one's
// tokenizer files that the new one has none of are removed; a folder holding another program's
// model (its weights, or its tokenizer's files) is refused: they are not ours to replace.
import { existsSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { DataFileError } from "../../engine/data/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { writeDurably } from "../../engine/durable.ts";
import { gpt2TokenizerFiles, hfConfig, toHfTensors } from "../../engine/hf-gpt2.ts";
import { readModelFile } from "../../engine/modelfile.ts";
import type { GptConfig } from "../../engine/models/gpt.ts";
import { safetensorsMetadata, writeSafetensors } from "../../engine/safetensors.ts";
import { checkOutDir, shownPath } from "../user-paths.ts";

export interface ExportOptions {
  /** absolute paths */
  model: string;
  format: "safetensors";
  out: string;
}

const json = (value: unknown) => new TextEncoder().encode(`${JSON.stringify(value, null, 2)}\n`);

/** Writes the folder; returns the files written. */
export function runExport(o: ExportOptions): string[] {
  const { header, slab } = readModelFile(o.model);
  checkOutDir(o.out, "--out");
  if (header.kind !== "gpt") {
    throw new DataFileError(
      o.model,
      "is an MLP classifier; export writes a GPT in Hugging Face's GPT-2 layout, which an MLP does not have",
    );
  }
  const config = header.config as GptConfig;
  const bpe = header.tokenizer === "gpt2";
  const present = existsSync(o.out) ? readdirSync(o.out).sort() : [];
  // a folder that holds another program's model (weights of another format, a model.safetensors
  // meshtrain did not write, a tokenizer's files of its own): its files are not ours to replace
  const exported =
    present.includes("model.safetensors") &&
    safetensorsMetadata(join(o.out, "model.safetensors"))?.producer === "meshtrain";
  const others = present.filter(
    (f) => otherWeights.test(f) || (!exported && (f === "model.safetensors" || replacedFiles.has(f))),
  );
  if (others.length > 0)
    throw new ConfigError(
      `--out ${shownPath(o.out)} holds another model's files (${others.join(", ")}); export into an empty folder or one an export wrote`,
    );
  mkdirSync(o.out, { recursive: true });
  const files: string[] = [];
  const put = (name: string, parts: Uint8Array[]) => {
    writeDurably(join(o.out, name), parts);
    files.push(name);
  };
  writeSafetensors(join(o.out, "model.safetensors"), toHfTensors(header.entries, slab), {
    format: "pt",
    producer: "meshtrain",
    step: String(header.step),
  });
  files.push("model.safetensors");
  put("config.json", [json(hfConfig(config, bpe))]);
  if (bpe) {
    const { vocab, merges } = gpt2TokenizerFiles();
    put("vocab.json", [json(vocab)]);
    put("merges.txt", [new TextEncoder().encode(`#version: 0.2\n${merges.join("\n")}\n`)]);
    const special = { bos_token: "<|endoftext|>", eos_token: "<|endoftext|>", unk_token: "<|endoftext|>" };
    put("special_tokens_map.json", [json(special)]);
    put("tokenizer_config.json", [
      json({
        tokenizer_class: "GPT2Tokenizer",
        model_max_length: config.blockSize,
        add_prefix_space: false,
        ...special,
      }),
    ]);
  } else if (header.vocab !== undefined) {
    // no Hugging Face tokenizer spells a character vocabulary: its characters, in id order
    put("meshtrain_chars.json", [json({ chars: header.vocab })]);
  }
  // the model this folder held before: its tokenizer's files and settings, which this one's do not replace
  for (const f of present) if (replacedFiles.has(f) && !files.includes(f)) rmSync(join(o.out, f), { force: true });
  return files;
}

/** Files of a GPT-2 folder that describe its model: an export into a folder replaces them all,
 *  removing those it does not write (a character model's over a BPE one's vocab.json, say). */
const replacedFiles = new Set([
  "vocab.json",
  "merges.txt",
  "special_tokens_map.json",
  "tokenizer_config.json",
  "tokenizer.json",
  "added_tokens.json",
  "generation_config.json",
  "meshtrain_chars.json",
]);

/** Weights files of Hugging Face's other formats and sharded layouts. */
const otherWeights =
  /^(pytorch_model.*\.bin|model-\d+-of-\d+\.safetensors|.*\.index\.json|tf_model\.h5|flax_model\.msgpack)$/;

export function exportSummary(o: ExportOptions, files: readonly string[]): string {
  return `exported ${shownPath(o.model)} to ${shownPath(o.out)}/: ${files.join(", ")} (transformers: GPT2LMHeadModel.from_pretrained("${shownPath(o.out)}"))`;
}
