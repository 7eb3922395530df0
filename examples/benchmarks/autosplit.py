"""Benchmark: split="auto" against the usual baselines, the cost model's error, partitioner speed.

For resnet50 and a transformer encoder stack, at 2 and 4 stages on logical CPU devices,
it prints the measured step time (fastest of a few 1F1B steps) of
  auto        the cost model's exact min-max split (FLOP estimates)
  auto+prof   the same with fxpipe.profile measurements
  params      equal parameter counts per stage (DeepSpeed's partition_method="parameters")
  layers      equal numbers of compute nodes per stage (DeepSpeed's "uniform")
with the predicted step time of each, then predicted vs measured forward+backward time
per stage (error %), then the partitioner's run time on synthetic 10,000-node graphs, and
a predicted-vs-measured micro-batch sweep plot.

    .venv/bin/python examples/benchmarks/autosplit.py [--quick] [--plot docs/img/tune-sweep.png]

Each worker uses one intra-op thread (torch.set_num_threads(1)). Timings on a shared CPU
are noisy, and with more stages than cores the workers share cores; compare ratios
within one run.
"""

from __future__ import annotations

import argparse
import random
import time

import networkx as nx
import torch
import torchvision
from torch import nn

import fxpipe
from fxpipe.tune import plot_sweep, sweep
from passes.autosplit import SplitProblem, ordered_problem_inputs, solve
from passes.partition import EDGE


class Encoder(nn.Module):
    """A transformer encoder stack with a token embedding and a classifier head."""

    def __init__(self, layers: int = 8, width: int = 256, vocab: int = 8000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean(1)


def _compute_nodes(part: fxpipe.Partitioned) -> list:
    return [n for n in part.graph.nodes if n.op in ("call_module", "call_function", "call_method") and EDGE not in n.meta]


def _split_points(part: fxpipe.Partitioned, weights: list[float], stages: int) -> list[str]:
    """Module paths starting ``stages`` contiguous runs with equal shares of ``weights``."""
    nodes = _compute_nodes(part)
    starts: dict[str, int] = {}  # first node within each module path, children included
    for k, n in enumerate(nodes):
        path = n.meta.get("module_path", "")
        while path:
            starts.setdefault(path, k)
            path = path.rpartition(".")[0]
    total, running, cuts = sum(weights), 0.0, []
    for k, (node, w) in enumerate(zip(nodes, weights)):
        if len(cuts) < stages - 1 and running >= total * (len(cuts) + 1) / stages:
            path = node.meta.get("module_path", "")
            if path and starts.get(path) == k and (not cuts or cuts[-1] != path):
                cuts.append(path)
        running += w
    return cuts


def _param_weights(part: fxpipe.Partitioned) -> list[float]:
    seen: set[int] = set()
    weights = []
    for node in _compute_nodes(part):
        count = 0
        if node.op == "call_module":
            module = part._resolve(node.target)
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    count += p.numel()
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                t = part._resolve(arg.target)
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    count += t.numel()
        weights.append(float(count))
    return weights


def _measure(model, plan, x, target, loss_fn, repeats: int, profile=None) -> tuple[float, fxpipe.Pipeline]:
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=loss_fn, profile=profile)
    best = float("inf")
    for k in range(repeats + 1):
        start = time.perf_counter()
        pipe.step(x, target=target)
        if k:
            best = min(best, time.perf_counter() - start)
        pipe.zero_grad()
    return best, pipe


def _stage_measured(pipe: fxpipe.Pipeline) -> list[float]:
    """Mean forward+backward seconds per micro-batch of each stage in the last step."""
    tl = pipe.timeline()
    out = []
    for s in range(len(pipe.stages)):
        events = [e for e in tl.events if e.stage == s and e.op in ("F", "B")]
        out.append(sum(e.duration for e in events) / pipe.plan.microbatches)
    return out


