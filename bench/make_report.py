#!/usr/bin/env python3
"""bench/make_report.py — turns the JSON of bench/compare.py into docs/benchmarks.md (tables
stamped with the date, GPU, clocks, driver, CUDA, PyTorch and cuDNN versions) and PNG plots in
docs/img/.

  python bench/make_report.py build/compare/*.json                  # → docs/benchmarks.md, docs/img/
  python bench/make_report.py run.json --out /tmp/b.md --img-dir /tmp/img

Several files (runs of separate case groups) are merged; where two hold the same case, the later
run wins. Plots need matplotlib; without it the report says so and has no images.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASH = "–"
ORDER = ("flashattn", "cudnn", "fa2", "fa3", "efficient", "flex", "math", "sdpa_cpu", "sgemm")
LABELS = {
    "flashattn": "flashattn",
    "cudnn": "cuDNN",
    "fa2": "FA2",
    "fa3": "FA3",
    "efficient": "mem-eff",
    "flex": "Flex",
    "math": "math",
    "sdpa_cpu": "SDPA (CPU)",
    "sgemm": "sgemm fp32",
}
DIRECTION_LABELS = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}
BEST_OF = ("fa3", "cudnn")  # "÷ best": flashattn against the faster of these on each row
NOT_IN_RUN = "not timed: the run's JSON has no entry for it"


# --- loading ---------------------------------------------------------------------------------------


def load(paths) -> list:
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: r.get("date", ""))
    return runs


def merged_cases(runs) -> list:
    by_id = collections.OrderedDict()
    for run in runs:
        for case in run["cases"]:
            by_id[case["id"]] = case
    return list(by_id.values())


def competitors_of(cases) -> list:
    seen = {name for c in cases for name in c.get("results", {})}
    return [n for n in ORDER if n in seen] + sorted(seen - set(ORDER))


def number(value):
    """A measured number, or None (missing, or written as a string for NaN)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def figure(value: float) -> str:
    """At most three significant figures (whole numbers from 100 up): 612, 45.3, 0.0123."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if value >= 1e-3 else f"{value:.1e}"


def metric(case, name, direction, key="tflops"):
    entry = case.get("results", {}).get(name, {}).get(direction, {})
    return number(entry.get(key))


def check_failed(case) -> bool:
    return not case.get("check", {}).get("passed", True)


def reason(case, name, direction):
    result = case.get("results", {}).get(name, {})
    if "unsupported" in result:
        return result["unsupported"]
    return result.get(direction, {}).get("unsupported")


# --- plots -----------------------------------------------------------------------------------------


def make_plots(runs, img_dir):
    """PNG plots of the runs' cases into img_dir; returns the file names, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    os.makedirs(img_dir, exist_ok=True)
    cases = merged_cases(runs)
    made = []
    grid = [c for c in cases if c["group"] == "grid"]
    names = competitors_of(grid)
    for dtype in sorted({c["params"]["dtype"] for c in grid}):
        rows = [c for c in grid if c["params"]["dtype"] == dtype]
        for direction in ("fwd", "bwd", "fwdbwd"):
            def speed(ax, panel, direction=direction):
                for name in names:
                    line(ax, [(c["params"]["sq"], metric(c, name, direction)) for c in panel
                              if not (name == "flashattn" and check_failed(c))], LABELS.get(name, name))
            made.append(grid_figure(plt, rows, speed, "TFLOP/s", img_dir, f"grid-{dtype}-{direction}.png",
                                    f"{dtype} {DIRECTION_LABELS[direction]}, batch·seqlen = 16k, heads·d = 2048"))
        if any(ratio(c, dn) for c in rows for dn in ("fwd", "bwd", "fwdbwd")):
            def ratios(ax, panel):
                for direction in ("fwd", "bwd", "fwdbwd"):
                    line(ax, [(c["params"]["sq"], ratio(c, direction)) for c in panel if not check_failed(c)],
                         DIRECTION_LABELS[direction])
                ax.axhline(1.0, color="gray", lw=0.8)
            made.append(grid_figure(plt, rows, ratios, "flashattn ÷ cuDNN", img_dir,
                                    f"grid-{dtype}-ratio-cudnn.png",
                                    f"{dtype}: flashattn TFLOP/s divided by cuDNN's (above 1: flashattn is faster)"))
    made += decode_plots(plt, runs, cases, img_dir)
    return made


def line(ax, points, label):
    """One curve of the measured points (x, y); points without a value are left out."""
    points = [(x, y) for x, y in points if y is not None]
    if points:
        ax.plot(*zip(*points), marker="o", label=label)


