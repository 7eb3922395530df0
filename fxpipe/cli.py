"""The ``fxpipe`` command: ``fxpipe inspect MODEL`` and ``fxpipe train MODEL``.

``inspect`` partitions a model without touching any device (a plan for four GPUs can be
inspected on a laptop): it prints the summary, writes the partition drawing and the
predicted timeline, and with ``--html`` one self-contained page holding them all.
``train`` compiles the model on its devices, runs a few training steps on random data
with a progress bar (``--loss lm``: a causal language model's next-token loss, with its
tokens per second), and writes the measured timeline beside the predicted one. Both wrap
the public API: ``fxpipe.partition``, ``fxpipe.compile``, ``draw``, ``simulate``,
``timeline``.

A user's mistake (an option fxpipe cannot use, a model that does not exist, does not
build or does not take the inputs given, a plan fxpipe cannot honour) ends the command
with one line on stderr, at most three lines of hints and exit status 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import fxpipe
from fxpipe import cli_model
from fxpipe.batching.microbatch import batch_size
from fxpipe.cli_model import CommandError
from fxpipe.inspection.page import write_page
from fxpipe.inspection.timeline import Timeline
from fxpipe.passes.meta import VAL
from fxpipe.schedules import SCHEDULES

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
  fxpipe inspect examples/llm_configs.py:gpt2 --input 8x128:int64 --stages 4 --html
  fxpipe train torchvision:resnet18 --stages 2 --split layer3 --input 16x3x64x64 \\
      --model-arg num_classes=10 --steps 5
  fxpipe train examples/llm_configs.py:gpt2 --input 8x64:int64 --stages 2 --loss lm
"""




class CommandParser(argparse.ArgumentParser):
    """argparse with fxpipe's error format: one line and a hint, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}\n  see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``fxpipe`` command with ``argv`` (default: the process's arguments);
    returns the exit status: 0, or 2 after a one-line error with at most three lines of
    hints (``--debug``: the traceback instead)."""
    args = build_parser().parse_args(argv)
    # fake tensors log a traceback of their own before an error reaches us: --debug shows it
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    if not args.debug:
        fake_tensor_log.setLevel(logging.CRITICAL)
    try:
        return args.run(args)
    except Exception as err:  # noqa: BLE001 - every failure is one line; --debug shows the traceback
        if args.debug:
            raise
        print("\n".join(error_lines(f"fxpipe {args.command}", err)), file=sys.stderr)
        return 2
    finally:
        fake_tensor_log.setLevel(level)


