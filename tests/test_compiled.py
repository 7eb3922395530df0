"""Compiled stages (``Plan(compile=...)``) and models the user compiled themselves.

Inductor takes tens of seconds a graph on two cores: the default run compiles one 2-stage
pipeline of a 2-block model (about 30 s); the schedule x dtype x recompute grid is marked
``compile_grid`` and runs with ``make test-compile``. User-compiled blocks run in a
subprocess (the failure they pin was a SIGSEGV), once under a 2-rank torchrun on gloo with
``Plan(compile=True)``.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._functorch.aot_autograd import aot_function

import fxpipe
from fxpipe.plan import PlanError
from fxpipe.runtime import split_backward
from fxpipe.runtime.runner import StageRunner


class Block(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(self.ln(x))))


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, p: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, p) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _step(pipe, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for _, p in pipe.named_parameters():
        p.grad = None
    torch.manual_seed(1)  # the step's dropout seed comes from the global generator
    loss = pipe.step(x, target=t)
    return loss.detach(), {name: p.grad.clone() for name, p in pipe.named_parameters()}


def compiled_against_eager(schedule: str, dtype: torch.dtype, checkpoint, p: float = 0.1):
    """One step of the same model and batch through eager and compiled stages; returns the
    largest difference over the loss and every gradient, and the compiled pipeline."""
    torch.manual_seed(0)
    depth, chunks = (4, 2) if schedule in ("interleaved-1f1b", "zb-v", "v-half", "v-min", "dualpipev") else (2, 1)
    model = Blocks(depth=depth, p=p).to(dtype)
    x, t = torch.randn(8, 5, 16, dtype=dtype), torch.randn(8, 5, 4, dtype=dtype)
    plan = fxpipe.Plan(
        devices=["cpu:0", "cpu:1"], split=[f"blocks.{i}" for i in range(1, depth)], schedule=schedule, chunks=chunks,
        checkpoint=checkpoint, microbatches=4,
    )
    eager = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.MSELoss())
    compiled = fxpipe.compile(model, plan.replace(compile=True), example_inputs=(x,), loss_fn=nn.MSELoss())
    loss_e, grads_e = _step(eager, x, t)
    loss_c, grads_c = _step(compiled, x, t)
    assert list(grads_c) == list(grads_e)
    worst = max([float((loss_c - loss_e).abs())] + [float((grads_c[k] - grads_e[k]).abs().max()) for k in grads_e])
    return worst, compiled, (x, t)


def _graphs(pipe) -> list[int]:
    return [r.compiled.graphs for program in pipe._programs.values() for r in program.runners.values() if r.compiled is not None]


def _mixed_recompute_1f1b() -> tuple:
    # stage 0 recomputes (its forward compiled twice: without and with autograd), stage 1 keeps
    worst, pipe, (x, t) = compiled_against_eager("1f1b", torch.float64, [True, False], p=0.1)
    assert worst < 1e-9, worst
    graphs = _graphs(pipe)
    assert all(g >= 1 for g in graphs), graphs
    return pipe, graphs, x, t


# make test-compile: a second step compiled one more graph in 1 of 4 full make test runs of
# this session (never alone), a flake not yet understood; the grid checks it for every schedule
@pytest.mark.compile_grid
@pytest.mark.timeout(600)
def test_compiled_1f1b_stages_with_recompute_and_dropout_do_not_recompile() -> None:
    pipe, graphs, x, t = _mixed_recompute_1f1b()
    _step(pipe, x, t)
    assert _graphs(pipe) == graphs  # a second step compiles nothing


@pytest.mark.timeout(600)
def test_compiled_1f1b_stages_equal_eager_in_float64_with_recompute_and_dropout() -> None:
    pipe, _, _, _ = _mixed_recompute_1f1b()
    summary = pipe.summary()
    assert re.search(r"stage 0: \d+ graph\(s\) compiled in \d+\.\d s", summary), summary
    assert re.search(r"stage 1: \d+ graph\(s\) compiled in \d+\.\d s", summary), summary


class _WeightGradWatch:
    """Counts the weight gradients compiled stages add, and those added outside a "W"."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.added = self.outside_w = 0
        self._in_w = threading.local()
        accumulate, backward_weight = split_backward.accumulate, StageRunner.backward_weight

        def counted(param: torch.Tensor, grad: torch.Tensor) -> None:
            self.added += 1
            self.outside_w += not getattr(self._in_w, "on", False)
            accumulate(param, grad)

        def weight_action(runner: StageRunner, *args) -> None:
            self._in_w.on = True
            try:
                backward_weight(runner, *args)
            finally:
                self._in_w.on = False

        monkeypatch.setattr(split_backward, "accumulate", counted)
        monkeypatch.setattr(StageRunner, "backward_weight", weight_action)


