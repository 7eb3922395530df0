"""Weight-gradient deferral (I/W split): same values, same gradients, weights only in W."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fxpipe.passes.trace import trace
from fxpipe.passes.weight_grad import defer_weight_gradients


class Mixed(nn.Module):
    """Every deferrable op kind, under both frontends, plus a LayerNorm that is not deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Parameter(torch.randn(8))
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(ids))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = torch.addmm(self.b, h.reshape(-1, 8), self.w).view(h.shape)
        h = torch.nn.functional.linear(self.norm(h), self.w) @ self.w
        return h.sum(1) + self.conv2(image).flatten(1)[:, :8]


def _inputs():
    return torch.randint(0, 10, (3, 5)), torch.randn(3, 2, 6, 6, dtype=torch.float64)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_deferred_weights_give_eager_values_and_gradients(frontend: str) -> None:
    model = Mixed().double()
    ids, image = _inputs()
    gm = trace(copy.deepcopy(model), (ids, image), {}, frontend).graph_module
    n = defer_weight_gradients(gm)
    assert n >= 7, gm.code  # emb, lin, conv, addmm, linear, matmul, conv2
    image.requires_grad_()
    store: list = []
    out = gm(ids, image, store)
    out = out[0] if isinstance(out, tuple) else out  # export returns a flat tuple
    expected = model(ids, image)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    expected.backward(g)
    # I: input gradients and non-deferred weights (LayerNorm) only
    image_ref = image.grad.clone() if image.grad is not None else None
    image.grad = None
    out.backward(g)
    torch.testing.assert_close(image.grad, image_ref)
    params = dict(gm.named_parameters())
    assert params["norm.weight"].grad is not None
    deferred = ["emb.weight", "lin.weight", "lin.bias", "conv.weight", "conv.bias", "w", "b", "conv2.weight", "conv2.bias"]
    assert all(params[k].grad is None for k in deferred), [k for k in deferred if params[k].grad is not None]
    assert store, "nothing was deferred"
    # W: the rest
    for work in store:
        work()
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, msg=name)


def test_without_a_store_everything_is_computed_at_once() -> None:
    model = Mixed().double()
    ids, image = _inputs()
    gm = trace(copy.deepcopy(model), (ids, image), {}, "fx").graph_module
    defer_weight_gradients(gm)
    gm(ids, image, None).sum().backward()
    model(ids, image).sum().backward()
    params = dict(gm.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, msg=name)


def test_deferred_ops_follow_autocast() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(4, 8)
    gm = trace(copy.deepcopy(model), (x,), {}, "fx").graph_module
    defer_weight_gradients(gm)
    store: list = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gm(x, store)
        expected = model(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    for work in store:
        work()
    params = dict(gm.named_parameters())
    for name, p in model.named_parameters():
        assert params[name].grad.dtype == torch.float32
        torch.testing.assert_close(params[name].grad, p.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_a_stage_without_deferrable_weights_is_left_alone() -> None:
    model = nn.Sequential(nn.LayerNorm(8), nn.Tanh())
    gm = trace(model, (torch.randn(2, 8),), {}, "fx").graph_module
    code = gm.code
    assert defer_weight_gradients(gm) == 0
    assert gm.code == code


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_split_backward_frees_the_micro_batchs_tensors(frontend: str) -> None:
    """W's closures hold only the detached tensors they need: one holding an activation
    with its grad_fn closed a loop (store -> closure -> activation -> autograd graph -> an
    earlier op's ctx -> store) through C++ references that no collector frees, so every
    micro-batch's graph and activations leaked."""
    import gc

    model = Mixed().double()
    ids, image = _inputs()
    gm = trace(copy.deepcopy(model), (ids, image), {}, frontend).graph_module
    defer_weight_gradients(gm)
    image.requires_grad_()

    def step() -> None:
        store: list = []
        out = gm(ids, image, store)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
        for work in store:
            work()

    def tensors() -> int:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    step()  # the gradients exist from here on
    before = tensors()
    for _ in range(3):
        step()
    assert tensors() <= before  # a leak grows it (an earlier test's objects may still go)
