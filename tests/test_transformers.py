"""HuggingFace decoder LMs (traced by torch.fx, the default frontend; torch.export when
asked): equal to eager, tied weights kept tied, train/eval followed."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import assert_grads_match, eager_microbatch_step
from llm_models import VOCAB, gpt2, llama

import fxpipe


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@pytest.mark.parametrize(
    ("build", "split"),
    [(gpt2, ["transformer.h.1", "transformer.h.2"]), (functools.partial(llama, 3), ["model.layers.1", "model.layers.2"])],
    ids=["gpt2", "llama"],
)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_decoder_lm_matches_eager(build, split: list[str], schedule: str) -> None:
    model = build()
    ids = torch.randint(0, VOCAB, (6, 8))
    target = torch.randint(0, VOCAB, (6, 8))
    ref = copy.deepcopy(model)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2"], split=split, schedule=schedule, microbatches=3)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=lm_loss)
    assert pipe.frontend == "fx" and pipe.part.opaque == []  # traced through, masks and attention included
    loss = pipe.step(ids, target=target)
    expected = eager_microbatch_step(ref, (ids,), target, lm_loss, 3)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_grads_match(pipe, ref)
    torch.testing.assert_close(pipe(ids).logits, ref(ids).logits.detach(), rtol=1e-5, atol=1e-5)
    assert list(pipe.state_dict()) == list(ref.state_dict())


def test_gpt2_tied_embedding_stays_tied_after_optimizer_steps() -> None:
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (4, 8))
    target = torch.randint(0, VOCAB, (4, 8))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.2"], microbatches=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=lm_loss)
    # held once per device: stage 0 (embedding) and the last stage (head) each have a copy
    wte = model.transformer.wte.weight

    def copies(stage: fxpipe.Stage) -> list[torch.Tensor]:
        return [p for p in stage.module.parameters() if p.shape == wte.shape and torch.equal(p, wte)]

    (first,), (last,) = copies(pipe.stages[0]), copies(pipe.stages[-1])
    assert first is not last
    names = [n for n, _ in pipe.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        pipe.step(ids, target=target)
        eager_microbatch_step(ref, (ids,), target, lm_loss, 2)
        assert_grads_match(pipe, ref)  # the tied gradient is the sum of both uses
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(pipe(ids).logits, ref(ids).logits.detach(), rtol=1e-4, atol=1e-5)
    state = pipe.state_dict()
    torch.testing.assert_close(state["lm_head.weight"], state["transformer.wte.weight"])


def test_attention_mask_crosses_stages() -> None:
    model = gpt2()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[:, -2:] = 0
    target = torch.randint(0, VOCAB, (4, 8))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.1"], microbatches=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), example_kwargs={"attention_mask": mask}, loss_fn=lm_loss)
    loss = pipe.step(ids, attention_mask=mask, target=target)
    total = torch.zeros(())
    for i in range(2):
        part = slice(2 * i, 2 * i + 2)
        piece = lm_loss(ref(ids[part], attention_mask=mask[part]), target[part]) * 0.5
        piece.backward()
        total += piece.detach()
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-6)
    assert_grads_match(pipe, ref)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_pipeline_follows_train_and_eval_like_the_model(frontend: str) -> None:
    model = gpt2(layers=2, dropout=0.3)  # traced in train mode: dropout active
    ids = torch.randint(0, VOCAB, (4, 8))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["transformer.h.1"], microbatches=2, frontend=frontend)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,))
    assert pipe.frontend == frontend
    if frontend == "export":  # export's literal train flags rewired to the stage's mode
        assert "fxpipe_training" in pipe.stages[0].module.code
    assert not torch.equal(pipe(ids).logits, pipe(ids).logits)  # dropout draws
    pipe.eval()  # fx: a program traced in eval mode (Python reads of self.training follow)
    model.eval()
    torch.testing.assert_close(pipe(ids).logits, model(ids).logits.detach())
