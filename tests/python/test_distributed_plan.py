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


def positions(length, world, rank, layout):
    return np.concatenate([np.arange(s.start, s.start + s.length) for s in fd._segments(length, world, rank, layout)]
                          + [np.zeros(0, dtype=np.int64)])


def check_plan(length, world, layout, left, right, alibi=False):
    """With alibi, also: in every cell a call sees, the library's bias of that call (slope 1 times
    the call's flip: −flip·|i + sk − sq − j| in the call's indices) plus the call's lse shift is
    the global bias −|i_g − j_g|."""
    truth = visible(length, length, left, right)
    for rank, src in itertools.product(range(world), repeat=2):
        rows, cols = positions(length, world, rank, layout), positions(length, world, src, layout)
        want = truth[np.ix_(rows, cols)].astype(int)
        got = np.zeros_like(want)
        plan = fd._plan(fd._segments(length, world, rank, layout), fd._segments(length, world, src, layout),
                        left, right, alibi)
        for call in plan:
            assert call.wl >= -1 and call.wr >= -1, call
            cells = library_cells(call)
            got[call.r0:call.r1, call.c0:call.c1] += cells
            if alibi:
                sq, sk = call.r1 - call.r0, call.c1 - call.c0
                i, j = np.nonzero(cells)
                library = -call.flip * np.abs(i + sk - sq - j) + call.shift
                exact = -np.abs(rows[call.r0 + i] - cols[call.c0 + j])
                assert np.array_equal(library, exact), (call, rank, src)
            else:
                assert (call.flip, call.shift) == (1, 0)
        assert np.array_equal(got, want), (length, world, layout, left, right, rank, src, plan)
        if not want.any():
            assert plan == (), "a block without visible cells is skipped"


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
        everything = np.sort(np.concatenate([positions(length, world, r, layout) for r in range(world)]))
        assert np.array_equal(everything, np.arange(length))
