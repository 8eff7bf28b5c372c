#!/usr/bin/env python3
"""bench/compare.py — flashattn beside PyTorch's attention backends, in one process, on the same
inputs, timed the same way.

Competitors: PyTorch SDPA restricted to one backend each — cuDNN (CUDNN_ATTENTION),
FlashAttention-2 (FLASH_ATTENTION), memory-efficient (EFFICIENT_ATTENTION) — FlexAttention
compiled with torch.compile, and FlashAttention-3 (fa3) through its `flash_attn_interface` module
(installed from FlashAttention's hopper/ folder) whenever that module is importable; when it is
not, the run says so once, records why in the JSON's "fa3" entry and marks every case's fa3 result
"FA3 not importable". A competitor that cannot run a case is shown as "–" with the reason in the
JSON; so is a flashattn call that raises (a feature its CUDA backend lacks). Nothing is dropped.
The JSON's "cuda_family" records FLASHATTN_CUDA_FAMILY (unset: "auto"), the variable that forces
flashattn's CUDA backend onto one kernel family (sm90 or sm80) instead of its per-call choice.

Case groups (--cases):
  grid      the FlashAttention benchmark grid: bf16 and fp16, d 64/128/256, causal or not,
            s 512 … 16k, batch·seqlen = 16384 tokens, heads·d = 2048
  features  d 128, s 4096, b 4, h 16: dropout 0.1, GQA 8:1, MQA, sliding window, ALiBi, softcap,
            varlen with mixed lengths, d 192 / dv 128, deterministic backward
  decode    sq 1 and 4 against a KV cache (contiguous, paged with pages of 16 and 256), GQA 32/8,
            d 128, batch 1 … 128, context 1k … 128k; GB/s beside a measured device copy
  memory    long sequences (b 1, h 16, d 128, causal, s 8k … 64k) with the math backend too: the
            peak memory of forward+backward is the point
  cpu       CPU tensors (also on the GPU machine, whose host has PyTorch): flashattn's CPU backend
            beside SDPA on CPU tensors (whichever CPU backend torch picks; the JSON says which) and
            an fp32 torch.matmul sgemm doing the same FLOPs on the attention's matmul shapes;
            bf16 and fp32, b 1, h 16, d 64/128, s 1024/2048, causal or not, forward and backward;
            GFLOP/s. One thread count for all (--cpu-threads, default torch.get_num_threads();
            flashattn's CPU backend follows torch.get_num_threads())

--cpp-bench PATH (the built flashattn-bench) adds the group cpp: bf16 d 128 s 4096 b 4 h 16,
causal and not, on the GPU, and b 1 h 16 s 2048 on the CPU, timed by this script (flashattn only)
and then by the C++ CLI with the matching flags; the report sets both medians side by side with
their ratio and whether they agree within 5% (reported, not an exit status).

Conventions (also written into the JSON):
  FLOPs     as FlashAttention counts them: forward 4·b·h·sq·sk·d (2·b·h·sq·sk·(d + dv) when d ≠ dv),
            halved when causal; backward 2.5× forward; forward+backward 3.5×. Masks other than
            causal (window, varlen documents) are counted as dense causal rows of their lengths.
  bytes     decode: K and V read once, q read, out written (the minimum traffic of the call).
  timing    median of repeats; triton.testing.do_bench (25 ms warm-up, 100 ms of repeats, L2
            flushed before each) where Triton is present, else CUDA events with the same warm-up,
            repeats and L2 flush (--timer). CPU cases: the host clock around every call, median of
            5 (--quick: 3) after 10 (--quick: 3) warm-up calls — glibc's allocator serves the first
            several allocations of an output's size from fresh pages (an 8 MiB output: ~2000 page
            faults, milliseconds), reusing its memory only after about eight. The backward is torch.autograd.grad of the output
            with the graph retained; the forward runs with autograd on (training forward) when the
            case has a backward. Decoding cases also record host_ms: the host clock over 20 calls
            issued back to back, per call — what issuing one call costs the CPU; where it reaches
            the timed median, the case is host-bound (the device waited for the host). Those up to
            batch 8 are also captured in a CUDA graph and its replay timed the same way (graph_ms,
            graph_gbps): the kernels without the per-call host work, as a serving loop runs them.
  memory    torch.cuda.max_memory_allocated over one forward+backward after a reset; reported as
            the peak and as the part above what was allocated before the call.
  check     every case runs flashattn once more, untimed, and compares out (and dq, dk, dv) on
            one batch entry and one key/value head group with an fp32 reference: the SDPA math
            backend where it can express the case, the same formulas written out otherwise
            (softcap, dropout with the library's Philox mask from docs/dropout.md); fp32 cases
            against fp64. The tolerance is SPEC §7's: 2·(error of a naive low-precision attention)
            + 2·rounding (3× with softcap; fp32 cases add fp32 rounding over the longest reduction).
            A failed check marks the case; the report shows no speed for it.

  python bench/compare.py --device-info
  python bench/compare.py --quick --out build/compare
  python bench/compare.py --cases grid --dtypes bf16 --dims 128 --out build/compare
  python bench/compare.py --cases cpu --out build/compare      # sized for about 2 minutes on 16 cores
  python bench/compare.py --quick --cpp-bench build/gpu/flashattn-bench --out build/compare
  python bench/compare.py --dry-run --out /tmp/cmp      # CPU only, tiny shapes: tests the script
Then python bench/make_report.py build/compare/*.json writes docs/benchmarks.md and docs/img/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Callable, Optional

# cuBLAS needs this to be deterministic (the math backend under torch.use_deterministic_algorithms);
# read when CUDA initialises, so it is set before torch is imported.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import make_report  # noqa: E402  (plots and number formatting; standard library only)
from make_report import figure  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CPU_DTYPES = ("bf16", "fp32")  # the cpu group's; fp32 is the CPU backend's native type
ALL_DTYPES = {**DTYPES, "fp32": torch.float32}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
BWD_FLOP_FACTOR = 2.5  # FlashAttention's convention: backward = 2.5 × forward
COPY_BUFFER_BYTES = 1 << 30  # the device-copy bandwidth is measured on 1 GiB
L2_FLUSH_BYTES = 256 << 20  # larger than the H200's 50 MB L2
MIB = 1 << 20
GIB = 1 << 30
ERROR_TEXT_LIMIT = 400  # characters of an exception's message kept in the JSON

# --cpp-bench: flashattn-bench and this script "agree" when their medians differ by at most this
# fraction; a run of the CLI that takes longer than CPP_BENCH_TIMEOUT_S is given up.
AGREEMENT_TOLERANCE = 0.05
CPP_BENCH_TIMEOUT_S = 600
# Rounds of (this script's timing, then the CLI's) per --cpp-bench configuration; each side's
# median over its rounds is compared. On the CPU one round was not enough: the same CPU backward on
# the GPU machine's shared host took 55, then 81 ms in runs minutes apart, and the two medians of
# one round each disagreed by 7–14% in either direction while the forward agreed within 1%.
# Alternating rounds put both sides under the same drift.
CPP_BENCH_ROUNDS = {"host": 3, "cuda": 1}
HOST_PROBE_CALLS = 20  # back-to-back calls of a decoding case timed by the host clock (Timer.host_ms)
DECODE_GRAPH_MAX_BATCH = 8  # decoding cases up to this batch are also timed as CUDA-graph replays
CPU_REPEATS = {"full": 5, "quick": 3}  # timed runs of a CPU case
CPU_WARMUP = {"full": 10, "quick": 3}  # untimed runs before them: until the allocator reuses its memory

# The fp32 reference materialises the scores of the checked slice: above this many (4 GiB of
# fp32), only the last query rows are checked.
REFERENCE_MAX_SCORES = 1 << 30

# SPEC §7: a kernel's error may be twice a naive low-precision attention's, plus twice the rounding
# of the result (three times with softcap).
SPEC_NAIVE_FACTOR = 2.0
SPEC_SOFTCAP_FACTOR = 3.0

COMPETITORS = ("flashattn", "cudnn", "fa2", "fa3", "efficient", "flex")
CPU_COMPETITORS = ("flashattn", "sdpa_cpu", "sgemm")  # the cpu group's, whatever --competitors says
LABELS = {
    "flashattn": "flashattn",
    "cudnn": "cuDNN (SDPA)",
    "fa2": "FA2 (SDPA flash)",
    "fa3": "FA3 (flash_attn_interface)",
    "efficient": "mem-efficient (SDPA)",
    "flex": "FlexAttention (compiled)",
    "math": "math (SDPA)",
    "sdpa_cpu": "SDPA on CPU tensors (the backend torch picks)",
    "sgemm": "fp32 sgemm (torch.matmul) of the same FLOP count",
}


class Unsupported(Exception):
    """A competitor cannot run this case; the message says why."""


FA3_MODULE = "flash_attn_interface"
FA3_MISSING = f"FA3 not importable ({FA3_MODULE})"  # every case's fa3 result when the module is absent
_fa3 = None  # (module or None, why not) once probed


def fa3_module():
    """FlashAttention-3's Python module and None, or None and why it cannot be imported; probed once."""
    global _fa3
    if _fa3 is None:
        try:
            _fa3 = (importlib.import_module(FA3_MODULE), None)
        except Exception as e:  # noqa: BLE001 — ImportError, or its extension failing to load
            _fa3 = (None, f"{type(e).__name__}: {str(e).strip()}"[:ERROR_TEXT_LIMIT])
    return _fa3


