"""Every LLM family traces with torch.fx (the default frontend), splits into >= 2 stages (by
module path and by split="auto") and equals eager at three sequence lengths, with the
attention mask left out (None) and given (padded tails), with boundaries that never move.

At the trace/partition level: per length a trace by its TraceKey, the same cut, the stage
GraphModules run in order by hand, forward and backward in float64. A sample runs by
default; the full family x split x mask grid is marked slow.
"""

from __future__ import annotations

import copy

import pytest
import torch
from llm_models import FAMILIES
from staging import SignatureStages, check_against_eager

# families whose forward takes an attention mask over its (first) token input
MASKED = {"gpt2", "gpt-neo", "opt", "llama", "mistral", "qwen2", "bert", "t5", "bart"}
SAMPLE = {("gpt2", "paths", "none"), ("gpt2", "paths", "mask"), ("llama", "auto", "mask"), ("bert", "paths", "mask"), ("t5", "paths", "none")}
GRID = [
    pytest.param(name, split, mask, marks=() if (name, split, mask) in SAMPLE else pytest.mark.slow, id=f"{name}-{split}-{mask}")
    for name in FAMILIES
    for split in ("paths", "auto")
    for mask in (("none", "mask") if name in MASKED else ("none",))
]


def family_inputs(name: str, length: int, mask: str) -> dict[str, torch.Tensor]:
    """The family's inputs at ``length`` (float64), with or without an attention mask that
    pads the tails of some rows."""
    inputs = FAMILIES[name].inputs(3, length, torch.Generator().manual_seed(length))
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    inputs.pop("attention_mask", None)
    if mask == "mask":
        padded = torch.ones(3, length, dtype=torch.long)
        for row in range(3):
            padded[row, length - row % 3 :] = 0
        inputs["attention_mask"] = padded
    return inputs


@pytest.mark.parametrize(("name", "split", "mask"), GRID)
def test_llm_family_matches_eager_at_three_lengths(name: str, split: str, mask: str) -> None:
    family = FAMILIES[name]
    model = family.build().double()
    ref = copy.deepcopy(model)
    stages = SignatureStages(model, family.split if split == "paths" else "auto")
    boundaries = None
    for length in family.lengths:
        inputs = family_inputs(name, length, mask)
        check_against_eager(stages, ref, (), inputs)
        staged = stages.stages_for((), inputs)
        assert len(staged.modules) >= 2
        if boundaries is None:
            boundaries = staged.stage_modules()
        assert staged.stage_modules() == boundaries, "a stage boundary moved with the sequence length"
    assert stages.frontend == "fx"
    # one trace per length where the trace followed a branch on sizes (its key holds them)
    assert stages.traces in (1, 3)
