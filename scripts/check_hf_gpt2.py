#!/usr/bin/env python3
"""Checks a folder `meshtrain export` wrote against GPT-2's forward pass in PyTorch.

Reads model.safetensors itself (an 8-byte header length, the JSON header, the raw tensors: Debian
has no safetensors package) and config.json, runs GPT-2's forward written out in float64 on the
token ids given, and compares its logits with the ones meshtrain computed. Where transformers is
importable (the lent GPU machines have it), GPT2LMHeadModel.from_pretrained(DIR) is compared too.

    check_hf_gpt2.py --dir DIR --tokens TOKENS.json --logits LOGITS.f32 [--tol 1e-4]

TOKENS.json: [[id, ...], ...], every row as long; LOGITS.f32: meshtrain's logits (rows, T, V) as
little-endian float32. Prints one JSON line; exit 0 when every comparison is within tol, 1 when
one is not, 3 when torch is missing (the caller skips).
"""
import argparse
import json
import math
import struct
import sys


def read_safetensors(path, torch):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            raise SystemExit(f"{path}: tensor {name} is {t['dtype']}, not F32")
        begin, end = t["data_offsets"]
        out[name] = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.float32).reshape(t["shape"])
    return out


def gpt2_logits(w, cfg, idx, torch):
    """GPT-2's forward, written out, in float64 (Conv1D weights are (in, out): x @ W)."""
    F = torch.nn.functional
    C, L, H = cfg["n_embd"], cfg["n_layer"], cfg["n_head"]
    D = C // H
    w = {k: v.double() for k, v in w.items()}
    B, T = idx.shape
    x = w["transformer.wte.weight"][idx] + w["transformer.wpe.weight"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(L):
        p = f"transformer.h.{l}."
        h = F.layer_norm(x, (C,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], 1e-5)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (C,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], 1e-5)
        m = F.gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (C,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], 1e-5)
    return x @ w["transformer.wte.weight"].t()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--logits", required=True)
    p.add_argument("--tol", type=float, default=1e-4)
    a = p.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"skipped": f"no torch: {e}"}))
        sys.exit(3)
    with open(f"{a.dir}/config.json") as f:
        cfg = json.load(f)
    with open(a.tokens) as f:
        idx = torch.tensor(json.load(f), dtype=torch.long)
    B, T = idx.shape
    V = cfg["vocab_size"]
    ours = torch.frombuffer(bytearray(open(a.logits, "rb").read()), dtype=torch.float32).reshape(B, T, V).double()
    w = read_safetensors(f"{a.dir}/model.safetensors", torch)
    ref = gpt2_logits(w, cfg, idx, torch)
    result = {"torch": torch.__version__, "rows": B, "T": T, "V": V, "max_abs_diff": (ours - ref).abs().max().item(), "max_abs_logit": ref.abs().max().item()}
    ok = result["max_abs_diff"] <= a.tol
    try:
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        result["transformers"] = f"not importable: {e}"
    else:
        model = GPT2LMHeadModel.from_pretrained(a.dir).eval()
        with torch.no_grad():
            hf = model(idx).logits.double()
        result["transformers_max_abs_diff"] = (ours - hf).abs().max().item()
        ok = ok and result["transformers_max_abs_diff"] <= a.tol
    result["ok"] = ok
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
