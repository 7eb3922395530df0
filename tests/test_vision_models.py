"""Pipelines of torchvision models equal eager: output, loss and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from conftest import check_pipeline_matches_eager, eager_microbatch_step
from torch import nn

import fxpipe

CE = nn.CrossEntropyLoss()


def _data(batch: int = 8, size: int = 32, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


RESNET_SPLITS = [(["layer3"], 2), (["layer2", "layer4"], 4), (["layer1", "layer2.1", "layer4"], 3)]


# each split under one schedule in make test, under the other in make test-slow
@pytest.mark.parametrize(
    ("schedule", "split", "microbatches"),
    [(schedule, split, m) for k, (split, m) in enumerate(RESNET_SPLITS) for schedule in ("gpipe", "1f1b")[k % 2 :][:1]]
    + [pytest.param(schedule, split, m, marks=pytest.mark.slow) for k, (split, m) in enumerate(RESNET_SPLITS) for schedule in ("1f1b", "gpipe")[k % 2 :][:1]],
)
def test_resnet18_grads_match_eager(schedule: str, split: list[str], microbatches: int) -> None:
    x, t = _data()
    devices = [f"cpu:{i}" for i in range(len(split) + 1)]
    plan = fxpipe.Plan(devices=devices, split=split, schedule=schedule, microbatches=microbatches)
    check_pipeline_matches_eager(torchvision.models.resnet18(num_classes=10), plan, (x,), t, CE)


def test_resnet18_under_export_frontend_matches_eager() -> None:
    x, t = _data()
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2, frontend="export")
    pipe = check_pipeline_matches_eager(torchvision.models.resnet18(num_classes=10), plan, (x,), t, CE)
    assert pipe.frontend == "export"


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_mobilenet_v3_small_matches_eager(schedule: str) -> None:
    x, t = _data()
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["features.4", "features.9"], schedule=schedule, microbatches=4)
    model = torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)  # dropout draws differ per thread
    check_pipeline_matches_eager(model, plan, (x,), t, CE)


def test_vision_transformer_matches_eager() -> None:
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )
    x, t = _data(batch=6)
    plan = fxpipe.Plan(
        devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"],
        split=["encoder.layers.encoder_layer_1", "encoder.layers.encoder_layer_2", "encoder.layers.encoder_layer_3"],
        schedule="1f1b",
        microbatches=3,
    )
    pipe = check_pipeline_matches_eager(vit, plan, (x,), t, CE)
    # the class token and position embedding are parameters used through get_attr
    names = dict(pipe.named_parameters())
    assert "class_token" in names and "encoder.pos_embedding" in names


def test_interleaved_schedule_matches_eager() -> None:
    x, t = _data()
    plan = fxpipe.Plan(
        devices=["cpu:0", "cpu:1"],
        split=["layer2", "layer3", "layer4"],
        schedule="interleaved-1f1b",
        chunks=2,
        microbatches=4,
    )
    pipe = check_pipeline_matches_eager(torchvision.models.resnet18(num_classes=10), plan, (x,), t, CE)
    assert [s.device for s in pipe.stages] == ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]


def test_float64_model_matches_eager() -> None:
    x, t = _data()
    model = torchvision.models.resnet18(num_classes=10).double()
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2)
    pipe = check_pipeline_matches_eager(model, plan, (x.double(),), t, CE, rtol=1e-9, atol=1e-10)
    assert all(p.dtype == torch.float64 for p in pipe.parameters())


def test_uneven_microbatches_equal_full_batch() -> None:
    # 10 samples into 4 micro-batches: 3, 3, 2, 2; no batch-dependent layers, so the
    # weighted micro-batch losses equal one full-batch step
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    x, t = torch.randn(10, 6), torch.randint(0, 3, (10,))
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4), example_inputs=(x,), loss_fn=CE)
    loss = pipe.step(x, target=t)
    eager_loss = CE(eager(x), t)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach())
    for (name, p), (_, q) in zip(pipe.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_batch_size_other_than_example_just_works() -> None:
    x, t = _data(batch=8)
    model = torchvision.models.resnet18(num_classes=10)
    ref_before = copy.deepcopy(model)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2)
    short_x, short_t = x[:5], t[:5]
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    pipe.step(x, target=t)
    pipe.zero_grad()
    loss = pipe.step(short_x, target=short_t)  # the short last batch of an epoch: 3, 2
    eager_microbatch_step(ref_before, (x,), t, CE, 2)  # the same first step, for BatchNorm statistics
    ref_before.zero_grad()
    expected = eager_microbatch_step(ref_before, (short_x,), short_t, CE, 2)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
