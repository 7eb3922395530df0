"""Bad input gets one clear error at compile time (or at the call, for batch shapes)."""

from __future__ import annotations

import copy
import re
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.distributed import MaterializeError, launch
from fxpipe.distributed.materialize import materialize


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


class RootBranch(nn.Module):
    """Branches on tensor values in its own forward: nothing can run whole in its place."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        if h.sum() > 0:  # data-dependent Python control flow in the root
            return h * 2
        return h


def test_untraceable_model_names_module_and_line_for_each_frontend() -> None:
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.partition(RootBranch(), {}, example_inputs=(X,))
    message = str(info.value)
    assert "torch.fx stopped in module 'RootBranch'" in message
    assert "torch.export stopped in module 'RootBranch'" in message
    assert "test_errors.py:" in message and "leaf" in message


def test_untraceable_submodule_runs_whole_and_is_named_with_its_reason() -> None:
    model = DataDependent()
    # one micro-batch: the branch is on the whole batch's values, as in eager
    pipe = fxpipe.compile(model, fxpipe.Plan(microbatches=1), example_inputs=(X,))
    assert pipe.frontend == "fx"
    (callee,) = pipe.part.opaque
    assert callee.name == "inner (Branchy)" and callee.kind == "module"
    assert "control flow" in callee.reason and "test_errors.py:" in callee.line and "x.sum() > 0" in callee.line
    for text in (pipe.summary(), pipe.explain()):
        assert "inner (Branchy)" in text and "control flow" in text
    for x in (X, -X.abs()):  # both branches at run time: the module runs as in eager
        torch.testing.assert_close(pipe(x), model(x))


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
            width = int(x.shape[-1])  # export specialises the size; fx cannot make a traced size an int
            return self.lin(x)[..., :width].relu()

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
    from fxpipe.runtime.inject import injected

    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2), example_inputs=(X,), loss_fn=nn.CrossEntropyLoss())
    with injected("raise:action=F0:0"), pytest.raises(fxpipe.PipelineError, match=r"stage 0 .*F0:0"):
        pipe.step(X, target=torch.zeros(8, dtype=torch.long))


def test_step_without_loss_explains() -> None:
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2), example_inputs=(X,))
    with pytest.raises(fxpipe.PipelineError, match="loss_fn"):
        pipe.step(X, target=torch.zeros(8, dtype=torch.long))


def test_missing_example_inputs_are_asked_for() -> None:
    with pytest.raises(fxpipe.CompileError, match="example_inputs=.*shaped like a training batch"):
        fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"]))


# ------------------------------------------- bad inputs at the call (issue 14, item 5)
X16 = torch.randn(16, 4)


def two_stage_pipe(model: nn.Module | None = None, loss_fn=None) -> fxpipe.Pipeline:
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4)
    return fxpipe.compile(model or mlp(), plan, example_inputs=(X16,), loss_fn=loss_fn or nn.CrossEntropyLoss())


@pytest.mark.parametrize("samples", [4, 12])
def test_a_target_of_another_batch_size_names_both_sizes(samples: int) -> None:
    pipe = two_stage_pipe()
    with pytest.raises(fxpipe.MicrobatchError, match=rf"target has {samples} samples .* the inputs have 16: pass one target row per input sample"):
        pipe.step(X16, target=torch.zeros(samples, dtype=torch.long))


class LogitsAndAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y.pow(2).mean()


def test_a_tuple_output_given_to_a_tensor_loss_says_what_to_pass() -> None:
    ce = nn.CrossEntropyLoss()
    pipe = fxpipe.compile(LogitsAndAux(), {"microbatches": 2}, example_inputs=(X16,), loss_fn=ce)
    t = torch.randint(0, 2, (16,))
    with pytest.raises(fxpipe.PipelineError, match=r"tuple \(Tensor\[8, 2\], Tensor\[\]\).*loss_fn=lambda out, t: ce\(out\[0\], t\)"):
        pipe.step(X16, target=t)
    # the fix the message gives works, and equals eager
    model = LogitsAndAux()
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, {"microbatches": 2}, example_inputs=(X16,), loss_fn=lambda out, t: ce(out[0], t))
    torch.testing.assert_close(pipe.step(X16, target=t), ce(ref(X16)[0], t))


class BadGuard(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fxpipe.device_guard("tpu:0"):  # the line the error must name
            return self.lin(x)


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_an_unknown_device_in_device_guard_is_reported_at_the_users_line(frontend: str) -> None:
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "device_guard(\"tpu:0\")" in text)
    with pytest.raises(fxpipe.DeviceError, match=rf"device_guard\('tpu:0'\) at .*test_errors.py:{line} in forward\(\): unknown device 'tpu:0'; use 'cpu'") as info:
        fxpipe.compile(BadGuard(), {"frontend": frontend}, example_inputs=(X16,))
    frames = traceback.extract_tb(info.value.__traceback__)
    assert (frames[-2].name, frames[-2].lineno) == ("forward", line)  # the raise is device_guard's own line
    with pytest.raises(fxpipe.DeviceError, match=rf"test_errors.py:{line} in forward"):
        BadGuard()(X16)  # eagerly too


def test_weights_given_to_a_single_process_compile_are_refused() -> None:
    with pytest.raises(MaterializeError, match="this compile runs in one process.*model.load_state_dict"):
        fxpipe.compile(mlp(), {}, example_inputs=(X16,), weights=mlp().state_dict())


def malformed_checkpoints(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    from safetensors.torch import save_file

    state = mlp().state_dict()
    good_pt, good_st = tmp_path / "good.pt", tmp_path / "good.safetensors"
    torch.save(state, good_pt)
    save_file(state, good_st)
    cases = {
        "garbage.pt": (b"not a checkpoint", "not a zip archive"),
        "truncated.pt": (good_pt.read_bytes()[:200], "not a zip archive"),
        "truncated.safetensors": (good_st.read_bytes()[:-10], "not a readable .safetensors file .*incomplete metadata"),
        "garbage.safetensors": (b"\x10" + bytes(7) + b"{not json}", "not a readable .safetensors file"),
    }
    out = {}
    for name, (data, problem) in cases.items():
        (tmp_path / name).write_bytes(data)
        out[name] = (tmp_path / name, problem)
    torch.save({"model": state, "step": 3}, tmp_path / "training.pt")
    out["training.pt"] = (tmp_path / "training.pt", r"'model' \(OrderedDict\), 'step' \(int\).*weights=torch.load\(path\)\['model'\]")
    torch.save(list(state.values()), tmp_path / "list.pt")
    out["list.pt"] = (tmp_path / "list.pt", "holds a list, not a state dict")
    torch.save(mlp(), tmp_path / "module.pt")
    out["module.pt"] = (tmp_path / "module.pt", r"Python objects besides tensors \(a torch.nn.modules.container.Sequential\)")
    out["missing.pt"] = (tmp_path / "missing.pt", "no such file")
    return out


def test_a_malformed_checkpoint_names_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    stage = fxpipe.partition(mlp(), {}, example_inputs=(X16,)).stages[0].module
    for path, problem in malformed_checkpoints(tmp_path).values():
        with pytest.raises(MaterializeError, match=rf"weights='{re.escape(str(path))}'.*{problem}"):
            materialize({0: stage}, torch.device("cpu"), str(path), {})
    with pytest.raises(MaterializeError, match=r"weights\['0.weight'\] is a str, not a tensor"):
        materialize({0: stage}, torch.device("cpu"), {"0.weight": "oops"}, {})


def compile_from(path: str) -> str:
    x = torch.randn(8, 4)
    try:
        fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], timeout=30), example_inputs=(x,), weights=path)
    except MaterializeError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(150)
def test_a_malformed_checkpoint_in_a_distributed_compile_names_the_file_on_every_rank(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "mlp.safetensors"
    save_file(mlp().state_dict(), path)
    path.write_bytes(path.read_bytes()[:-10])
    for message in launch(compile_from, 2, (str(path),), timeout=120):
        assert f"weights='{path}' is not a readable .safetensors file" in message, message


# ------------------------------------------- every mistake gets a one-line answer (issue 32)
def one_line(err: BaseException) -> str:
    message = str(err)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"devices": 5}, r"plan\.devices = 5 \(int\): give a list of device names, one per stage, e\.g\. \['cpu:0', 'cpu:1'\]"),
        ({"split": 5}, r"plan\.split = 5 \(int\): give 'tags', 'auto' or a list of module paths"),
        ({"device_specs": 5}, r"plan\.device_specs = 5 \(int\): give a dict of device name -> fxpipe\.DeviceSpec"),
        ({"output_merge": ["1"]}, r"plan\.output_merge = \['1'\] \(list\): give a dict of output path"),
        ({"leaf_modules": "Branchy"}, r"plan\.leaf_modules = 'Branchy' \(str\): give a list of module classes or qualified names"),
        ({"concrete_args": 3}, r"plan\.concrete_args = 3 \(int\): give a dict of forward argument name -> value, or None"),
    ],
)
def test_plan_fields_of_the_wrong_type_are_named(fields: dict, match: str) -> None:
    with pytest.raises(fxpipe.PlanError, match=match) as info:
        fxpipe.Plan(**fields)
    one_line(info.value)


def test_a_loss_fn_that_is_not_callable_is_refused_at_compile() -> None:
    with pytest.raises(fxpipe.CompileError, match=r"loss_fn = 5 \(int\) is not callable: pass a function of \(output, target\)") as info:
        fxpipe.compile(mlp(), {}, example_inputs=(X16,), loss_fn=5)
    one_line(info.value)
    pipe = fxpipe.compile(mlp(), {}, example_inputs=(X16,))
    with pytest.raises(fxpipe.LossFunctionError, match=r"loss_fn = 'ce' \(str\) is not callable"):
        pipe.step(X16, target=torch.zeros(16, dtype=torch.long), loss_fn="ce")


def test_example_inputs_none_asks_for_an_example_batch() -> None:
    with pytest.raises(fxpipe.CompileError, match=r"example_inputs=None: pass example_inputs=\(x, \.\.\.\), the arguments of Sequential\.forward") as info:
        fxpipe.compile(mlp(), {}, example_inputs=None)
    one_line(info.value)


def test_data_parallel_in_one_process_is_refused() -> None:
    with pytest.raises(fxpipe.PlanError, match=r"plan\.data_parallel=2 .* this one runs alone \(world size 1\): launch under torchrun") as info:
        fxpipe.compile(mlp(), {"data_parallel": 2}, example_inputs=(X16,))
    one_line(info.value)
    assert fxpipe.partition(mlp(), {"data_parallel": 2}, example_inputs=(X16,)).plan.data_parallel == 2  # planning stays possible


def ran_no_stage(pipe: fxpipe.Pipeline) -> bool:
    return all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(), lambda out, t: nn.functional.cross_entropy(out, t)], ids=["module", "function"])
def test_a_step_without_target_names_loss_fn_before_any_stage_runs(loss_fn) -> None:
    pipe = two_stage_pipe(loss_fn=loss_fn)
    with pytest.raises(fxpipe.LossFunctionError, match=r"pipe\.step got no target, and loss_fn \((CrossEntropyLoss|<lambda>)\) needs one: pass target=t") as info:
        pipe.step(X16)
    one_line(info.value)
    assert ran_no_stage(pipe)


def test_a_loss_fn_that_ignores_its_target_runs_without_one() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    pipe = two_stage_pipe(model, loss_fn=lambda out, _: out.pow(2).mean())
    torch.testing.assert_close(pipe.step(X16), ref(X16).pow(2).mean())


@pytest.mark.parametrize(
    ("loss_fn", "returned", "fix"),
    [
        (nn.CrossEntropyLoss(reduction="none"), r"returned a Tensor\[4\]", r"reduce it to one number \(reduction='mean' or 'sum'"),
        (lambda out, t: float(out.sum()), r"returned a Python float \(", r"return the tensor itself, not \.item\(\)"),
        (lambda out, t: None, "returned None", "return the loss tensor"),
    ],
    ids=["reduction-none", "float", "none"],
)
def test_a_loss_fn_result_that_is_not_a_scalar_tensor_is_named(loss_fn, returned: str, fix: str) -> None:
    pipe = two_stage_pipe(loss_fn=loss_fn)
    with pytest.raises(fxpipe.PipelineError, match=rf"loss_fn \(\S+\) {returned}.*not a scalar tensor that backward can start from: {fix}") as info:
        pipe.step(X16, target=torch.zeros(16, dtype=torch.long))
    one_line(info.value)


def test_load_state_dict_of_another_shape_names_the_key_and_both_shapes() -> None:
    pipe = two_stage_pipe()
    state = pipe.state_dict()
    state["2.weight"] = torch.zeros(8, 5)
    before = pipe.state_dict()["0.weight"].clone()
    with pytest.raises(ValueError, match=r"load_state_dict: 1 tensor\(s\) of another shape \(2\.weight: \[8, 5\] given, \[8, 8\] in the model\)") as info:
        pipe.load_state_dict({k: v + 1 if k == "0.weight" else v for k, v in state.items()})
    one_line(info.value)
    torch.testing.assert_close(pipe.state_dict()["0.weight"], before)  # nothing loaded


def test_assumption_error_is_a_trace_error() -> None:
    from fxpipe.passes.assumed import AssumptionError, check_assumed

    assert issubclass(AssumptionError, fxpipe.TraceError)
    with pytest.raises(fxpipe.TraceError, match="the trace followed the branch of"):
        check_assumed(3, 1, "if n > 1 (model.py:4)")


# ------------------------------------------- inputs the program was not traced for (issue 32)
def nine_features() -> nn.Sequential:
    return nn.Sequential(nn.Linear(9, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))


@pytest.mark.parametrize(
    ("given", "match"),
    [
        (torch.randn(16, 9, dtype=torch.float64), r"'input' is f64\[\*, 9\] where it was traced as f32\[\*, 9\].*: pass input\.to\(torch\.float32\)"),
        (torch.ones(16, 9, dtype=torch.int64), r"'input' is i64\[\*, 9\] where it was traced as f32\[\*, 9\].*: pass input\.to\(torch\.float32\)"),
        (torch.randn(16, 8), r"'input' is f32\[\*, 8\] where it was traced as f32\[\*, 9\].*: give input the traced sizes after the batch dimension \[9\]"),
    ],
    ids=["float64", "int64", "8-features"],
)
def test_an_input_the_model_was_not_traced_for_is_named_before_any_stage_runs(given: torch.Tensor, match: str) -> None:
    pipe = fxpipe.compile(nine_features(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"]), example_inputs=(torch.randn(16, 9),), loss_fn=nn.CrossEntropyLoss())
    for call in (lambda: pipe.step(given, target=torch.zeros(16, dtype=torch.long)), lambda: pipe(given), lambda: pipe(microbatches=[given[:8], given[8:]])):
        with pytest.raises(fxpipe.InputError, match="Sequential.forward's argument " + match) as info:
            call()
        assert "compile with example_inputs of this kind" in one_line(info.value)
    assert ran_no_stage(pipe) and len(pipe.signatures) == 1  # nothing ran, nothing was traced again


class Tokens(nn.Module):
    """Embeds token ids and mixes positions: any sequence length and int32 ids fit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids))).mean(1)


