"""Heterogeneous placement around memory: a model too big for the declared GPU's memory.

A ``TokenTransformer`` (a 20,000 x 128 token table, 2.6M parameters and almost no FLOPs,
then four transformer blocks over 256-token sequences, mean-pooled into 10 classes)
trained with Adam, batch 32, 1F1B, 8 micro-batches, cut into two stages at ``blocks.2``
(the table and two blocks, then two blocks and the head). The accelerator is declared
with ``DeviceSpec(memory=...)``: by default 95 MB, less than the model's parameters,
gradients, Adam's two moments and in-flight activations (about 104 MB) when both stages
sit on it and keep every activation. The options, each a ``Plan``:

  all on the GPU      both stages on the accelerator, every activation kept: does not fit
  host embedding      the table on the host by its device_guard tags (the seed's recipe);
                      the blocks on the accelerator
  offload             both stages on the accelerator; saved activations wait in host
                      memory until their backward (Plan(offload=True), CUDA only)
  recompute           both stages on the accelerator; Plan(checkpoint=True)
  planner             both stages on the accelerator; Plan(checkpoint="auto",
                      offload="auto"): per stage, the fastest predicted choice that fits
  planner, no offload the same with checkpoint="auto" only (what runs without CUDA)

For each option it prints, and plots, what the cost model predicts for the declared devices
(``fxpipe.partition`` on a host "cpu" and a "cuda:0": nothing needs the hardware): the step
time, and the bytes the accelerator must hold (``fxpipe.planner.memory_plan.device_needs``: its
stages' state with Adam's moments, plus its activations at their peak from each stage's
memory profile walked through the schedule). Then it runs every option it can for real and
measures the same bytes (``pipe.memory()``: the step's activation peak on the device, plus
the stages' parameters, gradients, buffers, and two Adam moments per parameter) and the
step time. Without CUDA the accelerator is the logical device ``cpu:1`` (the host
``cpu:0``), so measured times are the CPU's, not the declared GPU's, and offload (which
moves CUDA memory) is predicted only.

    .venv/bin/python examples/heterogeneous_placement.py [--accelerator-memory 95e6]
        [--plot docs/img/heterogeneous-placement.png] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import limit_threads, random_tokens, synchronize
from torch import nn

import fxpipe
from fxpipe.inspection import format as fmt
from fxpipe.planner.memory_plan import device_needs

HOST, GPU = "cpu", "cuda:0"  # the declared devices
ADAM_STATES = 2
KEEPS = {False: "keep", True: "recompute", "selective": "selective"}  # a stage's checkpoint choice, in words


class Block(nn.Module):
    """A pre-norm transformer block: attention and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TokenTransformer(nn.Module):
    """A large token table (most of the parameters, few FLOPs) feeding transformer blocks
    (most of the FLOPs and activations). ``device_guard`` keeps the table on the host and
    tags the blocks for the first accelerator ("gpu:0", Paddle's alias of "cuda:0")."""

    def __init__(self, vocab: int = 20_000, width: int = 128, depth: int = 4, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with fxpipe.device_guard("cpu"):
            x = self.embed(tokens)
        with fxpipe.device_guard("gpu:0"):
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(dim=1))


@dataclass
class Option:
    """One placement or memory choice: the plan (on the declared devices), what the cost
    model predicts, and what a run measured (None where it could not run here)."""

    name: str
    plan: fxpipe.Plan
    predicted_step: float = 0.0
    predicted_memory: float = 0.0  # bytes the accelerator must hold
    keeps: str = ""
    measured_step: float | None = None
    measured_memory: float | None = None


def options(split: str, microbatches: int, specs: dict) -> list[Option]:
    base = dict(schedule="1f1b", microbatches=microbatches, device_specs=specs)
    on_gpu = dict(devices=[GPU, GPU], split=[split], **base)
    return [
        Option("all on the GPU", fxpipe.Plan(**on_gpu)),
        Option("host embedding", fxpipe.Plan(devices=[HOST, GPU], split="tags", **base)),
        Option("offload", fxpipe.Plan(**on_gpu, offload=True)),
        Option("recompute", fxpipe.Plan(**on_gpu, checkpoint=True)),
        Option("planner", fxpipe.Plan(**on_gpu, checkpoint="auto", offload="auto")),
        Option("planner, no offload", fxpipe.Plan(**on_gpu, checkpoint="auto")),
    ]


def predict(option: Option, model: nn.Module, x: torch.Tensor) -> fxpipe.Partitioned:
    """The option's partition on the declared devices, with its step and accelerator memory."""
    part = fxpipe.partition(model, option.plan, example_inputs=(x,))
    choices = part.choices()
    option.predicted_step = part.simulate(choices=choices).step_time
    option.predicted_memory = device_needs(part, choices).get(GPU, 0.0)
    option.keeps = ", ".join(KEEPS[s.recompute] if not s.offload else "offload" for s in part.stages)
    return part


