"""Compiled stages: what ``Plan(compile=True)`` gains over eager stages, against what plain
``torch.compile`` gains over the eager micro-batch loop.

A GPT-2-style decoder (token and position embeddings, pre-norm blocks of causal
attention and a GELU MLP, a final norm and an LM head; 8 blocks, width 128, 64 tokens,
float32), one training step = 4 micro-batches of 2 sequences, one intra-op thread per
stage (``torch.set_num_threads(1)``), in interleaved rounds:
  1. fxpipe eager stages         2 stages, 1F1B, Plan(compile=False)
  2. fxpipe compile=True         the same plan, each stage's graph under torch.compile
  3. eager loop                  the micro-batch loop (forward, loss / m, backward) on the model
  4. torch.compile loop          the same loop on torch.compile(model)
Each variant is compiled and warmed up before the rounds; a round times ``--steps``
steps of each and keeps the median. Printed: the median step of each variant, the ratios
(2)/(1) and (4)/(3) (goal: (2)/(1) within 10 % of (4)/(3)), and the seconds spent
compiling (fxpipe's per stage from ``pipe.summary()``, the loop's first compiled step).

Then zero bubble, the same model on 2 ranks (``fxpipe.distributed.launch``, gloo, one
process and one intra-op thread per rank; a fresh world per run, the median step after 2
warm-up steps on rank 0), in interleaved rounds:
  1f1b eager / zb-h1 eager          eager stages; zb-h1 defers weight gradients op by op
  1f1b compiled                     Plan(compile=True)
  zb-h1 compiled, per-op split      compiled stages with yesterday's split: Inductor given as
                                    a callable backend, so the stage graph keeps the per-op
                                    deferring autograd Functions (Dynamo breaks the graph
                                    around them; I and W run them eagerly)
  zb-h1 compiled, graph split       Plan(compile=True): each compiled backward graph split
                                    into I and W, both Inductor code
  TDP 1f1b, compiled blocks         torch.distributed.pipelining's Schedule1F1B over stages
                                    built by hand, each block under Module.compile() (the
                                    torchtitan way; its zero-bubble schedules refuse them)
Last, the compile time of each stage of "zb-h1 compiled, graph split" and "1f1b
compiled" (forward, backward, I and W graphs, from ``pipe.summary()``): cold (an empty
Inductor cache) and warm (the same cache, a new process).

    .venv/bin/python examples/benchmarks/compiled.py [--rounds 3] [--steps 5] [--zb-rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.distributed import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_bubble import timed as rank_times  # noqa: E402 - the benchmark beside this file

ZERO_BUBBLE = {  # name: (schedule, Plan.compile)
    "1f1b eager": ("1f1b", False),
    "zb-h1 eager": ("zb-h1", False),
    "1f1b compiled": ("1f1b", True),
    "zb-h1 compiled, per-op split": ("zb-h1", "per-op"),
    "zb-h1 compiled, graph split": ("zb-h1", True),
}
TDP = "TDP 1f1b, compiled blocks"


class Block(nn.Module):
    """A pre-norm decoder block: causal attention (scaled_dot_product_attention) and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, n, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, seq: int, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def loop_step(model: Callable, idx: torch.Tensor, target: torch.Tensor, m: int) -> None:
    for x, t in zip(idx.chunk(m), target.chunk(m)):
        (lm_loss(model(x), t) / m).backward()


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def inductor(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor as a callable backend: fxpipe then keeps the per-op weight-gradient split."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def problem(quick: bool) -> tuple[Decoder, torch.Tensor, torch.Tensor, int]:
    """The model, its batch and target, and the micro-batch count (seeded: the same on every rank)."""
    depth, width, seq = (2, 32, 16) if quick else (8, 128, 64)
    batch, vocab = 8, 256
    torch.manual_seed(0)
    model = Decoder(vocab, width, depth, seq)
    return model, torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)), 4


def zero_bubble_run(name: str, quick: bool, steps: int, warmup: int) -> dict:
    """One rank of variant ``name``: its step times and its stage's compile line."""
    model, idx, target, m = problem(quick)
    schedule, compile = ZERO_BUBBLE[name]
    setting = {"backend": inductor} if compile == "per-op" else compile
    depth = len(model.blocks)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[f"blocks.{depth // 2}"], schedule=schedule, microbatches=m, compile=setting)
    pipe = fxpipe.compile(model, plan, example_inputs=(idx,), loss_fn=lm_loss)
    times = rank_times(lambda: pipe.step(idx, target=target), steps, warmup)
    compiled = [line.split(", ", 1)[1].strip() for line in pipe.summary().splitlines() if "graph(s) compiled" in line]
    return {"times": times, "compiled": compiled}


