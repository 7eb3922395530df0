"""The local stage runtime: grad mode, input gradients, dtypes, failures and hangs in bounded time."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from conftest import assert_grads_match, eager_microbatch_step
from torch import nn

import fxpipe

CE = nn.CrossEntropyLoss()


def mlp(width: int = 16, depth: int = 4, classes: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


PLAN = dict(devices=["cpu:0", "cpu:1"], split=["4"], microbatches=4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_under_no_grad_still_computes_every_gradient(schedule: str) -> None:
    model, x, t = mlp(), torch.randn(8, 16), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, {**PLAN, "schedule": schedule}, example_inputs=(x,), loss_fn=CE)
    with torch.no_grad():
        loss = pipe.step(x, target=t)
    torch.testing.assert_close(loss, eager_microbatch_step(ref, (x,), t, CE, 4))
    assert_grads_match(pipe, ref)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_input_gradients_equal_eager(checkpoint: bool) -> None:
    model = mlp().double()
    x, t = torch.randn(10, 16, dtype=torch.float64), torch.randint(0, 3, (10,))
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, {**PLAN, "checkpoint": checkpoint}, example_inputs=(x,), loss_fn=CE)
    x_pipe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    pipe.step(x_pipe, target=t)
    eager_microbatch_step(ref, (x_ref,), t, CE, 4)
    assert x_pipe.grad is not None
    torch.testing.assert_close(x_pipe.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    assert_grads_match(pipe, ref, rtol=1e-12, atol=1e-12)


def test_input_gradient_reaches_the_tensors_it_was_computed_from() -> None:
    """The pipeline's input is a non-leaf: its gradient flows on into the caller's graph."""
    model, emb = mlp().double(), nn.Embedding(20, 16).double()
    ids, t = torch.randint(0, 20, (8,)), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(model, PLAN, example_inputs=(emb(ids).detach(),), loss_fn=CE)
    ref_model, ref_emb = copy.deepcopy(model), copy.deepcopy(emb)
    pipe.step(emb(ids), target=t)
    # eager: one backward through the embedding, of the micro-batches' weighted losses
    sizes = [2, 2, 2, 2]
    total = sum(CE(ref_model(h), tt) * (n / 8) for h, tt, n in zip(ref_emb(ids).split(sizes), t.split(sizes), sizes))
    total.backward()
    torch.testing.assert_close(emb.weight.grad, ref_emb.weight.grad, rtol=1e-12, atol=1e-12)
    assert_grads_match(pipe, ref_model, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_any_floating_dtype_runs_and_matches_eager(dtype: torch.dtype) -> None:
    model = mlp().to(dtype)
    x, t = torch.randn(8, 16, dtype=dtype), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, PLAN, example_inputs=(x,), loss_fn=CE)
    loss = pipe.step(x, target=t)
    assert loss.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, eager_microbatch_step(ref, (x,), t, CE, 4).to(dtype), **tol)
    assert_grads_match(pipe, ref, **tol)


class Sleepy(nn.Module):
    """Sleeps in forward when told to, to stand for a stage that hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seconds = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return self.lin(x)


class TwoPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Sleepy()
        self.b = Sleepy()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.tanh(self.a(x))))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_hanging_stage_fails_the_step_within_the_timeout_naming_it(stage: int) -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["b"], microbatches=4, timeout=1.0, leaf_modules=[Sleepy])
    pipe = fxpipe.compile(TwoPart(), plan, example_inputs=(x,), loss_fn=CE)
    pipe.step(x, target=t)
    sleepy = pipe.stages[stage].module.get_submodule("a" if stage == 0 else "b")
    sleepy.seconds = 4.0
    start = time.monotonic()
    with pytest.raises(fxpipe.PipelineError, match=rf"stage {stage} on cpu:{stage} has been running F{stage}:0 .*Plan.timeout = 1 s") as info:
        pipe.step(x, target=t)
    assert time.monotonic() - start < 1.0 + 2.0
    assert info.value.stage == stage and info.value.microbatch == 0
    sleepy.seconds = 0.0
    time.sleep(4.0)  # the abandoned thread finishes its sleep; the next step runs on a fresh one
    pipe.zero_grad()
    ref = copy.deepcopy(TwoPart())
    ref.load_state_dict(pipe.state_dict())
    loss = pipe.step(x, target=t)
    torch.testing.assert_close(loss, eager_microbatch_step(ref, (x,), t, CE, 4))


def test_a_single_stage_that_hangs_is_caught_too() -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    model = nn.Sequential(Sleepy())
    pipe = fxpipe.compile(model, fxpipe.Plan(microbatches=2, timeout=0.5, leaf_modules=[Sleepy]), example_inputs=(x,), loss_fn=lambda y, t: y.sum())
    sleepy = pipe.stages[0].module.get_submodule("0")
    sleepy.seconds = 2.0
    with pytest.raises(fxpipe.PipelineError, match="stage 0 .* has been running F0:0"):
        pipe.step(x, target=t)
    sleepy.seconds = 0.0


