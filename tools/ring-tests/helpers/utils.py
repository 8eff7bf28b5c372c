"""Stand-in for the helper module that ring-flash-attention's tests import (`from utils import log,
set_seed`) and that its PyPI source distribution leaves out: tools/ring-tests/run puts it beside
the tests where they have none. Output in the form tools/ring-tests/summarize.py reads: a tensor of
rank 0 alone as "name: max X, mean Y", one of every rank as "name:" and then "[rank] max X, mean Y"
per rank, in rank order."""
import random

import torch
import torch.distributed as dist


def set_seed(rank, seed=42):
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def _stats(a):
    a = a.detach().abs().float()
    return f"max {a.max().item():.3g}, mean {a.mean().item():.3g}"


def log(msg, a, rank0_only=False):
    rank = dist.get_rank()
    if rank0_only:
        if rank == 0:
            print(f"{msg}: {_stats(a)}", flush=True)
        return
    for r in range(dist.get_world_size()):
        if r == rank:
            if rank == 0:
                print(f"{msg}:", flush=True)
            print(f"[{rank}] {_stats(a)}", flush=True)
        dist.barrier()