def fa3_info() -> dict:
    """The JSON's "fa3" entry: whether the module imported, from where, which version, or why not."""
    module, why = fa3_module()
    if module is None:
        return dict(importable=False, module=FA3_MODULE, error=why)
    version = getattr(module, "__version__", None)
    if version is None:
        from importlib import metadata

        for dist in ("flash_attn_3", "flash-attn-3"):
            with contextlib.suppress(metadata.PackageNotFoundError):
                version = metadata.version(dist)
                break
    return dict(importable=True, module=FA3_MODULE, file=getattr(module, "__file__", None), version=version)


def cuda_family() -> str:
    """FLASHATTN_CUDA_FAMILY as this process sees it; "auto" when unset (the backend's per-call choice)."""
    return os.environ.get("FLASHATTN_CUDA_FAMILY") or "auto"


# --- the shapes of a run ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scale:
    """The sizes the case generators use: the real ones, or tiny ones for --dry-run."""

    tokens: int  # batch · seqlen of the grid
    width: int  # heads · d of the grid
    grid_seqlens: tuple
    grid_dims: tuple
    feature_shape: tuple  # (b, s, h, d)
    window: int
    varlen_lengths: tuple
    decode_batches: tuple
    decode_contexts: tuple
    decode_heads: tuple  # (h, hk)
    decode_pages: tuple
    decode_max_kv_bytes: int
    memory_seqlens: tuple
    memory_shape: tuple  # (b, h, d)
    cpu_seqlens: tuple
    cpu_dims: tuple
    cpu_shape: tuple  # (b, h)
    cpp_cuda_shape: tuple  # (b, s, h, d) of the CUDA configurations timed by flashattn-bench too
    cpp_cpu_shape: tuple  # (b, s, h, d) of the CPU one


FULL = Scale(
    tokens=16384, width=2048, grid_seqlens=(512, 1024, 2048, 4096, 8192, 16384), grid_dims=(64, 128, 256),
    feature_shape=(4, 4096, 16, 128), window=1024,
    varlen_lengths=(512, 3072, 1024, 4096, 256, 2048, 1536, 3840),  # 16384 tokens
    decode_batches=(1, 8, 32, 64, 128), decode_contexts=(1024, 4096, 16384, 65536, 131072),
    decode_heads=(32, 8), decode_pages=(0, 16, 256), decode_max_kv_bytes=32 * GIB,
    memory_seqlens=(8192, 16384, 32768, 65536), memory_shape=(1, 16, 128),
    cpu_seqlens=(1024, 2048), cpu_dims=(64, 128), cpu_shape=(1, 16),
    cpp_cuda_shape=(4, 4096, 16, 128), cpp_cpu_shape=(1, 2048, 16, 128),  # batch·seqlen 16k, heads·d 2048
)

DRY = Scale(
    tokens=256, width=128, grid_seqlens=(32, 64), grid_dims=(32,),
    feature_shape=(2, 48, 4, 32), window=16, varlen_lengths=(7, 30, 1, 26),
    decode_batches=(1, 3), decode_contexts=(300,), decode_heads=(4, 2), decode_pages=(0, 16),
    decode_max_kv_bytes=GIB, memory_seqlens=(64,), memory_shape=(1, 2, 32),
    cpu_seqlens=(48,), cpu_dims=(32,), cpu_shape=(1, 2),
    cpp_cuda_shape=(2, 64, 4, 32), cpp_cpu_shape=(1, 64, 2, 32),  # a dry run has no GPU: only the CPU one runs
)


# --- cases -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    group: str
    name: str
    dtype: str
    b: int
    sq: int
    sk: int
    h: int
    hk: int
    d: int
    dv: int
    causal: bool = False
    window: tuple = (-1, -1)
    alibi: bool = False
    softcap: float = 0.0
    dropout: float = 0.0
    deterministic: bool = False
    varlen: Optional[tuple] = None  # sequence lengths (q and k alike) of a packed batch
    decode: bool = False
    page_size: int = 0  # decode: 0 = contiguous cache
    extra_competitors: tuple = ()  # e.g. ("math",) for the memory cases
    host: bool = False  # CPU tensors, also in a run on the GPU (the cpu group)
    only_competitors: tuple = ()  # when set, these instead of the run's competitors
    timed_directions: tuple = ()  # when set, these instead of fwd, bwd, fwd+bwd

    @property
    def id(self) -> str:
        return f"{self.group}/{self.name}"

    @property
    def directions(self):
        if self.decode:
            return ("fwd",)
        return self.timed_directions or DIRECTIONS

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)

    def visible_window(self):
        """(left, right) after SPEC §2's normalisation: causal is right = 0; ≥ sk is unbounded."""
        left, right = self.window
        if self.causal:
            right = 0
        left = -1 if left >= self.sk else left
        right = -1 if right >= self.sk else right
        return left, right

    def forward_flops(self) -> float:
        pairs = sum(s * s for s in self.varlen) if self.varlen else self.b * self.sq * self.sk
        masked = self.causal or self.window[1] == 0
        return 2.0 * self.h * pairs * (self.d + self.dv) * (0.5 if masked else 1.0)

    def flops(self, direction: str) -> float:
        factor = {"fwd": 1.0, "bwd": BWD_FLOP_FACTOR, "fwdbwd": 1.0 + BWD_FLOP_FACTOR}[direction]
        return factor * self.forward_flops()

    def io_bytes(self) -> int:
        """Decode: K and V read once, q read and out written."""
        elt = 2
        kv = self.b * self.sk * self.hk * (self.d + self.dv) * elt
        return kv + self.b * self.sq * self.h * (self.d + self.dv) * elt

    def params(self) -> dict:
        p = dataclasses.asdict(self)
        p["window"] = list(self.window)
        p["varlen"] = list(self.varlen) if self.varlen else None
        for internal in ("extra_competitors", "only_competitors", "timed_directions"):
            p.pop(internal)
        return p


