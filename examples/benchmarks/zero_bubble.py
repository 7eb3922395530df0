"""Zero-bubble schedules: fxpipe's 1F1B, ZB-H1 and ZB-V against torch.distributed.pipelining.

One process per pipeline rank (``fxpipe.distributed.launch``, gloo on 127.0.0.1, one
intra-op thread each), two models split into equal blocks:
  mlp          16 blocks of Linear(1024, 1024) + GELU and a classifier, batch 256
  transformer  8 pre-norm attention blocks (width 128, 4 heads, MLP 512, 32 tokens, no
               dropout) and a classifier, batch 64
For each model and micro-batch count, in interleaved rounds (a fresh world per run, the
median step after warm-up on rank 0):
  fxpipe 1f1b, zb-h1        p stages, one per rank
  fxpipe zb-v               2p stages, stages s and 2p-1-s on rank s (chunks=2)
  TDP 1f1b, TDP zb, TDP zbv torch.distributed.pipelining's Schedule1F1B,
                            ScheduleInterleavedZeroBubble (one stage per rank: its ZB1P)
                            and ScheduleZBVZeroBubble, on the same split points, built
                            with its own pipeline() and build_stage() (ZB-V's warm-up
                            message to its own rank is dropped: gloo cannot send it)
fxpipe's simulated bubble (pipe.simulate(), from the cost model) and its measured one
(pipe.timeline(): every rank's events on one clock, 1 - busy / (ranks x step)) are printed
beside each step time, then the ratios the goals name: zb-h1 / 1F1B (goal <= 0.90 at
p=4, m=8) and fxpipe / TDP for the zero-bubble schedules (goal <= 0.85).

With --plots DIR, Gantt charts of the transformer at the first micro-batch count: the
measured step of every rank above the predicted one, per fxpipe schedule.

Sizes: a stage's forward of one micro-batch takes 5-20 ms on one core, its activation
message is 64-130 KB (well under a millisecond on loopback), so compute dominates.
NOTE: with more ranks than cores (4 ranks on a 2-core machine) an idle rank's core goes
to a busy one, so bubbles cost little and the schedules converge: the ZB goals are about
devices that idle, e.g. one GPU per rank. --procs 2 shows it on 2 cores.

    .venv/bin/python examples/benchmarks/zero_bubble.py [--procs 4] [--microbatches 8 16]
        [--models mlp transformer] [--rounds 2] [--steps 6] [--plots docs/img] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.distributed import launch

FXPIPE = ("1f1b", "zb-h1", "zb-v")
TDP = ("tdp-1f1b", "tdp-zb", "tdp-zbv")
PLOTS: list[Path] = []


class Block(nn.Module):
    """A pre-norm transformer block: attention (scaled_dot_product_attention) and an MLP."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, n, 3, self.heads, w // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, n, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Classifier(nn.Module):
    """Mean over tokens, then a linear layer."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(1))


def build(case: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model (blocks named "0", "1", ..., then the classifier), its batch and target."""
    torch.manual_seed(0)
    if case == "mlp":
        blocks = [nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(16)]
        return (
            nn.Sequential(*blocks, nn.Linear(1024, 10)),
            torch.randn(256, 1024),
            torch.randint(0, 10, (256,)),
        )
    if case == "transformer":
        blocks = [Block(128, 4, 512) for _ in range(8)]
        return (
            nn.Sequential(*blocks, Classifier(128, 10)),
            torch.randn(64, 32, 128),
            torch.randint(0, 10, (64,)),
        )
    if case == "tiny":  # --quick
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)]
        return (
            nn.Sequential(*blocks, nn.Linear(64, 10)),
            torch.randn(32, 64),
            torch.randint(0, 10, (32,)),
        )
    raise ValueError(f"unknown model {case!r}: choose mlp, transformer or tiny")


