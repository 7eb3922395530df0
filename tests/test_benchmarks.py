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
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
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
def test_dualpipev_benchmark_runs_fxpipe_and_tdp_dualpipev_and_prints_the_ratios() -> None:
    out = run("dualpipev.py", "--quick")
    row = next(line for line in out.splitlines() if line.startswith("tiny"))
    times = [float(v) for v in row.split()[2:]]
    assert len(times) == 3 and all(t > 0 for t in times), row  # zb-v, dualpipev, TDP dualpipev
    assert re.search(r"dualpipev/TDP dualpipev \d+\.\d+x  dualpipev/zb-v \d+\.\d+x", out), out
    assert len(re.findall(r"b \d+%", out)) == 2, out


@pytest.mark.slow  # two ranks and about 12 compiles: 2 minutes on 2 cores
@pytest.mark.timeout(300)
def test_titan_benchmark_checks_fxpipe_against_tdp_and_prints_setup_steps_memory_and_ratios(tmp_path) -> None:
    plot = tmp_path / "titan.png"
    out = run("titan.py", "--quick", "--plot", str(plot))
    gaps = re.findall(r"^  (\S+)\s+loss (\S+)  grads (\S+)$", out, re.M)
    assert [g[0] for g in gaps] == ["1f1b", "interleaved-1f1b", "zb-v", "dualpipev"], out
    assert all(float(loss) <= 1e-5 and float(grad) <= 1e-4 for _, loss, grad in gaps), out
    setup = re.findall(r"^\s+(\d+)\s+\d+\.\d+s\s+\d+\.\d+s\s+\d+\.\d+s\s+\d+\.\d+s\s+(\d+\.\d)x$", out, re.M)
    assert [int(layers) for layers, _ in setup] == [4, 8], out
    steps = re.findall(r"^  (\S+) / (Schedule\w+)\s+(\d+\.\d+)\s+(\d+\.\d+) ms\s+(\d+\.\d+)x$", out, re.M)
    assert [s[:2] for s in steps] == [("1f1b", "Schedule1F1B"), ("interleaved-1f1b", "ScheduleInterleaved1F1B"),
                                      ("zb-v", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")], out
    kept = re.findall(r"^  (\S+) kept\s+(-?\d+\.\d+)\s+(-?\d+\.\d+) MiB", out, re.M)
    assert len(kept) == 4 and all(float(ours) < 0.01 and float(theirs) > 0 for _, ours, theirs in kept), out  # TDP keeps its buffers
    assert len(re.findall(r"^  \S+ rss\s+-?\d+\.\d+\s+-?\d+\.\d+ MiB", out, re.M)) == 4, out
    assert plot.stat().st_size > 0


@pytest.mark.timeout(300)
def test_signatures_benchmark_compares_a_cached_signature_with_a_fresh_compile() -> None:
    out = run("signatures.py", "--quick")
    assert re.search(r"cached / compiled for the shape:\s+\d+\.\d+x", out), out
    assert "i64[*, 16]" in out and "i64[*, 32]" in out, out  # both signatures held


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_benchmark_prints_predicted_against_measured_the_cap_and_the_v_ratios() -> None:
    out = run("memory.py", "--quick")
    worst = re.search(r"worst peak error (\d+\.\d)%, worst activations error (\d+\.\d)% over (\d+) stages", out)
    assert worst and float(worst.group(1)) <= 15 and int(worst.group(3)) == 12, out
    assert re.search(r"auto chose: stage 0 (True|selective)", out), out
    assert re.search(r"checkpoint=True / auto step time: \d+\.\d\dx", out), out
    assert re.search(r"auto\s+\S+ ms\s+.*fits", out) and re.search(r"False\s+\S+ ms\s+.*EXCEEDS", out), out
    assert re.search(r"v-half/1f1b 0\.\d{3}x \(goal <= 0.55x\), v-min/1f1b 0\.\d{3}x", out), out


@pytest.mark.slow
def test_compile_depth_sweep_prints_both_tools_the_goals_and_the_plot(tmp_path) -> None:
    plot = tmp_path / "depth.png"
    out = run("compile.py", "--quick", "--parts", "depth", "--plot", str(plot))
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)s\s+(\d+\.\d+)s \((\d+\.\d+)x\)\s+(\d+\.\d+)s \((\d+\.\d+)x\)$", out, re.M)
    assert [int(r[0]) for r in rows] == [4, 8, 16], out  # pipeline(), explicit and auto at each depth
    goals = re.findall(r"^\s+.+?\s+(\d+\.\d+)x\s+<= [\d.]+x\s+(met|NOT met)$", out, re.M)
    assert len(goals) == 4, out
    assert plot.stat().st_size > 0
    phases = re.findall(r"^\s+(\d+)((?:\s+\d+\.\d+s){7})$", out, re.M)  # trace ... placement, gc, total
    assert [int(p[0]) for p in phases] == [4, 8, 16], out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_varlen_benchmark_prints_the_equal_length_ratio_the_padding_speed_up_and_the_shape_costs() -> None:
    out = run("varlen.py", "--quick")
    assert re.search(r"varlen / equal: \d+\.\d+x \(goal <= 1\.3\)", out), out
    assert re.search(r"speed-up over padding to the longest: \d+\.\d+x", out), out
    difference = float(re.search(r"largest loss difference (\S+)", out).group(1))
    assert difference < 1e-4, out  # padding with -100 targets scores the same tokens
    assert re.search(r"edge shapes: derive \d+\.\d+ ms per new signature, look up \d+ µs per step, exchange \d+ µs per step", out), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_parallel_benchmark_prints_sharded_bytes_under_the_goal_and_every_variants_step_time() -> None:
    out = run("data_parallel.py", "--quick")
    largest = re.search(r"largest: (\d+\.\d+)x \(goal <= 0.55x\)", out)
    assert largest and float(largest.group(1)) <= 0.55, out
    for variant in ("all-reduce (fsdp=False)", "replicate()", "fsdp=True, kept gathered", "fsdp=True, freed after each action"):
        assert re.search(rf"{re.escape(variant)}\s+\d+(\.\d+)? m?s\s+\d+\.\d+x", out), (variant, out)


@pytest.mark.compile_grid  # Inductor compiles in several processes: make test-compile, beside the grid
@pytest.mark.timeout(1200)
def test_compiled_benchmark_times_eager_and_compiled_stages_and_loops_and_prints_both_ratios() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "compiled.py"), "--quick"], capture_output=True, text=True, timeout=1180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for variant in ("fxpipe eager stages", "fxpipe compile=True", "eager loop", "torch.compile loop"):
        row = next(line for line in out.splitlines() if line.startswith(variant))
        assert float(row.split()[-2]) > 0, row
    assert re.search(r"compiled/eager: fxpipe \(2\)/\(1\) \d+\.\d+x  loop \(4\)/\(3\) \d+\.\d+x", out), out
    assert re.search(r"stage 0: \d+ graph\(s\) compiled in \d+\.\d s; .*stage 1: \d+ graph\(s\) compiled", out), out
    for variant in ("1f1b eager", "zb-h1 eager", "1f1b compiled", "zb-h1 compiled, per-op split", "zb-h1 compiled, graph split", "TDP 1f1b, compiled blocks"):
        assert re.search(rf"^{re.escape(variant)}\s+\d+\.\d+ ms$", out, re.M), (variant, out)
    assert re.search(r"graph split / per-op split \(compiled\) \d+\.\d+x", out), out
    cold_warm = re.findall(r"stage (\d): \d+ graph\(s\) compiled in \S+ s, backward split into I and W\s+cold\s+(\S+) s\s+warm\s+(\S+) s", out)
    assert [stage for stage, _, _ in cold_warm] == ["0", "1"], out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compile_titan_part_prints_the_manual_split_ratios_and_issue_33s_goals() -> None:
    out = run("compile.py", "--quick", "--parts", "titan")
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)s\s+(\d+\.\d+)s\s+(\d+\.\d+)x$", out, re.M)
    assert [int(r[0]) for r in rows] == [4, 8, 16], out  # fxpipe.compile and the manual split at each depth
    assert re.search(r"split='auto' on a 1,000-node stack, 4 stages, seconds per phase .*\n\s+trace \d+\.\d\d, .*total \d+\.\d\d", out), out
    goals = re.findall(r"^\s+.+?\s+(\d+\.\d+)(x|s)\s+<= [\d.]+(x|s)\s+(met|NOT met)$", out, re.M)
    assert len(goals) == 3, out
