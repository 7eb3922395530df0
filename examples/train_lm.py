"""Train a GPT-2 on the Python standard library's own source, pipelined, as eager PyTorch would.

The text is every top-level module of the standard library (the ``*.py`` files beside
``os.py``, sorted by name, read as bytes): real text that every Python installation has.
Tokens are bytes (256 of them, plus a padding token). Each file is cut into sequences of
``--seq`` tokens that never cross into the next file, so a file's last sequence is padded
and its padded targets are ``-100``, which ``CrossEntropyLoss(ignore_index=-100)`` skips;
every tenth file is held out for the eval loss.

A GPT-2 (transformers' ``GPT2LMHeadModel`` from a config, random init, tied head) is cut
into two stages at ``transformer.h.<layers/2>`` and trained on the ``--schedule`` (1F1B)
over ``--microbatches``: AdamW over ``pipe.parameters()``, linear warm-up then cosine decay
to the last step, ``pipe.clip_grad_norm_(1.0)`` every step, the eval loss every
``--eval-every`` steps (``pipe.eval()``, ``pipe(x)``, ``pipe.train()``), and a checkpoint
(``fxpipe.save_checkpoint``) every ``--checkpoint-every`` steps that ``--resume`` continues
from with the same losses as an uninterrupted run, in this layout or another (another
``--schedule``, one process after a torchrun job).

    .venv/bin/python examples/train_lm.py [--steps 100]                         # one process, 2 stage threads
    .venv/bin/torchrun --nproc-per-node 2 examples/train_lm.py --loss-log losses.json  # one rank per stage
    .venv/bin/python examples/train_lm.py --compare-eager losses.json --plot lm.png   # eager PyTorch on the log
    .venv/bin/python examples/train_lm.py --compare-eager --plot lm.png         # both, in one process

``--compare-eager`` trains the same model without fxpipe (the same data, seed, optimizer,
schedule and ``torch.nn.utils.clip_grad_norm_``), prints the largest relative difference of
the two loss curves and draws them (``--plot``). Exit status 1 when it exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from common import limit_threads
from torch import nn

import fxpipe

PAD = 256  # the padding token: inputs after a file's end
VOCAB = 257  # the 256 byte values and PAD
IGNORE = -100  # the target of a padded position
HOLD_OUT_EVERY = 10  # every tenth file is held out
CHUNKS = {"interleaved-1f1b": 2, "zb-v": 2}  # stages per worker of the schedules that hold several
# the settings that decide the numbers: a resume must keep them, --compare-eager takes them from the log
NUMERIC_KEYS = ("steps", "batch", "seq", "layers", "width", "heads", "dtype", "bf16", "dropout", "lr", "warmup", "weight_decay", "seed")
LOGGED_KEYS = NUMERIC_KEYS + ("microbatches", "schedule", "devices", "eval_every", "eval_batches")

_cross_entropy = nn.CrossEntropyLoss(ignore_index=IGNORE)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions that are not padding."""
    return _cross_entropy(out.logits.flatten(0, 1), target.flatten())


# ---------------------------------------------------------------------- data
def stdlib_sources() -> list[Path]:
    """The standard library's top-level modules, sorted by name (the same list on every rank)."""
    return sorted(Path(os.__file__).parent.glob("*.py"))


