"""device_guard tags, skip edges over whole stages, and non-tensor values crossing stages."""

from __future__ import annotations

import pytest
import torch
from conftest import check_pipeline_matches_eager
from torch import nn

import fxpipe
from fxpipe.passes.partition import fxpipe_recv, fxpipe_send

CE = nn.CrossEntropyLoss()


class TaggedNet(nn.Module):
    """Three tagged blocks (cpu, gpu:0 alias, cpu again) and an untagged head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.tail = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fxpipe.device_guard("cpu"):
            x = torch.tanh(self.embed(x))
        with fxpipe.device_guard("gpu:0"):
            x = self.body(x)
            with fxpipe.device_guard("cpu:1"):  # nested: the innermost tag wins
                x = torch.relu(x)
        with fxpipe.device_guard("cpu"):
            x = self.tail(x)
        return self.head(x)


class SkipOverStage(nn.Module):
    """The input of block a is added after block c: an edge jumping from stage 0 to stage 2."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        y = torch.relu(self.b(h))
        y = self.c(y) + h
        return self.out(y)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tags_make_stages_in_program_order(frontend: str) -> None:
    x = torch.randn(6, 8)
    part = fxpipe.partition(TaggedNet(), fxpipe.Plan(frontend=frontend), example_inputs=(x,))
    assert part.devices == ["cpu", "cuda:0", "cpu:1", "cpu"]  # one device may host several stages
    assert "head" in part.stages[-1].module_range  # untagged head follows its input


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tagged_model_matches_eager(frontend: str, schedule: str) -> None:
    x, t = torch.randn(8, 8), torch.randint(0, 4, (8,))
    # the plan's devices override the tags' devices (here: no GPU)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], schedule=schedule, microbatches=4, frontend=frontend)
    check_pipeline_matches_eager(TaggedNet(), plan, (x,), t, CE)


def test_device_guard_is_a_no_op_in_eager_mode() -> None:
    net = TaggedNet()
    x = torch.randn(2, 8)
    with fxpipe.device_guard("gpu:3"):
        out = net(x)
    assert out.shape == (2, 4)
    with pytest.raises(fxpipe.DeviceError, match="tpu:0"):
        with fxpipe.device_guard("tpu:0"):
            pass


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_skip_edge_goes_straight_to_its_consumer_stage(frontend: str) -> None:
    x, t = torch.randn(8, 12), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["b", "c"], microbatches=4, frontend=frontend)
    pipe = check_pipeline_matches_eager(SkipOverStage(), plan, (x,), t, CE)
    skips = [e for e in pipe.stages[2].inputs if e.src == 0]
    assert len(skips) == 1, pipe.explain()
    sends = [n for n in pipe.graph.nodes if n.target is fxpipe_send]
    recvs = [n for n in pipe.graph.nodes if n.target is fxpipe_recv]
    assert len(sends) == len(recvs) == 3
    assert "fxpipe_recv" not in pipe.stages[2].module.code  # stage code takes recv'd values as arguments


class Encoder(nn.Module):
    """Returns a dict holding tensors, None and a Python number (traced as one leaf call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.lin(x)
        return {"h": h, "sq": h * h, "nothing": None, "three": 3}


class StructuredValues(nn.Module):
    """Stage 0 sends a dict (tensors, None, a number), a boolean mask and an int size."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.dec = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, scale: float = 2.0, extra: torch.Tensor | None = None) -> torch.Tensor:
        with fxpipe.device_guard("cpu:0"):
            pack = self.enc(x)
            mask = x > 0
            n = x.size(1)
        with fxpipe.device_guard("cpu:1"):
            assert pack["nothing"] is None or isinstance(pack["nothing"], torch.fx.Proxy)
            y = pack["h"] + pack["sq"] * scale / (n + pack["three"])
            y = torch.where(mask, y, -y)
            if extra is not None:
                y = y + extra
            out = self.dec(y)
        return out


def test_dicts_masks_numbers_and_none_cross_stages() -> None:
    x, t = torch.randn(8, 6), torch.randint(0, 2, (8,))
    plan = fxpipe.Plan(microbatches=4, frontend="fx", concrete_args={"extra": None}, leaf_modules=[Encoder])
    pipe = check_pipeline_matches_eager(StructuredValues(), plan, (x,), t, CE)
    kinds = " ".join(e.description for e in pipe.stages[1].inputs)
    assert "bool[8, 6]" in kinds and "{h: f32[8, 6]" in kinds and "int" in kinds, kinds


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activation_checkpointing_matches_eager(schedule: str) -> None:
    # recomputation in backward, a stage that writes into its input in place, and a skip edge
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    x, t = torch.randn(8, 8), torch.randint(0, 4, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["3"], schedule=schedule, microbatches=4, checkpoint=True)
    check_pipeline_matches_eager(model, plan, (x,), t, CE)
    x, t = torch.randn(8, 12), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["b", "c"], schedule=schedule, microbatches=2, checkpoint=True)
    check_pipeline_matches_eager(SkipOverStage(), plan, (x,), t, CE)