def grid_cases(scale: Scale, dtypes, dims, seqlens) -> list:
    cases = []
    for dtype in dtypes:
        for d in dims:
            for causal in (False, True):
                for s in seqlens:
                    b, h = max(1, scale.tokens // s), max(1, scale.width // d)
                    name = f"{dtype}/d{d}/{'causal' if causal else 'full'}/s{s}"
                    cases.append(Case("grid", name, dtype, b, s, s, h, h, d, d, causal=causal))
    return cases


def feature_cases(scale: Scale, dtype: str) -> list:
    b, s, h, d = scale.feature_shape
    base = dict(dtype=dtype, b=b, sq=s, sk=s, h=h, hk=h, d=d, dv=d)

    def case(name, **kw):
        fields = dict(base)
        fields.update(kw)
        return Case("features", name, **fields)

    lengths = scale.varlen_lengths
    return [
        case("dropout0.1", dropout=0.1),
        case("gqa8", hk=max(1, h // 8)),
        case("mqa", hk=1),
        case(f"window{scale.window}", causal=True, window=(scale.window, 0)),
        case("alibi", causal=True, alibi=True),
        case("softcap50", causal=True, softcap=50.0),
        case("varlen", causal=True, b=len(lengths), sq=max(lengths), sk=max(lengths), varlen=tuple(lengths)),
        case("d192-dv128", d=192 if d >= 128 else d + 32, dv=d),
        case("deterministic", deterministic=True),
    ]


def decode_cases(scale: Scale, dtype: str, batches, contexts) -> list:
    h, hk = scale.decode_heads
    d = scale.feature_shape[3]
    cases = []
    for sq in (1, 4):
        for page in scale.decode_pages:
            layout = f"paged{page}" if page else "contiguous"
            for b in batches:
                for ctx in contexts:
                    c = Case("decode", f"{dtype}/sq{sq}/{layout}/b{b}/ctx{ctx}", dtype, b, sq, ctx, h, hk, d, d,
                             decode=True, page_size=page)
                    if c.b * c.sk * c.hk * (c.d + c.dv) * 2 <= scale.decode_max_kv_bytes:
                        cases.append(c)
    return cases


def memory_cases(scale: Scale, dtype: str, seqlens) -> list:
    b, h, d = scale.memory_shape
    return [Case("memory", f"{dtype}/d{d}/causal/s{s}", dtype, b, s, s, h, h, d, d, causal=True,
                 extra_competitors=("math",)) for s in seqlens]


def cpu_cases(scale: Scale, quick: bool) -> list:
    """flashattn's CPU backend beside SDPA on CPU tensors and an sgemm: forward and backward."""
    b, h = scale.cpu_shape
    seqlens = scale.cpu_seqlens[-1:] if quick else scale.cpu_seqlens
    dims = scale.cpu_dims[-1:] if quick else scale.cpu_dims
    return [Case("cpu", f"{dtype}/d{d}/{'causal' if causal else 'full'}/s{s}", dtype, b, s, s, h, h, d, d,
                 causal=causal, host=True, only_competitors=CPU_COMPETITORS, timed_directions=("fwd", "bwd"))
            for dtype in CPU_DTYPES for d in dims for causal in (False, True) for s in seqlens]


def cpp_cases(scale: Scale, on_cuda: bool) -> list:
    """The configurations timed by flashattn-bench too (--cpp-bench): bf16, causal or not, on the
    GPU (when the run has one) and one on the CPU; flashattn only, forward and backward."""
    cases = []
    for device, (b, s, h, d), causals in (("cuda", scale.cpp_cuda_shape, (False, True)),
                                          ("cpu", scale.cpp_cpu_shape, (False,))):
        if device == "cuda" and not on_cuda:
            continue
        for causal in causals:
            cases.append(Case("cpp", f"{device}/bf16/d{d}/{'causal' if causal else 'full'}/s{s}", "bf16", b, s, s,
                              h, h, d, d, causal=causal, host=device == "cpu", only_competitors=("flashattn",),
                              timed_directions=("fwd", "bwd")))
    return cases


GROUPS = ("grid", "features", "decode", "memory", "cpu")


def build_cases(args, scale: Scale, on_cuda: bool) -> list:
    groups = args.cases.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"compare.py: unknown case group(s) {sorted(unknown)}; known: {','.join(GROUPS)}")
    quick = args.quick and not args.dry_run
    if args.dtypes and set(args.dtypes.split(",")) - set(DTYPES):
        raise SystemExit(f"compare.py: --dtypes takes {','.join(DTYPES)}; got {args.dtypes}")
    dtypes = args.dtypes.split(",") if args.dtypes else (["bf16"] if quick or args.dry_run else list(DTYPES))
    dims = [int(x) for x in args.dims.split(",")] if args.dims else ([128] if quick else list(scale.grid_dims))
    seqlens = ([int(x) for x in args.seqlens.split(",")] if args.seqlens
               else ([1024, 4096] if quick else list(scale.grid_seqlens)))
    cases = []
    if "grid" in groups:
        cases += grid_cases(scale, dtypes, dims, seqlens)
    if "features" in groups:
        feats = feature_cases(scale, dtypes[0])
        cases += [c for c in feats if c.name in ("gqa8", f"window{scale.window}")] if quick else feats
    if "decode" in groups:
        batches = (1, 32) if quick else scale.decode_batches
        contexts = (4096, 32768) if quick else scale.decode_contexts
        cases += [c for c in decode_cases(scale, dtypes[0], batches, contexts)
                  if not quick or (c.sq == 1 and c.page_size in (0, 16))]
    if "memory" in groups:
        cases += memory_cases(scale, dtypes[0], scale.memory_seqlens[:1] if quick else scale.memory_seqlens)
    if "cpu" in groups:
        cases += cpu_cases(scale, quick)
    if args.cpp_bench:
        cases += cpp_cases(scale, on_cuda)
    return cases


# --- masks, biases and the fp32 reference --------------------------------------------------------


def visible(case: Case, sq: int, sk: int, device, row0: int = 0, rows: Optional[int] = None):
    """(rows, sk) bool: key j visible to query i = row0 … row0 + rows − 1 of sq (SPEC §2, diagonal
    at the bottom right); None = all visible."""
    left, right = case.visible_window()
    if left < 0 and right < 0:
        return None
    rows = sq - row0 if rows is None else rows
    i = torch.arange(row0, row0 + rows, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(rows, sk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def alibi_slopes(h: int, device) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper, 2^(−8(i+1)/h), fp32."""
    return torch.exp2(-8.0 * torch.arange(1, h + 1, dtype=torch.float32, device=device) / h)


def score_bias(case: Case, slopes: Optional[torch.Tensor], sq: int, sk: int, device, row0: int = 0,
               rows: Optional[int] = None) -> Optional[torch.Tensor]:
    """Additive fp32 bias of the scores of query rows row0 … row0 + rows − 1, (heads or 1, rows, sk):
    −slope·|i + sk − sq − j| and −∞ where masked; None when the case has neither."""
    mask = visible(case, sq, sk, device, row0, rows)
    if slopes is None and mask is None:
        return None
    rows = sq - row0 if rows is None else rows
    bias = torch.zeros(1, rows, sk, dtype=torch.float32, device=device)
    if slopes is not None:
        i = torch.arange(row0, row0 + rows, device=device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=device)[None, :]
        bias = -slopes[:, None, None] * (i - j).abs().to(torch.float32)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    return bias


_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)
_LOW32 = 0xFFFFFFFF
_PHILOX_ROUNDS = 10
_KEEP_SCALE = 65536.0


def dropout_keep(seed: int, stream: int, sq: int, sk: int, p: float, device) -> torch.Tensor:
    """(sq, sk) bool keep mask of one (batch, head) with the given Philox stream, as docs/dropout.md
    defines it. The 32-bit words are held in int64: products of two 32-bit values wrap modulo 2^64,
    which keeps exactly the bits that Philox's mulhilo needs."""
    i = torch.arange(sq, dtype=torch.int64, device=device)[:, None].expand(sq, sk)
    j = torch.arange(sk, dtype=torch.int64, device=device)[None, :].expand(sq, sk)
    lane = 4 * (i & 7) + ((j & 7) >> 1)
    c = [32 * (j >> 4) + lane, i >> 4, stream & _LOW32, (stream >> 32) & _LOW32]
    k0, k1 = seed & _LOW32, (seed >> 32) & _LOW32
    for _ in range(_PHILOX_ROUNDS):
        p0 = c[0] * _PHILOX_MUL[0]
        p1 = c[2] * _PHILOX_MUL[1]
        c = [((p1 >> 32) & _LOW32) ^ c[1] ^ k0, p1 & _LOW32, ((p0 >> 32) & _LOW32) ^ c[3] ^ k1, p0 & _LOW32]
        k0, k1 = (k0 + _PHILOX_WEYL[0]) & _LOW32, (k1 + _PHILOX_WEYL[1]) & _LOW32
    words = torch.stack(torch.broadcast_tensors(*[torch.as_tensor(w, device=device) for w in c]))
    e = 4 * ((j >> 3) & 1) + 2 * ((i >> 3) & 1) + (j & 1)
    word = torch.gather(words, 0, (e >> 1)[None]).squeeze(0)
    u = (word >> (16 * (e & 1))) & 0xFFFF
    # The threshold is computed in fp32, as the library rounds it.
    one_minus_p = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(p, dtype=torch.float32)
    threshold = int(torch.floor(one_minus_p * _KEEP_SCALE + 0.5).item())
    return u < threshold


def attention(q, k, v, case: Case, bias, keep, use_sdpa_math: bool):
    """q (g, sq, d), k (sk, d), v (sk, dv) → out (g, sq, dv), in q's dtype; bias (·, sq, sk) fp32 or
    None; keep (g, sq, sk) bool or None. use_sdpa_math: run torch's SDPA math backend (only for
    what it can express: no softcap, no dropout mask)."""
    if use_sdpa_math:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            mask = None if bias is None else bias.to(q.dtype)[None]
            out = F.scaled_dot_product_attention(q[None], k[None, None], v[None, None], attn_mask=mask,
                                                 scale=case.scale, enable_gqa=q.shape[0] > 1)
        return out[0]
    s = torch.matmul(q, k.transpose(0, 1)) * case.scale  # (g, sq, sk)
    if case.softcap > 0:
        s = case.softcap * torch.tanh(s / case.softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    p = torch.softmax(s, dim=-1)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - case.dropout)
    return torch.matmul(p.to(v.dtype), v)


# --- timing ----------------------------------------------------------------------------------------


class Timer:
    """Median time of fn in ms, the same method for every competitor."""

    def __init__(self, device: torch.device, method: str, warmup_ms: float, rep_ms: float, cpu_repeats: int,
                 cpu_warmup: int = 1):
        self.device, self.method = device, method
        self.warmup_ms, self.rep_ms, self.cpu_repeats, self.cpu_warmup = warmup_ms, rep_ms, cpu_repeats, cpu_warmup
        self._flush = None

    def describe(self) -> dict:
        if self.device.type != "cuda":
            return dict(method="perf_counter", repeats=self.cpu_repeats, warmup_calls=self.cpu_warmup,
                        l2="not flushed (CPU)")
        l2 = "flushed before every repeat (a 256 MiB buffer is zeroed)"
        return dict(method=self.method, warmup_ms=self.warmup_ms, rep_ms=self.rep_ms, l2=l2, statistic="median")

    def __call__(self, fn: Callable) -> float:
        if self.device.type != "cuda":
            for _ in range(self.cpu_warmup):
                fn()
            times = []
            for _ in range(self.cpu_repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[len(times) // 2]
        if self.method == "do_bench":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        return self._events(fn)

    def host_ms(self, fn: Callable, calls: int = HOST_PROBE_CALLS) -> Optional[float]:
        """What issuing one call costs the host, in ms: `calls` calls back to back after a
        synchronize, timed by the host clock without waiting for the device (the launches are
        asynchronous, so a call whose kernels take longer than its host work returns early). None
        on the CPU, where the timing already is host time."""
        if self.device.type != "cuda":
            return None
        fn()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / calls
        torch.cuda.synchronize(self.device)
        return ms

    def graph_ms(self, fn: Callable) -> float:
        """fn captured once in a CUDA graph (after warm-up calls on a side stream, as capture
        needs), then its replay timed as any call is: what a server that replays its decoding
        step as a graph sees, without the per-call host work."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return self(graph.replay)
        finally:
            del graph

    def _events(self, fn: Callable) -> float:
        if self._flush is None:
            self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=self.device)
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        probes = 5
        for _ in range(probes):
            fn()
        stop.record()
        torch.cuda.synchronize()
        per_call = max(start.elapsed_time(stop) / probes, 1e-3)
        for _ in range(max(1, int(self.warmup_ms / per_call))):
            fn()
        n = max(5, int(self.rep_ms / per_call))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        stops = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for a, z in zip(starts, stops):
            self._flush.zero_()
            a.record()
            fn()
            z.record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(z) for a, z in zip(starts, stops))
        return times[len(times) // 2]


def copy_bandwidth_gbps(timer: Timer, device: torch.device, nbytes: int) -> float:
    """Device copy of a large buffer: bytes read + bytes written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


# --- inputs ----------------------------------------------------------------------------------------


class Inputs:
    """The values every competitor gets (each in its own layout, made outside the timing).
    q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), dout (b, sq, h, dv); varlen: packed
    (total, heads, d) with cu_seqlens; decode: the cache as k/v and no dout."""

    def __init__(self, case: Case, device: torch.device, seed: int):
        # Drawn on the device: a decode cache can be tens of GiB.
        g = torch.Generator(device=device).manual_seed(seed)
        dtype = ALL_DTYPES[case.dtype]

        def rand(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=dtype)

        if case.varlen:
            total = sum(case.varlen)
            self.q, self.k, self.v = rand(total, case.h, case.d), rand(total, case.hk, case.d), rand(total, case.hk, case.dv)
            self.dout = rand(total, case.h, case.dv)
            lengths = torch.tensor((0,) + case.varlen, dtype=torch.int64).cumsum(0)
            self.cu_seqlens = lengths.to(device=device, dtype=torch.int32)
        else:
            self.q = rand(case.b, case.sq, case.h, case.d)
            self.k, self.v = rand(case.b, case.sk, case.hk, case.d), rand(case.b, case.sk, case.hk, case.dv)
            self.dout = None if case.decode else rand(case.b, case.sq, case.h, case.dv)
            self.cu_seqlens = None
        self.slopes = alibi_slopes(case.h, device) if case.alibi else None


def leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().clone().requires_grad_(grad)


@dataclasses.dataclass
class Runner:
    """One competitor ready to run one case: forward(*inputs) → out in its own layout, the
    upstream gradient in that layout, and a context (backend selection) around every call."""

    forward: Callable
    inputs: tuple
    dout: Optional[torch.Tensor]
    to_common: Callable  # out in its layout → the layout of Inputs.q (with dv)
    context: Callable = contextlib.nullcontext
    note: str = ""
    flops: Optional[Callable] = None  # direction → FLOPs done, when not the case's (the sgemm baseline)

    def grads_of(self):
        return [x for x in self.inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def call(self, direction: str) -> Callable:
        if direction == "fwd":
            if self.dout is None:
                return lambda: self.forward(*self.inputs)

            def fwd():
                self.forward(*self.inputs)
            return fwd
        if direction == "bwd":
            out = self.forward(*self.inputs)
            wrt = self.grads_of()
            return lambda: torch.autograd.grad(out, wrt, self.dout, retain_graph=True)

        def fwdbwd():
            torch.autograd.grad(self.forward(*self.inputs), self.grads_of(), self.dout)
        return fwdbwd


# --- competitors -------------------------------------------------------------------------------------


def flashattn_runner(case: Case, x: Inputs, device) -> Runner:
    import flashattn

    train = not case.decode
    if case.decode:
        q = x.q.detach()
        k_cache, v_cache, block_table = x.k, x.v, None
        if case.page_size:
            k_cache, v_cache, block_table = paged_cache(case, x, device)
        seqlens = torch.full((case.b,), case.sk, dtype=torch.int32, device=device)

        def forward(q):
            return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                     block_table=block_table)
        return Runner(forward, (q,), None, lambda out: out)
    q, k, v = leaf(x.q, train), leaf(x.k, train), leaf(x.v, train)
    common = dict(dropout_p=case.dropout, causal=case.causal, window_size=case.window, softcap=case.softcap,
                  alibi_slopes=x.slopes, deterministic=case.deterministic)
    if case.varlen:
        longest = max(case.varlen)

        def forward(q, k, v):
            return flashattn.flash_attn_varlen_func(q, k, v, x.cu_seqlens, x.cu_seqlens, longest, longest, **common)
    else:
        def forward(q, k, v):
            return flashattn.flash_attn_func(q, k, v, **common)
    return Runner(forward, (q, k, v), x.dout, lambda out: out)


def paged_cache(case: Case, x: Inputs, device):
    """The contiguous cache cut into pages of case.page_size rows, stored in a shuffled order, and
    the block table that finds them: (num_blocks, page, hk, d), (b, blocks per sequence) int32."""
    page = case.page_size
    per_seq = -(-case.sk // page)
    pad = per_seq * page - case.sk

    def pages(t):
        t = F.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t
        return t.reshape(case.b * per_seq, page, case.hk, t.shape[-1])

    order = torch.randperm(case.b * per_seq, generator=torch.Generator().manual_seed(7))
    k_pages, v_pages = torch.empty_like(pages(x.k)), torch.empty_like(pages(x.v))
    k_pages[order.to(device)] = pages(x.k)
    v_pages[order.to(device)] = pages(x.v)
    table = order.reshape(case.b, per_seq).to(device=device, dtype=torch.int32)
    return k_pages, v_pages, table


def fa3_output(result):
    """FA3's flash_attn_* return out alone or (out, lse, …), depending on its version."""
    return result[0] if isinstance(result, (tuple, list)) else result


def fa3_runner(case: Case, x: Inputs, device) -> Runner:
    """FlashAttention-3 on the case, in flashattn's layouts ((b, s, heads, d); varlen packed with
    cu_seqlens; decode through flash_attn_with_kvcache with page_table for a paged cache). Options
    are passed only where the case sets them, so that versions without one still run the rest.
    FA3 itself refuses tensors off a CUDA device; that refusal is recorded as the reason."""
    module, _ = fa3_module()
    if module is None:
        raise Unsupported(FA3_MISSING)
    if case.dropout > 0:
        raise Unsupported("FA3 has no dropout")
    if case.alibi:
        raise Unsupported("FA3 has no ALiBi")
    options = dict(softmax_scale=case.scale, causal=case.causal)
    if tuple(case.window) != (-1, -1):
        options["window_size"] = tuple(case.window)
    if case.softcap > 0:
        options["softcap"] = case.softcap
    if case.decode:
        if not hasattr(module, "flash_attn_with_kvcache"):
            raise Unsupported(f"this {FA3_MODULE} has no flash_attn_with_kvcache")
        q = x.q.detach()
        k_cache, v_cache, table = x.k, x.v, None
        if case.page_size:
            k_cache, v_cache, table = paged_cache(case, x, device)
            options["page_table"] = table
        seqlens = torch.full((case.b,), case.sk, dtype=torch.int32, device=device)

        def forward(q):
            return fa3_output(module.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **options))
        return Runner(forward, (q,), None, lambda out: out)
    if case.deterministic:
        options["deterministic"] = True
    q, k, v = leaf(x.q, True), leaf(x.k, True), leaf(x.v, True)
    if case.varlen:
        longest = max(case.varlen)

        def forward(q, k, v):
            return fa3_output(module.flash_attn_varlen_func(q, k, v, x.cu_seqlens, x.cu_seqlens, longest, longest,
                                                            **options))
    else:
        def forward(q, k, v):
            return fa3_output(module.flash_attn_func(q, k, v, **options))
    return Runner(forward, (q, k, v), x.dout, lambda out: out)


SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "fa2": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def sdpa_runner(name: str, case: Case, x: Inputs, device) -> Runner:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name != "math" and device.type != "cuda":
        raise Unsupported(f"SDPA's {SDPA_BACKENDS[name]} backend needs a CUDA device")
    if case.softcap > 0:
        raise Unsupported("SDPA has no logit soft-capping")
    if case.decode and case.page_size:
        raise Unsupported("SDPA has no paged KV cache (block_table)")
    backend = getattr(SDPBackend, SDPA_BACKENDS[name])
    train = not case.decode
    gqa = dict(enable_gqa=True) if case.h != case.hk else {}

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel([backend]))
        if case.deterministic:
            stack.enter_context(deterministic_algorithms())
        return stack

    def bhsd(t, grad):  # (b, s, heads, d) → (b, heads, s, d) contiguous, as SDPA's users hold them
        return leaf(t.transpose(1, 2).contiguous(), grad)

    def to_common(out):
        return out.transpose(1, 2)

    if case.varlen:
        offsets = x.cu_seqlens.to(torch.int64)
        longest = max(case.varlen)

        def nested(values):
            return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min(case.varlen),
                                                          max_seqlen=longest).transpose(1, 2)

        def forward(q, k, v):
            out = F.scaled_dot_product_attention(nested(q), nested(k), nested(v), dropout_p=case.dropout,
                                                 is_causal=case.causal, **gqa)
            return out.transpose(1, 2).values()
        q, k, v = leaf(x.q, True), leaf(x.k, True), leaf(x.v, True)
        return Runner(forward, (q, k, v), x.dout, lambda out: out, context,
                      note="varlen as a jagged NestedTensor")
    q, k, v = bhsd(x.q, train), bhsd(x.k, train), bhsd(x.v, train)
    dout = None if case.decode else x.dout.transpose(1, 2).contiguous()
    left, right = case.visible_window()
    note = ""
    if x.slopes is None and left < 0 and (right < 0 or (right == 0 and case.sq == case.sk)):
        mask, is_causal = None, right == 0
    else:
        # Windows and ALiBi reach SDPA only as an explicit, materialised mask or additive bias.
        if x.slopes is None:
            mask = visible(case, case.sq, case.sk, device)
        else:
            mask = score_bias(case, x.slopes, case.sq, case.sk, device).to(DTYPES[case.dtype])[None]
        is_causal = False
        note = "mask passed as attn_mask"

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case.dropout,
                                              is_causal=is_causal, **gqa)
    return Runner(forward, (q, k, v), dout, to_common, context, note=note)


_flex_compiled = None


def flex_window_mod(left: int, right: int, offset: int):
    """mask_mod of SPEC §2's window (left, right ≥ 0 bounded, −1 unbounded) with the diagonal at
    q_idx + offset; None when nothing is masked."""
    if left >= 0 and right >= 0:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= q_idx + offset - left) & (kv_idx <= q_idx + offset + right)
    elif left >= 0:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx >= q_idx + offset - left
    elif right >= 0:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset + right
    else:
        mask_mod = None
    return mask_mod


def flex_mods(case: Case, slopes: Optional[torch.Tensor], device):
    """FlexAttention's (score_mod, mask_mod, q_len, kv_len) for the case; either mod None when the
    case has none. The score that score_mod gets is already scaled (q·k/√d), as flashattn's softcap
    and ALiBi take it. A varlen case is one packed sequence of all its documents: a key is visible
    to a query of the same document, under the case's window counted inside the document (q and k
    lengths are equal there, so the diagonal is q_idx = kv_idx).

    The mods refer to Python numbers and to tensors made here (ALiBi's slopes, the varlen document
    ids), which FlexAttention lifts into its compiled kernels as captured buffers; they must not
    refer to a name that this function binds conditionally (an `import torch.x` in here would make
    `torch` a local of this function and an empty closure cell in the mods)."""
    offset = case.sk - case.sq
    left, right = case.visible_window()
    if case.softcap > 0 and slopes is not None:
        raise Unsupported("softcap with ALiBi is not a case here")
    score_mod = None
    if case.softcap > 0:
        cap = float(case.softcap)  # a Python constant in the graph, no tensor

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
    elif slopes is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx).abs()

    if case.varlen:
        lengths = torch.tensor(case.varlen, dtype=torch.int64, device=device)
        doc = torch.repeat_interleave(torch.arange(len(case.varlen), device=device), lengths)
        inside = flex_window_mod(left, right, 0)
        if inside is None:
            def mask_mod(b, h, q_idx, kv_idx):
                return doc[q_idx] == doc[kv_idx]
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & inside(b, h, q_idx, kv_idx)
        total = sum(case.varlen)
        return score_mod, mask_mod, total, total
    return score_mod, flex_window_mod(left, right, offset), case.sq, case.sk


def flex_runner(case: Case, x: Inputs, device, flex_decode: bool) -> Runner:
    global _flex_compiled
    if device.type != "cuda":
        raise Unsupported("FlexAttention is compiled for CUDA here (its CPU compile takes minutes)")
    if case.dropout > 0:
        raise Unsupported("FlexAttention has no dropout")
    if case.decode and case.page_size:
        raise Unsupported("paged KV through FlexAttention's experimental paged attention is not measured")
    if case.decode and not flex_decode:
        raise Unsupported("decode shapes each need their own compile; pass --flex-decode to measure them")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        # `from … import`, not `import torch._dynamo`: the latter binds `torch` as a local of this
        # function, unbound on every call after the first.
        from torch._dynamo import config as dynamo_config

        # One compiled graph per shape and mask: allow many before dynamo gives up.
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, 4096)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)

    score_mod, mask_mod, q_len, kv_len = flex_mods(case, x.slopes, device)
    block_mask = (create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device)
                  if mask_mod is not None else None)
    gqa = case.h != case.hk
    train = not case.decode

    def forward(q, k, v):
        return _flex_compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)

    if case.varlen:  # one packed sequence of all documents: (1, heads, total, d)
        def packed(t, grad):
            return leaf(t.transpose(0, 1).unsqueeze(0).contiguous(), grad)
        q, k, v = packed(x.q, True), packed(x.k, True), packed(x.v, True)
        dout = x.dout.transpose(0, 1).unsqueeze(0).contiguous()
        return Runner(forward, (q, k, v), dout, lambda out: out[0].transpose(0, 1),
                      note="varlen as a document mask over the packed batch; block mask built once, untimed")
    q, k, v = (leaf(t.transpose(1, 2).contiguous(), train) for t in (x.q, x.k, x.v))
    dout = None if case.decode else x.dout.transpose(1, 2).contiguous()
    return Runner(forward, (q, k, v), dout, lambda out: out.transpose(1, 2),
                  note="block mask built once, untimed" if block_mask is not None else "")