def split_points(model: nn.Sequential, stages: int) -> list[str]:
    """Module names that begin stages 1..stages-1: equal numbers of blocks per stage."""
    blocks = len(model) - 1
    if blocks % stages:
        raise ValueError(f"{blocks} blocks do not split into {stages} equal stages")
    return [str(k * blocks // stages) for k in range(1, stages)]


def timed(step: Callable[[], object], steps: int, warmup: int) -> list[float]:
    """Step times after warm-up (a barrier before each)."""
    times = []
    for k in range(warmup + steps):
        dist.barrier()
        began = time.perf_counter()
        step()
        if k >= warmup:
            times.append(time.perf_counter() - began)
    dist.barrier()
    return times


def fxpipe_run(case: str, schedule: str, m: int, steps: int, warmup: int) -> dict:
    model, x, t = build(case)
    p = int(os.environ["WORLD_SIZE"])  # set by launch and torchrun
    chunks = 2 if schedule == "zb-v" else 1
    plan = fxpipe.Plan(
        devices=[f"cpu:{r}" for r in range(p)],
        split=split_points(model, p * chunks),
        schedule=schedule,
        chunks=chunks,
        microbatches=m,
    )
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    times = timed(lambda: pipe.step(x, target=t), steps, warmup)
    measured = pipe.timeline()  # every rank's events of the last step, gathered on one clock
    first = pipe.rank == 0
    return {
        "times": times,
        "measured": measured if first else None,
        "predicted": pipe.simulate() if first else None,
    }


def skip_self_messages(stage) -> None:
    """TDP's warm-up exchanges a message with each neighbouring stage, also when both
    stages are on this rank (ZB-V's turn: stages p-1 and p); gloo cannot send to its own
    rank ("Pair is not connected"), so every ScheduleZBVZeroBubble run failed. Those
    messages are dropped: they carry nothing (a placeholder tensor)."""
    ops = stage._get_init_p2p_neighbors_ops
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops() if op.peer != dist.get_rank()]


def tdp_run(case: str, schedule: str, m: int, steps: int, warmup: int) -> dict:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        SplitPoint,
        pipeline,
    )

    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    model, x, t = build(case)
    per_rank = 2 if schedule == "tdp-zbv" else 1
    points = split_points(model, p * per_rank)
    pipe = pipeline(
        model, mb_args=(x.chunk(m)[0],), split_spec={name: SplitPoint.BEGINNING for name in points}
    )
    indices = [rank, 2 * p - 1 - rank] if per_rank == 2 else [rank]
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in indices]
    for stage in stages:
        skip_self_messages(stage)
    loss_fn = nn.CrossEntropyLoss()
    if schedule == "tdp-1f1b":
        run = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn)
    elif schedule == "tdp-zb":
        run = ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn)
    else:
        run = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=loss_fn)
    first, last = 0 in indices, p * per_rank - 1 in indices

    def step() -> None:
        kwargs = {"target": t, "losses": []} if last else {}
        if first:
            run.step(x, **kwargs)
        else:
            run.step(**kwargs)

    times = timed(step, steps, warmup)
    dist.destroy_process_group()
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=4, help="pipeline ranks (processes)")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "transformer"],
        choices=["mlp", "transformer", "tiny"],
    )
    parser.add_argument("--microbatches", nargs="+", type=int, default=[8, 16])
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds (a fresh world per run)"
    )
    parser.add_argument(
        "--steps", type=int, default=6, help="timed steps per run, after 2 warm-up steps"
    )
    parser.add_argument(
        "--plots", help="folder for the transformer's Gantt charts (measured over predicted)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny MLP, 2 ranks, m=4, one round of 2 steps: a check that it runs",
    )
    args = parser.parse_args()
    if args.quick:
        args.procs, args.models, args.microbatches, args.rounds, args.steps = 2, ["tiny"], [4], 1, 2
    p, warmup = args.procs, 2
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; {p} processes x 1 thread (gloo); "
        f"{args.rounds} interleaved round(s) of {args.steps} steps after {warmup} warm-up; zb-v and TDP zbv on {2 * p} stages"
    )
    header = f"{'model':12} {'m':>3} " + " ".join(f"{name:>10}" for name in FXPIPE + TDP)
    ratios: list[str] = []
    for case in args.models:
        for m in args.microbatches:
            samples: dict[str, list[float]] = {name: [] for name in FXPIPE + TDP}
            bubbles: dict[str, tuple[float, float]] = {}
            for _ in range(args.rounds):
                for name in FXPIPE:
                    ranks = launch(fxpipe_run, p, (case, name, m, args.steps, warmup))
                    samples[name] += ranks[0]["times"]
                    measured, predicted = ranks[0]["measured"], ranks[0]["predicted"]
                    bubbles[name] = (predicted.bubble_fraction, measured.bubble_fraction)
                    if args.plots and case == "transformer" and m == args.microbatches[0]:
                        path = Path(args.plots) / f"zero-bubble-{name}.png"
                        path.parent.mkdir(parents=True, exist_ok=True)
                        PLOTS.append(path)
                        measured.plot(
                            path,
                            other=predicted,
                            title=f"fxpipe {name}, transformer, {p} ranks, m={m}: measured (top), predicted (bottom)",
                        )
                for name in TDP:
                    samples[name] += launch(tdp_run, p, (case, name, m, args.steps, warmup))[0][
                        "times"
                    ]
            med = {name: statistics.median(v) for name, v in samples.items()}
            if header:
                print(header + "   (median step, ms)")
                header = ""
            print(
                f"{case:12} {m:3} " + " ".join(f"{med[name] * 1e3:10.1f}" for name in FXPIPE + TDP)
            )
            shares = [f"b {100 * bubbles[n][0]:.0f}/{100 * bubbles[n][1]:.0f}%" for n in FXPIPE]
            print(f"{'':12} {'':3} " + " ".join(f"{share:>10}" for share in shares))
            ratios.append(
                f"{case:12} m={m:<3} zb-h1/1f1b {med['zb-h1'] / med['1f1b']:.3f}x  zb-v/1f1b {med['zb-v'] / med['1f1b']:.3f}x  "
                f"zb-h1/TDP zb {med['zb-h1'] / med['tdp-zb']:.3f}x  zb-v/TDP zbv {med['zb-v'] / med['tdp-zbv']:.3f}x  "
                f"1f1b/TDP 1f1b {med['1f1b'] / med['tdp-1f1b']:.3f}x"
            )
    print("b = fxpipe's bubble, simulated / measured (1 - busy / (ranks x step))")
    print("\nratios (goals at p=4, m=8: zb-h1/1f1b <= 0.90, fxpipe zero-bubble / TDP <= 0.85)")
    print("\n".join(ratios))
    for path in PLOTS:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
