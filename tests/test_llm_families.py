"""Every LLM family traces, splits into >= 2 stages (by module path and by split="auto")
and equals eager at three sequence lengths, with boundaries that never move.

At the trace/partition level: per length a trace by its TraceKey, the same cut, the stage
GraphModules run in order by hand, forward and backward in float64. A sample runs by
default; the full family x split grid is marked slow.
"""

from __future__ import annotations

import copy

import pytest
import torch
from llm_models import FAMILIES
from staging import SignatureStages, check_against_eager

SAMPLE = {("gpt2", "paths"), ("llama", "auto"), ("bert", "paths"), ("t5", "paths")}
GRID = [
    pytest.param(name, split, marks=() if (name, split) in SAMPLE else pytest.mark.slow, id=f"{name}-{split}")
    for name in FAMILIES
    for split in ("paths", "auto")
]


@pytest.mark.parametrize(("name", "split"), GRID)
def test_llm_family_matches_eager_at_three_lengths(name: str, split: str) -> None:
    family = FAMILIES[name]
    model = family.build().double()
    ref = copy.deepcopy(model)
    stages = SignatureStages(model, family.split if split == "paths" else "auto")
    boundaries = None
    for length in family.lengths:
        inputs = family.inputs(3, length, torch.Generator().manual_seed(length))
        inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
        check_against_eager(stages, ref, (), inputs)
        staged = stages.stages_for((), inputs)
        assert len(staged.modules) >= 2
        if boundaries is None:
            boundaries = staged.stage_modules()
        assert staged.stage_modules() == boundaries, "a stage boundary moved with the sequence length"
    assert stages.traces == 3  # one trace per length: each bakes its sizes
    assert stages.frontend == "export"
