"""flashattn.bert_padding — the module ``flash_attn.bert_padding`` of the ``flash_attn`` 2.x
package: between padded batches (batch, seqlen, ...) with an attention mask and the packed rows
(total, ...) plus cu_seqlens that the varlen functions take.

    hidden, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)

Everything is differentiable (gather and scatter along the first axis) and runs on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input, indices):
    """input (n, ...) -> input[indices] (len(indices), ...); the gradient scatters back."""
    return torch.index_select(input, 0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """values (len(indices), ...) -> (first_axis_dim, ...) zeros with values at rows indices."""
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_copy(0, indices, values)


def _cu_seqlens(seqlens):
    """(batch,) lengths -> (batch + 1,) int32 prefix sums starting at 0."""
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def _flat_rows(hidden_states):
    """(batch, seqlen, ...) -> (batch·seqlen, ...)."""
    return hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...); attention_mask (batch, seqlen), nonzero = a token;
    unused_mask (batch, seqlen), nonzero = a slot that is kept in the packed rows but not used
    (counted in cu_seqlens, not in seqused).

    Returns (hidden_states (total, ...), indices (total,) int64 into the flattened batch·seqlen
    rows, cu_seqlens (batch + 1,) int32, max_seqlen_in_batch int, seqused (batch,) int32: the
    tokens of each sequence that attention_mask selects) — flash_attn's 5-tuple."""
    selected = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return (index_first_axis(_flat_rows(hidden_states), indices), indices, _cu_seqlens(seqlens),
            max_seqlen, seqused)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Rows that each hold several sequences back to back. attention_mask_in_length (batch,
    seqlen): row b lists the lengths of its sequences, in order, followed by zeros — e.g.
    [2, 3, 0, 0, 0] is a sequence at positions 0-1 and one at 2-4.

    Returns (hidden_states (total, ...), indices (total,), cu_seqlens (number of sequences + 1,)
    int32 over all sequences of all rows, max_seqlen_in_batch int)."""
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    used = lengths.sum(dim=-1)
    positions = torch.arange(seqlen, device=lengths.device)
    mask = positions.unsqueeze(0) < used.unsqueeze(1)  # (batch, seqlen)
    flat = lengths.flatten()
    seqlens = flat[flat != 0].to(torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return index_first_axis(_flat_rows(hidden_states), indices), indices, _cu_seqlens(seqlens), max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (total, ...) at rows indices of the flattened batch -> (batch, seqlen, ...),
    zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))
