"""The torch.library operators: opcheck, torch.compile without graph breaks, dropout
reproducibility, and zero-copy reads of packed tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402
from flashattn import _torch_ops  # noqa: E402

from conftest import torch_devices  # noqa: E402


def qkv(device, b=2, sq=19, sk=23, h=4, hk=2, d=32, dtype=torch.float16, requires_grad=False):
    g = torch.Generator().manual_seed(41)
    make = lambda *s: torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)  # noqa: E731
    return make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, d)


def rng_state(device, seed=1234):
    return torch.tensor([seed, 0], dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_opcheck_fwd_bwd(dropout_p, device):
    q, k, v = qkv(device)
    alibi = torch.rand(4, device=device)
    state = rng_state(device)
    args = (q, k, v, dropout_p, 0.2, True, -1, -1, 0.0, alibi, state)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, args)
    out, lse, st = torch.ops.flashattn.fwd(*args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashattn.bwd.default,
                          (dout, q, k, v, out, lse, dropout_p, 0.2, True, -1, -1, 0.0, alibi, False, st))


@pytest.mark.parametrize("device", torch_devices())
def test_opcheck_varlen(device):
    g = torch.Generator().manual_seed(42)
    cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 12, 30], dtype=torch.int32, device=device)
    q = torch.randn(17, 4, 16, generator=g).to(device, torch.bfloat16)
    k = torch.randn(30, 2, 16, generator=g).to(device, torch.bfloat16)
    v = torch.randn(30, 2, 16, generator=g).to(device, torch.bfloat16)
    args = (q, k, v, cu_q, cu_k, None, 12, 18, 0.0, 0.25, False, 4, 4, 1.5, None, None)
    torch.library.opcheck(torch.ops.flashattn.varlen_fwd.default, args)
    out, lse, st = torch.ops.flashattn.varlen_fwd(*args)
    torch.library.opcheck(torch.ops.flashattn.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, cu_q, cu_k, None, 12, 18, 0.0, 0.25,
                           False, 4, 4, 1.5, None, True, st))


@pytest.mark.parametrize("device", torch_devices())
def test_opcheck_fwd_kvcache(device):
    g = torch.Generator().manual_seed(43)
    make = lambda *s: torch.randn(s, generator=g).to(device, torch.float16)  # noqa: E731
    q, k_cache, v_cache = make(2, 3, 4, 32), make(2, 16, 2, 32), make(2, 16, 2, 32)
    k_new, v_new = make(2, 2, 2, 32), make(2, 2, 2, 32)
    seqlens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    torch.library.opcheck(
        torch.ops.flashattn.fwd_kvcache.default,
        (q, k_cache, v_cache, k_new, v_new, seqlens, None, None, None, None, None, 0.17, True, -1, -1, 0.0,
         True, 0))


@pytest.mark.parametrize("device", torch_devices())
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_compile_fullgraph(dropout_p, device):
    """flash_attn_func forward and backward under torch.compile with no graph break."""
    q, k, v = qkv(device, d=40, requires_grad=True)  # d = 40: no padding; 36 below pads

    def step(q, k, v):
        out = flashattn.flash_attn_func(q, k, v, dropout_p, None, True)
        return out.float().square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.manual_seed(5)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.manual_seed(5)
    eager = step(q, k, v)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for a, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, x.grad)


@pytest.mark.parametrize("device", torch_devices())
def test_compile_varlen_kvcache_and_padding(device):
    g = torch.Generator().manual_seed(44)
    q = torch.randn(2, 5, 2, 36, generator=g).to(device, torch.float16)
    k_cache = torch.randn(2, 16, 2, 36 + 4, generator=g).to(device, torch.float16)

    def fn(q, k, v, cache):
        padded = flashattn.flash_attn_func(q, k, v, causal=True)  # head dim 36 -> 40 and back
        out = flashattn.flash_attn_with_kvcache(torch.nn.functional.pad(q, [0, 4]), cache, cache,
                                                cache_seqlens=7)
        return padded, out

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = compiled(q, q, q, k_cache)
    want = fn(q, q, q, k_cache)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", torch_devices())
def test_dropout_reproducible_under_manual_seed(device):
    q, k, v = qkv(device)
    torch.manual_seed(0)
    a = flashattn.flash_attn_func(q, k, v, dropout_p=0.3)
    b = flashattn.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(0)
    a2 = flashattn.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)  # the next call draws a new seed


@pytest.mark.parametrize("device", torch_devices())
def test_rng_state_goes_from_forward_to_backward(device):
    q, k, v = qkv(device)
    state = rng_state(device, seed=987654321)
    out, lse, returned = torch.ops.flashattn.fwd(q, k, v, 0.4, 0.2, False, -1, -1, 0.0, None, state)
    assert torch.equal(returned, state) and returned.data_ptr() != state.data_ptr()
    out2, _, _ = torch.ops.flashattn.fwd(q, k, v, 0.4, 0.2, False, -1, -1, 0.0, None, state)
    assert torch.equal(out, out2)
    with pytest.raises(ValueError, match="rng_state"):
        torch.ops.flashattn.bwd(torch.ones_like(out), q, k, v, out, lse, 0.4, 0.2, False, -1, -1, 0.0, None,
                                False, None)



# --- dropout position offsets ----------------------------------------------------------------------
#
# With v one-hot (dv = sk, v[j] = e_j) and small scores, out[i, h, j] = keep · p_ij / (1 − p) with
# p_ij > 0, so the mask of a call is out != 0.


def offsets_dtype(device):
    """fp32 where the CPU backend runs (its oracle's precision), fp16 on CUDA (fp32 is CPU-only)."""
    return torch.float32 if device == "cpu" else torch.float16


def one_hot_problem(device, b=2, sq=48, sk=96, h=3):
    g = torch.Generator().manual_seed(44)
    dtype = offsets_dtype(device)
    q = (0.25 * torch.randn(b, sq, h, 16, generator=g)).to(device, dtype)
    k = (0.25 * torch.randn(b, sk, h, 16, generator=g)).to(device, dtype)
    v = torch.eye(sk).expand(b, h, sk, sk).transpose(1, 2).contiguous().to(device, dtype)  # (b, sk, h, sk)
    return q, k, v


def part_of(q, k, rows, cols, device):
    """q's rows and k's columns, with v one-hot over those columns."""
    n = cols.stop - cols.start
    v = torch.eye(n).expand(q.shape[0], q.shape[2], n, n).transpose(1, 2).contiguous().to(device, q.dtype)
    return q[:, rows].contiguous(), k[:, cols].contiguous(), v


@pytest.mark.parametrize("device", torch_devices())
def test_dropout_offsets_draw_that_part_of_the_whole_mask(device):
    """fwd over rows [16, 48) x keys [32, 96), told (16, 32), draws exactly that part of the mask of
    the whole call (both through the op and directly); without the offsets, another one. varlen_fwd
    with the same offsets does the same for each sequence (stream = offset + sequence·nheads + head)."""
    q, k, v = one_hot_problem(device)
    state = rng_state(device, seed=77)
    p, scale = 0.4, 0.5
    whole = torch.ops.flashattn.fwd(q, k, v, p, scale, False, -1, -1, 0.0, None, state)[0] != 0
    assert 0.4 < whole.float().mean().item() < 0.8
    rows, cols = slice(16, 48), slice(32, 96)
    qp, kp, vp = part_of(q, k, rows, cols, device)
    want = whole[:, rows, :, cols]
    args = (qp, kp, vp, p, scale, False, -1, -1, 0.0, None, state, None)
    assert torch.equal(torch.ops.flashattn.fwd(*args, 16, 32)[0] != 0, want)
    assert torch.equal(_torch_ops.call("fwd", *args, 16, 32)[0] != 0, want)
    assert not torch.equal(torch.ops.flashattn.fwd(*args)[0] != 0, want)
    assert not torch.equal(torch.ops.flashattn.fwd(*args, 16, 0)[0] != 0, want)

    b, n_rows, n_cols = q.shape[0], 32, 64
    cu_q = torch.arange(0, (b + 1) * n_rows, n_rows, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (b + 1) * n_cols, n_cols, dtype=torch.int32, device=device)
    out = torch.ops.flashattn.varlen_fwd(qp.flatten(0, 1), kp.flatten(0, 1), vp.flatten(0, 1), cu_q, cu_k, None,
                                         n_rows, n_cols, p, scale, False, -1, -1, 0.0, None, state, None, None,
                                         16, 32)[0]
    assert torch.equal(out.view(b, n_rows, *out.shape[1:]) != 0, want)


@pytest.mark.parametrize("device", torch_devices())
def test_dropout_offsets_in_the_backward(device):
    """The whole call's gradients are the sum of those of four calls on the blocks rows {[0, 16),
    [16, 48)} x keys {[0, 32), [32, 96)}, each given its offsets and the whole call's out and lse
    (as ring attention computes them), by bwd and by varlen_bwd; with the offsets left at 0 they
    are not."""
    g = torch.Generator().manual_seed(45)
    dtype = offsets_dtype(device)
    q, k, v = (torch.randn(2, n, 3, 16, generator=g).to(device, dtype) for n in (48, 96, 96))
    dout = torch.randn(2, 48, 3, 16, generator=g).to(device, dtype)
    state = rng_state(device, seed=78)
    p, scale = 0.3, 0.25
    out, lse, _ = torch.ops.flashattn.fwd(q, k, v, p, scale, False, -1, -1, 0.0, None, state)
    want = torch.ops.flashattn.bwd(dout, q, k, v, out, lse, p, scale, False, -1, -1, 0.0, None, False, state)[:3]

    def blockwise(offsets, varlen):
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for rows in (slice(0, 16), slice(16, 48)):
            for cols in (slice(0, 32), slice(32, 96)):
                at = (rows.start, cols.start) if offsets else (0, 0)
                parts = (dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows])
                lse_rows = lse[:, :, rows].contiguous()
                if varlen:
                    n_r, n_c = rows.stop - rows.start, cols.stop - cols.start
                    cu_q = torch.tensor([0, n_r, 2 * n_r], dtype=torch.int32, device=device)
                    cu_k = torch.tensor([0, n_c, 2 * n_c], dtype=torch.int32, device=device)
                    flat = [x.flatten(0, 1) for x in parts]
                    lse_flat = lse_rows.transpose(0, 1).flatten(1, 2).contiguous()
                    dq, dk, dv, _ = torch.ops.flashattn.varlen_bwd(*flat, lse_flat, cu_q, cu_k, None, n_r, n_c, p,
                                                                   scale, False, -1, -1, 0.0, None, False, state,
                                                                   *at)
                    dq, dk, dv = dq.view(2, n_r, 3, 16), dk.view(2, n_c, 3, 16), dv.view(2, n_c, 3, 16)
                else:
                    dq, dk, dv, _ = torch.ops.flashattn.bwd(*parts, lse_rows, p, scale, False, -1, -1, 0.0, None,
                                                            False, state, *at)
                grads[0][:, rows] += dq
                grads[1][:, cols] += dk
                grads[2][:, cols] += dv
        return grads

    # fp16: each block's gradients rounded before they are summed, against one rounding of the whole.
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    for varlen in (False, True):
        for got, ref in zip(blockwise(True, varlen), want):
            torch.testing.assert_close(got, ref, **tol)
        assert not torch.allclose(blockwise(False, varlen)[1], want[1], atol=1e-3)


