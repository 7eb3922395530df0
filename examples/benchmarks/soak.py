"""Soak: many short torchrun jobs in a row, counting how each one ended.

Each job is a fresh world of 2 ranks under torch's elastic agent (what ``torchrun`` runs;
``python -m fxpipe.distributed`` by default, which listens on 127.0.0.1 only, or
``torchrun --standalone`` itself): every rank compiles a tiny pipeline (an MLP, or a
GPT-2 with ``--model gpt2``), runs a few training steps, calls
``torch.distributed.destroy_process_group()`` and returns from the script, so the
interpreter's own teardown runs, with whatever fxpipe threads are still alive. Meanwhile
(unless ``--no-load``) one busy-loop process per core keeps the machine loaded, which
makes timing-dependent endings (a thread caught inside a C++ call at exit) likelier.

Every job is bounded by ``--timeout`` and counted as one of:

- ok: exit status 0 and every rank printed its losses;
- abort: a rank ended by SIGABRT (exit code -6, the agent's "Signal 6 (SIGABRT)", or
  libstdc++'s "terminate called ..." on stderr);
- hang: still running after the timeout (its process group is then killed);
- other: any other failure.

With ``--faults raise,nan,kill,stop`` it runs faulted jobs instead, ``--repeats`` of each
kind on each world size of ``--ranks`` (2,4): ``FXPIPE_INJECT`` strikes the second step's
forward on one rank (rank 1, 2, ... in turn; ``nan`` with ``Plan(check_finite=True)``),
``Plan(timeout=--plan-timeout)``. Each faulted job counts:

- aborts among the survivors: a rank ended by SIGABRT ("terminate called ...", the agent's
  exit code -6): the faulted rank is not a survivor, but none of these may abort either;
- right blame: the launcher's summary names the faulted rank ("rank R failed first", as
  the ranks named it, or as the first to exit when it died before they could) and the
  job's exit status is that rank's (1 after raise or nan, 137 when SIGKILL ended it:
  kill, or stop once the launcher ended it);
- seconds from the fault (logged by the injector) to the launcher's exit, against the goal
  of ``Plan.timeout`` + 10 s.

    python examples/benchmarks/soak.py                     # 200 jobs under load (make soak)
    python examples/benchmarks/soak.py --jobs 3 --no-load  # the sample tests/test_soak.py runs
    python examples/benchmarks/soak.py --faults raise,nan,kill,stop --repeats 5 --no-load

The last line printed is the summary; the first failing job's stderr comes before it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

KINDS = ("ok", "abort", "other", "hang")
RANKS = 2
DONE = "soak-rank-done"  # what a rank prints after its steps
FAULTS = ("raise", "nan", "kill", "stop")
GOAL = 10.0  # seconds past Plan.timeout within which a faulted job must end
EXPECTED_STATUS = {"raise": 1, "nan": 1, "kill": 128 + signal.SIGKILL, "stop": 128 + signal.SIGKILL}


# ------------------------------------------------------------------ one rank
def rank_main(model_name: str, steps: int, plan_timeout: float = 60.0) -> None:
    """One rank of a job: compile, ``steps`` training steps, leave the process group. The
    pipeline has one stage per rank (an MLP; GPT-2: 2 ranks); ``check_finite`` is on, so a
    ``nan`` fault is named where it arises."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import fxpipe

    torch.manual_seed(0)
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=1)
        model, split = GPT2LMHeadModel(config), ["transformer.h.1"]
        x, t = torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))

        def loss_fn(out, target):
            return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())
    else:
        ranks = int(os.environ["WORLD_SIZE"])
        layers = [m for _ in range(ranks) for m in (nn.Linear(16, 16), nn.Tanh())]
        model, split = nn.Sequential(*layers, nn.Linear(16, 3)), [str(2 * k) for k in range(1, ranks)]
        x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
        loss_fn = nn.CrossEntropyLoss()
    devices = [f"cpu:{k}" for k in range(len(split) + 1)]
    plan = fxpipe.Plan(devices=devices, split=split, microbatches=4, timeout=plan_timeout, check_finite=True)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=loss_fn)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(round(float(pipe.step(x, target=t)), 6))
        opt.step()
    print(DONE, os.environ["RANK"], json.dumps(losses), flush=True)
    dist.destroy_process_group()


