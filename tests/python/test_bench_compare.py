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


@pytest.fixture
def without_fa3(compare, monkeypatch):
    """flash_attn_interface made unimportable (None in sys.modules) and compare.py's probe reset."""
    monkeypatch.setitem(sys.modules, compare.FA3_MODULE, None)
    monkeypatch.setattr(compare, "_fa3", None)
    monkeypatch.delenv("FLASHATTN_CUDA_FAMILY", raising=False)


def test_missing_fa3_is_reported_once_and_the_run_goes_on(compare, without_fa3, tmp_path, capsys):
    """Without FlashAttention-3's module every case still runs; fa3 is in every case's results as
    "FA3 not importable", the console and the report's conventions say it once, the JSON keeps the
    import error, and the CUDA family variable is recorded as "auto" when unset."""
    assert compare.main(["--dry-run", "--cases", "grid,features", "--out", str(tmp_path), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("FA3 not importable") == 1, printed
    (path,) = tmp_path.glob("compare-*.json")
    data = json.loads(path.read_text())
    assert data["fa3"]["importable"] is False and data["fa3"]["module"] == "flash_attn_interface"
    assert "ImportError" in data["fa3"]["error"] or "ModuleNotFoundError" in data["fa3"]["error"]
    assert data["cuda_family"]["FLASHATTN_CUDA_FAMILY"] == "auto"
    assert data["competitors"]["fa3"].startswith("FA3")
    for case in data["cases"]:
        assert case["results"]["fa3"] == {"unsupported": compare.FA3_MISSING}, case["id"]
        assert case["check"]["passed"], case["id"]
    report = load("make_report")
    out = tmp_path / "benchmarks.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    text = out.read_text()
    conventions = text[:text.index("## Correctness")]
    assert conventions.count("FA3 not importable") == 1
    assert "- FA3 not importable in 1 of 1 run(s) (`flash_attn_interface`: " in conventions
    assert "FLASHATTN_CUDA_FAMILY=auto" in conventions
    header = next(line for line in text.splitlines() if line.startswith("| d | causal |"))
    assert "| FA2 | FA3 |" in header and "| ÷ cuDNN | ÷ FA2 | ÷ best | check |" in header


def test_cuda_family_variable_is_recorded(compare, without_fa3, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHATTN_CUDA_FAMILY", "sm80")
    assert compare.main(["--dry-run", "--cases", "grid", "--seqlens", "32", "--out", str(tmp_path),
                         "--no-plots"]) == 0
    (path,) = tmp_path.glob("compare-*.json")
    assert json.loads(path.read_text())["cuda_family"]["FLASHATTN_CUDA_FAMILY"] == "sm80"


def fake_fa3(calls: list, with_lse: bool):
    """A stand-in for flash_attn_interface on CPU tensors (SDPA's math underneath, so autograd
    works): records each call's function and keyword options, and returns (out, lse) or out as the
    two generations of FA3 do."""
    import types

    def attend(q, k, v, softmax_scale, causal):  # (b, s, heads, d)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale, is_causal=causal,
            enable_gqa=q.shape[2] != k.shape[2])
        out = out.transpose(1, 2)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return (out, lse) if with_lse else out

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **options):
        calls.append(("func", dict(options, softmax_scale=softmax_scale, causal=causal)))
        return attend(q, k, v, softmax_scale, causal)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, **options):
        calls.append(("varlen", dict(options, cu=cu_q.tolist(), max_q=max_q, softmax_scale=softmax_scale)))
        bounds = cu_q.tolist()
        outs = [attend(q[None, a:z], k[None, a:z], v[None, a:z], softmax_scale, causal) for a, z in
                zip(bounds[:-1], bounds[1:])]
        out = torch.cat([o[0] if with_lse else o for o in outs], dim=1)[0]
        return (out, None) if with_lse else out

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, page_table=None, softmax_scale=None,
                                causal=False, **options):
        calls.append(("kvcache", dict(options, paged=page_table is not None, softmax_scale=softmax_scale)))
        if page_table is not None:
            b, n = page_table.shape
            k_cache = k_cache[page_table.long()].reshape(b, n * k_cache.shape[1], *k_cache.shape[2:])
            v_cache = v_cache[page_table.long()].reshape(b, n * v_cache.shape[1], *v_cache.shape[2:])
        sk = int(cache_seqlens[0])
        return attend(q, k_cache[:, :sk], v_cache[:, :sk], softmax_scale, causal)

    module = types.ModuleType("flash_attn_interface")
    module.__version__ = "3.0.0-test"
    module.flash_attn_func = flash_attn_func
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