def grid_figure(plt, rows, draw, ylabel, img_dir, name, title) -> str:
    """Panels of the grid cases: non-causal / causal (rows) × head dims (columns), sequence length
    on a log axis; draw(ax, cases of the panel sorted by seqlen) puts the curves in."""
    dims = sorted({c["params"]["d"] for c in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(4.2 * len(dims), 6.4), squeeze=False, sharex=True)
    for col, d in enumerate(dims):
        for row, causal in enumerate((False, True)):
            ax = axes[row][col]
            draw(ax, sorted((c for c in rows if c["params"]["d"] == d and c["params"]["causal"] == causal),
                            key=lambda c: c["params"]["sq"]))
            ax.set_xscale("log", base=2)
            ax.set_title(f"d={d}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(ylabel)
            if row == 1:
                ax.set_xlabel("sequence length")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    save(fig, img_dir, name)
    plt.close(fig)
    return name


def decode_plots(plt, runs, cases, img_dir) -> list:
    decode = [c for c in cases if c["group"] == "decode"]
    copy = next((number(r.get("copy_gbps")) for r in reversed(runs) if number(r.get("copy_gbps"))), None)
    names = competitors_of(decode)
    made = []
    for sq in sorted({c["params"]["sq"] for c in decode}):
        rows = [c for c in decode if c["params"]["sq"] == sq]
        layouts = sorted({c["params"]["page_size"] for c in rows})
        batches = sorted({c["params"]["b"] for c in rows})
        fig, axes = plt.subplots(len(layouts), len(batches), figsize=(3.6 * len(batches), 3.0 * len(layouts)),
                                 squeeze=False, sharey=True)
        for r, page in enumerate(layouts):
            for col, b in enumerate(batches):
                ax = axes[r][col]
                panel = sorted((c for c in rows if c["params"]["page_size"] == page and c["params"]["b"] == b),
                               key=lambda c: c["params"]["sk"])
                for name in names:
                    line(ax, [(c["params"]["sk"], metric(c, name, "fwd", "gbps")) for c in panel
                              if not (name == "flashattn" and check_failed(c))], LABELS.get(name, name))
                if copy:
                    ax.axhline(copy, color="gray", ls="--", lw=0.8, label="device copy")
                ax.set_xscale("log", base=2)
                ax.set_title(f"b={b}, {'paged ' + str(page) if page else 'contiguous'}", fontsize=9)
                ax.grid(alpha=0.3)
                if col == 0:
                    ax.set_ylabel("GB/s")
                if r == len(layouts) - 1:
                    ax.set_xlabel("context")
        handles, labels = axes[0][0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
        fig.suptitle(f"decoding, sq={sq}: GB/s of K/V read + q/out")
        fig.tight_layout(rect=(0, 0.08, 1, 0.94))
        made.append(save(fig, img_dir, f"decode-sq{sq}.png"))
        plt.close(fig)
    return made


def save(fig, img_dir, name) -> str:
    fig.savefig(os.path.join(img_dir, name), dpi=110)
    return name


def ratio(case, direction, other="cudnn"):
    ours, theirs = metric(case, "flashattn", direction), metric(case, other, direction)
    return ours / theirs if ours and theirs else None


# --- tables ----------------------------------------------------------------------------------------


class Notes:
    """Why a cell is "–": each distinct reason once, numbered, listed under its table."""

    def __init__(self):
        self.reasons = collections.OrderedDict()

    def mark(self, text) -> str:
        if text is None:
            return DASH
        short = text.replace("|", "/").replace("\n", " ").strip()
        if short not in self.reasons:
            self.reasons[short] = len(self.reasons) + 1
        return f"{DASH}<sup>{self.reasons[short]}</sup>"

    def lines(self) -> list:
        if not self.reasons:
            return []
        out = [""]
        out += [f"<sup>{n}</sup> {text}  " for text, n in self.reasons.items()]
        return out


def speeds(case, name, directions, notes, key="tflops") -> str:
    if name == "flashattn" and check_failed(case):
        return "**wrong result**"
    values = [metric(case, name, direction, key) for direction in directions]
    reasons = [reason(case, name, direction) for direction in directions]
    if all(v is None for v in values) and len(set(reasons)) == 1:
        return notes.mark(reasons[0])  # one "–" for a competitor that ran nothing, for one reason
    return " / ".join(figure(v) if v is not None else notes.mark(r) for v, r in zip(values, reasons))


def check_cell(case) -> str:
    chk = case.get("check")
    if not chk:
        return DASH
    if "error" in chk:
        return f"error: {chk['error'][:60]}"
    worst = max((number(v) or float("inf") for v in chk.get("max_abs_error", {}).values()), default=float("nan"))
    return f"{'ok' if chk['passed'] else 'FAILED'} ({worst:.1e})"


def grid_section(cases) -> list:
    grid = [c for c in cases if c["group"] == "grid"]
    if not grid:
        return []
    names = competitors_of(grid)
    if "fa3" not in names:  # its column stays, showing that it was not timed
        names = [n for n in ORDER if n in names or n == "fa3"] + [n for n in names if n not in ORDER]
    out = ["## The FlashAttention grid", "",
           "TFLOP/s as forward / backward / forward+backward; batch·seqlen = 16384 tokens, heads·d = 2048, "
           "q/k/v random normal. The ratios are flashattn's TFLOP/s divided by cuDNN's and by FA2's "
           "(forward / backward; FA2's to three decimals, the comparison that the sm80 kernels are held to). "
           "`÷ best`: flashattn's TFLOP/s divided by the better of FA3's and cuDNN's on that row and direction "
           "(cuDNN's alone where FA3 did not run; – where neither did); the target on Hopper is ≥ 1.00 on every "
           "forward row with a geometric mean ≥ 1.03. "
           "`check`: flashattn against the fp32 reference (largest max-abs error of out, dq, dk, dv).", ""]
    for dtype in sorted({c["params"]["dtype"] for c in grid}):
        notes = Notes()
        out += [f"### {dtype}", ""]
        header = ["d", "causal", "seqlen"] + [LABELS.get(n, n) for n in names] + ["÷ cuDNN", "÷ FA2", "÷ best",
                                                                                    "check"]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        rows = sorted((c for c in grid if c["params"]["dtype"] == dtype),
                      key=lambda c: (c["params"]["d"], c["params"]["causal"], c["params"]["sq"]))
        for c in rows:
            p = c["params"]
            cells = [str(p["d"]), "yes" if p["causal"] else "no", str(p["sq"])]
            cells += [speeds(c, n, ("fwd", "bwd", "fwdbwd"), notes) if n in c.get("results", {})
                      else notes.mark(NOT_IN_RUN) for n in names]
            cells += [ratio_cell(c, "cudnn", 2), ratio_cell(c, "fa2", 3), best_cell(c), check_cell(c)]
            out.append("| " + " | ".join(cells) + " |")
        out += notes.lines() + [""]
        out += fa2_summary(rows)
        out += best_summary(rows)
    return out


def best_ratio(case, direction):
    """(flashattn ÷ the faster of FA3 and cuDNN, the faster one's name), or (None, None) where
    flashattn or both of them did not run."""
    ours = metric(case, "flashattn", direction)
    timed = [(metric(case, name, direction), name) for name in BEST_OF]
    timed = [(value, name) for value, name in timed if value]
    if not ours or not timed:
        return None, None
    value, name = max(timed)
    return ours / value, name


def best_cell(case) -> str:
    """flashattn ÷ best as forward / backward; "–" where it has no value or flashattn was wrong."""
    if check_failed(case):
        return DASH
    return " / ".join(f"{r:.2f}" if r else DASH for r, _ in (best_ratio(case, dn) for dn in ("fwd", "bwd")))


def best_summary(rows) -> list:
    """One line per direction: the range and the geometric mean of flashattn ÷ best over the checked
    cases where it has a value, how many of them had FA3, and every case below 1.00 (with who led)."""
    lines = []
    for dn in ("fwd", "bwd"):
        found = [(r, who, c) for c in rows if not check_failed(c) for r, who in [best_ratio(c, dn)] if r]
        if not found:
            continue
        values = [r for r, _, _ in found]
        mean = math.exp(sum(math.log(r) for r in values) / len(values))
        with_fa3 = sum(1 for _, _, c in found if metric(c, "fa3", dn))
        behind = [f"d {c['params']['d']}{' causal' if c['params']['causal'] else ''} s {c['params']['sq']} "
                  f"({r:.4f} of {LABELS[who]})" for r, who, c in found if r < 1.0]
        lines.append(f"- {DIRECTION_LABELS[dn]} ÷ best: {min(values):.3f}–{max(values):.3f} over {len(values)} "
                     f"cases, geometric mean {mean:.3f} (FA3 timed in {with_fa3} of them"
                     + (", cuDNN alone in the others" if with_fa3 < len(values) else "") + "); "
                     + (f"below 1.00 in all {len(behind)}" if behind and len(behind) == len(found)
                        else f"below 1.00 in {len(behind)}: {', '.join(behind)}" if behind
                        else "at or above 1.00 in every one"))
    return lines + [""] if lines else []


def ratio_cell(case, other, digits) -> str:
    """flashattn ÷ other as forward / backward; "–" where a side did not run or flashattn was wrong."""
    if check_failed(case):
        return DASH
    return " / ".join(f"{r:.{digits}f}" if r else DASH for r in (ratio(case, dn, other) for dn in ("fwd", "bwd")))


def fa2_summary(rows) -> list:
    """One line per direction: the range of flashattn ÷ FA2 over the checked cases and every case where
    FA2 is ahead; nothing where FA2 did not run."""
    lines = []
    for dn in ("fwd", "bwd"):
        pairs = [(r, c) for c in rows if not check_failed(c) for r in [ratio(c, dn, "fa2")] if r]
        if not pairs:
            continue
        values = [r for r, _ in pairs]
        behind = [f"d {c['params']['d']}{' causal' if c['params']['causal'] else ''} s {c['params']['sq']} "
                  f"({r:.4f})" for r, c in pairs if r < 1.0]
        lines.append(f"- {DIRECTION_LABELS[dn]} ÷ FA2: {min(values):.3f}–{max(values):.3f} over {len(values)} "
                     "cases; " + (f"FA2 ahead in {len(behind)}: {', '.join(behind)}" if behind
                                  else "at or above FA2 in every one"))
    return lines + [""] if lines else []


def features_section(cases) -> list:
    feats = [c for c in cases if c["group"] == "features"]
    if not feats:
        return []
    names = competitors_of(feats)
    notes = Notes()
    out = ["## Features", "",
           "TFLOP/s as forward / backward / forward+backward, counted as FlashAttention does (dense, halved "
           "when causal or windowed; varlen sums over its sequences). SDPA gets windows and ALiBi as an "
           "explicit `attn_mask`, varlen as a jagged NestedTensor; FlexAttention gets them as `score_mod` / "
           "block masks.", ""]
    header = ["case", "shape"] + [LABELS.get(n, n) for n in names] + ["check"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in feats:
        p = c["params"]
        shape = f"{p['dtype']} b={p['b']} s={p['sq']} h={p['h']}/{p['hk']} d={p['d']}/{p['dv']}"
        cells = [c["id"].split("/", 1)[1], shape] + [speeds(c, n, ("fwd", "bwd", "fwdbwd"), notes) for n in names]
        repeat = [n for n in names if c["results"].get(n, {}).get("bitwise_repeatable") is False]
        extra = f"; not bitwise repeatable: {', '.join(repeat)}" if repeat else ""
        out.append("| " + " | ".join(cells + [check_cell(c) + extra]) + " |")
    return out + notes.lines() + [""]


def decode_order(case):
    """Decoding rows by sq, cache layout, batch, context."""
    p = case["params"]
    return p["sq"], p["page_size"], p["b"], p["sk"]


def decode_shape_cells(p) -> list:
    """The sq, cache, batch and context cells of a decoding row."""
    return [str(p["sq"]), f"paged {p['page_size']}" if p["page_size"] else "contiguous", str(p["b"]), str(p["sk"])]


def decode_section(runs, cases) -> list:
    decode = [c for c in cases if c["group"] == "decode"]
    if not decode:
        return []
    copy = next((number(r.get("copy_gbps")) for r in reversed(runs) if number(r.get("copy_gbps"))), None)
    names = competitors_of(decode)
    notes = Notes()
    copy_mib = next((r.get("copy_bytes") for r in reversed(runs) if r.get("copy_bytes")), 0) // (1 << 20)
    copy_text = f"{copy:.0f} GB/s (read + write of {copy_mib} MiB)" if copy else "not measured"
    out = ["## Decoding", "",
           f"GB/s = (K and V read once + q read + out written) / time; GQA {decode[0]['params']['h']}/"
           f"{decode[0]['params']['hk']}, d {decode[0]['params']['d']}, every cache row valid, not causal. "
           f"Device copy in the same run: **{copy_text}**. SDPA has no paged cache.", ""]
    with_host = any(number(c["results"].get("flashattn", {}).get("fwd", {}).get("host_ms")) for c in decode)
    if with_host:
        out[-2] += (" `host µs`: what issuing one flashattn call costs the CPU (20 calls back to back, host "
                    "clock); **bound** where it reaches the timed call — the GPU waited for the host, so the "
                    "GB/s there measure the Python call, not the kernels.")
    header = ["sq", "cache", "batch", "context"] + [LABELS.get(n, n) for n in names] + ["flashattn ÷ copy"]
    header += ["host µs"] * with_host + ["check"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in sorted(decode, key=decode_order):
        ours = metric(c, "flashattn", "fwd", "gbps")
        share = f"{ours / copy:.2f}" if ours and copy and not check_failed(c) else DASH
        cells = decode_shape_cells(c["params"])
        cells += [speeds(c, n, ("fwd",), notes, key="gbps") for n in names] + [share]
        if with_host:
            cells.append(host_cell(c))
        out.append("| " + " | ".join(cells + [check_cell(c)]) + " |")
    return out + notes.lines() + [""]


def decode_graph_section(cases) -> list:
    """The decoding cases that were also timed as CUDA-graph replays: GB/s per competitor."""
    decode = [c for c in cases if c["group"] == "decode"
              and any("graph_ms" in r.get("fwd", {}) or "graph_unsupported" in r.get("fwd", {})
                      for r in c["results"].values())]
    if not decode:
        return []
    names = [n for n in competitors_of(decode)
             if any(key in c["results"].get(n, {}).get("fwd", {}) for c in decode
                    for key in ("graph_ms", "graph_unsupported"))]
    notes = Notes()
    out = ["### Decoding as CUDA-graph replays", "",
           "The same calls captured once in a CUDA graph and replayed, timed as above (GB/s): the kernels "
           "without the host work of each Python call, as a serving loop that replays its decoding step runs "
           "them. Batch ≤ 8, where the host work matters.", ""]
    header = ["sq", "cache", "batch", "context"] + [LABELS.get(n, n) for n in names]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in sorted(decode, key=decode_order):
        cells = decode_shape_cells(c["params"])
        for n in names:
            fwd = c["results"].get(n, {}).get("fwd", {})
            value = number(fwd.get("graph_gbps"))
            why = fwd.get("graph_unsupported") or fwd.get("unsupported") or c["results"].get(n, {}).get("unsupported")
            cells.append(figure(value) if value is not None else notes.mark(why or "not timed"))
        out.append("| " + " | ".join(cells) + " |")
    return out + notes.lines() + [""]


def host_cell(case) -> str:
    """flashattn's host µs per decoding call, and whether it bounds the timed call."""
    fwd = case["results"].get("flashattn", {}).get("fwd", {})
    host, ms = number(fwd.get("host_ms")), number(fwd.get("ms"))
    if not host:
        return DASH
    return f"{host * 1e3:.0f}" + (" **bound**" if ms and host >= ms else "")


def memory_section(cases) -> list:
    rows = [c for c in cases if c["group"] in ("memory", "features")]
    if not rows:
        return []
    names = competitors_of(rows)
    notes = Notes()
    out = ["## Peak memory of forward + backward", "",
           "MiB: `torch.cuda.max_memory_allocated` over one forward+backward after a reset, and in brackets the "
           "part above what was allocated before the call (outputs, saved tensors, gradients, workspace). "
           "flashattn allocates its workspace through PyTorch, so it is counted.", ""]
    header = ["case"] + [LABELS.get(n, n) for n in names]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in rows:
        cells = [c["id"]]
        for n in names:
            mem = c.get("results", {}).get(n, {}).get("memory", {})
            peak, extra = number(mem.get("peak_mib")), number(mem.get("extra_mib"))
            text = mem.get("unsupported") or c.get("results", {}).get(n, {}).get("unsupported")
            cells.append(f"{peak:.0f} ({extra:.0f})" if peak is not None else notes.mark(text))
        out.append("| " + " | ".join(cells) + " |")
    return out + notes.lines() + [""]


def cpu_ratio(case, other, direction):
    ours, theirs = metric(case, "flashattn", direction, "gflops"), metric(case, other, direction, "gflops")
    return ours / theirs if ours and theirs and not check_failed(case) else None


def cpu_section(runs, cases) -> list:
    rows = [c for c in cases if c["group"] == "cpu"]
    if not rows:
        return []
    host = next((r["cpu"] for r in reversed(runs) if r.get("cpu")), {})
    picked = sorted({c["results"].get("sdpa_cpu", {}).get("note", "") for c in rows} - {""})
    notes = Notes()
    out = ["## CPU", "",
           f"CPU tensors on {host.get('model', '?')} ({host.get('logical_cpus', '?')} logical CPUs; torch's CPU "
           f"capability {host.get('capability', '?')}, BLAS {host.get('blas', '?')}, parallel backend "
           f"{host.get('parallel', '?')}), **{host.get('threads', '?')} threads** for every competitor "
           "(`torch.set_num_threads`; flashattn's CPU backend follows `torch.get_num_threads()`). GFLOP/s as "
           "forward / backward by FlashAttention's FLOP convention. SDPA (CPU) is "
           "`torch.nn.functional.scaled_dot_product_attention` without a backend restriction: "
           + ("; ".join(picked) if picked else "which backend torch picked was not recorded")
           + ". sgemm fp32 is `torch.matmul` on the attention's matmul shapes, as many heads as make the same "
           "FLOP count, into buffers allocated once: the speed of the products alone. The ratios are flashattn's "
           "GFLOP/s divided by the other's (forward / backward).", ""]
    header = ["dtype", "d", "causal", "seqlen", "flashattn", "SDPA (CPU)", "sgemm fp32", "÷ SDPA", "÷ sgemm",
              "check"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in sorted(rows, key=lambda c: (c["params"]["dtype"], c["params"]["d"], c["params"]["causal"],
                                         c["params"]["sq"])):
        p = c["params"]
        cells = [p["dtype"], str(p["d"]), "yes" if p["causal"] else "no", str(p["sq"])]
        cells += [speeds(c, n, ("fwd", "bwd"), notes, key="gflops") for n in ("flashattn", "sdpa_cpu", "sgemm")]
        for other in ("sdpa_cpu", "sgemm"):
            cells.append(" / ".join(f"{r:.2f}" if r else DASH for r in (cpu_ratio(c, other, dn)
                                                                          for dn in ("fwd", "bwd"))))
        out.append("| " + " | ".join(cells + [check_cell(c)]) + " |")
    return out + notes.lines() + [""]


def cpp_section(runs, cases) -> list:
    rows = [c for c in cases if c.get("cpp_bench")]
    if not rows:
        return []
    setup = next((r["cpp_bench"] for r in reversed(runs) if r.get("cpp_bench")), {})
    tolerance = setup.get("tolerance", 0.05)
    entries = [e for c in rows for e in c["cpp_bench"]["directions"].values()]
    agreed = sum(1 for e in entries if e.get("agree"))
    out = ["## flashattn-bench (C++) beside compare.py", "",
           "The same configurations timed by compare.py (flashattn through PyTorch) and by "
           f"`{setup.get('binary', '?')}` (the C++ API), one right after the other. Ratio = flashattn-bench's "
           f"median ÷ compare.py's; they agree when it is within 1 ± {tolerance:g}. "
           f"**{agreed} of {len(entries)} agree.** {setup.get('timing', '')}", ""]
    header = ["configuration", "direction", "compare.py ms", "flashattn-bench ms", "ratio",
              f"agree within {tolerance:.0%}", "flashattn-bench timing"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in rows:
        cpp = c["cpp_bench"]
        p = c["params"]
        name = c["id"].split("/", 1)[1]
        config = f"{name} (b={p['b']} h={p['h']})"
        rounds = f", {cpp['rounds']} rounds" if cpp.get("rounds", 1) > 1 else ""
        timing = (f"{cpp.get('timer', '?')}{', L2 flush' if cpp.get('l2_flush') else ''}, {cpp.get('warmup', '?')} "
                  f"warm-up, {cpp.get('threads', '?')} threads{rounds}" if "error" not in cpp
                  else f"error: {cpp['error'][:120].replace('|', '/')}")
        for dn, e in cpp["directions"].items():
            ms = [f"{e[k]:.3f}" if number(e.get(k)) else DASH for k in ("script_ms", "cli_ms")]
            if "ratio" in e:
                verdict, ratio_text = ("yes" if e["agree"] else "**no**"), f"{e['ratio']:.3f}"
            else:
                verdict, ratio_text = DASH, DASH
            if not number(e.get("script_ms")) or not number(e.get("cli_ms")):
                timing_cell = f"{timing}; – {str(e.get('missing'))[:120].replace('|', '/')}"
            else:
                timing_cell = timing
            out.append("| " + " | ".join([config, DIRECTION_LABELS.get(dn, dn)] + ms + [ratio_text, verdict,
                                                                                      timing_cell]) + " |")
    return out + [""]


def cudnn_version(v) -> str:
    """torch reports cuDNN 9.19.0 as 91900."""
    if not isinstance(v, int):
        return str(v)
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def timer_text(t: dict) -> str:
    if not t:
        return "?"
    if t.get("method") == "perf_counter":
        return f"wall clock (CPU), median of {t.get('repeats')} after {t.get('warmup_calls')} warm-up call(s)"
    return (f"{t.get('method')} ({'triton.testing.do_bench' if t.get('method') == 'do_bench' else 'CUDA events'}), "
            f"{t.get('statistic', 'median')} of the repeats within {t.get('rep_ms')} ms after {t.get('warmup_ms')} ms "
            f"of warm-up; L2 {t.get('l2')}")


def case_part(case) -> str:
    """The part of the sweep a case belongs to, as the run list names it: its group, and for the
    grid the dtype too (the bf16 and fp16 grids are separate runs)."""
    group = case["group"]
    dtype = case.get("params", {}).get("dtype")
    return f"{group} {dtype}" if group == "grid" and dtype else group


def stamp(runs) -> list:
    out = []
    seen = set()
    for run in runs:
        dev = run.get("device", {})
        gpu = (f" ({dev.get('sm')}, {dev.get('sms')} SMs, {dev.get('memory_gib')} GiB); clocks SM "
               f"{dev.get('clock_sm', '?')} (max {dev.get('clock_sm_max', '?')}), memory {dev.get('clock_mem', '?')} "
               f"(max {dev.get('clock_mem_max', '?')}), power limit {dev.get('power_limit', '?')}; driver "
               f"{dev.get('driver', '?')}") if dev.get("gpu") else f" ({dev.get('cpu')}, {dev.get('threads')} threads)"
        date = run.get("date", "?")
        when = f"{date[:10]} {date[11:16]} UTC" if len(date) >= 16 else date
        line = (f"- {when}: **{dev.get('gpu') or 'CPU'}**{gpu}; "
                f"CUDA {dev.get('cuda')}; PyTorch {dev.get('torch')}; cuDNN {cudnn_version(dev.get('cudnn'))}; "
                f"Triton {dev.get('triton')}; flashattn `{dev.get('flashattn')}`; "
                f"cases: {', '.join(sorted({case_part(c) for c in run['cases']}))}"
                + (" (dry run: CPU, tiny shapes)" if run.get("dry_run") else "")
                + (" (--quick)" if run.get("quick") else ""))
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out


def check_summary(cases) -> list:
    checked = [c for c in cases if "check" in c]
    failed = [c for c in checked if check_failed(c)]
    out = ["## Correctness", "",
           f"{len(checked)} of {len(cases)} cases ran flashattn and were checked against the fp32 reference "
           f"(SPEC §7 tolerance); {len(failed)} failed" + (":" if failed else "."), ""]
    for c in failed:
        chk = c["check"]
        detail = chk.get("error") or ", ".join(
            f"{k} {v if isinstance(v, str) else format(v, '.2e')} (tolerance {chk['tolerance'].get(k, 0):.2e})"
            for k, v in chk.get("max_abs_error", {}).items())
        out.append(f"- `{c['id']}`: {detail}")
    return out + [""]


def run_setup_lines(runs) -> list:
    """Convention lines for what runs record about FA3 and flashattn's CUDA kernel family; nothing for
    runs that predate those records."""
    out = []
    missing = [r for r in runs if r.get("fa3") and not r["fa3"].get("importable")]
    if missing:
        errors = sorted({r["fa3"].get("error") or "?" for r in missing})
        out.append(f"- FA3 not importable in {len(missing)} of {len(runs)} run(s) "
                   f"(`{missing[0]['fa3'].get('module', 'flash_attn_interface')}`: {'; '.join(errors)}); "
                   "its cells there show –.")
    found = [r["fa3"] for r in runs if r.get("fa3", {}).get("importable")]
    versions = sorted({str(f.get("version") or "version unknown") for f in found})
    if found:
        out.append(f"- FA3: `{found[0].get('module', 'flash_attn_interface')}` {', '.join(versions)}.")
    families = sorted({r["cuda_family"].get("FLASHATTN_CUDA_FAMILY", "?") for r in runs if r.get("cuda_family")})
    if families:
        out.append(f"- flashattn's CUDA kernel family: FLASHATTN_CUDA_FAMILY={', '.join(families)} (auto: the "
                   "backend picks sm90 or sm80 kernels per call).")
    return out


def context_parallel_section() -> list:
    """How to run bench/context_parallel.py (its JSON is not part of this report yet)."""
    return [
        "## Context parallelism (bench/context_parallel.py)", "",
        "Not measured on GPUs yet: no multi-GPU run of this benchmark has been made. CI runs it end to end on "
        "two CPU ranks over gloo with tiny shapes (`tests/python/test_bench_context_parallel.py`), which checks "
        "that it works, not how fast it is.", "",
        "`bench/context_parallel.py` starts `--world` processes on one host (one GPU each over NCCL, or CPU "
        "processes over gloo with `--device cpu`) and times, forward and forward+backward, flashattn's ring "
        "attention (`flashattn.distributed.ring_flash_attn_func`, zigzag shards by default, `--layout`), its "
        "Ulysses all-to-all (`ulysses_flash_attn_func`), the whole sequence on one device "
        "(`flashattn.flash_attn_func`), and PyTorch's context-parallel SDPA "
        "(`torch.distributed.tensor.experimental.context_parallel`) where it runs (on the CPU it does not: "
        "its SDPA has no CPU sharding rule, and the JSON keeps that reason). Per method: the median of the "
        "slowest rank's time, tokens/s and TFLOP/s per device (FlashAttention's FLOP convention), peak CUDA "
        "memory per device, and the largest difference of the gathered output from the single-device one. "
        "For the ring it also times the same calls with every transfer replaced by a local copy "
        "(compute-only) and the transfers alone (comm-only); total − compute-only is the communication left "
        "exposed, and 1 − exposed ÷ comm-only the fraction hidden behind the computation.", "",
        "```bash",
        "python bench/context_parallel.py --world 8 --seqlen 131072 --heads 32 --head-dim 128 --causal "
        "--out build/cp",
        "python bench/context_parallel.py --world 2 --device cpu --seqlen 64 --heads 4 --head-dim 32 "
        "--repeats 2 --out build/cp   # CPU ranks (what CI runs)",
        "```", "",
        "It writes `OUT/context_parallel-<tag>.json` (configuration, device and versions, one entry per "
        "method and direction, with the reason where a method did not run).", "",
    ]


def report(runs, img_files, img_link, earlier=()) -> str:
    """earlier: (link, what) pairs — reports of earlier runs that hold cases these runs do not."""
    cases = merged_cases(runs)
    latest = runs[-1]
    cpu_timer = next((r["cpu_timer"] for r in reversed(runs) if r.get("cpu_timer")), None)
    out = ["# flashattn beside PyTorch's attention backends", "",
           "Generated by `bench/make_report.py` from the JSON of `bench/compare.py`; do not edit by hand.", "",
           "Runs:", ""] + stamp(runs) + [
        "",
        "Conventions:",
        "",
        f"- FLOPs: {latest.get('flop_convention')}.",
        f"- Timing: {timer_text(latest.get('timer'))}; "
        + (f"CPU cases: {timer_text(cpu_timer)}; " if cpu_timer else "")
        + "every competitor in the same process, on the same input "
        "values (each in its own layout, made outside the timing). The backward is "
        "`torch.autograd.grad` of the output with the graph retained; the forward runs with autograd on.",
        f"- Decode bandwidth: {latest.get('bandwidth_convention')}.",
        f"- Memory: {latest.get('memory_convention')}.",
        "- Competitors: " + ", ".join(f"{k} = {v}" for k, v in latest.get("competitors", {}).items())
        + ". A competitor that cannot run a case shows – with the reason numbered under the table.",
    ] + run_setup_lines(runs) + [
        "",
        "Rerun on the GPU machine (see README.md, Benchmarks): `python bench/compare.py --out build/compare` "
        "(or by parts with `--cases`), then `python bench/make_report.py build/compare/*.json`.",
        "",
    ]
    out += [f"Not in these runs: {what} — see [{link}]({link}), an earlier report." for link, what in earlier]
    out += [""] if earlier else []
    out += check_summary(cases)
    if img_files is None:
        out += ["Plots: matplotlib was not importable when this report was made; none drawn.", ""]
    elif img_files:
        out += ["## Plots", ""] + [f"![{name[:-4]}]({img_link}/{name})" for name in img_files] + [""]
    out += grid_section(cases) + features_section(cases) + decode_section(runs, cases) + decode_graph_section(cases)
    out += memory_section(cases)
    out += cpu_section(runs, cases) + cpp_section(runs, cases) + context_parallel_section()
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="compare.py JSON files")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    p.add_argument("--img-dir", help="where the PNGs go (default: img/ beside --out)")
    p.add_argument("--earlier", nargs=2, action="append", default=[], metavar=("REPORT", "WHAT"),
                   help="link an earlier report (path relative to --out's folder) for the cases WHAT that these "
                        "runs do not hold; repeatable")
    args = p.parse_args(argv)
    runs = load(args.json)
    img_dir = args.img_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "img")
    img_files = make_plots(runs, img_dir)
    if img_files is None:
        print("make_report.py: matplotlib is not importable; the report has no plots (pip install matplotlib)")
    img_link = os.path.relpath(img_dir, os.path.dirname(os.path.abspath(args.out)))
    text = report(runs, img_files, img_link, [tuple(e) for e in args.earlier])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({len(merged_cases(runs))} cases, {len(img_files or [])} plots in {img_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
