"""Benchmark: compile time of fxpipe against torch.distributed.pipelining.pipeline() (TDP).

Side by side in one process, on the same split points (ratios are what to compare:
absolute times follow the machine's load):

  resnet152  fxpipe.compile with stages starting at layer2, layer3 and layer4, and with
             split="auto", against TDP's pipeline() with those split points
  lm         a 48-layer GPT-2-style LM (transformers' GPT2LMHeadModel, width 64), 4 stages
             by module path (transformer.h.12 / .24 / .36), and split="auto", against
             pipeline() with those split points
  depth      the same GPT-2 (width 64) at 24, 48 and 96 layers, 4 stages by module path and
             split="auto", against pipeline() on the same split points: compile seconds
             against depth for both tools (``--plot``: the figure), and the goals of issue 22
             as a table: explicit <= 0.3x and auto <= 0.5x at 48 layers, explicit <= 0.25x at
             96 layers, and 96 layers <= 1.5x the compile time of 24 layers; then
             fxpipe.compile's seconds per phase at each depth (explicit split): the
             compiler's phases, placement, and the garbage collection within them
  titan      issue 33's setup goals: a torchtitan-style Llama 3 (the debug model: dim 256, 16
             heads, vocab 2048; written here, no torchtitan dependency) at 16, 48 and 96
             layers, fxpipe.compile (2 stages cut at the middle layer, both placed in this
             process on devices ["cpu", "cpu"]) against torchtitan's manual split of one
             rank (deep-copy the model, delete the layers outside the stage); the ratio at
             48 layers (goal <= 3x), fxpipe's 96 / 24 layers (goal <= 1.5x), and
             fxpipe.partition(split="auto") of a 10,000-node Linear+ReLU stack into 4
             stages (goal <= 1 s) with its phases
  scaling    fxpipe.partition of nn.Sequential graphs of 2,500 / 5,000 / 10,000 nodes
             (Linear + ReLU pairs) into 4 stages, split="auto" and explicit, against
             pipeline() with the explicit split points; microseconds per node show whether
             time grows linearly. TDP grows faster than linearly (about 250 s at 10,000
             nodes here), so it runs up to --tdp-up-to nodes (default 5,000).

After one untimed warm-up of each, every round compiles with TDP, then fxpipe explicit,
then fxpipe auto, so a slow spell of the machine hits all three; the figure is the median
over --rounds rounds. torch._dynamo
is imported before anything is timed: both compilers need it (fxpipe's fake tensors, TDP's
torch.export), and the first to import it would otherwise pay ~2 s. --profile PART prints
a cProfile of fxpipe's compiles of that part (where the time goes).

Goals (issue 15): resnet152 <= 0.2x TDP with explicit splits and <= 0.4x with "auto";
the LM <= 0.3x / <= 0.5x; the 10,000-node partition(split="auto") <= 5 s, linear growth.

    .venv/bin/python examples/benchmarks/compile.py [--quick] [--parts resnet152 lm depth scaling]
        [--rounds 3] [--tdp-up-to 5000] [--profile lm] [--plot docs/img/compile-depth.png]

    .venv/bin/python examples/benchmarks/compile.py --parts titan    # issue 33's setup goals
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import gc
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch._dynamo  # noqa: F401 - imported once, untimed (see the module doc)
import torchvision
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

import fxpipe
import fxpipe.compiler.driver
import fxpipe.factory
from fxpipe.compiler.progress import Progress

sys.path.insert(0, str(Path(__file__).parent))
from titan import ModelArgs, Transformer, manual_stage, stage_layers  # noqa: E402 - the benchmark beside this file

PARTS = ("resnet152", "lm", "depth", "scaling", "titan")


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _tdp(model: nn.Module, microbatch: torch.Tensor, paths: list[str]) -> Callable[[], object]:
    """A pipeline() compile of a fresh copy of ``model`` (made untimed): pipeline() wraps the
    forwards of the split modules in place, so a second call on one model nests the wrappers."""
    fresh = copy.deepcopy(model)
    return lambda: pipeline(fresh, mb_args=(microbatch,), split_spec={p: SplitPoint.BEGINNING for p in paths})


def _loss(out, target) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits.float().mean()


def _lm(layers: int) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=1024, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 1024, (8, 32))


def _stack(nodes: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(nodes // 2):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers)


def compare(name: str, model: nn.Module, x: torch.Tensor, paths: list[str], rounds: int, profile: bool) -> dict[str, float]:
    """Time TDP's pipeline() and fxpipe (explicit, auto) on ``paths``; print medians and
    ratios; returns the medians by compiler ("tdp", "fxpipe explicit", "fxpipe auto")."""
    devices = [f"cpu:{k}" for k in range(len(paths) + 1)]
    microbatch = x[: max(1, x.shape[0] // 4)]
    # per compiler, an untimed set-up returning the compile to time
    prepare = {
        "tdp": lambda: _tdp(model, microbatch, paths),
        "fxpipe explicit": lambda: functools.partial(fxpipe.compile, model, fxpipe.Plan(devices=devices, split=paths, microbatches=4), (x,), loss_fn=_loss),
        "fxpipe auto": lambda: functools.partial(fxpipe.compile, model, fxpipe.Plan(devices=devices, split="auto", microbatches=4), (x,), loss_fn=_loss),
    }
    times: dict[str, list[float]] = {label: [] for label in prepare}
    profiler = cProfile.Profile() if profile else None
    for setup in prepare.values():  # warm-up, untimed: first calls set caches up
        setup()()
    for _ in range(rounds):
        for label, setup in prepare.items():
            run = setup()
            profiling = profiler is not None and label != "tdp"
            if profiling:
                profiler.enable()
            times[label].append(_seconds(run))
            if profiling:
                profiler.disable()
    median = {label: statistics.median(t) for label, t in times.items()}
    print(f"\n{name}: fxpipe.compile vs pipeline(), split points {paths}, median of {rounds}")
    print(f"  pipeline() {median['tdp']:.2f} s")
    for label in ("fxpipe explicit", "fxpipe auto"):
        print(f"  {label:16s} {median[label]:.2f} s = {median[label] / median['tdp']:.2f}x pipeline()")
    if profiler is not None:
        print(f"  cProfile of fxpipe's {2 * rounds} compiles (cumulative, fxpipe and torch.export frames):")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(r"(fxpipe|passes/|torch/export)", 25)
    return median


def depth(layer_counts: list[int], rounds: int, profile: bool, plot: str | None) -> None:
    """The LM at each depth, side by side with pipeline(); the issue's goals as a table."""
    medians = {}
    for layers in layer_counts:
        model, ids = _lm(layers)
        paths = [f"transformer.h.{layers // 4 * k}" for k in (1, 2, 3)]
        medians[layers] = compare(f"GPT-2 (transformers), {layers} layers, width 64", model, ids, paths, rounds, profile)
    print(f"\ndepth: compile seconds (median of {rounds}) and ratio to pipeline() on the same split")
    print(f"  {'layers':>6s} {'pipeline()':>11s} {'explicit':>16s} {'auto':>16s}")
    for layers, m in medians.items():
        tdp = m["tdp"]
        print(
            f"  {layers:6d} {tdp:10.2f}s {m['fxpipe explicit']:7.2f}s ({m['fxpipe explicit'] / tdp:.2f}x)"
            f" {m['fxpipe auto']:7.2f}s ({m['fxpipe auto'] / tdp:.2f}x)"
        )
    _goals(medians)
    if plot:
        _plot_depth(medians, plot)
    _phases(layer_counts, rounds)


