"""flashattn as transformers' attention backend ("flashattn"): a small Llama-style model built from
a config (random weights, nothing downloaded) against the same model on "sdpa" — logits and
parameter gradients of a full batch, a left-padded batch and a packed (padding-free) row."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/python-pins.sh pins it)")

import flashattn.integrations.transformers as fa_hf  # noqa: E402

from conftest import torch_devices  # noqa: E402


SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def tiny_model(implementation, device, config_class, dtype=torch.float32, **extra):
    config = config_class(**SIZES, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.to(device=device, dtype=dtype)


def pair(device, config_class=transformers.LlamaConfig, dtype=torch.float32, **extra):
    """A small model built from a config, with the same weights on "flashattn" and on "sdpa"."""
    ours = tiny_model(fa_hf.NAME, device, config_class, dtype, **extra)
    sdpa = tiny_model("sdpa", device, config_class, dtype, **extra)
    sdpa.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == fa_hf.NAME and sdpa.config._attn_implementation == "sdpa"
    return ours, sdpa


def loss(logits, labels_mask=None):
    """A loss that weighs every logit differently, over the positions labels_mask keeps."""
    weights = torch.linspace(-1.0, 1.0, logits.shape[-1], device=logits.device)
    per_token = (logits * weights).sum(-1)
    return (per_token if labels_mask is None else per_token * labels_mask).sum()


def gradients(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def run(model, labels_mask=None, **inputs):
    """Logits and the parameter gradients of loss()."""
    model.zero_grad()
    logits = model(**inputs).logits
    loss(logits, labels_mask).backward()
    return logits.detach(), gradients(model)


def assert_same(ours, sdpa, keep=None):
    """Logits and gradients as sdpa's, in float32 — or, on CUDA, where the float32 model's
    attention runs in bfloat16 (no fp32 kernels), within bfloat16's error: simulated on the CPU,
    that attention moves these logits by up to 2e-3 and each gradient by up to 0.5% of its
    largest entry, so the bounds are 1e-2 and 2%."""
    (logits, grads), (ref_logits, ref_grads) = ours, sdpa
    if keep is not None:
        logits, ref_logits = logits[keep], ref_logits[keep]
    bf16 = logits.device.type == "cuda"
    tol = 1e-2 if bf16 else 1e-4
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
    for name, grad in grads.items():
        ref = ref_grads[name]
        atol = 2e-2 * float(ref.abs().max()) if bf16 else 1e-5
        torch.testing.assert_close(grad, ref, rtol=2e-2 if bf16 else 1e-3, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", torch_devices())
def test_full_batch(device):
    ours, sdpa = pair(device)
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(1)).to(device)
    assert_same(run(ours, input_ids=ids), run(sdpa, input_ids=ids))


@pytest.mark.parametrize("device", torch_devices())
def test_left_padded_batch(device):
    ours, sdpa = pair(device)
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :11] = 0
    keep = mask.bool()
    got = run(ours, labels_mask=mask, input_ids=ids, attention_mask=mask)
    assert torch.all(torch.isfinite(got[0]))
    assert_same(got, run(sdpa, labels_mask=mask, input_ids=ids, attention_mask=mask), keep)


@pytest.mark.parametrize("device", torch_devices())
def test_packed_sequences(device):
    """Three sequences in one row, position_ids restarting at each (padding-free training): the
    same logits and gradients as sdpa over each sequence on its own."""
    ours, sdpa = pair(device)
    lengths = [7, 12, 5]
    ids = torch.randint(0, 96, (1, sum(lengths)), generator=torch.Generator().manual_seed(3)).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    got = run(ours, input_ids=ids, position_ids=positions)
    sdpa.zero_grad()
    logits, start = [], 0
    for n in lengths:  # the gradients of the separate sequences add up
        part = sdpa(input_ids=ids[:, start:start + n]).logits
        loss(part).backward()
        logits.append(part.detach())
        start += n
    assert_same(got, (torch.cat(logits, dim=1), gradients(sdpa)))

    # The boundaries as a padding-free collator passes them (cu_seq_lens_q/k, max_length_q/k).
    cu_seqlens = torch.tensor([0, 7, 19, 24], dtype=torch.int32, device=device)
    with torch.no_grad():
        explicit = ours(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                        max_length_q=12, max_length_k=12).logits
    torch.testing.assert_close(explicit, got[0], rtol=0, atol=0)


@pytest.mark.parametrize("device", torch_devices())
def test_sliding_window(device):
    """A Mistral-style model whose sliding window (6) is shorter than the sequence."""
    ours, sdpa = pair(device, transformers.MistralConfig, sliding_window=6)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(5)).to(device)
    assert_same(run(ours, input_ids=ids), run(sdpa, input_ids=ids))


def assert_greedy(sdpa, prompt, generated):
    """generated (a list of token ids) continues prompt (1, n) as sdpa's greedy decoding does: on
    the CPU (float32 throughout) token for token as sdpa.generate gives them; on CUDA, where
    flashattn computes in bfloat16 and two logits may lie closer than its error, each token is one
    whose logit in sdpa's forward over the whole sequence is within 0.05 of the largest (the
    greedy choice up to bfloat16's error: simulated, these logits move by up to 2e-3), 0.1 for a
    bfloat16 model (bfloat16's spacing at these logits is 0.008, and each layer rounds)."""
    if prompt.device.type == "cpu":
        config = transformers.GenerationConfig(max_new_tokens=len(generated), do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)
        assert sdpa.generate(prompt, generation_config=config)[0, prompt.shape[1]:].tolist() == generated
        return
    tokens = torch.cat([prompt[0], torch.tensor(generated, device=prompt.device)]).unsqueeze(0)
    logits = sdpa(input_ids=tokens).logits[0, prompt.shape[1] - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(generated, device=prompt.device).unsqueeze(1)).squeeze(1)
    tol = 0.05 if sdpa.dtype == torch.float32 else 0.1
    assert torch.all(chosen >= logits.max(dim=1).values - tol), (generated, logits.argmax(dim=1).tolist())


@pytest.mark.parametrize("device", torch_devices())
def test_generate_matches_sdpa(device):
    """Greedy decoding with a KV cache (a query of one token over the cached keys)."""
    ours, sdpa = pair(device)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(4)).to(device)
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(ids, generation_config=config)
        for i in range(ids.shape[0]):
            assert_greedy(sdpa, ids[i:i + 1], got[i, ids.shape[1]:].tolist())


