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

    python examples/benchmarks/soak.py                     # 200 jobs under load (make soak)
    python examples/benchmarks/soak.py --jobs 3 --no-load  # the sample tests/test_soak.py runs

The last line printed is the summary; the first failing job's stderr comes before it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

KINDS = ("ok", "abort", "other", "hang")
RANKS = 2
DONE = "soak-rank-done"  # what a rank prints after its steps


# ------------------------------------------------------------------ one rank
def rank_main(model_name: str, steps: int) -> None:
    """One rank of a job: compile, ``steps`` training steps, leave the process group."""
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
        model, split = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)), ["2"]
        x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
        loss_fn = nn.CrossEntropyLoss()
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=split, microbatches=4, timeout=60)
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


def job_command(launcher: str, model: str, steps: int) -> list[str]:
    worker = [os.path.abspath(__file__), "--rank", "--model", model, "--steps", str(steps)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), *worker]
    return [sys.executable, "-m", "fxpipe.distributed", "-n", str(RANKS), *worker]


def classify(returncode: int | None, stdout: str, stderr: str) -> str:
    if returncode is None:
        return "hang"
    if returncode == -signal.SIGABRT or "terminate called" in stderr or "SIGABRT" in stderr:
        return "abort"
    if returncode == 0 and stdout.count(DONE) == RANKS:
        return "ok"
    return "other"


def run_job(command: list[str], timeout: float) -> Job:
    """Run one job in its own process group; kill that group when it outlives ``timeout``."""
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = None
    return Job(classify(returncode, stdout, stderr), time.monotonic() - start, returncode, stderr)


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
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank of a job
    ns = parser.parse_args(argv)
    if ns.rank:
        rank_main(ns.model, ns.steps)
        return {}

    load = ns.load_processes if ns.load else 0
    setting = f"{ns.model}, {RANKS} ranks, {ns.steps} steps, {ns.launcher}, load {load} processes"
    command = job_command(ns.launcher, ns.model, ns.steps)
    print(f"fxpipe from {os.path.dirname(importlib.util.find_spec('fxpipe').origin)}", flush=True)
    counts: Counter = Counter()
    first_failure: Job | None = None
    start = time.monotonic()
    with cpu_load(load):
        for k in range(ns.jobs):
            job = run_job(command, ns.timeout)
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
