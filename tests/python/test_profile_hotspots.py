"""scripts/profile-hotspots.py on a small page in the layout of Nsight Compute's source-page CSV
(notes before the table, thousands separators, predicated instructions): the totals, the shares by
opcode and the ranking come out of the numbers given, and a page without sampling is refused."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(REPO, "scripts", "profile-hotspots.py")

PAGE = """==PROF== Connected to process
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_mio_throttle","stall_long_sb"
"00007f10","LDSM.16.M88.4 R4, [R2]","1,200","1,100","640","900","0"
"00007f20","HMMA.16816.F32.BF16 R8, R4, R6, R8","300","200","2,560","0","0"
"00007f30","@!P0 STS [R3], R9","2,500","2,400","320","2,000","100"
"00007f40","STS [R3+0x10], R10","0","0","320","0","0"
"""


def run(tmp_path, text, *args):
    path = tmp_path / "page.csv"
    path.write_text(text)
    return subprocess.run([sys.executable, SCRIPT, str(path), *args], capture_output=True, text=True)


def test_ranks_instructions_and_opcodes_by_samples(tmp_path):
    r = run(tmp_path, PAGE, "--top", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "4 instructions, 4000 warp-state samples" in out
    lines = out.splitlines()
    ops = lines[lines.index("samples by opcode:") + 1:][:3]
    assert ops[0].split() == ["STS", "62.5%"]  # 2500 of 4000, the predicate stripped
    assert ops[1].split() == ["LDSM", "30.0%"]
    assert ops[2].split() == ["HMMA", "7.5%"]
    ranked = [l for l in lines if l.startswith("  ") and "executed" in l]
    assert len(ranked) == 2
    assert "@!P0 STS" in ranked[0] and "62.50%" in ranked[0] and "executed 320" in ranked[0]
    assert "stall_mio_throttle 2000" in ranked[0] and "stall_long_sb 100" in ranked[0]
    assert "LDSM" in ranked[1] and "executed 640" in ranked[1]


def test_a_page_without_sampling_is_refused(tmp_path):
    r = run(tmp_path, '"# Address","Source","Instructions Executed"\n"0010","NOP","5"\n')
    assert r.returncode != 0
    assert "no Source or warp-state sampling column" in r.stderr