@contextlib.contextmanager
def deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def sdpa_cpu_runner(case: Case, x: Inputs, device) -> Runner:
    """SDPA without a backend restriction on CPU tensors (b, h, s, d); the note says which backend
    torch picked: its own choice function where it has one, and the autograd node it built."""
    if device.type != "cpu":
        raise Unsupported("the CPU competitor runs on CPU tensors")
    q, k, v = (leaf(t.transpose(1, 2).contiguous(), True) for t in (x.q, x.k, x.v))
    dout = x.dout.transpose(1, 2).contiguous()

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    picked = []
    choose = getattr(torch, "_fused_sdp_choice", None)  # private: absent in some versions
    if choose is not None:
        with contextlib.suppress(Exception):
            from torch.nn.attention import SDPBackend

            picked.append(SDPBackend(int(choose(q, k, v, None, 0.0, case.causal))).name)
    with torch.enable_grad():
        node = forward(q, k, v).grad_fn
    picked.append(f"autograd node {node.name() if node is not None else 'none'}")
    return Runner(forward, (q, k, v), dout, lambda out: out.transpose(1, 2), note="torch picked " + ", ".join(picked))


class SgemmRunner:
    """The CPU baseline: fp32 torch.matmul on the attention's matmul shapes, over as many heads as
    make the case's FLOP count (FlashAttention's convention; a causal case gets half the heads).
    Forward S = Q·Kᵀ, O = S·V; backward S = Q·Kᵀ, dP = dO·Vᵀ, dV = Sᵀ·dO, dQ = dP·K, dK = dPᵀ·Q;
    every product into a buffer allocated once, so that only the products are timed."""

    dout = None
    context = contextlib.nullcontext

    def __init__(self, case: Case, device):
        self.case = case
        self.heads = {dn: max(1, round(case.flops(dn) / self.head_flops(dn))) for dn in case.directions}
        n, sq, sk, d, dv = max(self.heads.values()), case.sq, case.sk, case.d, case.dv
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape):  # (heads, rows, cols)
            return torch.randn(n, *shape, generator=g, device=device, dtype=torch.float32)

        self.q, self.k, self.v, self.do = rand(sq, d), rand(sk, d), rand(sk, dv), rand(sq, dv)
        self.s, self.dp = torch.empty(n, sq, sk, device=device), torch.empty(n, sq, sk, device=device)
        self.o, self.dq = torch.empty(n, sq, dv, device=device), torch.empty(n, sq, d, device=device)
        self.dk, self.dv = torch.empty(n, sk, d, device=device), torch.empty(n, sk, dv, device=device)
        counts = ", ".join(f"{dn} {count}" for dn, count in self.heads.items())
        self.note = f"heads of (sq, sk, d, dv) = ({sq}, {sk}, {d}, {dv}): {counts}"

    def head_flops(self, direction: str) -> float:
        c = self.case
        fwd, bwd = 2.0 * c.sq * c.sk * (c.d + c.dv), 2.0 * c.sq * c.sk * (3 * c.d + 2 * c.dv)
        return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[direction]

    def flops(self, direction: str) -> float:
        return self.heads[direction] * self.head_flops(direction)

    def call(self, direction: str) -> Callable:
        n = self.heads[direction]
        q, k, v, do = self.q[:n], self.k[:n], self.v[:n], self.do[:n]
        s, dp, o, dq, dk, dv = (t[:n] for t in (self.s, self.dp, self.o, self.dq, self.dk, self.dv))

        def forward():
            torch.matmul(q, k.transpose(1, 2), out=s)
            torch.matmul(s, v, out=o)

        def backward():
            torch.matmul(q, k.transpose(1, 2), out=s)
            torch.matmul(do, v.transpose(1, 2), out=dp)
            torch.matmul(s.transpose(1, 2), do, out=dv)
            torch.matmul(dp, k, out=dq)
            torch.matmul(dp.transpose(1, 2), q, out=dk)

        def both():
            forward()
            backward()
        return {"fwd": forward, "bwd": backward, "fwdbwd": both}[direction]


