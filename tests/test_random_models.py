"""Hypothesis: random DAG models, random cuts and schedules, always equal to eager."""

from __future__ import annotations

import copy

import torch
from conftest import assert_grads_match, eager_microbatch_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe


class RandomDag(nn.Module):
    """Layer i reads node ``sources[i]`` and, optionally, adds node ``skips[i]`` (any earlier node)."""

    def __init__(self, width: int, sources: list[int], skips: list[int | None], activations: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in sources)
        self.sources, self.skips, self.activations = sources, skips, activations
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for layer, src, skip, act in zip(self.layers, self.sources, self.skips, self.activations):
            h = layer(nodes[src])
            h = torch.tanh(h) if act == "tanh" else torch.relu(h) if act == "relu" else h * torch.sigmoid(h)
            if skip is not None:
                h = h + nodes[skip]
            nodes.append(h)
        return self.head(nodes[-1] + nodes[len(nodes) // 2])


@st.composite
def dag_cases(draw: st.DrawFn) -> tuple:
    depth = draw(st.integers(2, 7))
    width = draw(st.integers(2, 9))
    sources = [draw(st.integers(0, i)) for i in range(depth)]
    skips = [draw(st.one_of(st.none(), st.integers(0, i))) for i in range(depth)]
    activations = [draw(st.sampled_from(["tanh", "relu", "silu"])) for _ in range(depth)]
    stages = draw(st.integers(1, min(4, depth)))
    cuts = sorted(draw(st.lists(st.integers(1, depth - 1), min_size=stages - 1, max_size=stages - 1, unique=True)))
    batch = draw(st.integers(1, 9))
    microbatches = draw(st.integers(1, batch))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    frontend = draw(st.sampled_from(["fx", "export"]))
    return width, sources, skips, activations, cuts, batch, microbatches, schedule, frontend


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_cases(), st.integers(0, 2**16))
def test_random_dag_pipeline_equals_eager(case: tuple, seed: int) -> None:
    width, sources, skips, activations, cuts, batch, microbatches, schedule, frontend = case
    torch.manual_seed(seed)
    model = RandomDag(width, sources, skips, activations)
    ref = copy.deepcopy(model)
    x, t = torch.randn(batch, width), torch.randint(0, 3, (batch,))
    split = [f"layers.{c}" for c in cuts] if cuts else "tags"
    plan = fxpipe.Plan(devices=[f"cpu:{i}" for i in range(len(cuts) + 1)], split=split, schedule=schedule, microbatches=microbatches, frontend=frontend)
    loss_fn = nn.CrossEntropyLoss()
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=loss_fn)
    loss = pipe.step(x, target=t)
    torch.testing.assert_close(loss, eager_microbatch_step(ref, (x,), t, loss_fn, microbatches), rtol=1e-4, atol=1e-5)
    assert_grads_match(pipe, ref)
    torch.testing.assert_close(pipe(x), ref(x).detach(), rtol=1e-4, atol=1e-5)
