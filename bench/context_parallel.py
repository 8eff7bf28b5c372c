#!/usr/bin/env python3
"""bench/context_parallel.py — context-parallel attention across the ranks of one host: flashattn's
ring attention (flashattn.distributed, zigzag or contiguous shards) and Ulysses all-to-all beside
the same attention on one device and beside PyTorch's context-parallel SDPA
(torch.distributed.tensor.experimental.context_parallel) where it runs.

    python bench/context_parallel.py --world 8 --seqlen 131072 --heads 32 --head-dim 128 --causal \\
        --out build/cp                                                    # GPUs: NCCL, one per rank
    python bench/context_parallel.py --world 2 --device cpu --seqlen 64 --heads 4 --head-dim 32 \\
        --repeats 2 --out build/cp                                        # CPU ranks over gloo (CI)

It starts --world processes (one GPU each over NCCL, or CPU processes over gloo), builds the same
random (batch, seqlen, heads, head_dim) inputs on every rank, shards them as each method wants,
and times forward and forward+backward. --dropout P times every call with dropout (ring attention
then needs shards that start at multiples of 16 tokens: docs/context-parallel.md, "Dropout"); the
single-device reference and the compared calls draw their mask from the same seed, so the
max_abs_diff_vs_single of ring and Ulysses still checks them.

Per method and direction (JSON, one file per run: OUT/context_parallel-<tag>.json):
  median_ms            median over --repeats of the slowest rank's time (every repeat starts
                       after a barrier; a step is as slow as its slowest rank)
  tokens_per_s_per_device, tflops_per_device
                       batch·seqlen tokens and the FLOPs of the whole sequence, divided by the
                       time and the number of devices working (1 for the single-device run)
  peak_memory_bytes    the largest torch.cuda.max_memory_allocated over the ranks (CUDA only;
                       null on the CPU, where no allocator statistics exist)
  ring only:           compute_only_ms (the same calls with every transfer replaced by a local
                       copy, flashattn.distributed._compute_only), comm_only_ms (the same
                       transfers back to back without computation), exposed_comm_ms = total −
                       compute-only, hidden_fraction = 1 − exposed / comm-only (clamped to [0, 1]):
                       how much of the communication the overlap hides
  max_abs_diff_vs_single
                       the method's out, gathered, against the single-device out (a wrong method
                       is not reported as fast without saying so)

FLOPs: FlashAttention's convention, forward 4·b·h·s²·d, halved when causal, forward+backward 3.5×
forward. A method that cannot run (PyTorch's CP SDPA on the CPU, Ulysses with heads % world != 0)
is kept with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("single", "ring", "ulysses", "torch_cp")
DIRECTIONS = ("fwd", "fwd_bwd")
# forward + backward = forward + 2.5 × forward (FlashAttention's count).
FWD_BWD_FLOP_FACTOR = 3.5


# Seeds the mask of the single-device reference and of the distributed calls compared with it.
DROPOUT_SEED = 20261203

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (processes; one GPU each on CUDA)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=16384, help="tokens of the whole sequence")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability of every call")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag", help="ring and Ulysses shards")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--directions", default=",".join(DIRECTIONS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (CPU runs)")
    p.add_argument("--out", default="build/context_parallel", help="folder of the JSON file")
    p.add_argument("--tag", default=None, help="file name part (default: a summary of the shape)")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.methods = [m for m in args.methods.split(",") if m]
    args.directions = [d for d in args.directions.split(",") if d]
    for name, chosen, allowed in (("--methods", args.methods, METHODS), ("--directions", args.directions,
                                                                       DIRECTIONS)):
        bad = [x for x in chosen if x not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    return args


def flops(args, direction):
    forward = 4.0 * args.batch * args.heads * args.seqlen ** 2 * args.head_dim * (0.5 if args.causal else 1.0)
    return forward * (FWD_BWD_FLOP_FACTOR if direction == "fwd_bwd" else 1.0)


class Rank:
    """One process's view: its rank, device and the group-wide helpers of the timings."""

    def __init__(self, rank, world, device):
        self.rank, self.world, self.device = rank, world, device

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def slowest(self, seconds):
        """The largest of every rank's value (the step time is the slowest rank's)."""
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def time(self, fn, warmup, repeats):
        """Median over repeats of the slowest rank's seconds for fn()."""
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            samples.append(self.slowest(time.perf_counter() - start))
        return statistics.median(samples)

    def peak_memory(self, fn):
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return int(self.slowest(torch.cuda.max_memory_allocated(self.device)))