def make_runner(name: str, case: Case, x: Inputs, device, args):
    if name == "flashattn":
        return flashattn_runner(case, x, device)
    if name == "sdpa_cpu":
        return sdpa_cpu_runner(case, x, device)
    if name == "sgemm":
        if device.type != "cpu":
            raise Unsupported("the sgemm baseline runs on the CPU")
        return SgemmRunner(case, device)
    if name == "flex":
        return flex_runner(case, x, device, args.flex_decode)
    if name == "fa3":
        return fa3_runner(case, x, device)
    return sdpa_runner(name, case, x, device)


# --- measuring -----------------------------------------------------------------------------------


class Caught(logging.Handler):
    """Collects what torch says while a competitor is set up or run: SDPA gives the reasons it
    found no kernel as warnings (dense tensors) or log records (nested tensors)."""

    LOGGERS = ("torch.nested._internal.sdpa",)

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        self._warnings = warnings.catch_warnings(record=True)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self._recorded = self._warnings.__enter__()
        warnings.simplefilter("always")
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            log.addHandler(self)
            log.propagate = False  # collected here instead of printed
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            log.removeHandler(self)
            log.propagate = True
        self._warnings.__exit__(*exc)
        return False

    def reasons(self) -> list:
        found = [str(w.message).strip() for w in self._recorded] + [m.strip() for m in self.messages]
        return [m for m in dict.fromkeys(found) if m]