@pytest.mark.parametrize("with_lse", [True, False], ids=["returns-out-lse", "returns-out"])
def test_fa3_competitor_times_dense_varlen_and_decoding(compare, monkeypatch, tmp_path, with_lse):
    """With an importable flash_attn_interface (a CPU stand-in here), fa3 is timed forward and
    backward on the grid and feature cases — dense through flash_attn_func with the case's scale,
    causal flag, window, softcap and deterministic flag, varlen through flash_attn_varlen_func on the
    packed batch — and on the decoding cases through flash_attn_with_kvcache (page_table for paged
    caches); dropout and ALiBi are recorded as unsupported. Its output matches flashattn's."""
    calls = []
    monkeypatch.setitem(sys.modules, compare.FA3_MODULE, fake_fa3(calls, with_lse))
    monkeypatch.setattr(compare, "_fa3", None)
    assert compare.main(["--dry-run", "--cases", "grid,features,decode", "--competitors", "flashattn,fa3",
                         "--out", str(tmp_path), "--no-plots"]) == 0
    data = json.loads(next(tmp_path.glob("compare-*.json")).read_text())
    assert data["fa3"]["importable"] is True and data["fa3"]["version"] == "3.0.0-test"
    by_id = {c["id"]: c for c in data["cases"]}
    assert by_id["features/dropout0.1"]["results"]["fa3"] == {"unsupported": "FA3 has no dropout"}
    assert by_id["features/alibi"]["results"]["fa3"] == {"unsupported": "FA3 has no ALiBi"}
    for case in data["cases"]:
        if case["params"]["dropout"] or case["params"]["alibi"]:
            continue
        fa3 = case["results"]["fa3"]
        for direction in case["flops"]:
            assert fa3[direction]["tflops"] > 0, (case["id"], direction, fa3)
    kinds = {kind for kind, _ in calls}
    assert kinds == {"func", "varlen", "kvcache"}
    options = [o for kind, o in calls if kind == "func"]
    assert any(o.get("window_size") == (compare.DRY.window, 0) and o["causal"] for o in options)
    assert any(o.get("softcap") == 50.0 for o in options) and any(o.get("deterministic") for o in options)
    assert all("window_size" not in o or o["window_size"] != (-1, -1) for o in options)
    varlen = next(o for kind, o in calls if kind == "varlen")
    assert varlen["cu"][-1] == sum(compare.DRY.varlen_lengths) and varlen["max_q"] == max(compare.DRY.varlen_lengths)
    assert {o["paged"] for kind, o in calls if kind == "kvcache"} == {False, True}

    # The runner's output, in flashattn's layout, against flashattn's on the same inputs.
    cpu = torch.device("cpu")
    cases = [c for c in compare.feature_cases(compare.DRY, "fp32") if c.name in ("gqa8", "varlen")]
    cases += [c for c in compare.decode_cases(compare.DRY, "fp32", (3,), compare.DRY.decode_contexts)
              if c.page_size]
    for case in cases:
        case = dataclasses.replace(case, dtype="fp32")
        x = compare.Inputs(case, cpu, 3)
        ours, theirs = compare.flashattn_runner(case, x, cpu), compare.fa3_runner(case, x, cpu)
        want = ours.to_common(ours.forward(*ours.inputs))
        got = theirs.to_common(theirs.forward(*theirs.inputs))
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=1e-5, err_msg=case.name)


