"""flashattn.distributed across processes: 2 and 4 ranks of a gloo process group on the CPU (and,
where a GPU is visible, 2 ranks with CUDA tensors sharing it over gloo, and 2 GPUs over NCCL),
each case checked against the float64 attention of the whole sequence with the SPEC §7 rule (see
cp_worker.py); plus the signatures, the arguments ring attention refuses, a group of one against
flash_attn_func, and the shard / unshard helpers."""

from __future__ import annotations

import inspect
import itertools
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: flashattn.distributed needs it")

import flashattn  # noqa: E402
from flashattn import distributed as fd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cp_worker  # noqa: E402

# Which cases run at which world size (each case shards, runs forward and backward, gathers, checks).
WORLD_CASES = {
    2: list(cp_worker.CASES),
    4: ["ring_zigzag_causal", "ring_contiguous_causal_window_softcap", "ring_varlen_zigzag_causal",
        "ring_zigzag_causal_alibi", "ring_varlen_zigzag_alibi", "ulysses_dropout_mqa", "ulysses_zigzag_alibi_window",
        "ring_dropout_zigzag_causal_gqa", "ring_dropout_contiguous_window_alibi", "ring_varlen_dropout_zigzag_causal",
        "ring_dropout_unaligned_refused"],
}
GPU_CASES = ["ring_zigzag_causal", "ring_zigzag_causal_alibi", "ring_varlen_zigzag_causal", "ring_zigzag_window",
             "ulysses_causal_gqa", "ulysses_dropout_mqa", "ring_dropout_zigzag_causal_gqa",
             "ring_varlen_dropout_zigzag_causal"]
WORKER_TIMEOUT_S = 300


def launch(world, backend, cases, tmp_path, device="cpu"):
    """Runs `world` worker processes; returns {case: "ok" | error text}."""
    init_file = tmp_path / "store"
    out_json = tmp_path / "results.json"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "cp_worker.py"), str(rank), str(world), backend,
                               device, str(init_file), str(out_json), ",".join(cases)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE)
             for rank in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=WORKER_TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    if not out_json.exists() or any(codes):
        pytest.fail(f"workers exited with {codes}:\n" + "\n".join(logs))
    return json.loads(out_json.read_text())


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """world -> {case: result}: each world size is launched once, when its first case runs."""
    cache = {}

    def results(world):
        if world not in cache:
            cache[world] = launch(world, "gloo", WORLD_CASES[world], tmp_path_factory.mktemp(f"cp{world}"))
        return cache[world]

    return results


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in WORLD_CASES.items() for c in cases])
def test_gloo_cpu(gloo_results, world, case):
    result = gloo_results(world)[case]
    assert result == "ok", result


def require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("not run: no GPU")
    if "cuda" not in flashattn.compiled_backends():
        pytest.skip("not run: a GPU is visible but this build has no CUDA backend (-DFLASHATTN_CUDA=ON)")


def test_gpu_gloo_one_device(tmp_path):
    """CUDA tensors on one GPU: two ranks share GPU 0, their transfers go through host memory
    over gloo — the kernels, combine and accumulators of the CUDA path, without NCCL."""
    require_gpu()
    results = launch(2, "gloo", GPU_CASES, tmp_path, device="cuda")
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, failed


def test_gpu_nccl(tmp_path):
    """Two GPUs over NCCL: the overlapped transfers on their own stream."""
    require_gpu()
    if torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available():
        pytest.skip(f"not run: NCCL context parallelism needs 2 GPUs, {torch.cuda.device_count()} visible")
    results = launch(2, "nccl", GPU_CASES, tmp_path, device="cuda")
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, failed


# --- refusals, without a process group --------------------------------------------------------------


@pytest.mark.parametrize("ours,theirs", [(fd.ring_flash_attn_func, flashattn.flash_attn_func),
                                         (fd.ulysses_flash_attn_func, flashattn.flash_attn_func),
                                         (fd.ring_flash_attn_varlen_func, flashattn.flash_attn_varlen_func)])