def describe_error(e: BaseException, caught: Optional[Caught] = None) -> str:
    """The exception's message, and the reasons torch gave beside it (e.g. why SDPA found no kernel)."""
    text = f"{type(e).__name__}: {str(e).strip()}"
    reasons = caught.reasons() if caught is not None else []
    if reasons:
        text += " | " + " | ".join(reasons)
    return text[:ERROR_TEXT_LIMIT]


def release(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_memory(runner: Runner, device) -> dict:
    if device.type != "cuda":
        return dict(unsupported="peak memory is measured with torch.cuda.max_memory_allocated (CUDA only)")
    fn = runner.call("fwdbwd") if runner.dout is not None else runner.call("fwd")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with runner.context():
        fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return dict(peak_mib=peak / MIB, extra_mib=(peak - before) / MIB,
                what="forward+backward" if runner.dout is not None else "forward")


def run_competitor(name: str, case: Case, x: Inputs, device, timer: Timer, args) -> tuple:
    """Times every direction of one competitor on one case; returns (result dict, runner or None)."""
    result = {}
    with Caught() as caught:
        try:
            runner = make_runner(name, case, x, device, args)
        except Unsupported as e:
            return {"unsupported": str(e)}, None
        except Exception as e:  # noqa: BLE001 — any failure becomes a "–" with its reason
            return {"unsupported": describe_error(e, caught)}, None
    if runner.note:
        result["note"] = runner.note
    for direction in case.directions:
        with Caught() as caught:
            try:
                with runner.context():
                    if name == "flex":
                        t0 = time.perf_counter()
                        runner.call(direction)()  # the compile, kept out of the timing
                        result.setdefault("compile_s", {})[direction] = round(time.perf_counter() - t0, 2)
                    ms = timer(runner.call(direction))
                work = runner.flops(direction) if runner.flops is not None else case.flops(direction)
                entry = dict(ms=ms, tflops=work / (ms * 1e-3) / 1e12)
                if runner.flops is not None:
                    entry["flops"] = work
                if case.decode:
                    entry["gbps"] = case.io_bytes() / (ms * 1e-3) / 1e9
                    # Decoding steps are short enough for the host to bound them: how long the host
                    # takes to issue one call, beside the timed one (make_report flags host-bound cases).
                    with runner.context():
                        host = timer.host_ms(runner.call(direction))
                    if host is not None:
                        entry["host_ms"] = host
                    if host is not None and case.b <= DECODE_GRAPH_MAX_BATCH:
                        try:
                            with runner.context():
                                graph = timer.graph_ms(runner.call(direction))
                            entry["graph_ms"] = graph
                            entry["graph_gbps"] = case.io_bytes() / (graph * 1e-3) / 1e9
                        except Exception as e:  # noqa: BLE001 — the plain timing above stands
                            entry["graph_unsupported"] = describe_error(e)
                            release(device)
                if case.host:
                    entry["gflops"] = work / (ms * 1e-3) / 1e9
                result[direction] = entry
            except Exception as e:  # noqa: BLE001
                result[direction] = {"unsupported": describe_error(e, caught)}
                release(device)
    if any("ms" in result.get(dn, {}) for dn in case.directions):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result["memory"] = measure_memory(runner, device)
        except Exception as e:  # noqa: BLE001
            result["memory"] = {"unsupported": describe_error(e)}
    else:
        result["memory"] = {"unsupported": "nothing ran"}
    if case.deterministic and "ms" in result.get("bwd", {}):
        result["bitwise_repeatable"] = repeatable(runner)
    release(device)
    return result, runner


def repeatable(runner: Runner) -> bool:
    """Two backward passes of the same graph give bitwise equal gradients."""
    with runner.context():
        out = runner.forward(*runner.inputs)
        first = torch.autograd.grad(out, runner.grads_of(), runner.dout, retain_graph=True)
        second = torch.autograd.grad(out, runner.grads_of(), runner.dout)
    return all(torch.equal(a, b) for a, b in zip(first, second))


# --- the CPU side and flashattn-bench ----------------------------------------------------------------


def cpu_info() -> dict:
    """The host of the CPU cases: model, cores, the thread count torch and flashattn use, and
    torch's CPU stack (vector capability, BLAS, parallel backend)."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    blas = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    parallel = re.search(r"ATen parallel backend: (.+)", torch.__config__.parallel_info())
    return dict(model=model, logical_cpus=os.cpu_count(), threads=torch.get_num_threads(),
                capability=torch.backends.cpu.get_cpu_capability(), blas=blas.group(1) if blas else None,
                parallel=parallel.group(1).strip() if parallel else None)


CPP_TIMING_NOTE = (
    "Both report the median of timed runs after warm-up. GPU: compare.py times with its --timer "
    "(triton.testing.do_bench or CUDA events), a 256 MB buffer zeroed before every run; flashattn-bench "
    "runs with --timer events --l2-flush (CUDA events around the call on the default stream, a 256 MiB "
    "memset before every run), as many warm-up runs as fill compare.py's warm-up time and --min-time of "
    "its repeat time. CPU: both put the host clock around every call, the same number of warm-up runs "
    "(enough for glibc's allocator to reuse the memory of compare.py's per-call outputs instead of faulting "
    "in fresh pages), repeats and threads. What still differs: compare.py calls flashattn through PyTorch "
    "(outputs and workspace allocated on every call, by the caching allocator on the GPU and by malloc on "
    "the CPU; the backward through torch.autograd.grad), the CLI calls the C++ API on buffers allocated once; "
    "the inputs are different draws from the same normal distribution. Rounds: on the CPU three rounds of "
    "(compare.py's timing, then flashattn-bench's), each side's median of its rounds compared (the host's "
    "speed drifts between runs more than the tolerance); on the GPU one round.")


def cpp_bench_command(binary: str, case: Case, script_ms: dict, timer: Timer) -> list:
    """flashattn-bench's flags for the case, timed the way this script timed it."""
    cmd = [binary, "--b", str(case.b), "--s", str(case.sq), "--h", str(case.h), "--hk", str(case.hk),
           "--d", str(case.d), "--dv", str(case.dv), "--dtype", case.dtype, "--direction", "both", "--json", "-"]
    if case.causal:
        cmd.append("--causal")
    if case.host:
        return cmd + ["--backend", "cpu", "--threads", str(torch.get_num_threads()), "--warmup",
                      str(timer.cpu_warmup), "--repeats", str(timer.cpu_repeats)]
    # do_bench warms up for warmup_ms and repeats for rep_ms: the CLI counts runs, so the count that
    # fills warmup_ms at the faster direction's speed, and --min-time for the repeats.
    fastest_ms = min(script_ms.values(), default=1.0)
    return cmd + ["--backend", "cuda", "--timer", "events", "--l2-flush",
                  "--warmup", str(max(1, math.ceil(timer.warmup_ms / fastest_ms))), "--repeats", "5",
                  "--min-time", f"{timer.rep_ms / 1e3:g}"]


def run_cpp_bench(binary: str, case: Case, script_result: dict, timer: Timer) -> dict:
    """Runs flashattn-bench on the case and sets its medians beside this script's: per direction
    both times, their ratio (CLI ÷ script) and whether they agree within AGREEMENT_TOLERANCE."""
    script_ms = {dn: script_result[dn]["ms"] for dn in case.directions if "ms" in script_result.get(dn, {})}
    cmd = cpp_bench_command(binary, case, script_ms, timer)
    out = dict(command=" ".join(shlex.quote(part) for part in cmd), directions={})
    cli_ms, reasons = {}, {}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CPP_BENCH_TIMEOUT_S)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.startswith("flashattn-bench:")]
            raise RuntimeError(f"exit {proc.returncode}: {' '.join(lines[-2:]) or proc.stderr[-200:]}")
        report = json.loads(proc.stdout)
        run = report["runs"][0]
        config = run["config"]
        out.update(build_info=report.get("build_info"), backend=run.get("backend"), tensors=run.get("tensors"),
                   threads=report.get("threads"), gpu=report.get("gpu", {}).get("description"),
                   timer=config.get("timer", "wall"), l2_flush=config.get("l2_flush", False),
                   warmup=config.get("warmup"))
        for entry in run["results"]:
            if "median_ms" in entry:
                cli_ms[entry["direction"]] = entry["median_ms"]
                out.setdefault("runs", {})[entry["direction"]] = len(entry.get("times_ms", []))
            else:
                reasons[entry["direction"]] = entry.get("skipped", "not measured")
    except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, LookupError) as e:
        out["error"] = describe_error(e)
    for dn in case.directions:
        ours, theirs = script_ms.get(dn), cli_ms.get(dn)
        entry = dict(script_ms=ours, cli_ms=theirs)
        if ours and theirs:
            entry.update(ratio=theirs / ours, agree=abs(theirs / ours - 1.0) <= AGREEMENT_TOLERANCE)
        elif not theirs:
            entry["missing"] = reasons.get(dn) or out.get("error") or "flashattn-bench did not time it"
        else:
            entry["missing"] = script_result.get(dn, {}).get("unsupported", "compare.py did not time it")
        out["directions"][dn] = entry
    return out


