"""Each distinct block is traced once: the others are stamped from its nodes, node for node
the graph a full trace gives, equal to eager; costed once; split="auto" cuts between them.
Layers that an integer attribute, a hook or a per-layer constant makes different are not
stamped from each other."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import check_pipeline_matches_eager
from torch import nn

import fxpipe
from fxpipe.passes.blocks import rebase
from fxpipe.passes.fx_tracer import PipeTracer
from fxpipe.passes.meta import BLOCK, COMPUTE_OPS, COST, MODULE_PATH
from fxpipe.passes.trace_fx import root_call, trace_fx

W = 8
MSE = nn.MSELoss()


def traced_both_ways(model: nn.Module, *args: torch.Tensor) -> tuple:
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args)
    bound.apply_defaults()
    stamped = trace_fx(model, signature, bound, (), {})
    full = trace_fx(model, signature, bound, (), {}, stamp_blocks=False)
    return stamped, full


def stamps(model: nn.Module, *args: torch.Tensor) -> int:
    """How many calls a trace of ``model(*args)`` stamped."""
    bound = inspect.signature(model.forward).bind(*args)
    bound.apply_defaults()
    tracer = PipeTracer()
    tracer.trace_call(model, root_call(bound, {})[0])
    return tracer.blocks.stamped


def test_a_deep_lm_is_one_trace_of_its_layer_node_for_node() -> None:
    model = pytest.importorskip("llm_models").gpt2(layers=8)
    ids = torch.randint(3, 64, (2, 6))
    stamped, full = traced_both_ways(model, ids)
    assert stamps(model, ids) >= 7  # h.1 ... h.7 from h.0
    a, b = list(stamped.graph_module.graph.nodes), list(full.graph_module.graph.nodes)
    assert [(n.op, str(n.target)) for n in a] == [(n.op, str(n.target)) for n in b]
    assert [n.meta.get(MODULE_PATH) for n in a] == [n.meta.get(MODULE_PATH) for n in b]
    assert {n.meta.get(BLOCK) for n in a} >= {f"transformer.h.{k}" for k in range(8)}
    expected = model(ids).logits
    torch.testing.assert_close(stamped.build_output(stamped.graph_module(*stamped.bind_inputs((ids,), {}))).logits, expected)


def test_each_distinct_layer_is_costed_once() -> None:
    model = pytest.importorskip("llm_models").gpt2(layers=6)
    part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.3"]), example_inputs=(torch.randint(3, 64, (2, 6)),))
    per_layer: dict[str, list] = {}
    for node in part.graph.nodes:
        block = node.meta.get(BLOCK)
        if block and node.op in COMPUTE_OPS:
            per_layer.setdefault(".".join(block.split(".")[:3]), []).append(id(node.meta[COST]))
    costs = list(per_layer.values())
    assert len(costs) == 6 and all(len(c) == len(costs[0]) for c in costs)
    distinct = {cost for layer in costs for cost in layer}
    assert len(distinct) <= 1.25 * len(costs[0])  # the cost pass ran about one layer's worth of nodes


class Indexed(nn.Module):
    """A layer whose forward uses its index (a scale and a branch) and keeps an unused one."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.index = index
        self.layer_idx = index  # never read in forward: does not keep layers apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * (self.index + 1)
        if self.index % 2:
            h = -h
        return x + h.tanh()


class Plain(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.layer_idx = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x).tanh()


class WithConstant(nn.Module):
    """A per-layer tensor made in forward from an integer attribute: a constant of the trace."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.tensor(float(self.index), dtype=x.dtype)


def stack(layer: type, depth: int = 6, hook: bool = False) -> nn.Sequential:
    layers = [layer(k) for k in range(depth)]
    if hook:
        for k, m in enumerate(layers):
            m.register_forward_hook(lambda mod, inp, out, k=k: out * (1 + k / 10))
    return nn.Sequential(*layers, nn.Linear(W, 2)).double()


@pytest.mark.parametrize(
    ("layer", "hook", "stamped"),
    # layer 0 takes the input (no gradient), the others a layer's output: 2..5 from layer 1
    [(Plain, False, 4), (Indexed, False, 0), (WithConstant, False, 0), (Plain, True, 0)],
    ids=["unused index", "used index", "per-layer constant", "hooked"],
)
def test_only_layers_that_trace_alike_are_stamped_and_every_pipeline_equals_eager(layer: type, hook: bool, stamped: int) -> None:
    model = stack(layer, hook=hook)
    x, t = torch.randn(8, W, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    assert stamps(model, x) == stamped
    plan = dict(devices=["cpu:0", "cpu:1"], split=["3"], microbatches=2)
    check_pipeline_matches_eager(model, plan, (x,), t, MSE, rtol=1e-10, atol=1e-12)


def test_split_auto_cuts_between_stamped_layers() -> None:
    model = pytest.importorskip("llm_models").gpt2(layers=12)
    part = fxpipe.partition(copy.deepcopy(model), fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split="auto"), example_inputs=(torch.randint(3, 64, (4, 16)),))
    layers = [{p.split(".")[2] for p in s.module_paths if p.startswith("transformer.h.")} for s in part.stages]
    assert all(layers) and not any(a & b for a in layers for b in layers if a is not b)  # no layer cut in two


def test_rebase_moves_only_the_block_prefix() -> None:
    assert rebase("transformer.h.1.attn.c_attn.weight", "transformer.h.1", "transformer.h.12") == "transformer.h.12.attn.c_attn.weight"
    assert rebase("transformer.h.10.mlp", "transformer.h.1", "transformer.h.2") == "transformer.h.10.mlp"
    assert rebase("transformer.wte.weight", "transformer.h.1", "transformer.h.2") == "transformer.wte.weight"
