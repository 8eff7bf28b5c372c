#!/usr/bin/env python3
"""scripts/profile-hotspots.py — the hottest SASS instructions of one Nsight Compute report's source
page, as exported by scripts/gpu-profile:

    ncu --import rep.ncu-rep --page source --csv --print-source sass > rep-sass.csv
    python3 scripts/profile-hotspots.py rep-sass.csv [--top 40]

Prints the total of warp-state samples, the share of each opcode in them (where the kernel's warps
wait), and the instructions with the most samples, each with its executions and, where the page
has them, the largest stall reasons of its samples. Column names differ between Nsight Compute
versions, so they are matched by their words; what is missing is said, not guessed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    # ncu may print notes before the table: the header is the first row that names the source.
    start = next((i for i, line in enumerate(lines) if "Source" in line and "," in line), None)
    if start is None:
        raise SystemExit(f"{path}: no table with a Source column")
    rows = list(csv.reader(lines[start:]))
    return rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]


def column(header: list[str], *words: str, exclude: tuple[str, ...] = ()) -> int | None:
    for i, name in enumerate(header):
        low = name.lower()
        if all(w in low for w in words) and not any(x in low for x in exclude):
            return i
    return None


def opcode(source: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split(" ")[0].split(".")[0] if text else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    header, rows = read_rows(args.csv)
    src = column(header, "source")
    addr = column(header, "address")
    samples = column(header, "warp stall sampling", "all") or column(header, "sampling", exclude=("not",))
    executed = column(header, "instructions executed")
    if src is None or samples is None:
        print(f"columns found: {header}")
        raise SystemExit("no Source or warp-state sampling column in this page")
    # Per-reason columns: those named after a stall reason (ncu prints them as stall_* or by name).
    reasons = [i for i, name in enumerate(header)
               if re.search(r"stall|throttle|scoreboard|barrier|dispatch|wait|branch|membar|mio|lg_", name, re.I)
               and i not in (samples, src) and "sampling" not in name.lower()]
    total = sum(number(r[samples]) for r in rows)
    if total <= 0:
        raise SystemExit("no samples in this page")
    print(f"{args.csv}: {len(rows)} instructions, {total:.0f} warp-state samples")
    if not reasons:
        print("(no per-reason columns in this page)")

    by_op: dict[str, float] = collections.Counter()
    for r in rows:
        by_op[opcode(r[src])] += number(r[samples])
    print("\nsamples by opcode:")
    for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {op:<10} {100 * n / total:5.1f}%")

    print(f"\nthe {args.top} instructions with the most samples:")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[: args.top]:
        n = number(r[samples])
        top_reasons = sorted(((number(r[i]), header[i]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{name} {v:.0f}" for v, name in top_reasons if v > 0)
        where = r[addr] if addr is not None else ""
        runs = f"{number(r[executed]):.0f}" if executed is not None else "?"
        print(f"  {100 * n / total:5.2f}%  {where:>8}  {r[src].strip()[:70]:<70}  executed {runs}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
