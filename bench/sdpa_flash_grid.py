#!/usr/bin/env python3
"""bench/sdpa_flash_grid.py — PyTorch's FlashAttention-2 (SDPA restricted to the flash backend), and
with --backends flash,cudnn also cuDNN's fused attention (SDPA's cuDNN backend), and with fa3
FlashAttention-3 through its `flash_attn_interface` module where it is importable (built by hand;
q/k/v then (b, s, h, d) contiguous, as flashattn_cuda_bench lays them out), on the shapes and with the timing of tests/cuda/bench (flashattn_cuda_bench): bf16 (or --dtype f16), batch·seqlen =
16384 tokens, heads·d = 2048, q/k/v (b, h, s, d) contiguous, CUDA events, median of 30 after 5
warm-up calls (all enqueued before one synchronisation, so the host's dispatch is not timed); the
backward is autograd's backward of one forward (retain_graph); backward FLOPs = 2.5 × forward,
halved when causal. Used by scripts/gpu-check and scripts/gpu-variants.
--l2-flush 1 zeroes a 256 MiB buffer before every timed call (outside the events), as
flashattn_cuda_bench --l2-flush 1 and bench/compare.py do.

--dv gives V, out and dout another head dim than q and k (e.g. --dims 192 --dv 128; FLOPs then
2·b·h·s²·(d + dv), halved when causal, as flashattn_cuda_bench --dv counts them); a backend that
refuses a shape is reported as not timed, and the others go on.

  python bench/sdpa_flash_grid.py --dims 64,128,256 --seqlens 1024,4096 [--dropout 0.1] [--l2-flush 1]
                                  [--backends flash,cudnn,fa3] [--passes fwd,bwd] [--dtype bf16|f16] [--dv 0]
                                  --json torch.json
"""

import argparse
import contextlib
import importlib
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def ints(text):
    return [int(x) for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=ints, default=[64, 128, 256])
    ap.add_argument("--dv", type=int, default=0, help="head dim of V and out (0: each d)")
    ap.add_argument("--seqlens", type=ints, default=[1024, 4096])
    ap.add_argument("--causal", type=ints, default=[0, 1])
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every call (the forward as well)")
    ap.add_argument("--l2-flush", type=int, choices=(0, 1), default=0, help="clear the L2 before every timed call")
    ap.add_argument("--backends", default="flash", help="backends to time, of flash,cudnn (SDPA), fa3")
    ap.add_argument("--passes", default="fwd,bwd", help="of fwd,bwd")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "fa3": None}
    chosen = [b for b in args.backends.split(",") if b]
    unknown = [b for b in chosen if b not in backends]
    if unknown:
        ap.error(f"--backends: unknown {','.join(unknown)} (of {','.join(backends)})")
    fa3 = None
    if "fa3" in chosen:
        if args.dropout > 0:
            ap.error("--backends fa3: FlashAttention-3 has no dropout")
        try:
            fa3 = importlib.import_module("flash_attn_interface")
        except Exception as e:  # noqa: BLE001 — any import failure means: not timed, and why
            print(f"fa3 not timed: flash_attn_interface is not importable ({type(e).__name__}: {e})", flush=True)
            chosen.remove("fa3")
    wanted_passes = set(args.passes.split(","))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.l2_flush else None
    rows = []
    tokens, width = 16384, 2048
    for d in args.dims:
        for s in args.seqlens:
            b, h = max(1, tokens // s), width // d
            dv = args.dv or d
            q, k = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(2))
            v, dout = (torch.randn(b, h, s, dv, device="cuda", dtype=dtype) for _ in range(2))
            for causal, backend in ((bool(c), be) for c in args.causal for be in chosen):
                if backend == "fa3":  # (b, s, h, d) contiguous; the first output is out
                    xs = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]

                    def attend(q_, k_, v_, causal=causal):
                        res = fa3.flash_attn_func(q_, k_, v_, causal=causal)
                        return res[0] if isinstance(res, tuple) else res
                else:
                    xs = [q, k, v, dout]

                    def attend(q_, k_, v_, causal=causal):
                        return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=causal,
                                                                                dropout_p=args.dropout)
                chosen_kernel = sdpa_kernel([backends[backend]]) if backends[backend] else contextlib.nullcontext()
                with chosen_kernel:
                    qx, kx, vx, dx = xs
                    qg, kg, vg = (t.detach().requires_grad_() for t in (qx, kx, vx))
                    try:
                        out = attend(qg, kg, vg)
                    except RuntimeError as e:  # this backend does not serve the shape: say so
                        print(f"{backend} d={d} dv={dv} s={s} causal={int(causal)}: not timed "
                              f"({str(e).splitlines()[0][:160]})", flush=True)
                        continue
                    passes = {
                        "fwd": lambda: attend(qx, kx, vx),
                        "bwd": lambda: torch.autograd.grad(out, (qg, kg, vg), dx, retain_graph=True),
                    }
                    for name, run in passes.items():
                        if name not in wanted_passes:
                            continue
                        for _ in range(5):
                            run()
                        # All 30 timed calls enqueued before one synchronisation, as do_bench does:
                        # the host stays ahead, so its dispatch time is not timed as idle GPU.
                        events = []
                        for _ in range(30):
                            if flush is not None:
                                flush.zero_()
                            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            start.record()
                            run()
                            stop.record()
                            events.append((start, stop))
                        torch.cuda.synchronize()
                        ms = sorted(e0.elapsed_time(e1) for e0, e1 in events)[len(events) // 2]
                        flops = (2.5 if name == "bwd" else 1.0) * 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
                        rows.append(dict(impl="fa3" if backend == "fa3" else f"torch_sdpa_{backend}", pass_=name, dtype=args.dtype, d=d, dv=dv, seqlen=s, batch=b,
                                         heads=h, causal=causal, dropout=args.dropout, l2_flush=bool(flush is not None), ms=ms,
                                         tflops=flops / (ms * 1e-3) / 1e12))
                        print(f"{'' if backend == 'fa3' else 'torch sdpa '}{backend} {name} {args.dtype} d={d} s={s} causal={int(causal)}: {ms:.3f} ms, "
                              f"{rows[-1]['tflops']:.1f} TFLOP/s", flush=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
