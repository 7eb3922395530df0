"""What torch.fx cannot trace runs whole (an opaque call) and the trace goes on around it.

The smallest enclosing function, however it is reached (a module global, a dict of
implementations), else the module; equal to eager in float64 (outputs and every
gradient); listed with its reason by summary() and explain(); randomness inside keyed
(the same masks under every schedule and with checkpoint), autocast reaching inside, a
grad-mode or autocast change inside forward run whole as in eager; a split point or a
device_guard inside one is a compile-time error naming it; what the trace assumed of an
opaque call's output, or of a size it branched on, is checked at run time.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import check_pipeline_matches_eager
from torch import nn

import fxpipe
from fxpipe.passes.annotate import AnnotateError
from fxpipe.passes.assumed import AssumptionError
from fxpipe.passes.opaque import OpaqueCall
from fxpipe.passes.tags import TagError

W = 8
MSE = nn.MSELoss()


def gate(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A branch on a weight's values: fx cannot trace it (the same for every micro-batch)."""
    if w.sum() > 0:
        return h.relu()
    return h.tanh()


ACTIVATIONS = {"gate": gate}


class Layer(nn.Module):
    def __init__(self, lookup: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.lookup = lookup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        act = ACTIVATIONS["gate"] if self.lookup else gate  # reached through a dict, as HF's attention functions
        return x + act(h, self.lin.weight)


class Stack(nn.Module):
    def __init__(self, depth: int = 4, lookup: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(lookup) for _ in range(depth))
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# forward branches on values, so fake tensors cannot tell that the output follows the batch
PLAN = dict(devices=["cpu:0", "cpu:1"], split=["layers.2"], schedule="1f1b", microbatches=4, output_merge={"": "cat"})


def _signs(model: nn.Module, positive: bool) -> nn.Module:
    with torch.no_grad():
        for layer in model.layers:
            layer.lin.weight.abs_() if positive else layer.lin.weight.copy_(-layer.lin.weight.abs())
    return model


@pytest.mark.parametrize("lookup", [False, True], ids=["global", "dict"])
@pytest.mark.parametrize("positive", [True, False], ids=["relu", "tanh"])
def test_an_untraceable_function_runs_whole_and_the_rest_is_traced(lookup: bool, positive: bool) -> None:
    model = _signs(Stack(lookup=lookup).double(), positive)
    x, t = torch.randn(8, W, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    pipe = check_pipeline_matches_eager(model, PLAN, (x,), t, MSE, rtol=1e-10, atol=1e-12)
    (callee,) = pipe.part.opaque
    assert callee.kind == "function" and callee.name.endswith("test_opaque.gate")
    assert "control flow" in callee.reason and "if w.sum() > 0" in callee.line
    calls = [n for s in pipe.stages for n in s.module.graph.nodes if isinstance(n.target, OpaqueCall)]
    assert len(calls) == 4  # one per layer; each layer's Linear stays a traced node of its own
    assert sum(n.op == "call_module" and n.target.endswith(".lin") for s in pipe.stages for n in s.module.graph.nodes) == 4
    for text in (pipe.summary(), pipe.explain()):
        assert "test_opaque.gate (function)" in text and "control flow" in text


class Branchy(nn.Module):
    """A branch on its input's values in its own forward: the module runs whole."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        if h.sum() > 0:
            return h * 2
        return -h


class WithBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.mid = Branchy()
        self.last = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.mid(self.first(x)))


def test_an_untraceable_module_runs_whole_and_a_split_inside_it_is_named() -> None:
    model = WithBranchy().double()
    x, t = torch.randn(6, W, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["mid"], microbatches=1)
    pipe = check_pipeline_matches_eager(model, plan, (x,), t, MSE, rtol=1e-10, atol=1e-12)
    assert [c.name for c in pipe.part.opaque] == ["mid (Branchy)"]
    with pytest.raises(AnnotateError, match=r"(?s)'mid.inner' runs inside mid \(Branchy\).*control flow.*test_opaque.py:\d+"):
        fxpipe.partition(model, dict(plan, split=["mid.inner"]), example_inputs=(x,))


def gated_by(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    out = module(h)
    return out if out.mean() > 0 else -out


class CallsThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.inner = nn.Linear(W, W)
        self.last = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(gated_by(self.inner, self.first(x)))


def test_a_split_point_inside_an_opaque_function_is_named() -> None:
    x = torch.randn(4, W)
    with pytest.raises(AnnotateError, match=r"(?s)'inner' runs inside .*gated_by.*control flow.*test_opaque.py:\d+"):
        fxpipe.partition(CallsThrough(), dict(devices=["cpu:0", "cpu:1"], split=["inner"]), example_inputs=(x,))
    part = fxpipe.partition(CallsThrough(), dict(devices=["cpu:0", "cpu:1"], split=["last"]), example_inputs=(x,))
    assert [sorted(c.modules) for c in part.opaque] == [["inner"]]


class GuardInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            with fxpipe.device_guard("cpu:1"):
                h = self.b(h)
        return h


def test_a_device_guard_inside_an_opaque_callee_is_an_error_naming_it() -> None:
    model = nn.Sequential(nn.Linear(W, W), GuardInside())
    with pytest.raises(TagError, match=r"(?s)device_guard\('cpu:1'\) at .*test_opaque.py:\d+.*inside 1 \(GuardInside\).*control flow.*opaque"):
        fxpipe.partition(model, {}, example_inputs=(torch.ones(4, W),))


def dropped(h: torch.Tensor, w: torch.Tensor, training: bool) -> torch.Tensor:
    if w.sum() > 0:  # fx cannot trace it: the dropout inside runs in the opaque call
        return F.dropout(h, 0.4, training)
    return F.dropout(h.tanh(), 0.4, training)


class DropLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropped(self.lin(x), self.lin.weight, self.training)


@pytest.mark.parametrize("with_dropout", [True, False])
def test_randomness_inside_an_opaque_callee_is_keyed_under_every_schedule(with_dropout: bool) -> None:
    model = nn.Sequential(*[DropLayer() if with_dropout else Layer() for _ in range(4)], nn.Linear(W, 3)).double()
    x, t = torch.randn(10, W, dtype=torch.float64), torch.randint(0, 3, (10,))
    plans = {
        "one stage": dict(microbatches=4),
        "1f1b": dict(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4),
        "interleaved": dict(devices=["cpu:0", "cpu:1"], split=["1", "2", "3"], schedule="interleaved-1f1b", chunks=2, microbatches=4),
        "checkpoint": dict(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4, checkpoint=True),
    }
    results = {}
    for name, plan in plans.items():
        pipe = fxpipe.compile(copy.deepcopy(model), plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
        torch.manual_seed(3)
        results[name] = (pipe.step(x, target=t), {n: p.grad.clone() for n, p in pipe.named_parameters()})
        keyed = "keyed_opaque" in "".join(s.module.code for s in pipe.stages)
        assert keyed == with_dropout  # an opaque call that draws nothing runs without a keyed scope
    loss, grads = results["one stage"]
    for name, (other_loss, other_grads) in results.items():
        torch.testing.assert_close(other_loss, loss, rtol=1e-13, atol=1e-13, msg=name)
        for key, g in grads.items():
            torch.testing.assert_close(other_grads[key], g, rtol=1e-12, atol=1e-13, msg=f"{name}: {key}")


class FullPrecisionHead(nn.Module):
    """Turns autocast off for its second half, as HF's rotary embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            return self.b(h.float())


def test_autocast_reaches_opaque_callees_and_autocast_inside_forward_is_kept() -> None:
    model = nn.Sequential(Layer(), Layer(), FullPrecisionHead())
    x = torch.randn(6, W)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["1"], microbatches=2, output_merge={"": "cat"})
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    reasons = {c.name: c.reason for c in pipe.part.opaque}
    assert "torch.autocast" in reasons["2 (FullPrecisionHead)"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pipe(x)
        expected = model(x)
    assert got.dtype == expected.dtype == torch.float32  # the head left autocast, as in eager
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class Teacher(nn.Module):
    """Part of forward under torch.no_grad(): no gradient reaches the teacher."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(W, W)
        self.student = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.student(x * target)


def test_grad_mode_changed_inside_forward_runs_whole_with_eager_gradients() -> None:
    model = nn.Sequential(nn.Linear(W, W), Teacher()).double()
    x, t = torch.randn(6, W, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    pipe = check_pipeline_matches_eager(model, dict(devices=["cpu:0", "cpu:1"], split=["1"], microbatches=2), (x,), t, MSE, rtol=1e-10, atol=1e-12)
    assert "torch.no_grad" in pipe.part.opaque[0].reason
    assert dict(pipe.named_parameters())["1.teacher.weight"].grad is None


EXTRA = {"on": False}


def maybe_twice(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = h.relu() if w.sum() > 0 else h.tanh()
    return h, (h * 2 if EXTRA["on"] else None)  # a structure fixed by a global, not by the call


class UsesBoth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, extra = maybe_twice(self.lin(x), self.lin.weight)
        return h if extra is None else h + extra


def test_an_opaque_call_returning_another_structure_than_traced_is_named() -> None:
    model, x = UsesBoth(), torch.randn(4, W)
    pipe = fxpipe.compile(model, dict(microbatches=1), example_inputs=(x,))
    torch.testing.assert_close(pipe(x), model(x))
    EXTRA["on"] = True
    try:
        with pytest.raises(Exception, match=r"(?s)test_opaque.maybe_twice returned \(<Tensor>, <Tensor>\) but the trace assumed \(<Tensor>, None\)"):
            pipe(x)
    finally:
        EXTRA["on"] = False


class BatchThreshold(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] > 3:  # a branch on the (micro-)batch size
            h = h * 2
        return h


class Broadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.register_buffer("ones", torch.ones(1, W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = self.ones
        if ones.shape[0] != x.shape[0]:  # only a batch of one goes the other way (as HF's masks)
            ones = ones.expand(x.shape[0], -1)
        return self.lin(x) + ones


def test_a_branch_on_sizes_is_checked_per_micro_batch() -> None:
    model = BatchThreshold()
    pipe = fxpipe.compile(model, dict(microbatches=2), example_inputs=(torch.randn(8, W),))
    for batch in (8, 10):  # micro-batches of 4 and 5: the traced branch
        x = torch.randn(batch, W)
        torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(Exception, match=r"(?s)AssumptionError.*test_opaque.py:\d+: `if x.shape\[0\] > 3:"):
        pipe(torch.randn(6, W))  # micro-batches of 3 would take the other branch
    assert issubclass(AssumptionError, RuntimeError)


def test_a_branch_only_a_batch_of_one_takes_is_followed_as_torch_export_does() -> None:
    model = Broadcast()
    pipe = fxpipe.compile(model, dict(microbatches=2), example_inputs=(torch.randn(4, W),))
    for batch in (4, 3):  # micro-batches of one included: the generic branch computes the same
        x = torch.randn(batch, W)
        torch.testing.assert_close(pipe(x), model(x))
