// A GPT in Hugging Face's GPT-2 layout (transformers' GPT2LMHeadModel): tensor names, its Conv1D
// weights stored (in, out) where ours are (out, in), config.json, and GPT-2's tokenizer files
// (vocab.json and merges.txt, derived from the BPE ranks js-tiktoken ships). The head is tied to
// the token embedding, as GPT-2's is, so lm_head.weight is not stored (transformers ties it).
import { existsSync, statSync } from "node:fs";
import { join } from "node:path";
import { gpt2Ranks } from "./data/gpt2-ranks.ts";
import { DataFileError } from "./data/errors.ts";
import { ConfigError } from "../ffi/errors.ts";
import { ShapeError } from "./errors.ts";
import type { GptConfig } from "./models/gpt.ts";
import { type NamedTensor, readSafetensors } from "./safetensors.ts";
import { readJsonFile } from "./data/files.ts";

/** Our parameter name -> theirs, and whether theirs is the transpose (a Conv1D weight). */
export function hfTensorName(ours: string): { name: string; transposed: boolean } {
  const linear = /^h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$/.test(ours);
  return { name: `transformer.${ours}`, transposed: linear };
}

/** (rows, cols) row-major -> (cols, rows) row-major. */
export function transpose2d(data: Float32Array, rows: number, cols: number): Float32Array {
  const out = new Float32Array(data.length);
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) out[c * rows + r] = data[r * cols + c]!;
  return out;
}

export interface ParamView {
  name: string;
  shape: readonly number[];
  offset: number;
  numel: number;
}

/** The model's parameters as Hugging Face names and lays them out. */
export function toHfTensors(entries: readonly ParamView[], values: Float32Array): NamedTensor[] {
  return entries.map((e) => {
    const { name, transposed } = hfTensorName(e.name);
    const data = values.slice(e.offset, e.offset + e.numel);
    if (!transposed) return { name, shape: [...e.shape], data };
    const [rows, cols] = e.shape as [number, number];
    return { name, shape: [cols, rows], data: transpose2d(data, rows, cols) };
  });
}

/**
 * Fills `values` (our slab) from Hugging Face tensors; every parameter must be there with the
 * shape the model needs, else a ShapeError naming the tensor. Extra tensors (lm_head.weight, the
 * attention's masked-bias buffers of older files) are ignored.
 */
export function fromHfTensors(
  entries: readonly ParamView[],
  tensors: ReadonlyMap<string, { shape: number[]; data: Float32Array }>,
  values: Float32Array,
): void {
  for (const e of entries) {
    const { name, transposed } = hfTensorName(e.name);
    const t = tensors.get(name) ?? tensors.get(name.slice("transformer.".length));
    if (t === undefined)
      throw new ConfigError(`the folder's model.safetensors has no tensor ${name}, which this model needs`);
    const want = transposed ? [e.shape[1]!, e.shape[0]!] : [...e.shape];
    if (t.shape.length !== want.length || t.shape.some((d, i) => d !== want[i])) {
      throw new ShapeError(
        "the folder's model.safetensors",
        [t.shape, want],
        `tensor ${name} is [${t.shape.join(", ")}]; this model's is [${want.join(", ")}]`,
      );
    }
    values.set(transposed ? transpose2d(t.data, want[0]!, want[1]!) : t.data, e.offset);
  }
}

/** config.json of GPT2LMHeadModel for our config (GELU tanh: gelu_new; LayerNorm eps 1e-5). */
export function hfConfig(c: GptConfig, bpe: boolean): Record<string, unknown> {
  return {
    architectures: ["GPT2LMHeadModel"],
    model_type: "gpt2",
    vocab_size: c.vocabSize,
    n_positions: c.blockSize,
    n_ctx: c.blockSize,
    n_embd: c.nEmbd,
    n_layer: c.nLayer,
    n_head: c.nHead,
    n_inner: null,
    activation_function: "gelu_new",
    layer_norm_epsilon: 1e-5,
    resid_pdrop: c.dropout,
    embd_pdrop: c.dropout,
    attn_pdrop: 0,
    initializer_range: 0.02,
    scale_attn_weights: true,
    tie_word_embeddings: true,
    ...(bpe ? { bos_token_id: 50256, eos_token_id: 50256 } : {}),
    torch_dtype: "float32",
  };
}

