"""bench/context_parallel.py end to end on the CPU: two gloo ranks, tiny shapes. Every method
either runs — with positive times, throughputs, and (ring) the compute-only / communication
split — or is kept in the JSON with the reason it could not (PyTorch's context-parallel SDPA has
no CPU sharding rule in torch 2.11); the context-parallel outputs match the single-device one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bench/context_parallel.py needs it")

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "context_parallel.py")


def test_two_cpu_ranks(tmp_path):
    cmd = [sys.executable, BENCH, "--world", "2", "--device", "cpu", "--seqlen", "48", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "32", "--causal", "--warmup", "1", "--repeats", "2", "--out",
           str(tmp_path), "--tag", "ci"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "context_parallel-ci.json").read_text())
    assert report["device"]["world"] == 2 and report["device"]["process_group"] == "gloo"
    entries = {(e["method"], e["direction"]): e for e in report["results"]}
    assert set(entries) == {(m, d) for m in ("single", "ring", "ulysses", "torch_cp") for d in ("fwd", "fwd_bwd")}
    for (method, direction), e in entries.items():
        if method == "torch_cp" and not e["ran"]:
            assert e["reason"], e
            continue
        assert e["ran"], e
        assert e["median_ms"] > 0 and e["tokens_per_s_per_device"] > 0 and e["tflops_per_device"] > 0, e
        assert e["peak_memory_bytes"] is None  # CPU: no allocator statistics
        if method in ("ring", "ulysses"):
            # bf16 outputs of magnitude ≤ ~3: a few units in the last place apart at most.
            assert e["max_abs_diff_vs_single"] <= 0.05, e
        if method == "ring":
            assert e["compute_only_ms"] > 0 and e["comm_only_ms"] > 0, e
            assert 0.0 <= e["hidden_fraction"] <= 1.0, e
            assert e["exposed_comm_ms"] == pytest.approx(max(0.0, e["median_ms"] - e["compute_only_ms"]))
    # The forward+backward of the whole sequence counts 3.5× the forward's FLOPs.
    single = entries[("single", "fwd")]
    assert single["tflops_per_device"] * single["median_ms"] == pytest.approx(
        entries[("single", "fwd_bwd")]["tflops_per_device"] * entries[("single", "fwd_bwd")]["median_ms"] / 3.5)


def test_two_cpu_ranks_with_dropout(tmp_path):
    """--dropout: every method runs with it, and ring and Ulysses, drawing the single-device mask from
    the same seed, still match the single-device out (a wrong mask would differ by whole values)."""
    cmd = [sys.executable, BENCH, "--world", "2", "--device", "cpu", "--seqlen", "64", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "32", "--causal", "--dropout", "0.2", "--methods", "single,ring,ulysses",
           "--warmup", "1", "--repeats", "2", "--out", str(tmp_path), "--tag", "dropout"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "context_parallel-dropout.json").read_text())
    assert report["config"]["dropout"] == 0.2
    entries = {(e["method"], e["direction"]): e for e in report["results"]}
    assert set(entries) == {(m, d) for m in ("single", "ring", "ulysses") for d in ("fwd", "fwd_bwd")}
    for (method, _), e in entries.items():
        assert e["ran"], e
        if method != "single":
            assert e["max_abs_diff_vs_single"] <= 0.05, e
