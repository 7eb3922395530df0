"""A sample of the soak (examples/benchmarks/soak.py, ``make soak``): short torchrun jobs
that compile a pipeline, step twice and return from the script. None may abort at
interpreter exit (SIGABRT, "terminate called without an active exception": a daemon
thread of fxpipe's still inside a C++ call) or hang."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "examples" / "benchmarks" / "soak.py"
JOBS = 3  # the full 200 under load: make soak (docs/results.md)


@pytest.mark.timeout(300)
def test_short_torchrun_jobs_end_without_aborts_or_hangs() -> None:
    done = subprocess.run(
        [sys.executable, str(SOAK), "--jobs", str(JOBS), "--no-load", "--timeout", "60"],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"soak: (\d+) jobs .*: ok (\d+), abort (\d+), other (\d+), hang (\d+)", done.stdout)
    assert found, done.stdout[-3000:] + done.stderr[-3000:]
    jobs, ok, aborts, other, hangs = map(int, found.groups())
    assert jobs == JOBS and aborts == 0 and hangs == 0, done.stdout[-6000:]
    assert ok + other == JOBS and other == 0, done.stdout[-6000:]
