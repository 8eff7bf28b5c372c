"""bench/compare.py and bench/make_report.py on the CPU: the dry run generates every case group
with tiny shapes, runs flashattn's CPU backend beside SDPA's math backend, reports the GPU-only
competitors as "–" with their reasons, checks every flashattn result against the fp32 reference,
and writes the JSON that make_report.py turns into the Markdown report."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bench/compare.py needs it")

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


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
    assert {c["group"] for c in data["cases"]} == {"grid", "features", "decode", "memory"}
    for case in data["cases"]:
        results = case["results"]
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

    report = load("make_report")
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main([str(path), "--out", str(out)]) == 0
    text = out.read_text()
    for heading in ("## The FlashAttention grid", "## Features", "## Decoding", "## Peak memory", "## Correctness"):
        assert heading in text
    assert "needs a CUDA device" in text and "–<sup>" in text
    assert "0 failed" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "docs" / "img" / "grid-bf16-fwd.png").stat().st_size > 0
        assert "](img/grid-bf16-fwd.png)" in text
    else:
        assert "matplotlib was not importable" in text


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