@pytest.mark.timeout(600)
def test_compiled_zero_bubble_stages_split_their_compiled_backward_into_i_and_w_and_equal_eager(monkeypatch) -> None:
    watch = _WeightGradWatch(monkeypatch)
    worst, pipe, _ = compiled_against_eager("zb-h1", torch.float64, False, p=0.0)
    assert worst < 1e-9, worst
    runners = [r for program in pipe._programs.values() for r in program.runners.values()]
    assert all(r.compiled.split and "weight_grads" not in r.extra_inputs for r in runners)
    # every weight gradient of the compiled stages came from a compiled W, in a "W" action
    assert watch.added > 0 and watch.outside_w == 0, (watch.added, watch.outside_w)
    assert "backward split into I and W" in pipe.summary()


def test_a_backward_graph_partitions_into_input_and_weight_gradients() -> None:
    # the backward AOTAutograd derives for x -> tanh(x @ w1) @ w2: I computes grad x only,
    # W the two weight gradients from what I hands it; together they equal the whole
    captured: list = []

    def keep(gm: torch.fx.GraphModule, _inputs) -> Callable:
        def run(args: list) -> list:
            captured.append((gm, list(args)))
            return gm(*args)

        run._boxed_call = True
        return run

    w1, w2 = torch.randn(4, 4, dtype=torch.float64, requires_grad=True), torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    f = aot_function(lambda x, w1, w2: torch.tanh(x @ w1) @ w2, fw_compiler=lambda gm, _: gm, bw_compiler=keep)
    f(x, w1, w2).sum().backward()
    (backward, real), = captured
    whole = backward(*real)
    parts = split_backward.partition(backward, [False, True, True])
    first = parts.input_grads(*real)
    second = parts.weight_grads(*([real[k] for k in parts.from_inputs] + list(first[1:])))
    torch.testing.assert_close(first[0], whole[0])
    torch.testing.assert_close(list(second), list(whole[1:]))
    assert parts.carried >= 1  # the gradient of tanh's output, which I computes and W reads

    def mms(gm: torch.fx.GraphModule) -> int:
        return sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)

    assert (mms(parts.input_grads), mms(parts.weight_grads)) == (2, 2), (parts.input_grads.code, parts.weight_grads.code)


@pytest.mark.parametrize(
    "value, message",
    [
        (5, r"plan.compile = 5 \(int\): use False, True, or a dict"),
        ({"modes": "default"}, r"unknown option\(s\) \['modes'\]"),
        ({"mode": "max-autotune", "options": {"trace.enabled": True}}, "both 'mode' and 'options'"),
    ],
)
def test_a_bad_plan_compile_is_a_plan_error_naming_the_fix(value, message) -> None:
    with pytest.raises(PlanError, match=message):
        fxpipe.Plan(compile=value)


def test_selectively_recomputed_stages_run_eager_and_say_so() -> None:
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(8, 5, 16)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["blocks.1"], checkpoint=["selective", False], compile={"backend": "eager"})
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.MSELoss())
    runners = next(iter(pipe._programs.values())).runners
    assert runners[0].compiled is None and runners[1].compiled is not None
    assert "stage 0: eager (checkpoint='selective' runs uncompiled)" in pipe.summary()


def test_plan_compile_accepts_a_dict_of_torch_compile_options() -> None:
    plan = fxpipe.Plan(compile={"mode": "reduce-overhead", "dynamic": False})
    assert plan.compile == {"mode": "reduce-overhead", "dynamic": False}


