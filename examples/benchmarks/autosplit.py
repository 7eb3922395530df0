"""Benchmark: split="auto" against the usual baselines, the cost model's error, partitioner speed.

For resnet50, a transformer encoder stack and a GPT-2-style LM (transformers'
GPT2LMHeadModel, 12 layers of width 128, tied embeddings), at 2 and 4 stages on logical
CPU devices, it prints the measured step time (median of interleaved 1F1B steps) of
  auto        the cost model's split (FLOP estimates): the exact min-max split, its cuts
              then moved while the simulated 1F1B step gets faster
  auto+prof   the same with fxpipe.profile measurements (per-node times in context and
              the per-kind calibration)
  params      equal parameter counts per stage (DeepSpeed's partition_method="parameters")
  layers      equal numbers of compute nodes per stage (DeepSpeed's "uniform")
with the predicted step time of each, then predicted vs measured forward+backward time
per stage (error %), then the partitioner's run time on synthetic 10,000-node graphs, and
a predicted-vs-measured micro-batch sweep plot.

    .venv/bin/python examples/benchmarks/autosplit.py [--quick] [--parts partitioner resnet50 encoder lm sweep]
        [--sizes 224 64] [--repeats 5] [--plot docs/img/tune-sweep.png]

ResNet-50 runs at its standard 224x224 input and at 64x64, where compute shrinks 12x but
the weights do not (weight traffic then dominates on a CPU). The four splits of a case
are compiled first, twice each, and timed in interleaved rounds (median of 2 x
``--repeats`` steps), so a slow spell of the machine hits them all; two pipelines of the
same split differ by up to ~6 % on this machine, so smaller differences are noise. Each worker uses one intra-op thread
(torch.set_num_threads(1)); with more stages than cores the workers share cores.
Compare ratios within one run.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import networkx as nx
import torch
import torchvision
from torch import nn

import fxpipe
from fxpipe.factory import build_pipeline
from fxpipe.passes.partition import EDGE
from fxpipe.passes.split_solver import SplitProblem, ordered_problem_inputs, refine, solve
from fxpipe.passes.targets import resolver
from fxpipe.planner.schedule_sim import simulate
from fxpipe.schedules import make_schedule
from fxpipe.tune import plot_sweep, sweep


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
    total, running, cuts, at = sum(weights), 0.0, [], []
    for k, (node, w) in enumerate(zip(nodes, weights)):
        if len(cuts) < stages - 1 and running >= total * (len(cuts) + 1) / stages:
            path = node.meta.get("module_path", "")
            if path and starts.get(path) == k and (not cuts or cuts[-1] != path):
                cuts.append(path)
                at.append(k)
        running += w
    # too few module starts past the last share (a small model): cut at the next ones
    later = sorted((k, path) for path, k in starts.items() if k > (at[-1] if at else 0))
    for k, path in later:
        if len(cuts) == stages - 1:
            break
        if k not in at:
            cuts.append(path)
            at.append(k)
    if len(cuts) < stages - 1:
        raise ValueError(f"{stages} stages asked for but only {len(cuts) + 1} module-aligned runs exist")
    return cuts


def _param_weights(part: fxpipe.Partitioned) -> list[float]:
    resolve = resolver(*(s.module for s in part.stages))
    seen: set[int] = set()
    weights = []
    for node in _compute_nodes(part):
        count = 0
        if node.op == "call_module":
            module = resolve(node.target)
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    count += p.numel()
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                t = resolve(arg.target)
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    count += t.numel()
        weights.append(float(count))
    return weights


def _cuts(part: fxpipe.Partitioned) -> list[str]:
    """Where stages 1.. start: the module (or node) of each stage's first compute node."""
    first: dict[int, str] = {}
    for node in _compute_nodes(part):
        stage = node.meta.get("stage")
        if stage and stage not in first:
            first[stage] = node.meta.get("module_path") or node.name
    return [first[k] for k in sorted(first)]