def merge_cpp_rounds(rounds: list) -> dict:
    """One run_cpp_bench record from several rounds of it: per direction, the median of each side's
    per-round times (both lists kept), their ratio and the verdict; the rest from the first round."""
    out = dict(rounds[0], directions={}, rounds=len(rounds))
    for dn, first in rounds[0]["directions"].items():
        script = [r["directions"][dn].get("script_ms") for r in rounds]
        cli = [r["directions"][dn].get("cli_ms") for r in rounds]
        if not all(script) or not all(cli):
            out["directions"][dn] = next((r["directions"][dn] for r in rounds if "missing" in r["directions"][dn]), first)
            continue
        ours, theirs = statistics.median(script), statistics.median(cli)
        out["directions"][dn] = dict(script_ms=ours, cli_ms=theirs, ratio=theirs / ours,
                                     agree=abs(theirs / ours - 1.0) <= AGREEMENT_TOLERANCE,
                                     script_rounds_ms=script, cli_rounds_ms=cli)
    errors = [r["error"] for r in rounds if "error" in r]
    if errors:
        out["error"] = errors[0]
    return out


def cpp_progress_line(cpp: dict) -> str:
    parts = []
    for dn, e in cpp["directions"].items():
        if "ratio" in e:
            verdict = "agree" if e["agree"] else f"DIFFER by more than {AGREEMENT_TOLERANCE:.0%}"
            parts.append(f"{dn} {e['cli_ms']:.3f} ms vs {e['script_ms']:.3f} ms ({e['ratio']:.3f}, {verdict})")
        else:
            parts.append(f"{dn} – ({str(e.get('missing'))[:100]})")
    return "    cpp-bench  " + "; ".join(parts)


# --- the correctness check -------------------------------------------------------------------------


def check_flashattn(case: Case, x: Inputs, runner: Runner, device, with_grads: bool) -> dict:
    """flashattn's out (and dq, dk, dv when its backward ran) against an fp32 reference, on batch
    entry 0 (varlen: the first and the last sequence) and the query heads of key/value head 0. When
    that slice has more than REFERENCE_MAX_SCORES scores, only its last query rows are checked (out
    and dq; dk and dv need every row)."""
    from flashattn._torch_ops import draw_rng_state

    seed = None
    if case.dropout > 0:
        # The call draws its seed from the default generator: draw the same one first, then rewind.
        cuda = device.type == "cuda"
        state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
        seed = int(draw_rng_state(device)[0].item()) % 2**64
        (torch.cuda.set_rng_state(state, device) if cuda else torch.set_rng_state(state))
    train = runner.dout is not None and with_grads
    with torch.enable_grad() if train else torch.no_grad():
        out = runner.forward(*runner.inputs)
        grads = torch.autograd.grad(out, runner.grads_of(), runner.dout) if train else ()
    group = case.h // case.hk
    slices = []
    if case.varlen:
        cu = x.cu_seqlens.tolist()
        for s in sorted({0, len(case.varlen) - 1}):
            slices.append((s, slice(cu[s], cu[s + 1])))
    else:
        slices.append((0, None))

    errors, tolerances, partial = {}, {}, False
    uses_sdpa = case.softcap == 0 and case.dropout == 0
    # An fp32 case needs a reference more precise than itself (fp64). Its naive fp32 attention sums
    # more accurately than a kernel's sequential fp32 accumulation, so its rounding term also counts
    # fp32 rounding over the longest reduction, as tests/python/reference.py's check_spec does.
    ref_dtype = torch.float64 if case.dtype == "fp32" else torch.float32
    rounding = UNIT_ROUNDOFF[case.dtype]
    if case.dtype == "fp32":
        rounding += max(case.sq, case.sk, case.d, case.dv) * UNIT_ROUNDOFF["fp32"]
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference means fp32 products
    try:
        for batch, rows in slices:
            def pick(t, heads):  # → (heads, s, ·) of this batch entry / sequence
                t = t[rows] if rows is not None else t[batch]
                return t[:, heads].transpose(0, 1)

            qh, kvh = slice(0, group), slice(0, 1)
            q, k, v = pick(x.q, qh), pick(x.k, kvh)[0], pick(x.v, kvh)[0]
            sq, sk = q.shape[1], k.shape[0]
            n_rows = min(sq, max(1, REFERENCE_MAX_SCORES // (sk * group)))
            row0 = sq - n_rows  # the last rows: with the diagonal at the bottom right they see the most keys
            partial = partial or n_rows < sq
            slopes = None if x.slopes is None else x.slopes[:group]
            bias = score_bias(case, slopes, sq, sk, device, row0, n_rows)
            keep = None
            if seed is not None:
                keep = torch.stack([dropout_keep(seed, batch * case.h + hh, sq, sk, case.dropout, device)[row0:]
                                    for hh in range(group)])
            got = {"out": pick(out, qh)[:, row0:]}
            if train:
                got["dq"] = pick(grads[0], qh)[:, row0:]
                if n_rows == sq:
                    got.update(dk=pick(grads[1], kvh)[0], dv=pick(grads[2], kvh)[0])
            dout = pick(x.dout, qh)[:, row0:] if train else None
            q = q[:, row0:]
            ref = reference(case, q, k, v, dout, bias, keep, ref_dtype, uses_sdpa)
            naive = reference(case, q, k, v, dout, bias, keep, q.dtype, False)
            factor = SPEC_SOFTCAP_FACTOR if case.softcap > 0 else SPEC_NAIVE_FACTOR
            if n_rows < sq:
                for name in ("dk", "dv"):
                    ref.pop(name, None)
                    naive.pop(name, None)
            for name, value in got.items():
                err = (value.float() - ref[name]).abs().max().item()
                naive_err = (naive[name].float() - ref[name]).abs().max().item()
                tol = factor * naive_err + factor * rounding * ref[name].abs().max().item()
                errors[name] = max(errors.get(name, 0.0), err)
                tolerances[name] = max(tolerances.get(name, 0.0), tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    passed = all(errors[n] <= tolerances[n] for n in errors)  # NaN never passes
    scope = "batch 0 (varlen: first and last sequence), query heads of key/value head 0"
    if partial:
        scope += f"; only the last query rows (at most {REFERENCE_MAX_SCORES} scores), so no dk/dv"
    if not train and runner.dout is not None:
        scope += "; forward only (the backward did not run)"
    if ref_dtype == torch.float64:
        name = "explicit-fp64"
    else:
        name = "sdpa-math-fp32" if uses_sdpa else "explicit-fp32"
    return dict(reference=name, max_abs_error=errors,
                tolerance=tolerances, passed=passed, scope=scope)


def reference(case, q, k, v, dout, bias, keep, dtype, use_sdpa):
    """out (and dq, dk, dv when dout is given) of the sliced problem, computed in dtype and returned
    in fp32 (fp64 when computed in it)."""
    q, k, v = (t.to(dtype).detach().requires_grad_(dout is not None) for t in (q, k, v))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        out = attention(q, k, v, case, bias, keep, use_sdpa and dtype == torch.float32)
        result = {"out": out.to(wide).detach()}
        if dout is not None:
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
            result.update(dq=dq.to(wide), dk=dk.to(wide), dv=dv.to(wide))
    return result


# --- the run -----------------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                host=platform.node())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import flashattn

        info["flashattn"] = flashattn.build_info()
    except Exception as e:  # noqa: BLE001
        info["flashattn"] = f"not importable: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sm=f"sm{props.major}{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / GIB, 1))
        if shutil.which("nvidia-smi"):
            fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit"
            try:
                line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader",
                                       f"--id={device.index or 0}"], capture_output=True, text=True,
                                      timeout=20).stdout.strip()
                values = [v.strip() for v in line.split(",")]
                info.update(dict(zip(("driver", "clock_sm", "clock_sm_max", "clock_mem", "clock_mem_max",
                                      "power_limit"), values)))
            except (OSError, subprocess.SubprocessError) as e:
                info["driver"] = f"nvidia-smi failed: {e}"
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def print_device_info(info: dict):
    for key in ("gpu", "sm", "sms", "memory_gib", "clock_sm", "clock_sm_max", "clock_mem", "clock_mem_max",
                "power_limit", "driver", "cuda", "cudnn", "torch", "triton", "python", "flashattn", "cpu",
                "threads"):
        if key in info:
            print(f"{key:>14}: {info[key]}")


def progress_line(case: Case, name: str, result: dict) -> str:
    key = "gbps" if case.decode else "gflops" if case.host else "tflops"
    if result.get("unsupported") == FA3_MISSING:
        return f"    {name:<10} – (no {FA3_MODULE}; said once at the start)"
    if "unsupported" in result:
        return f"    {name:<10} – ({result['unsupported'][:100]})"
    parts = [f"{dn} {figure(result[dn][key]) if key in result.get(dn, {}) else '–'}" for dn in case.directions]
    mem = result.get("memory", {})
    if "peak_mib" in mem:
        parts.append(f"peak {mem['peak_mib']:.0f} MiB")
    reasons = {result[dn]["unsupported"][:80] for dn in case.directions if "unsupported" in result.get(dn, {})}
    tail = f"  (– {'; '.join(sorted(reasons))})" if reasons else ""
    return f"    {name:<10} " + ", ".join(parts) + tail


