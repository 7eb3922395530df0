"""Vision-language models compile with transformers' defaults and train exactly (issue 34).

Llava (CLIP + Llama) and PaliGemma (SigLIP + Gemma), from config classes with the
library's defaults (``use_cache`` left on), called with ``pixel_values`` and image tokens
in ``input_ids``: fx traces through the multimodal model, so the language model's layers
are split across 2 stages (1F1B, 4 micro-batches). The check that image features and
image tokens match runs whole, on the call's real values. The loss and every gradient
equal eager's, eval logits equal eager's at the batch and below the micro-batch count.
Llava iterates over the batch of images (``list(image_features)``): its stages are traced
once per micro-batch size. Llava in float32 runs by default, the rest of the grid and the
torchrun tests are slow (``make test-llm``); below them, the pieces on small models.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from vlm_models import FAMILIES, IMAGE_TOKEN, image_batch, max_grad_error, rows

import fxpipe

transformers = pytest.importorskip("transformers")

PLAN = dict(devices=["cpu", "cpu"], microbatches=4, schedule="1f1b")
SAMPLE = ("llava", torch.float32)  # in make test; the rest of the grid is slow (make test-llm)
GRID = [
    pytest.param(name, dtype, marks=() if (name, dtype) == SAMPLE else pytest.mark.slow, id=f"{name}-{str(dtype).split('.')[-1]}")
    for name in FAMILIES for dtype in (torch.float32, torch.float64)
]
# float32: rounding; float64: Gemma's RMSNorm computes in float32 inside a float64 model
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}


def logits_loss(out, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=-100)


@pytest.mark.parametrize(("name", "dtype"), GRID)
@pytest.mark.timeout(600)
def test_vlm_family_with_library_defaults_trains_and_evaluates_like_eager(name: str, dtype: torch.dtype) -> None:
    family = FAMILIES[name]
    model = family.build(dtype)
    ref = copy.deepcopy(model)
    call = image_batch(dtype=dtype)
    target = torch.randint(3, 96, call["input_ids"].shape).masked_fill(call["attention_mask"] == 0, -100)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=[family.split], **PLAN), example_kwargs=call, loss_fn=logits_loss)
    assert [c.name for c in pipe.part.opaque] == ["transformers.utils.import_utils.torch_compilable_check"]
    assert [r.target for r in pipe.part.real_runs] == ["opaque_torch_compilable_check"]
    assert any("use_cache" in note for note in pipe.part.notes)

    loss = pipe.step(**call, target=target)
    eager = logits_loss(ref(**call), target)
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    assert max_grad_error(pipe, ref) < GRAD_TOLERANCE[dtype]

    pipe.eval()
    ref.eval()
    with torch.no_grad():
        # a batch of 3 runs 3 micro-batches of one; row 1 is padded (a PaliGemma call
        # without any padding drops its mask in eager, see docs/llm-training.md)
        for picked in (slice(0, 8), slice(0, 3), slice(1, 2)):
            out, expected = pipe(**rows(call, picked)).logits, ref(**rows(call, picked)).logits
            assert torch.allclose(out, expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.slow
def test_image_tokens_that_do_not_match_the_images_raise_the_models_own_error() -> None:
    """The check runs whole per micro-batch, on the call's real values: never on stand-ins."""
    model = FAMILIES["paligemma"].build()
    call = image_batch()
    pipe = fxpipe.compile(model, fxpipe.Plan(split=[FAMILIES["paligemma"].split], **PLAN), example_kwargs=call)
    wrong = {**call, "input_ids": call["input_ids"].masked_fill(call["input_ids"] == IMAGE_TOKEN, 5)}
    with pytest.raises(fxpipe.PipelineError, match="Image features and image tokens do not match"):
        pipe(**wrong)


# ------------------------------------------------------------------ under torchrun
STEPS = 3
LR = 1e-3


def vlm_rank(name: str) -> dict:
    """One rank: compile with transformers' defaults, AdamW steps with global clipping on a
    padded batch, then eval at the batch and at batch 1."""
    model, call = FAMILIES[name].build(), image_batch()
    target = torch.randint(3, 96, call["input_ids"].shape, generator=torch.Generator().manual_seed(1)).masked_fill(call["attention_mask"] == 0, -100)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[FAMILIES[name].split], microbatches=4, schedule="1f1b")
    with fxpipe.compile(model, plan, example_kwargs=call, loss_fn=logits_loss) as pipe:
        return train_and_eval(pipe, call, target, lambda c, t: pipe.step(**c, target=t))


