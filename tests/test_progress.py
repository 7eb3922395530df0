"""Compile progress: one line on stderr for a long compile, nothing for a short one."""

from __future__ import annotations

import gc
import io
import re
import time

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.compiler.progress import Progress


def test_a_short_compile_prints_nothing(capsys) -> None:
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    fxpipe.partition(model, fxpipe.Plan(), example_inputs=(x,))  # the process's first imports torch._dynamo
    capsys.readouterr()
    fxpipe.partition(model, fxpipe.Plan(), example_inputs=(x,))
    assert capsys.readouterr().err == ""


def test_a_long_compile_ends_with_one_summary_line_off_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("Net", stream=stream, after=0.05, tty=False) as progress:
        progress.phase("trace")
        time.sleep(0.03)
        progress.phase("shapes and costs")
        progress.nodes(10, 20)
        time.sleep(0.03)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("fxpipe: compiled Net in ")
    assert re.search(r"\(trace \d+\.\d+ ms, shapes and costs \d+\.\d+ ms\)$", lines[0]), lines[0]


def test_on_a_terminal_one_line_is_redrawn_with_the_phase_and_nodes() -> None:
    stream = io.StringIO()
    with Progress("Net", stream=stream, after=0.0, every=0.01, tty=True) as progress:
        progress.phase("shapes and costs")
        progress.nodes(64, 128)
        time.sleep(0.1)
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "\rfxpipe: compiling Net: shapes and costs 64/128 nodes" in text
    assert "\rfxpipe: compiled Net in " in text


def test_progress_can_be_silenced(monkeypatch) -> None:
    monkeypatch.setenv("FXPIPE_PROGRESS", "0")
    stream = io.StringIO()
    with Progress("Net", stream=stream, after=0.0, tty=False) as progress:
        progress.phase("trace")
    assert stream.getvalue() == ""


_COLLECTOR_SEEN: list[bool] = []  # whether the garbage collector was enabled, per traced call


class _CollectorProbe(nn.Module):
    """Doubles its input; records in _COLLECTOR_SEEN whether the garbage collector runs
    while it is traced (the tracer may run a copy of the module)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _COLLECTOR_SEEN.append(gc.isenabled())
        if self.fail:
            raise ValueError("probe fails")
        return x * 2


def test_compile_pauses_the_garbage_collector_and_restores_it() -> None:
    _COLLECTOR_SEEN.clear()
    model = nn.Sequential(nn.Linear(4, 4), _CollectorProbe(), nn.Linear(4, 2)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    assert _COLLECTOR_SEEN and not any(_COLLECTOR_SEEN)  # paused while tracing
    assert gc.isenabled()
    torch.testing.assert_close(pipe(x), model(x))  # float64: equal to eager up to rounding
    gc.disable()  # a caller's own choice is kept
    try:
        fxpipe.compile(model, plan, example_inputs=(x,))
        assert not gc.isenabled()
    finally:
        gc.enable()
    failing = nn.Sequential(nn.Linear(4, 4), _CollectorProbe(fail=True))
    with pytest.raises(ValueError, match="probe fails"):
        fxpipe.compile(failing, plan, example_inputs=(x.float(),))
    assert gc.isenabled()
