"""bench/compare.py and bench/make_report.py on the CPU: the dry run generates every case group
with tiny shapes, runs flashattn's CPU backend beside SDPA's math backend (the cpu group: beside
SDPA on CPU tensors and an sgemm), reports the GPU-only competitors as "–" with their reasons,
checks every flashattn result against the fp32 (fp64) reference, and writes the JSON that
make_report.py turns into the Markdown report. With the CPU build of flashattn-bench present, the
--cpp-bench path runs it beside the script on tiny shapes."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bench/compare.py needs it")

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BENCH = os.path.join(REPO, "bench")
# The C++ CLI of the cpu preset (cmake --preset cpu && cmake --build --preset cpu --target flashattn-bench).
CPP_BENCH = os.environ.get("FLASHATTN_BENCH_BIN", os.path.join(REPO, "build", "cpu", "flashattn-bench"))
needs_cpp_bench = pytest.mark.skipif(not os.access(CPP_BENCH, os.X_OK),
                                     reason=f"no flashattn-bench at {CPP_BENCH} (build the cpu preset's target)")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compare():
    return load("compare")


def test_dry_run_writes_json_and_report(compare, tmp_path):
    assert compare.main(["--dry-run", "--out", str(tmp_path), "--no-plots"]) == 0
    (path,) = tmp_path.glob("compare-*.json")
    data = json.loads(path.read_text())
    assert data["dry_run"] and data["device"]["torch"] == torch.__version__
    assert {c["group"] for c in data["cases"]} == {"grid", "features", "decode", "memory", "cpu"}
    for case in data["cases"]:
        results = case["results"]
        if case["group"] == "cpu":
            continue  # below
        assert set(compare.COMPETITORS) <= set(results), case["id"]  # nobody is dropped
        ours = results["flashattn"]
        for direction in case["flops"]:
            assert ours[direction]["ms"] > 0 and ours[direction]["tflops"] > 0, (case["id"], direction)
        assert case["check"]["passed"], (case["id"], case["check"])
        assert "needs a CUDA device" in results["cudnn"]["unsupported"]
        assert "unsupported" in results["flex"]
        assert "CUDA only" in ours["memory"]["unsupported"]
    by_id = {c["id"]: c for c in data["cases"]}
    assert by_id["features/softcap50"]["results"]["math"]["unsupported"] == "SDPA has no logit soft-capping"
    assert by_id["features/dropout0.1"]["check"]["reference"] == "explicit-fp32"
    decode = [c for c in data["cases"] if c["group"] == "decode"]
    assert all(c["results"]["flashattn"]["fwd"]["gbps"] > 0 for c in decode)
    assert any("paged KV" in c["results"]["math"].get("unsupported", "") for c in decode)

    cpu = [c for c in data["cases"] if c["group"] == "cpu"]
    assert {(c["params"]["dtype"], c["params"]["causal"]) for c in cpu} == {
        (t, causal) for t in ("bf16", "fp32") for causal in (False, True)}
    assert data["cpu"]["threads"] == torch.get_num_threads() and data["cpu_timer"]["method"] == "perf_counter"
    for case in cpu:
        results = case["results"]
        assert set(results) == {"flashattn", "sdpa_cpu", "sgemm"}, case["id"]
        assert set(case["flops"]) == {"fwd", "bwd"}
        for name in results:
            for direction in ("fwd", "bwd"):
                assert results[name][direction]["gflops"] > 0, (case["id"], name, direction)
        assert results["sdpa_cpu"]["note"].startswith("torch picked")
        # The sgemm does the attention's FLOPs (FlashAttention's count): all heads, or half when causal.
        p = case["params"]
        heads = p["b"] * p["h"] // (2 if p["causal"] else 1)
        assert results["sgemm"]["fwd"]["flops"] == heads * 4 * p["sq"] * p["sk"] * p["d"]
        assert results["sgemm"]["bwd"]["flops"] == 2.5 * results["sgemm"]["fwd"]["flops"]
        assert case["check"]["passed"], (case["id"], case["check"])
        assert case["check"]["reference"] == ("explicit-fp64" if p["dtype"] == "fp32" else "sdpa-math-fp32")

    report = load("make_report")
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main([str(path), "--out", str(out), "--earlier", "old.md", "the fp16 grid"]) == 0
    text = out.read_text()
    assert "Not in these runs: the fp16 grid — see [old.md](old.md)" in text
    for heading in ("## The FlashAttention grid", "## Features", "## Decoding", "## Peak memory", "## Correctness",
                    "## CPU"):
        assert heading in text
    assert f"**{torch.get_num_threads()} threads**" in text and "| fp32 | 32 | yes | 48 |" in text
    assert "needs a CUDA device" in text and "–<sup>" in text
    assert "0 failed" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "docs" / "img" / "grid-bf16-fwd.png").stat().st_size > 0
        assert "](img/grid-bf16-fwd.png)" in text
    else:
        assert "matplotlib was not importable" in text


@needs_cpp_bench
def test_dry_run_sets_flashattn_bench_beside_the_script(compare, tmp_path):
    """--cpp-bench: the same tiny CPU configuration timed by the script and by the C++ CLI, with the
    CLI's flags matching the script's timing; both medians, their ratio and the verdict reach the
    JSON and the report (agreement itself is not asserted: tiny shapes on a shared CPU are noise)."""
    threads = torch.get_num_threads()
    assert compare.main(["--dry-run", "--cases", "cpu", "--cpu-threads", "1", "--cpp-bench", CPP_BENCH,
                         "--out", str(tmp_path), "--no-plots"]) == 0
    assert torch.get_num_threads() == threads  # restored after the run
    data = json.loads((tmp_path / "compare-cpu.json").read_text())
    (case,) = [c for c in data["cases"] if c["group"] == "cpp"]
    assert data["cpu"]["threads"] == 1 and set(case["results"]) == {"flashattn"} and case["check"]["passed"]
    cpp = case["cpp_bench"]
    assert "error" not in cpp, cpp
    assert f"--backend cpu --threads 1 --warmup {compare.CPU_WARMUP['quick']} --repeats 3" in cpp["command"]
    assert cpp["tensors"] == "host" and cpp["threads"] == 1 and cpp["timer"] == "wall"
    assert cpp["runs"] == {"fwd": 3, "bwd": 3}
    # Host configurations alternate rounds of the script's timing and the CLI's; each side's median
    # of its rounds is compared, the first script round being the one the report's tables show.
    assert cpp["rounds"] == compare.CPP_BENCH_ROUNDS["host"] > 1
    for direction in ("fwd", "bwd"):
        entry = cpp["directions"][direction]
        assert len(entry["script_rounds_ms"]) == len(entry["cli_rounds_ms"]) == cpp["rounds"]
        assert entry["script_rounds_ms"][0] == case["results"]["flashattn"][direction]["ms"]
        assert entry["script_ms"] == pytest.approx(statistics.median(entry["script_rounds_ms"]))
        assert entry["cli_ms"] == pytest.approx(statistics.median(entry["cli_rounds_ms"])) and entry["cli_ms"] > 0
        assert entry["ratio"] == pytest.approx(entry["cli_ms"] / entry["script_ms"])
        assert entry["agree"] == (abs(entry["ratio"] - 1) <= compare.AGREEMENT_TOLERANCE)

    report = load("make_report")
    out = tmp_path / "benchmarks.md"
    assert report.main([str(tmp_path / "compare-cpu.json"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## flashattn-bench (C++) beside compare.py" in text and "agree within 5%" in text
    assert f"{cpp['rounds']} rounds |" in text
    assert f"| {case['id'].split('/', 1)[1]} (b=1 h=2) | forward |" in text


@needs_cpp_bench
def test_flashattn_bench_timer_flags_need_gpu_tensors():
    """--timer events and --l2-flush time GPU work: on host tensors the CLI says so and exits 2."""
    for flag in (["--timer", "events"], ["--l2-flush"]):
        proc = subprocess.run([CPP_BENCH, "--backend", "cpu", "--s", "8", "--h", "1", "--d", "8", *flag],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "needs GPU tensors" in proc.stderr, (flag, proc.stderr)


def test_dropout_mask_matches_the_documented_layout(compare):
    """The Philox mask of the fp32 reference (int64 torch) against the NumPy one of the tests."""
    from reference import dropout_keep

    for seed, stream, p in ((0x123456789ABCDEF0, 5, 0.1), (2**64 - 3, 2**33 + 1, 0.5)):
        ours = compare.dropout_keep(seed, stream, 37, 45, p, torch.device("cpu")).numpy()
        theirs = dropout_keep(seed, 0, stream, 37, 45, p)
        assert np.array_equal(ours, theirs)


def test_flop_convention(compare):
    case = compare.Case("grid", "x", "bf16", b=2, sq=1024, sk=1024, h=16, hk=16, d=128, dv=128, causal=True)
    assert case.flops("fwd") == 4 * 2 * 16 * 1024 * 1024 * 128 / 2
    assert case.flops("bwd") == 2.5 * case.flops("fwd")
    assert case.flops("fwdbwd") == 3.5 * case.flops("fwd")


def test_flex_mods_match_plain_softmax(compare):
    """FlexAttention's score_mod / mask_mod of the feature cases (softcap, ALiBi, window, varlen as a
    document mask over the packed batch), run by eager flex_attention on CPU tensors (no compile)
    against a plain fp64 softmax."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch has no FlexAttention")
    cpu = torch.device("cpu")

    def plain(q, k, v, case, slopes):  # one sequence: q (s, h, d), k and v (s, hk, ·)
        g = case.h // case.hk
        k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
        s = torch.einsum("ihd,jhd->hij", q.double(), k) * case.scale
        if case.softcap > 0:
            s = case.softcap * torch.tanh(s / case.softcap)
        bias = compare.score_bias(case, slopes, q.shape[0], k.shape[0], cpu)
        if bias is not None:
            s = s + bias.double()
        return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)

    lengths = compare.DRY.varlen_lengths
    cases = [c for c in compare.feature_cases(compare.DRY, "bf16") if c.dropout == 0] + [
        compare.Case("features", "varlen-full", "fp32", len(lengths), 30, 30, 4, 2, 32, 32, varlen=lengths),
        compare.Case("features", "varlen-softcap-window", "fp32", len(lengths), 30, 30, 4, 4, 32, 32, causal=True,
                     softcap=5.0, window=(5, 0), varlen=lengths),
        compare.Case("features", "alibi-sq<sk", "fp32", 2, 20, 48, 4, 4, 32, 32, causal=True, alibi=True),
        compare.Case("features", "window-sq<sk", "fp32", 2, 20, 48, 4, 2, 32, 32, window=(6, 3)),
    ]
    for case in cases:
        case = dataclasses.replace(case, dtype="fp32")
        x = compare.Inputs(case, cpu, 0)
        x.q = x.q * 4  # scores of several units: the cap bites
        score_mod, mask_mod, q_len, kv_len = compare.flex_mods(case, x.slopes, cpu)
        assert (score_mod is not None) == (case.softcap > 0 or case.alibi), case.name
        block_mask = (flex.create_block_mask(mask_mod, None, None, q_len, kv_len, device=cpu)
                      if mask_mod is not None else None)
        if case.varlen:
            spans = list(zip(x.cu_seqlens.tolist()[:-1], x.cu_seqlens.tolist()[1:]))

            def layout(t):
                return t.transpose(0, 1).unsqueeze(0)

            def back(out):
                return out[0].transpose(0, 1)
        else:
            spans = range(case.b)

            def layout(t):
                return t.transpose(1, 2)

            def back(out):
                return out.transpose(1, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            out = back(flex.flex_attention(layout(x.q), layout(x.k), layout(x.v), score_mod=score_mod,
                                           block_mask=block_mask, enable_gqa=case.h != case.hk))
        for span in spans:
            sel = slice(*span) if case.varlen else span
            want = plain(x.q[sel], x.k[sel], x.v[sel], case, x.slopes)
            np.testing.assert_allclose(out[sel].double().numpy(), want.numpy(), atol=2e-5, err_msg=case.name)


def test_no_function_binds_torch_locally(compare):
    """`import torch.x` (or `torch = …`) inside a function makes `torch` a local of the whole
    function: unbound where that line did not run, and an empty closure cell in the functions nested
    in it. flex_runner once did so (import torch._dynamo on its first call only), which failed every
    later Flex case that used torch (UnboundLocalError for varlen; softcap's score_mod broke torch.compile)."""
    import types

    def codes(code):
        yield code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from codes(const)

    functions = {}
    for name, value in vars(compare).items():
        if getattr(value, "__module__", None) != "compare":
            continue
        functions[name] = value
        if isinstance(value, type):
            functions.update((f"{name}.{k}", v) for k, v in vars(value).items())
    for name, fn in functions.items():
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None:
            continue
        for c in codes(code):
            assert not {"torch", "F"} & set(c.co_varnames + c.co_cellvars), (name, c.co_name)


def test_decode_report_flags_host_bound_calls(compare, tmp_path):
    """The decoding table shows flashattn's host µs per call where the JSON has them and marks a
    case whose host time reaches its timed median; Timer.host_ms is None on the CPU (there the
    timing is host time already)."""
    timer = compare.Timer(torch.device("cpu"), "events", 1.0, 1.0, cpu_repeats=1)
    assert timer.host_ms(lambda: None) is None
    assert compare.main(["--dry-run", "--cases", "decode", "--out", str(tmp_path), "--no-plots"]) == 0
    (path,) = tmp_path.glob("compare-*.json")
    data = json.loads(path.read_text())
    decode = [c for c in data["cases"] if c["group"] == "decode"]
    assert len(decode) >= 2 and not any("host_ms" in c["results"]["flashattn"]["fwd"] for c in decode)
    report = load("make_report")
    out = tmp_path / "plain.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    assert "host µs" not in out.read_text()  # no column without the measurement
    fast, slow = decode[0]["results"]["flashattn"]["fwd"], decode[1]["results"]["flashattn"]["fwd"]
    fast["host_ms"] = fast["ms"] * 0.5
    slow["host_ms"] = slow["ms"] * 1.5
    path.write_text(json.dumps(data))
    out = tmp_path / "host.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1 |")]
    assert f"| {fast['host_ms'] * 1e3:.0f} |" in "\n".join(rows)
    assert sum("**bound**" in line for line in rows) == 1
    assert f"{slow['host_ms'] * 1e3:.0f} **bound**" in "\n".join(rows)
    assert "Decoding as CUDA-graph replays" not in out.read_text()  # no graph timings in this JSON

    # Graph replays: a table of their GB/s, a competitor whose capture failed as "–" with the reason.
    fast["graph_ms"], fast["graph_gbps"] = fast["ms"] * 0.25, 1234.5
    decode[0]["results"]["math"]["fwd"] = {"graph_unsupported": "capture failed: operation not permitted"}
    path.write_text(json.dumps(data))
    out = tmp_path / "graph.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    text = out.read_text()
    section = text[text.index("### Decoding as CUDA-graph replays"):]
    assert "| 1234 |" in section or "| 1235 |" in section
    assert "capture failed: operation not permitted" in section