def train_and_eval(pipe_or_model, call: dict, target: torch.Tensor, step) -> dict:
    opt = torch.optim.AdamW(pipe_or_model.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(step(call, target).detach().clone())
        clip = getattr(pipe_or_model, "clip_grad_norm_", None)
        norms.append((clip(1.0) if clip else torch.nn.utils.clip_grad_norm_(pipe_or_model.parameters(), 1.0)).detach().clone())
        opt.step()
        opt.zero_grad()
    pipe_or_model.eval()
    with torch.no_grad():
        outs = [pipe_or_model(**rows(call, picked)) for picked in (slice(0, 8), slice(1, 2))]
    return {
        "losses": losses, "norms": norms, "logits": [None if o is None else o.logits.clone() for o in outs],
        "params": {n: p.detach().clone() for n, p in pipe_or_model.named_parameters()},
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.timeout(600)
def test_vlm_family_under_torchrun_trains_with_adamw_and_clipping_like_eager(name: str) -> None:
    from fxpipe.distributed import launch

    ranks = launch(vlm_rank, 2, (name,), timeout=500)
    model, call = FAMILIES[name].build(), image_batch()
    target = torch.randint(3, 96, call["input_ids"].shape, generator=torch.Generator().manual_seed(1)).masked_fill(call["attention_mask"] == 0, -100)

    def eager_step(c: dict, t: torch.Tensor) -> torch.Tensor:
        loss = logits_loss(model(**c), t)
        loss.backward()
        return loss

    ref = train_and_eval(model, call, target, eager_step)
    for rank in ranks:  # float32: see test_moe_families' torchrun test for the tolerances
        for got, expected in zip(rank["losses"] + rank["norms"], ref["losses"] + ref["norms"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for param, value in rank["params"].items():
            torch.testing.assert_close(value, ref["params"][param], rtol=0, atol=LR / 10, msg=lambda m, p=param: f"{p}: {m}")
    assert set(ranks[0]["params"]) | set(ranks[1]["params"]) == set(ref["params"])
    for got, expected in zip(ranks[1]["logits"], ref["logits"]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert ranks[0]["logits"] == [None, None]


# ------------------------------------------------------------------ the pieces, on small models
class PerSample(nn.Module):
    """Iterates over its batch, as Llava does over its images: one list entry per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        pieces = list(self.a(x))
        h = torch.stack([p * (k + 1) for k, p in enumerate(pieces)])
        return {"out": self.b(h.tanh() + x), "pieces": pieces}


def test_a_model_iterating_over_its_batch_runs_a_trace_per_microbatch_size() -> None:
    torch.manual_seed(0)
    model = PerSample().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], **PLAN), example_inputs=(x,))
    assert pipe.part.batch_lengths and "list(self.a(x))" in pipe.part.batch_lengths[0]
    loss = pipe.step(x, target=None, loss_fn=lambda out, t: out["out"].square().mean())  # micro-batches of 2
    # eager over the same micro-batches: the k in p * (k + 1) counts within each
    expected = sum(model(piece)["out"].square().sum() for piece in x.split(2)) / (8 * 3)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-12)
    for p, q in zip(pipe.parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    with pytest.raises(fxpipe.MicrobatchError, match="exchange other values"):
        pipe.step(x[:7], target=None, loss_fn=lambda out, t: out["out"].square().mean())  # 2, 2, 2, 1: lists of 2 and 1 cross
    for n in (8, 3, 1):
        out = pipe(x[:n])
        assert len(out["pieces"]) == n  # one entry per sample, joined over the micro-batches
        assert torch.allclose(torch.stack(out["pieces"]), model.a(x[:n]))
    assert pipe.signatures == ["x: f64[*, 4] (train)", "x: f64[2, 4] (train)", "x: f64[1, 4] (train)"]


INSTALLS: list[str] = []


class Caching(nn.Module):
    """Installs something once (behind a flag it sets) and caches a traced value on itself in
    forward; tracing fails once in a helper, so the forward is traced twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.installed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.installed:  # HF registers its output-capturing hooks once, so
            if torch.fx._symbolic_trace.is_fx_tracing():  # a retry that set the flag back would register them twice
                INSTALLS.append("hooks")
            self.installed = True
        self.cache = self.lin(x)
        return branchy(self.cache)


def branchy(h: torch.Tensor) -> torch.Tensor:
    if h.sum() > 0:  # a branch on values: this function is made opaque, the forward traced again
        return h * 2
    return h


def test_a_retried_trace_keeps_flags_and_sets_back_traced_attributes() -> None:
    model = Caching()
    x = torch.randn(4, 4)
    part = fxpipe.partition(model, fxpipe.Plan(devices=["cpu"], microbatches=2), example_inputs=(x,))
    assert [c.name for c in part.opaque] == ["test_vlm_families.branchy"]
    assert INSTALLS == ["hooks"]
    assert model.installed is False and "cache" not in vars(model)  # tracing leaves the model as it was


def check_counts(matches: torch.Tensor) -> None:
    """A Python check on values (made opaque), as HF's ``torch_compilable_check``."""
    if not bool(matches):
        raise ValueError("image features and image tokens do not match")


class CountsTokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        features = self.project(images)  # from parameters: the fake run knows its sizes only
        check_counts((ids == 7).sum() * 4 == features.numel())
        return features.sum(-1) + ids.float().mean(-1)


def test_a_check_mixing_token_counts_and_feature_sizes_runs_on_the_examples_real_values() -> None:
    images = torch.randn(4, 4)
    good = torch.tensor([[7, 1], [7, 2], [7, 3], [7, 4]])
    part = fxpipe.partition(CountsTokens(), fxpipe.Plan(devices=["cpu"], microbatches=2), example_inputs=(good, images))
    assert [c.name for c in part.opaque] == ["test_vlm_families.check_counts"]
    with pytest.raises(ValueError, match="do not match"):  # as eager raises; a stand-in True would let it pass
        fxpipe.partition(CountsTokens(), fxpipe.Plan(devices=["cpu"], microbatches=2), example_inputs=(good.clamp(max=6), images))
