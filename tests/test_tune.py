"""Micro-batch tuning: a U-shaped predicted curve, a plan back, a plot of predicted vs measured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.schedules import SCHEDULES
from fxpipe.tune import sweep


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(6)], nn.Linear(128, 4))


X = torch.randn(256, 128)
T = torch.randint(0, 4, (256,))
PLAN = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], split="auto")


def test_predicted_step_time_is_u_shaped_in_the_microbatch_count() -> None:
    points = sweep(model(), PLAN, (X,), candidates=[1, 2, 4, 8, 16, 32, 64, 128, 256], measure=0, schedules=["1f1b"])
    times = [p.predicted_step for p in points]
    best = times.index(min(times))
    assert 0 < best < len(times) - 1
    assert all(p.measured_step is None and p.fits for p in points)


def test_tune_returns_the_plan_with_the_best_measured_count(tmp_path) -> None:
    path = tmp_path / "tune.png"
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    best = fxpipe.tune(net, PLAN, (X,), nn.CrossEntropyLoss(), T, plot=path, candidates=[1, 4, 16, 64], measure=2, repeats=1)
    assert isinstance(best, fxpipe.Plan) and best.microbatches in (1, 4, 16, 64)
    assert best.devices == PLAN.devices and best.split == "auto"
    assert path.stat().st_size > 0
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert all(p.grad is None for p in net.parameters())  # the measured pipelines ran on copies


def test_counts_that_do_not_fit_memory_are_not_chosen() -> None:
    tight = fxpipe.DeviceSpec(flops=1e10, memory=0.9e6, bandwidth=1e9)
    plan = PLAN.replace(device_specs={"cpu": fxpipe.DeviceSpec(flops=1e10, memory=1e9, bandwidth=1e9)})
    points = sweep(model(), plan, (X,), candidates=[1, 8, 64], measure=0, schedules=["1f1b"])
    small = plan.replace(device_specs={"cpu": tight})
    fits = {p.microbatches: p.fits for p in sweep(model(), small, (X,), candidates=[1, 8, 64], measure=0, schedules=["1f1b"])}
    assert all(p.fits for p in points)
    assert not fits[1] and fits[64]
    assert fxpipe.tune(model(), small, (X,), candidates=[1, 8, 64], measure=0).microbatches != 1


def test_tune_chooses_among_schedules_by_prediction() -> None:
    """GPipe keeps every micro-batch's activations, 1F1B at most one per stage ahead: with
    memory for 1F1B's peak and not GPipe's, tune picks the fastest predicted schedule that fits."""
    plan = PLAN.replace(device_specs={"cpu": fxpipe.DeviceSpec(flops=1e10, memory=1e9, bandwidth=1e9)})
    points = sweep(model(), plan, (X,), candidates=[4, 16], measure=0)
    # the plan's schedule first, then every built-in one that keeps the stages on their workers
    runnable = ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1"]
    assert set(runnable) <= set(SCHEDULES)
    assert [(p.schedule, p.microbatches) for p in points] == [(s, m) for s in runnable for m in (4, 16)]
    memory = {(p.schedule, p.microbatches): p.predicted_memory for p in points}
    assert memory[("gpipe", 16)] > memory[("1f1b", 16)]
    limit = (memory[("gpipe", 16)] + memory[("1f1b", 16)]) / 2
    tight = plan.replace(device_specs={"cpu": fxpipe.DeviceSpec(flops=1e10, memory=limit, bandwidth=1e9)})
    fitting = [p for p in sweep(model(), tight, (X,), candidates=[16], measure=0) if p.fits]
    assert "gpipe" not in {p.schedule for p in fitting} and "1f1b" in {p.schedule for p in fitting}
    best = fxpipe.tune(model(), tight, (X,), candidates=[16], measure=0)
    assert best.schedule == min(fitting, key=lambda p: p.predicted_step).schedule and best.microbatches == 16


def with_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def test_a_failing_candidate_is_named_and_skipped_and_the_sweep_goes_on(tmp_path) -> None:
    """A micro-batch of one sample breaks BatchNorm in training: that candidate is reported
    (in the point, a warning and the plot), the others are measured."""
    x, t = torch.randn(8, 8), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["3"])
    path = tmp_path / "sweep.png"
    with pytest.warns(UserWarning, match=r"fxpipe.tune: candidate 1f1b x 8 .*Expected more than 1 value per channel.*skipped, the sweep goes on"):
        points = sweep(with_batchnorm(), plan, (x,), nn.CrossEntropyLoss(), t, candidates=[2, 4, 8], measure=[2, 4, 8], repeats=1, schedules=["1f1b"])
    by_count = {p.microbatches: p for p in points}
    assert by_count[8].error is not None and "Expected more than 1 value per channel" in by_count[8].error
    assert by_count[8].measured_step is None and by_count[8].name == "1f1b x 8"
    assert all(by_count[m].measured_step > 0 and by_count[m].error is None for m in (2, 4))
    with pytest.warns(UserWarning, match="1f1b x 8"):
        best = fxpipe.tune(with_batchnorm(), plan, (x,), nn.CrossEntropyLoss(), t, plot=path, candidates=[2, 4, 8], measure=3, repeats=1, schedules=["1f1b"])
    assert best.microbatches in (2, 4)
    assert path.stat().st_size > 0


def test_tune_sweep_is_reachable_from_fxpipe_tune() -> None:
    assert fxpipe.tune.sweep is sweep


def test_tune_predicts_dualpipev_from_its_least_count_on_a_v_plan() -> None:
    """dualpipev runs at least 2p - 1 micro-batches (3 on 2 workers): the sweep finds it among
    the schedules that keep a V's stages in place, and predicts it only from that count."""
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2", "4", "6"], schedule="zb-v", chunks=2)
    points = sweep(model(), plan, (X,), candidates=[1, 2, 4, 8], measure=0)
    counts: dict[str, list[int]] = {}
    for point in points:
        counts.setdefault(point.schedule, []).append(point.microbatches)
    assert counts == {"zb-v": [1, 2, 4, 8], "v-half": [1, 2, 4, 8], "v-min": [1, 2, 4, 8], "dualpipev": [4, 8]}
