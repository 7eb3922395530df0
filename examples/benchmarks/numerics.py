"""Numerics at speed: bf16 autocast vs float32, and what keyed randomness costs a step.

In one run, measurements interleaved and medians reported (the machine is noisy):
  autocast   a transformer block stack (4 x TransformerEncoderLayer, width 256) on a
             2-stage 1F1B pipeline: step time in float32 and under
             ``torch.autocast(device, dtype=torch.bfloat16)``, and the same for eager
  dropout    a dropout MLP (8 x Linear(1024) + Dropout(0.1)) and the same MLP without the
             dropout layers, each as a pipeline and as the eager micro-batch loop; the
             cost of fxpipe's keyed randomness is how much the pipeline/eager ratio grows
             when dropout is added: (pipe_drop / eager_drop) / (pipe_plain / eager_plain)
Runs on the CPU, and on cuda:0 too when CUDA is present.

    .venv/bin/python examples/benchmarks/numerics.py [--repeats 9] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import fxpipe

sys.path.insert(0, str(Path(__file__).parent))
from rng_overhead import interleaved  # noqa: E402 - the shared timing helper beside this file

CE = nn.CrossEntropyLoss()


class Blocks(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def mlp(width: int, depth: int, p: float | None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()] + ([nn.Dropout(p)] if p is not None else [])
    return nn.Sequential(*layers, nn.Linear(width, 10))


def eager_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, m: int) -> Callable[[], None]:
    def step() -> None:
        for xi, ti in zip(x.tensor_split(m), t.tensor_split(m)):
            (CE(model(xi), ti) * (len(xi) / len(x))).backward()

    return step


def autocast_case(device: str, repeats: int, quick: bool) -> None:
    width, depth, batch, seq = (64, 2, 8, 16) if quick else (256, 4, 32, 64)
    model = Blocks(width, depth).to(device)
    x, t = torch.randn(batch, seq, width, device=device), torch.randint(0, 10, (batch,), device=device)
    split = [f"blocks.{depth // 2}"]
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=[device, device], split=split, microbatches=4), example_inputs=(x,), loss_fn=CE)
    eager = copy.deepcopy(model)
    kind = torch.device(device).type

    def under_autocast(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.autocast(kind, dtype=torch.bfloat16):
                fn()

        return run

    step = lambda: pipe.step(x, target=t)  # noqa: E731
    runs = {
        "fxpipe fp32": step,
        "fxpipe bf16 autocast": under_autocast(step),
        "eager fp32": eager_step(eager, x, t, 4),
        "eager bf16 autocast": under_autocast(eager_step(eager, x, t, 4)),
    }
    times = interleaved(runs, repeats, 1)
    print(f"\nautocast on {device}: {depth} x TransformerEncoderLayer({width}), batch {batch} x {seq}, 2 stages, 1F1B, 4 micro-batches")
    for name, seconds in times.items():
        print(f"  {name:<22} {seconds * 1e3:9.1f} ms")
    print(f"  bf16/fp32: fxpipe {times['fxpipe bf16 autocast'] / times['fxpipe fp32']:.3f}x, eager {times['eager bf16 autocast'] / times['eager fp32']:.3f}x")


def dropout_case(device: str, repeats: int, quick: bool) -> None:
    width, batch = (128, 64) if quick else (1024, 256)
    x, t = torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device)
    plan = fxpipe.Plan(devices=[device, device], split=["12"], microbatches=4)
    runs: dict[str, Callable[[], None]] = {}
    for name, p in (("dropout", 0.1), ("plain", None)):
        torch.manual_seed(0)
        model = mlp(width, 8, p).to(device)
        pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
        runs[f"fxpipe {name}"] = lambda pipe=pipe: pipe.step(x, target=t)
        runs[f"eager {name}"] = eager_step(copy.deepcopy(model), x, t, 4)
    times = interleaved(runs, repeats, 1)
    print(f"\nkeyed randomness on {device}: 8 x Linear({width}) MLP with and without Dropout(0.1), batch {batch}, 2 stages, 4 micro-batches")
    for name, seconds in times.items():
        print(f"  {name:<16} {seconds * 1e3:9.1f} ms")
    drop = times["fxpipe dropout"] / times["eager dropout"]
    plain = times["fxpipe plain"] / times["eager plain"]
    print(f"  fxpipe/eager: with dropout {drop:.3f}x, without {plain:.3f}x; keyed randomness costs {100 * (drop / plain - 1):+.1f}% of a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="small models, 3 repeats: a check that it runs")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    devices = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
    for device in devices:
        autocast_case(device, repeats, args.quick)
        dropout_case(device, repeats, args.quick)


if __name__ == "__main__":
    main()
