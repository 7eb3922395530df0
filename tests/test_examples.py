"""Every example in examples/ runs end to end in a reduced size (``--smoke``).

Each script's ``main(argv)`` is called in-process and returns what it measured; the
assertions pin the behaviour the example demonstrates (pipelined equals eager), not its
speed.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module", autouse=True)
def _examples_on_path():
    # the examples set one intra-op thread per process; later tests get back what they had
    threads = torch.get_num_threads()
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))
    torch.set_num_threads(threads)


def example(name: str):
    return importlib.import_module(name)


@pytest.mark.parametrize("model", ["resnet50", "embedding"])
def test_device_guard_example_matches_eager_and_falls_back_to_cpu(model, capsys):
    result = example("device_guard_resnet").main(["--smoke", "--model", model])
    assert result["grad_difference"] < 1e-4
    out = capsys.readouterr().out
    assert "first step: loss" in out and "samples/s" in out


def test_demo_smoke_matches_eager(capsys):
    result = example("demo").main(["--smoke"])
    assert result["grad_difference"] < 1e-4
    assert abs(result["loss"] - result["eager_loss"]) < 1e-4
    assert "step 1: loss" in capsys.readouterr().out


def test_one_f_one_b_digits_loss_curves_equal_eager():
    eager, *pipelined = example("one_f_one_b_digits").main(["--smoke", "--no-progress"])
    assert [r.label for r in pipelined] == ["1f1b", "interleaved-1f1b"]
    for run in pipelined:
        assert len(run.losses) == len(eager.losses) == 2
        assert run.largest_difference(eager) < 1e-4


def test_train_digits_per_step_losses_equal_eager(tmp_path):
    plot = tmp_path / "loss.png"
    pipelined, eager = example("train_digits").main(["--smoke", "--no-progress", "--plot", str(plot)])
    assert len(pipelined.losses) == 4
    assert pipelined.largest_difference(eager) < 1e-4
    assert pipelined.accuracies == eager.accuracies
    assert plot.stat().st_size > 0


def test_model_parallel_sweep_writes_bar_chart_and_sweep_plot(tmp_path):
    result = example("model_parallel_sweep").main(["--smoke", "--out", str(tmp_path)])
    assert [p.microbatches for p in result["points"]] == [1, 2, 4]
    assert all(p.measured_step is not None for p in result["points"])
    assert result["best"] in (1, 2, 4)
    assert {"single device", "model parallel", "pipelined (2 mb)"} <= set(result["results"])
    assert (tmp_path / "model-parallel-bars.png").stat().st_size > 0
    assert (tmp_path / "model-parallel-sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_data_parallel_two_stages_two_replicas_match_eager():
    # a fresh interpreter: fxpipe.distributed.launch starts one forkserver per process,
    # and its children must import this example by name
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "data_parallel.py"), "--smoke", "--stages", "2"],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "world 4: 2 stage(s) x 2 replicas" in done.stdout
    assert "largest gradient difference over all ranks" in done.stdout


def test_heterogeneous_placement_compares_placement_offload_recompute_and_the_planner(tmp_path):
    plot = tmp_path / "placement.png"
    results = {o.name: o for o in example("heterogeneous_placement").main(["--smoke", "--plot", str(plot)])}
    assert list(results) == ["all on the GPU", "host embedding", "offload", "recompute", "planner", "planner, no offload"]
    budget = 3.2e6
    assert results["all on the GPU"].predicted_memory > budget  # the model does not fit as it is
    for name in ("host embedding", "recompute", "planner", "planner, no offload"):
        assert results[name].predicted_memory <= budget, name
    assert results["recompute"].predicted_step > results["all on the GPU"].predicted_step  # recompute costs time
    assert results["planner, no offload"].predicted_step <= results["recompute"].predicted_step
    for o in results.values():
        if o.measured_memory is not None:  # measured where it runs here
            # two stages on one device: the prediction adds their peaks, which the run may
            # reach at different times (how far apart depends on the threads' timing)
            assert 0.7 * o.predicted_memory <= o.measured_memory <= 1.01 * o.predicted_memory, o
            assert o.measured_step > 0
    assert results["offload"].measured_memory is None or torch.cuda.is_available()
    assert plot.stat().st_size > 0


def test_llm_example_trains_gpt2_equal_to_eager(tmp_path):
    # every batch has its own sequence length (a compile per signature) and epochs end short
    drawing = tmp_path / "split.png"
    result = example("llm").main(["--smoke", "--draw", str(drawing)])
    assert len(result["losses"]) == 6
    assert result["largest_difference"] < 1e-4
    assert drawing.stat().st_size > 0


def test_torchrun_timeline_example_gathers_every_rank_into_one_chart_and_trace(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "fxpipe.distributed", "-n", "2", str(EXAMPLES / "torchrun_timeline.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks, 1f1b, 2 micro-batches" in done.stdout
    assert "rank 0 (cpu): busy" in done.stdout and "rank 1 (cpu): busy" in done.stdout
    assert "each rank's own events alone: bubble rank 0" in done.stdout
    trace = json.loads((tmp_path / "torchrun-trace.json").read_text())["traceEvents"]
    assert sorted(e["args"]["name"] for e in trace if e["name"] == "process_name") == ["rank 0: stage 0, cpu", "rank 1: stage 1, cpu"]
    assert (tmp_path / "torchrun-timeline.png").stat().st_size > 0


def test_every_example_script_takes_smoke():
    """docs/examples.md promises --smoke of every scenario script (the docs tool aside)."""
    scripts = [p for p in sorted(EXAMPLES.glob("*.py")) if "__main__" in p.read_text() and p.name != "refresh_docs.py"]
    assert len(scripts) >= 10
    missing = [p.name for p in scripts if '"--smoke"' not in p.read_text() and "add_training_options(" not in p.read_text()]
    assert not missing, f"examples without --smoke: {missing}"