def error_lines(prefix: str, err: BaseException) -> list[str]:
    """``prefix: error: <message>`` and at most three indented hint lines: a
    CommandError's hints; for other errors their message's further lines and a pointer
    to --debug."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [type(err).__name__]
    if isinstance(err, CommandError):
        message, hints = lines[0], err.hints
    else:
        known = type(err).__module__.startswith("fxpipe")
        message = in_flags(lines[0]) if known else f"{type(err).__name__}: {lines[0]}"
        hints = [in_flags(line) for line in lines[1:3]] + ["rerun with --debug to see the traceback"]
    return [f"{prefix}: error: {message}"] + [f"  {hint}" for hint in hints[:3]]


# the Plan fields the command sets, by their flags
_FLAGS = {"devices": "--devices", "split": "--split", "schedule": "--schedule", "microbatches": "--microbatches",
          "chunks": "--chunks", "checkpoint": "--checkpoint", "frontend": "--frontend"}
_VALUE = r"(\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[\w.:-]+)"


def _flag_value(text: str) -> str:
    """``['cpu:0', 'cpu:1']`` -> ``cpu:0,cpu:1``; ``'auto'`` -> ``auto``."""
    if text.startswith("["):
        return ",".join(item.strip().strip("'\"") for item in text[1:-1].split(",") if item.strip())
    return text.strip("'\"")


def in_flags(message: str) -> str:
    """An fxpipe error's message as the command's user writes it: ``plan.split[0] = 'x'``,
    ``devices=['cpu:0', 'cpu:1']`` and ``Plan(split='auto')`` become ``--split x``,
    ``--devices cpu:0,cpu:1`` and ``--split auto``; ``example_inputs`` becomes ``--input``."""
    fields = "|".join(_FLAGS)

    def flag(match: re.Match) -> str:
        return f"{_FLAGS[match.group(1)]} {_flag_value(match.group(2))}"

    message = re.sub(rf"\bplan\.({fields})(?:\[\d+\])?\s*=\s*{_VALUE}", flag, message)
    message = re.sub(rf"(?<![\w.])({fields})={_VALUE}", flag, message)
    message = re.sub(rf"\bplan\.({fields})\b", lambda m: _FLAGS[m.group(1)], message)
    message = re.sub(r"\b(?:fxpipe\.)?Plan\((--[^()]*)\)", r"\1", message)
    message = re.sub(r"example_inputs=\(x, \.\.\.\)", "--input SHAPE[:DTYPE]", message)
    message = message.replace("convert the model (model.to(dtype))", "give --input the model's dtype, e.g. --input 8x3x224x224:float32")
    return re.sub(r"\bexample_inputs\b", "--input", message)


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of ``fxpipe`` with its two subcommands."""
    parser = CommandParser(
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
    inspect.add_argument("--html", action="store_true",
                         help="also write inspect.html: one self-contained page with the drawing (the stage view "
                              "unless --level says otherwise), the summary, the predicted timeline and the explain text")
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
    train.add_argument("--loss", choices=("cross-entropy", "mse", "lm", "output"), default="cross-entropy",
                       help="cross-entropy against random class labels, mse against random targets, lm: a causal "
                            "language model's next-token cross-entropy on random token ids (prints tokens/s), or "
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
                        help="one example input per argument of the model's forward, dimensions joined by x, e.g. "
                             "8x3x224x224 or 8x128:int64 (integer inputs hold 0s and 1s; with --loss lm, token ids); "
                             "dim 0 is the batch; default 8x3x224x224 for torchvision models, required otherwise")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group("plan", "the fxpipe.Plan to compile with")
    plan.add_argument("--stages", type=_positive, metavar="N",
                      help="number of pipeline stages; without --devices they go on logical CPUs cpu:0, cpu:1, …")
    plan.add_argument("--devices", metavar="LIST",
                      help="comma-separated device per stage (or per worker with --chunks), e.g. cuda:0,cuda:1 or cpu,cuda:0")
    plan.add_argument("--split", metavar="HOW",
                      help="tags (device_guard blocks), auto (cost model) or comma-separated module paths where stages "
                           "begin, e.g. layer2,layer3; default auto with several devices, tags otherwise")
    plan.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                      help="pipeline schedule (zb-v, v-half, v-min and dualpipev run with --chunks 2); default 1f1b")
    plan.add_argument("--microbatches", type=_positive, default=None, metavar="M",
                      help="micro-batches per step (the batch is cut along dim 0); default 4, or the batch size when smaller")
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
    """``fxpipe inspect``: summary, drawing, predicted timeline, and the page with
    ``--html``. Returns 0."""
    model, shapes, inputs = _model_and_inputs(args)
    plan = plan_from_args(args)
    plan = fit_batch(args, plan, inputs)
    part = _on_model(args, shapes, lambda: fxpipe.partition(model, plan, example_inputs=inputs))
    out = _out_dir(args.out, args.prefix)
    print(part.summary())
    if args.explain:
        print()
        print(part.explain())
    drawing = part.draw(out(f"partition.{args.format}"), level=args.level, renderer=args.renderer)
    print(f"\npartition drawing: {drawing}")
    predicted = on_logical_devices(part.simulate(), part.devices)
    _write_timeline(predicted, out("timeline-predicted.png"), out("trace-predicted.json"))
    if args.html:
        level = "stage" if args.level == "auto" else args.level  # the page is an overview
        page = write_page(part, predicted, out("inspect.html"), level=level, renderer=args.renderer)
        print(f"page: {page} (one self-contained file: drawing, summary, timeline, explain)")
    return 0