def synthetic_grid_run(report_rows) -> dict:
    """A compare.py JSON of grid cases with the given TFLOP/s: rows of (dtype, d, causal, s, {name:
    (fwd, bwd) or a reason string})."""
    cases = []
    for dtype, d, causal, s, speeds in report_rows:
        results = {}
        for name, value in speeds.items():
            if isinstance(value, str):
                results[name] = {"unsupported": value}
            else:
                results[name] = {dn: {"ms": 1.0, "tflops": t} for dn, t in zip(("fwd", "bwd", "fwdbwd"), value)}
        name = f"{dtype}/d{d}/{'causal' if causal else 'full'}/s{s}"
        cases.append(dict(id=f"grid/{name}", group="grid", results=results, check=dict(passed=True, max_abs_error={}),
                          params=dict(dtype=dtype, b=1, sq=s, sk=s, h=1, hk=1, d=d, dv=d, causal=causal)))
    return dict(date="2026-12-03T05:00:00+00:00", device={}, timer={}, competitors={}, cases=cases,
                fa3=dict(importable=True, module="flash_attn_interface", version="3.0.0b1"),
                cuda_family=dict(FLASHATTN_CUDA_FAMILY="sm90"))


def test_grid_report_divides_by_the_better_of_fa3_and_cudnn(tmp_path):
    """÷ best is flashattn over the faster of FA3 and cuDNN per row and direction (cuDNN alone where
    FA3 did not run, – where neither did); under each dtype's table a line per direction gives the
    range, the geometric mean and the cases below 1.00 with who led there."""
    rows = [
        ("bf16", 64, False, 512, dict(flashattn=(110, 90, 95), fa3=(100, 100, 100), cudnn=(50, 80, 70))),
        ("bf16", 64, True, 512, dict(flashattn=(120, 105, 108), fa3="FA3 not importable (flash_attn_interface)",
                                     cudnn=(100, 100, 100))),
        ("bf16", 128, False, 512, dict(flashattn=(50, 50, 50), cudnn="no kernel")),  # no fa3 entry at all
        ("fp16", 64, False, 512, dict(flashattn=(100, 100, 100), fa3=(97, 100, 100), cudnn=(90, 110, 100))),
        ("fp16", 64, True, 512, dict(flashattn=(100, 100, 100), fa3=(90, 120, 100), cudnn=(80, 105, 100))),
    ]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(synthetic_grid_run(rows)))
    report = load("make_report")
    out = tmp_path / "benchmarks.md"
    assert report.main([str(path), "--out", str(out), "--img-dir", str(tmp_path / "img")]) == 0
    text = out.read_text()
    bf16 = text[text.index("### bf16"):text.index("### fp16")]
    fp16 = text[text.index("### fp16"):]
    table = [line for line in bf16.splitlines() if line.startswith("| ")]
    assert table[0].endswith("| ÷ cuDNN | ÷ FA2 | ÷ best | check |")
    assert len(table) == 4  # the header and the three bf16 rows, sorted by d, causal, seqlen
    assert "| 1.10 / 0.90 |" in table[1]
    assert "| 1.20 / 1.05 |" in table[2]
    assert "| – / – |" in table[3] and "not timed: the run's JSON has no entry for it" in bf16
    assert "FA3 not importable (flash_attn_interface)" in bf16
    fwd = next(line for line in bf16.splitlines() if line.startswith("- forward ÷ best:"))
    bwd = next(line for line in bf16.splitlines() if line.startswith("- backward ÷ best:"))
    assert fwd.startswith(f"- forward ÷ best: 1.100–1.200 over 2 cases, geometric mean {(1.1 * 1.2) ** 0.5:.3f} "
                          "(FA3 timed in 1 of them, cuDNN alone in the others); at or above 1.00 in every one"), fwd
    assert f"geometric mean {(0.9 * 1.05) ** 0.5:.3f}" in bwd and "0.900–1.050 over 2 cases" in bwd
    assert bwd.endswith("below 1.00 in 1: d 64 s 512 (0.9000 of FA3)"), bwd
    assert "| 1.03 / 0.91 |" in fp16 and "| 1.11 / 0.83 |" in fp16
    fp16_fwd = next(line for line in fp16.splitlines() if line.startswith("- forward ÷ best:"))
    fp16_bwd = next(line for line in fp16.splitlines() if line.startswith("- backward ÷ best:"))
    mean = (100 / 97 * 100 / 90) ** 0.5
    assert f"1.031–1.111 over 2 cases, geometric mean {mean:.3f} (FA3 timed in 2 of them);" in fp16_fwd, fp16_fwd
    assert fp16_bwd.endswith("below 1.00 in all 2"), fp16_bwd  # every row behind: no list of them
    assert "- FA3: `flash_attn_interface` 3.0.0b1." in text and "FLASHATTN_CUDA_FAMILY=sm90" in text
