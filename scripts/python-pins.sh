# scripts/python-pins.sh — the pinned versions of the Python package's build and test dependencies,
# sourced by scripts/test-python (a virtual environment here, from PyPI) and scripts/stage-gpu-deps
# (wheels for the GPU machine, which reaches no registry), so that both install the same ones.
# shellcheck shell=bash
readonly nanobind_version=3.1.0
readonly scikit_build_core_version=1.1.2
readonly numpy_version=2.4.6
readonly pytest_version=9.2.0
readonly ml_dtypes_version=0.6.0
readonly matplotlib_version=3.11.2  # plots of bench/make_report.py (its dry-run test draws them)
readonly torch_version=2.11.0  # the version on the project's GPU machine
readonly ring_flash_attn_version=0.1.8  # ring-flash-attention's own tests (tools/ring-tests), from its source distribution
readonly transformers_version=5.23.0  # flashattn.integrations.transformers is written and tested against it (with torch 2.11)
readonly pytest_xdist_version=3.8.0  # the GPU machine's suite runs on 16 workers (scripts/gpu-check)
