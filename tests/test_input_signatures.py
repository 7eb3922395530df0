"""Every input the model accepts, through the pipelines: one compile per input signature.

``pipe.step`` / ``pipe(...)`` with another sequence length (torch.export bakes it), another
None pattern, or a short last batch traces and cuts that signature once, at the same stage
boundaries, sharing the parameters; later calls of a signature reuse it. Trace-level
tests are in test_tracing.py and test_signatures.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_grads_match
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_models import FAMILIES
from staging import logits_of, probe_loss
from test_tracing import LengthBranch, Masked
from torch import nn

import fxpipe
from fxpipe.batching import microbatch
from fxpipe.distributed import launch

LAUNCH_TIMEOUT = 180


def eager_step(model: nn.Module, args: tuple, kwargs: dict, target, loss_fn, m: int) -> torch.Tensor:
    """Eager gradient accumulation over the micro-batches the pipeline cuts."""
    pieces, sizes = microbatch.split(((args, kwargs), target), m)
    n = sum(sizes)
    total = None
    for ((a, k), t), size in zip(pieces, sizes):
        loss = loss_fn(model(*a, **k), t) * (size / n)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def check_step(pipe, ref: nn.Module, args: tuple, kwargs: dict, target, loss_fn, m: int, tol: float = 1e-10) -> None:
    pipe.zero_grad()
    ref.zero_grad()
    loss = pipe.step(*args, target=target, **kwargs)
    torch.testing.assert_close(loss, eager_step(ref, args, kwargs, target, loss_fn, m), rtol=tol, atol=tol)
    assert_grads_match(pipe, ref, rtol=1e3 * tol, atol=tol)


def mse(out, t):
    return ((out - t) ** 2).mean()


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_llm_trains_equal_to_eager_at_three_lengths_with_fixed_boundaries(name: str) -> None:
    family = FAMILIES[name]
    model = family.build().double()
    ref = copy.deepcopy(model)
    devices = [f"cpu:{k}" for k in range(len(family.split) + 1)]
    plan = fxpipe.Plan(devices=devices, split=family.split, microbatches=3)
    first = family.inputs(6, family.lengths[0], torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(model, plan, example_inputs=(), example_kwargs=first, loss_fn=probe_loss)
    boundaries = [s.module_range for s in pipe.stages]
    for length in family.lengths + family.lengths[:1]:
        inputs = family.inputs(6, length, torch.Generator().manual_seed(length))
        with torch.no_grad():
            probe = torch.randn(logits_of(ref(**inputs)).shape, dtype=torch.float64)
        check_step(pipe, ref, (), inputs, probe, probe_loss, 3)
    assert len(pipe.signatures) == 3, pipe.signatures  # one per length, the repeat reused
    assert [s.module_range for s in pipe.stages] == boundaries
    assert all(p.part.num_stages == len(devices) for p in pipe._programs.values())
    assert "signatures compiled: 3" in pipe.summary()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_mask_none_both_ways_in_any_order_through_step(frontend: str) -> None:
    model = Masked().double()
    ref = copy.deepcopy(model)
    x, t = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    mask = (torch.rand(4, 5) > 0.3).double()
    pipe = fxpipe.compile(model, dict(devices=["cpu:0", "cpu:1"], split=["body"], microbatches=2, frontend=frontend), example_inputs=(x,), loss_fn=mse)
    for kwargs in ({}, {"mask": mask}, {}, {"mask": mask}):
        check_step(pipe, ref, (x,), kwargs, t, mse, 2)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x, **kwargs), ref(x, **kwargs), rtol=1e-12, atol=1e-12)
    assert len(pipe.signatures) == 2


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_branch_on_the_length_is_followed_on_both_sides_through_step(frontend: str) -> None:
    model = LengthBranch().double()
    ref = copy.deepcopy(model)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["head"], microbatches=2, frontend=frontend)
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randn(4, 6, 4, dtype=torch.float64),), loss_fn=mse)
    assert pipe.frontend == ("fx" if frontend == "auto" else "export")
    for length in (6, 12, 6, 9):
        x = torch.randn(4, length, 4, dtype=torch.float64)
        check_step(pipe, ref, (x,), {}, torch.randn(4, length, 2, dtype=torch.float64), mse, 2)
    assert len(pipe.signatures) == 3


def test_the_short_last_batch_of_an_epoch_just_works() -> None:
    model = FAMILIES["gpt2"].build().double()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 64, (8, 7))
    pipe = fxpipe.compile(model, dict(devices=["cpu:0", "cpu:1"], split=FAMILIES["gpt2"].split[:1], microbatches=4), example_kwargs={"input_ids": ids}, loss_fn=probe_loss)
    for batch in (8, 5, 8):  # 5 samples: micro-batches of 2, 1, 1, 1
        inputs = {"input_ids": torch.randint(3, 64, (batch, 7))}
        probe = torch.randn(batch, 7, 64, dtype=torch.float64)
        check_step(pipe, ref, (), inputs, probe, probe_loss, 4)
    assert len(pipe.signatures) == 1  # the batch dimension is symbolic: one trace serves both


class Stack(nn.Module):
    """A small attention stack whose forward reads the sequence length (torch.export)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(3))
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.qkv:
            q, k, v = layer(x).chunk(3, -1)
            x = x + torch.softmax(q @ k.transpose(1, 2) / x.shape[-1] ** 0.5, -1) @ v
        return self.out(x).mean(1)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(2, 6), st.integers(2, 9)), min_size=2, max_size=4))
