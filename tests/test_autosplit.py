"""The split="auto" partitioner: exact on small chains, memory-safe, speed-aware, heterogeneous."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpipe
from fxpipe.passes.split_solver import SplitInfeasible, SplitProblem, refine, solve


def brute_force(problem: SplitProblem) -> tuple[float, list[int] | None]:
    K, n = problem.num_stages, problem.num_items
    best, arg = math.inf, None
    for cuts in itertools.combinations(range(1, n), K - 1):
        bounds = [0, *cuts, n]
        if any(problem.stage_memory(k, bounds[k], bounds[k + 1]) > problem.memory[k] for k in range(K)):
            continue
        value = problem.bottleneck(bounds)
        if value < best:
            best, arg = value, bounds
    return best, arg


@st.composite
def problems(draw) -> SplitProblem:
    K = draw(st.integers(1, 4))
    n = draw(st.integers(K, 9))
    unit = st.floats(0, 1, allow_nan=False)
    speed = [draw(st.sampled_from([1.0, 2.0, 5.0])) for _ in range(K)]
    times = [draw(st.lists(unit, min_size=n, max_size=n)) for _ in range(K)]
    return SplitProblem(
        item_time=torch.tensor([[t / s for t in row] for row, s in zip(times, speed)]),
        cut_bytes=[0.0] + draw(st.lists(unit, min_size=n - 1, max_size=n - 1)) + [0.0],
        recv_per_byte=[0.0] + draw(st.lists(unit, min_size=K - 1, max_size=K - 1)),
        send_per_byte=draw(st.lists(unit, min_size=K - 1, max_size=K - 1)) + [0.0],
        fixed_time=draw(st.lists(st.floats(0, 0.1), min_size=K, max_size=K)),
        state_bytes=torch.tensor(draw(st.lists(unit, min_size=n, max_size=n))),
        activation_bytes=torch.tensor(draw(st.lists(unit, min_size=n, max_size=n))),
        in_flight=draw(st.lists(st.integers(1, 4), min_size=K, max_size=K)),
        memory=draw(st.lists(st.floats(0.5, 6), min_size=K, max_size=K)),
    )


@settings(max_examples=80, deadline=None)
@given(problems())
def test_partitioner_equals_brute_force_and_respects_memory(problem: SplitProblem) -> None:
    best, _ = brute_force(problem)
    if best == math.inf:
        with pytest.raises(SplitInfeasible):
            solve(problem)
        return
    split = solve(problem)
    assert split.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)
    b = split.boundaries
    assert b[0] == 0 and b[-1] == problem.num_items and all(x < y for x, y in zip(b, b[1:]))
    for k in range(problem.num_stages):
        assert problem.stage_memory(k, b[k], b[k + 1]) <= problem.memory[k]


@settings(max_examples=60, deadline=None)
@given(problems(), st.integers(1, 8))
def test_refine_never_makes_the_step_slower_nor_breaks_memory(problem: SplitProblem, microbatches: int) -> None:
    """GPipe's step is sum(stage times) + (m - 1) x the slowest: refine it from the min-max split."""
    try:
        start = solve(problem).boundaries
    except SplitInfeasible:
        return

    def step(bounds: list[int]) -> float:
        times = [problem.stage_time(k, bounds[k], bounds[k + 1]) for k in range(problem.num_stages)]
        return sum(times) + (microbatches - 1) * max(times)

    b = refine(problem, start, step)
    assert step(b) <= step(start)
    assert b[0] == 0 and b[-1] == problem.num_items and all(x < y for x, y in zip(b, b[1:]))
    for k in range(problem.num_stages):
        assert problem.stage_memory(k, b[k], b[k + 1]) <= problem.memory[k]


def test_auto_split_is_refined_for_the_schedule() -> None:
    """16 equal layers, 4 stages, 1F1B with 4 micro-batches: the balanced 4-4-4-4 split is
    the min-max one, and a 1F1B step with so few micro-batches is faster with more layers
    early; auto must predict no slower than balanced and say why it moved the cuts."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
    x = torch.randn(64, 256)
    plan = fxpipe.Plan(devices=[f"cpu:{k}" for k in range(4)], split="auto", microbatches=4)
    auto = fxpipe.partition(model, plan, example_inputs=(x,))
    even = fxpipe.partition(model, plan.replace(split=["4", "8", "12"]), example_inputs=(x,))
    assert auto.simulate().step_time < even.simulate().step_time
    assert "cuts moved from the min-max split" in auto.explain()


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from([1.0, 2.0, 3.0, 4.0]), min_size=2, max_size=4))
def test_faster_devices_get_proportionate_work(speeds: list[float]) -> None:
    n = 400
    K = len(speeds)
    problem = SplitProblem(
        torch.tensor([[1.0 / s] * n for s in speeds]), [0.0] * (n + 1), [0.0] * K, [0.0] * K, [0.0] * K,
        torch.zeros(n), torch.zeros(n), [1] * K, [1.0] * K,
    )
    b = solve(problem).boundaries
    for k, s in enumerate(speeds):
        assert b[k + 1] - b[k] == pytest.approx(n * s / sum(speeds), abs=K)


class EmbedThenCompute(nn.Module):
    """A big embedding (memory) followed by compute-heavy layers (FLOPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50_000, 64)  # 12.8 MB of weights, ~51 MB with grads and Adam
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)])
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)).mean(1))


CPU = fxpipe.DeviceSpec(flops=1e10, memory=64e9, bandwidth=10e9)
GPU = fxpipe.DeviceSpec(flops=1e14, memory=20e6, bandwidth=25e9)
IDS = torch.randint(0, 50_000, (32, 128))