class _PhaseRecord(Progress):
    """The compiler's progress report; each phase's seconds kept in ``last`` when it ends."""

    last: dict[str, float] = {}

    def __exit__(self, kind, value, traceback) -> None:
        _PhaseRecord.last = self.phase_seconds()
        super().__exit__(kind, value, traceback)


def _compile_phases(model: nn.Module, ids: torch.Tensor, paths: list[str]) -> dict[str, float]:
    """One fxpipe.compile (explicit split): seconds per compiler phase, placement
    (``build_pipeline``), garbage collection (within those) and in all."""
    collecting = {"since": 0.0, "seconds": 0.0}

    def on_collection(phase: str, _: dict) -> None:
        if phase == "start":
            collecting["since"] = time.perf_counter()
        else:
            collecting["seconds"] += time.perf_counter() - collecting["since"]

    placed = {}

    def build(*args, **kwargs):
        start = time.perf_counter()
        pipe = build_pipeline(*args, **kwargs)
        placed["seconds"] = time.perf_counter() - start
        return pipe

    build_pipeline = fxpipe.factory.build_pipeline
    plan = fxpipe.Plan(devices=[f"cpu:{k}" for k in range(4)], split=paths, microbatches=4)
    gc.callbacks.append(on_collection)
    try:
        with mock.patch.object(fxpipe.compiler.driver, "Progress", _PhaseRecord), mock.patch.object(fxpipe.factory, "build_pipeline", build):
            total = _seconds(lambda: fxpipe.compile(model, plan, (ids,), loss_fn=_loss))
    finally:
        gc.callbacks.remove(on_collection)
    return {**_PhaseRecord.last, "placement": placed["seconds"], "gc (within)": collecting["seconds"], "total": total}


