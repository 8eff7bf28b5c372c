"""A decode step captured in a CUDA graph: flash_attn_with_kvcache (append into the cache, rotary,
attention over it) replayed on new inputs gives what the eager call gives, bit for bit, and its
cache writes land. Needs a GPU and the CUDA backend; elsewhere it reports why it did not run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

import flashattn  # noqa: E402


def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("not run: no GPU (a CUDA graph needs one)")
    if "cuda" not in flashattn.compiled_backends():
        pytest.skip("not run: this build has no CUDA backend (-DFLASHATTN_CUDA=ON)")


@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_replays_like_the_eager_call(paged):
    cuda_or_skip()
    g = torch.Generator(device="cuda").manual_seed(11)
    b, h, hk, d, cap, page = 2, 8, 2, 128, 512, 16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    k_cache, v_cache = rand(b, cap, hk, d), rand(b, cap, hk, d)
    table = None
    if paged:  # the same rows as pages, in a shuffled order
        pages = cap // page
        perm = torch.randperm(b * pages, device="cuda", generator=g).to(torch.int32)
        table = perm.view(b, pages)
        k_blocks = torch.empty(b * pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
        v_blocks = torch.empty_like(k_blocks)
        k_blocks[perm.long()] = k_cache.view(b * pages, page, hk, d)
        v_blocks[perm.long()] = v_cache.view(b * pages, page, hk, d)
        k_cache, v_cache = k_blocks, v_blocks
    cos = torch.cos(torch.arange(cap, device="cuda")[:, None] * torch.arange(d // 2, device="cuda") * 1e-3)
    sin = torch.sin(torch.arange(cap, device="cuda")[:, None] * torch.arange(d // 2, device="cuda") * 1e-3)
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    # Static inputs of the graph, refilled before every replay.
    q, k_new, v_new = rand(b, 1, h, d), rand(b, 1, hk, d), rand(b, 1, hk, d)
    seqlens = torch.tensor([100, 37], dtype=torch.int32, device="cuda")

    def step():
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                                 rotary_sin=sin, cache_seqlens=seqlens, block_table=table,
                                                 causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = step()

    for lengths in ([200, 5], [511, 300]):
        q.copy_(rand(b, 1, h, d))
        k_new.copy_(rand(b, 1, hk, d))
        v_new.copy_(rand(b, 1, hk, d))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        k_graph, v_graph, out_graph = k_cache.clone(), v_cache.clone(), out_static.clone()
        k_cache.copy_(k_before)
        v_cache.copy_(v_before)
        out_eager = step()
        torch.cuda.synchronize()
        assert torch.equal(out_graph, out_eager), lengths
        assert torch.equal(k_graph, k_cache) and torch.equal(v_graph, v_cache), lengths
        assert not torch.equal(k_graph, k_before), "the append did not land"