GRID = [
    (schedule, dtype, checkpoint)
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half", "v-min", "dualpipev")
    for dtype in (torch.float64, torch.float32)
    for checkpoint in (False, True)
]


@pytest.mark.compile_grid
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule, dtype, checkpoint", GRID, ids=[f"{s}-{str(d)[6:]}-ckpt{c}" for s, d, c in GRID])
def test_compiled_stages_equal_eager(monkeypatch, schedule: str, dtype: torch.dtype, checkpoint: bool) -> None:
    watch = _WeightGradWatch(monkeypatch)
    worst, pipe, (x, t) = compiled_against_eager(schedule, dtype, checkpoint)
    assert worst < (1e-9 if dtype == torch.float64 else 1e-5), worst
    runners = [r for program in pipe._programs.values() for r in program.runners.values()]
    if any(r.split_backward for r in runners):  # zero bubble: weight gradients from compiled Ws only
        assert all(r.compiled.split for r in runners) and watch.added > 0 and watch.outside_w == 0, (watch.added, watch.outside_w)
    graphs = _graphs(pipe)
    _step(pipe, x, t)
    assert _graphs(pipe) == graphs


@pytest.mark.compile_grid
@pytest.mark.timeout(900)
def test_compiled_zero_bubble_stages_of_the_benchmark_decoder_equal_eager() -> None:
    # the decoder of examples/benchmarks/compiled.py (8 blocks, width 128): with AOTAutograd's
    # donated buffers, I reused saved activations W read later and the final LayerNorm's
    # weight gradient came out 2500x too small
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "benchmarks"))
    from compiled import lm_loss, problem

    model, idx, target, m = problem(quick=False)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["blocks.4"], schedule="zb-h1", microbatches=m)
    steps = []
    for setting in (False, True):
        pipe = fxpipe.compile(model, plan.replace(compile=setting), example_inputs=(idx,), loss_fn=lm_loss)
        loss, grads = _step(pipe, idx, target)
        steps.append((loss, grads))
    (loss_e, grads_e), (loss_c, grads_c) = steps
    assert float((loss_c - loss_e).abs()) < 1e-5
    worst = {k: float((grads_c[k] - grads_e[k]).abs().max() / (grads_e[k].abs().max() + 1e-12)) for k in grads_e}
    assert max(worst.values()) < 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


USER_COMPILED = """
import copy, os, sys, warnings
import torch
from torch import nn
import fxpipe
sys.path.insert(0, {tests!r})
from test_compiled import Blocks

how = sys.argv[1]
torch.manual_seed(0)
model = Blocks()
ref = copy.deepcopy(model)
if how == "wrapped":  # the torchtitan way: each block replaced by its torch.compile wrapper
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
elif how == "in_place":
    for block in model.blocks:
        block.compile(fullgraph=True)
user = torch.compile(model) if how == "model" else model
x, t = torch.randn(8, 5, 16), torch.randn(8, 5, 4)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    plan = fxpipe.Plan(split=["blocks.1"], microbatches=2, compile=sys.argv[2:] == ["compile"])
    pipe = fxpipe.compile(user, plan, example_inputs=(x,), loss_fn=nn.MSELoss())
warned = any("traced through torch.compile" in str(w.message) for w in seen)
loss = pipe.step(x, target=t)
summary = pipe.summary()
ref_loss = nn.MSELoss()(ref(x), t)
ref_loss.backward()
expected = dict(ref.named_parameters())
names = [name for name, _ in pipe.named_parameters()]
err = max([abs(loss.item() - ref_loss.item())] + [float((p.grad - expected[n].grad).abs().max()) for n, p in pipe.named_parameters()])
rank = os.environ.get("RANK", "0")
print(f"rank {{rank}} {{how}} names {{all(n in expected for n in names) and bool(names)}} warned {{warned}} err {{err:.3g}}", flush=True)
"""


def _user_script(tmp_path) -> str:
    script = tmp_path / "user_compiled.py"
    script.write_text(USER_COMPILED.format(tests=str(Path(__file__).parent)))
    return str(script)