def run_train(args: argparse.Namespace) -> int:
    """``fxpipe train``: compile, run ``--steps`` steps with a progress bar, write the
    measured timeline beside the predicted one. Returns 0."""
    model, shapes, inputs = _model_and_inputs(args)
    model.train()
    loss_fn = {"cross-entropy": torch.nn.CrossEntropyLoss(), "mse": torch.nn.MSELoss(), "lm": cli_model.next_token_loss, "output": None}[args.loss]
    plan = plan_from_args(args)
    plan = fit_batch(args, plan, inputs)
    pipe = _on_model(args, shapes, lambda: fxpipe.compile(model, plan, example_inputs=inputs, loss_fn=loss_fn))
    print(pipe.summary())
    output = next(n for n in pipe.graph.nodes if n.op == "output").meta.get(VAL)
    batches = _batches(args, output, inputs)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    _train_steps(args, pipe, optimizer, batches)
    measured = on_logical_devices(pipe.timeline(), pipe.part.devices)
    predicted = on_logical_devices(pipe.simulate(), pipe.part.devices)
    print()
    print(measured.summary())
    print()
    print(predicted.summary())
    out = _out_dir(args.out, args.prefix)
    picture, trace = out("timeline.png"), out("trace-measured.json")
    measured.to_chrome_trace(trace)
    predicted.plot(picture, other=measured, title=f"{pipe.part.model_name}: predicted (top) and measured (bottom)")
    print(f"\ntimeline: {picture}\nChrome trace: {trace} (open in Perfetto or chrome://tracing)")
    return 0


def _batches(args: argparse.Namespace, output: Any, inputs: tuple) -> Callable[[int], tuple[tuple, Any]]:
    """The function giving step k's (inputs, target): random inputs of the --input
    shapes and a target for --loss; with --loss lm, token ids below the vocabulary size
    and the ids themselves as the target.

    Raises:
        CommandError: --loss lm without token ids or logits, or a target the output cannot have.
    """
    at = cli_model.token_input(inputs)
    logits = cli_model.token_logits(output, inputs[at]) if at is not None else None
    if args.loss == "lm":
        if logits is None:
            raise CommandError(
                "--loss lm needs token ids in and logits of shape (batch, length, vocabulary) out",
                ["give the ids as integers, e.g. --input 8x128:int64"],
            )
        vocab = int(logits.shape[-1])

        def lm_batch(step: int) -> tuple[tuple, Any]:
            batch = cli_model.example_inputs(args.input, seed=args.seed + step, high=vocab)
            return batch, batch[at]

        return lm_batch
    if logits is not None:
        print(
            f"fxpipe train: warning: MODEL returns token logits {tuple(logits.shape)}; --loss {args.loss} "
            "scores them against random targets, not the next token: use --loss lm to train a language model",
            file=sys.stderr,
        )
    generator = torch.Generator().manual_seed(args.seed)
    cli_model.make_target(args.loss, output, generator)  # a target the output cannot have is an error before any step

    def batch(step: int) -> tuple[tuple, Any]:
        values = inputs if step == 0 else cli_model.example_inputs(args.input, seed=args.seed + step)
        return values, cli_model.make_target(args.loss, output, generator)

    return batch


