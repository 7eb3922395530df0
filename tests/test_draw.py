"""Partition drawings as files: Graphviz when installed, the matplotlib renderer always."""

import shutil
import subprocess

import matplotlib.image
import pytest
import torch
from svg_bounds import outside_view_box
from test_contents import Stack
from test_dot import SkipNet

import fxpipe
from fxpipe.inspection import render as draw_module
from fxpipe.inspection.diagram import partition_diagram
from fxpipe.inspection.render import DrawError, draw, fallback_size, graphviz_available, layout

needs_graphviz = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")


@pytest.fixture(scope="module")
def part() -> fxpipe.Partitioned:
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["body", "head"], microbatches=2)
    return fxpipe.partition(SkipNet(), plan, example_inputs=(torch.randn(6, 8),))


@pytest.mark.parametrize("level", ["node", "stage"])
def test_matplotlib_png_opens_with_the_size_of_its_layout(part, tmp_path, level):
    path = draw(part, tmp_path / "part.png", level=level, renderer="matplotlib")
    image = matplotlib.image.imread(path)
    width, height = fallback_size(partition_diagram(part, level))
    assert abs(image.shape[1] - width) <= 1 and abs(image.shape[0] - height) <= 1
    assert image[..., :3].min() < 0.5  # something dark was drawn: text and arrows


def test_matplotlib_svg_and_pdf(part, tmp_path):
    svg = part.draw(tmp_path / "part.svg", renderer="matplotlib")
    assert svg.read_text().lstrip().startswith("<?xml") and "stage 1 · cpu:1" in svg.read_text()
    pdf = part.draw(tmp_path / "part.pdf", level="stage", renderer="matplotlib")
    assert pdf.read_bytes().startswith(b"%PDF")


def test_fallback_layout_puts_stages_in_order_and_routes_skip_links_around_boxes(part):
    diagram = partition_diagram(part, "node")
    placed = layout(diagram)
    tops = [placed.clusters[s][1] for s in range(3)]
    bottoms = [placed.clusters[s][3] for s in range(3)]
    assert tops[0] < bottoms[0] < tops[1] < bottoms[1] < tops[2]
    skip = next(
        route for link, route in zip(diagram.links, placed.routes) if link.cut and link.src == "send_stem_to_2"
    )
    detour_x = skip[1][0]
    between = [p for p in placed.boxes.values() if skip[0][1] < p.y < skip[-1][1]]
    assert between and all(detour_x > p.x + p.width / 2 for p in between)


def test_dot_suffix_writes_the_source(part, tmp_path):
    path = part.draw(tmp_path / "part.dot", level="stage")
    assert path.read_text() == part.to_dot("stage")


def test_unknown_format_and_missing_graphviz_are_errors(part, tmp_path, monkeypatch):
    with pytest.raises(DrawError, match=r"\.svg, \.png, \.pdf or \.dot"):
        draw(part, tmp_path / "part.bmpx")
    with pytest.raises(ValueError, match="renderer must be one of"):
        draw(part, tmp_path / "part.png", renderer="ascii")
    monkeypatch.setattr(draw_module.shutil, "which", lambda name: None)
    with pytest.raises(DrawError, match="apt-get install graphviz"):
        draw(part, tmp_path / "part.png", renderer="graphviz")
    assert draw(part, tmp_path / "part.png").exists()  # auto falls back to matplotlib


@needs_graphviz
@pytest.mark.parametrize("level", ["node", "stage"])
def test_graphviz_png_opens_with_the_size_graphviz_laid_out(part, tmp_path, level):
    path = draw(part, tmp_path / "part.png", level=level, renderer="graphviz")
    plain = subprocess.run(["dot", "-Tplain"], input=part.to_dot(level), text=True, capture_output=True, check=True)
    _, _, width, height = plain.stdout.split("\n")[0].split()
    pad = 2 * 4 / 72  # Graphviz's default pad: 4 points on each side
    image = matplotlib.image.imread(path)
    assert abs(image.shape[1] - (float(width) + pad) * draw_module.DPI) <= 2
    assert abs(image.shape[0] - (float(height) + pad) * draw_module.DPI) <= 2


@needs_graphviz
def test_graphviz_svg_of_a_compiled_pipeline(tmp_path):
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["head"])
    pipe = fxpipe.compile(SkipNet(), plan, example_inputs=(torch.randn(4, 8),))
    text = pipe.draw(tmp_path / "pipe.svg", level="node").read_text()
    assert "<svg" in text and "cluster_1" in text


# ------------------------------------------------------------------ nothing clipped
RENDERERS = [
    pytest.param("graphviz", marks=needs_graphviz),
    "matplotlib",
]


@pytest.fixture(scope="module")
def stack() -> fxpipe.Partitioned:
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["blocks.2.mlp", "blocks.4"], microbatches=2)
    return fxpipe.partition(Stack(), plan, example_inputs=(torch.randn(4, 4),))


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("level", ["node", "stage"])
def test_every_svgs_view_box_holds_every_element(part, stack, tmp_path, renderer, level):
    for name, partition in (("skip", part), ("stack", stack)):
        path = draw(partition, tmp_path / f"{name}.svg", level=level, renderer=renderer)
        assert outside_view_box(path) == [], path.read_text()[:400]


def test_the_svg_check_finds_what_a_view_box_clips(tmp_path):
    clipped = tmp_path / "clipped.svg"
    clipped.write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 100 50"><g transform="scale(1.33)">'
        '<rect x="10" y="10" width="70" height="20"/><text x="10" y="34" font-size="8">clipped on the right</text>'
        '<defs><path d="M 0 0 L 500 500"/></defs></g></svg>'
    )
    assert [line.split(">")[0] for line in outside_view_box(clipped)] == ["<rect", "<text"]
    if graphviz_available():  # what Graphviz 2.43 writes when given a resolution for an SVG
        source = "digraph { a -> b [label=x] }"
        done = subprocess.run(["dot", "-Tsvg", "-Gdpi=96", "-o", str(clipped)], input=source, text=True, check=True)
        assert done.returncode == 0 and outside_view_box(clipped)


@pytest.mark.parametrize("renderer", RENDERERS)
def test_a_hundred_and_twenty_layers_draw_as_a_box_per_stage_of_block_ranges(tmp_path, renderer):
    plan = fxpipe.Plan(devices=[f"cpu:{i}" for i in range(6)], split="auto", microbatches=6)
    part = fxpipe.partition(Stack(layers=120), plan, example_inputs=(torch.randn(6, 4),))
    diagram = partition_diagram(part)
    assert diagram.level == "stage"  # auto: far above the node view's limit
    assert [b.id for b in diagram.boxes if b.id.startswith("stage")] == [f"stage{s}" for s in range(6)]
    for box, modules in zip(diagram.boxes[1:], part.stage_contents()):
        assert any(" – blocks." in m for m in modules), modules  # repeated blocks collapse into a range
        assert len(box.lines) <= 8, box.lines
    path = draw(part, tmp_path / "deep.svg", renderer=renderer)
    assert outside_view_box(path) == []
