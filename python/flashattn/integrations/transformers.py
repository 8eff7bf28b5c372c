"""flashattn.integrations.transformers — flashattn as an attention backend of Hugging Face
transformers (5.x), under the name "flashattn":

    import flashattn.integrations.transformers  # registers "flashattn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashattn")

Importing the module registers `attention_forward` with transformers' AttentionInterface and, for
the masks, transformers' flash-attention mask (None for a full causal batch, else the 2-D padding
mask) with AttentionMaskInterface; `register(name)` does it under another name. Because the name
contains "flash", transformers treats it as a FlashAttention backend (2-D padding masks, the
sequence boundaries of packed batches) and loads a FlashAttention kernel's functions for it when
a model is built: for this name its loader is made to return flashattn's (_serve_flash_loader).
Written against transformers 5.23 (the version scripts/test-python pins).

What a call does, in transformers' order of precedence:
- a padding mask (batch, kv_len): the rows are unpacked (flashattn.bert_padding) and attended by
  sequence with flash_attn_varlen_func, then padded back (padding rows are zero);
- cu_seq_lens_q/k with max_length_q/k (a padding-free collator), or position_ids of a single row
  that restart (packed sequences): flash_attn_varlen_func over those sequences;
- otherwise flash_attn_func over the batch.
causal follows the module (is_causal), sliding_window w means a window of w - 1 keys back (and
ahead, without causal), softcap > 0 soft-caps, dropout is transformers' (0 outside training).
Float32 inputs on CUDA (which has no fp32 kernels) are computed in bfloat16 (or the autocast
dtype) and returned in float32. Continuous batching (generate_batch, whose calls carry transformers'
paged cache) goes through transformers' own FlashAttention path, which the loader hook makes run
on flashattn's flash_attn_varlen_func / flash_attn_with_kvcache. Attention sinks (s_aux, gpt-oss:
one logit per head in each row's softmax denominator, docs/sinks.md) go to flashattn's own
functions as sinks=, with their gradient; in continuous batching transformers passes them as s_aux
to the served varlen and KV-cache functions, which take that keyword (vLLM's). (transformers 5.23 sends models that list their own FlashAttention kernels,
gpt-oss among them, to the first of those instead of a backend it does not list: such a model
reaches this function only when that list is bypassed.) Attention weights are never returned
(None).
"""

from __future__ import annotations

import torch
import transformers.modeling_flash_attention_utils as _hf_flash
from transformers import AttentionInterface
from transformers.integrations.flash_attention import flash_attention_forward as _hf_flash_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import flashattn
from flashattn.bert_padding import pad_input, unpad_input
from flashattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["NAME", "attention_forward", "register"]

NAME = "flashattn"


def _packed_batch(kwargs, batch, length):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a padding-free batch: as
    transformers passes them (cu_seq_lens_q/k, max_length_q/k), else from position_ids of a single
    row that restart at each sequence's start; None for an ordinary batch."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if all(kwargs.get(name) is not None for name in names):
        cu_q, cu_k, max_q, max_k = (kwargs[name] for name in names)
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or batch != 1 or length == 1:
        return None
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == positions.min()).flatten()
    if starts.numel() <= 1:
        return None
    total = torch.tensor([positions.numel()], device=positions.device)
    cu_seqlens = torch.cat([starts, total]).to(torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return cu_seqlens, cu_seqlens, longest, longest


def _compute_dtype(query):
    if query.dtype != torch.float32 or query.device.type != "cuda":
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return torch.bfloat16


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention-function contract: query (batch, heads, q_len, d), key/value
    (batch, kv_heads, kv_len, d/dv) -> (out (batch, q_len, heads, dv), None)."""
    if kwargs.get("cache") is not None:  # continuous batching: transformers' paged path, on flashattn's functions
        # (which take the sinks as s_aux, the keyword transformers passes where a kernel's signature has it)
        return _hf_flash_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, s_aux=s_aux,
                                 **kwargs)
    batch, q_len = query.shape[0], query.shape[2]
    dtype = _compute_dtype(query)
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))  # (batch, len, heads, d)
    causal = module.is_causal if is_causal is None else bool(is_causal)
    # A sliding window of w sees w - 1 keys back (and, without causal, w - 1 ahead), as in
    # transformers' own FlashAttention path.
    reach = sliding_window - 1 if sliding_window is not None else -1
    common = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal,
                  window_size=(reach, 0 if causal else reach), softcap=softcap or 0.0)
    attend, attend_varlen = flash_attn_func, flash_attn_varlen_func
    if s_aux is not None:  # flashattn's own functions take the sinks (flash_attn's have none)
        attend, attend_varlen = flashattn.flash_attn_func, flashattn.flash_attn_varlen_func
        common["sinks"] = s_aux

    if attention_mask is not None:  # (batch, kv_len) bool: True where a token is
        q_mask = attention_mask[:, -q_len:]
        q_rows, q_index, cu_q, max_q, _ = unpad_input(q, q_mask)
        k_rows, _, cu_k, max_k, _ = unpad_input(k, attention_mask)
        v_rows = unpad_input(v, attention_mask)[0]
        out = attend_varlen(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k, **common)
        out = pad_input(out, q_index, batch, q_len)
    elif (packed := _packed_batch(kwargs, batch, q_len)) is not None:
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        out = attend_varlen(*flat, *packed, **common)
        out = out.view(batch, q_len, *out.shape[1:])
    else:
        out = attend(q, k, v, **common)
    return out.to(query.dtype), None


_FUNCTIONS = (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input)


def _serve_flash_loader(name):
    """transformers takes every implementation whose name contains "flash" for a FlashAttention
    kernel and, when a model is built, loads that kernel's flash_attn_func / varlen / kvcache and
    pad/unpad functions through modeling_flash_attention_utils._lazy_imports (a name it does not
    know is looked up on the kernels hub, and fails). The loader is wrapped once so that for the
    registered names it returns flashattn's functions, which have flash_attn's signatures."""
    loader = _hf_flash._lazy_imports
    names = getattr(loader, "flashattn_names", None)
    if names is None:
        names = set()

        def lazy_imports(implementation, *args, **kwargs):
            if implementation in names:
                return _FUNCTIONS
            return loader(implementation, *args, **kwargs)

        lazy_imports.flashattn_names = names
        _hf_flash._lazy_imports = lazy_imports
    names.add(name)


def register(name=NAME):
    """Registers attention_forward and the flash-attention mask under `name`."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    if "flash" in name:
        _serve_flash_loader(name)


register()
