"""The ``fxpipe`` command: ``fxpipe inspect MODEL`` and ``fxpipe train MODEL``.

``inspect`` partitions a model without touching any device (a plan for four GPUs can be
inspected on a laptop): it prints the summary, writes the partition drawing and the
predicted timeline. ``train`` compiles the model on its devices, runs a few training steps
on random data with a progress bar, and writes the measured timeline beside the predicted
one. Both wrap the public API: ``fxpipe.partition``, ``fxpipe.compile``, ``draw``,
``simulate``, ``timeline``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXAMPLES = """\
MODEL is one of
  torchvision:NAME          a torchvision model, e.g. torchvision:resnet50 (random weights)
  package.module:factory    a function or nn.Module class to call, e.g. mypkg.nets:build
  path/to/file.py[:factory] a Python file; without :factory it uses build_model,
                            make_model, get_model or model (a function or an nn.Module)
Factory keyword arguments come from --model-arg KEY=VALUE (Python literals).

examples:
  fxpipe inspect torchvision:resnet50 --stages 4 --split layer2,layer3,layer4 \\
      --input 32x3x224x224 --out docs/img
  fxpipe inspect torchvision:resnet152 --devices cuda:0,cuda:1 --split auto --level node
  fxpipe train torchvision:resnet18 --stages 2 --split layer3 --input 16x3x64x64 \\
      --model-arg num_classes=10 --steps 5
