"""Shared fixtures of the Python suite. Tests that need PyTorch import it with
pytest.importorskip, so a NumPy-only environment reports them as skipped with the reason."""

from __future__ import annotations

import numpy as np
import pytest

import flashattn


def torch_devices():
    """Devices the PyTorch tests run on: the CPU, and CUDA where a GPU is visible. CUDA tests
    are skipped, with the reason, on a build without the CUDA backend."""
    try:
        import torch
    except ImportError:
        return ["cpu"]
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append(
            pytest.param(
                "cuda",
                marks=pytest.mark.skipif(
                    "cuda" not in flashattn.compiled_backends(),
                    reason="a GPU is visible but this build has no CUDA backend (-DFLASHATTN_CUDA=ON)",
                ),
            )
        )
    return devices


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed per test: inputs are fresh random values, never zeros."""
    return np.random.default_rng(20240611)


def pytest_collection_modifyitems(config, items):
    """fp32 inputs are a CPU-only dtype (SPEC §1): the CUDA variants of fp32 cases report as skipped
    with that reason, and test_fp32_rejected_on_cuda checks the error CUDA gives instead."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        if callspec.params.get("device") == "cuda" and str(callspec.params.get("dtype")) == "torch.float32":
            item.add_marker(pytest.mark.skip(
                reason="fp32 is a CPU-only dtype (SPEC §1); test_fp32_rejected_on_cuda checks the CUDA error"))
