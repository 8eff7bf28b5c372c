"""The worst difference per quantity in one log of a ring-flash-attention test: the tests print a
label line ("out diff:", "lse diff 0:", or "name: max X, mean Y" for one rank) followed by one
"[rank] max X, mean Y" line per rank; only labels that name a difference count.

    summarize.py LOG [--check]

--check also exits 1 unless the log printed the differences of out and of dq, dk, dv, each at
most 0.0625 (bf16 results against one process's: a few units in the last place at magnitudes up
to 8), and those of lse (fp32) at most 1e-4."""
import re
import sys

TOLERANCE = {"lse": 1e-4}
DEFAULT_TOLERANCE = 0.0625
REQUIRED = ("out", "dq", "dk", "dv")

name, worst = None, {}
for line in open(sys.argv[1], errors="replace"):
    line = line.strip()
    m = re.match(r"([A-Za-z_][^:\[]*):(?: max ([0-9.e+-]+))?", line)
    if m:
        name = m.group(1) if "diff" in m.group(1) else None
        if m.group(2) and name:
            worst[name] = max(worst.get(name, 0.0), float(m.group(2)))
        continue
    m = re.match(r"\[\d+\] max ([0-9.e+-]+)", line)
    if m and name:
        worst[name] = max(worst.get(name, 0.0), float(m.group(1)))
print(" ".join(f"{k.replace(' ', '_')}={v:.3g}" for k, v in worst.items()) or "no diffs printed")
if "--check" in sys.argv[2:]:
    quantity = lambda name: name.split()[0]  # noqa: E731 — "lse diff 0" -> "lse"
    missing = [q for q in REQUIRED if not any(quantity(k) == q for k in worst)]
    over = [f"{k} {v:.3g} > {TOLERANCE.get(quantity(k), DEFAULT_TOLERANCE):g}" for k, v in worst.items()
            if v > TOLERANCE.get(quantity(k), DEFAULT_TOLERANCE)]
    if missing or over:
        print("check failed: " + "; ".join(([f"no {', '.join(missing)} difference printed"] if missing else []) + over))
        sys.exit(1)