def make_inputs(args, device):
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    shape = (args.batch, args.seqlen)
    q = torch.randn(shape + (args.heads, args.head_dim), generator=gen)
    k = torch.randn(shape + (args.kv_heads, args.head_dim), generator=gen)
    v = torch.randn(shape + (args.kv_heads, args.head_dim), generator=gen)
    dout = torch.randn(shape + (args.heads, args.head_dim), generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


def step(fn, q, k, v, dout, direction):
    """One forward (with autograd recording when a backward follows) and, for fwd_bwd, the backward."""
    if direction == "fwd":
        def forward():
            with torch.no_grad():
                fn(q, k, v)

        return forward
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def run():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, dout)

    return run


def measure(r, args, fn, inputs, direction, devices):
    q, k, v, dout = inputs
    run = step(fn, q, k, v, dout, direction)
    seconds = r.time(run, args.warmup, args.repeats)
    tokens = args.batch * args.seqlen
    return dict(median_ms=seconds * 1e3, tokens_per_s_per_device=tokens / seconds / devices,
                tflops_per_device=flops(args, direction) / seconds / devices / 1e12,
                peak_memory_bytes=r.peak_memory(run))


def run_flashattn(r, args, method, whole, direction, reference):
    from flashattn import distributed as fd

    fn = fd.ring_flash_attn_func if method == "ring" else fd.ulysses_flash_attn_func
    local = [fd.shard(x, layout=args.layout) for x in whole]

    def attention(q, k, v):
        # seqlen given: no all-gather of the shard lengths (a device synchronisation) per call.
        return fn(q, k, v, dropout_p=args.dropout, causal=args.causal, layout=args.layout, seqlen=args.seqlen)

    result = measure(r, args, attention, local, direction, r.world)
    with torch.no_grad():
        torch.manual_seed(DROPOUT_SEED)  # the reference's mask (the group's first rank draws it)
        out = fd.unshard(attention(*local[:3]), layout=args.layout)
    if reference is not None:
        result["max_abs_diff_vs_single"] = float((out.float() - reference.float()).abs().max())
    if method == "ring":
        with fd._compute_only():
            compute = measure(r, args, attention, local, direction, r.world)
        result["compute_only_ms"] = compute["median_ms"]
        result["comm_only_ms"] = ring_comm_only(r, args, local, direction) * 1e3
        exposed = max(0.0, result["median_ms"] - result["compute_only_ms"])
        result["exposed_comm_ms"] = exposed
        comm = result["comm_only_ms"]
        result["hidden_fraction"] = min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else None
    return result


def ring_comm_only(r, args, local, direction):
    """Seconds of the ring's transfers alone: world − 1 K/V blocks forward; for fwd_bwd also
    world − 1 K/V blocks and world fp32 dK/dV accumulators backward, each waited for at once."""
    from flashattn import distributed as fd

    _, k, v, _ = local
    ring = fd._Ring(None, r.device)
    block = fd._pack(k, v)
    grads = torch.zeros(block.numel(), dtype=torch.float32, device=r.device)
    transfers = [(block, fd._TAG_KV)] * (r.world - 1)
    if direction == "fwd_bwd":
        transfers += [(block, fd._TAG_KV)] * (r.world - 1) + [(grads, fd._TAG_DKV)] * r.world

    def run():
        for buf, tag in transfers:
            ring.wait(ring.start(buf, torch.empty_like(buf), tag))

    return r.time(run, args.warmup, args.repeats)


