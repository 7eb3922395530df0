"""The benchmarks' --quick modes run end to end and print the ratios their goals name.

The figures themselves are measured with ``make bench`` (docs/results.md); these runs only
check that the scripts work with the code as it is today.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "examples" / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_zero_bubble_benchmark_runs_fxpipe_and_tdp_schedules_and_prints_the_ratios(tmp_path) -> None:
    out = run("zero_bubble.py", "--quick")
    row = next(line for line in out.splitlines() if line.startswith("tiny"))
    times = [float(v) for v in row.split()[2:]]
    assert len(times) == 6 and all(t > 0 for t in times), row  # 3 fxpipe and 3 TDP schedules
    assert re.search(r"zb-h1/1f1b \d+\.\d+x .* zb-v/TDP zbv \d+\.\d+x", out), out
    bubbles = re.findall(r"b (\d+)/(\d+)%", out)
    assert len(bubbles) == 3 and all(0 <= int(a) < 100 and 0 <= int(b) < 100 for a, b in bubbles), out


@pytest.mark.timeout(300)
def test_signatures_benchmark_compares_a_cached_signature_with_a_fresh_compile() -> None:
    out = run("signatures.py", "--quick")
    assert re.search(r"cached / compiled for the shape:\s+\d+\.\d+x", out), out
    assert "i64[*, 16]" in out and "i64[*, 32]" in out, out  # both signatures held


@pytest.mark.timeout(300)
def test_data_parallel_benchmark_prints_sharded_bytes_under_the_goal_and_every_variants_step_time() -> None:
    out = run("data_parallel.py", "--quick")
    largest = re.search(r"largest: (\d+\.\d+)x \(goal <= 0.55x\)", out)
    assert largest and float(largest.group(1)) <= 0.55, out
    for variant in ("all-reduce (fsdp=False)", "replicate()", "fsdp=True, kept gathered", "fsdp=True, freed after each action"):
        assert re.search(rf"{re.escape(variant)}\s+\d+(\.\d+)? m?s\s+\d+\.\d+x", out), (variant, out)
