// `meshtrain export` writes a GPT in Hugging Face's GPT-2 layout and `train gpt --init-from`
// reads it back: the tensors' names and (Conv1D: transposed) shapes, config.json, GPT-2's
// tokenizer files for a BPE model; PyTorch's GPT-2 forward on the exported tensors gives
// meshtrain's logits (scripts/check_hf_gpt2.py, where python3 has torch; transformers too where it
// is importable); a round trip gives the same validation loss; shapes that disagree are refused,
// naming the tensor.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { loadSlabInto, readModelFile } from "../../engine/modelfile.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import { readSafetensors, writeSafetensors } from "../../engine/safetensors.ts";
import { Context } from "../../engine/context.ts";
import { runPrepare, prepareDefaults } from "../../sdk/local/prepare.ts";
import { skip } from "../helpers/skip.ts";
import { runCli } from "../helpers/cli.ts";
import { cliOptions } from "../helpers/cli-options.ts";

const root = join(import.meta.dir, "..", "..");
const dir = mkdtempSync(join(tmpdir(), "meshtrain-export-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const cli = (...args: string[]) => runCli(dir, ...args);
/** `train gpt` on the prepared token files, starting from the Hugging Face folder `hf`. */
const trainFrom = (hf: string, ...args: string[]) =>
  cli("train", "gpt", "--tokens", "data", "--init-from", hf, ...args);

/** Debian's python3 with torch (or the one on PATH), else null and why. */
function torchPython(): { python: string | null; reason: string | null } {
  for (const python of ["python3", "/usr/bin/python3"]) {
    if (Bun.spawnSync([python, "-c", "import torch"], { stdout: "ignore", stderr: "ignore" }).exitCode === 0)
      return { python, reason: null };
  }
  return { python: null, reason: "no python3 imports torch (apt-get install python3-torch)" };
}
const torch = torchPython();

const shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16"];
const valLoss = (out: string) => Number(/^step \d+: val loss ([\d.]+)/m.exec(out)?.[1]);
let model = "";
let trained = "";

beforeAll(async () => {
  const src = join(dir, "docs");
  mkdirSync(src);
  for (let i = 0; i < 40; i++)
    writeFileSync(join(src, `d${i}.txt`), `Document ${i}: ${"Call me Ishmael. Some years ago. ".repeat(2 + (i % 5))}`);
  await runPrepare({ ...prepareDefaults, text: src, out: join(dir, "data"), valFraction: 0.2, quiet: true });
  model = join(dir, "gpt.mtm");
  const r = cli(
    "train",
    "gpt",
    "--tokens",
    "data",
    ...shape,
    ...cliOptions({ "batch-size": 4, "max-steps": 12, "eval-every": 12, warmup: 2, "sample-chars": 0, out: "gpt.mtm" }),
  );
  expect(r.code).toBe(0);
  trained = r.out;
}, 120_000);

describe("export to Hugging Face's GPT-2 layout", () => {
  test("model.safetensors with GPT2LMHeadModel's names, Conv1D weights transposed; config.json; the tokenizer's files", () => {
    const r = cli("export", "--model", "gpt.mtm", "--out", "hf");
    expect(r.code).toBe(0);
    expect(r.out).toContain(
      "exported gpt.mtm to hf/: model.safetensors, config.json, vocab.json, merges.txt, special_tokens_map.json, tokenizer_config.json",
    );
    const t = readSafetensors(join(dir, "hf", "model.safetensors"));
    expect(t.get("transformer.wte.weight")!.shape).toEqual([50257, 32]);
    expect(t.get("transformer.wpe.weight")!.shape).toEqual([16, 32]);
    expect(t.get("transformer.h.1.attn.c_attn.weight")!.shape).toEqual([32, 96]); // ours (96, 32)
    expect(t.get("transformer.h.0.mlp.c_proj.weight")!.shape).toEqual([128, 32]);
    expect(t.get("transformer.h.0.mlp.c_fc.bias")!.shape).toEqual([128]);
    expect(t.has("lm_head.weight")).toBe(false); // tied to wte, as transformers saves GPT-2
    // the transpose: ours (out, in) at [o, i] is theirs [i, o]
    const { header, slab } = readModelFile(model);
    const e = header.entries.find((x) => x.name === "h.1.attn.c_attn.weight")!;
    expect(t.get("transformer.h.1.attn.c_attn.weight")!.data[5 * 96 + 70]).toBe(slab[e.offset + 70 * 32 + 5]!);
    const config = JSON.parse(readFileSync(join(dir, "hf", "config.json"), "utf8"));
    expect(config).toMatchObject({
      model_type: "gpt2",
      vocab_size: 50257,
      n_positions: 16,
      n_embd: 32,
      n_layer: 2,
      n_head: 2,
      activation_function: "gelu_new",
    });
    const vocab = JSON.parse(readFileSync(join(dir, "hf", "vocab.json"), "utf8"));
    expect([vocab["Ġthe"], vocab.Hello, vocab["<|endoftext|>"]]).toEqual([262, 15496, 50256]);
    expect(
      readFileSync(join(dir, "hf", "merges.txt"), "utf8")
        .split("\n")
        .slice(0, 3),
    ).toEqual(["#version: 0.2", "Ġ t", "Ġ a"]);
  });

  test("eval and sample of the exported folder give its model file's loss and tokens (GPT-2 BPE)", () => {
    expect(cli("export", "--model", "gpt.mtm", "--out", "hf-read").code).toBe(0);
    const loss = (m: string) => {
      const r = cli("eval", "--model", m, "--tokens", "data");
      expect(r.code).toBe(0);
      return Number(/^validation loss: ([\d.]+) nats\/token/m.exec(r.out)?.[1]);
    };
    expect(loss("hf-read")).toBe(loss("gpt.mtm"));
    const sample = (m: string) => cli("sample", "--model", m, "--prompt", "Call me", "--length", "24", "--seed", "2");
    const fromFile = sample("gpt.mtm");
    expect(fromFile.code).toBe(0);
    expect(fromFile.out.startsWith("Call me")).toBe(true);
    expect(sample("hf-read").out).toBe(fromFile.out);
  });

  test.skipIf(skip("PyTorch", torch.reason))(
    "PyTorch's GPT-2 forward on the exported tensors gives meshtrain's logits within 1e-4 (transformers too, where importable)",
    () => {
      cli("export", "--model", "gpt.mtm", "--out", "hf2");
      const { header } = readModelFile(model);
      const ctx = new Context(new CpuBackend(), { seed: 1 });
      const m = new GptModel(ctx, header.config as GptConfig, 0);
      loadSlabInto(model, m.store, readModelFile(model));
      const rows = [
        [50256, 5962, 502, 1148, 9926, 11, 2773, 812, 2084, 13, 4380, 318, 257, 1332, 13, 50256],
        [40, 716, 257, 3290, 290, 314, 716, 407, 257, 1110, 11, 475, 257, 1332, 286, 262],
        [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 290, 1057, 1497, 351, 340, 13, 50256],
      ];
      ctx.newPass();
      const logits = ctx.noGrad(() => m.forward(ctx.fromArray(Int32Array.from(rows.flat()), [3, 16]))).toFloat32();
      ctx.dispose();
      writeFileSync(join(dir, "tokens.json"), JSON.stringify(rows));
      writeFileSync(join(dir, "logits.f32"), new Uint8Array(logits.buffer));
      const p = Bun.spawnSync(
        [
          torch.python!,
          join(root, "scripts", "check_hf_gpt2.py"),
          "--dir",
          join(dir, "hf2"),
          "--tokens",
          join(dir, "tokens.json"),
          "--logits",
          join(dir, "logits.f32"),
        ],
        { stdout: "pipe", stderr: "pipe" },
      );
      const result = JSON.parse(p.stdout.toString().trim().split("\n").pop() ?? "{}");
      console.log(
        `exported GPT-2 against PyTorch ${result.torch}: max |logit difference| ${result.max_abs_diff} (logits up to ${result.max_abs_logit}); transformers: ${result.transformers_max_abs_diff ?? result.transformers}`,
      );
      expect(p.exitCode).toBe(0);
      expect(result.max_abs_diff).toBeLessThan(1e-4);
    },
    60_000,
  );

  test("train gpt --init-from the folder: the same validation loss before its first step (a round trip), and fine-tuning goes on from there", () => {
    cli("export", "--model", "gpt.mtm", "--out", "hf3");
    const r = trainFrom(
      "hf3",
      ...cliOptions({ "batch-size": 4, "max-steps": 2, "eval-every": 2, "sample-chars": 0, out: "tuned.mtm" }),
    );
    expect(r.code).toBe(0);
    expect(r.out).toContain("initialized from hf3 (model.safetensors, config.json)");
    expect(r.out).toContain("vocab 50257");
    expect(Number(/^step 0: val loss ([\d.]+)/m.exec(r.out)?.[1])).toBe(valLoss(trained));
    expect(readModelFile(join(dir, "tuned.mtm")).header.config).toMatchObject({ nLayer: 2, nEmbd: 32, blockSize: 16 });
  }, 60_000);

  test.each([
    ["all-reduce", ["--sync", "allreduce", "--trainers", "1"]],
    ["parameter server (BSP)", ["--trainers", "2", "--shards", "2"]],
  ])(
    "a mesh job fine-tunes the folder (%s): run --init-from starts from its tensors, with the job's --beta2",
    (_, mode) => {
      cli("export", "--model", "gpt.mtm", "--out", "hf-mesh");
      // a learning rate too small to move the tensors: the job evaluates what it started from
      const r = cli(
        "run",
        "--model",
        "gpt",
        "--tokens",
        "data",
        "--init-from",
        "hf-mesh",
        ...mode,
        ...cliOptions({ "batch-size": 4, "max-steps": 2, lr: 1e-9, "min-lr": 0, warmup: 0, beta2: 0.95 }),
        ...["--dir", "mesh-runs", "--no-dashboard"],
      );
      expect(r.code, r.err + r.out).toBe(0);
      expect(r.out).toContain("GPT 2 layers, 2 heads, width 32, context 16, fine-tuned from hf-mesh");
      expect(r.out).toContain("AdamW (betas 0.9/0.95");
      expect(Number(/^val loss: ([\d.]+)/m.exec(r.out)?.[1])).toBeCloseTo(valLoss(trained), 3);
    },
    60_000,
  );

  test("into a folder an export wrote: the new model's files, the old one's tokenizer files removed; weights of another format refused", () => {
    const out = join(dir, "hf-again");
    // an export before (a character model's: its characters; a stale fast tokenizer), a model card
    expect(cli("export", "--model", "gpt.mtm", "--out", "hf-again").code).toBe(0);
    writeFileSync(join(out, "meshtrain_chars.json"), '{"chars":["a","b"]}\n');
    writeFileSync(join(out, "tokenizer.json"), "{}\n");
    writeFileSync(join(out, "README.md"), "# my model\n");
    const r = cli("export", "--model", "gpt.mtm", "--out", "hf-again");
    expect(r.code, r.err).toBe(0);
    expect(readdirSync(out).sort()).toEqual([
      "README.md",
      "config.json",
      "merges.txt",
      "model.safetensors",
      "special_tokens_map.json",
      "tokenizer_config.json",
      "vocab.json",
    ]);
    writeFileSync(join(out, "pytorch_model.bin"), "weights of another model");
    const refused = cli("export", "--model", "gpt.mtm", "--out", "hf-again");
    expect([refused.code, refused.err.trim()]).toEqual([
      1,
      "meshtrain: ConfigError: --out hf-again holds another model's files (pytorch_model.bin); export into an empty folder or one an export wrote",
    ]);
    // a folder transformers wrote (its model.safetensors is not meshtrain's): nothing of it is replaced
    const theirs = join(dir, "hf-theirs");
    mkdirSync(theirs);
    writeSafetensors(join(theirs, "model.safetensors"), [{ name: "wte", shape: [1], data: new Float32Array(1) }], {
      format: "pt",
    });
    writeFileSync(join(theirs, "tokenizer.json"), "{}\n");
    const kept = cli("export", "--model", "gpt.mtm", "--out", "hf-theirs");
    expect([kept.code, kept.err.trim()]).toEqual([
      1,
      "meshtrain: ConfigError: --out hf-theirs holds another model's files (model.safetensors, tokenizer.json); export into an empty folder or one an export wrote",
    ]);
    expect(readdirSync(theirs).sort()).toEqual(["model.safetensors", "tokenizer.json"]);
  });

  test("refusals: a shape option that disagrees with the folder, a tensor of the wrong shape (named), an MLP model", () => {
    cli("export", "--model", "gpt.mtm", "--out", "hf4");
    const shapeFlag = trainFrom("hf4", "--n-layer", "3", "--max-steps", "2", "--out", "x.mtm");
    expect(shapeFlag.code).toBe(1);
    expect(shapeFlag.err).toContain("--init-from hf4: its model has n-layer 2; --n-layer 3 disagrees (leave it out)");
    // a wrong-shaped tensor is named
    const t = readSafetensors(join(dir, "hf4", "model.safetensors"));
    const named = [...t].map(([name, v]) => ({
      name,
      shape: name === "transformer.h.0.mlp.c_fc.weight" ? [32, 64] : v.shape,
      data: name === "transformer.h.0.mlp.c_fc.weight" ? v.data.slice(0, 32 * 64) : v.data,
    }));
    writeSafetensors(join(dir, "hf4", "model.safetensors"), named);
    const bad = trainFrom("hf4", "--max-steps", "2", "--out", "x.mtm");
    expect(bad.code).toBe(1);
    expect(bad.err).toContain("tensor transformer.h.0.mlp.c_fc.weight is [32, 64]; this model's is [32, 128]");
    const mlp = cli("train", "mlp", "--epochs", "1", "--widths", "784,16,10", "--out", "mlp.mtm");
    expect(mlp.code).toBe(0);
    const refused = cli("export", "--model", "mlp.mtm", "--out", "hf5");
    expect(refused.code).toBe(1);
    expect(refused.err).toContain("is an MLP classifier; export writes a GPT in Hugging Face's GPT-2 layout");
  }, 120_000);
});
