"""Framework-free helpers shared by the PyTorch and NumPy layers: argument normalisation and the
Options struct of the C++ core."""

from __future__ import annotations

import math

from flashattn import _C

# The core's rule for caller-owned workspace (SPEC §4): the pointer must be a multiple of this.
WORKSPACE_ALIGNMENT = 256

# Head dims that are not a multiple of this are zero-padded up to it (the kernels' rule, SPEC §1);
# the padding changes neither scores nor outputs, and is sliced off the results.
HEAD_DIM_MULTIPLE = 8


def padded_head_dim(d: int) -> int:
    return -(-d // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """1/sqrt(d) of the caller's head dim (before any padding) unless given."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    return float(softmax_scale)


def window_pair(window_size) -> tuple[int, int]:
    """(left, right) from the reference API's window_size tuple; -1 means unbounded."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise _C.Error(
            f"window_size: must be a pair (left, right) of ints ≥ -1; got {window_size!r}"
        ) from None
    return int(left), int(right)


def make_options(
    *,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    num_threads: int = 0,
    num_splits: int = 0,
) -> _C.Options:
    opt = _C.Options()
    opt.softmax_scale = float(softmax_scale)
    opt.causal = bool(causal)
    opt.window_left = int(window_left)
    opt.window_right = int(window_right)
    opt.softcap = float(softcap)
    opt.dropout_p = float(dropout_p)
    opt.deterministic = bool(deterministic)
    opt.num_threads = int(num_threads)
    opt.num_splits = int(num_splits)
    return opt


def check_dropout_p(dropout_p) -> float:
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise _C.Error(f"dropout_p: dropout probability must be in [0, 1); got {dropout_p}")
    return p


def check_no_leftpad(cache_leftpad) -> None:
    if cache_leftpad is not None:
        raise NotImplementedError(
            "cache_leftpad: left-padded KV caches are not supported by flashattn; "
            "shift each sequence to the start of its cache row instead"
        )