class FirstStage(nn.Module):
    def __init__(self, model: Decoder, blocks: int) -> None:
        super().__init__()
        self.tok, self.pos, self.blocks = model.tok, model.pos, model.blocks[:blocks]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, model: Decoder, blocks: int) -> None:
        super().__init__()
        self.blocks, self.ln, self.head = model.blocks[blocks:], model.ln, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def tdp_run(quick: bool, steps: int, warmup: int) -> dict:
    """One rank of torch.distributed.pipelining's 1F1B, its blocks compiled (Module.compile)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, idx, target, m = problem(quick)
    for block in model.blocks:
        block.compile()
    half = len(model.blocks) // 2
    module = FirstStage(model, half) if rank == 0 else LastStage(model, half)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    run = Schedule1F1B(stage, n_microbatches=m, loss_fn=lm_loss)
    step = (lambda: run.step(idx)) if rank == 0 else (lambda: run.step(target=target, losses=[]))
    times = rank_times(step, steps, warmup)
    dist.destroy_process_group()
    return {"times": times}


def zero_bubble(quick: bool, rounds: int, steps: int) -> None:
    """The zero-bubble table: each variant's median step on 2 ranks, and the ratios."""
    samples: dict[str, list[float]] = {name: [] for name in [*ZERO_BUBBLE, TDP]}
    for _ in range(rounds):
        for name in ZERO_BUBBLE:
            samples[name] += launch(zero_bubble_run, 2, (name, quick, steps, 2))[0]["times"]
        samples[TDP] += launch(tdp_run, 2, (quick, steps, 2))[0]["times"]
    med = {name: statistics.median(ts) for name, ts in samples.items()}
    print(f"\nzero bubble: 2 ranks x 1 thread (gloo), {rounds} round(s) of {steps} steps after 2 warm-up, load average {os.getloadavg()[0]:.1f}")
    for name, value in med.items():
        print(f"{name:32s} {1e3 * value:9.2f} ms")
    graph, per_op = med["zb-h1 compiled, graph split"], med["zb-h1 compiled, per-op split"]
    print(
        f"zb-h1/1f1b: eager {med['zb-h1 eager'] / med['1f1b eager']:.2f}x  compiled, graph split {graph / med['1f1b compiled']:.2f}x  "
        f"compiled, per-op split {per_op / med['1f1b compiled']:.2f}x"
    )
    print(f"graph split / per-op split (compiled) {graph / per_op:.2f}x  zb-h1 compiled, graph split / zb-h1 eager {graph / med['zb-h1 eager']:.2f}x")
    print(f"fxpipe 1f1b compiled / {TDP} {med['1f1b compiled'] / med[TDP]:.2f}x  zb-h1 compiled, graph split / {TDP} {graph / med[TDP]:.2f}x")


def compile_times(quick: bool) -> None:
    """Per stage, the seconds compiling took with an empty Inductor cache and then warm
    (--quick: zb-h1 only)."""
    print("\ncompile time per stage (forward + backward graphs; zb-h1: forward + I + W), cold / warm cache:")
    for name in ("zb-h1 compiled, graph split",) + (() if quick else ("1f1b compiled",)):
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache}
            cold = launch(zero_bubble_run, 2, (name, quick, 1, 0), env=env)
            warm = launch(zero_bubble_run, 2, (name, quick, 1, 0), env=env)
        for rank in (0, 1):
            seconds = [float(re.search(r"in (\d+\.\d) s", r[rank]["compiled"][0]).group(1)) for r in (cold, warm)]
            print(f"  {name:30s} {cold[rank]['compiled'][0]:60s} cold {seconds[0]:5.1f} s  warm {seconds[1]:5.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--zb-rounds", type=int, default=2, help="interleaved rounds of the zero-bubble runs (a fresh world each)")
    parser.add_argument("--quick", action="store_true", help="2 blocks, width 32, 16 tokens, 1 round of 2 steps")
    parser.add_argument("--part", choices=["all", "loop", "zero-bubble", "compile-time"], default="all", help="run one part only")
    args = parser.parse_args()
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    if args.part in ("all", "loop"):
        loop_part(args.quick, rounds, steps)
    if args.part in ("all", "zero-bubble"):
        zero_bubble(args.quick, 1 if args.quick else args.zb_rounds, steps)
    if args.part in ("all", "compile-time"):
        compile_times(args.quick)


def loop_part(quick: bool, rounds: int, steps: int) -> None:
    """Compiled against eager stages, beside torch.compile(model) against the eager loop."""
    torch.set_num_threads(1)
    model, idx, target, m = problem(quick)
    depth, width, seq, batch = len(model.blocks), model.head.in_features, idx.shape[1], idx.shape[0]
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[f"blocks.{depth // 2}"], schedule="1f1b", microbatches=m)

    eager_pipe = fxpipe.compile(model, plan, example_inputs=(idx,), loss_fn=lm_loss)
    compiled_pipe = fxpipe.compile(model, plan.replace(compile=True), example_inputs=(idx,), loss_fn=lm_loss)
    loop_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled_loop = torch.compile(compiled_model)
    variants: dict[str, Callable[[], None]] = {
        "fxpipe eager stages": lambda: eager_pipe.step(idx, target=target),
        "fxpipe compile=True": lambda: compiled_pipe.step(idx, target=target),
        "eager loop": lambda: loop_step(loop_model, idx, target, m),
        "torch.compile loop": lambda: loop_step(compiled_loop, idx, target, m),
    }
    first = {name: timed(step) for name, step in variants.items()}  # compiles
    for step in variants.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, step in variants.items():
            times[name].append(statistics.median(timed(step) for _ in range(steps)))
    median = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"GPT-2-style decoder: {depth} blocks, width {width}, {seq} tokens, batch {batch} in {m} micro-batches, float32, 1 thread per stage")
    print(f"{'variant':24s} {'step ms':>9s} {'first step s':>13s}")
    for name in variants:
        print(f"{name:24s} {1e3 * median[name]:9.2f} {first[name]:13.1f}")
    fxpipe_ratio = median["fxpipe compile=True"] / median["fxpipe eager stages"]
    loop_ratio = median["torch.compile loop"] / median["eager loop"]
    print(f"compiled/eager: fxpipe (2)/(1) {fxpipe_ratio:.2f}x  loop (4)/(3) {loop_ratio:.2f}x")
    compiled = [line.strip() for line in compiled_pipe.summary().splitlines() if "graph(s) compiled" in line]
    print("compile time: " + "; ".join(compiled) + f"; torch.compile loop's first step {first['torch.compile loop']:.1f} s")


if __name__ == "__main__":
    main()
