"""The GPU path: CPU + cuda:0 stages, two stages on one GPU (own streams), bf16 on CUDA.

Run with ``make test-gpu`` on a machine with CUDA; every test skips cleanly without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_grads_match, eager_microbatch_step
from test_runtime import Blocks
from torch import nn

import fxpipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CE = nn.CrossEntropyLoss()


def mlp(width: int = 64, depth: int = 4, classes: int = 5) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cpu"], ["cuda:0", "cuda:0"]])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_heterogeneous_stages_match_eager_in_float64(devices: list[str], schedule: str) -> None:
    model = mlp().double()
    x, t = torch.randn(12, 64, dtype=torch.float64), torch.randint(0, 5, (12,))
    ref = copy.deepcopy(model)
    plan = fxpipe.Plan(devices=devices, split=["4"], microbatches=4, schedule=schedule)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    loss = pipe.step(x, target=t)
    torch.testing.assert_close(loss.cpu(), eager_microbatch_step(ref, (x,), t, CE, 4), rtol=1e-10, atol=1e-10)
    assert_grads_match(pipe, ref, rtol=1e-9, atol=1e-10)
    assert [str(p.device) for p in pipe.stages[0].module.parameters()][0].startswith(devices[0].split(":")[0])


def test_two_stages_on_one_gpu_run_concurrently_on_their_own_streams() -> None:
    model = mlp(width=2048, depth=8).cuda()
    x, t = torch.randn(512, 2048, device="cuda"), torch.randint(0, 5, (512,), device="cuda")
    plan = fxpipe.Plan(devices=["cuda:0", "cuda:0"], split=["8"], microbatches=8, schedule="1f1b")
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    for _ in range(2):
        pipe.step(x, target=t)
    timeline = pipe.timeline()
    busy = {w: [(e.start, e.end) for e in timeline.events if e.worker == w and e.op in ("F", "B")] for w in (0, 1)}
    overlap = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in busy[0] for b0, b1 in busy[1])
    assert overlap > 0, "the two workers never ran at the same time"


@pytest.mark.parametrize("how", ["autocast", "bf16 model"])
def test_bf16_on_cuda_matches_eager(how: str) -> None:
    model, x, t = Blocks().cuda(), torch.randn(8, 6, 32, device="cuda"), torch.randint(0, 5, (8,), device="cuda")
    if how == "bf16 model":
        model, x = model.bfloat16(), x.bfloat16()
    ref = copy.deepcopy(model)
    plan = fxpipe.Plan(devices=["cuda:0", "cuda:0"], split=["blocks.2"], microbatches=4)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=how == "autocast"):
        loss = pipe.step(x, target=t)
        expected = eager_microbatch_step(ref, (x,), t, CE, 4)
    torch.testing.assert_close(loss.float().cpu(), expected.float().cpu(), rtol=2e-2, atol=2e-2)
    assert_grads_match(pipe, ref, rtol=1e-1, atol=2e-2)