def test_dropout_offsets_must_be_whole_blocks():
    q, k, v = qkv("cpu")
    for offsets, name in (((8, 0), "dropout_row_offset"), ((0, -16), "dropout_col_offset")):
        with pytest.raises(ValueError, match=name):
            torch.ops.flashattn.fwd(q, k, v, 0.2, 0.2, False, -1, -1, 0.0, None, rng_state("cpu"), None, *offsets)


def test_packed_qkv_is_read_in_place(monkeypatch):
    """The kernels receive views of the packed tensor (same storage), not copies."""
    qkv_t = torch.randn(2, 9, 3, 2, 16, dtype=torch.float16)
    seen = {}
    real_forward = _torch_ops._C.forward

    def recording_forward(q, k, v, *args, **kwargs):
        # The ops hand _C DLPack capsules; import them here instead (a capsule is used once).
        q, k, v = (torch.utils.dlpack.from_dlpack(x) for x in (q, k, v))
        seen["ptrs"] = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        return real_forward(q, k, v, *args, **kwargs)

    monkeypatch.setattr(_torch_ops._C, "forward", recording_forward)
    flashattn.flash_attn_qkvpacked_func(qkv_t)
    base, step = qkv_t.data_ptr(), qkv_t.stride(2) * qkv_t.element_size()
    assert seen["ptrs"] == (base, base + step, base + 2 * step)


