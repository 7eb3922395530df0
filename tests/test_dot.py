"""Partition drawings as DOT: clusters per stage, labelled cut edges, a stage view that scales."""

import shutil
import subprocess

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.inspection import diagram as dot
from fxpipe.inspection import format as fmt
from fxpipe.inspection.diagram import partition_diagram, partition_dot


class SkipNet(nn.Module):
    """Three stages; ``h`` skips from stage 0 to stage 2."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.body(h)) + h


@pytest.fixture(scope="module")
def part() -> fxpipe.Partitioned:
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["body", "head"], microbatches=2)
    return fxpipe.partition(SkipNet(), plan, example_inputs=(torch.randn(6, 8),))


def _parses(source: str) -> bool:
    done = subprocess.run(["dot", "-Tcanon"], input=source, text=True, capture_output=True, check=False)
    return done.returncode == 0 and not done.stderr


def test_node_view_has_one_cluster_per_stage_and_cut_edges_with_shape_and_bytes(part):
    source = part.to_dot(level="node")
    assert source.count("subgraph cluster_") == 3
    assert "stage 2 · cpu:2" in source
    # h crosses to stage 1 and skips to stage 2; 6 x 16 float32 is 384 bytes.
    cut_labels = [line for line in source.splitlines() if "#dc2626" in line and "->" in line]
    assert len(cut_labels) == 3
    assert all("f32[6, 16] · 384 B" in line for line in cut_labels)
    assert "Linear · body.1" in source and "send → stage 2" in source and "recv ← stage 0" in source


def test_stage_view_is_a_box_per_stage_with_modules_params_flops_and_edge_totals(part):
    source = partition_dot(part, level="stage")
    assert "subgraph" not in source
    for index in range(3):
        assert f"<B>stage {index} · cpu:{index}</B>" in source
    assert "stage0 -> stage2" in source
    pad = "\u00a0\u00a0"  # three stages stack downwards: a label keeps clear of its arrow
    assert f"stage0 -> stage2 [label=<{pad}1 tensor · 384 B<BR/>{pad}192 B per micro-batch<BR/>{pad}stem f32[6, 16]>" in source
    assert "<B>stage 1 · cpu:1</B><BR/>body<BR/>" in source  # the whole Sequential, not its children
    assert "params" in source and "FLOP forward per batch" in source


def test_stage_boxes_carry_the_cost_models_flops_time_and_memory(part):
    source = part.to_dot("stage")
    for estimate in part.estimates():
        line = f"predicted {fmt.seconds(estimate.time)} per micro-batch · memory {fmt.nbytes(estimate.memory)}"
        assert line in source
    assert source.count("FLOP forward per batch") == 3


def test_auto_level_switches_to_the_stage_view_above_the_node_limit(part, monkeypatch):
    assert partition_diagram(part).level == "node"
    monkeypatch.setattr(dot, "NODE_VIEW_LIMIT", 5)
    assert partition_diagram(part).level == "stage"


def test_unknown_level_is_an_error_naming_the_choices(part):
    with pytest.raises(ValueError, match="'auto', 'node', 'stage'"):
        part.to_dot(level="module")


def test_labels_escape_html_and_odd_node_names():
    diagram = dot.Diagram("a < b & c", "node", "TB", boxes=[dot.Box("x.y", ["<x>", "a & b"])])
    source = diagram.to_dot()
    assert "a &lt; b &amp; c" in source and '"x.y" [' in source


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_graphviz_parses_both_views_of_a_resnet(part):
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"])
    resnet = fxpipe.partition(model, plan, example_inputs=(torch.randn(2, 3, 32, 32),))
    for source in (resnet.to_dot("node"), resnet.to_dot("stage"), part.to_dot("node"), part.to_dot("stage")):
        assert _parses(source)
