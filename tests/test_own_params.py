"""The pipeline's parameters are the model's own objects: an optimizer built on
``model.parameters()`` trains the pipeline exactly as eager trains the model, and an
in-place edit of the model's weights after compile is seen by the next step."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import eager_microbatch_step
from test_distributed import TiedLM  # an embedding tied to the head, the uses on different stages
from torch import nn

import fxpipe
from fxpipe.distributed import launch

MSE = nn.MSELoss()
CE = nn.CrossEntropyLoss()


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.head(torch.relu(self.conv2(x)).mean((2, 3)))



def train_both(model: nn.Module, plan: fxpipe.Plan, batches: list[tuple], loss_fn, lr: float = 0.1):
    """Losses of 3 SGD steps: the pipeline with the optimizer on ``model.parameters()``, and
    eager on a copy made before compiling."""
    ref = copy.deepcopy(model)
    x0 = batches[0][0]
    pipe = fxpipe.compile(model, plan, example_inputs=(x0,), loss_fn=loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    got, expected = [], []
    for x, t in batches:
        got.append(float(pipe.step(x, target=t)))
        opt.step()
        opt.zero_grad()
        expected.append(float(eager_microbatch_step(ref, (x,), t, loss_fn, plan.microbatches)))
        ref_opt.step()
        ref_opt.zero_grad()
    return pipe, ref, got, expected


def test_optimizer_on_model_parameters_trains_an_mlp_as_eager(float64) -> None:
    torch.manual_seed(0)
    model = mlp()
    batches = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(3)]
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2)
    pipe, _, got, expected = train_both(model, plan, batches, MSE)
    assert all(a is b for a, b in zip(pipe.parameters(), model.parameters(), strict=True))
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert got[0] != got[-1]  # it trained


def test_optimizer_on_model_parameters_trains_a_cnn_and_its_batchnorm_as_eager(float64) -> None:
    torch.manual_seed(1)
    model = SmallCNN()
    batches = [(torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))) for _ in range(3)]
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["conv2"], schedule="gpipe", microbatches=3)
    _, ref, got, expected = train_both(model, plan, batches, CE)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    # the running statistics the pipeline updated are the model's own buffers
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-12, atol=1e-12, msg=key)


def test_tied_weights_on_two_devices_train_as_eager_with_the_optimizer_on_the_model(float64) -> None:
    torch.manual_seed(2)
    model = TiedLM()
    batches = [(torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6,))) for _ in range(3)]
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["mid"], schedule="1f1b", microbatches=3)
    pipe, ref, got, expected = train_both(model, plan, batches, CE)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert model.head.weight is model.emb.weight  # the user's module structure as it was
    assert dict(pipe.named_parameters())["emb.weight"] is model.emb.weight
    torch.testing.assert_close(model.emb.weight, ref.emb.weight, rtol=1e-12, atol=1e-12)


def test_an_edit_of_the_models_weights_after_compile_is_seen(float64) -> None:
    torch.manual_seed(3)
    model = mlp()
    x, t = torch.randn(8, 8), torch.randn(8, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=2), example_inputs=(x,), loss_fn=MSE)
    with torch.no_grad():
        model[2].weight.mul_(3.0)
        model[4].bias.add_(1.0)
    torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=1e-12)
    model.load_state_dict(mlp().state_dict())  # load_state_dict copies in place too
    torch.testing.assert_close(pipe(x), model(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pipe.step(x, target=t), MSE(model(x), t), rtol=1e-12, atol=1e-12)


def test_gpt2_with_tied_embeddings_trains_as_eager_with_the_optimizer_on_the_model(float64) -> None:
    from llm_models import VOCAB, gpt2

    torch.manual_seed(4)
    model = gpt2(layers=2)
    assert model.lm_head.weight is model.transformer.wte.weight
    ref = copy.deepcopy(model)

    def lm_loss(out, target):
        return CE(out.logits.flatten(0, 1), target.flatten())

    lengths = [8, 8, 6]  # the last step another signature: its stages share the same parameters
    batches = [(torch.randint(0, VOCAB, (4, n)), torch.randint(0, VOCAB, (4, n))) for n in lengths]
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.1"], microbatches=2, frontend="export")
    pipe = fxpipe.compile(model, plan, example_inputs=(batches[0][0],), loss_fn=lm_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, t in batches:
        loss = pipe.step(x, target=t)
        opt.step()
        opt.zero_grad()
        expected = eager_microbatch_step(ref, (x,), t, lm_loss, 2)
        ref_opt.step()
        ref_opt.zero_grad()
        assert float(loss) == pytest.approx(float(expected), rel=1e-10)
    assert len(pipe.signatures) == 2
    # every signature's stages run on the model's own objects (and the head's one replica)
    own = {id(p) for p in model.parameters()} | {id(r) for group in pipe._placement.tied for r in group.replicas}
    for program in pipe._programs.values():
        held = {id(p) for runner in program.runners.values() for p in runner.module.parameters()}
        assert held and held <= own
    assert model.lm_head.weight is model.transformer.wte.weight
    torch.testing.assert_close(model.transformer.wte.weight, ref.transformer.wte.weight, rtol=1e-10, atol=1e-12)


def own_params_rank() -> dict:
    """One rank of a 2-stage TiedLM trained by an optimizer on ``model.parameters()``."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(5)
    model = TiedLM()
    batches = [(torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6,))) for _ in range(3)]
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu", "cpu"], split=["mid"], microbatches=3), example_inputs=(batches[0][0],), loss_fn=CE)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for x, t in batches:
        losses.append(float(pipe.step(x, target=t)))
        opt.step()
        opt.zero_grad()
    own = all(p is dict(model.named_parameters())[n] for n, p in pipe.named_parameters())
    return {"losses": losses, "own": own, "names": [n for n, _ in pipe.named_parameters()]}


