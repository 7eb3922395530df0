"""The fxpipe command: inspect and train end to end, model specs, inputs, plans, errors."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch
from test_dot import SkipNet

from fxpipe import cli

SMALL_RESNET = ["torchvision:resnet18", "--model-arg", "num_classes=10", "--input", "4x3x32x32"]


def _fxpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("fxpipe")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fxpipe.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_inspect_prints_the_summary_and_writes_drawing_timeline_and_trace(tmp_path):
    done = _fxpipe("inspect", *SMALL_RESNET, "--stages", "2", "--split", "layer3", "--format", "png", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "2 stage(s), schedule 1f1b, 4 micro-batch(es)" in done.stdout
    assert "layer3.0.conv1" in done.stdout and "bubble" in done.stdout
    out = tmp_path / "out"
    assert matplotlib.image.imread(out / "partition.png").shape[0] > 100
    assert matplotlib.image.imread(out / "timeline-predicted.png").shape[1] > 100
    trace = json.loads((out / "trace-predicted.json").read_text())["traceEvents"]
    assert len(trace) == 2 * 2 * 4  # two stages, forward and backward, four micro-batches


def test_train_runs_steps_with_a_progress_bar_and_writes_the_measured_timeline(tmp_path):
    done = _fxpipe(
        "train", *SMALL_RESNET, "--stages", "2", "--split", "layer3", "--schedule", "gpipe",
        "--microbatches", "2", "--steps", "2", "--out", str(tmp_path), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "2/2" in done.stderr and "loss=" in done.stderr
    assert "measured timeline: 2 workers" in done.stdout
    trace = json.loads((tmp_path / "trace-measured.json").read_text())["traceEvents"]
    compute = [e for e in trace if e["name"].startswith(("F", "B"))]
    assert len(compute) == 2 * 2 * 2  # two stages, forward and backward, two micro-batches
    assert len(trace) >= len(compute)  # plus the spans where a worker waited (recv)
    assert matplotlib.image.imread(tmp_path / "timeline.png").shape[0] > 100


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "inspect" in capsys.readouterr().out
    for command, options in (
        ("inspect", ["--stages", "--devices", "--split", "--schedule", "--microbatches", "--input", "--level", "--format", "--out"]),
        ("train", ["--stages", "--devices", "--split", "--schedule", "--microbatches", "--input", "--steps", "--lr", "--loss"]),
    ):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert all(option in text for option in options)
        assert "torchvision:NAME" in text and "examples:" in text


def test_bad_model_spec_exits_2_with_a_one_line_message(capsys):
    assert cli.main(["inspect", "no_such_package_xyz:build"]) == 2
    assert "cannot import 'no_such_package_xyz'" in capsys.readouterr().err
    assert cli.main(["inspect", "torchvision:not_a_model"]) == 2
    assert "torchvision.models.list_models()" in capsys.readouterr().err


def test_load_model_from_a_module_factory_a_class_and_a_file(tmp_path):
    model = cli.load_model("torchvision.models:resnet18", {"num_classes": 3})
    assert model.fc.out_features == 3
    assert isinstance(cli.load_model("test_dot:SkipNet"), SkipNet)
    path = tmp_path / "mynet.py"
    path.write_text("from torch import nn\n\ndef build_model(width=4):\n    return nn.Linear(width, 2)\n")
    assert cli.load_model(str(path), {"width": 5}).in_features == 5
    assert cli.load_model(f"{path}:build_model").in_features == 4
    with pytest.raises(cli.CommandError, match="defines none of nope"):
        cli.load_model(f"{path}:nope")
    with pytest.raises(cli.CommandError, match="no file"):
        cli.load_model(str(tmp_path / "missing.py"))


def test_inputs_and_model_args_parse():
    x, ids = cli.example_inputs(["2x3x8x8", "2x5:int64"])
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.float32
    assert ids.dtype == torch.int64 and set(ids.unique().tolist()) <= {0, 1}
    with pytest.raises(cli.CommandError, match="joined by x"):
        cli.example_inputs(["2by3"])
    with pytest.raises(cli.CommandError, match="torch dtype"):
        cli.example_inputs(["2x3:float99"])
    assert cli.parse_model_args(["num_classes=10", "name=tiny", "flags=(1, 2)"]) == {
        "num_classes": 10, "name": "tiny", "flags": (1, 2),
    }


def _plan_args(**overrides) -> argparse.Namespace:
    args = {"stages": None, "devices": None, "split": None, "schedule": "1f1b", "microbatches": 4,
            "chunks": 1, "checkpoint": False, "frontend": "auto"}
    return argparse.Namespace(**{**args, **overrides})


def test_plan_from_args_places_stages_on_logical_cpus_and_defaults_the_split():
    plan = cli.plan_from_args(_plan_args(stages=3))
    assert plan.devices == ["cpu:0", "cpu:1", "cpu:2"] and plan.split == "auto"
    plan = cli.plan_from_args(_plan_args(devices="cpu,cuda:0", split="layer2, layer3"))
    assert plan.devices == ["cpu", "cuda:0"] and plan.split == ["layer2", "layer3"]
    plan = cli.plan_from_args(_plan_args(stages=4, chunks=2, schedule="interleaved-1f1b"))
    assert plan.devices == ["cpu:0", "cpu:1"]
    assert cli.plan_from_args(_plan_args()).split == "tags"
    with pytest.raises(cli.CommandError, match="needs 2"):
        cli.plan_from_args(_plan_args(stages=2, devices="cpu:0,cpu:1,cpu:2"))


def test_targets_fit_the_loss_and_the_output_shape():
    generator = torch.Generator().manual_seed(0)
    labels = cli.make_target("cross-entropy", torch.empty(6, 10), generator)
    assert labels.shape == (6,) and labels.max() < 10
    assert cli.make_target("mse", torch.empty(6, 4), generator).shape == (6, 4)
    assert cli.make_target("output", None, generator) is None
    with pytest.raises(cli.CommandError, match="--loss output"):
        cli.make_target("mse", (torch.empty(1),), generator)


def test_schedule_choices_are_every_schedule() -> None:
    from fxpipe.schedules import SCHEDULES

    assert cli.SCHEDULE_CHOICES == SCHEDULES
