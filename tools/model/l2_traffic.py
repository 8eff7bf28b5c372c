#!/usr/bin/env python3
"""tools/model/l2_traffic.py — the DRAM bytes of the sm90 forward's causal tile orders, as an LRU
cache of a given size sees them: the persistent CTAs walk the masked order (one section of every
(head, batch) pair, or sections of a number of pairs, alternating or not — tile_order.py's
masked_order) by the static snake or dynamically; a tile of row block m reads its Q block, then the
K/V blocks m, m - 1, ..., 0 of its pair (square causal, one key tile a time unit, the tile's fixed
cost `overhead` units), then writes its O block. Every Q, K/V and O block passes through the cache;
a K/V block not in it is read from DRAM. The real L2 is neither LRU nor one pool (two partitions,
hashed sets), so the sizes to try bracket the H100's 50 MB; the model compares orders, it does not
predict bytes to the percent.

    python3 tools/model/l2_traffic.py [--d 128] [--seqlen 16384] [--l2 24,48] [--sections 0,4]
"""
import argparse
import heapq
from collections import OrderedDict

from tile_order import masked_order


def cta_tiles_static(tiles, ctas):
    """Each CTA's tiles in the static snake walk (PersistentTileScheduler::index)."""
    per = [[] for _ in range(ctas)]
    for i, tile in enumerate(tiles):
        rnd, c = divmod(i, ctas)
        per[ctas - 1 - c if rnd % 2 else c].append(tile)
    return per


def accesses(tiles, ctas, overhead, dynamic):
    """(time, kind, key) of every block access: kind "q", "kv" or "o"; key identifies the block."""
    events = []
    if dynamic:
        free = [(0.0, c) for c in range(ctas)]
        plan = [[] for _ in range(ctas)]
        for tile in tiles:
            t, c = heapq.heappop(free)
            plan[c].append(tile)
            heapq.heappush(free, (t + tile[0] + 1 + overhead, c))
    else:
        plan = cta_tiles_static(tiles, ctas)
    for c, mine in enumerate(plan):
        t = 0.0
        for m, pair in mine:
            events.append((t, c, "q", (pair, m)))
            t += overhead
            for n in range(m, -1, -1):
                events.append((t, c, "kv", (pair, n)))
                t += 1
            events.append((t, c, "o", (pair, m)))
    events.sort()
    return events


def dram_bytes(events, capacity, kv_bytes, q_bytes):
    """K/V bytes read from DRAM and the reuse of the rest, for an LRU of `capacity` bytes."""
    cache, used, misses, hits = OrderedDict(), 0, 0, 0
    for _, _, kind, key in events:
        size = kv_bytes if kind == "kv" else q_bytes
        entry = (kind, key)
        if entry in cache:
            cache.move_to_end(entry)
            hits += kind == "kv"
            continue
        misses += kind == "kv"
        cache[entry] = size
        used += size
        while used > capacity:
            _, evicted = cache.popitem(last=False)
            used -= evicted
    return misses * kv_bytes, hits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=16384, help="batch · seqlen")
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=0.5)
    ap.add_argument("--l2", default="24,48", help="cache sizes in MiB, comma-separated")
    ap.add_argument("--sections", default="0", help="pairs per section, comma-separated; 0: the 32 MiB share")
    a = ap.parse_args()
    heads, batch = 2048 // a.d, a.tokens // a.seqlen
    pairs = heads * batch
    assert a.block_m == a.block_n, "the model reads K/V blocks m..0 of a row block m: square tiles"
    m_blocks = (a.seqlen + a.block_m - 1) // a.block_m
    kv_bytes = a.block_n * a.d * 2 * 2
    q_bytes = a.block_m * a.d * 2
    share = max(1, (32 << 20) // (a.seqlen * a.d * 2 * 2))
    kv_total = pairs * m_blocks * kv_bytes
    print(f"d {a.d}, {a.seqlen} keys, {pairs} pairs of {m_blocks} row blocks; K/V {kv_total / 1e6:.0f} MB once")
    print("| order | schedule | L2 (MiB) | K/V from DRAM (MB) | ÷ once |")
    print("|---|---|---:|---:|---:|")
    orders = [("one section", pairs, False)]
    for s in (int(x) for x in a.sections.split(",")):
        section = share if s == 0 else s
        orders += [(f"sections of {section}, alternating", section, True),
                   (f"sections of {section}, highest first", section, False)]
    for name, sec, alt in orders:
        tiles = masked_order(m_blocks, pairs, sec, alt)
        for dynamic in (False, True):
            events = accesses(tiles, a.ctas, a.overhead, dynamic)
            for mib in (int(x) for x in a.l2.split(",")):
                read, _ = dram_bytes(events, mib << 20, kv_bytes, q_bytes)
                print(f"| {name} | {'dynamic' if dynamic else 'static'} | {mib} | {read / 1e6:.0f} | "
                      f"{read / kv_total:.2f} |")


if __name__ == "__main__":
    main()
