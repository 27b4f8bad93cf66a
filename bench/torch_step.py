#!/usr/bin/env python3
"""PyTorch eager baseline for `bun run bench engine --device cuda`.

Times one full training step (forward, backward, optimizer) of exactly the models the engine
benchmark times -- the MLP 784-1024-1024-10 at batch 256 with SGD (momentum 0.9) and the
default GPT (L4 H4 C128 T64 V83, tied embeddings, AdamW, clip 1.0) at batch 32 -- in the same
precision, and torch.matmul on the GEMM shapes the benchmark passes in. Prints one JSON line.

Attention is written out (q k^T, causal softmax, att v) as meshtrain computes it; --sdpa uses
torch's fused scaled_dot_product_attention instead, for reference.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H, sdpa):
        super().__init__()
        self.H, self.sdpa = H, sdpa
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, V, T, L, H, C, sdpa):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H, sdpa) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied embeddings
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step, steps, warmup=5):
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return times[len(times) // 2]


def autocast(precision, device="cuda"):
    if precision in ("bf16", "f16"):
        return torch.autocast(device, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return torch.autocast(device, enabled=False)


def mlp_step_ms(precision, steps):
    dev = "cuda"
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "f16")
    # the batch comes from host memory every step, as meshtrain's does (pinned, as a
    # DataLoader with pin_memory=True hands it over)
    x_host = torch.randn(256, 784).pin_memory()
    y_host = torch.randint(0, 10, (256,)).pin_memory()

    def step():
        x = x_host.to(dev, non_blocking=True)
        y = y_host.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        with autocast(precision):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        loss.item()  # meshtrain reads the loss every step too

    return time_steps(step, steps)


def gpt_step_ms(precision, steps, sdpa):
    dev = "cuda"
    V, T, B = 83, 64, 32
    model = Gpt(V, T, 4, 4, 128, sdpa).to(dev)
    # weight decay on matrices and embeddings only, as meshtrain's parameter groups do
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "f16")
    idx_host = torch.randint(0, V, (B, T)).pin_memory()
    tgt_host = torch.randint(0, V, (B, T)).pin_memory()

    def step():
        idx = idx_host.to(dev, non_blocking=True)
        tgt = tgt_host.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        with autocast(precision):
            loss = model(idx, tgt)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        loss.item()

    return time_steps(step, steps)


def config_step(cfg, mode, device, precision, steps):
    """One GPT training step at a nanoGPT shape (bench engine --config): tokens/s and peak memory.
    mode: written (attention written out), sdpa, or compile (torch.compile of the SDPA model)."""
    V, T, B = cfg["vocabSize"], cfg["blockSize"], cfg["batch"]
    model = Gpt(V, T, cfg["nLayer"], cfg["nHead"], cfg["nEmbd"], mode != "written").to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.999), eps=1e-8)
    run = torch.compile(model) if mode == "compile" else model
    idx = torch.randint(0, V, (B, T), device=device)
    tgt = torch.randint(0, V, (B, T), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast(precision, device):
            loss = run(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = time_steps(step, steps, warmup=2)
    out = {"step_ms": ms}
    if device == "cuda":
        out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    else:
        import resource
        out["rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def gemm_tflops(shapes, precision, reps):
    """torch.matmul on each (M,N,K,transA,transB,batch); returns TFLOP/s per shape and overall."""
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision, torch.float32)
    results = []
    total_flops, total_ms = 0.0, 0.0
    for s in shapes:
        M, N, K, ta, tb, batch = s["M"], s["N"], s["K"], s["transA"], s["transB"], s["batch"]
        a = torch.randn(batch, *((K, M) if ta else (M, K)), device="cuda", dtype=dtype)
        b = torch.randn(batch, *((N, K) if tb else (K, N)), device="cuda", dtype=dtype)
        a2 = a.transpose(-2, -1) if ta else a
        b2 = b.transpose(-2, -1) if tb else b
        if batch == 1:
            a2, b2 = a2[0], b2[0]
        ms = time_steps(lambda: torch.matmul(a2, b2), reps, warmup=3)
        flops = 2.0 * M * N * K * batch
        total_flops += flops
        total_ms += ms
        results.append({**s, "ms": ms, "tflops": flops / ms / 1e9})
    return results, total_flops / total_ms / 1e9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--precision", choices=["f32", "tf32", "bf16", "f16"], default="f32")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--sdpa", action="store_true")
    p.add_argument("--gemm-shapes", default="[]", help="JSON list of {M,N,K,transA,transB,batch}")
    p.add_argument("--gpt-config", help="JSON {nLayer,nHead,nEmbd,blockSize,vocabSize,batch}: one GPT at that shape")
    p.add_argument("--mode", choices=["written", "sdpa", "compile"], default="written")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args()
    if args.gpt_config is not None:
        if args.device == "cuda" and not torch.cuda.is_available():
            print(json.dumps({"error": "torch.cuda.is_available() is False"}))
            return
        if args.mode != "written" and not hasattr(F, "scaled_dot_product_attention"):
            print(json.dumps({"error": f"torch {torch.__version__} has no scaled_dot_product_attention"}))
            return
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        torch.manual_seed(1)
        tf32 = args.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        out = config_step(json.loads(args.gpt_config), args.mode, args.device, args.precision, args.steps)
        print(json.dumps({"torch": torch.__version__, "mode": args.mode, **out}))
        return
    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch.cuda.is_available() is False"}))
        return
    tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(1)
    gemms, overall = gemm_tflops(json.loads(args.gemm_shapes), args.precision, args.steps)
    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "precision": args.precision,
        "mlp_step_ms": mlp_step_ms(args.precision, args.steps),
        "gpt_step_ms": gpt_step_ms(args.precision, args.steps, args.sdpa),
        "gemm": gemms,
        "gemm_tflops": overall,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
