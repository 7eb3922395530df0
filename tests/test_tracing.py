"""Tracing never changes the model, and the pipeline's names are the model's names."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from conftest import check_pipeline_matches_eager
from torch import nn

import fxpipe


class CachesProxies(nn.Module):
    """Like timm's levit: caches a value in an attribute the first time forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias_cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "bias" not in self.bias_cache:
            self.bias_cache["bias"] = torch.ones(4) * 0.5
        if not hasattr(self, "scale"):
            self.scale = x.new_ones(()) * 2  # a proxy while tracing
        return self.lin(x) * self.scale + self.bias_cache["bias"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tracing_leaves_no_proxies_behind(frontend: str) -> None:
    model = CachesProxies()
    x = torch.randn(4, 4)
    fxpipe.partition(model, fxpipe.Plan(frontend=frontend), example_inputs=(x,))
    assert not hasattr(model, "scale") and model.bias_cache == {}
    # a second trace of the same instance is as good as the first, and eager still works
    pipe = fxpipe.compile(model, fxpipe.Plan(frontend=frontend), example_inputs=(x,))
    torch.testing.assert_close(pipe(x), model(x))


def test_compile_leaves_batchnorm_statistics_untouched() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    before = copy.deepcopy(model.state_dict())
    for frontend in ("fx", "export"):
        fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], frontend=frontend), example_inputs=(torch.randn(4, 3, 32, 32),))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.training


def test_state_dict_round_trips_with_original_names() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2), example_inputs=(x,))
    assert list(pipe.state_dict()) == list(model.state_dict())
    other = torchvision.models.resnet18(num_classes=10)
    pipe.load_state_dict(other.state_dict())
    pipe.eval()
    other.eval()
    torch.testing.assert_close(pipe(x), other(x))
    with pytest.raises(KeyError, match="missing"):
        pipe.load_state_dict({})


def test_unused_parameters_still_live_in_a_stage() -> None:
    class WithSpare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)  # never called in forward
            self.register_buffer("counter", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = WithSpare()
    pipe = fxpipe.compile(model, {}, example_inputs=(torch.randn(2, 4),))
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(pipe.state_dict()) == list(model.state_dict())


def test_stage_holds_only_its_own_parameters() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2), example_inputs=(x,))
    first = {n for n, _ in pipe.stages[0].module.named_parameters()}
    second = {n for n, _ in pipe.stages[1].module.named_parameters()}
    assert not first & second
    assert all(not n.startswith(("layer3", "layer4", "fc")) for n in first)
    assert first | second == {n for n, _ in model.named_parameters()}
    own = {id(p) for p in model.parameters()}
    assert not any(id(p) in own for p in pipe.parameters())  # copies, not the user's tensors


def test_pipeline_output_supports_autograd() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    check_pipeline_matches_eager(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=3), (x,), torch.randn(6, 1), nn.MSELoss())
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=3), example_inputs=(x,))
    pipe(x).sum().backward()  # not pipelined, but differentiable
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_pipeline_keeps_no_reference_to_the_users_model(frontend: str) -> None:
    import gc
    import weakref

    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2, frontend=frontend)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    alive = [weakref.ref(m) for m in (model, model.layer3, model.fc)]
    del model
    gc.collect()
    assert all(ref() is None for ref in alive), "the pipeline keeps the user's modules alive"
    assert torch.isfinite(pipe.step(x, target=torch.randint(0, 10, (4,))))
    assert "layer3" in pipe.summary()
