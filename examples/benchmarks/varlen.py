"""Micro-batches of different lengths in one step: their cost against equal lengths, the
speed-up against padding, and what knowing each micro-batch's shapes costs across ranks.

A GPT-style decoder written for torch.fx (one program serves every length: the sequence
dimension is read at run time), 2 stages, 1F1B, 8 micro-batches of 4 rows, a token-mean
loss. In one run:
  varlen / equal   a warm step of 8 micro-batches of 8 different lengths against a step of
                   8 micro-batches of one length holding the same tokens; measured in
                   alternation with eager running each set one micro-batch after another
                   (what the lengths cost by themselves: attention grows with the square of
                   the length), medians. Goal: <= 1.3x.
  padding          steps whose 8 lengths are drawn from a long-tailed distribution
                   (lognormal, median 64, clipped to 16..512): listed as they are
                   (``pipe.step(microbatches=...)``) against the same rows padded to the
                   step's longest (-100 targets: the same loss) and cut by the plan; each
                   draw measured both ways in alternation. Reports the speed-up, the tokens
                   computed and the largest loss difference.
  shapes on ranks  2 gloo ranks: a receiving rank must know each micro-batch's shapes. fxpipe
                   derives them from the micro-batch's input shapes on fake tensors, once per
                   new input signature (timed inside the step), then looks them up; the
                   alternative, sending each micro-batch's shapes with it, is timed as the
                   messages it would need (one small message per micro-batch and edge).

    .venv/bin/python examples/benchmarks/varlen.py [--repeats 7] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.distributed import launch

sys.path.insert(0, str(Path(__file__).parent))
from rng_overhead import interleaved  # noqa: E402 - the shared timing helper beside this file

ROWS = 4  # rows per micro-batch
MICROBATCHES = 8


@dataclass(frozen=True)
class Size:
    """The decoder's size and the lengths the runs use."""

    layers: int
    width: int
    vocab: int
    lengths: tuple[int, ...]  # the 8 different lengths of the varlen / equal comparison
    longest: int  # the long-tailed draws' clip
    draws: int  # padding comparison: steps drawn


FULL = Size(layers=4, width=128, vocab=512, lengths=(64, 96, 128, 160, 192, 224, 256, 288), longest=512, draws=6)
QUICK = Size(layers=2, width=32, vocab=64, lengths=(8, 12, 16, 20, 24, 28, 32, 36), longest=64, draws=2)


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.emb = nn.Embedding(size.vocab, size.width)
        self.pos = nn.Embedding(size.longest, size.width)
        self.blocks = nn.ModuleList(Block(size.width) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, size.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def token_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100)


def build(size: Size, **plan) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = Decoder(size)
    plan = fxpipe.Plan(split=[f"blocks.{size.layers // 2}"], devices=["cpu:0", "cpu:1"], schedule="1f1b", microbatches=MICROBATCHES, frontend="fx", **plan)
    return model, fxpipe.compile(model, plan, example_inputs=(torch.zeros(ROWS, size.lengths[0], dtype=torch.long),), loss_fn=token_mean)


