"""flashattn.bert_padding: unpad_input's 5-tuple, pad_input, index_first_axis and
unpad_input_for_concatenated_sequences, their gradients, and a padded batch through the varlen
function equal to each sequence on its own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch tests need it")

from flashattn.bert_padding import (  # noqa: E402
    index_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from flashattn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402

from conftest import torch_devices  # noqa: E402
from torch_checks import randn  # noqa: E402

# Right-padded rows, an empty row and a full one.
MASK = [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]


@pytest.mark.parametrize("device", torch_devices())
def test_unpad_and_pad(device):
    mask = torch.tensor(MASK, device=device)
    g = torch.Generator().manual_seed(1)
    x = randn((4, 6, 3, 8), torch.float32, device, g)
    hidden, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    expected_rows = [b * 6 + s for b in range(4) for s in range(6) if MASK[b][s]]
    assert indices.tolist() == expected_rows
    assert torch.equal(hidden, x.reshape(24, 3, 8)[expected_rows])
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 3, 9, 11]
    assert max_seqlen == 6 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [3, 0, 6, 2]

    padded = pad_input(hidden, indices, 4, 6)
    assert torch.equal(padded, x * mask[:, :, None, None])

    # Gradients: through the gather and the scatter, zero at the padding.
    xg = x.clone().requires_grad_()
    weight = randn((4, 6, 3, 8), torch.float32, device, g)
    (pad_input(unpad_input(xg, mask)[0], indices, 4, 6) * weight).sum().backward()
    assert torch.equal(xg.grad, weight * mask[:, :, None, None])


@pytest.mark.parametrize("device", torch_devices())
def test_unpad_with_unused_mask(device):
    """unused_mask slots are kept in the packed rows and cu_seqlens but not in seqused."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], device=device)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], device=device)
    x = torch.arange(8.0, device=device).reshape(2, 4, 1)
    hidden, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert hidden.flatten().tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3 and seqused.tolist() == [2, 1]


@pytest.mark.parametrize("device", torch_devices())
def test_concatenated_sequences(device):
    """Row 0 holds sequences of 2 and 3 tokens, row 1 one of 4."""
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]], device=device)
    x = torch.arange(12.0, device=device).reshape(2, 6, 1)
    hidden, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert hidden.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 2, 5, 9] and max_seqlen == 4


def test_index_first_axis_gradient():
    x = torch.arange(12.0).reshape(4, 3).requires_grad_()
    idx = torch.tensor([3, 0, 3])
    out = index_first_axis(x, idx)
    assert torch.equal(out, x.detach()[[3, 0, 3]])
    out.sum().backward()
    assert x.grad[:, 0].tolist() == [1.0, 0.0, 0.0, 2.0]  # row 3 was taken twice


@pytest.mark.parametrize("device", torch_devices())
def test_padded_batch_through_varlen(device):
    """The usual path of a padded batch: unpad q, k, v, attend varlen, pad the output — each
    sequence gets what it gets alone; the padding rows are zero."""
    mask = torch.tensor(MASK, device=device)
    g = torch.Generator().manual_seed(2)
    q, k, v = (randn((4, 6, 2, 16), torch.bfloat16, device, g) for _ in range(3))
    q_u, indices, cu, max_seqlen, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_seqlen, max_seqlen, causal=True),
                    indices, 4, 6)
    for b, row in enumerate(MASK):
        n = sum(row)
        if n:
            alone = flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
            torch.testing.assert_close(out[b:b + 1, :n], alone)
        assert torch.all(out[b, n:] == 0)
