"""The fault grid: fault × stage × schedule on a 4-stage pipeline, one process per worker.

Every run launches a fresh world (``fxpipe.distributed.launch``, gloo on 127.0.0.1), runs
one clean training step, then one step in which ``FXPIPE_INJECT`` strikes one action of
one stage (see ``fxpipe.runtime.inject``):

- kill: the rank sends itself SIGKILL;  hang: the action sleeps past the timeout;
- raise: the action raises;             nan: the stage's forward outputs become NaN
  (the plan has ``check_finite=True``).

Each run records whether every rank ended on its own (none left for the launcher to
end: no hang), whether every other rank's error names the faulted rank and stage, and
the time from the fault (logged by the injector just before it strikes) to each other
rank's error. Schedules: gpipe, 1f1b and zb-h1 on 4 ranks; interleaved-1f1b (stages s
and s + 2 share a rank) and zb-v (stages s and 3 - s) with chunks=2 on 2 ranks. Fault
points per stage: F:0, F:2 and B:1 (zero-bubble: F:0, I:1 and W:2; nan: F:0, F:2, F:3).

    python examples/benchmarks/faults.py              # the full grid (make faults)
    python examples/benchmarks/faults.py --quick      # one fault point per stage
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import fxpipe
from fxpipe.distributed import LaunchError, RankFailedError, launch
from fxpipe.runtime.inject import ENV, LOG_ENV
from fxpipe.schedules import SCHEDULES as NAMES
from fxpipe.schedules import make_schedule, stage_workers

FAULTS = ("kill", "hang", "raise", "nan")
STAGES = 4
# (schedule, ranks, chunks): every schedule runs the same 4 stages
SCHEDULES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 2, 2), ("zb-h1", 4, 1), ("zb-v", 2, 2)]
MICROBATCHES = 4
NAN_POINTS = ("F{s}:0", "F{s}:2", "F{s}:3")  # a nan fault poisons a forward's outputs


def points(schedule: str, kind: str) -> tuple[str, ...]:
    """The actions a fault strikes in each stage: two forwards and a backward (zero-bubble
    schedules split the backward: its input-gradient half I and its weight-gradient half W)."""
    if kind == "nan":
        return NAN_POINTS
    return ("F{s}:0", "I{s}:1", "W{s}:2") if schedule.startswith("zb") else ("F{s}:0", "F{s}:2", "B{s}:1")
SLACK = 5.0  # seconds past the timeout an error may take (the goal)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run: ``kind`` strikes ``action`` of ``stage`` under ``schedule`` on ``ranks`` ranks."""

    schedule: str
    ranks: int
    chunks: int
    kind: str
    stage: int
    action: str
    timeout: float

    @property
    def rank(self) -> int:
        """The rank holding the faulted stage (where the schedule places it)."""
        return stage_workers(make_schedule(self.schedule, STAGES, MICROBATCHES, self.chunks))[self.stage]

    @property
    def spec(self) -> str:
        """The ``FXPIPE_INJECT`` value: strike in the second step (the first runs clean); a
        hang outlasts the others' timeout, then the hung rank finds the job failed."""
        hang = f":seconds={self.timeout + 6:g}" if self.kind == "hang" else ""
        return f"{self.kind}:rank={self.rank}:action={self.action}:step=2{hang}"


def available_schedules() -> list[tuple[str, int, int]]:
    """The grid's schedules that this fxpipe has."""
    return [s for s in SCHEDULES if s[0] in NAMES]