def test_outputs_are_written_completely():
    """Outputs poisoned with NaN before the call come back without a NaN (every element written)."""
    q, k, v = qkv("cpu")
    out = torch.full((2, 19, 4, 32), float("nan"), dtype=torch.float16)
    lse = torch.full((2, 4, 19), float("nan"))
    opt = flashattn._C.Options()
    flashattn._C.forward(q, k, v, out, lse, options=opt)
    assert not out.isnan().any() and not lse.isnan().any()
    grads = [torch.full(x.shape, float("nan"), dtype=x.dtype) for x in (q, k, v)]
    softmax_d = torch.full((2, 4, 19), float("nan"))
    flashattn._C.backward(torch.randn_like(out), q, k, v, out, lse, *grads, softmax_d, options=opt)
    assert not any(g.isnan().any() for g in grads) and not softmax_d.isnan().any()


def test_cuda_tensor_on_a_build_without_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible: a CUDA tensor cannot be made here")
    if "cuda" in flashattn.compiled_backends():
        pytest.skip("this build has the CUDA backend")
    q = torch.randn(1, 4, 1, 8, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="FLASHATTN_CUDA"):
        flashattn.flash_attn_func(q, q, q)


def test_cuda_graph_capture_with_dropout():
    """A captured CUDA graph replays the forward with fresh dropout randomness on every replay
    (the seed is drawn on the device inside the graph), and without dropout a replay equals the
    eager call."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible: CUDA-graph capture needs one")
    if "cuda" not in flashattn.compiled_backends():
        pytest.skip("this build has no CUDA backend (-DFLASHATTN_CUDA=ON)")
    q, k, v = qkv("cuda", sq=64, sk=64, d=64)
    for dropout_p in (0.0, 0.25):
        fn = lambda: flashattn.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up outside the capture, as CUDA graphs require
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn()
        graph.replay()
        first = static_out.clone()
        graph.replay()
        second = static_out.clone()
        torch.cuda.synchronize()
        assert torch.isfinite(first).all() and torch.isfinite(second).all()
        if dropout_p == 0.0:
            torch.testing.assert_close(first, fn(), rtol=0, atol=0)
            assert torch.equal(first, second)
        else:
            assert not torch.equal(first, second), "replays reused one dropout mask"


def test_kernels_run_on_the_current_stream():
    """The stream handle the ops pass to the core is the current one, also inside a
    torch.cuda.stream context and on a second device index where there is one."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible: CUDA streams need one")
    device = torch.device("cuda", torch.cuda.current_device())
    assert _torch_ops._stream(device) == torch.cuda.current_stream(device).cuda_stream
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        assert _torch_ops._stream(device) == side.cuda_stream != torch.cuda.default_stream(device).cuda_stream
    assert _torch_ops._stream(torch.device("cpu")) == 0


