"""Framework-free helpers shared by the PyTorch and NumPy layers: argument normalisation and the
Options struct of the C++ core."""

from __future__ import annotations

import atexit
import functools
import math
import operator

from flashattn import _C

# The core's rule for caller-owned workspace (SPEC §4): the pointer must be a multiple of this.
WORKSPACE_ALIGNMENT = 256

# Head dims that are not a multiple of this are zero-padded up to it (the kernels' rule, SPEC §1);
# the padding changes neither scores nor outputs, and is sliced off the results.
HEAD_DIM_MULTIPLE = 8


def padded_head_dim(d: int) -> int:
    return -(-d // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


# The core's integer arguments are C++ ints (int32): larger Python ints are refused here with
# the argument's name, instead of by the binding's overload resolution.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_HEAD_DIM = 256
# The axes of each kind of attention input, for messages.
BATCH_LAYOUT = "(batch, seqlen, nheads, headdim)"
VARLEN_LAYOUT = "(total_tokens, nheads, headdim)"
KVCACHE_LAYOUT = "(batch, seqlen, nheads, headdim) (paged cache: (num_blocks, page_size, nheads_k, headdim))"
PAGED_LAYOUT = "(num_blocks, page_size, nheads_k, headdim) (a paged cache, with block_table)"


def int_arg(name: str, value, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """value as a Python int in [lo, hi]: an int, a NumPy integer or anything with __index__
    (a 0-d integer tensor); not a bool, a float or a string."""
    # The common case first (a plain int in range; bool is a subclass, not the type itself): the
    # checks below cost a microsecond per argument on every call.
    if type(value) is int and lo <= value <= hi:
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = operator.index(value)
    if not lo <= v <= hi:
        raise _C.Error(f"{name}: must be an int in [{lo}, {hi}]; got {v}")
    return v


def float_arg(name: str, value) -> float:
    """value as a Python float: a real number (int, float, NumPy scalar, 0-d tensor), not a
    string."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None


def check_rank(name: str, shape, rank: int, layout: str) -> None:
    """flashattn.Error (a ValueError and a RuntimeError) naming the tensor when its rank is not
    `rank` (layout: the expected axes)."""
    if len(shape) != rank:
        raise _C.Error(f"{name}: must be {layout} (rank {rank}); got shape {tuple(shape)}")


def check_head_dim(name: str, head_dim: int) -> None:
    """The caller's head dim, before padding to a multiple of 8: 1 to 256."""
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _C.Error(
            f"{name}: head dimension (last axis) must be in [1, {MAX_HEAD_DIM}] (padded to a multiple "
            f"of {HEAD_DIM_MULTIPLE}); got {head_dim}"
        )


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """1/sqrt(d) of the caller's head dim (before any padding) when None; otherwise a finite
    number > 0. (The core reads 0 as "the default": here None says that, and an explicit 0, a
    negative or a non-finite scale is an error rather than a silent default.)"""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float_arg("softmax_scale", softmax_scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise _C.Error(
            f"softmax_scale: must be a finite number > 0 (None: 1/sqrt(headdim)); got {softmax_scale!r}"
        )
    return scale


def window_pair(window_size) -> tuple[int, int]:
    """(left, right) from the reference API's window_size tuple; -1 means unbounded."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise _C.Error(
            f"window_size: must be a pair (left, right) of ints ≥ -1; got {window_size!r}"
        ) from None
    return int_arg("window_size[0]", left), int_arg("window_size[1]", right)


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
    dropout_row_offset: int = 0,
    dropout_col_offset: int = 0,
) -> _C.Options:
    opt = _C.Options()
    opt.softmax_scale = float(softmax_scale)
    opt.causal = bool(causal)
    opt.window_left = int(window_left)
    opt.window_right = int(window_right)
    opt.softcap = float_arg("softcap", softcap)
    opt.dropout_p = float(dropout_p)
    opt.deterministic = bool(deterministic)
    opt.num_threads = int(num_threads)
    opt.num_splits = int_arg("num_splits", num_splits)
    # Where the call's rows and keys sit in a longer sequence whose dropout mask it draws
    # (docs/dropout.md); the core refuses values that are not whole 16×16 blocks in [0, 2^30].
    opt.dropout_row_offset = int_arg("dropout_row_offset", dropout_row_offset, INT64_MIN, INT64_MAX)
    opt.dropout_col_offset = int_arg("dropout_col_offset", dropout_col_offset, INT64_MIN, INT64_MAX)
    return opt


# The argument types whose values alone decide make_options' result and errors (with the type).
_PLAIN_SCALARS = frozenset((bool, int, float))


# typed=True keys on each argument's type as well as its value, so that True, 1 and 1.0 (equal
# and of one hash) do not share an entry: int_arg refuses a bool or a float where the int passes.
# (0.0 and -0.0 do share one; the core reads them alike.) Failed calls are not cached: each raises.
@functools.lru_cache(maxsize=256, typed=True)
def _cached_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic,
                    num_threads, num_splits, dropout_row_offset, dropout_col_offset) -> _C.Options:
    return make_options(
        softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, dropout_p=dropout_p, deterministic=deterministic, num_threads=num_threads,
        num_splits=num_splits, dropout_row_offset=dropout_row_offset, dropout_col_offset=dropout_col_offset,
    )


# shared_options' objects for the arguments of the types the flash_attn_* functions pass (float
# softmax_scale, softcap and dropout_p, bool causal and deterministic, int others), by their values
# alone: with the types fixed, the values tell the entries apart. shared_options then costs 0.5 µs
# per call against 0.87 µs through the test of each argument's type in _PLAIN_SCALARS and the
# lru_cache's typed key (a 2-core CPU host, where a decoding step's Python besides its C++ call is
# about 10 µs). Emptied when it reaches the lru_cache's size (a NaN, never equal to itself, adds
# an entry on each call).
_SHARED_OPTIONS: dict = {}
_SHARED_OPTIONS_MAX = 256

# Both emptied at exit, before the extension is torn down: nanobind reports the instances of its
# classes that are still alive then as leaks.
atexit.register(_cached_options.cache_clear)
atexit.register(_SHARED_OPTIONS.clear)


def shared_options(softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0, deterministic=False,
                   num_threads=0, num_splits=0, dropout_row_offset=0, dropout_col_offset=0) -> _C.Options:
    """make_options (the same checks and errors) for callers that never modify the result: one
    Options object per distinct tuple of plain bool/int/float arguments, shared by every call that
    passes it. Building an Options costs microseconds per call (eleven attribute writes through the
    binding and the int checks), as much as the rest of a decoding step's Python. The C++ entry
    points take it by const reference and copy it before adding the call's tensors
    (python/src/flashattn_ext.cpp, with_tensors), so a shared one is never written. Other argument
    types (a NumPy scalar, a 0-d tensor, whose value may change in place) get a new object."""
    values = (softmax_scale, causal, window_left, window_right, softcap, dropout_p, deterministic, num_threads,
              num_splits, dropout_row_offset, dropout_col_offset)
    if (type(softmax_scale) is float and type(causal) is bool and type(window_left) is int
            and type(window_right) is int and type(softcap) is float and type(dropout_p) is float
            and type(deterministic) is bool and type(num_threads) is int and type(num_splits) is int
            and type(dropout_row_offset) is int and type(dropout_col_offset) is int):
        opt = _SHARED_OPTIONS.get(values)
        if opt is None:
            opt = _cached_options(*values)  # (raises for values make_options refuses: nothing is kept)
            if len(_SHARED_OPTIONS) >= _SHARED_OPTIONS_MAX:
                _SHARED_OPTIONS.clear()
            _SHARED_OPTIONS[values] = opt
        return opt
    for x in values:
        if type(x) not in _PLAIN_SCALARS:
            return make_options(
                softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
                softcap=softcap, dropout_p=dropout_p, deterministic=deterministic, num_threads=num_threads,
                num_splits=num_splits, dropout_row_offset=dropout_row_offset,
                dropout_col_offset=dropout_col_offset,
            )
    return _cached_options(*values)


def check_dropout_p(dropout_p) -> float:
    p = float_arg("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise _C.Error(f"dropout_p: dropout probability must be in [0, 1); got {dropout_p}")
    return p


def check_out_layout(out, shape, dtype) -> None:
    """out= of a flash_attn_* function (PyTorch or NumPy): the result's shape and q's dtype,
    checked before anything runs, so that a refused out is never written."""
    if tuple(out.shape) != tuple(shape):
        raise _C.Error(f"out: wrong shape; expected {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise _C.Error(f"out: must have q's dtype; expected {dtype}, got {out.dtype}")
