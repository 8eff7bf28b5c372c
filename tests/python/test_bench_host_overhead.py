"""bench/host_overhead.py end to end on the CPU (this library's call alone, tiny shapes): it runs
and reports a positive time per call for the shapes it names. On the GPU machine the same script
times FA2/cuDNN through SDPA and FA3 beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed: bench/host_overhead.py needs it")

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "host_overhead.py")


def test_cpu_run_reports_time_per_call(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, BENCH, "--device", "cpu", "--calls", "5", "--repeats", "2", "--context", "64",
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["flashattn"]
    assert rows[0]["us_per_call"] > 0 and rows[0]["context"] == 64 and rows[0]["heads"] == 32
    assert "µs per call" in run.stdout


def test_cpu_breakdown_times_the_extension_call_alone(tmp_path):
    """--breakdown adds _C.forward_kvcache alone (flashattn_C) and its parts on the problem the shape
    flags name."""
    out = tmp_path / "host.json"
    cmd = [sys.executable, BENCH, "--device", "cpu", "--calls", "5", "--repeats", "2", "--context", "16",
           "--heads", "4", "--heads-k", "2", "--headdim", "64", "--dtype", "float32", "--threads", "1",
           "--breakdown", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["flashattn", "flashattn_C", "flashattn_C_python_alloc",
                                         "flashattn_C_given_workspace",
                                         "flashattn_C_size_only", "to_dlpack", "torch_empty_like",
                                         "stream_and_capture_check"]
    assert all(r["us_per_call"] > 0 and (r["heads"], r["heads_k"], r["d"]) == (4, 2, 64) for r in rows)

