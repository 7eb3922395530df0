"""Heterogeneous placement: an embedding-heavy model on one device, split by tag, split="auto".

An ``EmbeddingClassifier`` (a 200,000 x 64 token table, 12.8M parameters and almost no
FLOPs, feeding a 3-layer MLP with most of the FLOPs) is trained with Adam under three
placements over a host and an accelerator:
  one device   everything on the accelerator
  tags         ``device_guard("cpu")`` keeps the table on the host, ``device_guard("gpu:0")``
               puts the MLP on the accelerator (split="tags")
  auto         the cost model picks the cut (split="auto") over the same two devices
The accelerator is given a memory budget (``DeviceSpec(memory=...)``, default 100 MB,
less than the table with its gradient and Adam's two moments), so the cost model must
keep the table off it. For every placement and stage the example prints, and plots, the
cost model's prediction next to the measurement:
  time     seconds the stage computes in one step (forward + backward of all
           micro-batches): predicted by ``simulate()``, measured from ``pipe.timeline()``
  memory   predicted by the cost model (parameters, gradients, optimizer state, and one
           micro-batch's activations times the micro-batches in flight); measured by
           counting the tensors the stage holds after a real step (parameters, .grad,
           Adam's state) plus the activations autograd saved for one micro-batch (counted
           with saved-tensor hooks) times the peak micro-batches in flight in the measured
           timeline. On CUDA the allocator's peak per GPU is printed too.
Without CUDA the accelerator is the logical device ``cpu:1`` and the host ``cpu:0`` (both
run on this machine's CPU); with CUDA they are ``cuda:0`` and ``cpu``.

    .venv/bin/python examples/heterogeneous_placement.py [--plot docs/img/heterogeneous-placement.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from common import (
    EmbeddingClassifier,
    fallback_devices,
    gpu_count,
    limit_threads,
    random_tokens,
    synchronize,
)
from torch import nn

import fxpipe
from fxpipe.cost_model import default_spec

TAGS = ["cpu", "gpu:0"]  # EmbeddingClassifier's device_guard tags, in stage order


@dataclass
class StageResult:
    placement: str
    stage: int
    device: str
    predicted_time: float
    measured_time: float
    predicted_memory: float
    measured_memory: float
    modules: str = ""
    allocator_peak: float | None = None


@dataclass
class PlacementResult:
    name: str
    predicted_step: float
    measured_step: float
    stages: list[StageResult]


class SavedActivations:
    """Counts the bytes autograd saves for backward in each forward of a stage module
    (parameters excluded), with saved-tensor hooks pushed inside the module's own forward,
    so in the worker thread that runs it."""

    def __init__(self, module: nn.Module) -> None:
        self.per_forward: list[int] = []
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._hooks = None
        self._seen: set[int] = set()
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._params and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.per_forward[-1] += storage.nbytes()
        return t

    def _start(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self.per_forward.append(0)
            self._seen = set()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._hooks.__enter__()

    def _stop(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the stage's parameters, their gradients, the optimizer's state for them, and buffers."""
    total = sum(b.nbytes for b in module.buffers())
    for p in module.parameters():
        total += p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
        total += sum(v.nbytes for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return total


def measure(name: str, model: nn.Module, plan: fxpipe.Plan, x: torch.Tensor, target: torch.Tensor, repeats: int) -> PlacementResult:
    part = fxpipe.partition(model, plan, example_inputs=(x,))
    predicted = part.simulate()
    estimates = part.estimates()
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    counters = [SavedActivations(s.module) for s in pipe.stages]
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    for i in range(gpu_count()):
        torch.cuda.reset_peak_memory_stats(i)
    steps, timelines = [], []
    for k in range(repeats + 1):
        opt.zero_grad(set_to_none=False)
        synchronize()
        start = time.perf_counter()
        pipe.step(x, target=target)
        synchronize()
        if k:  # the first step warms up (and creates Adam's state)
            steps.append(time.perf_counter() - start)
            timelines.append(pipe.timeline())
        opt.step()
    fastest = min(range(repeats), key=lambda i: steps[i])
    measured = timelines[fastest]
    in_flight = measured.peak_in_flight()
    stages = []
    for s, est, counter in zip(pipe.stages, estimates, counters):
        activations = statistics.mean(counter.per_forward) if counter.per_forward else 0.0
        peak = None
        if s.device.startswith("cuda"):
            peak = float(torch.cuda.max_memory_allocated(torch.device(s.device)))
        stages.append(
            StageResult(
                name, s.index, s.device,
                predicted_time=predicted.busy_time(s.index), measured_time=measured.busy_time(s.index),
                predicted_memory=est.memory,
                measured_memory=state_bytes(s.module, opt) + in_flight.get(s.index, 0) * activations,
                modules=s.module_range, allocator_peak=peak,
            )
        )
    return PlacementResult(name, predicted.step_time, steps[fastest], stages)


def plot(results: list[PlacementResult], limit: float, accelerator: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for r in results for s in r.stages]
    labels = [f"{s.placement}\nstage {s.stage}\n{s.device}" for s in rows]
    where = range(len(rows))
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, pred, meas, scale, unit in (
        (ax_time, [s.predicted_time for s in rows], [s.measured_time for s in rows], 1e3, "compute time per step (ms)"),
        (ax_mem, [s.predicted_memory for s in rows], [s.measured_memory for s in rows], 1e-6, "memory (MB)"),
    ):
        ax.bar([i - 0.2 for i in where], [v * scale for v in pred], width=0.4, label="predicted", color="C0")
        ax.bar([i + 0.2 for i in where], [v * scale for v in meas], width=0.4, label="measured", color="C1")
        ax.set_xticks(list(where), labels, fontsize=8)
        ax.set_ylabel(unit)
        ax.legend(loc="upper right")
    ax_mem.axhline(limit * 1e-6, color="red", linestyle="--", linewidth=1)
    ax_mem.annotate(f"{accelerator} budget", (len(rows) - 0.5, limit * 1e-6), color="red", ha="right", va="bottom", fontsize=8)
    steps = ", ".join(f"{r.name} {r.measured_step * 1e3:.0f} ms (predicted {r.predicted_step * 1e3:.0f})" for r in results)
    fig.suptitle(f"EmbeddingClassifier per stage, predicted vs measured. Step: {steps}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[PlacementResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=32, help="tokens per sample")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--accelerator-memory", type=float, default=100e6, help="the accelerator's memory budget in bytes")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per placement (the fastest is reported)")
    parser.add_argument("--plot", help="write the predicted-vs-measured bar charts to this PNG")
    parser.add_argument("--smoke", action="store_true", help="a small table and batch (for tests)")
    args = parser.parse_args(argv)
    limit_threads()
    torch.manual_seed(0)
    if args.smoke:
        args.vocab, args.batch, args.length, args.repeats, args.accelerator_memory = 20_000, 32, 8, 1, 10e6
    model = EmbeddingClassifier(vocab=args.vocab, hidden=256 if args.smoke else 1024)
    x, target = random_tokens(args.batch, args.length, args.vocab)
    host, accelerator = fallback_devices(TAGS) or ["cpu", "cuda:0"]
    # the accelerator as the cost model sees it by default, with a smaller memory budget
    specs = {accelerator: dataclasses.replace(default_spec(accelerator), memory=args.accelerator_memory)}
    base = dict(schedule="1f1b", microbatches=args.microbatches, device_specs=specs)
    plans = {
        "one device": fxpipe.Plan(devices=[accelerator], split=[], **base),
        "tags": fxpipe.Plan(devices=fallback_devices(TAGS), split="tags", **base),
        "auto": fxpipe.Plan(devices=[host, accelerator], split="auto", **base),
    }
    print(
        f"EmbeddingClassifier: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({model.embed.weight.numel() / 1e6:.1f}M in the table); batch {args.batch} x {args.length} tokens, "
        f"{args.microbatches} micro-batches, Adam; host {host}, accelerator {accelerator} with a {args.accelerator_memory / 1e6:.0f} MB budget\n"
    )
    results = []
    for name, plan in plans.items():
        result = measure(name, model, plan, x, target, args.repeats)
        results.append(result)
        print(f"{name}: " + "; ".join(f"stage {s.stage} on {s.device}: {s.modules}" for s in result.stages))

    print(f"\n{'placement':<11} {'stage':>5} {'device':<7} {'time pred':>10} {'time meas':>10} {'mem pred':>10} {'mem meas':>10}  fits")
    for r in results:
        for s in r.stages:
            fits = "" if s.device != accelerator else ("yes" if s.predicted_memory <= args.accelerator_memory else "NO (over budget)")
            peak = f"  allocator peak {s.allocator_peak / 1e6:.1f} MB" if s.allocator_peak is not None else ""
            print(
                f"{r.name:<11} {s.stage:>5} {s.device:<7} {s.predicted_time * 1e3:>8.1f}ms {s.measured_time * 1e3:>8.1f}ms "
                f"{s.predicted_memory / 1e6:>8.1f}MB {s.measured_memory / 1e6:>8.1f}MB  {fits}{peak}"
            )
        print(f"{r.name:<11} {'step':>5} {'':<7} {r.predicted_step * 1e3:>8.1f}ms {r.measured_step * 1e3:>8.1f}ms")
    if args.plot:
        plot(results, args.accelerator_memory, accelerator, args.plot)
        print(f"\nwrote {args.plot}")
    return results


if __name__ == "__main__":
    main()
