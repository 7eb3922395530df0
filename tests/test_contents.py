"""What each stage holds, in the model's names: module ranges that never overlap, parts of
blocks a cut falls inside, and crossing values named by the module producing them."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.inspection.contents import RANGE, stage_contents

GPT2_BLOCK = ["ln_1", "attn.c_attn", "attn.c_proj", "attn", "ln_2", "mlp.c_fc", "mlp.act", "mlp.c_proj", ""]


def gpt2_paths(layers: int) -> list[str]:
    """The module path of each node of a GPT-2's forward, in order ("" for the model's own code)."""
    paths = ["", "transformer", "transformer.wte", "transformer.wpe", "transformer.drop"]
    for k in range(layers):
        paths += [f"transformer.h.{k}.{p}".rstrip(".") for p in GPT2_BLOCK]
    return paths + ["transformer.ln_f", "transformer", "lm_head", ""]


def cut(paths: list[str], *starts: str) -> list[list[str]]:
    """``paths`` cut before the first node of each path in ``starts``."""
    at = [0] + [paths.index(s) for s in starts] + [len(paths)]
    return [paths[a:b] for a, b in zip(at, at[1:])]


def test_whole_blocks_become_ranges_and_a_cut_block_names_each_part():
    stages = stage_contents(cut(gpt2_paths(12), "transformer.h.6.attn.c_attn"))
    assert stages == [
        ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0 – transformer.h.6 (up to ln_1)"],
        ["transformer.h.6 (from attn) – transformer.h.11", "transformer.ln_f", "lm_head"],
    ]


def test_a_cut_between_blocks_gives_ranges_that_meet():
    stages = stage_contents(cut(gpt2_paths(12), "transformer.h.6.ln_1"))
    assert stages[0][-1] == "transformer.h.0 – transformer.h.5"
    assert stages[1][0] == "transformer.h.6 – transformer.h.11"


def test_cuts_inside_a_child_and_inside_a_leaf_go_as_deep_as_they_must():
    paths = gpt2_paths(4)
    stages = stage_contents(cut(paths, "transformer.h.1.mlp.c_proj", "transformer.h.2.attn.c_proj"))
    assert stages[0][-1] == "transformer.h.0 – transformer.h.1 (up to mlp.act)"
    assert stages[1] == ["transformer.h.1 (from mlp.c_proj) – transformer.h.2 (up to attn.c_attn)"]
    assert stages[2][0] == "transformer.h.2 (from attn.c_proj) – transformer.h.3"
    # a leaf module whose operations are cut: GELU's tanh in one stage, its product in the next
    leaf = paths[: paths.index("transformer.h.1.mlp.act") + 1] + ["transformer.h.1.mlp.act"] + paths[paths.index("transformer.h.1.mlp.act") + 1 :]
    stages = stage_contents([leaf[: leaf.index("transformer.h.1.mlp.act") + 1], leaf[leaf.index("transformer.h.1.mlp.act") + 1 :]])
    assert stages[0][-1].endswith("transformer.h.1 (up to part of mlp.act)")
    assert stages[1][0].startswith("transformer.h.1 (from part of mlp.act)")


def test_a_stage_inside_one_block_names_both_ends_and_a_root_only_stage_says_so():
    paths = gpt2_paths(2)
    stages = stage_contents(cut(paths, "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc"))
    assert stages[1] == ["transformer.h.0 (from attn.c_proj to ln_2)"]
    assert stage_contents([["a", "b"], ["", ""]]) == [["a", "b"], ["(root)"]]


def test_one_stage_names_top_level_modules_whole():
    assert stage_contents([gpt2_paths(3)]) == [["transformer", "lm_head"]]
    assert stage_contents([["conv1", "bn1", "layer1.0.conv1", "layer1.1.conv1", "fc"]]) == [["conv1", "bn1", "layer1", "fc"]]


def _named(label: str) -> str:
    return label.split(" (")[0]


@given(st.integers(2, 9), st.lists(st.integers(1, 10**6), min_size=1, max_size=5))
def test_no_module_is_named_whole_by_two_stages_and_ranges_follow_the_order(layers, cuts):
    paths = gpt2_paths(layers)
    at = sorted({1 + c % (len(paths) - 1) for c in cuts})
    pieces = [paths[a:b] for a, b in zip([0, *at], [*at, len(paths)])]
    stages = stage_contents(pieces)
    whole: dict[str, int] = {}
    for s, items in enumerate(stages):
        assert items, s
        for item in items:
            ends = item.split(RANGE)
            for end in ends:
                if "(" not in end:
                    assert whole.setdefault(_named(end), s) == s, (end, stages)
            if len(ends) == 2:  # a range runs over numbered siblings, forwards
                low, high = (int(_named(e).rpartition(".")[2]) for e in ends)
                assert low < high
    # a block named in part by several stages is named by the stages holding its nodes
    for k in range(layers):
        block = f"transformer.h.{k}"
        holders = {s for s, piece in enumerate(pieces) if any(p.startswith(block + ".") or p == block for p in piece)}
        naming = {s for s, items in enumerate(stages) if any(_mentions(item, k) for item in items)}
        assert naming == holders, (block, stages)


def _mentions(item: str, k: int) -> bool:
    """Whether a contents item covers block k: itself, in a range, or a module holding it."""
    ends = [_named(e) for e in item.split(RANGE)]
    if "(" not in item and f"transformer.h.{k}.".startswith(item + "."):
        return True
    if not all(e.startswith("transformer.h.") for e in ends):
        return False
    indices = [int(e.rpartition(".")[2]) for e in ends]
    return indices[0] <= k <= indices[-1]


# ---------------------------------------------------------------- on a traced model
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Stack(nn.Module):
    """An embedding, ``layers`` residual blocks and a head: a decoder's shape in small."""

    def __init__(self, layers: int = 6, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def stack() -> fxpipe.Partitioned:
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["blocks.2.mlp", "blocks.4"], microbatches=2)
    return fxpipe.partition(Stack(), plan, example_inputs=(torch.randn(4, 4),))


def test_summary_explain_and_drawing_name_the_same_contents(stack):
    assert stack.stage_contents() == [
        ["embed", "blocks.0 – blocks.2 (up to attn)"],
        ["blocks.2 (from mlp) – blocks.3"],
        ["blocks.4 – blocks.5", "head"],
    ]
    summary, explain, dot = stack.summary(), stack.explain(), stack.to_dot("stage")
    for modules in stack.stage_contents():
        assert ", ".join(modules) in summary and "runs " + ", ".join(modules) in explain
        assert all(item in dot for item in modules)


def test_crossing_values_are_named_by_the_module_that_produces_them(stack):
    rows = stack.crossing_rows()
    assert rows[0] == ("from", "to", "value", "shape", "bytes", "fx node")
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows[1:]] == [
        ("0", "1", "blocks.2 · add", "f32[4, 8]", "128 B"),
        ("1", "2", "blocks.3 · add", "f32[4, 8]", "128 B"),
    ]
    assert "values crossing stages:" in stack.summary()
    explain = stack.explain()
    assert "send to stage 1: blocks.2 · add f32[4, 8] (128 B; fx node " in explain
    assert "recv from stage 0: blocks.2 · add f32[4, 8] (128 B; fx node " in explain