def measure(option: Option, part: fxpipe.Partitioned, model: nn.Module, x: torch.Tensor, target: torch.Tensor, repeats: int) -> None:
    """Run the option's split and choices on this machine's devices (the declared ones
    with CUDA, logical CPUs without) and measure the accelerator's bytes and the step."""
    plan, placed = option.plan, {HOST: HOST, GPU: GPU}
    if not torch.cuda.is_available():
        if any(s.offload for s in part.stages):
            return
        # the same split and choices on logical CPU devices standing for the declared ones
        placed = {HOST: "cpu:0", GPU: "cpu:1"}
        plan = plan.replace(devices=[placed[d] for d in part.devices], checkpoint=[s.recompute for s in part.stages], offload=False, device_specs={})
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    steps = []
    for _ in range(repeats + 1):
        synchronize()
        start = time.perf_counter()
        pipe.step(x, target=target)
        synchronize()
        steps.append(time.perf_counter() - start)
        pipe.zero_grad()
    report = pipe.memory()
    on_gpu = [r for r in report if r.device == placed[GPU]]
    together = {d.device: d.activations_peak for d in report.devices}
    state = sum(r.parameters * (1 + ADAM_STATES) + r.gradients + r.buffers for r in on_gpu)
    option.measured_memory = state + together.get(placed[GPU], 0)
    option.measured_step = statistics.median(steps[1:])


def plot(results: Sequence[Option], budget: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    where = list(range(len(results)))
    fits = ["C0" if o.predicted_memory <= budget else "grey" for o in results]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 5.4))
    ax_time.bar(where, [o.predicted_step * 1e3 for o in results], color=fits)
    ax_time.set_ylabel("predicted step on the declared devices (ms)")
    ax_time.set_title("time (grey: does not fit)", fontsize=9)
    for k, o in enumerate(results):
        ax_time.annotate(o.keeps, (k, o.predicted_step * 1e3), ha="center", va="bottom", fontsize=7)
    ax_mem.bar([k - 0.2 for k in where], [o.predicted_memory / 1e6 for o in results], width=0.4, color=fits)
    ax_mem.bar([k + 0.2 for k in where], [(o.measured_memory or 0) / 1e6 for o in results], width=0.4, color="C1")
    for k, o in enumerate(results):
        if o.measured_memory is None:
            ax_mem.annotate("measured\non CUDA\nonly", (k + 0.2, budget * 0.02 / 1e6), ha="center", va="bottom", fontsize=7, color="C1")
    ax_mem.axhline(budget / 1e6, color="red", linestyle="--", linewidth=1)
    ax_mem.annotate(f"{GPU}: {budget / 1e6:.0f} MB", (-0.45, budget / 1e6), color="red", ha="left", va="bottom", fontsize=8)
    ax_mem.set_ylabel(f"bytes {GPU} must hold (MB)")
    ax_mem.set_title("memory: state with Adam's moments + activations at their peak", fontsize=9)
    handles = [matplotlib.patches.Patch(color=c, label=t) for c, t in (("C0", "predicted"), ("grey", "predicted, does not fit"), ("C1", "measured"))]
    ax_mem.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8)
    for ax in (ax_time, ax_mem):
        ax.set_xticks(where, [o.name.replace(" the", "\nthe").replace(" embedding", "\nembedding").replace(", ", ",\n") for o in results], fontsize=8)
    fig.suptitle("TokenTransformer on a host and a small GPU: placement, offload, recompute and the planner's choice", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Option]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator-memory", type=float, default=95e6, help=f"the declared {GPU}'s memory in bytes")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=256, help="tokens per sample")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per option (the median is reported)")
    parser.add_argument("--plot", help="write the table as a picture to this PNG")
    parser.add_argument("--smoke", action="store_true", help="a small model and batch (for tests)")
    args = parser.parse_args(argv)
    limit_threads()
    torch.manual_seed(0)
    vocab, width = (2_000, 32) if args.smoke else (20_000, 128)
    if args.smoke:
        args.batch, args.length, args.repeats, args.accelerator_memory = 16, 64, 1, 3.2e6
    model = TokenTransformer(vocab=vocab, width=width)
    x, target = random_tokens(args.batch, args.length, vocab)
    specs = {
        HOST: fxpipe.DeviceSpec(flops=2e11, memory=256e9, bandwidth=25e9),
        GPU: fxpipe.DeviceSpec(flops=20e12, memory=args.accelerator_memory, bandwidth=25e9),
    }
    print(
        f"TokenTransformer: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({model.embed.weight.numel() / 1e6:.1f}M in the table); batch {args.batch} x {args.length} tokens, "
        f"{args.microbatches} micro-batches, 1F1B, Adam; declared {HOST} and {GPU} with {fmt.nbytes(args.accelerator_memory)}\n"
    )
    results = options("blocks.2", args.microbatches, specs)
    for option in results:
        part = predict(option, model, x)
        measure(option, part, model, x, target, args.repeats)
    print(f"{'option':<19} {'keeps (per stage)':<22} {'step pred':>10} {f'{GPU} pred':>12} {'fits':>5} {'step meas':>10} {f'{GPU} meas':>12}")
    for o in results:
        fits = "yes" if o.predicted_memory <= args.accelerator_memory else "NO"
        step = fmt.seconds(o.measured_step) if o.measured_step is not None else "—"
        memory = fmt.nbytes(o.measured_memory) if o.measured_memory is not None else "— (CUDA)"
        print(f"{o.name:<19} {o.keeps:<22} {fmt.seconds(o.predicted_step):>10} {fmt.nbytes(o.predicted_memory):>12} {fits:>5} {step:>10} {memory:>12}")
    if args.plot:
        plot(results, args.accelerator_memory, args.plot)
        print(f"\nwrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
