#!/usr/bin/env python3
"""PyTorch's generation for `bun run bench engine --config ...`: the same GPT shape as meshtrain's
(pre-norm blocks, tanh GELU, tied embeddings), random weights, greedy decoding with a KV cache
(each new token's forward runs over the cached keys and values of the earlier ones, as
transformers' GPT-2 does with use_cache). Prints one JSON line: the milliseconds a new token
takes after the prompt's pass (the median of the steps), or {"error": ...}.
"""
import argparse
import json
import math
import resource
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch_step import Block as StepBlock
except ImportError as e:  # reported as the benchmark's row, not a traceback
    print(json.dumps({"error": f"no PyTorch: {e}"}))
    raise SystemExit(0)


class Block(StepBlock):
    """torch_step.py's block (its layers), its forward over a KV cache."""

    def __init__(self, C, H):
        super().__init__(C, H, sdpa=False)

    def forward(self, x, cache):
        """x (1,T,C) at the positions after those `cache` holds; cache: [k, v] of (1,H,t,D) or None."""
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        # written out (torch before 2.0 has no scaled_dot_product_attention): the prompt's pass is
        # causal; a new token attends to every cached position
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        if T > 1:
            mask = torch.ones(T, k.size(2), dtype=torch.bool, device=x.device).tril(k.size(2) - T)
            att = att.masked_fill(~mask, float("-inf"))
        y = att.softmax(dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x, [k, v]


class Gpt(nn.Module):
    def __init__(self, V, T, L, H, C):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, caches, pos):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(pos, pos + T, device=idx.device))
        new = []
        for block, cache in zip(self.blocks, caches):
            x, c = block(x, cache)
            new.append(c)
        # the last position's logits only: what is sampled from
        return self.ln_f(x[:, -1:, :]) @ self.wte.weight.t(), new


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpt-config", required=True, help="JSON: nLayer, nHead, nEmbd, blockSize, vocabSize")
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    g = json.loads(a.gpt_config)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "torch has no CUDA device"}))
        return
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    dev = torch.device(a.device)
    model = Gpt(g["vocabSize"], g["blockSize"], g["nLayer"], g["nHead"], g["nEmbd"]).to(dev).eval()
    prompt = torch.randint(0, g["vocabSize"], (1, a.prompt_tokens), device=dev)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    steps = []
    with torch.inference_mode():
        logits, caches = model(prompt, [None] * g["nLayer"], 0)
        pos = a.prompt_tokens
        for _ in range(a.new_tokens):
            token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            sync()
            t = time.perf_counter()
            logits, caches = model(token, caches, pos)
            sync()
            steps.append((time.perf_counter() - t) * 1000)
            pos += 1
    steps.sort()
    print(
        json.dumps(
            {
                "ms_per_token": steps[len(steps) // 2],
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
