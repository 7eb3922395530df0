"""Bad input gets one clear error at compile time (or at the call, for batch shapes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent Python control flow
            return self.lin(x)
        return x


X = torch.randn(8, 4)


def test_untraceable_model_names_module_and_line_for_each_frontend() -> None:
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.partition(DataDependent(), {}, example_inputs=(X,))
    message = str(info.value)
    assert "torch.fx stopped in module 'inner'" in message
    assert "torch.export stopped in module 'inner'" in message
    assert "test_errors.py:" in message and "leaf" in message


def test_leaf_module_makes_an_untraceable_model_traceable() -> None:
    part = fxpipe.partition(DataDependent(), fxpipe.Plan(frontend="fx", leaf_modules=[Branchy]), example_inputs=(X,))
    assert part.frontend == "fx"
    part = fxpipe.partition(DataDependent(), fxpipe.Plan(frontend="fx", leaf_modules=["inner"]), example_inputs=(X,))
    assert "inner" in part.stages[0].module.code


def test_fx_failure_falls_back_to_export_and_says_so() -> None:
    class Shapey(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] == 4:  # fine for export (static shape), fails under fx (proxy bool)
                return self.lin(x).relu()
            return x

    with pytest.warns(UserWarning, match="traced with torch.export instead"):
        part = fxpipe.partition(Shapey(), {}, example_inputs=(X,))
    assert part.frontend == "export"
    assert any("torch.fx could not trace" in n for n in part.notes)


@pytest.mark.parametrize("bad", ["tpu:0", "gpu0", "cuda:x"])
def test_unknown_device_is_named(bad: str) -> None:
    with pytest.raises(fxpipe.DeviceError, match=r"plan\.devices\[1\].*" + bad.replace(":", ".")):
        fxpipe.Plan(devices=["cpu", bad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_plan_partitions_without_gpu_but_does_not_compile() -> None:
    plan = fxpipe.Plan(devices=["cpu", "gpu:0"], split=["2"])
    part = fxpipe.partition(mlp(), plan, example_inputs=(X,))
    assert part.devices == ["cpu", "cuda:0"] and "cuda:0" in part.summary()
    with pytest.raises(fxpipe.DeviceError, match=r"plan\.devices\[1\] = 'cuda:0'.*fxpipe\.partition"):
        fxpipe.compile(mlp(), plan, example_inputs=(X,))


def test_more_stages_than_the_graph_can_give() -> None:
    with pytest.raises(fxpipe.AnnotateError, match="only 5 compute nodes"):
        fxpipe.partition(mlp(), fxpipe.Plan(devices=[f"cpu:{i}" for i in range(9)], split="auto"), example_inputs=(X,))


def test_unknown_split_point_is_named() -> None:
    with pytest.raises(fxpipe.AnnotateError, match=r"plan\.split\[0\] = 'layer9' is not a module"):
        fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer9"]), example_inputs=(X,))


def test_split_points_out_of_order() -> None:
    with pytest.raises(fxpipe.AnnotateError, match="order forward"):
        fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["4", "2"]), example_inputs=(X,))


def test_device_count_must_match_stage_count() -> None:
    with pytest.raises(fxpipe.PlanError, match="lists 3 device"):
        fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["2"]), example_inputs=(X,))


def test_untagged_model_on_several_devices_asks_for_a_split() -> None:
    with pytest.raises(fxpipe.PlanError, match="no fxpipe.device_guard blocks"):
        fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"]), example_inputs=(X,))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"schedule": "zigzag"}, "plan.schedule"),
        ({"microbatches": 0}, "plan.microbatches"),
        ({"chunks": 2}, "interleaved-1f1b"),
        ({"splitt": "auto"}, "unknown plan field"),
        ({"split": "everywhere"}, "plan.split"),
    ],
)
def test_bad_plan_fields_are_named(fields: dict, match: str) -> None:
    with pytest.raises(fxpipe.PlanError, match=match):
        fxpipe.Plan.coerce(fields)


def test_more_microbatches_than_samples() -> None:
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4), example_inputs=(X,), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(fxpipe.MicrobatchError, match="only 3 samples"):
        pipe.step(X[:3], target=torch.zeros(3, dtype=torch.long))


def test_fewer_microbatches_than_stages_is_allowed() -> None:
    for schedule in ("gpipe", "1f1b"):
        plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=["2", "4"], microbatches=2, schedule=schedule)
        pipe = fxpipe.compile(mlp(), plan, example_inputs=(X,), loss_fn=nn.CrossEntropyLoss())
        assert torch.isfinite(pipe.step(X, target=torch.zeros(8, dtype=torch.long)))


def test_failing_stage_is_named_not_hung() -> None:
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2), example_inputs=(X,), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(fxpipe.PipelineError, match=r"stage 0 .*F0:0"):
        pipe.step(torch.randn(8, 5), target=torch.zeros(8, dtype=torch.long))  # wrong feature size


def test_step_without_loss_explains() -> None:
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2), example_inputs=(X,))
    with pytest.raises(fxpipe.PipelineError, match="loss_fn"):
        pipe.step(X, target=torch.zeros(8, dtype=torch.long))


def test_missing_example_inputs_are_asked_for() -> None:
    with pytest.raises(fxpipe.CompileError, match="example_inputs=.*shaped like a training batch"):
        fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"]))
