"""Caller-owned workspace (SPEC §4): the size functions of flashattn._C, the workspace argument of
forward / backward / forward_kvcache, and the errors a wrong workspace gives."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flashattn
from flashattn import _C
from flashattn._common import WORKSPACE_ALIGNMENT, make_options


def options(**kw):
    base = dict(softmax_scale=0.25, causal=False, window_left=-1, window_right=-1, softcap=0.0)
    base.update(kw)
    return make_options(**base)


def test_numpy_sizes_are_zero(rng):
    """Host arrays need no workspace: every size function says 0."""
    q = rng.standard_normal((2, 7, 4, 16)).astype(np.float16)
    k = rng.standard_normal((2, 9, 2, 16)).astype(np.float16)
    lse = np.zeros((2, 4, 7), dtype=np.float32)
    assert _C.forward_workspace_size(q, k, k, options=options()) == 0
    assert _C.backward_workspace_size(q, q, k, k, q, lse, options=options(deterministic=True)) == 0
    assert _C.forward_kvcache_workspace_size(q[:, :1], k, k, options=options()) == 0


def test_workspace_argument_is_checked(rng):
    """A workspace that is not a 1-D uint8 buffer on q's device is an argument error."""
    q = rng.standard_normal((1, 5, 2, 16)).astype(np.float16)
    out = np.empty_like(q)
    with pytest.raises(ValueError, match="workspace: must be a byte buffer"):
        _C.forward(q, q, q, out, None, options=options(), workspace=np.zeros(64, dtype=np.float32))
    with pytest.raises(ValueError, match="workspace: must be a contiguous 1-D uint8 array"):
        _C.forward(q, q, q, out, None, options=options(), workspace=np.zeros((4, 64), dtype=np.uint8))


def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")


def test_torch_cpu_sizes_are_zero():
    torch = _torch()
    q = torch.randn(2, 7, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 9, 2, 16, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 7)
    assert _C.forward_workspace_size(q, k, k, options=options()) == 0
    assert _C.backward_workspace_size(q, q, k, k, q, lse, options=options()) == 0
    assert _C.forward_kvcache_workspace_size(q[:, :1], k, k, options=options(), k=k[:, :1], v=k[:, :1],
                                             cache_seqlens=torch.tensor([3, 5], dtype=torch.int32)) == 0
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    qv, kv = q[0], k[0]
    assert _C.forward_workspace_size(qv, kv, kv, options=options(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=4, max_seqlen_k=5) == 0
    assert _C.backward_workspace_size(qv, qv, kv, kv, qv, torch.zeros(4, 7), options=options(),
                                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                                      max_seqlen_k=5) == 0


def test_explicit_workspace_on_cpu_is_accepted():
    """A CPU call given a workspace it does not need computes the same result."""
    torch = _torch()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 2, 16, generator=g).half()
    k = torch.randn(1, 8, 2, 16, generator=g).half()
    out_a, out_b = torch.empty_like(q), torch.empty_like(q)
    _C.forward(q, k, k, out_a, None, options=options())
    _C.forward(q, k, k, out_b, None, options=options(), workspace=torch.empty(1024, dtype=torch.uint8))
    assert torch.equal(out_a, out_b)


def test_allocated_workspace_is_aligned():
    torch = _torch()
    from flashattn._torch_ops import _workspace

    assert _workspace(0, torch.device("cpu")) is None
    for nbytes in (1, 300, 4096):
        ws = _workspace(nbytes, torch.device("cpu"))
        assert ws.dtype == torch.uint8 and ws.shape == (nbytes,)
        assert ws.data_ptr() % WORKSPACE_ALIGNMENT == 0


