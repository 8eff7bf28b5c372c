#!/usr/bin/env python3
"""tools/model/tile_order.py — the makespan of the sm90 forward's persistent CTAs under a causal
mask, for the masked tile orders of src/common/tile_order.h (one section, sections, sections with
alternating directions) walked by the static snake (PersistentTileScheduler::index) or taken
greedily by whichever CTA is free first (a dynamic scheduler). A tile of row block m costs m + 1
key tiles (square causal) plus a fixed overhead; the result is the longest CTA's sum over the
ideal (total / CTAs). No cache or memory effects: it isolates load balance.

    python3 tools/model/tile_order.py [--ctas 132] [--overhead 0.5]
"""
import argparse
import heapq


def masked_order(m_blocks, pairs, section, alternate):
    """(row block, pair) by position: common::MaskedTileOrder::at, in Python."""
    sections = (pairs + section - 1) // section
    rising_parity = sections % 2 if alternate else -1
    out = []
    for index in range(m_blocks * pairs):
        k = index // (section * m_blocks)
        first = k * section
        in_section = min(section, pairs - first)
        local = index - first * m_blocks
        step = local // in_section
        m = step if (k & 1) == rising_parity else m_blocks - 1 - step
        out.append((m, first + local % in_section))
    return out


def static_snake(tiles, ctas, overhead):
    busy = [0.0] * ctas
    for i, (m, _) in enumerate(tiles):
        rnd, c = divmod(i, ctas)
        busy[ctas - 1 - c if rnd % 2 else c] += m + 1 + overhead
    return max(busy)


def dynamic(tiles, ctas, overhead):
    heap = [(0.0, c) for c in range(ctas)]
    for m, _ in tiles:
        t, c = heapq.heappop(heap)
        heapq.heappush(heap, (t + m + 1 + overhead, c))
    return max(t for t, _ in heap)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=0.5, help="per-tile cost in key tiles")
    a = ap.parse_args()
    # The FlashAttention grid (16k tokens, heads · d = 2048, 128-row tiles): name, row blocks,
    # (head, batch) pairs, pairs per 32 MiB section.
    cases = [("d 64, 8k", 64, 64, 16), ("d 64, 16k", 128, 32, 8), ("d 128, 512", 4, 512, 128),
             ("d 128, 1k", 8, 256, 64), ("d 128, 4k", 32, 64, 16), ("d 128, 16k", 128, 16, 4),
             ("d 256, 16k", 128, 8, 2)]
    print("| case | one section | sections | alternating sections | one section, dynamic |")
    print("|---|---:|---:|---:|---:|")
    for name, m_blocks, pairs, section in cases:
        ideal = sum(m + 1 + a.overhead for m in range(m_blocks)) * pairs / a.ctas
        one = masked_order(m_blocks, pairs, pairs, False)
        cells = [static_snake(one, a.ctas, a.overhead),
                 static_snake(masked_order(m_blocks, pairs, section, False), a.ctas, a.overhead),
                 static_snake(masked_order(m_blocks, pairs, section, True), a.ctas, a.overhead),
                 dynamic(one, a.ctas, a.overhead)]
        print(f"| {name} | " + " | ".join(f"{c / ideal:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