def run_torch_cp(r, args, whole, direction):
    """PyTorch's context-parallel SDPA: DTensor's ring attention over a 1-D device mesh."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(r.device.type, (r.world,))
    # SDPA's layout: (batch, heads, seqlen, head_dim); context_parallel shards dim 2 in place.
    q, k, v, dout = (x.transpose(1, 2).contiguous() for x in whole)
    gqa = args.kv_heads != args.heads

    def attention(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, dropout_p=args.dropout, is_causal=args.causal,
                                              enable_gqa=gqa)

    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        return measure(r, args, attention, (q, k, v, dout), direction, r.world)


def single_device(r, args, whole, direction):
    """The whole sequence on rank 0's device alone (the other ranks wait)."""
    import flashattn

    def attention(q, k, v):
        return flashattn.flash_attn_func(q, k, v, dropout_p=args.dropout, causal=args.causal)

    result = None
    if r.rank == 0:
        q, k, v, dout = whole
        run = step(attention, q, k, v, dout, direction)
        for _ in range(args.warmup):
            run()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)
            samples.append(time.perf_counter() - start)
        seconds = statistics.median(samples)
        tokens = args.batch * args.seqlen
        result = dict(median_ms=seconds * 1e3, tokens_per_s_per_device=tokens / seconds,
                      tflops_per_device=flops(args, direction) / seconds / 1e12, peak_memory_bytes=None)
        if r.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(r.device)
            run()
            result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(r.device))
    dist.barrier()
    return result


def worker(rank, args, init_file, out_path):
    world = args.world
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
        backend = "gloo"
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        # All ranks are on this host: loopback needs no resolvable host name (CI containers).
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    r = Rank(rank, world, device)
    whole = make_inputs(args, device)
    reference = None
    if rank == 0:
        import flashattn

        with torch.no_grad():
            torch.manual_seed(DROPOUT_SEED)
            reference = flashattn.flash_attn_func(*whole[:3], dropout_p=args.dropout, causal=args.causal)
    results = []
    for method in args.methods:
        for direction in args.directions:
            entry = dict(method=method, direction=direction)
            try:
                if method == "single":
                    measured = single_device(r, args, whole, direction)
                elif method == "torch_cp":
                    measured = run_torch_cp(r, args, whole, direction)
                else:
                    measured = run_flashattn(r, args, method, whole, direction, reference)
                entry.update(measured or {})
                entry["ran"] = True
            except Exception as e:  # noqa: BLE001  (kept in the JSON with its reason)
                entry.update(ran=False, reason=f"{type(e).__name__}: {e}".splitlines()[0][:300])
            # Ranks that failed differently must not drift apart in their collectives.
            dist.barrier()
            if rank == 0:
                results.append(entry)
                print(format_row(entry), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(config=vars(args), device=describe(device, world, backend), flop_convention=(
                "forward 4·b·h·s²·d, halved when causal; forward+backward 3.5× forward"), results=results), f,
                indent=1)
        print(f"wrote {out_path}")
    dist.destroy_process_group()


def describe(device, world, backend):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compare import device_info

    info = device_info(device)
    info.update(world=world, process_group=backend)
    return info


def format_row(e):
    if not e.get("ran"):
        return f"{e['method']:>9} {e['direction']:>7}  not run: {e.get('reason')}"
    row = (f"{e['method']:>9} {e['direction']:>7}  {e['median_ms']:10.3f} ms  {e['tokens_per_s_per_device']:12.0f} "
           f"tok/s/dev  {e['tflops_per_device']:8.4f} TFLOP/s/dev")
    if e.get("hidden_fraction") is not None:
        row += (f"  compute-only {e['compute_only_ms']:.3f} ms, comm-only {e['comm_only_ms']:.3f} ms, "
                f"hidden {100 * e['hidden_fraction']:.0f}%")
    if "max_abs_diff_vs_single" in e:
        row += f"  |Δ| vs single {e['max_abs_diff_vs_single']:.3g}"
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs as many GPUs; {torch.cuda.device_count()} visible (--device cpu "
                 f"runs CPU ranks)")
    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or (f"{args.device}-w{args.world}-b{args.batch}-s{args.seqlen}-h{args.heads}-d{args.head_dim}"
                       f"-{args.dtype}{'-causal' if args.causal else ''}")
    out_path = os.path.join(args.out, f"context_parallel-{tag}.json")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out_path), nprocs=args.world, join=True)
    return out_path


if __name__ == "__main__":
    main()