def test_cpu_timer_warms_up_as_told_and_the_cli_gets_the_same_count(compare):
    """CPU cases run cpu_warmup untimed calls, then cpu_repeats timed ones; flashattn-bench is
    told the same counts, so both time the allocator's steady state."""
    calls = []
    timer = compare.Timer(torch.device("cpu"), "events", 1.0, 1.0, cpu_repeats=3, cpu_warmup=4)
    assert timer(lambda: calls.append(1)) >= 0 and len(calls) == 7
    assert timer.describe()["warmup_calls"] == 4
    case = compare.Case("cpp", "cpu/bf16/d32/full/s64", "bf16", 1, 64, 64, 2, 2, 32, 32, host=True)
    cmd = compare.cpp_bench_command("flashattn-bench", case, {}, timer)
    assert cmd[cmd.index("--warmup") + 1] == "4" and cmd[cmd.index("--repeats") + 1] == "3"
    assert compare.CPU_WARMUP["full"] >= 8  # glibc reuses an output size's memory after about eight


def test_grid_report_gives_the_ratio_to_fa2_and_names_the_cases_fa2_leads(compare, tmp_path):
    """The grid tables carry flashattn ÷ FA2 (forward / backward, three decimals) beside ÷ cuDNN,
    and under each dtype's table one line per direction gives the range and names every case where
    FA2 is ahead — however slightly; without FA2 timings (the CPU dry run) there is no such line."""
    assert compare.main(["--dry-run", "--cases", "grid", "--dtypes", "bf16", "--out", str(tmp_path),
                         "--no-plots"]) == 0
    (path,) = tmp_path.glob("compare-*.json")
    report = load("make_report")
    out = tmp_path / "plain.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    assert "÷ FA2" in out.read_text() and "÷ FA2:" not in out.read_text()

    data = json.loads(path.read_text())
    grid = sorted((c for c in data["cases"] if c["group"] == "grid"), key=lambda c: c["id"])
    assert len(grid) >= 2
    behind, ahead = grid[0], grid[1]
    for case, factor in ((behind, 1.0001), (ahead, 0.5)):  # FA2 a hair faster / half as fast
        mine = case["results"]["flashattn"]
        case["results"]["fa2"] = {dn: {"tflops": mine[dn]["tflops"] * factor} for dn in ("fwd", "bwd")}
    path.write_text(json.dumps(data))
    out = tmp_path / "fa2.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 0.500 / 0.500 |" not in text and "| 2.000 / 2.000 |" in text
    assert "| 1.000 / 1.000 |" in text  # 1 / 1.0001 at three decimals
    p = behind["params"]
    named = f"d {p['d']}{' causal' if p['causal'] else ''} s {p['sq']} (0.9999)"
    for direction in ("forward", "backward"):
        line = next(l for l in text.splitlines() if l.startswith(f"- {direction} ÷ FA2:"))
        assert "1.000–2.000 over 2 cases" in line and f"FA2 ahead in 1: {named}" in line, line
