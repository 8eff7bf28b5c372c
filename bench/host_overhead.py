#!/usr/bin/env python3
"""bench/host_overhead.py — what one decoding call costs the host: Python argument handling,
checks and dispatch of flash_attn_with_kvcache at batch 1 (sq 1, GQA 32/8, d 128, a 1k-key cache),
timed two ways, each the median of --repeats loops: `host` — the host time of --host-calls calls
issued while the GPU is kept busy by a spin kernel queued before them (so no call waits for the
GPU, and no queue fills: what the host spends per call, Python and launches), and `wall` — the
wall time of --calls back-to-back calls without synchronisation (bounded by the GPU's time per
call where that is longer than the host's). Beside it, on CUDA and in the same process: torch SDPA's
FlashAttention-2 and cuDNN backends on the same q against the cache's keys (their dispatch path),
and FlashAttention-3's flash_attn_with_kvcache where its flash_attn_interface module is importable.
--device cpu times this library's call alone (the CPU backend's dispatch), as CI does to keep the
script running. --breakdown adds a row `flashattn_C`: _C.forward_kvcache alone on the same tensors
and options (its DLPack conversions included), the extension's share of a call; the rest is the
Python layer's (and torch.empty's for the result). It splits that share further:
`flashattn_C_python_alloc` (the call with a Python workspace_alloc that keeps its last workspace:
the round trip into Python that the stream's _C.KeptWorkspace saves while its array suffices),
`flashattn_C_given_workspace` (the call handed a workspace allocated beforehand),
`flashattn_C_size_only` (_C.forward_kvcache_workspace_size on the same tensors: the conversions
and checks without a launch), `to_dlpack` (one tensor's capsule), `torch_empty_like` (the result's
allocation) and `stream_and_capture_check` (_torch_ops._launch: the current stream, whether it is
being captured into a CUDA graph, and its workspace). The shape flags change the problem, e.g. the
small CPU call of python/README.md ("Per-call overhead"):

  python bench/host_overhead.py [--device cuda|cpu] [--calls 2000] [--repeats 7] [--json out.json]
  python bench/host_overhead.py --device cpu --heads 4 --heads-k 4 --headdim 64 --context 16 \
      --dtype float32 --threads 1 --breakdown
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time

import torch

import flashattn


def per_call_us(fn, calls, repeats, sync, busy=None):
    """Median over `repeats` loops of `calls` calls of the host time per call, in µs. busy: a
    function that queues GPU work outlasting the loop before each one (None: nothing queued)."""
    for _ in range(max(10, calls // 10)):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        if busy is not None:
            busy()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        samples.append((t1 - t0) / calls * 1e6)
    return statistics.median(samples)


def extension_calls(q, k_cache, v_cache, seqlens):
    """The call's _C.forward_kvcache alone, as flash_attn_with_kvcache makes it (the same options,
    workspace allocator and stream; no softmax_lse), into one out tensor allocated here; the same
    call with a Python allocator, and handed a workspace allocated beforehand; and the
    workspace-size query on the same tensors (conversions and checks, no launch).
    -> {row name: function}."""
    from torch.utils.dlpack import to_dlpack

    from flashattn import _C, _torch_ops
    from flashattn._common import shared_options

    out = torch.empty_like(q)
    num_threads, alloc, stream = _torch_ops._launch(q.device)
    opt = shared_options(q.shape[-1] ** -0.5, False, -1, -1, 0.0, 0.0, False, num_threads, 0)
    nbytes = _C.forward_kvcache_workspace_size(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), options=opt,
                                               cache_seqlens=to_dlpack(seqlens), rotary_interleaved=True)
    workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=q.device)

    def call():
        _C.forward_kvcache(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out), None,
                           options=opt, cache_seqlens=to_dlpack(seqlens), rotary_interleaved=True,
                           workspace_alloc=alloc, stream=stream)

    kept_ws = [None]

    def python_alloc(nbytes):  # a Python allocator that keeps its last workspace, asked by every call
        if kept_ws[0] is None or kept_ws[0].numel() < nbytes:
            kept_ws[0] = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
        return to_dlpack(kept_ws[0])

    def python_alloc_call():
        _C.forward_kvcache(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out), None,
                           options=opt, cache_seqlens=to_dlpack(seqlens), rotary_interleaved=True,
                           workspace_alloc=python_alloc, stream=stream)

    def given():
        _C.forward_kvcache(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(out), None,
                           options=opt, cache_seqlens=to_dlpack(seqlens), rotary_interleaved=True,
                           workspace=to_dlpack(workspace) if nbytes > 0 else None, stream=stream)

    def size_only():
        _C.forward_kvcache_workspace_size(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), options=opt,
                                          cache_seqlens=to_dlpack(seqlens), rotary_interleaved=True)

    return {"flashattn_C": call, "flashattn_C_python_alloc": python_alloc_call, "flashattn_C_given_workspace": given,
            "flashattn_C_size_only": size_only,
            "to_dlpack": lambda: to_dlpack(q), "torch_empty_like": lambda: torch.empty_like(q),
            "stream_and_capture_check": lambda: _torch_ops._launch(q.device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--host-calls", type=int, default=200,
                    help="calls per loop while the GPU is busy (their kernels must fit the launch queue)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-k", type=int, default=8)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (the CPU backend's threads)")
    ap.add_argument("--breakdown", action="store_true", help="also time _C.forward_kvcache alone (flashattn_C)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here (--device cpu times the CPU backend's dispatch)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    b, h, hk, d, ctx = 1, args.heads, args.heads_k, args.headdim, args.context
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, 1, h, d, device=dev, dtype=dtype, generator=g)
    k_cache = torch.randn(b, ctx, hk, d, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(b, ctx, hk, d, device=dev, dtype=dtype, generator=g)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []

    busy = None
    if dev.type == "cuda":
        # A spin kernel of about 0.1 s at the H200's clock: longer than any --host-calls loop here.
        busy = lambda: torch.cuda._sleep(200_000_000)  # noqa: E731

    def record(impl, fn):
        us = per_call_us(fn, args.calls, args.repeats, sync)
        row = dict(impl=impl, device=args.device, batch=b, heads=h, heads_k=hk, d=d, context=ctx, us_per_call=us)
        text = f"{impl}: {us:.2f} µs per call"
        if busy is not None:
            host = per_call_us(fn, args.host_calls, args.repeats, sync, busy)
            row["host_us_per_call"] = host
            text = f"{impl}: host {host:.2f} µs per call, wall {us:.2f} µs per call back to back"
        rows.append(row)
        print(text, flush=True)

    record("flashattn", lambda: flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens))
    if args.breakdown:
        for name, fn in extension_calls(q, k_cache, v_cache, seqlens).items():
            record(name, fn)
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt = q.transpose(1, 2)  # (b, h, 1, d)
        kt = k_cache.transpose(1, 2).repeat_interleave(h // hk, dim=1)
        vt = v_cache.transpose(1, 2).repeat_interleave(h // hk, dim=1)
        for name, backend in (("torch_sdpa_flash", SDPBackend.FLASH_ATTENTION), ("torch_sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    record(name, lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))
            except RuntimeError as e:
                print(f"{name} not timed: {e}".splitlines()[0], flush=True)
        try:
            fa3 = importlib.import_module("flash_attn_interface")
        except Exception as e:  # noqa: BLE001 — any import failure means: not timed, and why
            print(f"fa3 not timed: flash_attn_interface is not importable ({type(e).__name__}: {e})", flush=True)
        else:
            record("fa3", lambda: fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
