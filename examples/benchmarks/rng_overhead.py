"""The cost of keyed randomness: keyed ops vs torch's global-generator ops, side by side.

In one run, measurements interleaved and medians reported (this machine is noisy):
  dropout op   ``keyed.dropout`` (generator re-seeded for the call, as a rewritten stage
               does) vs ``F.dropout``: forward, and forward + backward, per call
  stages       one micro-batch's forward (and forward + backward) through a traced model, as it runs
               today (dropout from the global generator) and after
               ``make_randomness_explicit`` (every random op keyed), for a dropout MLP
               under both frontends and a TransformerEncoderLayer stack under fx (whose
               layers run under a KeyedScope dispatch mode)
Prints median times and the keyed / global ratio of each. One intra-op thread, so the
ratio measures the ops rather than the thread pool's contention on a shared machine.

    .venv/bin/python examples/benchmarks/rng_overhead.py [--repeats 15] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.passes import keyed
from fxpipe.passes.rng import make_randomness_explicit, number_random_ops
from fxpipe.passes.shape_prop import propagate_shapes
from fxpipe.passes.trace import trace


def interleaved(runs: dict[str, Callable[[], None]], repeats: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each function, measured in alternation."""
    for fn in runs.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {k: statistics.median(v) for k, v in samples.items()}


def dropout_op(shape: tuple[int, ...], repeats: int, calls: int) -> dict[str, float]:
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    seed = keyed.mix(1, 2)

    def ours() -> torch.Tensor:
        return keyed.dropout(x, 0.1, generator=keyed.generator(seed, 3, x))

    def theirs() -> torch.Tensor:
        return F.dropout(x, 0.1)

    return interleaved(
        {
            "F.dropout fwd": lambda: theirs(),
            "keyed fwd": lambda: ours(),
            "F.dropout fwd+bwd": lambda: theirs().backward(grad),
            "keyed fwd+bwd": lambda: ours().backward(grad),
        },
        repeats,
        calls,
    )


def dropout_mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def encoder_stack(width: int, depth: int) -> nn.Module:
    layer = [nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True) for _ in range(depth)]
    return nn.Sequential(*layer, nn.Linear(width, 10))


def stage_step(model: nn.Module, x: torch.Tensor, frontend: str, repeats: int) -> dict[str, float]:
    """One micro-batch's forward, and forward + backward, of the traced graph: global vs keyed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = trace(model, (x,), frontend=frontend).graph_module
        rewritten = trace(model, (x,), frontend=frontend).graph_module
    propagate_shapes(rewritten, [x])
    number_random_ops(rewritten.graph)
    assert make_randomness_explicit(rewritten)
    seeds = iter(range(10**9))

    def run(gm: torch.nn.Module, backward: bool, *extra: int) -> None:
        out = gm(x, *extra)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            out.sum().backward()

    return interleaved(
        {
            "global fwd": lambda: run(plain, False),
            "keyed fwd": lambda: run(rewritten, False, keyed.mix(7, next(seeds))),
            "global fwd+bwd": lambda: run(plain, True),
            "keyed fwd+bwd": lambda: run(rewritten, True, keyed.mix(7, next(seeds))),
        },
        repeats,
        3,
    )


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: checks the script runs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    repeats = 3 if args.quick else args.repeats
    results: dict[str, dict[str, float]] = {}
    for shape in [(64, 256)] if args.quick else [(64, 1024), (16, 128, 512)]:
        r = results[f"dropout {shape}"] = dropout_op(shape, repeats, 5 if args.quick else 50)
        print(
            f"dropout {str(shape):<16} fwd: F.dropout {r['F.dropout fwd'] * 1e6:7.1f} us, keyed {r['keyed fwd'] * 1e6:7.1f} us "
            f"({r['keyed fwd'] / r['F.dropout fwd']:.3f}x) | fwd+bwd: F.dropout {r['F.dropout fwd+bwd'] * 1e6:7.1f} us, "
            f"keyed {r['keyed fwd+bwd'] * 1e6:7.1f} us ({r['keyed fwd+bwd'] / r['F.dropout fwd+bwd']:.3f}x)"
        )
    width, depth, batch = (64, 2, 8) if args.quick else (512, 8, 32)
    models = [
        ("dropout MLP", "fx", dropout_mlp(width, depth), torch.randn(batch, width)),
        ("dropout MLP", "export", dropout_mlp(width, depth), torch.randn(batch, width)),
        ("encoder layers", "fx", encoder_stack(width // 4, depth // 2), torch.randn(batch // 2, 64, width // 4)),
    ]
    for name, frontend, model, x in models:
        r = results[f"{name} ({frontend})"] = stage_step(model, x, frontend, repeats)
        print(
            f"{name + ' (' + frontend + ')':<24} per micro-batch fwd: global {r['global fwd'] * 1e3:8.2f} ms, "
            f"keyed {r['keyed fwd'] * 1e3:8.2f} ms ({r['keyed fwd'] / r['global fwd']:.3f}x) | fwd+bwd: global "
            f"{r['global fwd+bwd'] * 1e3:8.2f} ms, keyed {r['keyed fwd+bwd'] * 1e3:8.2f} ms "
            f"({r['keyed fwd+bwd'] / r['global fwd+bwd']:.3f}x)"
        )
    return results


if __name__ == "__main__":
    main()
