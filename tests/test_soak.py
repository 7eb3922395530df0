"""A sample of the soak (examples/benchmarks/soak.py, ``make soak``): short torchrun jobs
that compile a pipeline, step twice and return from the script. None may abort at
interpreter exit (SIGABRT, "terminate called without an active exception": a daemon
thread of fxpipe's still inside a C++ call) or hang.

And a sample of its faulted jobs (2 ranks: a rank raises; a rank is stopped with
SIGSTOP): no rank aborts, the launcher's summary and exit status blame the faulted rank,
and the job ends within ``Plan.timeout`` + 10 s of the fault."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "examples" / "benchmarks" / "soak.py"
JOBS = 1  # the full 200 under load: make soak (docs/results.md)
PLAN_TIMEOUT = 5.0

sys.path.insert(0, str(SOAK.parent))
import soak  # noqa: E402


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


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", [pytest.param("raise", marks=pytest.mark.slow), "stop"])  # the stopped rank's peers fail too
def test_a_faulted_job_ends_in_time_blaming_the_faulted_rank_without_aborts(kind: str) -> None:
    [job] = soak.fault_soak([kind], [2], 1, PLAN_TIMEOUT, 180.0, "mlp")
    assert not job.aborted, job.stderr[-4000:]
    assert job.seconds is not None, job.stderr[-4000:]  # the fault struck
    assert job.right_blame, (job.blamed, job.returncode, job.stderr[-4000:])
    assert job.seconds < PLAN_TIMEOUT + soak.GOAL, job.seconds
    if kind == "stop":
        assert "ended by this launcher once the others had named it" in job.stderr, job.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_launcher_blames_and_ends_a_stopped_middle_rank_of_four() -> None:
    [job] = soak.fault_soak(["stop"], [4], 1, PLAN_TIMEOUT, 180.0, "mlp")
    assert not job.aborted and job.right_blame and job.rank == 1, (job.blamed, job.returncode, job.stderr[-4000:])
    assert job.seconds is not None and job.seconds < PLAN_TIMEOUT + soak.GOAL, job.seconds


BLOCKED_AT_EXIT = """
import os, sys, threading, time, torch, torch.distributed as dist
from fxpipe.distributed import teardown
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    work = dist.irecv(torch.zeros(4), 0)  # rank 0 never sends: the wait ends when rank 0 exits
    thread = threading.Thread(target=work.wait, daemon=True)
    thread.start()
    dist.barrier()
    if sys.argv[1] == "retire":
        teardown.retire(thread, 0.1)  # what fxpipe's watchdog does with its threads at exit
else:
    dist.barrier()
    time.sleep(0.5)
    os._exit(0)  # ends abruptly (killed, or as a failed rank ends) while rank 1 finalises
"""


@pytest.mark.timeout(200)
def test_a_thread_blocked_on_a_peer_at_exit_aborts_unless_fxpipe_retired_it(tmp_path: Path) -> None:
    """The cause of the survivors' exit 134: a daemon thread in a gloo wait that wakes while
    the interpreter finalises. Left alone it aborts the rank; retired through
    fxpipe.distributed.teardown, the rank ends without teardown, status 0."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_AT_EXIT)
    ended = {}
    for how in ("plain", "retire"):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), how],
                             capture_output=True, text=True, timeout=90)
        ended[how] = (run.returncode, "terminate called without an active exception" in run.stderr, run.stderr[-3000:])
    assert ended["plain"][:2] != (0, False), ended["plain"]  # the abort this guards against
    assert ended["retire"][:2] == (0, False), ended["retire"]
