"""Hand-placed models (PyTorch's model-parallel tutorial) read as placed: ``.to("cuda:N")``
and ``.cuda(N)`` in forward are device tags, planned without CUDA and run on two CPUs.

The models keep the tutorial's forward verbatim; their ``__init__`` moves run only where two
GPUs exist, so the parameters stay on the CPU here. The eager reference runs the same
forward with the CUDA moves left out (``_WithoutCudaMoves``, written here, not fxpipe's)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_grads_match, eager_microbatch_step
from torch import nn
from torch.overrides import TorchFunctionMode
from torchvision.models.resnet import BasicBlock, ResNet

import fxpipe
from fxpipe.passes.moves import read_move

TWO_GPUS = torch.cuda.device_count() >= 2


class ToyModel(nn.Module):
    """The tutorial's ToyModel: net1 on cuda:0, net2 on cuda:1."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        if TWO_GPUS:
            self.net1.to("cuda:0")
            self.net2.to("cuda:1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.net1(x.to("cuda:0"))
        return self.net2(self.relu(x).to("cuda:1"))


class ModelParallelResNet(ResNet):
    """The tutorial's ModelParallelResNet50 at ResNet-18 widths, one block per layer."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
        self.seq1 = nn.Sequential(self.conv1, self.bn1, self.relu, self.maxpool, self.layer1, self.layer2)
        self.seq2 = nn.Sequential(self.layer3, self.layer4, self.avgpool)
        if TWO_GPUS:
            self.seq1.to("cuda:0")
            self.seq2.to("cuda:1")
            self.fc.to("cuda:1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.seq2(self.seq1(x).to("cuda:1"))
        return self.fc(x.view(x.size(0), -1))


class SpelledMoves(nn.Module):
    """The other spellings: ``.cuda(N)``, ``torch.device("cuda", N)``, ``device=`` with a dtype,
    and a device_guard inside a moved region (the guard wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.d = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x.cuda(0))
        x = self.b(x.to(torch.device("cuda", 1)))
        with fxpipe.device_guard("cpu"):
            x = torch.tanh(x)
        x = x.to(device="cuda:0", dtype=torch.float64, non_blocking=True)
        return self.d(self.c(x.to(torch.float32)))


class _WithoutCudaMoves(TorchFunctionMode):
    """Eager forward with ``.to(<cuda>)``/``.cuda()`` as the identity (dtypes still applied)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            device = kwargs.pop("device", None)
            rest = list(args[1:])
            if rest and isinstance(rest[0], str | torch.device):
                device = rest.pop(0)
            if device is not None and torch.device(device).type == "cuda":
                kwargs.pop("non_blocking", None)
                return args[0].to(*rest, **kwargs) if rest or kwargs else args[0]
        return func(*args, **kwargs)


def _stage_ops(part: fxpipe.Partitioned) -> list[str]:
    return [str(n.target) for s in part.stages for n in s.module.graph.nodes if n.op == "call_method"]


def test_tutorial_toy_model_is_planned_on_its_devices_without_cuda() -> None:
    part = fxpipe.partition(ToyModel(), fxpipe.Plan(microbatches=2), example_inputs=(torch.randn(8, 10),))
    assert part.devices == ["cuda:0", "cuda:1"]
    assert "net1" in part.stages[0].module_range and "relu" in part.stages[0].module_range
    assert part.stages[1].module_range == "net2"
    assert "to" not in _stage_ops(part)  # the moves are gone: a stage's device decides
    explained = part.explain()
    assert "stage 1 on cuda:1: moved to 'cuda:1' in forward (" in explained and "test_hand_placed.py" in explained


def test_tutorial_toy_model_trains_on_two_cpus_equal_to_eager_without_moves() -> None:
    torch.manual_seed(0)
    model = ToyModel().double()
    ref = copy.deepcopy(model)
    x, t = torch.randn(8, 10, dtype=torch.float64), torch.randint(0, 5, (8,))
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], microbatches=2), example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    assert [str(s.device) for s in pipe.stages] == ["cpu:0", "cpu:1"]
    loss = pipe.step(x, target=t)
    with _WithoutCudaMoves():
        expected = eager_microbatch_step(ref, (x,), t, nn.CrossEntropyLoss(), 2)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert_grads_match(pipe, ref, rtol=1e-12, atol=1e-12)


def test_tutorial_model_parallel_resnet_splits_at_the_move_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = ModelParallelResNet().double()
    x, t = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (4,))
    part = fxpipe.partition(model, fxpipe.Plan(microbatches=2), example_inputs=(x,))
    # seq1 runs where its parameters are (the CPU here; cuda:0 where __init__ moved them)
    assert part.devices == [str(next(model.seq1.parameters()).device), "cuda:1"]
    # named as forward calls them: seq1 holds conv1 ... layer2, seq2 holds layer3 ... avgpool
    assert part.stages[0].module_range.startswith("seq1.0") and "seq2" not in part.stages[0].module_range
    assert part.stages[1].module_range.startswith("seq2.0") and part.stages[1].module_range.endswith("fc")

    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], microbatches=2), example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    loss = pipe.step(x, target=t)
    with _WithoutCudaMoves():
        expected = eager_microbatch_step(ref, (x,), t, nn.CrossEntropyLoss(), 2)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-10)
    assert_grads_match(pipe, ref, rtol=1e-10, atol=1e-10)


def test_every_spelling_of_a_cuda_move_is_a_tag_and_dtypes_survive() -> None:
    torch.manual_seed(0)
    model = SpelledMoves()
    x, t = torch.randn(6, 6), torch.randint(0, 3, (6,))
    part = fxpipe.partition(model, fxpipe.Plan(microbatches=2), example_inputs=(x,))
    assert part.devices == ["cuda:0", "cuda:1", "cpu", "cuda:0"]
    assert _stage_ops(part).count("to") == 2  # to(float64) and to(float32); no device left

    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:0", "cpu:1"], microbatches=2), example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    loss = pipe.step(x, target=t)
    with _WithoutCudaMoves():
        expected = eager_microbatch_step(ref, (x,), t, nn.CrossEntropyLoss(), 2)
    torch.testing.assert_close(loss, expected)
    assert_grads_match(pipe, ref)


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "device"),
    [
        ("to", ("cuda:1",), {}, "cuda:1"),
        ("to", (torch.device("cuda", 2),), {"non_blocking": True}, "cuda:2"),
        ("to", (), {"device": "cuda"}, "cuda:0"),
        ("cuda", (3,), {}, "cuda:3"),
        ("cuda", (), {}, "cuda:0"),
        ("to", ("cpu",), {}, None),
        ("to", (torch.float16,), {}, None),
        ("to", ("meta",), {}, None),
    ],
)
def test_read_move_reads_cuda_devices_only(method: str, args: tuple, kwargs: dict, device: str | None) -> None:
    move = read_move(method, args, kwargs)
    assert (move.device if move is not None else None) == device


class DeviceOfInput(nn.Module):
    """HF-style ``.to(x.device)``: a device read from a traced tensor, not a placement."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).to(x.device) + torch.ones(4).to(x.device))


def test_a_device_read_from_a_traced_tensor_is_no_move() -> None:
    x = torch.randn(4, 4)
    part = fxpipe.partition(DeviceOfInput(), fxpipe.Plan(split=["b"], devices=["cpu:0", "cpu:1"], microbatches=2), example_inputs=(x,))
    assert _stage_ops(part).count("to") == 2  # both kept, run as written
    assert len(fxpipe.partition(DeviceOfInput(), fxpipe.Plan(), example_inputs=(x,)).stages) == 1  # no tag read