def _results(out: str) -> list[tuple[str, str, str, str, float]]:
    return [(r, how, names, warned, float(err)) for r, how, names, warned, err in re.findall(r"rank (\d) (\w+) names (\w+) warned (\w+) err (\S+)", out)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["wrapped", pytest.param("in_place", marks=pytest.mark.slow), "model"])
def test_user_compiled_blocks_trace_through_under_their_own_names(tmp_path, how: str) -> None:
    run = subprocess.run([sys.executable, _user_script(tmp_path), how], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    found = _results(run.stdout)
    assert found and found[0][1:4] == (how, "True", "True"), run.stdout + run.stderr[-2000:]
    assert found[0][4] < 1e-5, found


@pytest.mark.timeout(300)
def test_user_compiled_blocks_run_as_compiled_stages_under_torchrun(tmp_path) -> None:
    # each rank compiles its own stage (Plan(compile=True)): no warning, eager's gradients
    run = subprocess.run(
        [sys.executable, "-m", "fxpipe.distributed", "-n", "2", _user_script(tmp_path), "wrapped", "compile"],
        capture_output=True, text=True, timeout=280,
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    found = sorted(_results(run.stdout))
    assert [r for r, *_ in found] == ["0", "1"], run.stdout + run.stderr[-2000:]
    assert all(names == "True" and warned == "False" and err < 1e-5 for _, _, names, warned, err in found), found


def test_without_compile_wrappers_leaves_the_users_model_compiled() -> None:
    from fxpipe.passes.uncompiled import without_compile_wrappers

    model = Blocks()
    model.blocks[0] = torch.compile(model.blocks[0])
    model.blocks[1].compile()
    model.head.forward = torch.compile(model.head.forward)
    view, found = without_compile_wrappers(torch.compile(model))
    assert found == ["", "blocks.0", "blocks.1", "head"]
    assert "forward" not in view.head.__dict__ and "forward" in model.head.__dict__
    assert [n for n, _ in view.named_parameters()] == [n.replace("_orig_mod.", "") for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(view.parameters(), model.parameters()))
    assert type(model.blocks[0]).__name__ == "OptimizedModule" and model.blocks[1]._compiled_call_impl is not None
    assert view.blocks[1]._compiled_call_impl is None and type(view.blocks[0]) is Block


@torch.compile(fullgraph=True)
def _compiled_mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) + x


class CallsACompiledHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_compiled_mix(self.a(x), self.w))


def test_a_compiled_helper_called_in_forward_is_traced_as_its_python() -> None:
    torch.manual_seed(0)
    model = CallsACompiledHelper()
    ref = copy.deepcopy(model)
    x, t = torch.randn(8, 16), torch.randn(8, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], microbatches=2), example_inputs=(x,), loss_fn=nn.MSELoss())
    loss = pipe.step(x, target=t)
    expected = nn.MSELoss()(ref(x), t)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach())
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    assert "tanh" in pipe.stages[0].module.code  # the helper's ops, not a call of compiled code