def run(args) -> dict:
    scale = DRY if args.dry_run else FULL
    on_cuda = not args.dry_run and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    info = device_info(device)
    method = args.timer
    if method == "auto":
        try:
            import triton.testing  # noqa: F401

            method = "do_bench"
        except ImportError:
            method = "events"
    warmup_ms, rep_ms = (10.0, 30.0) if args.quick else (25.0, 100.0)
    cpu_repeats = CPU_REPEATS["quick" if args.quick or args.dry_run else "full"]
    cpu_warmup = CPU_WARMUP["quick" if args.quick or args.dry_run else "full"]
    timer = Timer(device, method, warmup_ms, rep_ms, cpu_repeats=cpu_repeats, cpu_warmup=cpu_warmup)
    cpu = torch.device("cpu")
    cpu_timer = Timer(cpu, method, warmup_ms, rep_ms, cpu_repeats=cpu_repeats, cpu_warmup=cpu_warmup)
    competitors = [c for c in (args.competitors.split(",") if args.competitors else COMPETITORS)]
    if args.dry_run:
        competitors = list(dict.fromkeys(competitors + ["math"]))
    cases = build_cases(args, scale, on_cuda)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)  # flashattn's CPU backend follows it too
    unit = "GB/s" if all(c.decode for c in cases) else "TFLOP/s (GB/s for decode)"
    unit += "; GFLOP/s for CPU cases" if any(c.host for c in cases) else ""
    print(f"compare.py: {len(cases)} case(s), competitors {', '.join(competitors)}; {unit}; "
          f"timer {timer.describe()['method']}; device {info.get('gpu') or 'cpu'}", flush=True)

    data = dict(
        tool="bench/compare.py", schema=1, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        dry_run=bool(args.dry_run), quick=bool(args.quick), argv=sys.argv[1:], device=info, timer=timer.describe(),
        flop_convention="FlashAttention's: forward 2*b*h*sq*sk*(d+dv) (= 4*b*h*s^2*d), halved when causal "
                        "(window cases count as causal, varlen sums per sequence); backward 2.5x forward; "
                        "forward+backward 3.5x",
        bandwidth_convention="decode: bytes of K and V read once + q read + out written, per second",
        memory_convention="torch.cuda.max_memory_allocated over one forward+backward after a reset; "
                          "extra = peak minus what was allocated before the call",
        competitors={n: LABELS[n] for n in competitors},
        cuda_family=dict(FLASHATTN_CUDA_FAMILY=cuda_family(),
                         note="flashattn's CUDA backend picks its sm90 or sm80 kernels per call unless this "
                              "variable forces one family; the calls do not report which family ran"),
        cases=[],
    )
    if "fa3" in competitors:
        data["fa3"] = fa3_info()
        if data["fa3"]["importable"]:
            print(f"fa3: {FA3_MODULE} {data['fa3']['version'] or '(version unknown)'} from {data['fa3']['file']}",
                  flush=True)
        else:
            print(f"fa3: {FA3_MISSING}: {data['fa3']['error']}; its results are marked so and the run goes on",
                  flush=True)
    host_names = [n for c in cases if c.host for n in c.only_competitors]
    data["competitors"].update({n: LABELS[n] for n in host_names})
    if any(c.host for c in cases):
        data["cpu"] = cpu_info()
        data["cpu_timer"] = cpu_timer.describe()
        print(f"cpu: {data['cpu']['model']}, {data['cpu']['threads']} thread(s) for torch and flashattn", flush=True)
    if args.cpp_bench:
        data["cpp_bench"] = dict(binary=os.path.abspath(args.cpp_bench), tolerance=AGREEMENT_TOLERANCE,
                                 timing=CPP_TIMING_NOTE)
    if any(c.decode for c in cases):
        nbytes = COPY_BUFFER_BYTES if device.type == "cuda" else 16 * MIB
        data["copy_gbps"] = copy_bandwidth_gbps(timer, device, nbytes)
        data["copy_bytes"] = nbytes
        print(f"device copy: {data['copy_gbps']:.0f} GB/s (read + write of {nbytes // MIB} MiB)", flush=True)
    out_path = os.path.join(args.out, f"compare-{args.tag or args.cases.replace(',', '-')}.json") if args.out else None

    started = time.perf_counter()
    for index, case in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {case.id}  b={case.b} sq={case.sq} sk={case.sk} h={case.h} hk={case.hk} "
              f"d={case.d} dv={case.dv}", flush=True)
        record = dict(id=case.id, group=case.group, params=case.params(),
                      flops={dn: case.flops(dn) for dn in case.directions}, results={})
        if case.decode:
            record["bytes"] = case.io_bytes()
        where, case_timer = (cpu, cpu_timer) if case.host else (device, timer)
        try:
            x = Inputs(case, where, seed=index)
        except Exception as e:  # noqa: BLE001 — e.g. out of memory for the inputs themselves
            record["error"] = describe_error(e)
            print(f"    inputs: – ({record['error']})", flush=True)
            data["cases"].append(record)
            release(where)
            continue
        names = list(case.only_competitors) or competitors + [n for n in case.extra_competitors if n not in competitors]
        for name in names:
            result, runner = run_competitor(name, case, x, where, case_timer, args)
            record["results"][name] = result
            print(progress_line(case, name, result), flush=True)
            if name == "flashattn" and runner is not None and not all(
                    "unsupported" in result.get(dn, {}) for dn in case.directions):
                try:
                    record["check"] = check_flashattn(case, x, runner, where,
                                                      with_grads="ms" in result.get("bwd", {}))
                except Exception as e:  # noqa: BLE001
                    record["check"] = dict(passed=False, error=describe_error(e))
                chk = record["check"]
                errs = ", ".join(f"{k} {v:.2e}" for k, v in chk.get("max_abs_error", {}).items())
                print(f"    check      {'ok' if chk['passed'] else 'FAILED'} vs {chk.get('reference', '?')}: "
                      f"{errs or chk.get('error')}", flush=True)
            del runner
            release(where)
        if case.group == "cpp":
            rounds = [run_cpp_bench(args.cpp_bench, case, record["results"]["flashattn"], case_timer)]
            for _ in range(CPP_BENCH_ROUNDS["host" if case.host else "cuda"] - 1):
                again, runner = run_competitor("flashattn", case, x, where, case_timer, args)
                del runner
                release(where)
                rounds.append(run_cpp_bench(args.cpp_bench, case, again, case_timer))
            record["cpp_bench"] = merge_cpp_rounds(rounds)
            print(cpp_progress_line(record["cpp_bench"]), flush=True)
        del x
        release(where)
        data["cases"].append(record)
        if out_path:  # after every case, so that an interrupted run keeps what it measured
            write_json(data, out_path)
    data["seconds"] = round(time.perf_counter() - started, 1)
    print(f"compare.py: {len(cases)} case(s) in {data['seconds']} s", flush=True)
    if out_path:
        write_json(data, out_path)
        print(f"wrote {out_path}")
    if out_path and not args.no_plots:
        made = make_report.make_plots([data], os.path.join(args.out, "img"))
        if made is None:
            print("plots: matplotlib is not importable; skipped (pip install matplotlib)")
        else:
            print(f"plots: {len(made)} PNG(s) in {os.path.join(args.out, 'img')}")
    return data


def json_safe(value):
    """JSON has no NaN or infinity: such numbers (an error of a kernel that wrote NaN) become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(data: dict, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(json_safe(data), f, indent=1, allow_nan=False, default=str)
    os.replace(tmp, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(GROUPS), help=f"groups: {','.join(GROUPS)}")
    p.add_argument("--quick", action="store_true", help="a small subset (a few minutes) for routine checks")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU only, tiny shapes: flashattn's CPU backend and SDPA math; tests this script")
    p.add_argument("--out", help="directory for the JSON and the PNG plots")
    p.add_argument("--no-plots", action="store_true", help="JSON only (make_report.py draws the plots too)")
    p.add_argument("--tag", help="name part of the JSON file (default: the case groups)")
    p.add_argument("--device-info", action="store_true", help="print GPU, clocks, driver, CUDA, PyTorch, cuDNN; exit")
    p.add_argument("--competitors", help=f"comma-separated subset of {','.join(COMPETITORS)},math")
    p.add_argument("--dtypes", help="grid dtypes, e.g. bf16 (default bf16,fp16); the first also for the other groups")
    p.add_argument("--dims", help="grid head dims, e.g. 64,128")
    p.add_argument("--seqlens", help="grid sequence lengths, e.g. 1024,4096")
    p.add_argument("--timer", choices=("auto", "do_bench", "events"), default="auto",
                   help="do_bench (Triton) or CUDA events; both median, L2 flushed (default: do_bench if present)")
    p.add_argument("--flex-decode", action="store_true", help="also compile FlexAttention for every decode shape")
    p.add_argument("--cpu-threads", type=int, help="threads of the CPU cases, torch's and flashattn's alike "
                                                  "(default: torch.get_num_threads())")
    p.add_argument("--cpp-bench", metavar="PATH",
                   help="the built flashattn-bench: also time a few configurations with it and report both "
                        "medians and whether they agree within 5%%")
    args = p.parse_args(argv)
    if args.cpu_threads is not None and args.cpu_threads < 1:
        p.error("--cpu-threads must be at least 1")
    if args.cpp_bench and not (os.path.isfile(args.cpp_bench) and os.access(args.cpp_bench, os.X_OK)):
        p.error(f"--cpp-bench {args.cpp_bench}: not an executable file (build it: cmake --build <dir> "
                "--target flashattn-bench)")
    if args.competitors:
        unknown = set(args.competitors.split(",")) - set(COMPETITORS) - {"math"}
        if unknown:
            p.error(f"unknown competitor(s) {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device_info:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        print_device_info(device_info(dev))
        return 0
    if not args.dry_run and not torch.cuda.is_available() and args.cases != "cpu":
        print("compare.py: no CUDA device visible; use --dry-run to exercise the script on the CPU "
              "(--cases cpu alone runs without one)", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    try:
        data = run(args)
    except KeyboardInterrupt:
        print("compare.py: interrupted", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    finally:
        torch.set_num_threads(threads)  # --cpu-threads changed it for this process
    failed = [c["id"] for c in data["cases"] if not c.get("check", {}).get("passed", True)]
    if failed:
        print(f"compare.py: the correctness check FAILED for {len(failed)} case(s): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
