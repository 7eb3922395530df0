"""A torchtitan-style Llama 3: fxpipe against torchtitan's manual split on TDP's schedules.

The model is written here the way torchtitan writes it (no torchtitan dependency):
RMSNorm, rotary embeddings from a ``freqs`` buffer of the top module, grouped-query
attention (scaled_dot_product_attention), a SwiGLU feed-forward, and a Transformer of
``tok_embeddings``, ``layers`` (a ModuleDict keyed "0".."n-1"), ``norm`` and ``output``
whose forward skips the parts a stage deleted. The debug configuration: dim 256, 16 heads
(8 key/value heads), vocab 2048.

torchtitan's manual split, per rank and per stage it holds: deep-copy the model, delete
the layers outside the stage (and the embedding, norm and output where the stage has
none), wrap what is left in torch.distributed.pipelining's ``PipelineStage``.

Two ranks under ``python -m fxpipe.distributed -n 2`` (the script starts them itself),
gloo, one thread each; fxpipe and TDP alternate in the same processes:
  setup        seconds per rank to build the pipeline of an already built model, at
               16/48/96 layers, 2 stages: fxpipe.compile against the manual split
  step time    the median step of fxpipe's 1f1b, interleaved-1f1b, zb-v and dualpipev
               against TDP's Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
               and ScheduleDualPipeV on the same stages (2 stages, or 4 for chunks=2)
  memory       per step over --memory-steps steps after warm-up: resident (RssAnon) growth,
               Python objects and tensors left alive; and the tensors kept between steps
               that are not parameters, gradients or buffers (summed over the ranks)
Before timing, one step of each fxpipe schedule is checked against the same TDP schedule:
the loss and every gradient (float32; the largest difference is printed).

    .venv/bin/python examples/benchmarks/titan.py [--layers 8] [--microbatches 8]
        [--setup-layers 16 48 96] [--rounds 3] [--steps 6] [--memory-steps 20]
        [--plot docs/img/titan.png] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import fxpipe

sys.path.insert(0, str(Path(__file__).parent))
from distributed import PeakAnonMemory  # noqa: E402 - the benchmarks beside this file
from zero_bubble import timed  # noqa: E402

SCHEDULES = {  # fxpipe's schedule: (chunks, TDP's schedule class)
    "1f1b": (1, "Schedule1F1B"),
    "interleaved-1f1b": (2, "ScheduleInterleaved1F1B"),
    "zb-v": (2, "ScheduleZBVZeroBubble"),
    "dualpipev": (2, "ScheduleDualPipeV"),
}


# ------------------------------------------------------------------- the model
@dataclasses.dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = 2048
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 128


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_frequencies(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos and sin of every position's rotation angles, stacked: (2, seq_len, head_dim / 2)."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inverse)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotates each (even, odd) pair of x's last dimension (batch, seq, heads, head_dim)."""
    cos, sin = freqs[0, : x.shape[1], None, :], freqs[1, : x.shape[1], None, :]
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), freqs)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), freqs)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        repeats = self.n_heads // self.n_kv_heads  # grouped-query attention: each key/value head serves several queries
        k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = int(2 * 4 * args.dim / 3)
        hidden = args.multiple_of * math.ceil(hidden / args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(args.dim, args.norm_eps), RMSNorm(args.dim, args.norm_eps)
        self.attention, self.feed_forward = Attention(args), FeedForward(args)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama 3; a stage of the manual split has some parts set to None."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs", rope_frequencies(args.dim // args.n_heads, args.max_seq_len, args.rope_theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(layers: int, batch: int, seq: int) -> tuple[Transformer, torch.Tensor, torch.Tensor]:
    """The model (seeded: alike on every rank), its tokens and targets."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=layers, max_seq_len=seq))
    tokens = torch.randint(0, 2048, (batch, seq + 1))
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ------------------------------------------------------ the two ways to stage it
def stage_layers(layers: int, stages: int) -> list[range]:
    per = layers // stages
    if per * stages != layers:
        raise ValueError(f"{layers} layers do not split into {stages} equal stages")
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def rank_stages(rank: int, ranks: int, chunks: int, v: bool) -> list[int]:
    """The stages a rank holds: one, two in a loop (interleaved) or two in a V."""
    if chunks == 1:
        return [rank]
    return [rank, 2 * ranks - 1 - rank] if v else [rank, rank + ranks]


def manual_stage(model: Transformer, keep: range, stages: int, index: int) -> Transformer:
    """torchtitan's split: a deep copy without the layers (and ends) outside the stage."""
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if int(name) not in keep:
            del part.layers[name]
    if index > 0:
        part.tok_embeddings = None
    if index < stages - 1:
        part.norm, part.output = None, None
    return part


def tdp_pipeline(model: Transformer, schedule: str, m: int) -> tuple[Callable[[], object], list[nn.Module]]:
    """The manual split on this rank and TDP's schedule over it: (schedule, stage modules)."""
    from torch.distributed import pipelining

    chunks, name = SCHEDULES[schedule]
    rank, ranks = dist.get_rank(), dist.get_world_size()
    n = ranks * chunks
    ranges = stage_layers(len(model.layers), n)
    mine = rank_stages(rank, ranks, chunks, schedule in ("zb-v", "dualpipev"))
    modules = [manual_stage(model, ranges[s], n, s) for s in mine]
    stages = [pipelining.PipelineStage(mod, s, n, torch.device("cpu")) for mod, s in zip(modules, mine, strict=True)]
    for stage in stages:
        # the V's turn (stages p-1 and p) is on one rank: gloo cannot send to itself
        ops = stage._get_init_p2p_neighbors_ops
        stage._get_init_p2p_neighbors_ops = lambda ops=ops: [op for op in ops() if op.peer != rank]
    run = getattr(pipelining, name)(stages if chunks > 1 else stages[0], n_microbatches=m, loss_fn=lm_loss)
    return run, modules


def tdp_step(run: object, x: torch.Tensor, t: torch.Tensor) -> tuple[Callable[[], object], list[torch.Tensor] | None]:
    """One step of TDP's schedule, and the list its micro-batch losses go to on the rank of
    the last stage (None elsewhere): rank 0 feeds the first stage, that rank the target."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    v = type(run).__name__ in (SCHEDULES["zb-v"][1], SCHEDULES["dualpipev"][1])
    losses: list[torch.Tensor] | None = [] if rank == (0 if v else ranks - 1) else None
    given = {"target": t, "losses": losses} if losses is not None else {}

    def step() -> None:
        if losses:
            losses.clear()
        run.step(x, **given) if rank == 0 else run.step(**given)

    return step, losses


def fxpipe_pipeline(model: Transformer, schedule: str, m: int, x: torch.Tensor) -> object:
    """fxpipe.compile of the whole model, cut at the same layers as the manual split."""
    chunks, _ = SCHEDULES[schedule]
    ranks = dist.get_world_size()
    ranges = stage_layers(len(model.layers), ranks * chunks)
    plan = fxpipe.Plan(
        devices=[f"cpu:{r}" for r in range(ranks)], split=[f"layers.{r.start}" for r in ranges[1:]],
        schedule=schedule, chunks=chunks, microbatches=m,
    )
    return fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=lm_loss)


# ------------------------------------------------------------------ measurements
def slowest(value: float) -> float:
    """The largest of every rank's value (a pipeline is ready when its slowest rank is)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def setup_seconds(layers: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Wall and CPU seconds per rank (the slowest rank) to stage a built model, both ways."""
    model, x, _ = build(layers, args.batch, args.seq)
    out = {}
    for name, make in (("fxpipe", lambda: fxpipe_pipeline(model, "1f1b", args.microbatches, x)), ("manual", lambda: tdp_pipeline(model, "1f1b", args.microbatches))):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        made = make()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out[name] = (slowest(wall), slowest(cpu))
        if name == "fxpipe":
            made.close()
        del made
        gc.collect()
    return out


def storages() -> dict[int, int]:
    """Every live CPU tensor's storage: data pointer -> bytes."""
    gc.collect()
    found = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu" and not isinstance(o, FakeTensor):  # type(): some objects' __class__ warns
            found[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    return found


def owned(params: list[nn.Parameter], buffers: list[torch.Tensor]) -> set[int]:
    """The storages of the parameters, their gradients and the buffers."""
    tensors = params + buffers + [p.grad for p in params if p.grad is not None]
    return {t.untyped_storage().data_ptr() for t in tensors}


def growth(step: Callable[[], object], state: Callable[[], set[int]], before: set[int], steps: int) -> dict[str, float]:
    """Per step: resident (RssAnon) MiB, Python objects and tensors left alive; and the MiB
    of tensors kept between steps that are not parameters, gradients or buffers (nor alive
    before the pipeline was built)."""
    gc.collect()
    objects, tensors, rss = len(gc.get_objects()), len(storages()), PeakAnonMemory.now()
    for _ in range(steps):
        step()
    rss = PeakAnonMemory.now() - rss
    alive = storages()
    kept = sum(n for k, n in alive.items() if k not in before and k not in state())
    return {"rss": rss / steps, "objects": (len(gc.get_objects()) - objects) / steps, "tensors": (len(alive) - tensors) / steps, "kept": kept / 2**20}


@dataclasses.dataclass
class Run:
    """One pipeline's run: its first step's loss and gradients, step times, memory."""

    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    times: list[float]
    memory: dict[str, float] | None


def measure(step: Callable[[], object], loss: Callable[[], torch.Tensor | None], grads: Callable[[], dict], state: Callable[[], set[int]], before: set[int], args: argparse.Namespace, first: bool) -> Run:
    """One step (its loss and gradients kept on the first round), the timed steps, then on
    the first round the memory over --memory-steps more."""
    step()
    seen = (loss(), {n: g.clone() for n, g in grads().items()}) if first else (None, {})
    before = before | {g.untyped_storage().data_ptr() for g in seen[1].values()}  # the copies are the benchmark's
    times = timed(step, args.steps, args.warmup)
    return Run(*seen, times, total(growth(step, state, before, args.memory_steps)) if first else None)


def run_both(schedule: str, args: argparse.Namespace, first: bool) -> dict[str, Run]:
    """fxpipe's schedule, then TDP's, in this process, each on a fresh model (see measure)."""
    model, x, t = build(args.layers, args.batch, args.seq)
    before = set(storages())
    pipe = fxpipe_pipeline(model, schedule, args.microbatches, x)
    last: list[torch.Tensor] = []

    def ours() -> None:
        last[:] = [pipe.step(x, target=t).detach()]

    params = functools.partial(lambda pipe: [p for _, p in pipe.named_parameters()], pipe)
    state = functools.partial(lambda pipe: owned(params(), list(pipe.state_dict().values())), pipe)
    grads = functools.partial(lambda: {n: p.grad for n, p in pipe.named_parameters()})
    found = {"fxpipe": measure(ours, lambda: last[0] if pipe.is_last else None, grads, state, before, args, first)}
    pipe.close()
    pipe = params = state = grads = None  # TDP's run below starts without fxpipe's pipeline alive
    model, x, t = build(args.layers, args.batch, args.seq)
    before = set(storages())
    run, modules = tdp_pipeline(model, schedule, args.microbatches)
    step, losses = tdp_step(run, x, t)
    state = functools.partial(lambda mods: owned([p for m in mods for p in m.parameters()], [b for m in mods for b in m.buffers()]), modules)
    grads = functools.partial(lambda mods: {n: p.grad for m in mods for n, p in m.named_parameters()}, modules)
    found["tdp"] = measure(step, lambda: torch.stack(losses).mean().detach() if losses is not None else None, grads, state, before, args, first)
    run = modules = state = grads = None
    gc.collect()
    return found


def difference(ours: Run, theirs: Run) -> tuple[float, float]:
    """The largest |loss difference| and |gradient difference| over the ranks."""
    if set(ours.grads) != set(theirs.grads):
        raise AssertionError(f"rank {dist.get_rank()}: {sorted(set(ours.grads) ^ set(theirs.grads))} held by one side only")
    worst = max(float((g - theirs.grads[n]).abs().max()) for n, g in ours.grads.items())
    loss = float((ours.loss - theirs.loss).abs()) if ours.loss is not None else 0.0
    return slowest(loss), slowest(worst)


def ratio_line(label: str, ours: float, theirs: float, unit: str, scale: float = 1.0) -> str:
    shown = f"{ours / theirs:.2f}x" if theirs else "n/a"
    return f"  {label:42} {ours * scale:10.3f} {theirs * scale:10.3f} {unit:3} {shown:>8}"


def total(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over the ranks."""
    t = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(values, t.tolist(), strict=True))


def say(*lines: str) -> None:
    if dist.get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def measure_setup(args: argparse.Namespace) -> dict[int, dict[str, tuple[float, float]]]:
    say("\nsetup per rank (slowest rank), 2 stages: fxpipe.compile against the manual split (deepcopy, delete, PipelineStage, schedule)")
    say(f"  {'layers':>6} {'fxpipe wall':>12} {'cpu':>7} {'manual wall':>12} {'cpu':>7} {'fxpipe/manual':>14}")
    found = {}
    for layers in args.setup_layers:
        found[layers] = got = setup_seconds(layers, args)
        (fw, fc), (mw, mc) = got["fxpipe"], got["manual"]
        say(f"  {layers:6} {fw:11.2f}s {fc:6.2f}s {mw:11.3f}s {mc:6.3f}s {fw / mw:13.1f}x")
    first, last = min(found), max(found)
    say(f"  fxpipe {last} layers / {first} layers: {found[last]['fxpipe'][0] / found[first]['fxpipe'][0]:.2f}x;"
        f" manual: {found[last]['manual'][0] / found[first]['manual'][0]:.2f}x")
    return found


def measure_runs(args: argparse.Namespace) -> dict[str, list[dict[str, Run]]]:
    """Every schedule, fxpipe then TDP, in alternating rounds."""
    found: dict[str, list[dict[str, Run]]] = {s: [] for s in SCHEDULES}
    for k in range(args.rounds):
        for schedule in SCHEDULES:
            found[schedule].append(run_both(schedule, args, k == 0))
    return found


def report_gradients(runs: dict[str, list[dict[str, Run]]]) -> None:
    say("\nfxpipe against TDP, the first step on the same stages (float32): largest |loss difference|, |gradient difference|")
    for schedule, rounds in runs.items():
        loss, grad = difference(rounds[0]["fxpipe"], rounds[0]["tdp"])
        say(f"  {schedule:18} loss {loss:.1e}  grads {grad:.1e}")
        if grad > 1e-4 or loss > 1e-5:
            raise AssertionError(f"{schedule}: fxpipe's step differs from TDP's (loss {loss:.1e}, gradients {grad:.1e})")


def report_steps(runs: dict[str, list[dict[str, Run]]], args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    say(f"\nstep time, {args.layers} layers, batch {args.batch} x {args.seq} tokens, {args.microbatches} micro-batches; "
        f"{args.rounds} alternating round(s) of {args.steps} steps after {args.warmup} warm-up (median, ms)")
    say(f"  {'fxpipe / TDP':42} {'fxpipe':>10} {'TDP':>10} {'':3} {'ratio':>8}")
    found = {}
    for schedule, rounds in runs.items():
        found[schedule] = ours, theirs = tuple(statistics.median(t for r in rounds for t in r[w].times) for w in ("fxpipe", "tdp"))
        say(ratio_line(f"{schedule} / {SCHEDULES[schedule][1]}", ours, theirs, "ms", 1e3))
    return found


def report_memory(runs: dict[str, list[dict[str, Run]]], args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    say(f"\nper step over {args.memory_steps} steps after the timed ones (first round), summed over the ranks: resident growth,\n"
        "Python objects and tensors left alive; kept: MiB of tensors alive between steps beyond parameters, gradients, buffers")
    say(f"  {'':42} {'fxpipe':>10} {'TDP':>10} {'':3} {'ratio':>8}")
    found = {}
    for schedule, rounds in runs.items():
        found[schedule] = got = {w: rounds[0][w].memory for w in ("fxpipe", "tdp")}
        for key, unit in (("rss", "MiB"), ("objects", "obj"), ("tensors", "t"), ("kept", "MiB")):
            say(ratio_line(f"{schedule} {key}", got["fxpipe"][key], got["tdp"][key], unit))
    return found


def plot(path: str, setup: dict, steps: dict, memory: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(steps)
    a.bar(names, [steps[s][0] / steps[s][1] for s in names], color="tab:blue")
    a.axhline(1.0, color="black", lw=1, ls="--")
    a.set(title="step time, fxpipe / TDP (lower is better)", ylabel="ratio")
    layers = sorted(setup)
    for who, colour in (("fxpipe", "tab:blue"), ("manual", "tab:orange")):
        b.plot(layers, [setup[n][who][0] for n in layers], "o-", color=colour, label="fxpipe.compile" if who == "fxpipe" else "manual split + PipelineStage")
    b.set(title="setup per rank", xlabel="layers", ylabel="seconds", xticks=layers, yscale="log")
    b.legend()
    width = 0.38
    xs = range(len(names))
    for k, (who, colour) in enumerate((("fxpipe", "tab:blue"), ("tdp", "tab:orange"))):
        c.bar([x + (k - 0.5) * width for x in xs], [memory[s][who]["kept"] for s in names], width, color=colour, label="fxpipe" if who == "fxpipe" else "TDP")
    c.set(title="tensors kept between steps (2 ranks)", ylabel="MiB", xticks=list(xs), xticklabels=names)
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="layers of the model timed (a multiple of 4)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--setup-layers", nargs="+", type=int, default=[16, 48, 96])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every schedule")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=20)
    parser.add_argument("--plot", help="write the figures' PNG here")
    parser.add_argument("--quick", action="store_true", help="4 layers, batch 8 x 16, m=4, setup at 4/8 layers, one round of 2 steps: a check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.batch, args.seq, args.microbatches, args.setup_layers = 4, 8, 16, 4, [4, 8]
        args.rounds, args.steps, args.warmup, args.memory_steps = 1, 2, 1, 2
    return args


def main() -> None:
    args = arguments()
    if "RANK" not in os.environ:  # start the two ranks, each running this script
        sys.exit(subprocess.call([sys.executable, "-m", "fxpipe.distributed", "-n", "2", __file__, *sys.argv[1:]]))
    dist.init_process_group("gloo")
    say(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; "
        f"{dist.get_world_size()} ranks x {torch.get_num_threads()} thread (gloo); torchtitan-style Llama 3 debug model "
        "(dim 256, 16 heads, 8 kv heads, vocab 2048)")
    runs = measure_runs(args)
    report_gradients(runs)
    setup = measure_setup(args)
    steps = report_steps(runs, args)
    memory = report_memory(runs, args)
    if args.plot and dist.get_rank() == 0:
        plot(args.plot, setup, steps, memory)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