def test_inputs_a_new_signature_serves_still_run_as_eager() -> None:
    model = Tokens()
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["head"], microbatches=2), example_inputs=(torch.randint(0, 10, (4, 5)),))
    for ids in (torch.randint(0, 10, (4, 7)), torch.randint(0, 10, (4, 5), dtype=torch.int32)):  # another length; int32 ids
        torch.testing.assert_close(pipe(ids), model(ids))
    with pytest.raises(fxpipe.InputError, match=r"'ids' is f32\[\*, 5\] where it was traced as i64\[\*, 5\]"):
        pipe(torch.rand(4, 5))


def test_an_unknown_split_point_lists_the_nearest_module_names() -> None:
    import torchvision

    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["layer9"])
    with pytest.raises(fxpipe.AnnotateError, match=r"'layer9' is not a module of the model; nearest: layer1, layer2, layer3, layer4"):
        fxpipe.partition(torchvision.models.resnet18(num_classes=4), plan, example_inputs=(torch.randn(2, 3, 32, 32),))
    with pytest.raises(fxpipe.AnnotateError, match=r"'blocks' is not a module of the model; the model's top-level modules are 0, 1, 2, 3, 4"):
        fxpipe.partition(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["blocks"]), example_inputs=(X,))


def test_an_example_of_a_dtype_the_kernels_refuse_is_a_compile_error() -> None:
    with pytest.raises(fxpipe.CompileError, match=r"example_inputs \(float64\[8, 4\]\) meet Sequential's float32 parameters where real kernels refuse mixed dtypes \(addmm") as info:
        fxpipe.compile(mlp(), {}, example_inputs=(X.double(),))
    one_line(info.value)
    assert fxpipe.compile(mlp().double(), {}, example_inputs=(X.double(),))(X.double()).dtype == torch.float64
