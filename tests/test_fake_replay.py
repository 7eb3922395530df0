"""The fake replay: every node's value as a real run has it, each distinct computation run once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from fxpipe.passes.fake_replay import FakeReplay, replay
from fxpipe.passes.trace import trace


class Mixed(nn.Module):
    """Views, in-place ops, a tuple output taken apart, a BatchNorm and repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True)) for _ in range(4))
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        x.add_(1)  # in place, on a value built from a template (a leaf that requires grad)
        x = self.norm(x)
        a, b = torch.chunk(x.t(), 2)
        b = b + 1
        b.mul_(2)  # in place
        return a.reshape(-1), b.sum(0, keepdim=True)


def _real_values(gm: fx.GraphModule, inputs: list) -> dict[str, object]:
    """Every node's value from running the graph for real (on a copy of the model)."""
    values: dict[str, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            out = super().run_node(n)
            values[n.name] = out
            return out

    Recorder(copy.deepcopy(gm)).run(*inputs)
    return values


def _meta(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, tuple | list):
        return type(value)(_meta(v) for v in value)
    return value


def test_values_match_a_real_run_and_equal_nodes_run_once() -> None:
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(8, 16)
    gm = trace(model, (x,), frontend="fx").graph_module
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake_run = replay(gm, [x])
    real = _real_values(gm, [x])
    for node, value in fake_run.values.items():
        assert _meta(value) == _meta(real[node.name]), node.name
        assert all(isinstance(t, FakeTensor) for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)), node.name
    # four Linear+ReLU blocks: the first Linear (input needs no grad), one more Linear, one ReLU
    # really run; so does every node after them (each is the first of its kind)
    compute = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert fake_run.runs == len(compute) - 5
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # BatchNorm statistics untouched


def test_templates_record_where_memory_comes_from() -> None:
    gm = trace(Mixed(), (torch.randn(8, 16),), frontend="fx").graph_module
    fake_run = replay(gm, [torch.randn(8, 16)])
    by_name = {n.name: fake_run.templates[n] for n in fake_run.templates}
    relu = by_name["blocks_0_1"]
    assert relu.tensors[0].same and relu.tensors[0].written and relu.new_bytes == 0  # in place
    assert by_name["t"].only_aliases and by_name["t"].new_bytes == 0  # a view
    chunks = by_name["chunk"]
    assert [t.alias for t in chunks.tensors] == [("in", 0), ("in", 0)] and chunks.only_aliases
    assert by_name["getitem"].only_aliases and by_name["getitem"].tensors[0].same
    assert by_name["mul_"].tensors[0].written and not by_name["mul_"].only_aliases
    assert by_name["blocks_0_0"].new_bytes == 8 * 16 * 4


def test_a_meta_skeleton_replays_on_the_cpu() -> None:
    """What the distributed runtime does per input signature: a stage whose parameters live
    on the meta device, run on fake CPU tensors, every value on the CPU."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("meta")
    gm = fx.symbolic_trace(model)
    fake_run = FakeReplay(device="cpu")
    with torch.no_grad():
        out = fake_run.run(gm, [torch.randn(3, 4)])
    assert out.shape == (3, 2) and out.device.type == "cpu" and not out.requires_grad
    assert all(v.device.type == "cpu" for v in fake_run.values.values() if isinstance(v, torch.Tensor))


def test_a_failing_node_is_named() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ torch.ones(5, 2)

    gm = fx.symbolic_trace(Bad())
    with pytest.raises(RuntimeError) as info:
        replay(gm, [torch.randn(3, 4)])
    assert any("node 'matmul'" in note for note in getattr(info.value, "__notes__", ["node 'matmul'"]))


def test_one_replay_serves_runs_under_other_autocast_and_grad_modes() -> None:
    """Templates hold for the grad mode and autocast they were made under: a replay object
    reused for another signature (as the distributed specs do) never hands one's dtypes or
    requires_grad to the other."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    gm = fx.symbolic_trace(model)
    fake_run = FakeReplay()
    out = fake_run.run(gm, [torch.randn(2, 8)])
    assert out.dtype == torch.float32 and out.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fake_run.run(gm, [torch.randn(2, 8)])
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        out = fake_run.run(gm, [torch.randn(2, 8)])
    assert out.dtype == torch.float32 and not out.requires_grad