# --- direct calls (the ops' implementations without the dispatcher, in plain eager mode) -------


@pytest.fixture
def direct_calls(monkeypatch):
    """Records which op implementations run directly (not through torch.ops.flashattn), by
    _torch_ops.call (_IMPLS) or by call_into (_IMPLS_INTO, the forwards of calls autograd does not
    record)."""
    calls = []
    for table in (_torch_ops._IMPLS, _torch_ops._IMPLS_INTO):
        for name, impl in list(table.items()):
            def recording(*args, _name=name, _impl=impl, **kwargs):
                calls.append(_name)
                return _impl(*args, **kwargs)
            monkeypatch.setitem(table, name, recording)
    return calls


@pytest.mark.parametrize("device", torch_devices())
def test_direct_call_matches_the_op(device, direct_calls):
    q, k, v = qkv(device)
    args = (q, k, v, 0.3, 0.2, True, -1, -1, 0.0, None, rng_state(device))
    direct = _torch_ops.call("fwd", *args)
    assert direct_calls == ["fwd"]
    via_op = torch.ops.flashattn.fwd(*args)
    for a, b in zip(direct, via_op):
        assert torch.equal(a, b)
    # Forward and backward of the autograd function run directly, with the op's gradients.
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flashattn.flash_attn_func(qg, kg, vg, causal=True).float().sum().backward()
    assert direct_calls == ["fwd", "fwd", "bwd"]
    out, lse, _ = torch.ops.flashattn.fwd(q, k, v, 0.0, q.shape[-1] ** -0.5, True, -1, -1, 0.0, None, None)
    dq, dk, dv, _ = torch.ops.flashattn.bwd(torch.ones_like(out), q, k, v, out, lse, 0.0, q.shape[-1] ** -0.5,
                                            True, -1, -1, 0.0, None, False, None)
    for got, want in ((qg.grad, dq), (kg.grad, dk), (vg.grad, dv)):
        assert torch.equal(got, want)


