"""The cost model: FLOPs from flop_counter on fake tensors, bytes, device specs, predictions."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxpipe
from fxpipe.passes.meta import COST
from fxpipe.passes.node_costs import NodeCost
from fxpipe.planner.cost_model import DeviceModel, default_spec, spec_for

X = torch.randn(16, 32)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def costs_of(part: fxpipe.Partitioned) -> dict[str, NodeCost]:
    return {n.name: n.meta[COST] for n in part.graph.nodes if COST in n.meta and n.op == "call_module"}


def test_linear_flops_match_flop_counter_forward_and_backward() -> None:
    part = fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"]), example_inputs=(X,))
    costs = costs_of(part)
    assert costs["_0"].fwd_flops == 2 * 16 * 32 * 64
    # the model input needs no gradient: only the weight gradient is computed
    assert costs["_0"].bwd_flops == 2 * 16 * 32 * 64
    assert costs["_2"].bwd_flops == 2 * 2 * 16 * 64 * 64
    assert costs["_2"].param_bytes == (64 * 64 + 64) * 4
    model = mlp()
    with FlopCounterMode(display=False) as counter:
        model(X).sum().backward()
    counted = sum(c.fwd_flops + c.bwd_flops for name, c in costs.items() if name in ("_0", "_2", "_4"))
    assert counted == counter.get_total_flops()


def test_inplace_and_views_do_not_double_count_activations() -> None:
    part = fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"]), example_inputs=(X,))
    costs = costs_of(part)
    assert costs["_1"].activation_bytes == 0  # ReLU(inplace=True) writes into _0's output
    assert costs["_3"].activation_bytes == 16 * 64 * 4
    assert costs["_1"].fwd_flops == 16 * 64  # not counted by flop_counter: one per element


def test_costing_leaves_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto"), example_inputs=(X,))
    part.summary()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def test_summary_and_explain_report_flops_time_and_memory() -> None:
    part = fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"]), example_inputs=(X,))
    summary = part.summary()
    assert "FLOPs" in summary and "predicted" in summary and "memory" in summary
    explain = part.explain()
    assert explain.count("cost model, per micro-batch") == 2
    estimates = part.estimates()
    assert all(e.time > 0 and e.memory > 0 for e in estimates)


def test_simulate_predicts_a_timeline_for_the_schedule() -> None:
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto", microbatches=4)
    pipe = fxpipe.compile(mlp(), plan, example_inputs=(X,), loss_fn=nn.CrossEntropyLoss())
    timeline = pipe.simulate()
    assert timeline.kind == "predicted" and timeline.step_time > 0
    assert len(timeline.events) == 2 * 2 * 4
    assert 0 < timeline.bubble_fraction < 1
    assert pipe.simulate(8).step_time != timeline.step_time


def test_default_specs_are_deterministic_and_cpu_n_share_the_cpu_spec() -> None:
    cpu = default_spec("cpu")
    assert cpu.flops > 0 and cpu.memory > 0 and cpu.bandwidth > 0
    assert default_spec("cpu:1") == cpu
    gpu = default_spec("cuda:0")
    assert gpu.flops > cpu.flops
    custom = fxpipe.DeviceSpec(flops=1e9, memory=1e9, bandwidth=1e9)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], device_specs={"cpu": custom})
    assert spec_for(plan, "cpu:1") == custom


def test_faster_device_predicts_less_time() -> None:
    cost = NodeCost(fwd_flops=1e9, bwd_flops=2e9, act_bytes_moved=1e3)
    plan = fxpipe.Plan(device_specs={"cpu": fxpipe.DeviceSpec(1e10, 1e9, 1e9), "cuda:0": fxpipe.DeviceSpec(1e12, 1e9, 1e9)})
    slow = sum(DeviceModel.of(plan, "cpu").node_times(cost, 1.0))
    fast = sum(DeviceModel.of(plan, "cuda:0").node_times(cost, 1.0))
    assert slow == pytest.approx(0.3, rel=0.01) and fast < slow / 50


class EncoderThenReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.layer(x))


def test_fixed_cost_counts_the_aten_ops_a_node_dispatches() -> None:
    """A leaf TransformerEncoderLayer is one node but dozens of ops; each pays the fixed
    cost, so its time at a tiny batch is dominated by them, unlike a ReLU's."""
    plan = fxpipe.Plan(devices=["cpu:0"], split="auto", microbatches=1)
    part = fxpipe.partition(EncoderThenReLU(), plan, example_inputs=(torch.randn(1, 2, 64),))
    costs = {n.name: n.meta[COST] for n in part.graph.nodes if n.op == "call_module"}
    layer, act = costs["layer"], costs["act"]
    assert layer.fwd_ops > 20 and layer.bwd_ops > 20
    assert 1 <= act.fwd_ops <= 3 and 1 <= act.bwd_ops <= 3
    cpu = DeviceModel.of(plan, "cpu:0")
    fwd, bwd = cpu.node_times(layer, 1.0)
    assert fwd >= layer.fwd_ops * cpu.op_overhead and bwd >= layer.bwd_ops * cpu.op_overhead
    assert cpu.node_times(act, 1.0)[0] < fwd / 10


