"""The worst difference per quantity in one log of a ring-flash-attention test: the tests print a
label line ("out diff:", "lse diff 0:", or "name: max X, mean Y" for one rank) followed by one
"[rank] max X, mean Y" line per rank; only labels that name a difference count."""
import re
import sys

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
