"""Partition drawings as files: Graphviz when installed, the matplotlib renderer always."""

import shutil
import subprocess

import matplotlib.image
import pytest
import torch
from test_dot import SkipNet

import fxpipe
from fxpipe.drawing import render as draw_module
from fxpipe.drawing.diagram import partition_diagram
from fxpipe.drawing.render import DrawError, draw, fallback_size, layout

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