def _stage_measured(pipe: fxpipe.Pipeline) -> list[float]:
    """Mean forward+backward seconds per micro-batch of each stage in the last step."""
    tl = pipe.timeline()
    out = []
    for s in range(len(pipe.stages)):
        events = [e for e in tl.events if e.stage == s and e.op in ("F", "B")]
        out.append(sum(e.duration for e in events) / pipe.plan.microbatches)
    return out


def compare(name: str, model: nn.Module, x, target, loss_fn, stages: int, repeats: int, microbatches: int) -> None:
    """Compile the four splits, then time them in interleaved rounds (median per split)."""
    devices = [f"cpu:{i}" for i in range(stages)]
    base = fxpipe.Plan(devices=devices, split="auto", microbatches=microbatches)
    auto = fxpipe.partition(model, base, example_inputs=(x,))
    profile = fxpipe.profile(model, (x,), device="cpu", plan=base, repeats=3)  # timed at the micro-batch
    plans = {
        "auto": (base, None),
        "auto+prof": (base, profile),
        "params": (base.replace(split=_split_points(auto, _param_weights(auto), stages)), None),
        "layers": (base.replace(split=_split_points(auto, [1.0] * len(_compute_nodes(auto)), stages)), None),
    }
    print(f"\n{name}, {stages} stages, {microbatches} micro-batches, batch {x.shape[0]}, input {tuple(x.shape[1:])}")
    pipes: dict[str, list[fxpipe.Pipeline]] = {}
    parts = {}
    for label, (plan, prof) in plans.items():
        parts[label] = auto if label == "auto" else fxpipe.partition(model, plan, example_inputs=(x,), profile=prof)
        # two compiled copies per split: one pipeline object alone runs a few % faster or
        # slower than another of the same split for as long as it lives (memory layout)
        pipes[label] = [build_pipeline(parts[label], model, loss_fn) for _ in range(2)]
        for pipe in pipes[label]:
            pipe.step(x, target=target)  # warm-up
            pipe.zero_grad()
    times: dict[str, list[float]] = {label: [] for label in plans}
    for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every split
        for label, copies in pipes.items():
            for pipe in copies:
                start = time.perf_counter()
                pipe.step(x, target=target)
                times[label].append(time.perf_counter() - start)
                pipe.zero_grad()
    print(f"  {'split':10s} {'measured':>10s} {'predicted':>10s}   cuts; stage fwd+bwd per micro-batch: predicted / measured (error)")
    results, predictions = {}, {}
    for label, part in parts.items():
        measured = statistics.median(times[label])
        results[label] = measured
        predictions[label] = part.simulate().step_time
        cells = []
        for est, meas in zip(part.estimates(), _stage_measured(pipes[label][0])):
            compute = est.forward + est.backward
            cells.append(f"{compute * 1e3:.1f}/{meas * 1e3:.1f} ms ({(compute - meas) / meas:+.0%})")
        print(f"  {label:10s} {measured * 1e3:8.1f}ms {predictions[label] * 1e3:8.1f}ms   " + ", ".join(cells) + f"; stages start at {_cuts(part)}")
    # the ranking check: do the FLOP-estimate predictions order the three splits
    # without a profile as measurement does?
    # noise: how far the two compiled copies of one split are apart (steps alternate copies)
    noise = max(abs(statistics.median(t[0::2]) / statistics.median(t[1::2]) - 1) for t in times.values())
    ranked = ("auto", "params", "layers")
    by_prediction = sorted(ranked, key=predictions.__getitem__)
    by_measurement = sorted(ranked, key=results.__getitem__)
    # a pair ordered one way by prediction and the other by measurement disagrees only
    # when the measured gap is larger than the noise; a smaller gap is a tie
    flipped = [
        (a, b) for i, a in enumerate(by_prediction) for b in by_prediction[i + 1 :]
        if results[a] > results[b] * (1 + noise)
    ]
    verdict = f"DISAGREE on {flipped}" if flipped else "agree"
    print(
        f"  ranking (fastest first) predicted {by_prediction}, measured {by_measurement}: {verdict} "
        f"(gaps under {noise:.1%}, the spread between two copies of one split, count as ties)"
    )
    for label in ("params", "layers"):
        for auto_label in ("auto", "auto+prof"):
            gain = results[label] / results[auto_label] - 1
            print(f"  {auto_label} vs {label}: {gain:+.1%} faster" if gain >= 0 else f"  {auto_label} vs {label}: {-gain:.1%} slower")


