"""The block plans of flashattn.distributed's ring attention, without any process group: for every
rank and every K/V block of a sharded sequence, the library calls the plan makes (rows, columns,
window) must see exactly the cells of the global mask between the rank's queries and that block —
each visible cell once, no other cell — under the library's own mask rule (bottom-right aligned,
a window ≥ the call's key count unbounded; SPEC §2), written out here independently."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed: flashattn.distributed needs it")

from flashattn import distributed as fd  # noqa: E402
from reference import visible  # noqa: E402


def library_cells(call):
    """(rows, cols) bool of the cells one library call on the call's rectangle sees."""
    sq, sk = call.r1 - call.r0, call.c1 - call.c0
    left = -1 if call.wl >= sk else call.wl
    right = -1 if call.wr >= sk else call.wr
    return visible(sq, sk, left, right)


def positions(segments):
    """The global positions of a rank's tokens, in local order."""
    return np.concatenate([np.arange(s.start, s.start + s.length) for s in segments] + [np.zeros(0, dtype=np.int64)])


def check_plan(length, world, layout, left, right, alibi=False, dropout=False):
    for rank, src in itertools.product(range(world), repeat=2):
        check_block(length, fd._segments(length, world, rank, layout), fd._segments(length, world, src, layout),
                    left, right, alibi, dropout)


def check_block(length, q_segments, k_segments, left, right, alibi=False, dropout=False):
    """The plan of one (query shard, K/V block) pair of a length-`length` sequence. With alibi,
    also: in every cell a call sees, the library's bias of that call (slope 1 times the call's
    flip: −flip·|i + sk − sq − j| in the call's indices) plus the call's lse shift is the global
    bias −|i_g − j_g|. With dropout, also: every call's rows are consecutive positions of the
    sequence and so are its columns, its first row and column are at multiples of 16, and its
    `at` gives them — so that its dropout position offsets place it in the whole mask."""
    rows, cols = positions(q_segments), positions(k_segments)
    want = visible(length, length, left, right)[np.ix_(rows, cols)].astype(int)
    got = np.zeros_like(want)
    plan = fd._plan(q_segments, k_segments, left, right, alibi, dropout)
    for call in plan:
        assert call.wl >= -1 and call.wr >= -1, call
        if dropout:
            call_rows, call_cols = rows[call.r0:call.r1], cols[call.c0:call.c1]
            assert np.array_equal(call_rows, call_rows[0] + np.arange(len(call_rows))), (call, q_segments)
            assert np.array_equal(call_cols, call_cols[0] + np.arange(len(call_cols))), (call, k_segments)
            at = (int(call_rows[0]), int(call_cols[0]))
            assert call.at == at and at[0] % 16 == 0 and at[1] % 16 == 0, (call, at)
        else:
            assert call.at is None
        cells = library_cells(call)
        got[call.r0:call.r1, call.c0:call.c1] += cells
        if alibi:
            sq, sk = call.r1 - call.r0, call.c1 - call.c0
            i, j = np.nonzero(cells)
            library = -call.flip * np.abs(i + sk - sq - j) + call.shift
            exact = -np.abs(rows[call.r0 + i] - cols[call.c0 + j])
            assert np.array_equal(library, exact), call
        else:
            assert (call.flip, call.shift) == (1, 0)
    # Each visible cell once (a cell seen by two calls counts 2), no other cell.
    assert np.array_equal(got, want), (length, q_segments, k_segments, left, right, plan)
    if not want.any():
        assert plan == (), "a block without visible cells is skipped"
    return plan


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 7, 16, 33, 50])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (3, 2), (0, 4), (12, -1), (0, 0), (40, 40)])
def test_plan_is_the_global_mask(length, world, layout, window):
    check_plan(length, world, layout, *window)


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("length", [7, 33])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (3, 2), (0, -1), (40, 40)])
def test_alibi_plan_is_the_global_bias(length, world, layout, window):
    check_plan(length, world, layout, *window, alibi=True)


def dropout_lengths(world, layout, most):
    """The lengths up to `most` whose shards all start at multiples of 16 (the rule of
    _check_dropout_shards: a world of one, or with n chunks L % (16·n) in {0, 16·n − 1}, or L ≤ 1)."""
    n = world if layout == "contiguous" else 2 * world
    return [length for length in range(most + 1)
            if world == 1 or length <= 1 or length % (16 * n) in (0, 16 * n - 1)]


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (3, 2), (0, 4), (20, -1), (0, 0), (40, 40)])
def test_dropout_plan_is_aligned_and_exact(world, layout, window):
    lengths = set(dropout_lengths(world, layout, 200)) & {1, 31, 32, 33, 63, 64, 95, 96, 127, 128, 191, 192}
    for length in sorted(lengths):
        check_plan(length, world, layout, *window, dropout=True)
        check_plan(length, world, layout, *window, alibi=True, dropout=True)