def _train_steps(args: argparse.Namespace, pipe: Any, optimizer: Any, batches: Callable[[int], tuple[tuple, Any]]) -> None:
    """Runs ``--steps`` steps under a progress bar; with --loss lm, prints tokens per second."""
    tokens, seconds = 0, 0.0
    with tqdm(range(args.steps), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        for step in bar:
            batch, target = batches(step)
            started = time.perf_counter()
            loss = pipe.step(*batch, target=target)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - started
            postfix = {"loss": f"{loss.item():.4f}", "step": f"{elapsed:.3f}s"}
            if args.loss == "lm":
                postfix["tokens/s"] = f"{target.numel() / elapsed:.0f}"
                if step > 0 or args.steps == 1:  # the first step warms up
                    tokens, seconds = tokens + target.numel(), seconds + elapsed
            bar.set_postfix(postfix)
    if args.loss == "lm":
        print(f"{tokens / seconds:.0f} tokens/s ({tokens} tokens in {seconds:.3f} s, the first step left out)")


def _model_and_inputs(args: argparse.Namespace) -> tuple[Any, list[str], tuple]:
    """The model the arguments name, the --input shapes it gets (also left in
    ``args.input``, defaults filled in) and example tensors of them."""
    model = cli_model.load_model(args.model, cli_model.parse_model_args(args.model_arg))
    args.input = cli_model.input_shapes(args.model, args.input, model)
    return model, args.input, cli_model.example_inputs(args.input, seed=getattr(args, "seed", 0))


def _on_model(args: argparse.Namespace, shapes: Sequence[str], build: Callable[[], Any]) -> Any:
    """Returns ``build()`` (partitioning or compiling the model); an error that is not
    fxpipe's own comes from running the model on the inputs, and is reported as such."""
    try:
        return build()
    except Exception as err:
        if type(err).__module__.startswith("fxpipe"):
            raise
        message = (str(err).strip().splitlines() or [""])[0]
        raise CommandError(
            f"MODEL {args.model!r} does not run on {cli_model.describe_inputs(shapes)}: {type(err).__name__}: {message}",
            ["check that each --input has the shape and dtype the forward expects",
             "rerun with --debug to see the traceback"],
        ) from err


def plan_from_args(args: argparse.Namespace) -> Any:
    """Returns the ``fxpipe.Plan`` the plan options describe.

    Raises:
        CommandError: when --stages and --devices disagree, or --stages is not a multiple
            of --chunks.
    """
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    if args.stages is not None:
        if args.stages % args.chunks:
            raise CommandError(f"--stages {args.stages} is not a multiple of --chunks {args.chunks}")
        workers = args.stages // args.chunks
        if devices is None:
            devices = [f"cpu:{i}" for i in range(workers)]
        elif len(devices) not in (workers, args.stages):
            raise CommandError(f"--devices lists {len(devices)} device(s) but --stages {args.stages} needs {workers}")
    workers = args.stages // args.chunks if args.stages is not None else len(devices or ())
    if args.chunks > 1 and workers == 1:
        given = f"--stages {args.stages}" if args.stages is not None else f"--devices {args.devices}"
        raise CommandError(
            f"{given} with --chunks {args.chunks} puts every stage on one worker, which has nothing to overlap with",
            [f"--schedule {args.schedule} runs --chunks stages per worker: give --stages {2 * args.chunks} for two workers "
             f"(e.g. --devices cpu:0,cpu:1), or --chunks 1"],
        )
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


def fit_batch(args: argparse.Namespace, plan: Any, inputs: tuple) -> Any:
    """Returns ``plan`` with the micro-batch count the batch allows when --microbatches was
    left out (4, or the batch size when smaller).

    Raises:
        CommandError: when --microbatches asks for more micro-batches than --input has
            samples (``pipe.step`` would refuse the batch; ``inspect`` would plan what cannot run).
    """
    samples = batch_size(inputs)
    if samples is None or plan.microbatches <= samples:
        return plan
    if args.microbatches is None:
        return plan.replace(microbatches=samples)
    raise CommandError(
        f"--microbatches {plan.microbatches} cuts a batch of {samples} samples ({cli_model.describe_inputs(args.input)}) "
        "into more micro-batches than samples",
        [f"give --microbatches {samples} or fewer, or a larger batch (dim 0 of --input)"],
    )


def on_logical_devices(timeline: Any, devices: Sequence[str]) -> Any:
    """Returns ``timeline`` with each event's device the plan's name for its stage
    ("cpu:1", "cuda:0"), so the chart's rows say which logical device each worker is."""
    events = [replace(e, device=devices[e.stage]) for e in timeline.events]
    return Timeline(events, timeline.num_workers, timeline.kind, timeline.activation_bytes, timeline.ranks, timeline.deps)


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
