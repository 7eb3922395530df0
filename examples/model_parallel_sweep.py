"""Single device vs model parallel vs pipelined ResNet-50, and the micro-batch sweep.

PyTorch's single-machine model-parallel tutorial, rebuilt on fxpipe. ResNet-50 (1000
classes) trains on random images with SGD in three ways:
  single device     eager PyTorch on one device
  model parallel    two stages (cut at ``layer3``) on two devices, one micro-batch: the
                    devices take turns, none overlaps
  pipelined         the same two stages with the batch cut into micro-batches (1F1B):
                    ``--microbatches`` of them (default 4, split size 8), and the count
                    ``fxpipe.tune`` picks when that is another (more than one)
The tutorial's "split size" is batch / micro-batches. ``fxpipe.tune``'s sweep predicts
every candidate count with the cost model, then compiles and times each. Prints the sweep table and the three step times
(median, fastest and slowest of interleaved repeats), and writes a bar chart (median,
whiskers from fastest to slowest) and the sweep plot as PNGs.

Devices come from ``torch.cuda.device_count()``: two GPUs (or one GPU twice) with CUDA,
otherwise two logical CPU devices of one intra-op thread each, so "single device" is
one core and the two-stage runs get two. On a shared machine the figures are noisy:
compare ratios within one run.

    .venv/bin/python examples/model_parallel_sweep.py [--batch 32] [--image-size 64] [--out docs/img]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torchvision
from common import limit_threads, stage_devices, synchronize, torch_device
from torch import nn

import fxpipe
from fxpipe.tune import TunePoint, plot_sweep, sweep


def timed(step: Callable[[], None]) -> float:
    synchronize()
    start = time.perf_counter()
    step()
    synchronize()
    return time.perf_counter() - start


def best_microbatches(points: Sequence[TunePoint]) -> int:
    """fxpipe.tune's choice: the fastest measured count (the fastest predicted if none ran)."""
    measured = [p for p in points if p.measured_step is not None]
    if measured:
        return min(measured, key=lambda p: p.measured_step).microbatches
    return min((p for p in points if p.fits), key=lambda p: p.predicted_step).microbatches


def plot_bars(results: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [name.replace(" (", "\n(") for name in results]
    medians = [statistics.median(v) for v in results.values()]
    whiskers = [[m - min(v) for m, v in zip(medians, results.values())], [max(v) - m for m, v in zip(medians, results.values())]]
    ax.bar(names, medians, yerr=whiskers, capsize=8, color=[f"C{k}" for k in range(len(names))], alpha=0.8)
    for k, median in enumerate(medians):
        ax.annotate(f"{median:.2f} s", (k, median / 2), ha="center", color="white", fontweight="bold")
    ax.set_ylabel("step time (s): median, fastest to slowest")
    ax.set_ylim(0, max(max(v) for v in results.values()) * 1.15)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--candidates", default="1,2,4,8,16,32", help="micro-batch counts to sweep")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches of the fixed pipelined run")
    parser.add_argument("--out", default=".", help="folder for model-parallel-bars.png and model-parallel-sweep.png")
    parser.add_argument("--smoke", action="store_true", help="a ResNet-18 on a tiny batch (for tests)")
    args = parser.parse_args(argv)
    limit_threads()
    torch.manual_seed(0)
    if args.smoke:
        args.batch, args.image_size, args.repeats, args.candidates, args.microbatches = 8, 32, 1, "1,2,4", 2
    arch = "resnet18" if args.smoke else "resnet50"
    model = getattr(torchvision.models, arch)(weights=None, num_classes=1000)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    devices = stage_devices(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{arch}, batch {args.batch} of {args.image_size}x{args.image_size} images; two-stage runs on {devices}")

    # 1. the sweep: predict every count, then compile and time each candidate
    plan = fxpipe.Plan(devices=devices, split=["layer3"], schedule="1f1b", microbatches=1)
    counts = [int(c) for c in args.candidates.split(",")]
    points = sweep(model, plan, (x,), loss_fn, target, candidates=counts, measure=counts, repeats=args.repeats, schedules=[plan.schedule])
    best = best_microbatches(points)
    print(f"\nmicro-batch sweep (fxpipe.tune; fastest of {args.repeats} steps each):")
    print(f"{'micro-batches':>13}  {'split size':>10}  {'predicted':>10}  {'measured':>10}")
    for p in points:
        measured = f"{p.measured_step:>9.3f}s" if p.measured_step is not None else f"{'-':>10}"
        print(f"{p.microbatches:>13}  {args.batch // p.microbatches:>10}  {p.predicted_step:>9.3f}s  {measured}")
    print(f"fxpipe.tune picks {best} micro-batches (split size {args.batch // best})")
    sweep_png = plot_sweep(points, out / "model-parallel-sweep.png", title=f"{arch} on {' + '.join(devices)}: step time against micro-batches")

    # 2. single device vs model parallel vs pipelined, timed in turns
    single = torch_device(devices[0])
    eager = copy.deepcopy(model).to(single)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.01)
    microbatches = {"model parallel": 1, f"pipelined ({args.microbatches} mb)": args.microbatches}
    if best not in (1, args.microbatches):
        microbatches[f"pipelined ({best} mb, tuned)"] = best
    pipes = {name: fxpipe.compile(model, plan.replace(microbatches=m), example_inputs=(x,), loss_fn=loss_fn) for name, m in microbatches.items()}
    optimizers = {name: torch.optim.SGD(p.parameters(), lr=0.01) for name, p in pipes.items()}

    def eager_step() -> None:
        eager_opt.zero_grad()
        loss_fn(eager(x.to(single)), target.to(single)).backward()
        eager_opt.step()

    def pipe_step(name: str) -> Callable[[], None]:
        def step() -> None:
            optimizers[name].zero_grad()
            pipes[name].step(x, target=target)
            optimizers[name].step()

        return step

    steps = {"single device": eager_step, **{name: pipe_step(name) for name in pipes}}
    results: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        timed(step)  # warm-up
    for _ in range(args.repeats):
        for name, step in steps.items():
            results[name].append(timed(step))
    print(f"\nstep time of {args.repeats} steps each (forward, backward, SGD), in turns:")
    base = statistics.median(results["single device"])
    for name, times in results.items():
        median = statistics.median(times)
        print(f"  {name:<24} median {median:.3f} s (fastest {min(times):.3f}, slowest {max(times):.3f})   {base / median:.2f}x single device's speed")
    bars_png = out / "model-parallel-bars.png"
    plot_bars(results, bars_png, f"{arch}, batch {args.batch}, on {devices[0]} vs {' + '.join(devices)}")
    print(f"\nwrote {bars_png} and {sweep_png}")
    return {"points": points, "best": best, "results": results}


if __name__ == "__main__":
    main()
