"""Faults end in bounded time, naming the culprit: injected faults, non-finite values, start-up.

- ``FXPIPE_INJECT`` (``fxpipe.runtime.inject``): its syntax, and faults in the local
  executor over random plans (hypothesis): PipelineError names the stage and micro-batch;
  1,000 failing steps leave memory and threads flat.
- ``Plan(check_finite=True)``: the first NaN/Inf is named with its stage, action,
  micro-batch and edge; off, a diverging model behaves as eager.
- A sample of the distributed fault grid of ``examples/benchmarks/faults.py`` (the full
  grid is ``make faults``): every rank ends, every other rank names the faulted rank and
  stage, within the timeout + 5 s.
- Start-up: a rank failing before its first step (before compile, while compiling, while
  loading weights, never started, a plan mismatch) is named on every other rank by a
  RankFailedError within the timeout + 5 s.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_grads_match, eager_microbatch_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runtime import mlp
from torch import nn

import fxpipe
from fxpipe.distributed import LaunchError, PlanMismatchError, RankFailedError, launch
from fxpipe.runtime import inject
from fxpipe.runtime.finite import NonFiniteError
from fxpipe.schedules import make_schedule

# the grid's code lives in its benchmark script; a rank imports this module, which finds it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "benchmarks"))
import faults as grid  # noqa: E402

CE = nn.CrossEntropyLoss()
LAUNCH_TIMEOUT = 120
TIMEOUT = 5.0  # Plan.timeout of the distributed cases
SLACK = grid.SLACK


def devices(n: int) -> list[str]:
    return [f"cpu:{k}" for k in range(n)]


# ------------------------------------------------------------------ the syntax
def test_fault_specs_parse_and_malformed_ones_say_how_to_write_them() -> None:
    faults = inject.parse("hang:rank=2:action=F2:1:seconds=0.5; raise:action=B0:3:step=2")
    assert [(f.kind, f.action, f.rank, f.step, f.seconds) for f in faults] == [
        ("hang", "F2:1", 2, 1, 0.5),
        ("raise", "B0:3", None, 2, 3600.0),
    ]
    assert inject.parse("") == []
    for bad, says in [
        ("explode:action=F0:0", "kind 'explode'"),
        ("raise:rank=1", "needs action="),
        ("raise:action=F0", "needs action="),
        ("nan:action=B1:0", "give an F action"),
        ("hang:action=F0:0:speed=2", "unknown or malformed"),
        ("raise:action=F0:0:rank=two", "integers"),
        ("raise:action=F0:0:step=0", "counts from 1"),
    ]:
        with pytest.raises(inject.FaultSpecError, match=says):
            inject.parse(bad)


def test_no_faults_armed_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(inject.ENV, raising=False)
    monkeypatch.setattr(inject, "_armed", (-1, None))
    assert inject.armed() is None
    monkeypatch.setenv(inject.ENV, "raise:action=F0:0")
    monkeypatch.setattr(inject, "_armed", (-1, None))
    assert inject.armed() is not None
    monkeypatch.setenv(inject.ENV, "")  # read once per process: no re-read
    assert inject.armed() is not None
    monkeypatch.setattr(inject, "_armed", (-1, None))


# ---------------------------------------------------------- the local executor
def test_each_fault_kind_in_the_local_executor_names_stage_and_micro_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=devices(3), split=["2", "6"], microbatches=4, timeout=0.5, check_finite=True)
    pipe = fxpipe.compile(mlp(), plan, example_inputs=(x,), loss_fn=CE)
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv(inject.LOG_ENV, str(log))
    cases = [
        ("raise:action=B1:2", r"stage 1 on cpu:1 failed in B1:2 \(micro-batch 2\): InjectedFault"),
        ("hang:action=F2:3:seconds=1.5", r"stage 2 on cpu:2 has been running F2:3 \(micro-batch 3\)"),
        ("nan:action=F0:1", r"stage 0 on cpu:0 failed in F0:1 \(micro-batch 1\): NonFiniteError: the activation stage 0 sends on edge 0 \('_1', stage 0 -> stage 1\) is not finite: 32 NaN"),
        ("nan:action=F2:0", r"failed in F2:0 \(micro-batch 0\): NonFiniteError: the model's output \(stage 2\) is not finite"),
    ]
    for spec, message in cases:
        start = time.monotonic()
        with inject.injected(spec), pytest.raises(fxpipe.PipelineError, match=message) as info:
            pipe.step(x, target=t)
        fault = inject.parse(spec)[0]
        assert (info.value.stage, info.value.microbatch) == (int(fault.action[1]), int(fault.action[-1]))
        assert time.monotonic() - start < plan.timeout + 2.0
    assert [line.count('"kind"') for line in log.read_text().splitlines()] == [1] * len(cases)
    with inject.injected("kill:action=F0:0"):  # kill does not apply in one process
        pipe.step(x, target=t)
    time.sleep(1.5)  # the hung stage's thread finishes its sleep and retires
    pipe.zero_grad()
    ref = mlp()
    ref.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(pipe.step(x, target=t), eager_microbatch_step(ref, (x,), t, CE, 4))
    assert_grads_match(pipe, ref)


@st.composite
def faulty_plans(draw: st.DrawFn) -> tuple[dict, str, str]:
    """A plan (stages, schedule, micro-batches) and one of its actions to strike."""
    stages = draw(st.integers(1, 4))
    schedules = ["gpipe", "1f1b", "zb-h1"] + (["interleaved-1f1b", "zb-v"] if stages % 2 == 0 else [])
    schedule = draw(st.sampled_from(schedules))
    chunks = 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    m = draw(st.integers(1, 6))
    actions = [a for worker in make_schedule(schedule, stages, m, chunks) for a in worker]
    action = draw(st.sampled_from(actions))
    kind = draw(st.sampled_from(["raise", "hang"]))
    plan = dict(devices=devices(stages // chunks), split=[str(2 * k) for k in range(1, stages)], schedule=schedule, chunks=chunks, microbatches=m)
    return plan, kind, str(action)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(faulty_plans())
def test_a_fault_anywhere_in_any_plan_ends_the_step_naming_its_stage_and_micro_batch(case: tuple[dict, str, str]) -> None:
    plan, kind, action = case
    timeout = 0.3
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(**plan, timeout=timeout), example_inputs=(x,), loss_fn=CE)
    # the hang outlasts the timeout by far, so that a slow watcher on a loaded machine still sees it
    spec = f"hang:action={action}:seconds=3" if kind == "hang" else f"raise:action={action}"
    start = time.monotonic()
    with inject.injected(spec), pytest.raises(fxpipe.PipelineError) as info:
        pipe.step(x, target=t)
    elapsed = time.monotonic() - start
    stage, microbatch = (int(v) for v in action[1:].split(":"))
    assert (info.value.stage, info.value.microbatch, str(info.value.action)) == (stage, microbatch, action), str(info.value)
    assert (f"has been running {action}" if kind == "hang" else f"failed in {action}") in str(info.value)
    assert elapsed < timeout + 2.5, elapsed


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set size from Linux's /proc")
def test_a_thousand_failing_steps_leave_memory_and_threads_flat() -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=devices(2), split=["4"], microbatches=4, timeout=0.2), example_inputs=(x,), loss_fn=CE)

    def failing_steps(n: int, spec: str) -> None:
        for _ in range(n):
            with inject.injected(spec), pytest.raises(fxpipe.PipelineError):
                pipe.step(x, target=t)

    def extra_threads() -> list[threading.Thread]:
        """This pipeline's worker threads beyond the one per worker it keeps."""
        kept = {worker.thread for worker in pipe._executor._threads.values()}
        return [th for th in threading.enumerate() if th.name.startswith("fxpipe-worker") and th not in before and th not in kept]

    before = set(threading.enumerate())  # other tests' threads, whatever becomes of them
    failing_steps(100, "raise:action=B1:2")  # warm: allocator pools, autograd caches
    rss = _rss_bytes()
    failing_steps(1000, "raise:action=B1:2")
    assert len(pipe._executor._threads) == 2 and not extra_threads()
    assert _rss_bytes() - rss < 8 * 2**20, (_rss_bytes() - rss) / 2**20
    # a hung stage's thread is abandoned for a fresh one, and ends when its action returns
    failing_steps(10, "hang:action=F1:1:seconds=1.0")
    pipe.step(x, target=t)  # on a fresh thread
    deadline = time.monotonic() + 5
    while extra_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pipe._executor._threads) == 2 and not extra_threads()