def test_workspace_alloc_is_not_called_for_host_arrays(rng):
    """workspace_alloc is asked only for a workspace the call needs: none on the host, so the
    result is that of a call without it, with or without a workspace beside it, and a
    KeptWorkspace keeps nothing."""
    q = rng.standard_normal((1, 6, 2, 16)).astype(np.float16)
    k = rng.standard_normal((1, 8, 2, 16)).astype(np.float16)
    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return np.zeros(nbytes, dtype=np.uint8)

    out_a, out_b = np.empty_like(q), np.empty_like(q)
    _C.forward(q, k, k, out_a, None, options=options())
    _C.forward(q, k, k, out_b, None, options=options(), workspace_alloc=alloc)
    assert asked == [] and np.array_equal(out_a, out_b)
    out_c = np.full_like(q, np.nan)
    _C.forward(q, k, k, out_c, None, options=options(), workspace=np.zeros(256, dtype=np.uint8),
               workspace_alloc=alloc)
    kept = _C.KeptWorkspace(alloc, 1 << 20)
    assert (kept.max_bytes, kept.kept_bytes, kept.kept_address) == (1 << 20, 0, 0)
    out_d = np.full_like(q, np.nan)
    _C.forward(q, k, k, out_d, None, options=options(), workspace_alloc=kept)
    assert asked == [] and kept.kept_bytes == 0
    assert np.array_equal(out_a, out_c) and np.array_equal(out_a, out_d)


