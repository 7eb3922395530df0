"""torchvision detection models (Faster R-CNN, RetinaNet, Mask R-CNN; random init, small
images) pipelined in 2 stages cut at a module path: eval ``pipe(images)`` equals eager (a
list of dicts) and a train step with the model's own loss dict equals eager, loss and every
gradient, in float64. What torch.fx cannot trace of them (NMS, box decoding, the losses'
sampling) runs whole as opaque calls.

Micro-batches: fxpipe cuts tensors along dim 0; a detection model takes a *list* of images
(and of target dicts), which is not a batch dimension. Such a model is compiled with
``microbatches=1``; a micro-batch is a sub-list, one ``step()`` each, and the gradients
accumulate as eager's over the same sub-lists (``Plan(microbatches=2)`` is a PlanError
saying so). The Faster R-CNN cases run by default; the ResNet-50 ones are marked slow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torchvision
from conftest import assert_grads_match
from torch import nn

import fxpipe

detection = torchvision.models.detection
SMALL = dict(weights=None, weights_backbone=None, num_classes=5, min_size=64, max_size=96)
# detections kept whatever their score (a random model's are low); the samplers take every
# proposal and anchor, so training draws nothing at random and equals eager exactly
RCNN = dict(
    box_score_thresh=0.0, box_detections_per_img=8, rpn_pre_nms_top_n_train=40, rpn_post_nms_top_n_train=16,
    rpn_pre_nms_top_n_test=40, rpn_post_nms_top_n_test=16, rpn_batch_size_per_image=10_000, box_batch_size_per_image=10_000,
)
MODELS: dict[str, tuple[Callable[[], nn.Module], list[str]]] = {
    "fasterrcnn": (lambda: detection.fasterrcnn_mobilenet_v3_large_fpn(**SMALL, **RCNN), ["rpn"]),
    "retinanet": (lambda: detection.retinanet_resnet50_fpn(**SMALL, score_thresh=0.0, detections_per_img=8), ["head"]),
    "maskrcnn": (lambda: detection.maskrcnn_resnet50_fpn(**SMALL, **RCNN), ["rpn"]),
}
CASES = [pytest.param(name, marks=() if name == "fasterrcnn" else pytest.mark.slow) for name in MODELS]


def images_and_targets(n: int = 2, masks: bool = False) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(n)
    images = [torch.rand(3, 64, 80, generator=g, dtype=torch.float64) for _ in range(n)]
    targets = []
    for k in range(n):
        boxes = torch.tensor([[4.0, 6.0, 30.0, 40.0], [10.0, 10.0 + k, 50.0, 60.0]], dtype=torch.float64)[: 1 + k % 2]
        target = {"boxes": boxes, "labels": torch.tensor([1, 3])[: len(boxes)]}
        if masks:
            target["masks"] = torch.zeros(len(boxes), 64, 80, dtype=torch.uint8)
            target["masks"][:, 8:32, 8:40] = 1
        targets.append(target)
    return images, targets


def sum_losses(losses: dict[str, torch.Tensor], target: object) -> torch.Tensor:
    """The model's own loss dict, as its training loop sums it."""
    return sum(losses.values())


def plan(split: list[str]) -> fxpipe.Plan:
    return fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=split, microbatches=1)


@pytest.mark.parametrize("name", CASES)
def test_eval_detections_equal_eager(name: str) -> None:
    build, split = MODELS[name]
    model = build().double().eval()
    images, _ = images_and_targets()
    pipe = fxpipe.compile(copy.deepcopy(model), plan(split), example_inputs=(images,))
    assert pipe.frontend == "fx" and pipe.part.opaque  # NMS and friends run whole
    assert len(pipe.stages) == 2 and split[0] in pipe.stages[1].module_range
    got, expected = pipe(images), model(images)
    assert len(got) == len(expected) == 2
    for one, other in zip(got, expected):
        assert set(one) == set(other) and len(one["boxes"]) > 0
        for key in other:
            torch.testing.assert_close(one[key], other[key], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", CASES)
def test_a_train_step_with_the_models_own_losses_equals_eager(name: str) -> None:
    build, split = MODELS[name]
    model = build().double().train()
    ref = copy.deepcopy(model)
    images, targets = images_and_targets(masks=name == "maskrcnn")
    pipe = fxpipe.compile(model, plan(split), example_inputs=(images, targets), loss_fn=sum_losses)
    loss = pipe.step(images, targets)
    expected = sum_losses(ref(images, targets), None)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-9, atol=1e-9)
    assert_grads_match(pipe, ref, rtol=1e-7, atol=1e-9)


def test_micro_batches_of_a_list_are_sub_lists_one_step_each() -> None:
    build, split = MODELS["fasterrcnn"]
    model = build().double().train()
    ref = copy.deepcopy(model)
    images, targets = images_and_targets(4)
    with pytest.raises(fxpipe.PlanError, match=r"(?s)takes its batch as a list.*microbatches=1.*step\(\) per micro-batch"):
        fxpipe.compile(copy.deepcopy(model), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=split, microbatches=2), example_inputs=(images, targets), loss_fn=sum_losses)
    pipe = fxpipe.compile(model, plan(split), example_inputs=(images[:2], targets[:2]), loss_fn=sum_losses)
    losses = [pipe.step(images[k : k + 2], targets[k : k + 2]) for k in (0, 2)]  # two micro-batches
    expected = []
    for k in (0, 2):
        loss = sum_losses(ref(images[k : k + 2], targets[k : k + 2]), None)
        loss.backward()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-9, atol=1e-9)
    assert_grads_match(pipe, ref, rtol=1e-7, atol=1e-9)  # accumulated over both, as eager


@pytest.mark.slow
def test_other_image_sizes_and_counts_trace_again_and_equal_eager() -> None:
    """A new input signature (another image size or count) retraces: the anchor generator's
    anchors (plain tensors in a list) are shared with the fake copy, and the check for
    degenerate boxes (a condition on the targets alone) is answered from the call's own
    values."""
    build, split = MODELS["fasterrcnn"]
    model = build().double().train()
    ref = copy.deepcopy(model)
    images, targets = images_and_targets()
    pipe = fxpipe.compile(model, plan(split), example_inputs=(images, targets), loss_fn=sum_losses)
    more, their_targets = images_and_targets(3)
    loss = pipe.step(more, their_targets)
    expected = sum_losses(ref(more, their_targets), None)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-9, atol=1e-9)
    assert_grads_match(pipe, ref, rtol=1e-7, atol=1e-9)
    pipe.eval(), ref.eval()
    larger = [torch.rand(3, 72, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    with torch.no_grad():
        for one, other in zip(pipe(larger), ref(larger)):
            for key in other:
                torch.testing.assert_close(one[key], other[key], rtol=1e-9, atol=1e-9)
    assert len(pipe.signatures) == 3