def micro_batches(size: Size, lengths: list[int], g: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ids = [torch.randint(0, size.vocab, (ROWS, n), generator=g) for n in lengths]
    return ids, [torch.randint(0, size.vocab, (ROWS, n), generator=g) for n in lengths]


def eager_step(model: nn.Module, ids: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """The same micro-batches one after another in eager PyTorch, normalised over the step."""
    count = sum(t.numel() for t in targets)
    for x, t in zip(ids, targets):
        (F.cross_entropy(model(x).flatten(0, 1), t.flatten(), reduction="sum") / count).backward()


def varlen_against_equal(size: Size, repeats: int) -> None:
    model, pipe = build(size)
    g = torch.Generator().manual_seed(1)
    mean = sum(size.lengths) // len(size.lengths)
    varied, equal = micro_batches(size, list(size.lengths), g), micro_batches(size, [mean] * MICROBATCHES, g)
    times = interleaved(
        {
            "8 lengths": lambda: pipe.step(microbatches=varied[0], targets=varied[1]),
            "1 length": lambda: pipe.step(microbatches=equal[0], targets=equal[1]),
            "eager 8 lengths": lambda: eager_step(model, *varied),
            "eager 1 length": lambda: eager_step(model, *equal),
        },
        repeats,
        1,
    )
    print(f"  8 lengths {list(size.lengths)}: {times['8 lengths'] * 1e3:7.1f} ms per step")
    print(f"  8 x length {mean} (the same {ROWS * sum(size.lengths)} tokens): {times['1 length'] * 1e3:7.1f} ms per step")
    eager = times["eager 8 lengths"] / times["eager 1 length"]
    print(f"  eager, the same micro-batches one after another: {times['eager 8 lengths'] * 1e3:.1f} / {times['eager 1 length'] * 1e3:.1f} ms = {eager:.2f}x (the work itself)")
    print(f"  varlen / equal: {times['8 lengths'] / times['1 length']:.2f}x (goal <= 1.3)")


def long_tailed(size: Size, g: torch.Generator) -> list[int]:
    """8 lengths, lognormal around 64 tokens with a long tail, clipped to 16..longest."""
    draws = torch.empty(MICROBATCHES).log_normal_(math.log(max(16, size.longest // 8)), 0.8, generator=g)
    return [int(min(size.longest, max(16, round(float(x))))) for x in draws]


def padded(ids: list[torch.Tensor], targets: list[torch.Tensor], longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows right-padded to ``longest`` (causal attention: real tokens never see the pad),
    the targets' pad -100, as one batch that the plan cuts into the same 8 micro-batches."""
    pad = lambda t, v: F.pad(t, (0, longest - t.shape[1]), value=v)  # noqa: E731
    return torch.cat([pad(t, 0) for t in ids]), torch.cat([pad(t, -100) for t in targets])


def one_draw(pipe, size: Size, g: torch.Generator, repeats: int) -> tuple[list[int], dict[str, float], float]:  # noqa: ANN001
    """One long-tailed draw measured listed and padded: (its lengths, median seconds per
    step of each, the two losses' difference)."""
    lengths = long_tailed(size, g)
    ids, targets = micro_batches(size, lengths, g)
    whole, whole_targets = padded(ids, targets, max(lengths))
    losses = {}
    times = interleaved(
        {
            "listed": lambda: losses.__setitem__("listed", pipe.step(microbatches=ids, targets=targets)),
            "padded": lambda: losses.__setitem__("padded", pipe.step(whole, target=whole_targets)),
        },
        repeats,
        1,
    )
    return lengths, times, abs(float(losses["listed"]) - float(losses["padded"]))


def against_padding(size: Size, repeats: int) -> None:
    _, pipe = build(size)
    g = torch.Generator().manual_seed(2)
    listed_time = padded_time = difference = 0.0
    real = computed = 0
    for _ in range(size.draws):
        lengths, times, diff = one_draw(pipe, size, g, repeats)
        listed_time += times["listed"]
        padded_time += times["padded"]
        real += ROWS * sum(lengths)
        computed += ROWS * MICROBATCHES * max(lengths)
        difference = max(difference, diff)
    print(f"  {size.draws} steps of 8 lengths drawn long-tailed (the last: {lengths}):")
    print(f"  listed {listed_time / size.draws * 1e3:7.1f} ms per step, padded to the longest {padded_time / size.draws * 1e3:7.1f} ms per step")
    print(f"  tokens computed: {real} listed, {computed} padded ({computed / real:.2f}x); largest loss difference {difference:.1e}")
    print(f"  speed-up over padding to the longest: {padded_time / listed_time:.2f}x")


def shapes_on_ranks(size: Size, repeats: int) -> dict:
    """On each of 2 ranks: the edge-spec derivation inside steps of new and of seen
    lengths, the message planning of each new combination, and the messages an exchange
    of shapes would add to a step."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    _, pipe = build(size)
    spent: dict[str, list[float]] = {"specs": [], "plans": [], "outputs": []}
    for name, method in (("specs", "_edge_specs"), ("plans", "_plan_messages")):
        setattr(pipe, method, _timed(getattr(pipe, method), spent[name]))
    # the loss's counts: each new input signature's output shapes, from a fake run (last stage's rank)
    pipe._compiler = dataclasses.replace(pipe._compiler, output_like=_timed(pipe._compiler.output_like, spent["outputs"]))
    g = torch.Generator().manual_seed(3)
    steps = []
    for _ in range(repeats):
        ids, targets = micro_batches(size, long_tailed(size, g), g)
        started = time.perf_counter()
        pipe.step(microbatches=ids, targets=targets)  # lengths not seen before (most of them)
        steps.append(time.perf_counter() - started)
        pipe.step(microbatches=ids, targets=targets)  # the same lengths again
    new, seen = spent["specs"][0::2], spent["specs"][1::2]
    signatures = len(pipe._programs_first().specs)
    exchange = _exchange(pipe.rank, repeats)
    edges = len(pipe.stages[0].outputs)
    pipe.close()
    dist.destroy_process_group()
    return {
        "new": sum(new), "seen": statistics.median(seen), "signatures": signatures, "step": statistics.median(steps),
        "exchange": exchange, "edges": edges, "plan": statistics.median(spent["plans"]),
        "outputs": statistics.mean(spent["outputs"]) if spent["outputs"] else 0.0,
    }


def _timed(method, into: list[float]):  # noqa: ANN001, ANN202 - wraps one of the pipeline's own methods
    def timed(*args):  # noqa: ANN002, ANN202
        started = time.perf_counter()
        out = method(*args)
        into.append(time.perf_counter() - started)
        return out

    return timed


def _exchange(rank: int, repeats: int) -> float:
    """Median seconds for rank 0 to send rank 1 eight micro-batches' shapes, one message each."""
    import torch.distributed as dist

    shape = torch.zeros(3, dtype=torch.int64)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(MICROBATCHES):
            dist.send(shape, 1) if rank == 0 else dist.recv(shape, 0)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def report_ranks(results: list[dict]) -> None:
    receiver = results[1]
    per = receiver["new"] / max(1, receiver["signatures"])
    print(f"  derived: {receiver['signatures']} input signatures in {receiver['new'] * 1e3:.1f} ms of fake runs, {per * 1e3:.2f} ms each, once per signature")
    print(f"  a step whose lengths were seen: {receiver['seen'] * 1e6:.0f} µs to look its 8 micro-batches' shapes up")
    print(f"  a new combination of lengths: its messages planned in {receiver['plan'] * 1e6:.0f} µs (median)")
    print(f"  the loss's counts (the last stage's rank): each new signature's output shapes in {receiver['outputs'] * 1e3:.2f} ms (a fake run of the model), once")
    print(f"  exchanged instead: {receiver['exchange'] * 1e6:.0f} µs per step for {MICROBATCHES} messages x {receiver['edges']} edge(s), every step")
    print(f"  a step on 2 ranks: {receiver['step'] * 1e3:.1f} ms (median, new lengths)")
    print(f"  edge shapes: derive {per * 1e3:.2f} ms per new signature, look up {receiver['seen'] * 1e6:.0f} µs per step, exchange {receiver['exchange'] * 1e6:.0f} µs per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a tiny decoder and 2 repeats: a check that it runs")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    size, repeats = (QUICK, 2) if args.quick else (FULL, args.repeats)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; decoder {size.layers} layers, width {size.width}, "
        f"2 stages, 1F1B, {MICROBATCHES} micro-batches of {ROWS} rows"
    )
    print("varlen against equal lengths:")
    varlen_against_equal(size, repeats)
    print("against padding:")
    against_padding(size, repeats)
    print("shapes on 2 gloo ranks:")
    report_ranks(launch(shapes_on_ranks, 2, (size, repeats), timeout=600))


if __name__ == "__main__":
    main()