def test_direct_call_bumps_the_versions_of_mutated_caches(direct_calls):
    q, k, v = qkv("cpu", sq=1, sk=2)
    k_cache, v_cache = torch.zeros(2, 16, 2, 32, dtype=q.dtype), torch.zeros(2, 16, 2, 32, dtype=q.dtype)
    versions = (k_cache._version, v_cache._version)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens)
    assert direct_calls == ["fwd_kvcache"]
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    assert torch.equal(k_cache[0, 3:5], k[0]) and torch.equal(v_cache[1, 5:7], v[1])


def test_direct_calls_make_softmax_lse_only_when_it_is_returned(monkeypatch):
    """A flash_attn_* call that does not return softmax_lse gives the core no lse tensor (nothing
    allocated, nothing written), with the same out; asked for, the lse is the op's."""
    q, k, v = qkv("cpu", sq=3, sk=40)
    seqlens = torch.tensor([17, 40], dtype=torch.int32)
    lse_given = []
    for name in ("forward", "forward_kvcache"):
        real = getattr(_torch_ops._C, name)

        def recording(*args, _real=real, **kwargs):
            lse_given.append(args[4] is not None)
            return _real(*args, **kwargs)
        monkeypatch.setattr(_torch_ops._C, name, recording)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    q_packed, k_packed, v_packed = (t[:, :3].reshape(-1, *t.shape[2:]) for t in (q, k, v))
    calls = [
        lambda lse: flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, return_softmax_lse=lse),
        lambda lse: flashattn.flash_attn_func(q, k, v, return_attn_probs=lse),
        lambda lse: flashattn.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu, cu, 3, 3,
                                                     return_softmax_lse=lse),
    ]
    for fn in calls:
        lse_given.clear()
        out = fn(False)
        with_lse = fn(True)
        assert lse_given == [False, True]
        assert torch.equal(out, with_lse[0])
    out, lse = flashattn.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, return_softmax_lse=True)
    want = torch.ops.flashattn.fwd_kvcache(q, k, v, None, None, seqlens, None, None, None, None, None,
                                           q.shape[-1] ** -0.5, False, -1, -1, 0.0, True, 0)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_the_op_serves_everything_else(direct_calls):
    """Tensors autograd tracks (with gradients on), FakeTensor, the profiler and torch.compile go
    through torch.ops.flashattn, never the direct path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = qkv("cpu")
    args = (0.0, 0.2, False, -1, -1, 0.0, None, None)
    with pytest.raises(RuntimeError):  # no autograd formula on the raw op: refused, not run untracked
        _torch_ops.call("fwd", q.clone().requires_grad_(), k, v, *args)[0].sum().backward()
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, _, _ = _torch_ops.call("fwd", fq, fk, fv, *args)
        assert out.shape == (2, 19, 4, 32)
    with torch.profiler.profile() as prof:
        flashattn.flash_attn_func(q, k, v)
    assert any(e.name.startswith("flashattn::fwd") for e in prof.events())
    compiled = torch.compile(lambda q, k, v: flashattn.flash_attn_func(q, k, v), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), flashattn.flash_attn_func(q, k, v))
    assert direct_calls == ["fwd"]  # only the last, eager call


def test_kvcache_direct_path_decides_as_direct_call_allowed(monkeypatch):
    """call_fwd_kvcache_into (flash_attn_with_kvcache's call) tests only some of its arguments:
    it runs the implementation directly exactly where direct_call_allowed lets all of them
    through, and leaves everything else to call_into (which tests them all), for each tensor
    argument made a subclass, put on the meta device or made to require grad (gradients on and
    off), and under modes, the profiler and out=. Values other than plain bool/int/float/str for
    causal, softcap and rotary_interleaved (tensors, NumPy scalars), which the caller passes as
    they are, always go to call_into."""
    import contextlib

    import numpy as np
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    taken = []
    monkeypatch.setitem(_torch_ops._IMPLS_INTO, "fwd_kvcache",
                        lambda *args, need_lse: taken.append("direct") or ("out", None))
    monkeypatch.setattr(_torch_ops, "call_into", lambda *args, need_lse: taken.append("call_into") or ("out", None))
    t = lambda *shape: torch.zeros(shape)  # noqa: E731
    base = [t(1, 1, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 1, 2, 8), t(1, 1, 2, 8), t(1), t(4, 4), t(4, 4),
            t(1), t(1, 1), t(2), 0.25, True, -1, -1, 0.0, True, 0, t(1), t(2)]
    tensor_slots = [i for i, a in enumerate(base) if isinstance(a, torch.Tensor)]
    variants = [list(base)]
    for i in tensor_slots:
        for value in (None, torch.nn.Parameter(base[i].clone(), requires_grad=False), base[i].to("meta"),
                      base[i].clone().requires_grad_()):
            if i > 2 or value is not None:  # (q, k_cache and v_cache are never None)
                variants.append(base[:i] + [value] + base[i + 1:])
    for i in (12, 15, 16):  # causal, softcap, rotary_interleaved
        for value in (torch.tensor(1.0), torch.tensor(1.0, requires_grad=True), torch.tensor(1.0, device="meta"),
                      np.float64(1.0), 1, "x"):
            variants.append(base[:i] + [value] + base[i + 1:])

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def check_all():
        for args in variants:
            want = _torch_ops.direct_call_allowed(tuple(args))
            taken.clear()
            assert _torch_ops.call_fwd_kvcache_into(None, *args, need_lse=False) == ("out", None)
            plain = all(type(args[i]) in (bool, int, float, str) for i in (12, 15, 16))
            assert taken == ["direct" if want and plain else "call_into"], args

    for context in (contextlib.nullcontext, torch.no_grad, Functions, Dispatch, torch.profiler.profile):
        with context():
            check_all()
    torch.func.vmap(lambda x: (check_all(), x)[1])(torch.zeros(1))  # (a functorch transform)
    # out= always goes to call_into, which writes it.
    taken.clear()
    _torch_ops.call_fwd_kvcache_into(t(1, 1, 2, 8), *base, need_lse=True)
    assert taken == ["call_into"]


# --- shared Options (flashattn._common.shared_options) -------------------------------------------


def test_shared_options_one_object_per_distinct_values():
    from flashattn._common import shared_options

    a = shared_options(0.125, True, -1, 0, 0.0, num_threads=1)
    assert shared_options(0.125, True, -1, 0, 0.0, num_threads=1) is a
    others = [shared_options(0.125, False, -1, 0, 0.0, num_threads=1),
              shared_options(0.25, True, -1, 0, 0.0, num_threads=1),
              shared_options(0.125, True, -1, 0, 30.0, num_threads=1),
              shared_options(0.125, True, -1, 0, 0.0, num_threads=1, num_splits=2),
              shared_options(0.125, True, -1, 0, 0.0, num_threads=2)]
    assert all(o is not a for o in others) and len({id(o) for o in others}) == len(others)
    assert (a.softmax_scale, a.causal, a.window_left, a.window_right, a.softcap, a.num_threads) == (
        0.125, True, -1, 0, 0.0, 1)
    # Equal values of other types (True == 1 == 1.0) are separate entries: the int checks refuse
    # a bool or a float however often the int has been seen.
    with pytest.raises(TypeError, match="num_splits"):
        shared_options(0.125, True, -1, 0, 0.0, num_threads=1, num_splits=True)
    with pytest.raises(TypeError, match="num_splits"):
        shared_options(0.125, True, -1, 0, 0.0, num_threads=1, num_splits=1.0)
    with pytest.raises(TypeError, match="softcap"):
        shared_options(0.125, True, -1, 0, "1", num_threads=1)
    # Values that are not plain scalars (they may change in place) get a new object each time.
    cap = torch.tensor(30.0)
    first = shared_options(0.125, True, -1, 0, cap, num_threads=1)
    assert first.softcap == 30.0 and shared_options(0.125, True, -1, 0, cap, num_threads=1) is not first


def test_calls_with_different_options_do_not_share_them():
    """Interleaved calls with different options each get their own, and a cached one gives the
    same results as the first call that made it; the calls leave the shared object unchanged."""
    from flashattn._common import shared_options

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 4, 32, generator=g)
    k_cache, v_cache = torch.randn(2, 40, 2, 32, generator=g), torch.randn(2, 40, 2, 32, generator=g)
    seqlens = torch.tensor([17, 40], dtype=torch.int32)
    calls = [dict(causal=True), dict(causal=False, softcap=5.0), dict(window_size=(4, 0)), dict(softmax_scale=0.5)]
    first = [flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kw) for kw in calls]
    for i in range(len(first)):
        for j in range(i):
            assert not torch.equal(first[i], first[j])
    for _ in range(2):
        for kw, want in zip(calls, first):
            assert torch.equal(flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **kw),
                               want)
    opt = shared_options(32 ** -0.5, True, -1, 0, 0.0, 0.0, False, torch.get_num_threads(), 0, 0, 0)
    flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    assert (opt.softmax_scale, opt.causal, opt.window_left, opt.window_right, opt.softcap, opt.dropout_p,
            opt.num_splits) == (pytest.approx(32 ** -0.5), True, -1, 0, 0.0, 0.0, 0)


# --- flash_attn_func / flash_attn_varlen_func without autograd history ---------------------------


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_calls_autograd_does_not_record_match_the_autograd_function(dropout_p, direct_calls):
    """Without anything for autograd to record, the functions run the forward op alone: the same
    values (the same dropout seeds drawn) as through their autograd functions."""
    q, k, v = qkv("cpu", d=20)  # a head dim that is padded
    cu = torch.tensor([0, 19, 38], dtype=torch.int32)
    packed = [t.reshape(-1, *t.shape[2:]) for t in qkv("cpu", sq=19, sk=19, d=20)]

    def both():
        torch.manual_seed(3)
        out = flashattn.flash_attn_func(q, k, v, dropout_p, causal=True, return_attn_probs=True)
        varlen = flashattn.flash_attn_varlen_func(*packed, cu, cu, 19, 19, dropout_p, causal=True,
                                                  return_attn_probs=True)
        return out[:2] + varlen[:2]

    with torch.no_grad():
        plain = both()
    assert direct_calls == ["fwd", "varlen_fwd"]
    q.requires_grad_(), packed[0].requires_grad_()
    recorded = both()  # through the autograd functions (then also run directly)
    assert recorded[0].requires_grad and recorded[2].requires_grad
    for a, b in zip(plain, recorded):
        assert a.shape == b.shape and torch.equal(a, b.detach())
    assert plain[0].shape[-1] == 20 and not plain[0].requires_grad


def test_the_autograd_function_still_serves_forward_ad_and_functorch():
    import torch.autograd.forward_ad as fwAD

    q, k, v = qkv("cpu")
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            flashattn.flash_attn_func(dual, k, v)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.vmap(lambda q: flashattn.flash_attn_func(q, k, v))(q.unsqueeze(0).expand(2, -1, -1, -1, -1))
