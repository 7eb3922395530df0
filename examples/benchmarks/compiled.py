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

    .venv/bin/python examples/benchmarks/compiled.py [--rounds 3] [--steps 5] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 blocks, width 32, 16 tokens, 1 round of 2 steps")
    args = parser.parse_args()
    depth, width, seq = (2, 32, 16) if args.quick else (8, 128, 64)
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    m, batch, vocab = 4, 8, 256
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Decoder(vocab, width, depth, seq)
    idx = torch.randint(0, vocab, (batch, seq))
    target = torch.randint(0, vocab, (batch, seq))
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