def test_a_raising_stage_stops_the_others_and_no_thread_leaks_across_failed_steps() -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(mlp(), {**PLAN, "microbatches": 8}, example_inputs=(x,), loss_fn=CE)
    calls = []

    def boom(module, args, output):
        calls.append(1)
        raise ValueError("boom")

    pipe.stages[1].module.register_forward_hook(boom)
    before = set(threading.enumerate())  # other tests' threads, whatever becomes of them
    kept = None
    for _ in range(20):
        calls.clear()
        with pytest.raises(fxpipe.PipelineError, match=r"stage 1 on cpu:1 failed in F1:0 .*ValueError: boom"):
            pipe.step(x, target=t)
        assert len(calls) == 1  # stage 1 ran once and the step stopped
        threads = {worker.thread for worker in pipe._executor._threads.values()}
        kept = kept or threads
        assert threads == kept  # a failing (not hung) step keeps its worker threads
        new = [th for th in threading.enumerate() if th not in before and th not in kept]
        assert not new, new


class Blocks(nn.Module):
    """A small transformer block stack with a classifier head."""

    def __init__(self, width: int = 32, depth: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_callers_autocast_reaches_every_stage(schedule: str) -> None:
    model, x, t = Blocks(), torch.randn(8, 6, 32), torch.randint(0, 5, (8,))
    ref = copy.deepcopy(model)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["blocks.2"], microbatches=4, schedule=schedule)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pipe.step(x, target=t)
        expected = eager_microbatch_step(ref, (x,), t, CE, 4)
        out = pipe(x)
    assert out.dtype == torch.bfloat16  # the head ran under autocast, as in eager
    with torch.no_grad():
        plain = pipe(x)
    assert plain.dtype == torch.float32  # and nothing of it sticks to later calls
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-2)
    assert_grads_match(pipe, ref, rtol=5e-2, atol=5e-3)
    # the pipeline's gradients are bf16-autocast ones: far closer to eager's under autocast
    # than to float32 eager's
    name = "blocks.0.linear1.weight"
    fp32 = copy.deepcopy(model)
    eager_microbatch_step(fp32, (x,), t, CE, 4)
    got, bf16_ref, fp32_ref = dict(pipe.named_parameters())[name].grad, dict(ref.named_parameters())[name].grad, dict(fp32.named_parameters())[name].grad
    assert (got - bf16_ref).norm() < 0.1 * (bf16_ref - fp32_ref).norm()


class WithAux(nn.Module):
    """Logits and a mean-reduced auxiliary loss (a 0-d output that is not batched)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return {"logits": self.b(h), "aux": h.pow(2).mean()}


def test_unbatched_outputs_are_merged_as_the_plan_says_or_named() -> None:
    model, x = WithAux().double(), torch.randn(10, 16, dtype=torch.float64)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["b"], microbatches=4)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    with pytest.raises(fxpipe.MicrobatchError, match=r"aux.*output_merge"):
        pipe(x)
    pipe = fxpipe.compile(model, {**plan, "output_merge": {"aux": "mean"}}, example_inputs=(x,))
    out, expected = pipe(x), model(x)
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["aux"], expected["aux"], rtol=1e-12, atol=1e-12)  # 10 -> 3,3,2,2, weighted


class _Recorder:
    """An action hook recording what it sees, in order, per worker thread."""

    def __init__(self, fail_at: str | None = None) -> None:
        self.seen: dict[str, list[tuple[str, str]]] = {}
        self.fail_at = fail_at

    def before(self, action: fxpipe.Action, runner, step) -> None:
        assert runner.index == action.stage and step.ctx.train
        self.seen.setdefault(threading.current_thread().name, []).append(("before", str(action)))
        if str(action) == self.fail_at:
            raise RuntimeError("the hook refuses")

    def after(self, action: fxpipe.Action, runner, step) -> None:
        self.seen.setdefault(threading.current_thread().name, []).append(("after", str(action)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_action_hooks_see_every_action_before_and_after_it_runs_in_schedule_order(schedule: str) -> None:
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(mlp(), {**PLAN, "schedule": schedule}, example_inputs=(x,), loss_fn=CE)
    hook = _Recorder()
    pipe.action_hooks.append(hook)
    pipe.step(x, target=t)
    lists = pipe.part.actions(4, train=True)
    expected = sorted([[(when, str(a)) for a in plan for when in ("before", "after")] for plan in lists])
    assert sorted(hook.seen.values()) == expected
    failing = _Recorder(fail_at="F1:2")
    pipe.action_hooks[:] = [failing]
    with pytest.raises(fxpipe.PipelineError, match=r"stage 1 on cpu:1 failed in F1:2 \(micro-batch 2\): RuntimeError: the hook refuses"):
        pipe.step(x, target=t)


def test_placed_stages_share_the_compiled_graph_and_code_and_run_as_eager() -> None:
    # placement copies no node and generates no code (issue 33): the placed copy is the same
    # program, its tensors the model's; gradients still equal eager's
    from fxpipe.factory import build_pipeline
    from fxpipe.runtime.placement import skeleton

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    reference = copy.deepcopy(model)
    part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=3), example_inputs=(x,))
    pipe = build_pipeline(part, model, loss_fn=nn.MSELoss())
    for compiled, placed in zip(part.stages, pipe.stages):
        assert placed.module.graph is compiled.module.graph and placed.module.graph.owning_module is placed.module
        assert type(placed.module) is type(compiled.module) and placed.module.code == compiled.module.code
        meta = skeleton(placed.module)
        assert type(meta) is type(placed.module) and all(p.is_meta for p in meta.parameters())
    loss = pipe.step(x, target=target)
    eager = nn.MSELoss()(reference(x), target)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=0, atol=1e-12)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)