def test_profile_measures_every_node_and_feeds_the_split() -> None:
    model = mlp()
    profile = fxpipe.profile(model, (X,), device="cpu", repeats=1)
    assert set(profile.times) == {"_0", "_1", "_2", "_3", "_4"}
    assert all(t.forward > 0 for t in profile.times.values())
    assert profile.times["_2"].backward > 0
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto")
    part = fxpipe.partition(model, plan, example_inputs=(X,), profile=profile)
    assert any("measured_time" in n.meta for n in part.graph.nodes)
    assert all(e.forward > 0 for e in part.estimates())


@pytest.fixture
def one_thread():
    """Time on one thread: with two threads on a busy 2-core machine, a descheduled
    OpenMP worker stalls whichever parallel kernel it is in and the timings turn to noise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.Linear(2048, 8))


def test_profile_attributes_time_to_the_nodes_that_spend_it(one_thread) -> None:
    # the 2048x2048 layer (_3) does 256x the multiply-adds of any other node
    plan = fxpipe.Plan(microbatches=1)
    prof = fxpipe.profile(wide_mlp(), (torch.randn(64, 8),), plan=plan, repeats=5)
    t = prof.times
    assert set(t) == {"_0", "_1", "_2", "_3", "_4"}
    assert all(v.forward > 0 and v.batch_fraction == 1.0 for v in t.values())
    assert all(v.backward > 0 for v in t.values())  # every node creates autograd nodes
    for other in ("_0", "_1", "_2", "_4"):
        assert t["_3"].forward > 5 * t[other].forward, (other, t)
        assert t["_3"].backward > 5 * t[other].backward, (other, t)
    assert t["_3"].forward + t["_3"].backward > 0.5 * (prof.forward + prof.backward)
    assert t["_2"].backward < t["_3"].backward / 5


def test_profile_asks_for_at_least_one_timed_step() -> None:
    with pytest.raises(ValueError, match="repeats"):
        fxpipe.profile(mlp(), (X,), repeats=0)


def test_profile_leaves_the_model_and_inputs_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(8, 3, 8, 8, requires_grad=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = fxpipe.profile(model, (x,), plan=fxpipe.Plan(microbatches=2), repeats=2)
    assert prof.times["_1"].backward > 0 and prof.times["_1"].batch_fraction == 0.5
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats, num_batches_tracked
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is None and model.training


def test_profile_sums_match_an_eager_training_step(one_thread) -> None:
    model, x = wide_mlp(), torch.randn(64, 8)
    micro = x[:16]

    def step() -> float:
        start = time.perf_counter()
        model(micro).sum().backward()
        return time.perf_counter() - start

    ratios = []
    for _ in range(3):  # another process taking the core only inflates times: retry
        prof = fxpipe.profile(model, (x,), plan=fxpipe.Plan(microbatches=4), repeats=5)
        eager = min(step() for _ in range(4))
        ratios.append((prof.forward + prof.backward) / eager)
        if 1 / 3 < ratios[-1] < 3:
            break
    assert 1 / 3 < ratios[-1] < 3, ratios


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.linear(x)))


def test_a_stack_of_equal_layers_is_counted_once_per_distinct_node(monkeypatch) -> None:
    """48 equal blocks cost one block's worth of counting: the first Linear (its input
    needs no gradient), then one Linear, GELU and LayerNorm; every other node reuses a count."""
    from fxpipe.passes import node_costs

    counted: list[str] = []
    count = node_costs._count

    def spy(node, *args):
        counted.append(node.name)
        return count(node, *args)

    monkeypatch.setattr(node_costs, "_count", spy)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(32) for _ in range(48)])
    x = torch.randn(8, 32)
    part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["24"]), example_inputs=(x,))
    assert counted == ["_0_linear", "_0_act", "_0_norm", "_1_linear"]
    costs = {n.name: n.meta[COST] for n in part.graph.nodes if COST in n.meta and n.op == "call_module"}
    assert len(costs) == 3 * 48
    assert costs["_47_linear"] == costs["_1_linear"] and costs["_47_norm"] == costs["_0_norm"]
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    linear_flops = sum(c.fwd_flops + c.bwd_flops for name, c in costs.items() if name.endswith("linear"))
    assert linear_flops == counter.get_total_flops()  # only matmuls are counted by flop_counter


def test_backward_splits_into_input_and_weight_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
        nn.Flatten(), nn.Linear(8 * 8 * 8, 16), nn.LayerNorm(16), nn.Linear(16, 4),
    )
    x = torch.randn(4, 3, 8, 8)
    part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["5"]), example_inputs=(x,))
    costs = costs_of(part)
    for name, cost in costs.items():
        assert cost.bwd_input_flops + cost.bwd_weight_flops == pytest.approx(cost.bwd_flops), name
    # I and W, counted apart, add up to what one real backward counts
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    counted = sum(c.fwd_flops + c.bwd_input_flops + c.bwd_weight_flops for c in costs.values() if c.kind in ("conv", "matmul"))
    assert counted == counter.get_total_flops()
    assert {c.kind for c in costs.values()} == {"conv", "matmul", "norm", "elementwise", "view"}
    # the first layer's input needs no gradient: all of its backward is weight gradient
    assert costs["_0"].bwd_input_flops == 0 and costs["_0"].bwd_weight_flops == costs["_0"].bwd_flops > 0
    # a Linear's two matmuls: d/dinput and d/dweight, each 2 x batch x in x out
    assert costs["_7"].bwd_input_flops == costs["_7"].bwd_weight_flops == 2 * 4 * 16 * 4
    assert costs["_3"].bwd_input_flops > 0 and costs["_3"].bwd_weight_flops > 0
    assert costs["_2"].bwd_weight_flops == 0  # ReLU has no weights
    for est in part.estimates():
        assert est.input_grad > 0 and est.weight_grad > 0
        assert est.backward == pytest.approx(est.input_grad + est.weight_grad)


def _meta_snapshot(part: fxpipe.Partitioned) -> list[tuple[str, dict]]:
    graphs = [part.graph] + [s.module.graph for s in part.stages]
    return [(n.name, dict(n.meta)) for g in graphs for n in g.nodes]


def test_views_read_and_never_write_node_meta() -> None:
    """summary, explain, estimates, simulate and to_dot read the costs the compiler wrote."""
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split="auto", microbatches=4)
    part = fxpipe.partition(mlp(), plan, example_inputs=(X,))
    assert all(COST in n.meta for n in part.graph.nodes if n.op in ("call_module", "get_attr"))
    before = _meta_snapshot(part)
    part.summary(), part.explain(), part.estimates(8), part.simulate(), part.simulate(2), part.to_dot()
    after = _meta_snapshot(part)
    assert [name for name, _ in after] == [name for name, _ in before]
    for (name, old), (_, new) in zip(before, after):
        assert new.keys() == old.keys(), name
        assert all(new[k] is old[k] for k in old), name


def conv_net(channels: int, size: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
        nn.ReLU(), nn.Flatten(), nn.Linear(channels * size * size, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, 10),
    )


def calibration_errors(calibrate_on: tuple[nn.Module, torch.Tensor], predict: tuple[nn.Module, torch.Tensor], bound: float) -> list[dict[str, float]]:
    """|log(predicted / measured)| of ``predict``'s step with the nominal and with the
    calibrated device model, up to 3 tries (another process taking the core only
    inflates times) until the calibrated one is within ``bound`` and beats the nominal."""
    import math

    (small, x_small), (big, x_big) = calibrate_on, predict
    profile_plan = fxpipe.Plan(microbatches=2)
    errors = []
    for _ in range(3):  # another process taking the core only inflates times: retry
        cal = fxpipe.profile(small, (x_small,), plan=profile_plan, repeats=3).calibration
        assert cal.nodes == 10 and {"conv", "matmul", "norm", "elementwise"} <= set(cal.forward)  # views take no time above their ops
        measured = fxpipe.profile(big, (x_big,), plan=profile_plan, repeats=3)
        error = {}
        for label, profile in (("nominal", None), ("calibrated", fxpipe.Profile("cpu", {}, cal))):
            part = fxpipe.partition(big, fxpipe.Plan(devices=["cpu:0"], microbatches=2), example_inputs=(x_big,), profile=profile)
            predicted = sum(e.forward + e.backward for e in part.estimates())
            error[label] = abs(math.log(predicted / (measured.forward + measured.backward)))
        errors.append(error)
        if error["calibrated"] < min(error["nominal"], bound):
            break
    return errors


def test_profile_calibration_brings_a_models_estimate_to_its_measured_time(one_thread) -> None:
    """Per-kind rates measured on a network predict that network's step, timed by a fresh
    profile, within 25%, where the nominal FLOP/s and bandwidth are off by 1.5-1.7x here."""
    import math

    net = (conv_net(48, 24, 512), torch.randn(32, 3, 24, 24))
    errors = calibration_errors(net, net, math.log(1.25))
    assert errors[-1]["calibrated"] < min(errors[-1]["nominal"], math.log(1.25)), errors


@pytest.mark.slow
def test_profile_calibration_of_a_small_network_predicts_a_bigger_one(one_thread) -> None:
    """Per-kind rates measured on one small network predict another network of the same
    kinds of layers (other widths and sizes) closer than the nominal spec. Not reliable on
    this machine (docs/cost-model.md, 'Calibration'): the big network's flattened linear
    layer is weight-bound in its backward, the small one's is not, and one rate per kind
    does not carry across that; kept out of the default run."""
    import math

    errors = calibration_errors((conv_net(32, 16, 256), torch.randn(32, 3, 16, 16)), (conv_net(48, 24, 512), torch.randn(32, 3, 24, 24)), math.log(2.5))
    assert errors[-1]["calibrated"] < min(errors[-1]["nominal"], math.log(2.5)), errors


def test_zero_bubble_prediction_runs_i_and_w_with_their_own_times() -> None:
    """predicted_timeline gives I and W actions the stage's predicted input- and
    weight-gradient seconds, so zb-h1's smaller bubble shows before anything runs."""
    import dataclasses

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)])
    plan = fxpipe.Plan(devices=[f"cpu:{k}" for k in range(4)], split=["2", "4", "6"], schedule="zb-h1", microbatches=8)
    part = fxpipe.partition(model, plan, example_inputs=(torch.randn(64, 256),))
    timeline, estimates = part.simulate(), part.estimates()
    latency = DeviceModel.of(plan, "cpu:0").spec.latency
    assert {e.op for e in timeline.events} == {"F", "I", "W"}
    for event in timeline.events:
        est = estimates[event.stage]
        expected = {"F": est.forward, "I": est.input_grad, "W": est.weight_grad}[event.op] + latency
        assert event.end - event.start == pytest.approx(expected)
    one_f_one_b = dataclasses.replace(part, plan=plan.replace(schedule="1f1b")).simulate()
    assert timeline.step_time < one_f_one_b.step_time
    assert timeline.bubble_fraction < one_f_one_b.bubble_fraction