def test_compiled_pipelines_end_their_threads_when_collected() -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    threads = []
    for _ in range(5):
        pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=devices(2), split=["4"], microbatches=2), example_inputs=(x,), loss_fn=CE)
        pipe.step(x, target=t)
        threads += [worker.thread for worker in pipe._executor._threads.values()]
        del pipe
        gc.collect()
    assert len(threads) == 10
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


# ------------------------------------------------------------- check_finite
class Overflows(nn.Module):
    """Finite until stage 1's exp overflows float32 for large inputs: diverging training."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.exp(self.a(x)))


def test_check_finite_off_lets_a_diverging_step_through_as_eager_and_on_names_where() -> None:
    model = Overflows()
    x, t = torch.randn(8, 4), torch.randint(0, 3, (8,))
    x[5] *= 1e4  # micro-batch 2 (samples 4 and 5) overflows
    plan = dict(devices=devices(2), split=["b"], microbatches=4)
    ref = Overflows()
    ref.load_state_dict(model.state_dict())
    eager = eager_microbatch_step(ref, (x,), t, CE, 4)
    assert not torch.isfinite(eager)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    loss = pipe.step(x, target=t)
    assert bool(loss.isnan()) == bool(eager.isnan()) and bool(loss.isinf()) == bool(eager.isinf())
    checked = fxpipe.compile(model, {**plan, "check_finite": True}, example_inputs=(x,), loss_fn=CE)
    with pytest.raises(fxpipe.PipelineError, match=r"stage 0 on cpu:0 failed in F0:2 \(micro-batch 2\): NonFiniteError: the activation stage 0 sends on edge 0 \('exp', stage 0 -> stage 1\) is not finite: 0 NaN and \d+ Inf") as info:
        checked.step(x, target=t)
    assert isinstance(info.value.__cause__, NonFiniteError) and info.value.__cause__.edge == 0


def test_check_finite_on_a_finite_model_changes_nothing() -> None:
    x, t = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 3, (8,))
    model = mlp().double()
    ref = mlp().double()
    ref.load_state_dict(model.state_dict())
    pipe = fxpipe.compile(model, dict(devices=devices(2), split=["4"], microbatches=4, checkpoint=True, check_finite=True), example_inputs=(x,), loss_fn=CE)
    torch.testing.assert_close(pipe.step(x, target=t), eager_microbatch_step(ref, (x,), t, CE, 4), rtol=0, atol=1e-12)
    assert_grads_match(pipe, ref, rtol=1e-12, atol=1e-12)


def test_check_finite_must_be_a_bool() -> None:
    with pytest.raises(fxpipe.PlanError, match="check_finite"):
        fxpipe.Plan(check_finite="yes")


# ------------------------------------------------- the distributed fault grid
def rank_case(case: grid.Case) -> dict:
    return grid.rank_case(case)


SAMPLE = [
    grid.Case("1f1b", 4, 1, "hang", 2, "B2:1", TIMEOUT),
    grid.Case("gpipe", 4, 1, "kill", 1, "F1:2", TIMEOUT),
    grid.Case("interleaved-1f1b", 2, 2, "kill", 3, "B3:1", TIMEOUT),
    grid.Case("interleaved-1f1b", 2, 2, "raise", 2, "F2:2", TIMEOUT),
    grid.Case("1f1b", 4, 1, "nan", 3, "F3:2", TIMEOUT),
    grid.Case("zb-h1", 4, 1, "kill", 2, "I2:1", TIMEOUT),
    grid.Case("zb-v", 2, 2, "raise", 2, "W2:2", TIMEOUT),
]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize("case", SAMPLE, ids=lambda c: f"{c.schedule}-{c.kind}-{c.action}")
def test_a_sample_of_the_fault_grid_ends_with_the_right_culprit_in_bounded_time(case: grid.Case) -> None:
    outcome = grid.run_case(case, rank_case)
    assert outcome.fired and outcome.ended, outcome
    assert outcome.correct, outcome.errors
    assert outcome.in_time, outcome.delays


# ------------------------------------------------------------------- start-up
def startup_case(scenario: str) -> dict:
    """On every rank: compile (failing as ``scenario`` says on one rank); what the error named."""
    rank = int(os.environ["RANK"])
    start = time.monotonic()
    x = torch.randn(8, 16)
    # the success path waits for a slow peer's start-up as long as a real job would
    timeout = 60.0 if scenario == "none" else TIMEOUT
    plan = dict(devices=devices(int(os.environ["WORLD_SIZE"])), split=["2", "4"], microbatches=4, timeout=timeout)
    weights = None
    if rank == 1 and scenario == "compile":
        plan["split"] = ["2", "no.such.module"]
    if rank == 1 and scenario == "mismatch":
        plan["microbatches"] = 2
    if rank == 1 and scenario == "weights":
        weights = {"2.weight": torch.zeros(3, 3)}  # the wrong shape for its stage's layer
    if rank == 2 and scenario == "model":
        raise ValueError("rank 2 cannot build its model")
    if rank == 0 and scenario == "store host":
        return {"skipped": True}
    try:
        pipe = fxpipe.compile(mlp(), plan, example_inputs=(x,), loss_fn=CE, weights=weights)
        loss = pipe.step(x, target=torch.randint(0, 3, (8,)))
    except RankFailedError as err:
        return {"rank": err.rank, "type": type(err).__name__, "message": str(err), "elapsed": time.monotonic() - start}
    return {"rank": None, "loss": float(loss), "elapsed": time.monotonic() - start}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _survivors(scenario: str, env: dict | None = None, nprocs: int = 3) -> dict[int, dict]:
    try:
        return dict(enumerate(launch(startup_case, nprocs, (scenario,), timeout=LAUNCH_TIMEOUT, grace=TIMEOUT + 15, env=env)))
    except LaunchError as err:
        return err.results


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
@pytest.mark.parametrize(
    "scenario, culprit, says",
    [
        ("model", 2, "rank 2 (stage 2) never joined: it did not start, failed before fxpipe.compile"),
        ("compile", 1, "rank 1 failed while compiling: AnnotateError: plan.split[1] = 'no.such.module'"),
        ("weights", 1, "rank 1 failed while loading its stages' weights: MaterializeError: weights['2.weight'] has shape (3, 3)"),
        ("mismatch", 1, "rank 1 differs from rank 0 in plan"),
    ],
)
def test_a_rank_failing_before_its_first_step_is_named_on_every_rank_within_the_timeout(scenario: str, culprit: int, says: str) -> None:
    results = _survivors(scenario)
    others = {r: v for r, v in results.items() if r != culprit or scenario == "mismatch"}
    assert len(others) == (3 if scenario == "mismatch" else 2), results
    for rank, r in others.items():
        assert r["rank"] == culprit and says in r["message"], (rank, r)
        assert r["elapsed"] < TIMEOUT + SLACK, (rank, r)
    if scenario == "mismatch":
        assert all(r["type"] == PlanMismatchError.__name__ for r in others.values())


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_rank_that_never_starts_is_named_within_the_timeout() -> None:
    results = _survivors("never started", env={"WORLD_SIZE": "3"}, nprocs=2)  # rank 2 of 3 is never launched
    for rank, r in results.items():
        assert r["rank"] == 2 and "rank 2 (stage 2) never joined" in r["message"], (rank, r)
        assert TIMEOUT <= r["elapsed"] < TIMEOUT + SLACK, (rank, r)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_under_plain_env_rendezvous_rank_0_hosts_the_store_and_is_named_when_absent() -> None:
    plain = {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    results = _survivors("none", env={**plain, "MASTER_PORT": str(_free_port())}, nprocs=2)
    assert all(r.get("loss") is not None for r in results.values()), results  # rank 0 hosts it; the step runs
    results = _survivors("store host", env={**plain, "MASTER_PORT": str(_free_port())}, nprocs=2)
    r = results[1]
    assert r["rank"] == 0 and "could not reach the job's store" in r["message"] and "rank 0" in r["message"], r
    assert r["elapsed"] < TIMEOUT + SLACK, r