def grid(schedules: Sequence[tuple[str, int, int]], faults: Sequence[str], timeout: float, quick: bool = False) -> list[Case]:
    """Every (schedule, fault, stage, fault point) case; ``quick``: the first point only."""
    cases = []
    for schedule, ranks, chunks in schedules:
        for kind in faults:
            for stage in range(STAGES):
                for point in points(schedule, kind)[: 1 if quick else None]:
                    cases.append(Case(schedule, ranks, chunks, kind, stage, point.format(s=stage), timeout))
    return cases


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def rank_case(case: Case) -> dict[str, Any]:
    """On every rank: compile, one clean step, the faulted step; what this rank's error
    named and when (wall clock, to compare with the injector's log)."""
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    devices = [f"cpu:{r}" for r in range(case.ranks)]
    plan = fxpipe.Plan(
        devices=devices, split=["2", "4", "6"], schedule=case.schedule, chunks=case.chunks,
        microbatches=MICROBATCHES, timeout=case.timeout, check_finite=True,
    )
    pipe = fxpipe.compile(model(), plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    pipe.step(x, target=t)
    try:
        pipe.step(x, target=t)
    except RankFailedError as err:
        return {"rank": pipe.rank, "blamed": err.rank, "stage": err.stage, "time": time.time(), "error": f"{type(err).__name__}: {err}"}
    except Exception as err:  # noqa: BLE001 - a raw error is a finding, reported as such
        return {"rank": pipe.rank, "blamed": None, "stage": None, "time": time.time(), "error": f"{type(err).__name__}: {err}"}
    return {"rank": pipe.rank, "blamed": None, "stage": None, "time": time.time(), "error": None}


@dataclasses.dataclass
class Outcome:
    """What one run showed: every rank ended by itself; each other rank's blame and delay."""

    case: Case
    ended: bool
    fired: bool
    blame: dict[int, tuple[int | None, int | None]]  # other rank -> (rank, stage) its error named
    delays: dict[int, float]  # other rank -> seconds from the fault to its error
    errors: dict[int, str]
    seconds: float

    @property
    def correct(self) -> bool:
        expected = (self.case.rank, self.case.stage)
        others = [r for r in range(self.case.ranks) if r != self.case.rank]
        return self.fired and all(self.blame.get(r) == expected for r in others)

    @property
    def in_time(self) -> bool:
        return bool(self.delays) and max(self.delays.values()) <= self.case.timeout + SLACK


def run_case(case: Case, rank_fn: Callable[[Case], dict] = rank_case) -> Outcome:
    """Launch one world for ``case`` and collect what every rank reported."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "faults.jsonl")
        env = {ENV: case.spec, LOG_ENV: log}
        start = time.monotonic()
        limit = 4 * case.timeout + 60  # past this the launcher ends what is left: a hang
        try:
            results = dict(enumerate(launch(rank_fn, case.ranks, (case,), timeout=limit, grace=case.timeout + 15, env=env)))
            errors: dict[int, str] = {}
        except LaunchError as err:
            results, errors = err.results, err.errors
        seconds = time.monotonic() - start
        fired = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    struck = fired[0]["time"] if fired else None
    others = {r: v for r, v in results.items() if r != case.rank}
    blame = {r: (v["blamed"], v["stage"]) for r, v in others.items()}
    delays = {r: v["time"] - struck for r, v in others.items() if struck is not None and v["error"] is not None}
    ended = not any("ended by the launcher" in text for text in errors.values())
    texts = {r: v["error"] or "no error" for r, v in results.items()} | {r: text.splitlines()[0] for r, text in errors.items()}
    return Outcome(case, ended, bool(fired), blame, delays, texts, seconds)


def table(outcomes: Sequence[Outcome]) -> str:
    """One row per (schedule, fault): runs, hangs, correct blame, time from fault to error."""
    rows = ["| schedule | fault | runs | hangs | right rank and stage | time to error, median / max |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    keys = dict.fromkeys((o.case.schedule, o.case.kind) for o in outcomes)
    for schedule, kind in keys:
        group = [o for o in outcomes if (o.case.schedule, o.case.kind) == (schedule, kind)]
        delays = [d for o in group for d in o.delays.values()]
        spread = f"{statistics.median(delays):.2f} / {max(delays):.2f} s" if delays else "-"
        rows.append(
            f"| {schedule} | {kind} | {len(group)} | {sum(not o.ended for o in group)} | "
            f"{sum(o.correct for o in group)}/{len(group)} | {spread} |"
        )
    return "\n".join(rows)


def summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Totals over the grid: runs, hangs, runs with every other rank blaming right, runs
    with every error within timeout + SLACK, and the slowest error."""
    delays = [d for o in outcomes for d in o.delays.values()]
    return {
        "runs": len(outcomes),
        "hangs": sum(not o.ended for o in outcomes),
        "correct": sum(o.correct for o in outcomes),
        "in_time": sum(o.in_time for o in outcomes),
        "max_delay": max(delays, default=float("nan")),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fault point per stage (a quarter of the grid)")
    parser.add_argument("--timeout", type=float, default=5.0, help="Plan.timeout of every run, seconds")
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--schedules", nargs="+", default=None, help="a subset of gpipe 1f1b interleaved-1f1b zb-h1 zb-v")
    args = parser.parse_args(argv)
    schedules = [s for s in available_schedules() if args.schedules is None or s[0] in args.schedules]
    cases = grid(schedules, args.faults, args.timeout, args.quick)
    print(f"{len(cases)} runs, Plan.timeout = {args.timeout:g} s; load average {os.getloadavg()[0]:.1f} at the start")
    outcomes = []
    for k, case in enumerate(cases):
        outcome = run_case(case)
        outcomes.append(outcome)
        worst = " ".join(f"{d:.2f}" for _, d in sorted(outcome.delays.items())) or "-"
        flag = "" if outcome.correct and outcome.ended and outcome.in_time else "   <-- " + "; ".join(f"rank {r}: {e[:160]}" for r, e in outcome.errors.items())
        print(f"[{k + 1}/{len(cases)}] {case.schedule:<16} {case.kind:<5} stage {case.stage} {case.action:<6} ended={outcome.ended} right={outcome.correct} delays {worst} s ({outcome.seconds:.1f} s){flag}", flush=True)
    print()
    print(table(outcomes))
    totals = summary(outcomes)
    print(
        f"\n{totals['runs']} runs: {totals['hangs']} hangs, right rank and stage named by every other rank in "
        f"{totals['correct']}, every error within timeout + {SLACK:g} s in {totals['in_time']}; slowest error "
        f"{totals['max_delay']:.2f} s after the fault (timeout {args.timeout:g} s); load average {os.getloadavg()[0]:.1f} at the end"
    )
    return {"outcomes": outcomes, **totals}


if __name__ == "__main__":
    main()