def file_sequences(data: bytes, seq: int) -> torch.Tensor:
    """One file's bytes as rows of ``seq + 1`` tokens, row k starting at byte ``k * seq``
    (a row's inputs are its first ``seq`` tokens, its targets the last ``seq``), the last
    row padded with PAD."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    rows = math.ceil((len(tokens) - 1) / seq)
    padded = torch.full((rows * seq + 1,), PAD)
    padded[: len(tokens)] = tokens
    return padded.unfold(0, seq + 1, seq)


def inputs_and_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    targets = rows[:, 1:].clone()
    targets[targets == PAD] = IGNORE
    return rows[:, :-1].contiguous(), targets


@dataclass
class Corpus:
    """Training and held-out sequences (rows of ``seq + 1`` tokens) of the standard library."""

    train: torch.Tensor
    held_out: torch.Tensor
    files: int
    bytes: int

    @classmethod
    def load(cls, seq: int) -> Corpus:
        """Every top-level standard-library module; every HOLD_OUT_EVERY-th file (by sorted
        name) goes to the held-out split. Raises RuntimeError when there is no text."""
        train, held_out, size = [], [], 0
        for k, path in enumerate(stdlib_sources()):
            data = path.read_bytes()
            if len(data) < 2:
                continue
            size += len(data)
            (held_out if k % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 else train).append(file_sequences(data, seq))
        if not train or not held_out:
            raise RuntimeError(f"no standard-library sources under {Path(os.__file__).parent}")
        return cls(torch.cat(train), torch.cat(held_out), len(train) + len(held_out), size)

    def training_batch(self, step: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s batch: epochs of shuffled sequences, the order drawn from
        (seed, epoch), so any step's batch is known without running the ones before it."""
        per_epoch = len(self.train) // size
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        return inputs_and_targets(self.train[order[k * size : (k + 1) * size]])

    def eval_batches(self, count: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` fixed batches of held-out sequences."""
        order = torch.randperm(len(self.held_out), generator=torch.Generator().manual_seed(seed))
        rows = self.held_out[order[: count * size]]
        return [inputs_and_targets(chunk) for chunk in rows.split(size)]

    def describe(self, seq: int) -> str:
        padding = float((self.train[:, 1:] == PAD).float().mean())
        return (
            f"corpus: {self.files} standard-library modules under {Path(os.__file__).parent} ({self.bytes / 2**20:.1f} MiB); "
            f"{len(self.train):,} training sequences of {seq} byte tokens ({padding:.1%} padding), "
            f"{len(self.held_out):,} held out"
        )


# --------------------------------------------------------------------- model
def gpt2(args: argparse.Namespace) -> nn.Module:
    """A GPT-2 from a config (random init from ``args.seed``, no download), byte vocabulary,
    the output head tied to the token embedding."""
    torch.manual_seed(args.seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout, use_cache=False,
        bos_token_id=PAD, eos_token_id=PAD, tie_word_embeddings=True,
    )
    return transformers.GPT2LMHeadModel(config).to(getattr(torch, args.dtype))


def pipeline_plan(args: argparse.Namespace) -> fxpipe.Plan:
    """``devices`` workers, each holding ``CHUNKS`` stages under the interleaved schedules;
    the stages get equal shares of the transformer blocks."""
    devices = args.devices.split(",")
    chunks = CHUNKS.get(args.schedule, 1)
    stages = len(devices) * chunks
    split = [f"transformer.h.{k * args.layers // stages}" for k in range(1, stages)]
    return fxpipe.Plan(devices=devices, split=split, schedule=args.schedule, microbatches=args.microbatches, chunks=chunks)


# ------------------------------------------------------------- training loop
@dataclass
class Trainer:
    """What differs between the pipelined and the eager loop: ``module`` is a pipeline or
    the model (parameters, state_dict, eval/train, forward); ``backward(x, t)`` runs one
    step's forward and backward and returns its loss; ``clip(max_norm)`` returns the norm."""

    label: str
    module: Any
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    clip: Callable[[float], torch.Tensor]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``args.warmup`` steps, then cosine decay towards 0 at ``args.steps``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_step(trainer: Trainer, opt: torch.optim.Optimizer, step: int, batch: tuple, args: argparse.Namespace) -> dict:
    lr = learning_rate(step, args)
    for group in opt.param_groups:
        group["lr"] = lr
    began = time.perf_counter()
    opt.zero_grad()
    torch.manual_seed(args.seed + step)  # the step's dropout masks, the same after a resume
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        loss = trainer.backward(*batch)
    norm = trainer.clip(1.0)
    opt.step()
    return {"step": step, "loss": float(loss), "lr": lr, "grad_norm": float(norm), "seconds": time.perf_counter() - began}


@torch.no_grad()
def evaluate(module: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], bf16: bool) -> float:
    """Mean cross-entropy over every held-out target token. Under torchrun only the rank
    holding the last stage gets ``module(x)``; the token sums are all-reduced."""
    total = torch.zeros(2, dtype=torch.float64)
    module.eval()
    try:
        for x, t in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = module(x)
            if out is not None:
                logits = out.logits.flatten(0, 1).float().cpu()
                total += torch.tensor([F.cross_entropy(logits, t.flatten(), ignore_index=IGNORE, reduction="sum"), (t != IGNORE).sum()])
    finally:
        module.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1])


def progress_line(history: dict, count: int, args: argparse.Namespace) -> str:
    last, recent = history["steps"][-1], history["steps"][-count:]
    tokens_per_s = len(recent) * args.batch * args.seq / sum(r["seconds"] for r in recent)
    return (
        f"step {last['step']:>5}  loss {last['loss']:.4f}  lr {last['lr']:.2e}  grad norm {last['grad_norm']:.3f}  "
        f"tokens/s {tokens_per_s:,.0f}"
    )


def train(trainer: Trainer, corpus: Corpus, args: argparse.Namespace, say: Callable[[str], None], checkpoints: bool) -> dict:
    """Train from step 0 (or the checkpoint with ``--resume``) to ``--steps`` (or
    ``--stop-after``); returns the history: every step's record and the eval losses."""
    opt = torch.optim.AdamW(trainer.module.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    config = {key: getattr(args, key) for key in LOGGED_KEYS}
    history: dict = {"config": config, "steps": [], "eval": []}
    if checkpoints and args.resume:
        history = {**load_checkpoint(args, trainer.module, opt), "config": config}
        say(f"{trainer.label}: resumed at step {len(history['steps'])} from {checkpoint_path(args)}")
    evals = corpus.eval_batches(args.eval_batches, args.batch, args.seed)
    stop = min(args.steps, args.stop_after or args.steps)
    for step in range(len(history["steps"]), stop):
        history["steps"].append(train_step(trainer, opt, step, corpus.training_batch(step, args.batch, args.seed), args))
        if (step + 1) % args.print_every == 0 or step in (0, args.steps - 1):
            say(f"{trainer.label}: {progress_line(history, args.print_every, args)}")
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            history["eval"].append({"step": step, "loss": evaluate(trainer.module, evals, args.bf16)})
            say(f"{trainer.label}: step {step:>5}  eval loss {history['eval'][-1]['loss']:.4f}")
        if checkpoints and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(args, trainer.module, opt, history)
    return history


# --------------------------------------------------------------- checkpoints
def checkpoint_path(args: argparse.Namespace) -> Path:
    return Path(args.ckpt_dir) / "checkpoint"


def save_checkpoint(args: argparse.Namespace, module: Any, opt: torch.optim.Optimizer, history: dict) -> None:
    """The job's parameters and optimizer state under the model's names, and the history
    so far (``fxpipe.save_checkpoint``: every rank writes its share; the previous checkpoint
    stays whole until the new one is complete)."""
    Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
    fxpipe.save_checkpoint(checkpoint_path(args), module, optimizer=opt, extra=history)


def load_checkpoint(args: argparse.Namespace, module: Any, opt: torch.optim.Optimizer) -> dict:
    """Load the checkpoint into ``module`` and ``opt`` (any layout: another schedule,
    another number of ranks); returns its history. Raises SystemExit when there is none,
    when a file of it is damaged, or when it was trained with other settings."""
    path = checkpoint_path(args)
    try:
        history = fxpipe.load_checkpoint(path, module, optimizer=opt)
    except fxpipe.CheckpointError as err:
        raise SystemExit(f"--resume: {err}; train with --checkpoint-every N --ckpt-dir {args.ckpt_dir} first") from err
    saved = history["config"]
    changed = [f"--{k.replace('_', '-')} {saved[k]} (now {getattr(args, k)})" for k in NUMERIC_KEYS if saved[k] != getattr(args, k)]
    if changed:
        raise SystemExit(f"--resume: {path} was trained with other settings: {', '.join(changed)}; resume with the same ones")
    return history


# ----------------------------------------------------------- the two runners
def run_fxpipe(args: argparse.Namespace, corpus: Corpus, say: Callable[[str], None]) -> dict:
    """Train with fxpipe: a local pipeline in one process, one rank per worker under torchrun."""
    plan = pipeline_plan(args)
    x, _ = corpus.training_batch(0, args.batch, args.seed)
    with fxpipe.compile(gpt2(args), plan, example_inputs=(x,), loss_fn=lm_loss) as pipe:
        say(f"fxpipe: {pipe!r}; {len(plan.split) + 1} stages cut at {', '.join(plan.split)}, {plan.microbatches} micro-batches")
        trainer = Trainer("fxpipe", pipe, lambda x, t: pipe.step(x, target=t), pipe.clip_grad_norm_)
        return train(trainer, corpus, args, say, checkpoints=True)


def run_eager(args: argparse.Namespace, corpus: Corpus, say: Callable[[str], None]) -> dict:
    """The same loop on the plain model: full-batch forward and backward, torch's clipping."""
    model = gpt2(args)

    def backward(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), t)
        loss.backward()
        return loss.detach()

    trainer = Trainer("eager", model, backward, lambda max_norm: nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    return train(trainer, corpus, args, say, checkpoints=False)


# ---------------------------------------------------------------- comparison
def largest_relative_difference(ours: list[float], reference: list[float]) -> float:
    if len(ours) != len(reference):
        raise ValueError(f"the runs have {len(ours)} and {len(reference)} steps")
    return max((abs(a - b) / abs(b) for a, b in zip(ours, reference)), default=0.0)


def plot_comparison(pipelined: dict, eager: dict, path: str, title: str, tolerance: float) -> None:
    """Both loss curves (training, and eval as markers) above their relative difference
    per step, with the tolerance dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5.5), gridspec_kw={"height_ratios": [3, 1.2]})
    steps = [r["step"] for r in eager["steps"]]
    for run, style in ((pipelined, dict(color="C0", linewidth=4, alpha=0.45)), (eager, dict(color="black", linestyle=(0, (1, 2)), linewidth=1))):
        label = "fxpipe" if run is pipelined else "eager PyTorch"
        top.plot(steps, [r["loss"] for r in run["steps"]], label=f"{label}, training", **style)
        if run["eval"]:
            marker = dict(marker="o", markersize=9, alpha=0.45, color="C1") if run is pipelined else dict(marker="x", color="black")
            top.plot([e["step"] for e in run["eval"]], [e["loss"] for e in run["eval"]], linestyle="none", label=f"{label}, held out", **marker)
    top.set_ylabel("cross-entropy (nats per byte)")
    top.set_title(title)
    top.legend()
    differences = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(pipelined["steps"], eager["steps"])]
    bottom.plot(steps, differences, color="C0", marker=".", linewidth=0.8)
    bottom.axhline(tolerance, color="C3", linestyle="--", linewidth=1, label=f"tolerance {tolerance:.0e}")
    bottom.set_yscale("symlog", linthresh=1e-8)
    bottom.set_ylim(0, 10 * max(tolerance, *differences))
    bottom.legend(loc="upper left")
    bottom.set_ylabel("|fxpipe − eager| / eager")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(pipelined: dict, eager: dict, args: argparse.Namespace) -> float:
    """Print the largest relative differences of the losses and norms, draw the curves."""
    losses = largest_relative_difference([r["loss"] for r in pipelined["steps"]], [r["loss"] for r in eager["steps"]])
    norms = largest_relative_difference([r["grad_norm"] for r in pipelined["steps"]], [r["grad_norm"] for r in eager["steps"]])
    print(f"fxpipe against eager over {len(eager['steps'])} steps: largest relative difference of the loss {losses:.2e}, of the gradient norm {norms:.2e}")
    for mine, theirs in zip(pipelined["eval"], eager["eval"]):
        print(f"  eval loss at step {mine['step']:>4}: fxpipe {mine['loss']:.6f}, eager {theirs['loss']:.6f}")
    print(f"time in steps: fxpipe {sum(r['seconds'] for r in pipelined['steps']):.1f} s, eager {sum(r['seconds'] for r in eager['steps']):.1f} s")
    if args.plot:
        numbers = f"{args.dtype}{' + bf16 autocast' if args.bf16 else ''}, dropout {args.dropout}"
        title = f"GPT-2 on the standard library ({args.schedule}, {args.microbatches} micro-batches; {numbers})"
        plot_comparison(pipelined, eager, args.plot, title, args.tolerance)
        print(f"wrote {args.plot}")
    return losses


# ---------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=int, default=100)
    add("--batch", type=int, default=8, help="sequences per step")
    add("--seq", type=int, default=128, help="tokens (bytes) per sequence")
    add("--microbatches", type=int, default=4)
    add("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"))
    add("--devices", default="cpu:0,cpu:1",
        help="one device per pipeline worker (one rank each under torchrun); distinct logical CPUs hold a copy each of the tied "
        "embedding and add its gradients in a fixed order, where 'cpu,cpu' shares one copy that two threads add into as they finish")
    add("--layers", type=int, default=4)
    add("--width", type=int, default=128)
    add("--heads", type=int, default=4)
    add("--dtype", default="float32", choices=("float32", "float64", "bfloat16"), help="the parameters' dtype")
    add("--bf16", action="store_true", help="bf16 autocast around every step and eval forward")
    add("--dropout", type=float, default=0.0)
    add("--lr", type=float, default=1e-3, help="the peak learning rate")
    add("--warmup", type=int, default=10, help="steps of linear warm-up before the cosine decay")
    add("--weight-decay", type=float, default=0.1)
    add("--seed", type=int, default=0)
    add("--eval-every", type=int, default=25, help="held-out loss every N steps (0: never)")
    add("--eval-batches", type=int, default=4, help="held-out batches of --batch sequences")
    add("--print-every", type=int, default=10)
    add("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps")
    add("--ckpt-dir", default="checkpoints", help="where the checkpoint directory goes (<dir>/checkpoint)")
    add("--resume", action="store_true", help="continue from the checkpoint in --ckpt-dir")
    add("--stop-after", type=int, default=0, help="stop after this many steps (as if interrupted; --resume continues)")
    add("--loss-log", help="write the settings, step records and eval losses to this JSON file (rank 0); torchrun takes a bare --log for its own --log-dir")
    add("--compare-eager", nargs="?", const="", metavar="LOG",
        help="train the model in eager PyTorch too and compare: with the losses of LOG (a --loss-log file), else after an fxpipe run in this process")
    add("--plot", help="with --compare-eager: draw both loss curves to this PNG")
    add("--tolerance", type=float, default=1e-4, help="with --compare-eager: exit status 1 above this largest relative difference")
    add("--smoke", action="store_true", help="smaller defaults: a 2-layer model of width 32, 32-byte sequences, batch 4 (for tests)")
    args = parser.parse_args(argv)
    if args.smoke:  # smaller defaults; options given still win
        parser.set_defaults(layers=2, width=32, heads=2, seq=32, batch=4, microbatches=2, eval_batches=1)
        args = parser.parse_args(argv)
    stages = len(args.devices.split(",")) * CHUNKS.get(args.schedule, 1)
    if args.layers < stages:
        parser.error(f"--schedule {args.schedule} on {args.devices} cuts {stages} stages at transformer blocks: give --layers {stages} or more")
    if args.compare_eager is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--compare-eager runs in one process: run torchrun with --loss-log losses.json, then --compare-eager losses.json")
    if args.compare_eager and args.resume:
        parser.error("--compare-eager LOG trains eager PyTorch only; --resume applies to the fxpipe run")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Returns {"fxpipe": history} (the log's with --compare-eager LOG), plus "eager",
    "largest_relative_difference" and "tolerance" with --compare-eager."""
    args = parse_args(argv)
    limit_threads()
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda line: None)
    if args.compare_eager:
        logged = json.loads(Path(args.compare_eager).read_text())
        vars(args).update(logged["config"])
        say(f"eager PyTorch on the settings of {args.compare_eager}: {logged['config']}")
    corpus = Corpus.load(args.seq)
    say(corpus.describe(args.seq))
    say(f"GPT-2: {args.layers} layers, width {args.width}, {args.heads} heads, vocabulary {VOCAB} (tied head); {args.dtype}"
        f"{', bf16 autocast' if args.bf16 else ''}, dropout {args.dropout}; batch {args.batch} x {args.seq} tokens, {args.steps} steps")
    pipelined = logged if args.compare_eager else run_fxpipe(args, corpus, say)
    if args.loss_log and rank == 0 and not args.compare_eager:
        Path(args.loss_log).write_text(json.dumps(pipelined, indent=1))
        say(f"wrote {args.loss_log}")
    if args.compare_eager is None:
        return {"fxpipe": pipelined}
    eager = run_eager(args, corpus, say)
    worst = compare(pipelined, eager, args)
    return {"fxpipe": pipelined, "eager": eager, "largest_relative_difference": worst, "tolerance": args.tolerance}


if __name__ == "__main__":
    result = main()
    if result.get("largest_relative_difference", 0.0) > result.get("tolerance", 0.0):
        raise SystemExit(f"fxpipe's losses differ from eager's by more than {result['tolerance']:.0e} (relative)")
    if dist.is_initialized():
        dist.destroy_process_group()