def compare(name: str, model: nn.Module, x, target, loss_fn, stages: int, repeats: int, microbatches: int) -> None:
    devices = [f"cpu:{i}" for i in range(stages)]
    base = fxpipe.Plan(devices=devices, split="auto", microbatches=microbatches)
    auto = fxpipe.partition(model, base, example_inputs=(x,))
    profile = fxpipe.profile(model, (x,), device="cpu", plan=base, repeats=2)  # timed at the micro-batch
    plans = {
        "auto": (base, None),
        "auto+prof": (base, profile),
        "params": (base.replace(split=_split_points(auto, _param_weights(auto), stages)), None),
        "layers": (base.replace(split=_split_points(auto, [1.0] * len(_compute_nodes(auto)), stages)), None),
    }
    print(f"\n{name}, {stages} stages, {microbatches} micro-batches, batch {x.shape[0]}")
    print(f"  {'split':10s} {'measured':>10s} {'predicted':>10s}   stage fwd+bwd per micro-batch: predicted / measured (error)")
    results = {}
    for label, (plan, prof) in plans.items():
        part = fxpipe.partition(model, plan, example_inputs=(x,), profile=prof)
        predicted = part.simulate().step_time
        measured, pipe = _measure(model, plan, x, target, loss_fn, repeats, prof)
        results[label] = measured
        per_stage = _stage_measured(pipe)
        cells = []
        for est, meas in zip(part.estimates(), per_stage):
            compute = est.forward + est.backward
            cells.append(f"{compute * 1e3:.1f}/{meas * 1e3:.1f} ms ({(compute - meas) / meas:+.0%})")
        print(f"  {label:10s} {measured * 1e3:8.1f}ms {predicted * 1e3:8.1f}ms   " + ", ".join(cells))
    for label in ("params", "layers"):
        for auto_label in ("auto", "auto+prof"):
            gain = results[label] / results[auto_label] - 1
            print(f"  {auto_label} vs {label}: {gain:+.1%} faster" if gain >= 0 else f"  {auto_label} vs {label}: {-gain:.1%} slower")


def partitioner_speed() -> None:
    """Time ``solve`` on synthetic 10,000-node graphs: a chain, and a chain with skip edges."""
    rng = random.Random(0)
    n = 10_000
    print("\npartitioner on synthetic 10,000-node graphs (networkx order + exact min-max split)")
    for kind in ("chain", "skips"):
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        for i in range(n - 1):
            graph.add_edge(i, i + 1, bytes=rng.uniform(1e5, 1e6))
            if kind == "skips" and i % 10 == 0 and i + 5 < n:
                graph.add_edge(i, i + 5, bytes=rng.uniform(1e5, 1e6))
        for stages in (2, 4, 8):
            start = time.perf_counter()
            order, cuts = ordered_problem_inputs(graph, list(range(n)))
            speeds = [rng.choice([1.0, 2.0, 4.0]) for _ in range(stages)]
            base = [rng.uniform(1e-5, 1e-3) for _ in range(n)]
            state = torch.tensor([rng.uniform(0, 1e6) for _ in range(n)])
            acts = torch.tensor([rng.uniform(0, 1e5) for _ in range(n)])
            # memory for 1.5x an even share: tight enough that the limit shapes some splits
            limit = 1.5 * float(state.sum() + stages * acts.sum()) / stages
            problem = SplitProblem(
                torch.tensor([[t / s for t in base] for s in speeds]), cuts, [0.0] + [1e-10] * (stages - 1),
                [1e-10] * (stages - 1) + [0.0], [1e-4] * stages, state, acts, [stages - k for k in range(stages)],
                [limit] * stages,
            )
            built = time.perf_counter()
            split = solve(problem)
            done = time.perf_counter()
            print(
                f"  {kind:6s} K={stages}: order+cuts {built - start:.3f} s, solve {done - built:.3f} s, "
                f"bottleneck {split.bottleneck:.3f} s (speeds {speeds})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, one timed step")
    parser.add_argument("--plot", default=None, help="write the micro-batch sweep plot here")
    args = parser.parse_args()
    torch.manual_seed(0)
    # one intra-op thread per worker: on a small machine the stages then run in parallel
    # instead of oversubscribing the cores, which is what a split is meant to exploit
    torch.set_num_threads(1)
    repeats = 1 if args.quick else 3
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; cpu spec {fxpipe.costs.default_spec('cpu')}")
    partitioner_speed()
    loss = nn.CrossEntropyLoss()
    size = 32 if args.quick else 64
    resnet = torchvision.models.resnet50(num_classes=10)
    x, t = torch.randn(16, 3, size, size), torch.randint(0, 10, (16,))
    for stages in (2, 4):
        compare("resnet50", resnet, x, t, loss, stages, repeats, microbatches=4)
    encoder = Encoder(layers=4 if args.quick else 8)
    ids = torch.randint(0, 8000, (16, 64))
    tt = torch.randint(0, 8000, (16,))
    for stages in (2, 4):
        compare("transformer encoder", encoder, ids, tt, loss, stages, repeats, microbatches=4)
    print("\nmicro-batch sweep, transformer encoder, 2 stages (predicted for all, measured for some)")
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto")
    points = sweep(encoder, plan, (ids,), loss, tt, candidates=[1, 2, 4, 8, 16], measure=[1, 2, 4, 8, 16], repeats=repeats)
    for p in points:
        print(f"  m={p.microbatches:3d}: predicted {p.predicted_step * 1e3:7.1f} ms, measured {p.measured_step * 1e3:7.1f} ms")
    if args.plot:
        print(f"  plot: {plot_sweep(points, args.plot, 'transformer encoder, 2 stages on CPU')}")


if __name__ == "__main__":
    main()