def _phases(layer_counts: list[int], rounds: int) -> None:
    """fxpipe.compile's seconds per phase at each depth (explicit split), medians of ``rounds``."""
    rows = {}
    for layers in layer_counts:
        model, ids = _lm(layers)
        paths = [f"transformer.h.{layers // 4 * k}" for k in (1, 2, 3)]
        _compile_phases(model, ids, paths)  # untimed warm-up, as in compare()
        runs = [_compile_phases(model, ids, paths) for _ in range(rounds)]
        rows[layers] = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    names = list(next(iter(rows.values())))
    print(f"\nphases: fxpipe.compile, explicit split, seconds per phase (median of {rounds})")
    print("  layers " + " ".join(f"{name:>16s}" for name in names))
    for layers, row in rows.items():
        print(f"  {layers:6d} " + " ".join(f"{row[name]:15.2f}s" for name in names))


def _goals(medians: dict[int, dict[str, float]]) -> None:
    """The goals of issue 22 at the depths measured (the middle one stands for 48 layers)."""
    small, middle, large = sorted(medians)[0], sorted(medians)[len(medians) // 2], sorted(medians)[-1]

    def ratio(layers: int, label: str) -> float:
        return medians[layers][label] / medians[layers]["tdp"]

    rows = [
        (f"{middle} layers, explicit split", ratio(middle, "fxpipe explicit"), 0.3),
        (f"{middle} layers, split='auto'", ratio(middle, "fxpipe auto"), 0.5),
        (f"{large} layers, explicit split", ratio(large, "fxpipe explicit"), 0.25),
        (f"{large} / {small} layers, fxpipe explicit", medians[large]["fxpipe explicit"] / medians[small]["fxpipe explicit"], 1.5),
    ]
    print("\ngoals (issue 22):")
    print(f"  {'case':40s} {'measured':>9s} {'goal':>7s}")
    for case, value, goal in rows:
        print(f"  {case:40s} {value:8.2f}x {'<= ' + str(goal) + 'x':>7s}  {'met' if value <= goal else 'NOT met'}")


def _plot_depth(medians: dict[int, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(medians)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, name, style in (("tdp", "torch.distributed.pipelining pipeline()", "s-"), ("fxpipe explicit", "fxpipe.compile, explicit split", "o-"), ("fxpipe auto", "fxpipe.compile, split='auto'", "^--")):
        ax.plot(layers, [medians[n][label] for n in layers], style, label=name)
    ax.set_xlabel("GPT-2 layers (width 64), 4 stages")
    ax.set_ylabel("compile seconds (median)")
    ax.set_xticks(layers)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Compile time against depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def scaling(sizes: list[int], rounds: int, tdp_up_to: int, profile: bool) -> None:
    """partition() time per node at growing sizes, and TDP's on the same split points."""
    print(f"\nscaling: fxpipe.partition of nn.Sequential stacks into 4 stages, median of {rounds}")
    print(f"  {'nodes':>6s} {'auto':>8s} {'explicit':>9s} {'auto/node':>10s} {'pipeline()':>11s} {'auto/TDP':>9s}")
    profiler = cProfile.Profile() if profile else None
    fxpipe.partition(_stack(100), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto"), example_inputs=(torch.randn(8, 16),))  # warm-up
    first: float | None = None
    for n in sizes:
        model, x = _stack(n), torch.randn(8, 16)
        paths = [str(n // 4 * k) for k in (1, 2, 3)]
        devices = [f"cpu:{k}" for k in range(4)]
        auto, explicit = [], []
        for _ in range(rounds):
            if profiler is not None:
                profiler.enable()
            auto.append(_seconds(lambda: fxpipe.partition(model, fxpipe.Plan(devices=devices, split="auto"), example_inputs=(x,))))  # noqa: B023
            explicit.append(_seconds(lambda: fxpipe.partition(model, fxpipe.Plan(devices=devices, split=paths), example_inputs=(x,))))  # noqa: B023
            if profiler is not None:
                profiler.disable()
        a, e = statistics.median(auto), statistics.median(explicit)
        per_node = a / n * 1e6
        first = first or per_node
        tdp = "skipped" if n > tdp_up_to else None
        ratio = ""
        if tdp is None:
            seconds = _seconds(_tdp(model, x[:2], paths))
            tdp, ratio = f"{seconds:.2f} s", f"{a / seconds:.2f}x"
        print(f"  {n:6d} {a:7.2f}s {e:8.2f}s {per_node:7.0f} µs ({per_node / first:.2f}x) {tdp:>11s} {ratio:>9s}")
    if profiler is not None:
        print("  cProfile of fxpipe's partitions (cumulative):")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(r"(fxpipe|passes/)", 25)


def titan(layer_counts: list[int], rounds: int, stack_nodes: int, profile: bool) -> None:
    """Issue 33's setup goals: fxpipe.compile against the manual split at each depth
    (alternating, medians), the 96/24 ratio, and split='auto' on a large stack."""
    medians: dict[int, dict[str, float]] = {}
    profiler = cProfile.Profile() if profile else None
    for layers in layer_counts:
        model, tokens = Transformer(ModelArgs(n_layers=layers, max_seq_len=64)), torch.randint(0, 2048, (8, 64))
        plan = fxpipe.Plan(devices=["cpu", "cpu"], split=[f"layers.{layers // 2}"], microbatches=4)
        run = {
            "fxpipe.compile": lambda: fxpipe.compile(model, plan, (tokens,), loss_fn=_loss),  # noqa: B023
            "manual split": lambda: manual_stage(model, stage_layers(layers, 2)[0], 2, 0),  # noqa: B023
        }
        for fn in run.values():  # warm-up, untimed
            fn()
        times: dict[str, list[float]] = {label: [] for label in run}
        for _ in range(rounds):
            for label, fn in run.items():
                profiling = profiler is not None and label == "fxpipe.compile"
                if profiling:
                    profiler.enable()
                times[label].append(_seconds(fn))
                if profiling:
                    profiler.disable()
        medians[layers] = {label: statistics.median(t) for label, t in times.items()}
    print(f"\ntitan: torchtitan-style Llama 3 (dim 256, 16 heads, vocab 2048), 2 stages, median of {rounds} (alternating)")
    print(f"  {'layers':>6s} {'fxpipe.compile':>15s} {'manual split':>13s} {'ratio':>7s}")
    for layers, m in medians.items():
        print(f"  {layers:6d} {m['fxpipe.compile']:14.2f}s {m['manual split']:12.2f}s {m['fxpipe.compile'] / m['manual split']:6.2f}x")
    small, large = min(medians), max(medians)
    middle = sorted(medians)[len(medians) // 2]
    depth_ratio = medians[large]["fxpipe.compile"] / medians[small]["fxpipe.compile"]
    auto = _auto_stack(stack_nodes, rounds)
    print("\ngoals (issue 33):")
    rows = [
        (f"{middle} layers: fxpipe.compile / manual split", medians[middle]["fxpipe.compile"] / medians[middle]["manual split"], 3.0, "x"),
        (f"{large} / {small} layers: fxpipe.compile", depth_ratio, 1.5, "x"),
        (f"split='auto', {stack_nodes:,} nodes: seconds", auto, 1.0, "s"),
    ]
    for case, value, goal, unit in rows:
        print(f"  {case:46s} {value:7.2f}{unit} {'<= ' + str(goal) + unit:>8s}  {'met' if value <= goal else 'NOT met'}")
    if profiler is not None:
        print(f"  cProfile of fxpipe.compile ({rounds * len(layer_counts)} compiles, cumulative):")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(r"(fxpipe|passes/)", 30)


def _auto_stack(nodes: int, rounds: int) -> float:
    """fxpipe.partition(split="auto") of a Linear+ReLU stack of ``nodes`` nodes into 4 stages:
    the median seconds, printed with the compiler's phases."""
    model, x = _stack(nodes), torch.randn(8, 16)
    plan = fxpipe.Plan(devices=[f"cpu:{k}" for k in range(4)], split="auto")
    fxpipe.partition(_stack(100), plan, example_inputs=(x,))  # warm-up
    runs = []
    for _ in range(rounds):
        with mock.patch.object(fxpipe.compiler.driver, "Progress", _PhaseRecord):
            seconds = _seconds(lambda: fxpipe.partition(model, plan, example_inputs=(x,)))
        runs.append({**_PhaseRecord.last, "total": seconds})
    row = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    print(f"\nsplit='auto' on a {nodes:,}-node stack, 4 stages, seconds per phase (median of {rounds}):")
    print("  " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in row.items()))
    return row["total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, one round (checks the script runs)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run (default all)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per compiler (median)")
    parser.add_argument("--tdp-up-to", type=int, default=5000, help="largest stack pipeline() compiles in the scaling part")
    parser.add_argument("--profile", choices=PARTS, default=None, help="print a cProfile of fxpipe's compiles of this part")
    parser.add_argument("--plot", default=None, help="write the depth sweep's figure here (compile seconds against layers)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rounds = 1 if args.quick else args.rounds
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    if "resnet152" in args.parts:
        model = torchvision.models.resnet18(num_classes=10) if args.quick else torchvision.models.resnet152(num_classes=10)
        size = 64 if args.quick else 224
        compare("resnet18" if args.quick else "resnet152", model, torch.randn(8, 3, size, size), ["layer2", "layer3", "layer4"], rounds, args.profile == "resnet152")
    if "lm" in args.parts:
        layers = 8 if args.quick else 48
        model, ids = _lm(layers)
        paths = [f"transformer.h.{layers // 4 * k}" for k in (1, 2, 3)]
        compare(f"GPT-2-style LM, {layers} layers, width 64", model, ids, paths, rounds, args.profile == "lm")
    if "depth" in args.parts:
        depth([4, 8, 16] if args.quick else [24, 48, 96], rounds, args.profile == "depth", args.plot)
    if "titan" in args.parts:
        titan([4, 8, 16] if args.quick else [16, 24, 48, 96], rounds, 1000 if args.quick else 10000, args.profile == "titan")
    if "scaling" in args.parts:
        sizes = [250, 500, 1000] if args.quick else [2500, 5000, 10000]
        scaling(sizes, rounds, args.tdp_up_to, args.profile == "scaling")


if __name__ == "__main__":
    main()