def test_optimizer_on_model_parameters_trains_as_eager_on_two_ranks(float64) -> None:
    torch.manual_seed(5)
    ref = TiedLM()
    batches = [(torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6,))) for _ in range(3)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    expected = []
    for x, t in batches:
        expected.append(float(eager_microbatch_step(ref, (x,), t, CE, 3)))
        opt.step()
        opt.zero_grad()
    ranks = launch(own_params_rank, 2, timeout=120)
    for rank in ranks:
        assert rank["own"] and rank["names"]
        assert rank["losses"] == pytest.approx(expected, rel=1e-12, abs=0)
    assert "emb.weight" in ranks[0]["names"] and "mid.weight" in ranks[1]["names"]


class Scaled(nn.Module):
    """A forward that reads Python attributes: one baked into the trace, one read by a leaf module."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(0.1)
        self.b = nn.Linear(4, 2)
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)) * self.scale)


@pytest.mark.parametrize(("path", "value"), [("scale", 2.0), ("act.negative_slope", 0.3)])
def test_an_attribute_changed_after_compile_is_named_never_used_stale(path: str, value: float) -> None:
    from fxpipe.runtime.attributes import AttributeChangedError

    model, x = Scaled(), torch.randn(6, 4)
    pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["b"], microbatches=2), example_inputs=(x,), loss_fn=MSE)
    pipe.step(x, target=torch.randn(6, 2))
    torch.testing.assert_close(pipe(x), model(x))
    owner, name = (model, path) if "." not in path else (model.act, path.split(".")[1])
    old = getattr(owner, name)
    setattr(owner, name, value)
    with pytest.raises(AttributeChangedError, match=rf"attribute '{path}' changed after compile \(it was {old}, now {value}\)"):
        pipe(x)
    with pytest.raises(AttributeChangedError, match=path):
        pipe.step(x, target=torch.randn(6, 2))
    setattr(owner, name, old)  # set back: the compiled stages are right again
    torch.testing.assert_close(pipe(x), model(x))
