"""Shared test helpers: the eager reference every pipeline is held to."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.batching.microbatch import split_sizes

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One temporary Inductor cache for the session (and the subprocesses it starts): the
    tests' compiled stages share it, and nothing is left in the user's cache."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))


def eager_microbatch_step(model: nn.Module, inputs: tuple, target: Any, loss_fn: Callable, m: int) -> torch.Tensor:
    """Eager gradient accumulation over the same micro-batches the pipeline uses."""
    n = inputs[0].shape[0]
    sizes = split_sizes(n, m)
    pieces = [torch.split(x, sizes) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == n else [x] * m for x in inputs]
    targets = torch.split(target, sizes)
    total = None
    for i in range(m):
        loss = loss_fn(model(*[p[i] for p in pieces]), targets[i]) * (sizes[i] / n)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def assert_grads_match(pipe: fxpipe.Pipeline, ref: nn.Module, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    expected = dict(ref.named_parameters())
    got = dict(pipe.named_parameters())
    assert list(got) == [n for n, _ in ref.named_parameters()], "parameter names/order differ from eager"
    shared = [name for name, param in got.items() if param is expected[name]]
    assert not shared, f"the eager reference holds the pipeline's own parameters ({shared[:3]}): compare with a copy made before compiling"
    for name, param in got.items():
        ref_grad = expected[name].grad
        if ref_grad is None:
            assert param.grad is None or not param.grad.abs().any(), name
            continue
        assert param.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(param.grad.cpu(), ref_grad.cpu(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"grad of {n}: {m}")


def check_pipeline_matches_eager(
    model: nn.Module,
    plan: fxpipe.Plan | dict,
    inputs: tuple,
    target: torch.Tensor,
    loss_fn: Callable,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> fxpipe.Pipeline:
    """Compile, run one step, and compare loss, every gradient and the eval output with eager."""
    plan = fxpipe.Plan.coerce(plan)
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = fxpipe.compile(model, plan, example_inputs=inputs, loss_fn=loss_fn)
    for key, value in model.state_dict().items():
        assert torch.equal(value.cpu(), before[key]), f"compiling changed the user's model: {key}"
    loss = pipe.step(*inputs, target=target)
    ref_loss = eager_microbatch_step(ref, inputs, target, loss_fn, plan.microbatches)
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=rtol, atol=atol)
    assert_grads_match(pipe, ref, rtol, atol)
    pipe.eval()  # under export too: the mode pass makes BatchNorm/Dropout follow it
    ref.eval()
    with torch.no_grad():
        if ref.training:
            sizes = split_sizes(inputs[0].shape[0], plan.microbatches)
            expected = torch.cat([_first_tensor(ref(x)) for x in torch.split(inputs[0], sizes)])
        else:
            expected = _first_tensor(ref(*inputs))
        torch.testing.assert_close(_first_tensor(pipe(*inputs)), expected, rtol=rtol, atol=atol)
    # the pipeline's tensors are the model's own: its buffers (BatchNorm statistics) moved as
    # eager's did, its parameters (no optimizer step) not at all
    after, expected = model.state_dict(), ref.state_dict()
    for key in before:
        torch.testing.assert_close(after[key].cpu(), expected[key], rtol=rtol, atol=atol, msg=lambda m, k=key: f"the model's {k} after the step: {m}")
    return pipe


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if hasattr(out, "logits"):
        return out.logits.detach().cpu()
    return _first_tensor(out[0])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def float64():
    """float64 as the default dtype for the test (exact comparisons with eager), restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