def test_embedding_goes_to_the_cpu_and_compute_to_the_gpu() -> None:
    plan = fxpipe.Plan(devices=["cpu", "gpu:0"], split="auto", device_specs={"cpu": CPU, "cuda:0": GPU})
    part = fxpipe.partition(EmbedThenCompute(), plan, example_inputs=(IDS,))
    cpu, gpu = part.stages
    assert gpu.device == "cuda:0"
    assert [p for p in cpu.module_paths if p] == ["embed"]
    assert all(p.startswith(("body", "head")) or not p for p in gpu.module_paths)
    assert "cost model" in part.explain() and "cost model" in cpu.reason


def test_infeasible_memory_names_the_stage_and_the_bytes() -> None:
    plan = fxpipe.Plan(devices=["gpu:0", "cpu"], split="auto", device_specs={"cpu": CPU, "cuda:0": GPU})
    with pytest.raises(fxpipe.PlanError, match=r"(?s)no split.*memory.*stage 0 on cuda:0 .*MiB.*has 19\.1 MiB.*too small"):
        fxpipe.partition(EmbedThenCompute(), plan, example_inputs=(IDS,))


def test_auto_split_runs_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)], nn.Linear(32, 4))
    x, t = torch.randn(16, 32), torch.randint(0, 4, (16,))
    ref = copy.deepcopy(model)  # the pipeline's parameters are the model's own
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split="auto"), example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    assert len(pipe.stages) == 3 and all(s.num_nodes > 0 for s in pipe.stages)
    loss = pipe.step(x, target=t)
    expected = nn.CrossEntropyLoss()(ref(x), t)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad)


class ScaledStack(nn.Module):
    """A constant made from nothing (``torch.ones``) and used only by the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(32)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x * scale)


def test_auto_split_places_stages_with_the_annotate_rule(monkeypatch) -> None:
    """split="auto" returns cuts; the annotate pass assigns stages, so sources follow the one
    rule: inputs in stage 0, attributes and input-free nodes with their first user."""
    from fxpipe.passes import annotate

    calls = []
    fix_sources = annotate._fix_sources
    monkeypatch.setattr(annotate, "_fix_sources", lambda graph: (calls.append(graph), fix_sources(graph)))
    # torch.export keeps torch.ones as a node without inputs (fx would fold it into a constant)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split="auto", frontend="export")
    part = fxpipe.partition(ScaledStack(), plan, example_inputs=(torch.randn(16, 32),))
    assert len(calls) == 1
    nodes = {n.name: n for n in part.graph.nodes}
    ones = nodes["ones"]
    assert ones.meta["stage"] == max(u.meta["stage"] for u in ones.users) == 2
    assert not any(e.name == "ones" for e in part.partitioned.edges)  # made where it is used
    for node in part.graph.nodes:
        if node.op == "get_attr":
            assert node.meta["stage"] == min(u.meta["stage"] for u in node.users)
        if node.op == "placeholder":
            assert node.meta["stage"] == 0
    assert [s.reason.startswith("cost model") for s in part.stages] == [True] * 3


def test_auto_split_follows_the_schedules_placement_of_stages() -> None:
    """zb-v puts stages 0 and 3 on worker 0 and stages 1 and 2 on worker 1 (a V): with a
    slow CPU as worker 0's device and a fast GPU as worker 1's, the GPU stages get the work."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(16)])
    plan = fxpipe.Plan(
        devices=["cpu", "gpu:0"], chunks=2, schedule="zb-v", split="auto", microbatches=8,
        device_specs={"cpu": fxpipe.DeviceSpec(flops=1e9, memory=64e9, bandwidth=10e9), "cuda:0": fxpipe.DeviceSpec(flops=1e12, memory=16e9, bandwidth=25e9)},
    )
    part = fxpipe.partition(model, plan, example_inputs=(torch.randn(32, 64),))
    assert part.devices == ["cpu", "cuda:0", "cuda:0", "cpu"]
    assert [f"on {d}" in s.reason for s, d in zip(part.stages, part.devices)] == [True] * 4
    nodes = [s.num_nodes for s in part.stages]
    assert nodes[1] + nodes[2] > 4 * (nodes[0] + nodes[3])


@pytest.mark.parametrize("name,stages,chunks", [("gpipe", 3, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 4, 2), ("zb-h1", 3, 1), ("zb-v", 4, 2), ("dualpipev", 4, 2)])
def test_step_clock_is_the_simulated_step_to_the_bit(name: str, stages: int, chunks: int) -> None:
    # split="auto" refines its cuts with StepClock: the same float operations as play(), so the same cuts
    from fxpipe.planner.cost_model import stage_models
    from fxpipe.planner.estimates import StepClock, play
    from fxpipe.schedules import make_schedule

    plan = fxpipe.Plan(devices=[f"cpu:{k}" for k in range(stages // chunks)])
    models = stage_models(plan, [f"cpu:{k % (stages // chunks)}" for k in range(stages)])
    actions = make_schedule(name, stages, 8, chunks)
    clock = StepClock(actions, models, [(k, k + 1) for k in range(stages - 1)])
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        f, i, w = (torch.rand(stages, generator=rng, dtype=torch.float64).mul(1e-3).tolist() for _ in range(3))
        edges = {(k, k + 1): float(torch.randint(0, 10**7, (), generator=rng)) for k in range(stages - 1)}
        assert clock.step_time(f, i, w, edges) == play(actions, models, f, i, w, edges).step_time