# ------------------------------------------------------------------ the driver
@dataclass
class Job:
    kind: str
    seconds: float
    returncode: int | None
    stderr: str


def job_command(launcher: str, model: str, steps: int, ranks: int = RANKS, plan_timeout: float = 60.0) -> list[str]:
    worker = [os.path.abspath(__file__), "--rank", "--model", model, "--steps", str(steps), "--plan-timeout", str(plan_timeout)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *worker]
    return [sys.executable, "-m", "fxpipe.distributed", "-n", str(ranks), *worker]


def classify(returncode: int | None, stdout: str, stderr: str) -> str:
    if returncode is None:
        return "hang"
    if returncode == -signal.SIGABRT or "terminate called" in stderr or "SIGABRT" in stderr:
        return "abort"
    if returncode == 0 and stdout.count(DONE) == RANKS:
        return "ok"
    return "other"


def run_job(command: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[Job, str]:
    """Run one job in its own process group; kill that group when it outlives ``timeout``.
    Returns the job and its stdout."""
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = None
    return Job(classify(returncode, stdout, stderr), time.monotonic() - start, returncode, stderr), stdout


# ------------------------------------------------------------------ faulted jobs
@dataclass
class FaultJob:
    """One faulted job: ``kind`` struck ``rank`` of ``ranks``; what its end looked like."""

    kind: str
    ranks: int
    rank: int
    aborted: bool
    blamed: int | None  # the rank the launcher's summary names
    returncode: int | None
    seconds: float | None  # from the fault to the launcher's exit (None: it never struck)
    stderr: str

    @property
    def right_blame(self) -> bool:
        return self.blamed == self.rank and self.returncode == EXPECTED_STATUS[self.kind]


def run_fault_job(kind: str, ranks: int, rank: int, plan_timeout: float, timeout: float, model: str) -> FaultJob:
    """One job whose ``rank`` suffers ``kind`` in its second step's forward."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "faults.jsonl")
        env = {"FXPIPE_INJECT": f"{kind}:action=F{rank}:1:rank={rank}:step=2", "FXPIPE_INJECT_LOG": log}
        job, _ = run_job(job_command("fxpipe", model, 3, ranks, plan_timeout), timeout, env)
        end = time.time()
        struck = json.loads(open(log).readline())["time"] if os.path.exists(log) else None
    found = re.search(r"python -m fxpipe\.distributed: rank (\d+) failed first", job.stderr)
    aborted = job.kind == "abort"
    return FaultJob(kind, ranks, rank, aborted, int(found.group(1)) if found else None, job.returncode,
                    end - struck if struck is not None else None, job.stderr)


def fault_summary(jobs: list[FaultJob], plan_timeout: float) -> str:
    """One line: runs, aborts among survivors, right blame, seconds to exit (max, median)."""
    seconds = [j.seconds for j in jobs if j.seconds is not None]
    late = sum(1 for s in seconds if s > plan_timeout + GOAL)
    times = f"max {max(seconds):.1f} s, median {statistics.median(seconds):.1f} s" if seconds else "none struck"
    kinds = ",".join(sorted({j.kind for j in jobs}))
    sizes = ",".join(str(r) for r in sorted({j.ranks for j in jobs}))
    return (f"soak faults: {len(jobs)} runs ({kinds}; {sizes} ranks; Plan.timeout {plan_timeout:g} s): "
            f"aborts {sum(j.aborted for j in jobs)}, right blame {sum(j.right_blame for j in jobs)}/{len(jobs)}, "
            f"never struck {len(jobs) - len(seconds)}, seconds from fault to exit {times}, "
            f"over timeout+{GOAL:g} s {late}")


def fault_soak(kinds: list[str], sizes: list[int], repeats: int, plan_timeout: float, timeout: float, model: str) -> list[FaultJob]:
    """Every kind on every world size, ``repeats`` times; the faulted rank cycles 1, 2, ..."""
    jobs = []
    for ranks in sizes:
        for kind in kinds:
            for k in range(repeats):
                job = run_fault_job(kind, ranks, 1 + k % (ranks - 1), plan_timeout, timeout, model)
                jobs.append(job)
                print(f"{kind} rank {job.rank}/{ranks}: exit {job.returncode}, blamed {job.blamed}, abort {job.aborted}, "
                      f"{job.seconds if job.seconds is None else round(job.seconds, 1)} s after the fault", flush=True)
                if job.aborted or not job.right_blame:
                    print(job.stderr[-4000:].rstrip(), flush=True)
    return jobs


@contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """``processes`` busy-loop processes for the duration of the block."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def summary(counts: Counter, jobs: int, seconds: float, setting: str) -> str:
    parts = ", ".join(f"{kind} {counts[kind]}" for kind in KINDS)
    rate = 100.0 * counts["abort"] / max(1, jobs)
    return f"soak: {jobs} jobs ({setting}): {parts}; abort rate {rate:.1f}%; {seconds / max(1, jobs):.1f} s/job"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a job may run before it counts as a hang")
    parser.add_argument("--no-load", dest="load", action="store_false", help="no busy-loop processes beside the jobs")
    parser.add_argument("--load-processes", type=int, default=os.cpu_count() or 1, help="busy-loop processes (default: one per core)")
    parser.add_argument("--launcher", choices=("fxpipe", "torchrun"), default="fxpipe",
                        help="python -m fxpipe.distributed (loopback only) or torchrun --standalone")
    parser.add_argument("--faults", default="", help=f"faulted jobs instead: kinds among {','.join(FAULTS)}")
    parser.add_argument("--ranks", default="2,4", help="world sizes of the faulted jobs (mlp only)")
    parser.add_argument("--repeats", type=int, default=5, help="faulted jobs per kind and world size")
    parser.add_argument("--plan-timeout", type=float, default=None, help="Plan.timeout (default 60; 5 for faulted jobs)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank of a job
    ns = parser.parse_args(argv)
    if ns.rank:
        rank_main(ns.model, ns.steps, ns.plan_timeout or 60.0)
        return {}
    load = ns.load_processes if ns.load else 0
    if ns.faults:
        kinds = ns.faults.split(",")
        unknown = sorted(set(kinds) - set(FAULTS))
        if unknown:
            parser.error(f"--faults: unknown kind(s) {unknown}; choose among {','.join(FAULTS)}")
        plan_timeout = ns.plan_timeout or 5.0
        with cpu_load(load):
            jobs = fault_soak(kinds, [int(r) for r in ns.ranks.split(",")], ns.repeats, plan_timeout, ns.timeout, ns.model)
        print(fault_summary(jobs, plan_timeout), flush=True)
        return {"faults": jobs}

    setting = f"{ns.model}, {RANKS} ranks, {ns.steps} steps, {ns.launcher}, load {load} processes"
    command = job_command(ns.launcher, ns.model, ns.steps)
    print(f"fxpipe from {os.path.dirname(importlib.util.find_spec('fxpipe').origin)}", flush=True)
    counts: Counter = Counter()
    first_failure: Job | None = None
    start = time.monotonic()
    with cpu_load(load):
        for k in range(ns.jobs):
            job, _ = run_job(command, ns.timeout)
            counts[job.kind] += 1
            if job.kind != "ok" and first_failure is None:
                first_failure = job
                print(f"job {k}: {job.kind} (exit {job.returncode}, {job.seconds:.1f} s)", flush=True)
            if (k + 1) % 10 == 0:
                print(f"{k + 1}/{ns.jobs}: " + ", ".join(f"{kind} {counts[kind]}" for kind in KINDS), flush=True)
    seconds = time.monotonic() - start
    if first_failure is not None:
        print(f"--- stderr of the first failing job ({first_failure.kind}, exit {first_failure.returncode}) ---")
        print(first_failure.stderr[-6000:].rstrip())
        print("---")
    print(summary(counts, ns.jobs, seconds, setting), flush=True)
    return {"counts": dict(counts), "jobs": ns.jobs, "seconds": seconds}


if __name__ == "__main__":
    main()
