"""Tracing never changes the model, the pipeline's names are the model's names, and a trace
specialises exactly on what its TraceKey says (None pattern, constants, baked sizes)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchvision
from conftest import check_pipeline_matches_eager
from staging import SignatureStages, check_against_eager
from torch import nn

import fxpipe
from fxpipe.passes.signature import SignatureError, trace_key
from fxpipe.passes.trace import trace


class CachesProxies(nn.Module):
    """Like timm's levit: caches a value in an attribute the first time forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias_cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "bias" not in self.bias_cache:
            self.bias_cache["bias"] = torch.ones(4) * 0.5
        if not hasattr(self, "scale"):
            self.scale = x.new_ones(()) * 2  # a proxy while tracing
        return self.lin(x) * self.scale + self.bias_cache["bias"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tracing_leaves_no_proxies_behind(frontend: str) -> None:
    model = CachesProxies()
    x = torch.randn(4, 4)
    fxpipe.partition(model, fxpipe.Plan(frontend=frontend), example_inputs=(x,))
    assert not hasattr(model, "scale") and model.bias_cache == {}
    # a second trace of the same instance is as good as the first, and eager still works
    pipe = fxpipe.compile(model, fxpipe.Plan(frontend=frontend), example_inputs=(x,))
    torch.testing.assert_close(pipe(x), model(x))


def test_compile_leaves_batchnorm_statistics_untouched() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    before = copy.deepcopy(model.state_dict())
    for frontend in ("fx", "export"):
        fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], frontend=frontend), example_inputs=(torch.randn(4, 3, 32, 32),))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.training


def test_state_dict_round_trips_with_original_names() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2), example_inputs=(x,))
    assert list(pipe.state_dict()) == list(model.state_dict())
    other = torchvision.models.resnet18(num_classes=10)
    pipe.load_state_dict(other.state_dict())
    pipe.eval()
    other.eval()
    torch.testing.assert_close(pipe(x), other(x))
    with pytest.raises(KeyError, match="missing"):
        pipe.load_state_dict({})


def test_unused_parameters_still_live_in_a_stage() -> None:
    class WithSpare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)  # never called in forward
            self.register_buffer("counter", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = WithSpare()
    pipe = fxpipe.compile(model, {}, example_inputs=(torch.randn(2, 4),))
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(pipe.state_dict()) == list(model.state_dict())


def test_stage_holds_only_its_own_parameters() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2), example_inputs=(x,))
    first = {n for n, _ in pipe.stages[0].module.named_parameters()}
    second = {n for n, _ in pipe.stages[1].module.named_parameters()}
    assert not first & second
    assert all(not n.startswith(("layer3", "layer4", "fc")) for n in first)
    assert first | second == {n for n, _ in model.named_parameters()}
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for p in pipe.parameters())  # the user's own tensors, not copies


def test_pipeline_output_supports_autograd() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    check_pipeline_matches_eager(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=3), (x,), torch.randn(6, 1), nn.MSELoss())
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=3), example_inputs=(x,))
    pipe(x).sum().backward()  # not pipelined, but differentiable
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_pipeline_keeps_no_reference_to_the_users_model(frontend: str) -> None:
    import gc
    import weakref

    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer3"], microbatches=2, frontend=frontend)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    alive = [weakref.ref(m) for m in (model, model.layer3, model.fc)]
    del model
    gc.collect()
    assert all(ref() is None for ref in alive), "the pipeline keeps the user's modules alive"
    assert torch.isfinite(pipe.step(x, target=torch.randint(0, 10, (4,))))
    assert "layer3" in pipe.summary()


