"""One rank of the context-parallel tests (tests/python/test_distributed.py starts `world` of these
processes): it joins a process group over a file store, runs the named cases — each shards the
same random batch, runs flashattn.distributed forward and backward, and on rank 0 gathers out,
lse, dq, dk, dv back into whole-sequence tensors and checks them against the float64 attention of
the whole sequence with the SPEC §7 rule (torch_checks) — and rank 0 writes {case: "ok" | the
error} as JSON.

    python cp_worker.py RANK WORLD BACKEND DEVICE INIT_FILE OUT_JSON CASE[,CASE...]

DEVICE is cpu, or cuda: with nccl rank r uses GPU r; with gloo every rank uses GPU 0 (CUDA tensors
through host copies — how one GPU runs the CUDA path).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from flashattn import distributed as fd
from flashattn._torch_ops import draw_rng_state
from torch_checks import check_batch, check_varlen

# Every case: the function, the layout and the flash_attn arguments. Shapes are small (two CPU
# cores run the whole suite) and lengths deliberately do not divide by 2·world — except with
# dropout in ring attention, which needs every shard to start at a multiple of 16 tokens: lengths
# that are multiples of 16·2·world (16·world contiguous), one less, or 1, for world 2 and 4.
BATCH = dict(b=2, seqlen=37, h=4, hk=4, d=32, dv=32, dtype="bfloat16")
CASES = {
    "ring_contiguous_full": dict(fn="ring", layout="contiguous"),
    "ring_contiguous_causal": dict(fn="ring", layout="contiguous", causal=True),
    "ring_zigzag_causal": dict(fn="ring", layout="zigzag", causal=True, give_seqlen=True),
    "ring_zigzag_causal_gqa_fp32": dict(fn="ring", layout="zigzag", causal=True, hk=1, dtype="float32", d=24, dv=40),
    "ring_zigzag_window": dict(fn="ring", layout="zigzag", window=(6, 3)),
    "ring_contiguous_causal_window_softcap": dict(fn="ring", layout="contiguous", causal=True, window=(9, -1),
                                                  softcap=4.0, deterministic=True),
    "ring_zigzag_causal_alibi": dict(fn="ring", layout="zigzag", causal=True, alibi=True, hk=2),
    "ring_contiguous_alibi_window_softcap": dict(fn="ring", layout="contiguous", alibi=True, window=(7, 4),
                                                 softcap=3.0),
    "ring_varlen_zigzag_alibi": dict(fn="ring_varlen", layout="zigzag", alibi=True, seqlens=[19, 3, 26]),
    "ring_varlen_zigzag_causal": dict(fn="ring_varlen", layout="zigzag", causal=True, seqlens=[13, 1, 29, 8],
                                      hk=2),
    "ring_varlen_contiguous_window": dict(fn="ring_varlen", layout="contiguous", window=(5, 5), seqlens=[22, 0, 17]),
    "ulysses_causal_gqa": dict(fn="ulysses", layout="contiguous", causal=True, hk=2),
    "ulysses_zigzag_alibi_window": dict(fn="ulysses", layout="zigzag", alibi=True, window=(8, 0)),
    "ulysses_dropout_mqa": dict(fn="ulysses", layout="zigzag", causal=True, hk=1, dropout_p=0.2),
    "ring_dropout_zigzag_causal_gqa": dict(fn="ring", layout="zigzag", causal=True, seqlen=128, hk=2, dropout_p=0.2,
                                           give_seqlen=True),
    "ring_dropout_contiguous_window_alibi": dict(fn="ring", layout="contiguous", window=(20, 7), seqlen=63,
                                                 alibi=True, softcap=3.0, dropout_p=0.3, deterministic=True),
    "ring_varlen_dropout_zigzag_causal": dict(fn="ring_varlen", layout="zigzag", causal=True, seqlens=[128, 1, 255],
                                              hk=1, dropout_p=0.25),
    "ring_varlen_dropout_contiguous_alibi": dict(fn="ring_varlen", layout="contiguous", alibi=True, window=(-1, 9),
                                                 seqlens=[63, 32], dropout_p=0.2),
    "ring_dropout_unaligned_refused": dict(fn="ring_refusal"),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def randn(shape, dtype, gen, device):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def check_unaligned_refused(device):
    """Ring attention with dropout refuses, on every rank and before any transfer, shards that do
    not start at multiples of 16 tokens, naming the rule; the same shards without dropout work."""
    world = dist.get_world_size()
    for layout in fd.LAYOUTS:
        n = world if layout == "contiguous" else 2 * world
        seqlen = 16 * n + 5
        x = torch.randn(1, seqlen, 2, 16, device=device)
        xl = fd.shard(x, layout=layout)
        try:
            fd.ring_flash_attn_func(xl, xl, xl, dropout_p=0.1, layout=layout)
        except NotImplementedError as e:
            assert f"a multiple of {16 * n} ({16} x {n} chunks) or one less" in str(e), str(e)
            assert f"({seqlen} tokens)" in str(e), str(e)
        else:
            raise AssertionError(f"{layout}: an unaligned {seqlen}-token sequence was accepted with dropout")
        fd.ring_flash_attn_func(xl, xl, xl, layout=layout)
        cu = [0, 16 * n, 16 * n + seqlen]
        flat = torch.randn(cu[-1], 2, 16, device=device)
        fl = fd.shard(flat, layout=layout, cu_seqlens=cu)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        try:
            fd.ring_flash_attn_varlen_func(fl, fl, fl, cu_t, cu_t, seqlen, seqlen, dropout_p=0.1, layout=layout)
        except NotImplementedError as e:
            assert f"of sequence 1 ({seqlen} tokens)" in str(e), str(e)
        else:
            raise AssertionError(f"{layout}: an unaligned varlen sequence was accepted with dropout")


def run_case(name, case, device):
    if case["fn"] == "ring_refusal":
        return check_unaligned_refused(device)
    c = {**BATCH, **case}
    dtype = DTYPES[c["dtype"]]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    causal, window, softcap = c.get("causal", False), c.get("window", (-1, -1)), c.get("softcap", 0.0)
    dropout_p, layout = c.get("dropout_p", 0.0), c["layout"]
    varlen = c["fn"] == "ring_varlen"
    if varlen:
        cu = [0]
        for n in c["seqlens"]:
            cu.append(cu[-1] + n)
        lead = (cu[-1],)
    else:
        lead = (c["b"], c["seqlen"])
    q = randn(lead + (c["h"], c["d"]), dtype, gen, device)
    k = randn(lead + (c["hk"], c["d"]), dtype, gen, device)
    v = randn(lead + (c["hk"], c["dv"]), dtype, gen, device)
    dout = randn(lead + (c["h"], c["dv"]), dtype, gen, device)
    alibi = None
    if c.get("alibi"):
        # (b, h) slopes for batches, (h) for varlen batches: both forms are exercised.
        alibi = (torch.rand((c["h"],) if varlen else (c["b"], c["h"]), generator=gen) * 0.5).to(device)

    shard_kw = dict(layout=layout, cu_seqlens=cu) if varlen else dict(layout=layout)
    local = [fd.shard(x, **shard_kw).detach().requires_grad_(x is not dout) for x in (q, k, v, dout)]
    ql, kl, vl, doutl = local
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p,
              deterministic=c.get("deterministic", False), return_attn_probs=True, layout=layout)
    seed = 1234
    torch.manual_seed(seed)  # the dropout seed is drawn on rank 0 from the default generator
    if varlen:
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        longest = max(c["seqlens"])
        out, lse, _ = fd.ring_flash_attn_varlen_func(ql, kl, vl, cu_t, cu_t, longest, longest, **kw)
    elif c["fn"] == "ring":
        out, lse, _ = fd.ring_flash_attn_func(ql, kl, vl, seqlen=c["seqlen"] if c.get("give_seqlen") else None, **kw)
    else:
        out, lse, _ = fd.ulysses_flash_attn_func(ql, kl, vl, **kw)
    assert out.shape == ql.shape[:-1] + (c["dv"],) and out.dtype == dtype
    out.backward(doutl)

    if varlen:
        whole = [fd.unshard(x, **shard_kw) for x in (out, ql.grad, kl.grad, vl.grad)]
        lse_whole = fd.unshard(lse.transpose(0, 1), **shard_kw).transpose(0, 1)
    else:
        whole = [fd.unshard(x, **shard_kw) for x in (out, ql.grad, kl.grad, vl.grad)]
        lse_whole = fd.unshard(lse, dim=2, layout=layout)
    if dist.get_rank() != 0:
        return
    out_w, dq, dk, dv = whole
    check = dict(causal=causal, window=window, softcap=softcap, grads=(dq, dk, dv), dout=dout)
    rng_state = None
    if dropout_p > 0:
        # The single-device call's rng_state: the same draw after the same seed.
        torch.manual_seed(seed)
        rng_state = draw_rng_state(torch.device(device))
    check["dropout_p"], check["rng_state"] = dropout_p, rng_state
    if varlen:
        check_varlen(q, k, v, cu, cu, out_w, lse_whole, max_seqlen_k=max(c["seqlens"]), alibi=alibi, **check)
    else:
        check_batch(q, k, v, out_w, lse_whole, alibi=alibi, **check)


def main():
    rank, world, backend, device, init_file, out_json, names = sys.argv[1:8]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)  # the ranks share two cores
    if device == "cuda":
        index = rank if backend == "nccl" else 0
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        # All ranks are on this host: loopback needs no resolvable host name (CI containers).
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in names.split(","):
        try:
            run_case(name, CASES[name], device)
            results[name] = "ok"
        except Exception:  # reported per case by the test; the other cases still run
            results[name] = traceback.format_exc()
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