def test_signatures_extend_flash_attn(ours, theirs):
    """flash_attn's positional arguments and defaults, in its order, then group=, layout= (and
    seqlen= for batch tensors). flashattn's keyword-only extras (out=, seqused_k=,
    return_softmax_lse=) are not part of the ring's interface; an argument that flash_attn lets
    default to None only for its paged call (cu_seqlens_k, the max lengths) the ring requires."""
    mine = list(inspect.signature(ours).parameters.values())
    ref = [p for p in inspect.signature(theirs).parameters.values() if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in mine[:len(ref)]] == [p.name for p in ref]
    for p, q in zip(mine, ref):
        if p.default is not inspect.Parameter.empty or q.default is not None:
            assert p.default == q.default, p.name
    extra = ["group", "layout"] + (["seqlen"] if ours is not fd.ring_flash_attn_varlen_func else [])
    assert [(p.name, p.kind) for p in mine[len(ref):]] == [(name, inspect.Parameter.KEYWORD_ONLY) for name in extra]


def inputs(s=8, h=2, d=16):
    return [torch.randn(1, s, h, d) for _ in range(3)]


def test_ring_dropout_refuses_only_unaligned_shards():
    """With dropout, the shard layouts are checked: every shard must start at a multiple of 16
    tokens (the message says which lengths qualify); any other layout, and any layout without
    dropout, is accepted."""
    with pytest.raises(NotImplementedError, match=r"dropout_p: ring attention with dropout needs every shard to "
                                                  r"start at a multiple of 16 tokens .* layout 'zigzag' of the "
                                                  r"sequence \(37 tokens\) over 2 ranks gives starts \[0, 10, "
                                                  r"28\]; use a length that is a multiple of 64 .* or one less"):
        fd._BatchLayout([19, 18], "zigzag", 0, 2, dropout=True)
    fd._BatchLayout([19, 18], "zigzag", 0, 2)
    with pytest.raises(NotImplementedError, match=r"of sequence 1 \(33 tokens\) over 2 ranks"):
        fd._VarlenLayout([0, 32, 65], "contiguous", 1, 2, dropout=True)
    fd._VarlenLayout([0, 32, 65], "contiguous", 1, 2)
    for world, layout, lengths in [(2, "zigzag", [64, 63, 128, 1, 0]), (2, "contiguous", [32, 31, 96]),
                                   (4, "zigzag", [128, 127, 256]), (3, "contiguous", [48, 47]),
                                   (1, "zigzag", [5, 37])]:
        fd._VarlenLayout([0] + list(itertools.accumulate(lengths)), layout, 0, world, dropout=True)
        for n in lengths:
            sizes = [sum(s.length for s in fd._segments(n, world, p, layout)) for p in range(world)]
            fd._BatchLayout(sizes, layout, 0, world, dropout=True)


def test_ring_checks_alibi_slopes():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"alibi_slopes: must be float32 of shape \(2,\) or \(1, 2\)"):
        fd.ring_flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="alibi_slopes: must be float32"):
        fd.ring_flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64))


def test_ring_varlen_refuses_block_table():
    q, k, v = (x[0] for x in inputs())
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table: paged K/V"):
        fd.ring_flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_bad_layout_and_no_group():
    """Both are flashattn.Error: caught as ValueError and as RuntimeError alike."""
    q, k, v = inputs()
    with pytest.raises(RuntimeError, match="layout: must be one of") as caught:
        fd.ring_flash_attn_func(q, k, v, layout="striped")
    assert isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match="torch.distributed is not initialised") as caught:
        fd.ring_flash_attn_func(q, k, v)
    assert isinstance(caught.value, RuntimeError)


def test_cross_attention_refused():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="self-attention"):
        fd.ring_flash_attn_func(q, k[:, :5], v[:, :5])