/** Our config from a config.json GPT2LMHeadModel wrote (or we did). */
export function gptConfigOfHf(json: Record<string, unknown>, path: string): Omit<GptConfig, "dropout"> {
  const int = (k: string) => {
    const v = json[k];
    if (!Number.isInteger(v) || (v as number) <= 0)
      throw new ConfigError(`${path}: ${k} must be a positive integer, got ${JSON.stringify(v)}`);
    return v as number;
  };
  if (json.model_type !== "gpt2")
    throw new ConfigError(`${path}: model_type is ${JSON.stringify(json.model_type)}; a GPT-2 folder says "gpt2"`);
  const act = json.activation_function ?? "gelu_new";
  if (act !== "gelu_new" && act !== "gelu_pytorch_tanh")
    throw new ConfigError(
      `${path}: activation_function ${JSON.stringify(act)}; meshtrain's GPT uses GELU's tanh form (gelu_new)`,
    );
  if (json.n_inner !== undefined && json.n_inner !== null && json.n_inner !== 4 * int("n_embd"))
    throw new ConfigError(`${path}: n_inner must be 4 n_embd`);
  return {
    vocabSize: int("vocab_size"),
    blockSize: int("n_positions"),
    nLayer: int("n_layer"),
    nHead: int("n_head"),
    nEmbd: int("n_embd"),
  };
}

/** The shape of a Hugging Face GPT-2 folder's model (its config.json): what fine-tuning from it trains. */
export function hfFolderShape(dir: string): Omit<GptConfig, "dropout"> {
  const path = join(dir, "config.json");
  const st = statSync(dir, { throwIfNoEntry: false });
  if (st === undefined)
    throw new DataFileError(dir, "not found (a Hugging Face GPT-2 folder: what meshtrain export writes)");
  if (!st.isDirectory())
    throw new DataFileError(
      dir,
      "is a file, not a Hugging Face GPT-2 folder (a .mtm model file? meshtrain export --model <file> --out <dir> writes a folder)",
    );
  if (!existsSync(path))
    throw new DataFileError(
      dir,
      "has no config.json: a Hugging Face GPT-2 folder (what meshtrain export writes) has one",
    );
  return gptConfigOfHf(readJsonFile(path) as Record<string, unknown>, path);
}

/** Fills a model's slab `values` from a Hugging Face GPT-2 folder's model.safetensors. */
export function loadHfFolder(dir: string, entries: readonly ParamView[], values: Float32Array): void {
  fromHfTensors(entries, readSafetensors(join(dir, "model.safetensors")), values);
}

// ---- GPT-2's tokenizer files ---------------------------------------------------------------

/** GPT-2's map from bytes to the printable characters its vocab.json spells tokens with. */
function bytesToUnicode(): string[] {
  const bs: number[] = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = [...bs];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n++);
    }
  }
  const out = new Array<string>(256);
  bs.forEach((b, i) => (out[b] = String.fromCodePoint(cs[i]!)));
  return out;
}

/** Every rank's bytes, from js-tiktoken's gpt2 ranks (lines "<x> <first rank> <base64 token>...". */
function gpt2RankBytes(): Uint8Array[] {
  const out: Uint8Array[] = [];
  for (const line of gpt2Ranks().bpe_ranks.split("\n")) {
    if (line === "") continue;
    const [, first, ...tokens] = line.split(" ");
    tokens.forEach((t, i) => (out[Number(first) + i] = Uint8Array.from(Buffer.from(t, "base64"))));
  }
  return out;
}

/**
 * vocab.json and merges.txt as transformers' GPT2Tokenizer reads them. A token's merge is found
 * by running byte-pair merging on its bytes with the ranks below its own: what is left is the
 * pair that made it.
 */
export function gpt2TokenizerFiles(): { vocab: Record<string, number>; merges: string[] } {
  const ranks = gpt2RankBytes();
  const u = bytesToUnicode();
  const spell = (b: Uint8Array) => Array.from(b, (x) => u[x]).join("");
  const rankOf = new Map(ranks.map((b, r) => [b.join(","), r]));
  const vocab: Record<string, number> = {};
  ranks.forEach((b, r) => (vocab[spell(b)] = r));
  vocab["<|endoftext|>"] = 50256;
  const merges: string[] = [];
  for (let r = 256; r < ranks.length; r++) {
    const bytes = ranks[r]!;
    let parts: number[][] = Array.from(bytes, (x) => [x]);
    for (;;) {
      let best = -1;
      let bestRank = r;
      for (let i = 0; i + 1 < parts.length; i++) {
        const m = rankOf.get([...parts[i]!, ...parts[i + 1]!].join(","));
        if (m !== undefined && m < bestRank) {
          best = i;
          bestRank = m;
        }
      }
      if (best < 0) break;
      parts = [...parts.slice(0, best), [...parts[best]!, ...parts[best + 1]!], ...parts.slice(best + 2)];
    }
    if (parts.length !== 2) throw new Error(`gpt2 rank ${r}: its bytes merge into ${parts.length} parts, not 2`);
    merges.push(`${spell(Uint8Array.from(parts[0]!))} ${spell(Uint8Array.from(parts[1]!))}`);
  }
  return { vocab, merges };
}
