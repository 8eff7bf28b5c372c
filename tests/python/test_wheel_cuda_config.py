"""What `pip install .` decides about the CUDA backend (python/flashattn_wheel_cuda.cmake), run
in CMake's script mode with the environment of each case: FLASHATTN_CUDA, FLASHATTN_CUDA_ARCHS,
TORCH_CUDA_ARCH_LIST, a GPU that nvidia-smi lists, and none of them; plus what this installation
says it was built with."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import flashattn

MODULE = Path(__file__).resolve().parents[2] / "python" / "flashattn_wheel_cuda.cmake"
CMAKE = shutil.which("cmake")
pytestmark = pytest.mark.skipif(CMAKE is None, reason="cmake is not on the PATH")


def decide(tmp_path, env, defines=()):
    """Runs the module with only `env` (plus a PATH of tmp_path/bin) -> (FLASHATTN_CUDA,
    architectures, summary)."""
    driver = tmp_path / "driver.cmake"
    driver.write_text(f'include("{MODULE}")\n'
                      'message(STATUS "RESULT|${FLASHATTN_CUDA}|${CMAKE_CUDA_ARCHITECTURES}|'
                      '${FLASHATTN_WHEEL_CUDA_SUMMARY}")\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    full_env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CUDA_HOME": str(tmp_path / "no-cuda"), **env}
    # The CUTLASS location is given so that no case tries to install the headers.
    args = [CMAKE, f"-DFLASHATTN_CUTLASS_DIR={tmp_path}", *defines, "-P", str(driver)]
    result = subprocess.run(args, env=full_env, capture_output=True, text=True, check=True)
    line = next(x for x in result.stdout.splitlines() if "RESULT|" in x)
    _, cuda, archs, summary = line.split("|", 3)
    return cuda, archs, summary


def fake_tool(tmp_path, name, output=""):
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    path.chmod(0o755)
    return str(path)


def test_off_is_cpu_only(tmp_path):
    nvcc = fake_tool(tmp_path, "nvcc")
    fake_tool(tmp_path, "nvidia-smi", "9.0\\n")
    cuda, _, summary = decide(tmp_path, {"FLASHATTN_CUDA": "OFF", "CUDACXX": nvcc})
    assert cuda == "OFF" and summary.startswith("CPU-only") and "FLASHATTN_CUDA=OFF" in summary


def test_auto_builds_for_the_gpus_found(tmp_path):
    nvcc = fake_tool(tmp_path, "nvcc")
    fake_tool(tmp_path, "nvidia-smi", "9.0\\n8.6\\n9.0\\n")
    cuda, archs, summary = decide(tmp_path, {"CUDACXX": nvcc})
    assert cuda == "ON" and archs == "90a;86"
    assert "built for sm 90a;86" in summary and "nvidia-smi" in summary


def test_torch_cuda_arch_list(tmp_path):
    """PyTorch's spelling; sm_75 has no kernels and is left out; FLASHATTN_CUDA_ARCHS wins."""
    nvcc = fake_tool(tmp_path, "nvcc")
    cuda, archs, summary = decide(tmp_path, {"CUDACXX": nvcc, "TORCH_CUDA_ARCH_LIST": "7.5;8.0 9.0+PTX"})
    assert (cuda, archs) == ("ON", "80;90a") and "TORCH_CUDA_ARCH_LIST" in summary
    cuda, archs, _ = decide(tmp_path, {"CUDACXX": nvcc, "TORCH_CUDA_ARCH_LIST": "8.0",
                                       "FLASHATTN_CUDA_ARCHS": "sm_89"})
    assert (cuda, archs) == ("ON", "89")


def test_auto_without_a_target_is_cpu_only(tmp_path):
    """nvcc but no GPU and no architecture list (this CI machine): a CPU-only build that says why."""
    nvcc = fake_tool(tmp_path, "nvcc")
    cuda, archs, summary = decide(tmp_path, {"CUDACXX": nvcc})
    assert cuda == "OFF" and archs == "" and "no GPU visible" in summary
    cuda, _, _ = decide(tmp_path, {"CUDACXX": nvcc, "TORCH_CUDA_ARCH_LIST": "7.0"})
    assert cuda == "OFF"


def test_explicit_define_wins(tmp_path):
    nvcc = fake_tool(tmp_path, "nvcc")
    cuda, archs, _ = decide(tmp_path, {"CUDACXX": nvcc, "FLASHATTN_CUDA": "ON"},
                            ["-DFLASHATTN_CUDA=OFF"])
    assert cuda == "OFF"
    cuda, archs, _ = decide(tmp_path, {"CUDACXX": nvcc, "FLASHATTN_CUDA_ARCHS": "80"},
                            ["-DCMAKE_CUDA_ARCHITECTURES=90a"])
    assert (cuda, archs) == ("ON", "90a")


def test_auto_with_a_gpu_but_no_cutlass_stops(tmp_path):
    """A GPU and nvcc found but the CUTLASS headers not installable (no registry): the install stops
    with a message saying how to go on, rather than leaving a CPU-only package on a GPU machine."""
    tree = tmp_path / "tree"
    (tree / "python").mkdir(parents=True)
    (tree / "scripts").mkdir()
    module = tree / "python" / MODULE.name
    module.write_text(MODULE.read_text())
    (tree / "scripts" / "setup-cuda").write_text("echo 'setup-cuda: no network' >&2\nexit 1\n")
    nvcc = fake_tool(tmp_path, "nvcc")
    fake_tool(tmp_path, "nvidia-smi", "9.0\n")
    driver = tmp_path / "driver.cmake"
    driver.write_text(f'include("{module}")\n')
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "CUDACXX": nvcc}
    result = subprocess.run([CMAKE, "-P", str(driver)], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    message = " ".join(result.stderr.split())
    assert "could not install the CUTLASS headers" in message and "FLASHATTN_CUDA=OFF" in message
    assert "FLASHATTN_CUTLASS_DIR" in message
    # Given the headers' location, or OFF, it goes on.
    cuda, _, _ = decide(tmp_path, {"CUDACXX": nvcc})
    assert cuda == "ON"
    cuda, _, _ = decide(tmp_path, {"CUDACXX": nvcc, "FLASHATTN_CUDA": "OFF"})
    assert cuda == "OFF"


def test_installed_build_says_what_it_built():
    config = flashattn.build_config()
    has_cuda = "cuda" in flashattn.compiled_backends()
    assert config.startswith("CUDA backend built") == has_cuda, config
    assert "AUTO" in config or "FLASHATTN_CUDA" in config or "CMAKE_CUDA_ARCHITECTURES" in config
    if os.environ.get("FLASHATTN_CUDA", "").upper() == "OFF":
        assert not has_cuda
