"""Per-signature building blocks: stage boundaries that never move (anchors), the fake-tensor
soundness check of a specialised trace, and (batch, length) pairs on a transformer stack."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from staging import SignatureStages, check_against_eager
from torch import nn
from torch.nn import functional as F

import fxpipe
from fxpipe.passes import annotate
from fxpipe.passes.generalise import TraceMismatch, check_generalises
from fxpipe.passes.meta import STAGE
from fxpipe.passes.node_costs import annotate_costs
from fxpipe.passes.shape_prop import propagate_shapes
from fxpipe.passes.targets import resolver
from fxpipe.passes.trace import trace
from fxpipe.planner.auto_split import auto_split


class Block(nn.Module):
    """A pre-norm causal self-attention block (two heads) with an MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, c // 2).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    """A small GPT: token and position embeddings, blocks, a head."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def auto_split_of(model: nn.Module, x: torch.Tensor):
    traced = trace(model, (x,), dynamic_batch=False)
    resolve = resolver(model, traced.root)
    fake_run = propagate_shapes(traced.graph_module, traced.bind_inputs((x,), {}), resolve)
    graph = traced.graph_module.graph
    annotate_costs(graph, resolve, fake_run)
    cuts = auto_split(graph, fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split="auto", microbatches=1))
    annotate.annotate_by_cuts(graph, cuts.starts, cuts.reasons, cuts.how)
    return graph


def test_anchors_reproduce_the_auto_split_of_the_same_trace() -> None:
    graph = auto_split_of(Stack(), torch.randint(0, 32, (2, 7)))
    chosen = {n.name: n.meta[STAGE] for n in graph.nodes}
    found = annotate.anchors(graph)
    assert len(found) == 2 and len(set(found)) == 2
    for node in graph.nodes:
        node.meta[STAGE] = None
    assignment = annotate.annotate_by_anchors(graph, found)
    assert assignment.num_stages == 3
    assert {n.name: n.meta[STAGE] for n in graph.nodes} == chosen


@pytest.mark.slow
def test_auto_boundaries_stay_put_across_sequence_lengths() -> None:
    model = Stack().double()
    ref = copy.deepcopy(model)
    stages = SignatureStages(model, "auto", devices=["cpu:0", "cpu:1", "cpu:2"], frontend="export")
    boundaries = None
    for length in (7, 3, 12):
        check_against_eager(stages, ref, (torch.randint(0, 32, (2, length)),))
        modules = stages.stages_for((torch.randint(0, 32, (2, length)),)).stage_modules()
        boundaries = boundaries or modules
        assert modules == boundaries
    assert stages.traces == 3


def test_a_trace_without_an_anchor_is_an_error_naming_it() -> None:
    graph = auto_split_of(Stack(), torch.randint(0, 32, (2, 7)))
    found = annotate.anchors(graph)
    ghost = annotate.Anchor("blocks.7.mlp", found[0].op, 0)
    with pytest.raises(annotate.AnnotateError, match=r"no .* in module 'blocks\.7\.mlp', where stage 2 began"):
        annotate.annotate_by_anchors(graph, [found[0], ghost])
    with pytest.raises(annotate.AnnotateError, match="before stage 1"):
        annotate.annotate_by_anchors(graph, list(reversed(found)))


# ------------------------------------------------------------------ soundness check
class Pooled(nn.Module):
    """Reads a module attribute the trace key cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.pool:
            h = h.mean(1)
        return h


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_check_generalises_catches_a_branch_the_key_cannot_see(frontend: str) -> None:
    model, x = Pooled(), torch.randn(2, 3, 4)
    traced = trace(model, (x,), frontend=frontend, dynamic_batch=False)
    assert check_generalises(model, traced, (x,)) is True
    model.pool = True
    with pytest.raises(TraceMismatch, match=r"f32\[2, 3, 4\] in the trace but f32\[2, 4\] in eager") as info:
        check_generalises(model, traced, (x,))
    if frontend == "export":  # export records source lines: the error names the model's line
        assert "test_signatures.py:" in str(info.value)


def test_check_generalises_leaves_the_model_and_the_rng_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(6, 4)
    traced = trace(model, (x,))
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    assert check_generalises(model, traced, (x,)) is True
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_check_generalises_checks_a_model_built_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = Stack()
    ids = torch.randint(0, 32, (2, 5))
    traced = trace(model, (ids,), frontend="export", dynamic_batch=False)
    assert check_generalises(model, traced, (ids,)) is True


def test_check_generalises_says_when_fake_tensors_cannot_tell() -> None:
    class Selects(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0]  # a data-dependent output shape

    traced = trace(Selects(), (torch.randn(5),), frontend="fx")
    assert check_generalises(Selects(), traced, (torch.randn(5),)) is False


# ------------------------------------------------ (batch, length) pairs, hypothesis
STACK = Stack().double()
STACK_REF = copy.deepcopy(STACK)
STACK_STAGES = SignatureStages(STACK, ["blocks.1", "blocks.2"], devices=["cpu:0", "cpu:1", "cpu:2"], frontend="export")


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**16))
def test_transformer_stack_equals_eager_for_any_batch_and_length(batch: int, length: int, seed: int) -> None:
    ids = torch.randint(0, 32, (batch, length), generator=torch.Generator().manual_seed(seed))
    check_against_eager(STACK_STAGES, STACK_REF, (ids,))
    assert STACK_STAGES.traces == len(STACK_STAGES.cache)  # a trace per new key, reused after
    assert str(STACK_STAGES.stages_for((ids,)).traced.key) == f"ids: i64[{batch}, {length}]"