"""


# fxpipe.schedules.SCHEDULES, spelled out: importing fxpipe would cost --help a second (a test keeps them equal)
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


class CommandError(Exception):
    """A command-line value fxpipe cannot use; the message says what to write instead."""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``fxpipe`` command with ``argv`` (default: the process's arguments);
    returns the exit status. Errors in arguments, models and plans exit with status 2 and
    a one-line message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from fxpipe import CompileError, DeviceError, MicrobatchError, PlanError
    from fxpipe.drawing.render import DrawError
    from fxpipe.passes.annotate import AnnotateError
    from fxpipe.passes.traced import TraceError

    expected = (CommandError, PlanError, CompileError, AnnotateError, TraceError, DeviceError, MicrobatchError, DrawError)
    try:
        return args.run(args)
    except expected as err:
        print(f"fxpipe {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of ``fxpipe`` with its two subcommands."""
    parser = argparse.ArgumentParser(
        prog="fxpipe",
        description="Split a PyTorch model into pipeline stages with torch.fx; see where it was cut and where the pipeline waits.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="partition a model (no device needed); print the summary, draw the partition and the predicted timeline",
        description=(
            "Partition MODEL without moving it to any device, print the per-stage summary, "
            "write the partition drawing (partition.FORMAT), the predicted timeline "
            "(timeline-predicted.png) and its Chrome trace (trace-predicted.json) to --out."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arguments(inspect)
    _add_plan_arguments(inspect)
    inspect.add_argument("--level", choices=("auto", "node", "stage"), default="auto",
                         help="drawing detail: every node, a box per stage, or auto (stage view above 400 nodes); default auto")
    inspect.add_argument("--format", choices=("svg", "png", "pdf", "dot"), default="svg",
                         help="file format of the partition drawing; default svg")
    inspect.add_argument("--renderer", choices=("auto", "graphviz", "matplotlib"), default="auto",
                         help="who draws the partition: Graphviz when installed (auto), or the built-in matplotlib renderer")
    inspect.add_argument("--explain", action="store_true", help="also print why each stage holds its nodes and the edges it cuts")
    _add_output_argument(inspect)
    inspect.set_defaults(run=run_inspect)

    train = commands.add_parser(
        "train",
        help="compile a model on its devices and run a few training steps on random data with a progress bar",
        description=(
            "Compile MODEL on the plan's devices, run --steps training steps (SGD) on random "
            "inputs and targets with a progress bar, then write the measured timeline of the "
            "last step beside the predicted one (timeline.png) and its Chrome trace "
            "(trace-measured.json) to --out."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arguments(train)
    _add_plan_arguments(train)
    train.add_argument("--steps", type=_positive, default=5, help="training steps to run; default 5")
    train.add_argument("--lr", type=float, default=0.01, help="SGD learning rate; default 0.01")
    train.add_argument("--loss", choices=("cross-entropy", "mse", "output"), default="cross-entropy",
                       help="cross-entropy against random class labels, mse against random targets, or "
                            "output: the model returns its own scalar loss; default cross-entropy")
    train.add_argument("--seed", type=int, default=0, help="seed of the random model inputs and targets; default 0")
    _add_output_argument(train)
    train.set_defaults(run=run_train)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="torchvision:NAME, package.module:factory or path/to/file.py[:factory]")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the model factory, a Python literal (repeatable), e.g. num_classes=10")
    parser.add_argument("--input", action="append", default=None, metavar="SHAPE[:DTYPE]",
                        help="one example input per flag, dimensions joined by x, e.g. 8x3x224x224 or 8x128:int64 "
                             "(integer inputs hold 0s and 1s); dim 0 is the batch; default 8x3x224x224")


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group("plan", "the fxpipe.Plan to compile with")
    plan.add_argument("--stages", type=_positive, metavar="N",
                      help="number of pipeline stages; without --devices they go on logical CPUs cpu:0, cpu:1, …")
    plan.add_argument("--devices", metavar="LIST",
                      help="comma-separated device per stage (or per worker with --chunks), e.g. cuda:0,cuda:1 or cpu,cuda:0")
    plan.add_argument("--split", metavar="HOW",
                      help="tags (device_guard blocks), auto (cost model) or comma-separated module paths where stages "
                           "begin, e.g. layer2,layer3; default auto with several devices, tags otherwise")
    plan.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="1f1b",
                      help="pipeline schedule (zb-v runs with --chunks 2); default 1f1b")
    plan.add_argument("--microbatches", type=_positive, default=4, metavar="M",
                      help="micro-batches per step (the batch is cut along dim 0); default 4")
    plan.add_argument("--chunks", type=_positive, default=1, metavar="V",
                      help="stages per device for interleaved-1f1b; default 1")
    plan.add_argument("--checkpoint", action="store_true", help="recompute activations in backward instead of keeping them")
    plan.add_argument("--frontend", choices=("auto", "fx", "export"), default="auto",
                      help="tracer: torch.fx, torch.export, or auto (fx, falling back to export); default auto")


def _add_output_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                        help="folder for the pictures and traces (created if missing); default the current folder")
    parser.add_argument("--prefix", default="", metavar="TEXT",
                        help="prepended to every file name written, e.g. resnet50- gives resnet50-partition.svg")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


# ------------------------------------------------------------------ commands
def run_inspect(args: argparse.Namespace) -> int:
    """``fxpipe inspect``: summary, drawing, predicted timeline. Returns 0."""
    import fxpipe

    model = load_model(args.model, parse_model_args(args.model_arg))
    inputs = example_inputs(args.input)
    part = fxpipe.partition(model, plan_from_args(args), example_inputs=inputs)
    out = _out_dir(args.out, args.prefix)
    print(part.summary())
    if args.explain:
        print()
        print(part.explain())
    drawing = part.draw(out(f"partition.{args.format}"), level=args.level, renderer=args.renderer)
    print(f"\npartition drawing: {drawing}")
    _write_timeline(on_logical_devices(part.simulate(), part.devices), out("timeline-predicted.png"), out("trace-predicted.json"))
    return 0


def run_train(args: argparse.Namespace) -> int:
    """``fxpipe train``: compile, run ``--steps`` steps with a progress bar, write the
    measured timeline beside the predicted one. Returns 0."""
    import torch
    from tqdm import tqdm

    import fxpipe

    model = load_model(args.model, parse_model_args(args.model_arg))
    model.train()
    inputs = example_inputs(args.input, seed=args.seed)
    loss_fn = {"cross-entropy": torch.nn.CrossEntropyLoss(), "mse": torch.nn.MSELoss(), "output": None}[args.loss]
    pipe = fxpipe.compile(model, plan_from_args(args), example_inputs=inputs, loss_fn=loss_fn)
    out = _out_dir(args.out, args.prefix)
    print(pipe.summary())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    output_value = next(n for n in pipe.graph.nodes if n.op == "output").meta.get("val")
    generator = torch.Generator().manual_seed(args.seed)
    with tqdm(range(args.steps), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        for step in bar:
            batch = inputs if step == 0 else example_inputs(args.input, seed=args.seed + step)
            target = make_target(args.loss, output_value, generator)
            started = time.perf_counter()
            loss = pipe.step(*batch, target=target)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.4f}", step=f"{time.perf_counter() - started:.3f}s")
    measured = on_logical_devices(pipe.timeline(), pipe.part.devices)
    predicted = on_logical_devices(pipe.simulate(), pipe.part.devices)
    print()
    print(measured.summary())
    print()
    print(predicted.summary())
    picture, trace = out("timeline.png"), out("trace-measured.json")
    measured.to_chrome_trace(trace)
    predicted.plot(picture, other=measured, title=f"{pipe.part.model_name}: predicted (top) and measured (bottom)")
    print(f"\ntimeline: {picture}\nChrome trace: {trace} (open in Perfetto or chrome://tracing)")
    return 0


# ------------------------------------------------------------------ helpers
def load_model(spec: str, kwargs: dict[str, Any] | None = None) -> Any:
    """Returns the ``nn.Module`` that ``spec`` names (see ``fxpipe --help``), built with
    ``kwargs``.

    Raises:
        CommandError: when the spec names no model, or what it names is not an nn.Module.
    """
    from torch import nn

    kwargs = dict(kwargs or {})
    if spec.startswith("torchvision:"):
        import torchvision

        name = spec.split(":", 1)[1]
        try:
            model = torchvision.models.get_model(name, weights=None, **kwargs)
        except ValueError as err:
            raise CommandError(f"{spec}: {err}; list them with torchvision.models.list_models()") from err
        return model
    where, _, attribute = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise CommandError(f"MODEL {spec!r}: no file {where}")
        module = _import_file(Path(where))
        names = [attribute] if attribute else ["build_model", "make_model", "get_model", "model"]
    elif attribute:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise CommandError(f"cannot import {where!r} from MODEL {spec!r}: {err}") from err
        names = [attribute]
    else:
        raise CommandError(f"MODEL {spec!r}: write torchvision:NAME, package.module:factory or path/to/file.py[:factory]")
    found = next((getattr(module, n) for n in names if hasattr(module, n)), None)
    if found is None:
        raise CommandError(f"MODEL {spec!r}: {where} defines none of {', '.join(names)}")
    model = found if isinstance(found, nn.Module) else found(**kwargs)
    if not isinstance(model, nn.Module):
        raise CommandError(f"MODEL {spec!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def _import_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)
    spec.loader.exec_module(module)
    return module


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """Returns ``{"num_classes": 10}`` for ``["num_classes=10"]``; values are Python
    literals, or strings when they parse as none.

    Raises:
        CommandError: for an item without ``=``.
    """
    kwargs = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise CommandError(f"--model-arg {item!r}: write KEY=VALUE, e.g. num_classes=10")
        try:
            kwargs[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            kwargs[key] = text
    return kwargs


def example_inputs(shapes: Sequence[str] | None, seed: int = 0) -> tuple:
    """Returns random example tensors for ``--input`` values such as ``8x3x224x224`` or
    ``8x128:int64`` (floats are standard normal, integers 0 or 1).

    Raises:
        CommandError: for a malformed shape or an unknown dtype.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for text in shapes or ["8x3x224x224"]:
        shape_text, _, dtype_name = text.partition(":")
        try:
            shape = [int(d) for d in shape_text.lower().split("x")]
        except ValueError:
            raise CommandError(f"--input {text!r}: write dimensions joined by x, e.g. 8x3x224x224") from None
        dtype = getattr(torch, dtype_name or "float32", None)
        if not isinstance(dtype, torch.dtype) or any(d < 1 for d in shape):
            raise CommandError(f"--input {text!r}: positive dimensions and a torch dtype such as float32 or int64")
        if dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            tensors.append(torch.randint(0, 2, shape, generator=generator).to(dtype))
    return tuple(tensors)


def plan_from_args(args: argparse.Namespace) -> Any:
    """Returns the ``fxpipe.Plan`` the plan options describe.

    Raises:
        CommandError: when --stages and --devices disagree, or --stages is not a multiple
            of --chunks.
    """
    import fxpipe

    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    if args.stages is not None:
        if args.stages % args.chunks:
            raise CommandError(f"--stages {args.stages} is not a multiple of --chunks {args.chunks}")
        workers = args.stages // args.chunks
        if devices is None:
            devices = [f"cpu:{i}" for i in range(workers)]
        elif len(devices) not in (workers, args.stages):
            raise CommandError(f"--devices lists {len(devices)} device(s) but --stages {args.stages} needs {workers}")
    if args.split is None:
        split: Any = "auto" if devices and len(devices) * args.chunks > 1 else "tags"
    elif args.split in ("tags", "auto"):
        split = args.split
    else:
        split = [path.strip() for path in args.split.split(",") if path.strip()]
    return fxpipe.Plan(
        devices=devices, split=split, schedule=args.schedule, microbatches=args.microbatches,
        chunks=args.chunks, checkpoint=args.checkpoint, frontend=args.frontend,
    )


def make_target(loss: str, output: Any, generator: Any) -> Any:
    """Returns a random target for ``loss`` shaped like the model's ``output`` (a fake
    tensor from shape propagation): class indices for cross-entropy, values for mse.

    Raises:
        CommandError: when the model's output is not one tensor but the loss needs one.
    """
    import torch

    if loss == "output":
        return None
    if not isinstance(output, torch.Tensor):
        raise CommandError(f"--loss {loss} needs a model that returns one tensor; use --loss output for a model returning its loss")
    if loss == "mse":
        return torch.randn(tuple(output.shape), generator=generator)
    if output.dim() < 2:
        raise CommandError(f"--loss cross-entropy needs an output of shape (batch, classes, …), got {tuple(output.shape)}")
    shape = (output.shape[0], *output.shape[2:])
    return torch.randint(0, int(output.shape[1]), shape, generator=generator)


def on_logical_devices(timeline: Any, devices: Sequence[str]) -> Any:
    """Returns ``timeline`` with each event's device the plan's name for its stage
    ("cpu:1", "cuda:0"), so the chart's rows say which logical device each worker is."""
    from dataclasses import replace

    from fxpipe.timeline import Timeline

    events = [replace(e, device=devices[e.stage]) for e in timeline.events]
    return Timeline(events, timeline.num_workers, timeline.kind, timeline.activation_bytes)


def _write_timeline(timeline: Any, picture: Path, trace: Path) -> None:
    print()
    print(timeline.summary())
    timeline.plot(picture, title="predicted timeline of one step")
    timeline.to_chrome_trace(trace)
    print(f"predicted timeline: {picture}\nChrome trace: {trace} (open in Perfetto or chrome://tracing)")


def _out_dir(folder: Path, prefix: str) -> Callable[[str], Path]:
    """Creates ``folder``; returns the function naming a file written there."""
    folder.mkdir(parents=True, exist_ok=True)
    return lambda name: folder / f"{prefix}{name}"


if __name__ == "__main__":
    sys.exit(main())
