#!/usr/bin/env python3
"""PyTorch DDP (gloo) baseline for `bun run bench hosts`: one rank of a data-parallel job.

Every rank runs this inside its host of the test bed (testbed/hosts.ts). The ranks meet at
--master (rank 0's host) and train the model the mesh trains on batches of --batch samples per
rank: the MLP (--widths, ReLU, SGD with momentum 0.9), or with --gpt L,H,C,T,V the GPT of
torch_step.py (tied embeddings, AdamW, clipping at 1). Rank 0 prints one JSON line: samples/s
over all ranks and the mean step time, split into the step without its all-reduce wait (compute)
and the rest. The data is random: what is measured is the step and the gradients crossing the
links, which the data does not change.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="host:port of rank 0")
    p.add_argument("--widths", default="784,1024,1024,10")
    p.add_argument("--gpt", default="", help="L,H,C,T,V: a GPT instead of the MLP")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world)
    if a.gpt:
        from torch_step import Gpt

        L, H, C, T, V = (int(v) for v in a.gpt.split(","))
        model = DDP(Gpt(V, T, L, H, C, sdpa=False))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        x = torch.randint(0, V, (a.batch, T))
        y = torch.randint(0, V, (a.batch, T))

        def loss_of():
            return model(x, y)

    else:
        widths = [int(w) for w in a.widths.split(",")]
        layers: list[nn.Module] = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        model = DDP(nn.Sequential(*layers))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        x = torch.randn(a.batch, widths[0])
        y = torch.randint(0, widths[-1], (a.batch,))
        loss_fn = nn.CrossEntropyLoss()

        def loss_of():
            return loss_fn(model(x), y)

    # compute alone: the forward and backward without DDP's all-reduce (no_sync), timed first
    with model.no_sync():
        for _ in range(a.warmup):
            opt.zero_grad(set_to_none=True)
            loss_of().backward()
        c0 = time.perf_counter()
        for _ in range(a.steps):
            opt.zero_grad(set_to_none=True)
            loss_of().backward()
        compute_ms = 1000 * (time.perf_counter() - c0) / a.steps
    # the steps DDP runs: its all-reduce overlapped with the backward, then the update
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        if a.gpt:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if a.rank == 0:
        step_ms = 1000 * elapsed / a.steps
        print(
            json.dumps(
                {
                    "samples_per_s": a.batch * a.world * a.steps / elapsed,
                    "step_ms": step_ms,
                    "compute_ms": compute_ms,
                    "exposed_comm_ms": max(0.0, step_ms - compute_ms),
                    "torch": torch.__version__,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