# ------------------------------------------------------------ specialised traces
class Masked(nn.Module):
    """Takes another branch when no mask is given, as HF attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        if mask is None:
            h = h.relu()
        else:
            h = h * mask.unsqueeze(-1)
        return self.head(self.body(h).tanh())


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("order", [("none", "mask", "none"), ("mask", "none", "mask")], ids=["none-first", "mask-first"])
def test_mask_none_model_called_both_ways_in_any_order(frontend: str, order: tuple[str, ...]) -> None:
    model = Masked().double()
    ref = copy.deepcopy(model)
    stages = SignatureStages(model, ["body"], frontend=frontend)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    mask = (torch.rand(4, 5) > 0.3).double()
    for which in order:
        check_against_eager(stages, ref, (x,), {} if which == "none" else {"mask": mask})
    assert stages.traces == 2  # one trace per None pattern, each reused
    keys = [str(k) for k in stages.cache]
    assert any("mask: None" in k for k in keys) and any("mask: f64" in k for k in keys)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_call_with_another_none_pattern_is_rejected_not_miscomputed(frontend: str) -> None:
    x = torch.randn(4, 5, 6)
    traced = trace(Masked(), (x,), frontend=frontend)
    with pytest.raises(SignatureError, match=r"mask: None -> f32\["):
        traced.bind_inputs((x,), {"mask": torch.ones(4, 5)})
    assert traced.key_of((x,), {"mask": torch.ones(4, 5)}) != traced.key
    assert traced.key_of((x,), {"mask": None}) == traced.key  # None passed or absent: one call


def test_compiled_pipeline_takes_the_branch_of_its_example() -> None:
    check_pipeline_matches_eager(Masked(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["body"], microbatches=2), (torch.randn(4, 5, 6),), torch.randn(4, 5, 3), nn.MSELoss())


class LengthBranch(nn.Module):
    """Branches on the sequence length: fx follows the example's branch (its key then holds
    the length), torch.export bakes the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if x.shape[1] > 8:
            h = h * 2 - 1
        else:
            h = h.relu()
        return self.head(h)


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_branch_on_sequence_length_is_followed_on_both_sides(frontend: str) -> None:
    model = LengthBranch().double()
    ref = copy.deepcopy(model)
    stages = SignatureStages(model, ["head"], frontend=frontend)
    for length in (6, 12, 6, 9, 8, 12):
        check_against_eager(stages, ref, (torch.randn(3, length, 4, dtype=torch.float64),))
    assert stages.frontend == ("fx" if frontend == "auto" else "export")
    assert stages.traces == 4  # 6, 12, 9, 8: one trace per length


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("dynamic_batch", [True, False])
def test_a_call_at_another_length_is_rejected_not_run_on_the_wrong_branch(dynamic_batch: bool, frontend: str) -> None:
    x = torch.randn(4, 6, 4)
    traced = trace(LengthBranch(), (x,), frontend=frontend, dynamic_batch=dynamic_batch)
    assert str(traced.key) == ("x: f32[*, 6, 4]" if dynamic_batch else "x: f32[4, 6, 4]")
    assert (traced.key_of((torch.randn(3, 6, 4),)) == traced.key) == dynamic_batch
    traced.bind_inputs((torch.randn(8, 6, 4),), {})  # a whole batch of any size binds: micro-batches are the caller's
    longer = torch.randn(4, 12, 4)
    assert traced.key_of((longer,)) != traced.key
    with pytest.raises(SignatureError, match=r"x: f32\[\*, 6, 4\] -> f32\[\*, 12, 4\]"):
        traced.bind_inputs((longer,), {})


def test_a_branch_on_the_batch_size_is_checked_whatever_the_mode() -> None:
    class BatchBranch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.shape[0] > 5 else x

    static = trace(BatchBranch(), (torch.randn(6, 4),), frontend="export", dynamic_batch=False)
    assert static.key_of((torch.randn(3, 4),)) != static.key  # the batch size is in the key
    dynamic = trace(BatchBranch(), (torch.randn(6, 4),), frontend="export", dynamic_batch=True)
    assert "_guards_fn" in dynamic.graph_module.code  # export's guard runs with the graph
    torch.testing.assert_close(dynamic.graph_module(torch.ones(7, 4))[0], torch.full((7, 4), 2.0))
    with pytest.raises(Exception, match=r"Guard failed: x.size\(\)\[0\]"):
        dynamic.graph_module(torch.ones(3, 4))


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("dynamic_batch", [True, False])
def test_a_batch_of_one_does_not_fix_the_batch_size_for_good(dynamic_batch: bool, frontend: str) -> None:
    model = LengthBranch()
    traced = trace(model, (torch.randn(1, 6, 4),), frontend=frontend, dynamic_batch=dynamic_batch)
    if dynamic_batch:  # the branch is followed as a batch of 2 takes it: the batch stays free
        assert str(traced.key) == "x: f32[*, 6, 4]"
        x = torch.randn(4, 6, 4)
        assert traced.key_of((x,)) == traced.key  # another batch size: the same graph
        torch.testing.assert_close(traced.build_output(traced.graph_module(x)), model(x))
    else:
        assert str(traced.key) == "x: f32[1, 6, 4]"  # baked, so the key says so
        assert traced.key_of((torch.randn(4, 6, 4),)) != traced.key  # another batch traces again
    again = trace(LengthBranch(), (torch.randn(4, 6, 4),), frontend=frontend, dynamic_batch=dynamic_batch)
    assert again.key_of((torch.randn(4, 6, 4),)) == again.key


class ScaledByDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor = torch.tensor(2.0, dtype=torch.float64)) -> torch.Tensor:  # noqa: B008 - the case under test
        return self.out(self.lin(x) * scale)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tensor_default_is_an_input_and_can_be_overridden(frontend: str) -> None:
    model = ScaledByDefault().double()
    ref = copy.deepcopy(model)
    stages = SignatureStages(model, ["out"], frontend=frontend)
    x = torch.randn(3, 4, dtype=torch.float64)
    check_against_eager(stages, ref, (x,))
    check_against_eager(stages, ref, (x,), {"scale": torch.tensor(-3.0, dtype=torch.float64)})
    assert stages.traces == 1  # the default is bound at call time: one graph serves both
    assert "scale" in [n.name for n in stages.stages_for((x,)).modules[0].graph.nodes if n.op == "placeholder"]


class BufferDerived(nn.Module):
    """Values computed from buffers must be read from the stage's buffers at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.register_buffer("gain", torch.ones(4))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x) * self.gain.clone()
        return self.second(h) + self.shift * 2


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_buffer_derived_values_follow_load_state_dict_and_in_place_updates(frontend: str) -> None:
    model = BufferDerived()
    x = torch.randn(6, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["second"], microbatches=2, frontend=frontend), example_inputs=(x,))
    assert not any(n.op == "get_attr" and "constant" in str(n.target) for s in pipe.stages for n in s.module.graph.nodes)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    pipe.load_state_dict(state)
    model.load_state_dict(state)
    torch.testing.assert_close(pipe(x), model(x))
    with torch.no_grad():
        pipe.state_dict()["shift"].add_(1.5)  # the pipeline's own buffer, updated in place
        model.shift.add_(1.5)
    torch.testing.assert_close(pipe(x), model(x))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_buffer_derived_values_follow_to_and_in_place_updates_at_the_stage_level(frontend: str) -> None:
    model = BufferDerived()
    x = torch.randn(6, 4)
    stages = SignatureStages(model, ["second"], frontend=frontend)
    stages.run((x,))
    with torch.no_grad():
        model.gain.mul_(3)  # the stage modules reference the model's buffers
    torch.testing.assert_close(stages.run((x,)), model(x))
    staged = stages.stages_for((x,))
    for module in staged.modules:
        module.double()
    doubled = copy.deepcopy(model).double()
    # the stage modules take x as their one input (bind_inputs would ask for a float64 trace)
    out = staged.modules[1](*staged.modules[0](x.double()))
    torch.testing.assert_close(staged.traced.build_output(out), doubled(x.double()))


def test_item_assignment_into_a_buffer_is_recorded_under_fx() -> None:
    class History(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("history", torch.zeros(3, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.history[1] = x.detach().mean(0)
            return self.lin(x) + self.history.sum(0)

    model = History()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4)
    traced = trace(model, (x,), frontend="fx")
    assert torch.equal(model.history, ref.history)  # tracing wrote nothing
    torch.testing.assert_close(traced.graph_module(x), ref(x))
    torch.testing.assert_close(traced.graph_module.history, ref.history)  # written at run time


# ------------------------------------------------------------ frontends, quietly
def test_huggingface_model_traces_with_fx_without_warnings_or_output(capfd: pytest.CaptureFixture) -> None:
    model = pytest.importorskip("llm_models").gpt2()
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.1"]), example_inputs=(torch.randint(3, 64, (4, 8)),))
    assert [str(w.message) for w in caught] == []
    out, err = capfd.readouterr()
    # a progress line on a loaded machine at most: nothing from torch
    assert out == "" and all(line.startswith("fxpipe: compil") for line in err.replace("\r", "\n").splitlines() if line.strip())
    assert part.frontend == "fx" and part.notes == []


def test_plan_frontend_still_forces_one() -> None:
    gpt2 = pytest.importorskip("llm_models").gpt2()
    assert fxpipe.partition(gpt2, fxpipe.Plan(frontend="export"), example_inputs=(torch.randint(3, 64, (2, 4)),)).frontend == "export"
    with pytest.raises(fxpipe.TraceError, match="torch.fx stopped"):
        fxpipe.partition(DataDependent(), fxpipe.Plan(frontend="fx"), example_inputs=(torch.randn(2, 4),))
    assert fxpipe.partition(Masked(), fxpipe.Plan(frontend="export"), example_inputs=(torch.randn(2, 3, 6),)).frontend == "export"


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent: neither frontend can trace it
            return h * 2
        return h


def test_both_frontends_failing_is_one_short_error_naming_the_line(capfd: pytest.CaptureFixture) -> None:
    capfd.readouterr()
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.partition(DataDependent(), {}, example_inputs=(torch.randn(2, 4),))
    message = str(info.value)
    assert len(message.splitlines()) <= 5, message
    assert message.count("test_tracing.py:") == 2  # the line, for each frontend
    assert info.value.__cause__ is None and len(info.value.failures) == 2  # details kept, not printed
    assert capfd.readouterr() == ("", "")  # no symbolic-shape logging, no partial graph


class NoneReachesAnOperator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x) + bias  # fails in eager too when bias is None


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
def test_none_reaching_an_operator_names_the_argument_and_the_line(frontend: str) -> None:
    with pytest.raises(fxpipe.TraceError, match=r"(?s)'bias'.*None.*(test_tracing.py:\d+|pass a tensor)") as info:
        fxpipe.partition(NoneReachesAnOperator(), fxpipe.Plan(frontend=frontend), example_inputs=(torch.randn(2, 4),))
    assert "test_tracing.py:" in str(info.value)


def test_trace_key_tells_constants_apart_and_absent_from_default() -> None:
    class Flags(nn.Module):
        def forward(self, x: torch.Tensor, n: int = 1, flag: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x * n if flag else x

    model, x = Flags(), torch.randn(2, 3)
    assert trace_key(model, (x,)) == trace_key(model, (x, 1, True, None))
    assert trace_key(model, (x,), {"n": True}) != trace_key(model, (x,))  # True is not 1
    assert trace_key(model, (x.double(),)) != trace_key(model, (x,))
    assert trace_key(model, (torch.randn(5, 7),)) == trace_key(model, (x,))  # fx reads sizes at run time
    assert trace_key(model, (torch.randn(5, 7),), frontend="export") != trace_key(model, (x,), frontend="export")
    assert str(trace_key(model, (x,), frontend="export")) == "x: f32[2, 3], n: 1, flag: True, mask: None"
    traced = trace(model, (x,), {"flag": False})
    assert "mul" not in traced.graph_module.code  # the branch of flag=False, as a constant
    with pytest.raises(SignatureError, match="flag: False -> True"):
        traced.bind_inputs((x,), {})


def test_keyword_only_arguments_after_varargs_bind_to_their_own_placeholders() -> None:
    class KeywordOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *rest: torch.Tensor, flag: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
            y = self.lin(x)
            if mask is not None:
                y = y * mask
            return y * 2 if flag else y

    model, x = KeywordOnly(), torch.randn(2, 4)
    for kwargs in ({}, {"flag": False}, {"mask": torch.rand(2, 4)}, {"flag": False, "mask": torch.rand(2, 4)}):
        traced = trace(model, (x,), kwargs, frontend="fx")
        torch.testing.assert_close(traced.graph_module(*traced.bind_inputs((x,), kwargs)), model(x, **kwargs))