def test_dropout_plan_random_windows():
    """Random lengths, worlds, layouts and windows of aligned shards, with and without ALiBi; the
    small widths (a window much narrower than a 16-token block, short last chunks) are where the
    extended calls could overlap in rows or where the library's window normalisation would bite."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        world = int(rng.integers(1, 5))
        layout = str(rng.choice(fd.LAYOUTS))
        length = int(rng.choice(dropout_lengths(world, layout, 260)))
        left, right = (int(x) for x in rng.integers(-1, 40, size=2))
        check_plan(length, world, layout, left, right, alibi=bool(rng.integers(2)), dropout=True)


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dropout_shard_rule(world, layout):
    """_check_dropout_shards accepts exactly the lengths whose non-empty shards all start at
    multiples of 16 — except where a rank's two chunks follow each other in the sequence (one run:
    the second needs no alignment) — and its message states the rule."""
    for length in range(0, 16 * 2 * world * 3 + 2):
        runs = []
        for p in range(world):
            segments = [s for s in fd._segments(length, world, p, layout) if s.length]
            runs += [s.start for i, s in enumerate(segments)
                     if i == 0 or s.start != segments[i - 1].start + segments[i - 1].length]
        aligned = all(start % 16 == 0 for start in runs)
        assert aligned == (length in dropout_lengths(world, layout, length)), length
        if aligned:
            fd._check_dropout_shards(length, world, layout, "the sequence")
        else:
            n = world if layout == "contiguous" else 2 * world
            with pytest.raises(NotImplementedError, match=f"a multiple of {16 * n} .* or one less"):
                fd._check_dropout_shards(length, world, layout, "the sequence")


def test_plan_random_windows():
    rng = np.random.default_rng(7)
    for _ in range(60):
        length = int(rng.integers(1, 70))
        world = int(rng.integers(1, 6))
        left, right = (int(x) for x in rng.integers(-1, 30, size=2))
        check_plan(length, world, str(rng.choice(fd.LAYOUTS)), left, right, alibi=bool(rng.integers(2)))


def test_causal_zigzag_steps_are_one_call_each():
    """The load-balancing trick: under a causal mask every zigzag step is one call — the diagonal
    block causal, an earlier rank's block as its first half against all local queries, a later
    rank's block whole against the second local half — and each rank computes the same number of
    cells per step."""
    length, world = 64, 4
    for rank in range(world):
        q_seg = fd._segments(length, world, rank, "zigzag")
        for src in range(world):
            plan = fd._plan(q_seg, fd._segments(length, world, src, "zigzag"), -1, 0)
            assert len(plan) == 1, plan
            (call,) = plan
            if src == rank:
                assert (call.r0, call.r1, call.c0, call.c1, call.wl, call.wr) == (0, 16, 0, 16, -1, 0)
            elif src < rank:
                assert (call.r0, call.r1, call.c0, call.c1, call.wl, call.wr) == (0, 16, 0, 8, -1, -1)
            else:
                assert (call.r0, call.r1, call.c0, call.c1, call.wl, call.wr) == (8, 16, 0, 16, -1, -1)


def test_causal_contiguous_skips_later_blocks():
    length, world = 40, 4
    for rank in range(world):
        for src in range(world):
            plan = fd._plan(fd._segments(length, world, rank, "contiguous"),
                            fd._segments(length, world, src, "contiguous"), -1, 0)
            expected = () if src > rank else ((0, 10, 0, 10, -1, 0 if src == rank else -1),)
            assert tuple(tuple(c)[:6] for c in plan) == expected


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_shard_sizes_are_near_equal(layout):
    for length, world in [(0, 3), (1, 4), (13, 4), (64, 4), (101, 8)]:
        sizes = [sum(s.length for s in fd._segments(length, world, r, layout)) for r in range(world)]
        assert sum(sizes) == length
        assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)
        everything = np.sort(np.concatenate([positions(fd._segments(length, world, r, layout)) for r in range(world)]))
        assert np.array_equal(everything, np.arange(length))


def test_dropout_calls_are_cut_between_blocks():
    """A block much taller than wide, whose right window the library would read as unbounded
    (a window ≥ the call's key count, SPEC §2): queries [0, 64) against keys [64, 80) with
    window (−1, 40). Its calls are cut between rows, and with dropout only where a block of the
    mask begins (each part then starts there); every visible cell is still seen once."""
    q_segments, k_segments = (fd.Segment(0, 0, 64),), (fd.Segment(0, 64, 16),)
    plain = check_block(80, q_segments, k_segments, -1, 40)
    assert len(plain) > 1 and any(c.r0 % 16 for c in plain), plain
    for alibi in (False, True):
        plan = check_block(80, q_segments, k_segments, -1, 40, alibi=alibi, dropout=True)
        assert len(plan) > 1, plan


def test_dropout_refuses_what_cannot_be_cut_on_blocks():
    """16 queries against 8 keys that need a cut between rows, which no block boundary offers:
    refused, not computed wrong."""
    with pytest.raises(NotImplementedError, match="no row of it starts a block of the dropout mask"):
        fd._plan((fd.Segment(0, 0, 16),), (fd.Segment(0, 16, 8),), -1, 20, False, True)
