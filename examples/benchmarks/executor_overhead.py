"""Executor overhead: eager micro-batch loop vs fxpipe on one device, and 2 CPU stages.

For each model, in one run (measurements interleaved, medians reported, since this
machine is noisy):
  eager       gradient accumulation over the same micro-batches, one after another
  1 stage     fxpipe with every node in one stage on the CPU: the executor's overhead
  same device fxpipe with two stages both on the device "cpu" (1F1B): the cost of the cut
  2 stages    fxpipe with two CPU stages in two worker threads (1F1B), on logical
              devices cpu:0 and cpu:1 that share the machine's cores
  finite      the same two stages with Plan(check_finite=True): every value handed on
              and every loss checked for NaN/Inf
Prints a table of median step times, the ratios to eager, and check_finite's ratio to
the unchecked two stages.

    .venv/bin/python examples/benchmarks/executor_overhead.py [--repeats 7] [--models mlp]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from torch import nn

import fxpipe
from fxpipe.factory import build_pipeline


def mlp_stack(width: int = 1024, depth: int = 8) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def eager_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, m: int, loss_fn: nn.Module) -> None:
    for xi, ti in zip(x.tensor_split(m), t.tensor_split(m)):
        (loss_fn(model(xi), ti) * (len(xi) / len(x))).backward()


def median_time(fn: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench(name: str, model: nn.Module, x: torch.Tensor, split: str | list[str], m: int, repeats: int) -> dict[str, float]:
    loss_fn = nn.CrossEntropyLoss()
    t = torch.randint(0, 10, (len(x),))
    eager = copy.deepcopy(model)
    one = fxpipe.compile(model, fxpipe.Plan(devices=["cpu"], split="tags", microbatches=m), example_inputs=(x,), loss_fn=loss_fn)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=split, schedule="1f1b", microbatches=m)
    part = fxpipe.partition(model, plan, example_inputs=(x,))
    two = build_pipeline(part, model, loss_fn)
    print(f"  2-stage split: {[s.module_range for s in two.stages]}")
    finite = build_pipeline(dataclasses.replace(part, plan=plan.replace(check_finite=True)), model, loss_fn)  # the same cut
    same = build_pipeline(dataclasses.replace(part, plan=plan.replace(devices=["cpu", "cpu"])), model, loss_fn)
    runs: dict[str, Callable[[], None]] = {
        "eager": lambda: eager_step(eager, x, t, m, loss_fn),
        "1 stage": lambda: one.step(x, target=t),
        "same device": lambda: same.step(x, target=t),
        "2 stages": lambda: two.step(x, target=t),
        "finite": lambda: finite.step(x, target=t),
    }
    for fn in runs.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):  # interleaved, so drift hits every variant alike
        for key, fn in runs.items():
            samples[key] += median_time(fn, 1)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"{name:<28} eager {medians['eager'] * 1e3:8.1f} ms | 1 stage {medians['1 stage'] * 1e3:8.1f} ms "
        f"({medians['1 stage'] / medians['eager']:.3f}x) | 2 stages on cpu {medians['same device'] * 1e3:8.1f} ms "
        f"({medians['same device'] / medians['eager']:.3f}x) | 2 CPU stages {medians['2 stages'] * 1e3:8.1f} ms "
        f"({medians['2 stages'] / medians['eager']:.3f}x) | check_finite {medians['finite'] * 1e3:8.1f} ms "
        f"({medians['finite'] / medians['2 stages']:.3f}x 2 stages)"
    )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "mlp"], choices=["resnet18", "resnet50", "mlp"])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, micro-batches 4")
    if "resnet18" in args.models:
        bench("resnet18 (32x3x64x64)", torchvision.models.resnet18(num_classes=10), torch.randn(32, 3, 64, 64), "auto", 4, args.repeats)
    if "resnet50" in args.models:
        bench("resnet50 (32x3x64x64)", torchvision.models.resnet50(num_classes=10), torch.randn(32, 3, 64, 64), "auto", 4, args.repeats)
    if "mlp" in args.models:
        bench("mlp 8x1024 (batch 256)", mlp_stack(), torch.randn(256, 1024), "auto", 4, args.repeats)


if __name__ == "__main__":
    main()
