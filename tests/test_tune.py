"""Micro-batch tuning: a U-shaped predicted curve, a plan back, a plot of predicted vs measured."""

from __future__ import annotations

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


def test_tune_predicts_dualpipev_from_its_least_count_on_a_v_plan() -> None:
    """dualpipev runs at least 2p - 1 micro-batches (3 on 2 workers): the sweep finds it among
    the schedules that keep a V's stages in place, and predicts it only from that count."""
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2", "4", "6"], schedule="zb-v", chunks=2)
    points = sweep(model(), plan, (X,), candidates=[1, 2, 4, 8], measure=0)
    counts: dict[str, list[int]] = {}
    for point in points:
        counts.setdefault(point.schedule, []).append(point.microbatches)
    assert counts == {"zb-v": [1, 2, 4, 8], "v-half": [1, 2, 4, 8], "v-min": [1, 2, 4, 8], "dualpipev": [4, 8]}