# --- one process: a group of one, and the shard helpers ----------------------------------------------


@pytest.fixture
def single_rank_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_world_of_one_matches_flash_attn_func(single_rank_group):
    """One rank: the ring's single step is the plain call (same kernel, same mask), bit for bit
    in the forward; the backward passes through the fp32 accumulators and rounds once."""
    torch.manual_seed(0)
    # Views into one packed qkv tensor (strided, not contiguous), as training code passes them.
    qkv = torch.randn(1, 21, 3, 4, 32).to(torch.bfloat16).requires_grad_()
    q, k, v = qkv.unbind(2)
    out = fd.ring_flash_attn_func(q, k, v, causal=True, window_size=(7, -1))
    ref = flashattn.flash_attn_func(q, k, v, causal=True, window_size=(7, -1))
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    (ref_grad,) = torch.autograd.grad(ref, qkv, dout)
    assert torch.equal(grad, ref_grad)


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_world_of_one_dropout_matches_flash_attn_func(single_rank_group, layout):
    """One rank with dropout: the ring draws its rng_state as flash_attn_func does, and its calls
    (per run of the sequence, with their position offsets) the same mask, so under the same
    manual_seed the results match; zigzag's two chunks (one run here) need no alignment. For a
    varlen batch, each sequence's calls take that sequence's Philox streams."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 32).requires_grad_() for _ in range(3))
    kw = dict(dropout_p=0.3, causal=True, window_size=(20, -1), softcap=2.0)
    torch.manual_seed(5)
    out = fd.ring_flash_attn_func(q, k, v, layout=layout, **kw)
    torch.manual_seed(5)
    ref = flashattn.flash_attn_func(q, k, v, **kw)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.manual_seed(6)
    assert not torch.allclose(fd.ring_flash_attn_func(q, k, v, layout=layout, **kw), ref, atol=1e-3)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    cu = torch.tensor([0, 21, 21, 58, 70], dtype=torch.int32)
    qv, kv, vv = (torch.randn(70, 4, 32).requires_grad_() for _ in range(3))
    torch.manual_seed(7)
    out = fd.ring_flash_attn_varlen_func(qv, kv, vv, cu, cu, 37, 37, layout=layout, **kw)
    torch.manual_seed(7)
    ref = flashattn.flash_attn_varlen_func(qv, kv, vv, cu, cu, 37, 37, **kw)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (qv, kv, vv), dout),
                         torch.autograd.grad(ref, (qv, kv, vv), dout)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

def test_seqlen_must_match_the_shard(single_rank_group):
    q, k, v = inputs(s=8)
    with pytest.raises(ValueError, match="seqlen: layout 'zigzag' of a 9-token sequence gives rank 0 9 tokens; q "
                                         "holds 8"):
        fd.ring_flash_attn_func(q, k, v, layout="zigzag", seqlen=9)
    assert torch.equal(fd.ring_flash_attn_func(q, k, v, seqlen=8), fd.ring_flash_attn_func(q, k, v))


def test_shard_unshard_round_trip(single_rank_group):
    x = torch.arange(2 * 11 * 3).reshape(2, 11, 3)
    assert torch.equal(fd.unshard(fd.zigzag_shard(x), layout="zigzag"), x)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    assert torch.equal(fd.local_cu_seqlens(cu), cu)
    flat = x[0]
    assert torch.equal(fd.unshard(fd.shard(flat, cu_seqlens=cu, layout="contiguous"), cu_seqlens=cu,
                                  layout="contiguous"), flat)


def test_zigzag_shard_positions():
    """Rank r of 4 holds chunks r and 7 − r of 8 (sizes differ by at most one)."""
    segs = [fd._segments(19, 4, r, "zigzag") for r in range(4)]
    assert [[(s.start, s.length) for s in seg] for seg in segs] == [
        [(0, 3), (17, 2)], [(3, 3), (15, 2)], [(6, 3), (13, 2)], [(9, 2), (11, 2)]]