@pytest.mark.parametrize("device", torch_devices())
def test_continuous_batching(device):
    """transformers' continuous batching (generate_batch, a paged cache): its FlashAttention path,
    run on flashattn's functions, gives each prompt the tokens sdpa's greedy generate gives it. On
    CUDA the model is bfloat16: transformers passes the paged cache to the attention in the
    model's dtype, and the CUDA kernels take fp16/bf16 only."""
    ours, sdpa = pair(device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    if "page_size" not in inspect.signature(transformers.ContinuousBatchingConfig).parameters:
        pytest.skip(f"transformers {transformers.__version__}: ContinuousBatchingConfig takes no page_size "
                    f"(this test follows the pinned version, scripts/python-pins.sh)")
    # A CPU model on a machine with a GPU: transformers would turn on CUDA graphs and asynchronous
    # batching (chosen by the GPU's presence, not the model's device), which a CPU model cannot take.
    cpu_only = {} if device == "cuda" else dict(use_cuda_graph=False, use_async_batching=False)
    paging = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, page_size=16, **cpu_only)
    with torch.no_grad():
        batch = ours.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=paging,
                                    warmup=False)
        for i, prompt in enumerate(prompts):
            assert_greedy(sdpa, torch.tensor([prompt], device=device), batch[f"req_{i}"].generated_tokens)


def test_sinks_match_gpt_oss_eager_attention():
    """gpt-oss passes its per-head sinks as s_aux: out and the gradients (the sinks' included) as
    transformers' eager gpt-oss attention gives them, which concatenates the sink to the scaled
    logits. (A gpt-oss model built with attn_implementation="flashattn" is redirected by
    transformers to the FlashAttention kernels it lists for that model; the attention function is
    what it would call.)"""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(7)
    b, h, hk, n, d = 2, 4, 2, 11, 16
    query, key, value = (torch.randn(b, heads, n, d, generator=g).requires_grad_() for heads in (h, hk, hk))
    sinks = (torch.randn(h, generator=g) * 2).requires_grad_()
    module = SimpleNamespace(is_causal=True, num_key_value_groups=h // hk, sinks=sinks, training=False)
    scaling = d ** -0.5
    causal_mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
    want, _ = eager_attention_forward(module, query, key, value, causal_mask, scaling)
    got, weights = fa_hf.attention_forward(module, query, key, value, None, scaling=scaling, s_aux=sinks)
    assert weights is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dout = torch.randn(want.shape, generator=g)
    grads_want = torch.autograd.grad(want, (query, key, value, sinks), dout)
    grads_got = torch.autograd.grad(got, (query, key, value, sinks), dout)
    for name, a, w in zip(("query", "key", "value", "sinks"), grads_got, grads_want):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5, msg=name)
    assert grads_got[3].abs().max() > 1e-3


def test_continuous_batching_hands_the_sinks_on():
    """Continuous batching's paged path is transformers' own FlashAttention path: it passes a
    model's sinks on as s_aux to the served varlen and KV-cache functions only where their
    signatures take that keyword — which flashattn's do."""
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    from flashattn import flash_attn_interface as fai

    sinks = torch.zeros(4)
    for fn in (fai.flash_attn_varlen_func, fai.flash_attn_with_kvcache):
        kwargs = _lazy_define_process_function(fn)(query_length=1, key_length=8, is_causal=True, s_aux=sinks)
        assert kwargs.get("s_aux") is sinks, fn.__name__