def test_kept_workspace_refusals_and_exit(rng):
    """A KeptWorkspace that was never initialised is refused by name; the per-stream keepers that
    _torch_ops holds are gone before the extension at exit (no nanobind leak report)."""
    q = rng.standard_normal((1, 4, 2, 16)).astype(np.float16)
    bare = _C.KeptWorkspace.__new__(_C.KeptWorkspace)
    out = np.full_like(q, np.nan)
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="a KeptWorkspace that was never initialised"):
        _C.forward(q, q, q, out, None, options=options(), workspace_alloc=bare)
    assert np.isnan(out).all()
    import subprocess
    import sys
    code = ("import torch\nfrom flashattn import _torch_ops\n"
            "_torch_ops._DEVICES['test'] = ('cuda', 0, None, {1: _torch_ops._kept_workspace(torch.device('cpu'))})\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "leaked" not in run.stderr, run.stderr
    # flashattn.release_workspaces forgets every stream's keeper.
    torch = _torch()
    from flashattn import _torch_ops
    _torch_ops._DEVICES["test"] = ("cuda", 0, None, {1: _torch_ops._kept_workspace(torch.device("cpu"))})
    try:
        flashattn.release_workspaces()
        assert _torch_ops._DEVICES["test"][3] == {}
    finally:
        del _torch_ops._DEVICES["test"]


def _cuda_or_skip(torch):
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible: the CUDA workspace checks need CUDA tensors")
    if "cuda" not in flashattn.compiled_backends():
        pytest.skip("this build has no CUDA backend (-DFLASHATTN_CUDA=ON)")


def _cuda_backward_inputs(torch, seed, seqlen):
    """(dout, q, k, v, out, lse) of a bf16 backward on the GPU: b 2, h 4, d 64, random values."""
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(s, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    dout, q, k, v, out = (make(2, seqlen, 4, 64) for _ in range(5))
    return dout, q, k, v, out, torch.randn(2, 4, seqlen, generator=g).cuda()


def test_cuda_backward_rejects_small_workspace():
    """On CUDA the backward needs the bytes of the kernel family that serves it, at most
    backward_workspace_size (the largest need among the families that could): less (or none)
    raises a ValueError that names the workspace and the sizes, before anything is written."""
    torch = _torch()
    _cuda_or_skip(torch)
    dout, q, k, v, out, lse = _cuda_backward_inputs(torch, 11, 128)
    opt = options(deterministic=True)
    dq = torch.full_like(q, float("nan"))
    outputs = (dq, torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse))
    stream = torch.cuda.current_stream().cuda_stream
    on_host = torch.empty(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="workspace: all tensors must be on one device"):
        _C.backward(dout, q, k, v, out, lse, *outputs, options=opt, workspace=on_host, stream=stream)
    need = _C.backward_workspace_size(dout, q, k, v, out, lse, options=opt)
    if need == 0:
        pytest.skip("this build's CUDA backward reports no workspace for this shape: nothing can be too small")
    with pytest.raises(ValueError, match=r"workspace: too small.*at least (\d+) bytes, got 0") as refused:
        _C.backward(dout, q, k, v, out, lse, *outputs, options=opt, workspace=None, stream=stream)
    serving = int(re.search(r"at least (\d+) bytes", str(refused.value)).group(1))
    assert 0 < serving <= need, (serving, need)
    small = torch.empty(serving // 2, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=f"workspace: too small.*at least {serving} bytes, got {serving // 2}"):
        _C.backward(dout, q, k, v, out, lse, *outputs, options=opt, workspace=small, stream=stream)
    misaligned = torch.empty(need + WORKSPACE_ALIGNMENT, dtype=torch.uint8, device="cuda")[1:]
    with pytest.raises(ValueError, match="workspace: must be 256-byte aligned"):
        _C.backward(dout, q, k, v, out, lse, *outputs, options=opt, workspace=misaligned, stream=stream)
    torch.cuda.synchronize()
    assert torch.isnan(dq).all(), "a rejected call wrote dq"


def test_cuda_workspace_alloc_gets_the_size_needed():
    """On CUDA the backward asks workspace_alloc once for what the serving kernel family needs (at
    most backward_workspace_size, the bytes a call without a workspace is refused for wanting),
    and gives the gradients of a call with a workspace of the public size passed in; beside a
    workspace that holds as much it is not asked; an allocator that returns too little or no
    array is an argument error, before anything is written."""
    torch = _torch()
    _cuda_or_skip(torch)
    dout, q, k, v, out, lse = _cuda_backward_inputs(torch, 12, 96)
    opt = options(deterministic=True)
    stream = torch.cuda.current_stream().cuda_stream
    need = _C.backward_workspace_size(dout, q, k, v, out, lse, options=opt)
    if need == 0:
        pytest.skip("this build's CUDA backward reports no workspace for this shape")

    def grads():
        return (torch.full_like(q, float("nan")), torch.empty_like(k), torch.empty_like(v),
                torch.empty_like(lse))

    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    with pytest.raises(ValueError, match=r"workspace: too small.*at least (\d+) bytes, got 0") as refused:
        _C.backward(dout, q, k, v, out, lse, *grads(), options=opt, stream=stream)
    serving = int(re.search(r"at least (\d+) bytes", str(refused.value)).group(1))
    by_alloc, by_size, beside = grads(), grads(), grads()
    _C.backward(dout, q, k, v, out, lse, *by_alloc, options=opt, workspace_alloc=alloc, stream=stream)
    _C.backward(dout, q, k, v, out, lse, *by_size, options=opt, stream=stream,
                workspace=torch.empty(need, dtype=torch.uint8, device="cuda"))
    _C.backward(dout, q, k, v, out, lse, *beside, options=opt, stream=stream, workspace_alloc=alloc,
                workspace=torch.empty(serving, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    assert asked == [serving] and 0 < serving <= need, (asked, serving, need)
    for a, b, c in zip(by_alloc, by_size, beside):
        assert torch.equal(a, b) and torch.equal(a, c)
    for bad, message in ((lambda n: torch.empty(n // 2, dtype=torch.uint8, device="cuda"), f"at least {serving} bytes"),
                         (lambda n: "not an array", "not an array")):
        dq, dk, dv, softmax_d = grads()
        with pytest.raises(ValueError, match=f"workspace_alloc: .*{message}"):
            _C.backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_d, options=opt, workspace_alloc=bad,
                        stream=stream)
        torch.cuda.synchronize()
        assert torch.isnan(dq).all(), "a rejected call wrote dq"


def test_cuda_stream_keeps_its_workspace():
    """On CUDA each stream's calls share one _C.KeptWorkspace (_torch_ops._kept_workspace): a
    decoding step's call asks it for its split-KV workspace once, and the next calls that need no
    more run on the same bytes without asking; a larger need replaces them, one past max_bytes is
    not kept, another stream has its own, and a call captured into a CUDA graph gets a fresh
    workspace without touching the kept one; decoding steps on the kept workspace stay right."""
    torch = _torch()
    _cuda_or_skip(torch)
    from flashattn import _torch_ops

    dev = torch.device("cuda", torch.cuda.current_device())
    _, kept, _ = _torch_ops._launch(dev)
    assert isinstance(kept, _C.KeptWorkspace) and _torch_ops._launch(dev)[1] is kept, "one per stream"
    assert kept.max_bytes == _torch_ops.KEPT_WORKSPACE_MAX
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _torch_ops._launch(dev)[1] is not kept, "another stream shares the kept workspace"

    asked = []

    def alloc(nbytes):
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    g0 = torch.Generator().manual_seed(4)
    q0 = torch.randn(1, 1, 8, 64, generator=g0).to("cuda", torch.bfloat16)
    cache0 = torch.randn(1, 8192, 2, 64, generator=g0).to("cuda", torch.bfloat16)
    out0 = torch.empty_like(q0)
    opt = options(num_splits=4)

    def step(keeper, context, splits=4):
        opt.num_splits = splits
        seqlens = torch.full((1,), context, dtype=torch.int32, device="cuda")
        _C.forward_kvcache(q0, cache0, cache0, out0, None, options=opt, cache_seqlens=seqlens,
                           workspace_alloc=keeper, stream=torch.cuda.current_stream().cuda_stream)

    mine = _C.KeptWorkspace(alloc, 1 << 30)
    step(mine, 4096)
    assert len(asked) == 1 and asked[0] > 0 and mine.kept_bytes == asked[0], (asked, mine.kept_bytes)
    first = mine.kept_address
    step(mine, 100)
    step(mine, 8192)
    assert len(asked) == 1 and mine.kept_address == first, "a call that needed no more asked again"
    step(mine, 8192, splits=16)
    assert len(asked) == 2 and asked[1] > asked[0] and mine.kept_bytes == asked[1]
    small = _C.KeptWorkspace(alloc, asked[0] - 1)
    step(small, 4096)
    step(small, 4096)
    assert len(asked) == 4 and small.kept_bytes == 0, "a workspace past max_bytes was kept"
    torch.cuda.synchronize()

    # A call while another holds the keeper (as another host thread's call would, between its
    # launches; here a call made from inside the first one's allocation) gets a workspace of its
    # own and keeps nothing; the first call keeps its own.
    inner_asked = []

    def nesting_alloc(nbytes):
        if not inner_asked:
            inner_asked.append(nbytes)
            step(busy_keeper, 4096)  # the same keeper, now busy
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    busy_keeper = _C.KeptWorkspace(nesting_alloc, 1 << 30)
    step(busy_keeper, 4096)
    torch.cuda.synchronize()
    assert len(inner_asked) == 1 and busy_keeper.kept_bytes == inner_asked[0], (inner_asked, busy_keeper.kept_bytes)
    # An allocator that returns a misaligned array: the call is refused and the array not kept.
    skewed = _C.KeptWorkspace(lambda n: torch.empty(n + 256, dtype=torch.uint8, device="cuda")[1:n + 1], 1 << 30)
    with pytest.raises(ValueError, match="256-byte aligned"):
        step(skewed, 4096)
    assert skewed.kept_bytes == 0, "a misaligned workspace was kept"

    graph = torch.cuda.CUDAGraph()
    marker = torch.zeros(1, device="cuda")
    before = kept.kept_address
    with torch.cuda.graph(graph):
        marker.add_(1)  # (a graph with a kernel in it)
        assert _torch_ops._launch(dev)[1] is not kept, "a captured call got the stream's kept workspace"
        seqlens = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
        flashattn.flash_attn_with_kvcache(q0, cache0, cache0, cache_seqlens=seqlens, num_splits=4)
    assert kept.kept_address == before, "a captured call kept its workspace"
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 64, generator=g).to("cuda", torch.bfloat16)
    k_cache = torch.randn(2, 4096, 2, 64, generator=g).to("cuda", torch.bfloat16)
    v_cache = torch.randn(2, 4096, 2, 64, generator=g).to("cuda", torch.bfloat16)
    results = []
    for context in (4096, 1000, 4096):
        seqlens = torch.full((2,), context, dtype=torch.int32, device="cuda")
        results.append(flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=4))
    torch.cuda.synchronize()
    assert torch.equal(results[0], results[2]), "the same step gave other values on the kept workspace"
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k_cache[:, :1000].float().transpose(1, 2).repeat_interleave(4, dim=1),
        v_cache[:, :1000].float().transpose(1, 2).repeat_interleave(4, dim=1)).transpose(1, 2)
    assert (results[1].float() - ref).abs().max().item() < 2e-2