def _one_f_one_b_step(problem: SplitProblem, actions, bounds: list[int]) -> float:
    """The simulated step of ``actions`` with stage times from ``problem`` (backward = 2 x forward)."""
    times = [problem.stage_time(k, bounds[k], bounds[k + 1]) for k in range(problem.num_stages)]
    return simulate(actions, problem.num_stages, lambda k, _: times[k] / 3, lambda k, _: 2 * times[k] / 3).step_time


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
            step_time = functools.partial(_one_f_one_b_step, problem, make_schedule("1f1b", stages, 2 * stages))
            refined = refine(problem, split.boundaries, step_time)
            finished = time.perf_counter()
            print(
                f"  {kind:6s} K={stages}: order+cuts {built - start:.3f} s, solve {done - built:.3f} s, "
                f"refine {finished - done:.3f} s (1F1B step {step_time(split.boundaries):.2f} -> "
                f"{step_time(refined):.2f} s), bottleneck {split.bottleneck:.3f} s (speeds {speeds})"
            )


PARTS = ("partitioner", "resnet50", "encoder", "lm", "sweep")


def gpt2_lm(layers: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, object]:
    """A GPT-2-style LM (tied embeddings), token ids, next-token targets and its loss."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=layers, n_embd=128, n_head=4, vocab_size=2048, n_positions=128, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    ids = torch.randint(0, 2048, (16, 64))

    def loss(out, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return transformers.GPT2LMHeadModel(config), ids, torch.randint(0, 2048, (16, 64)), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small inputs, one timed round")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run (default all)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 64], help="ResNet-50 input sizes (default 224 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per split (median)")
    parser.add_argument("--plot", default=None, help="write the micro-batch sweep plot here")
    args = parser.parse_args()
    torch.manual_seed(0)
    # one intra-op thread per worker: on a small machine the stages then run in parallel
    # instead of oversubscribing the cores, which is what a split is meant to exploit
    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    sizes = [32] if args.quick else args.sizes
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; cpu spec {fxpipe.planner.cost_model.default_spec('cpu')}")
    if "partitioner" in args.parts:
        partitioner_speed()
    loss = nn.CrossEntropyLoss()
    if "resnet50" in args.parts:
        resnet = torchvision.models.resnet50(num_classes=10)
        for size in sizes:
            x, t = torch.randn(16, 3, size, size), torch.randint(0, 10, (16,))
            for stages in (2, 4):
                compare("resnet50", resnet, x, t, loss, stages, repeats, microbatches=4)
    encoder = Encoder(layers=4 if args.quick else 8)
    ids = torch.randint(0, 8000, (16, 64))
    tt = torch.randint(0, 8000, (16,))
    if "encoder" in args.parts:
        for stages in (2, 4):
            compare("transformer encoder", encoder, ids, tt, loss, stages, repeats, microbatches=4)
    if "lm" in args.parts:
        lm, lm_ids, lm_target, lm_loss = gpt2_lm(4 if args.quick else 12)
        for stages in (2, 4):
            compare("GPT-2-style LM", lm, lm_ids, lm_target, lm_loss, stages, repeats, microbatches=4)
    if "sweep" in args.parts:
        print("\nmicro-batch sweep, transformer encoder, 2 stages (predicted for all, measured for some)")
        plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto")
        points = sweep(encoder, plan, (ids,), loss, tt, candidates=[1, 2, 4, 8, 16], measure=[1, 2, 4, 8, 16], repeats=min(repeats, 3), schedules=[plan.schedule])
        for p in points:
            measured = f"{p.measured_step * 1e3:7.1f} ms" if p.measured_step is not None else f"failed, skipped ({p.error})"
            print(f"  m={p.microbatches:3d}: predicted {p.predicted_step * 1e3:7.1f} ms, measured {measured}")
        if args.plot:
            print(f"  plot: {plot_sweep(points, args.plot, 'transformer encoder, 2 stages on CPU')}")


if __name__ == "__main__":
    main()
