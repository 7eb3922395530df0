"""DualPipeV: fxpipe's dualpipev against its zb-v and torch.distributed.pipelining's ScheduleDualPipeV.

One process per pipeline rank (``fxpipe.distributed.launch``, gloo on 127.0.0.1, one
intra-op thread each), 2 ranks by default, an MLP of 16 blocks (Linear(512, 512) + GELU)
and a classifier, batch 128, cut into 2p stages of equal blocks placed in a V (stages s
and 2p-1-s on rank s). For each micro-batch count, in interleaved rounds (a fresh world
per run, the median step after warm-up on rank 0):
  fxpipe zb-v            Plan(schedule="zb-v", chunks=2)
  fxpipe dualpipev       Plan(schedule="dualpipev", chunks=2)
  TDP dualpipev          torch.distributed.pipelining's ScheduleDualPipeV on the same
                         split points, built with its own pipeline() and build_stage()
                         (its warm-up message to its own rank is dropped: gloo cannot
                         send it)
fxpipe's simulated bubble (pipe.simulate(), from the cost model) is printed beside each
of its step times, then the ratios the issue names: fxpipe dualpipev / TDP dualpipev
(goal <= 1.0) and dualpipev / zb-v.

TDP's ScheduleDualPipeV needs at least 2p micro-batches; fxpipe's dualpipev 2p - 1.

    .venv/bin/python examples/benchmarks/dualpipev.py [--procs 2] [--microbatches 8 16]
        [--rounds 3] [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fxpipe
from fxpipe.distributed import launch

sys.path.insert(0, str(Path(__file__).parent))
from zero_bubble import split_points, timed  # noqa: E402 - the split and timing helpers beside this file

FXPIPE = ("zb-v", "dualpipev")
TDP = ("tdp-dualpipev",)


def build(case: str) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model (blocks named "0", "1", ..., then the classifier), its batch and target."""
    torch.manual_seed(0)
    width, blocks, batch = {"mlp": (512, 16, 128), "tiny": (64, 8, 32)}[case]
    layers = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)]
    return nn.Sequential(*layers, nn.Linear(width, 10)), torch.randn(batch, width), torch.randint(0, 10, (batch,))


def fxpipe_run(case: str, schedule: str, m: int, steps: int, warmup: int) -> dict:
    model, x, t = build(case)
    p = int(os.environ["WORLD_SIZE"])  # set by launch and torchrun
    plan = fxpipe.Plan(devices=[f"cpu:{r}" for r in range(p)], split=split_points(model, 2 * p), schedule=schedule, chunks=2, microbatches=m)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    times = timed(lambda: pipe.step(x, target=t), steps, warmup)
    return {"times": times, "bubble": pipe.simulate().bubble_fraction if pipe.rank == 0 else None}


def tdp_run(case: str, schedule: str, m: int, steps: int, warmup: int) -> dict:
    from torch.distributed.pipelining import ScheduleDualPipeV, SplitPoint, pipeline

    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    model, x, t = build(case)
    points = split_points(model, 2 * p)
    pipe = pipeline(model, mb_args=(x.chunk(m)[0],), split_spec={name: SplitPoint.BEGINNING for name in points})
    stages = [pipe.build_stage(i, torch.device("cpu")) for i in (rank, 2 * p - 1 - rank)]
    for stage in stages:
        # the V's turn (stages p-1 and p) is on one rank: gloo cannot send to itself
        ops = stage._get_init_p2p_neighbors_ops
        stage._get_init_p2p_neighbors_ops = lambda ops=ops: [op for op in ops() if op.peer != rank]
    run = ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=nn.CrossEntropyLoss())

    def step() -> None:
        # rank 0 holds the first stage (the input) and the last (the target)
        if rank == 0:
            run.step(x, target=t, losses=[])
        else:
            run.step()

    times = timed(step, steps, warmup)
    dist.destroy_process_group()
    return {"times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a fresh world per run)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run, after 2 warm-up steps")
    parser.add_argument("--quick", action="store_true", help="a tiny MLP, 2 ranks, m=4, one round of 2 steps: a check that it runs")
    args = parser.parse_args()
    case = "mlp"
    if args.quick:
        case, args.procs, args.microbatches, args.rounds, args.steps = "tiny", 2, [4], 1, 2
    p, warmup = args.procs, 2
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; {p} processes x 1 thread (gloo); "
        f"{case}, {2 * p} stages in a V; {args.rounds} interleaved round(s) of {args.steps} steps after {warmup} warm-up"
    )
    print(f"{'model':6} {'m':>3} " + " ".join(f"{name:>14}" for name in FXPIPE + TDP) + "   (median step, ms)")
    ratios = []
    for m in args.microbatches:
        samples: dict[str, list[float]] = {name: [] for name in FXPIPE + TDP}
        bubbles: dict[str, float] = {}
        for _ in range(args.rounds):
            for name in FXPIPE:
                first = launch(fxpipe_run, p, (case, name, m, args.steps, warmup))[0]
                samples[name] += first["times"]
                bubbles[name] = first["bubble"]
            for name in TDP:
                samples[name] += launch(tdp_run, p, (case, name, m, args.steps, warmup))[0]["times"]
        med = {name: statistics.median(v) for name, v in samples.items()}
        print(f"{case:6} {m:3} " + " ".join(f"{med[name] * 1e3:14.1f}" for name in FXPIPE + TDP))
        print(f"{'':6} {'':3} " + " ".join(f"{f'b {100 * bubbles[n]:.0f}%':>14}" for n in FXPIPE))
        ratios.append(
            f"{case:6} m={m:<3} dualpipev/TDP dualpipev {med['dualpipev'] / med['tdp-dualpipev']:.3f}x  "
            f"dualpipev/zb-v {med['dualpipev'] / med['zb-v']:.3f}x  zb-v/TDP dualpipev {med['zb-v'] / med['tdp-dualpipev']:.3f}x"
        )
    print("b = fxpipe's simulated bubble (cost model)")
    print("\nratios (goal: dualpipev / TDP dualpipev <= 1.0)")
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