def _relative_difference(a: tuple, b: tuple) -> float:
    """The loss difference and each gradient's largest difference relative to its largest entry."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    return max([float((loss_a - loss_b).abs())] + [float((grads_a[k] - grads_b[k]).abs().max() / (grads_b[k].abs().max() + 1e-12)) for k in grads_b])


@pytest.mark.compile_grid
@pytest.mark.timeout(900)
def test_compiled_stages_under_bf16_autocast_stay_within_plain_torch_compiles_difference() -> None:
    torch.manual_seed(0)
    model = Blocks(width=32)
    x, t = torch.randn(8, 5, 32), torch.randn(8, 5, 4)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["blocks.1"], microbatches=4)

    def pipelined(compile: bool) -> tuple:
        # a copy each: the pipeline's parameters are the model's own, and so are their gradients
        pipe = fxpipe.compile(copy.deepcopy(model), plan.replace(compile=compile), example_inputs=(x,), loss_fn=nn.MSELoss())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.step(x, target=t)
        return loss.float(), {n: p.grad.clone() for n, p in pipe.named_parameters()}

    def looped(compile: bool) -> tuple:
        module = copy.deepcopy(model)
        call = torch.compile(module) if compile else module
        total = torch.zeros(())
        for xi, ti in zip(x.chunk(4), t.chunk(4)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.MSELoss()(call(xi), ti) / 4
            loss.backward()
            total = total + loss.detach().float()
        return total, {n: p.grad.clone() for n, p in module.named_parameters()}

    stages = _relative_difference(pipelined(True), pipelined(False))
    plain = _relative_difference(looped(True), looped(False))
    assert stages <= max(plain, 2**-7), (stages, plain)  # 2**-7: two bf16 ulps


@pytest.mark.compile_grid
@pytest.mark.timeout(900)
def test_a_new_sequence_length_compiles_once_then_any_length_reuses_it() -> None:
    # the traced program holds for any sequence length; Dynamo compiles the second length's
    # graphs with that dim dynamic (automatic dynamic shapes), which every later length reuses
    torch.manual_seed(0)
    model = Blocks()
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["blocks.1"], compile=True)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, n, 16), torch.randn(8, n, 4)

    x, t = batch(5)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.MSELoss())
    pipe.step(x, target=t)
    first = _graphs(pipe)
    x, t = batch(7)
    pipe.step(x, target=t)
    second = _graphs(pipe)
    assert all(b > a for a, b in zip(first, second)), (first, second)
    for n in (9, 5, 12):
        x, t = batch(n)
        pipe.step(x, target=t)
    assert _graphs(pipe) == second


REPLICATED = """
import copy, os, sys
import torch
from torch import nn
import fxpipe
sys.path.insert(0, {tests!r})
from test_compiled import Blocks

torch.manual_seed(0)
model = Blocks()
ref = copy.deepcopy(model)
x, t = torch.randn(8, 5, 16), torch.randn(8, 5, 4)
fsdp = sys.argv[1] == "fsdp"
pipe = fxpipe.compile(model, fxpipe.Plan(microbatches=2, data_parallel=2, fsdp=fsdp, compile=True), example_inputs=(x,), loss_fn=nn.MSELoss())
loss = pipe.step(x, target=t)
ref_loss = nn.MSELoss()(ref(x), t)
ref_loss.backward()
expected = dict(ref.named_parameters())
full = [(n, p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in pipe.named_parameters()]
err = max([abs(loss.item() - ref_loss.item())] + [float((g - expected[n].grad).abs().max()) for n, g in full])
graphs = sum("graph(s) compiled" in line for line in pipe.summary().splitlines())
print(f"rank {{os.environ['RANK']}} graphs {{graphs}} err {{err:.3g}}", flush=True)
"""


@pytest.mark.compile_grid
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
def test_compiled_stages_with_data_parallel_replicas_equal_eager_under_torchrun(tmp_path, sharding: str) -> None:
    script = tmp_path / "replicated.py"
    script.write_text(REPLICATED.format(tests=str(Path(__file__).parent)))
    run = subprocess.run([sys.executable, "-m", "fxpipe.distributed", "-n", "2", str(script), sharding], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    found = sorted(re.findall(r"rank (\d) graphs (\d+) err (\S+)", run.stdout))
    assert [r for r, _, _ in found] == ["0", "1"], run.stdout + run.stderr[-2000:]
    assert all(int(graphs) == 1 and float(err) < 1e-5 for _, graphs, err in found), found


def test_memory_hooks_of_a_measured_zero_bubble_step_are_not_compiled_by_dynamo() -> None:
    # autograd calls the saved-tensor hook from the eager code between a compiled stage's
    # graphs (the W split's autograd Functions); Dynamo compiled it anew for every key and hit
    # its recompile limit (eight micro-batches, one process)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from fxpipe.runtime import memory

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks(depth=2)
    x, t = torch.randn(8, 5, 16), torch.randn(8, 5, 4)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["blocks.1"], schedule="zb-h1", microbatches=8, compile={"backend": "eager"})
    with fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.MSELoss()) as pipe:
        pipe.step(x, target=t)  # the first step of a signature is measured
        assert pipe.memory() is not None
        compiled = [fn.__qualname__ for fn in (memory.StageMemory._pack, memory._extent, memory.StageMemory._add) if _debug_get_cache_entry_list(fn.__code__)]
    torch._dynamo.reset()  # nothing of this pipeline outlives the test
    assert not compiled, compiled
