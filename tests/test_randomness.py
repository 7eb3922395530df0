"""Randomness as a contract, end to end: dropout under every schedule, split, checkpoint.

After ``torch.manual_seed(s)`` a step draws one seed from the caller's generator; every
random op of micro-batch i draws from (that seed, i's global index, the op's key). So two
runs are bitwise equal and every schedule, every split and checkpointing give the same
masks (graph-level tests of the rewrite are in test_rng.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_grads_match
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_random_models import RandomDag
from torch import nn

import fxpipe
from fxpipe.passes.keyed import draw_seed
from fxpipe.runtime.context import StepContext

CE = nn.CrossEntropyLoss()


class DropoutMLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4, p: float = 0.3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.ModuleList(nn.Dropout(p) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, drop in zip(self.layers, self.drop):
            x = drop(torch.tanh(layer(x)))
        return self.head(x)


def run(model: nn.Module, plan: dict, x: torch.Tensor, t: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, dict]:
    pipe = fxpipe.compile(copy.deepcopy(model), plan, example_inputs=(x,), loss_fn=CE)
    torch.manual_seed(seed)
    loss = pipe.step(x, target=t)
    return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}


PLANS = {
    "one stage": dict(microbatches=4),
    "gpipe": dict(devices=["cpu:0", "cpu:1"], split=["layers.2"], schedule="gpipe", microbatches=4),
    "1f1b": dict(devices=["cpu:0", "cpu:1"], split=["layers.2"], schedule="1f1b", microbatches=4),
    "4 stages": dict(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], split=["layers.1", "layers.2", "layers.3"], microbatches=4),
    "interleaved": dict(devices=["cpu:0", "cpu:1"], split=["layers.1", "layers.2", "layers.3"], schedule="interleaved-1f1b", chunks=2, microbatches=4),
    "checkpoint": dict(devices=["cpu:0", "cpu:1"], split=["layers.2"], microbatches=4, checkpoint=True),
}


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_every_schedule_split_and_checkpoint_draws_the_same_masks(frontend: str) -> None:
    model = DropoutMLP().double()
    x, t = torch.randn(10, 16, dtype=torch.float64), torch.randint(0, 3, (10,))
    results = {name: run(model, {**plan, "frontend": frontend}, x, t) for name, plan in PLANS.items()}
    loss, grads = results["one stage"]
    for name, (other_loss, other_grads) in results.items():
        torch.testing.assert_close(other_loss, loss, rtol=1e-13, atol=1e-13, msg=name)
        for key, g in grads.items():
            torch.testing.assert_close(other_grads[key], g, rtol=1e-12, atol=1e-13, msg=f"{name}: {key}")
    # no test passes by dropout being off: training differs from eval
    pipe = fxpipe.compile(copy.deepcopy(model), PLANS["1f1b"], example_inputs=(x,), loss_fn=CE)
    with torch.no_grad():
        train_out = pipe(x)
        pipe.eval()
        torch.testing.assert_close(pipe(x), model.eval()(x))  # eval: no dropout at all
    assert not torch.allclose(train_out, model(x))


def test_two_runs_are_bitwise_equal_and_the_callers_generator_advances_once() -> None:
    model, x, t = DropoutMLP(), torch.randn(8, 16), torch.randint(0, 3, (8,))
    first, second = run(model, PLANS["1f1b"], x, t), run(model, PLANS["1f1b"], x, t)
    assert torch.equal(first[0], second[0]) and all(torch.equal(first[1][k], second[1][k]) for k in first[1])
    pipe = fxpipe.compile(copy.deepcopy(model), PLANS["gpipe"], example_inputs=(x,), loss_fn=CE)
    torch.manual_seed(3)
    pipe.step(x, target=t)
    after_step = torch.rand(3)
    torch.manual_seed(3)
    torch.empty((), dtype=torch.int64).random_()  # exactly one draw per step
    assert torch.equal(torch.rand(3), after_step)


def test_one_dropout_equals_eager_dropout_drawing_from_the_same_seed() -> None:
    """Eager reference: micro-batch i's dropout draws from a generator seeded as fxpipe seeds it."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.4), nn.Linear(16, 3)).double()
    x, t = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, PLANS["1f1b"] | {"split": ["3"]}, example_inputs=(x,), loss_fn=CE)
    torch.manual_seed(11)
    loss = pipe.step(x, target=t)
    torch.manual_seed(11)
    ctx = StepContext.capture(train=True, random=True)
    total = 0.0
    for i, (xi, ti) in enumerate(zip(x.split(2), t.split(2))):
        torch.manual_seed(draw_seed(ctx.rng_seed(i), 0))  # the only random node has key 0
        part = CE(ref(xi), ti) * 0.25
        part.backward()
        total += part.detach()
    torch.testing.assert_close(loss, total, rtol=1e-14, atol=1e-14)
    assert_grads_match(pipe, ref, rtol=1e-13, atol=1e-14)


def test_micro_batches_draw_different_masks() -> None:
    model = nn.Sequential(nn.Dropout(0.5))
    x = torch.ones(8, 64)
    pipe = fxpipe.compile(model, dict(microbatches=4), example_inputs=(x,))
    with torch.no_grad():
        out = pipe(x)
    masks = [m.ne(0) for m in out.split(2)]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_batchnorm_running_statistics_update_once_per_micro_batch_under_checkpoint(frontend: str, schedule: str) -> None:
    model = ConvBN().double()
    x, t = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    ref = copy.deepcopy(model)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["conv2"], microbatches=4, checkpoint=True, schedule=schedule, frontend=frontend)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    pipe.step(x, target=t)
    for xi, ti in zip(x.split(2), t.split(2)):
        (CE(ref(xi), ti) * 0.25).backward()
    state = pipe.state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12, msg=key)
    assert int(state["bn.num_batches_tracked"]) == 4
    assert_grads_match(pipe, ref, rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 5), st.lists(st.sampled_from(["tanh", "relu", "silu"]), min_size=5, max_size=5), st.integers(1, 4), st.integers(0, 2**16))
def test_random_models_with_dropout_give_one_result_under_every_schedule(depth: int, activations: list[str], m: int, seed: int) -> None:
    torch.manual_seed(seed)
    base = RandomDag(6, list(range(depth)), [None] * depth, activations[:depth]).double()
    model = nn.Sequential(base, nn.Dropout(0.3), nn.Linear(3, 3)).double()
    x, t = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    cut = ["0.layers.1"]
    plans = [
        dict(microbatches=m),
        dict(devices=["cpu:0", "cpu:1"], split=cut, schedule="gpipe", microbatches=m),
        dict(devices=["cpu:0", "cpu:1"], split=cut, schedule="1f1b", microbatches=m, checkpoint=True),
    ]
    results = [run(model, plan, x, t, seed) for plan in plans]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-12, atol=1e-13)
        for key, g in results[0][1].items():
            torch.testing.assert_close(grads[key], g, rtol=1e-11, atol=1e-13, msg=key)