def test_any_batch_and_length_pairs_train_equal_to_eager(calls: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    model = Stack().double()
    ref = copy.deepcopy(model)
    batch, length = calls[0]
    plan = dict(devices=["cpu:0", "cpu:1"], split=["qkv.2"], microbatches=2, frontend="export")
    pipe = fxpipe.compile(model, plan, example_inputs=(torch.randn(batch, length, 8, dtype=torch.float64),), loss_fn=mse)
    for batch, length in calls:
        check_step(pipe, ref, (torch.randn(batch, length, 8, dtype=torch.float64),), {}, torch.randn(batch, 2, dtype=torch.float64), mse, 2)
    assert len(pipe.signatures) == len({length for _, length in calls})


# ---------------------------------------------------------------- distributed
def signature_rank_cases() -> dict:
    """GPT-2 at three lengths and the mask=None model both ways, on this rank; errors
    against eager (the loss is all-reduced, so every rank checks it)."""
    out = {}
    family = FAMILIES["gpt2"]
    torch.manual_seed(0)
    model = family.build().double()
    ref = copy.deepcopy(model)
    first = family.inputs(6, 5, torch.Generator().manual_seed(0))
    pipe = fxpipe.compile(model, dict(devices=["cpu:0", "cpu:1"], split=family.split[:1], microbatches=3), example_kwargs=first, loss_fn=probe_loss)
    for length in (5, 8, 13):
        inputs = family.inputs(6, length, torch.Generator().manual_seed(length))
        probe = torch.randn(6, length, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        ref.zero_grad()
        pipe.zero_grad()
        loss = pipe.step(target=probe, **inputs)
        expected = eager_step(ref, (), inputs, probe, probe_loss, 3)
        worst = max(float((p.grad - dict(ref.named_parameters())[n].grad).abs().max()) for n, p in pipe.named_parameters())
        out[f"gpt2 {length}"] = (abs(float(loss) - float(expected)), worst)
    out["gpt2 signatures"] = len(pipe.signatures)
    model = Masked().double()
    ref = copy.deepcopy(model)
    x, t = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    mask = (torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) > 0.3).double()
    pipe = fxpipe.compile(model, dict(devices=["cpu:0", "cpu:1"], split=["body"], microbatches=2, frontend="export"), example_inputs=(x,), loss_fn=mse)
    for k, kwargs in enumerate(({}, {"mask": mask}, {})):
        ref.zero_grad()
        pipe.zero_grad()
        loss = pipe.step(x, target=t, **kwargs)
        expected = eager_step(ref, (x,), kwargs, t, mse, 2)
        worst = max(float((p.grad - dict(ref.named_parameters())[n].grad).abs().max()) for n, p in pipe.named_parameters())
        out[f"masked {k}"] = (abs(float(loss) - float(expected)), worst)
    return out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_new_signatures_on_two_gloo_ranks_match_eager() -> None:
    for result in launch(signature_rank_cases, 2, timeout=LAUNCH_TIMEOUT):
        assert result.pop("gpt2 signatures") == 3
        for case, (loss_err, grad_err) in result.items():
            assert loss_err < 1e-9 and grad_err < 1e-8, (case, loss_err, grad_err)
