"""HuggingFace LLMs under torchrun (gloo on 127.0.0.1) train exactly as in eager.

Each family is built from a small random config (4 layers, width 64, 4 heads; T5 2
encoder + 2 decoder blocks; ``use_cache=False``, dropout 0), compiled with the default
frontend (whichever ``frontend="auto"`` picks) and run with
``fxpipe.distributed.launch`` on six layouts: 2 ranks 1F1B, 2 ranks interleaved 1F1B
(chunks=2), 2 ranks ZB-V, 2 ranks DualPipeV, 4 ranks = 2 stages x 2 replicas, and the same
sharded (``fsdp=True``, ZB-H1); batch 8, 4 micro-batches.
One launch per layout runs every variant: float32 and float64, with and without an
``attention_mask`` (whose padded tokens are ``ignore_index`` in the target), an example
batch of 2 or of the step's 8, and the model's own loss (``labels=``). Each variant steps,
clips the global gradient norm, takes an SGD step and steps again; the ranks return their
losses, norm and gradients, and the assertions run here against the eager model doing the
same on the whole batch (``loss_fn(model(**inputs), target).backward()``). A sample runs by
default; the full family x layout grid is marked slow (``make test-llm``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from llm_models import FAMILIES, VOCAB
from torch import nn

import fxpipe
from fxpipe.distributed import launch

BATCH = 8
MICROBATCHES = 4
LENGTH = 8
SIZE = dict(layers=4, width=64, heads=4)
LAUNCH_TIMEOUT = 300


@dataclass(frozen=True)
class Model:
    """A family at the size these tests use, and where its 2 and 4 stages begin."""

    build: Callable[[], nn.Module]
    two_stages: list[str]
    four_stages: list[str]
    seq2seq: bool = False


def _layers(prefix: str, *indices: int) -> list[str]:
    return [f"{prefix}.{i}" for i in indices]


MODELS = {
    "gpt2": Model(functools.partial(FAMILIES["gpt2"].build, **SIZE), _layers("transformer.h", 2), _layers("transformer.h", 1, 2, 3)),
    "llama": Model(functools.partial(FAMILIES["llama"].build, **SIZE), _layers("model.layers", 2), _layers("model.layers", 1, 2, 3)),
    "mistral": Model(functools.partial(FAMILIES["mistral"].build, **SIZE), _layers("model.layers", 2), _layers("model.layers", 1, 2, 3)),
    "qwen2": Model(functools.partial(FAMILIES["qwen2"].build, **SIZE), _layers("model.layers", 2), _layers("model.layers", 1, 2, 3)),
    "opt": Model(functools.partial(FAMILIES["opt"].build, **SIZE), _layers("model.decoder.layers", 2), _layers("model.decoder.layers", 1, 2, 3)),
    "bert": Model(functools.partial(FAMILIES["bert"].build, **SIZE), _layers("bert.encoder.layer", 2), _layers("bert.encoder.layer", 1, 2, 3)),
    # 2 encoder and 2 decoder blocks: the stages begin at the decoder, or at every block
    "t5": Model(
        functools.partial(FAMILIES["t5"].build, layers=2, width=64, heads=4),
        ["decoder.block.0"], ["encoder.block.1", "decoder.block.0", "decoder.block.1"], seq2seq=True,
    ),
}

LAYOUTS = {
    "1f1b": (2, dict(schedule="1f1b")),
    "interleaved": (2, dict(schedule="interleaved-1f1b", chunks=2)),
    "zb-v": (2, dict(schedule="zb-v", chunks=2)),
    "dualpipev": (2, dict(schedule="dualpipev", chunks=2)),
    "dp2x2": (4, dict(schedule="1f1b", data_parallel=2)),
    "fsdp2x2": (4, dict(schedule="zb-h1", data_parallel=2, fsdp=True)),
}


@dataclass(frozen=True)
class Variant:
    """One compile and two steps: the dtype, whether an attention mask is passed (its
    padded tokens are then ``ignore_index`` in the target: a token-mean loss), the batch
    of the example inputs the pipeline is compiled with (the step's is BATCH), and
    whether the loss is the model's own (``labels=``) instead of ``loss_fn``."""

    dtype: torch.dtype
    mask: bool
    example_batch: int
    own_loss: bool = False

    def __str__(self) -> str:
        words = [str(self.dtype).removeprefix("torch.")]
        words += ["mask"] if self.mask else []
        words += ["labels"] if self.own_loss else []
        return " ".join(words + [f"example {self.example_batch}"])


# every dtype with and without a mask, each with one of the two example batches; and the
# model's own loss
VARIANTS = [
    Variant(torch.float32, False, 2),
    Variant(torch.float32, True, BATCH),
    Variant(torch.float64, False, BATCH),
    Variant(torch.float64, True, 2),
    Variant(torch.float64, True, 2, own_loss=True),
]
LR = 0.5
MAX_NORM = 0.5  # below the gradients' norm, so clipping changes them


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def make_case(name: str, variant: Variant) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """The model (the same weights in every process), its inputs and its target."""
    torch.manual_seed(0)
    model = MODELS[name].build().to(variant.dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)
    inputs = {"input_ids": ids}
    if MODELS[name].seq2seq:
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, LENGTH // 2), generator=g)
    target = torch.randint(0, VOCAB, inputs.get("decoder_input_ids", ids).shape, generator=g)
    if variant.mask:
        mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
        for row in range(BATCH):
            mask[row, LENGTH - 1 - row % 4 :] = 0  # 1 to 4 padded tokens: micro-batches count differently
        inputs["attention_mask"] = mask
        if not MODELS[name].seq2seq:  # the mask pads the encoder's input, not T5's target
            target = target.masked_fill(mask == 0, -100)
    return model, inputs, target


def plan_for(name: str, layout: str) -> fxpipe.Plan:
    _, fields = LAYOUTS[layout]
    four = fields.get("chunks", 1) == 2
    split = MODELS[name].four_stages if four else MODELS[name].two_stages
    return fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=split, microbatches=MICROBATCHES, **fields)


def _grads(named: Any) -> dict[str, torch.Tensor | None]:
    """Every gradient in full (a sharded stage's gathered from its replicas)."""
    from fxpipe.distributed.fsdp import full

    return {n: None if p.grad is None else full(p.grad).detach().clone() for n, p in named}


# ---------------------------------------------------------------- rank function
def run_variants(name: str, layout: str, variants: list[Variant]) -> list[dict]:
    """On each rank, for every variant: compile, step, clip the global norm, SGD, step
    again; this rank's losses, gradients of both steps and the norm."""
    results = []
    for variant in variants:
        model, inputs, target = make_case(name, variant)
        call = {**inputs, "labels": target} if variant.own_loss else inputs
        loss_fn = None if variant.own_loss else lm_loss
        example = {k: v[: variant.example_batch] for k, v in call.items()}
        start = time.perf_counter()
        with fxpipe.compile(model, plan_for(name, layout), example_kwargs=example, loss_fn=loss_fn) as pipe:
            first = pipe.step(**call, target=None if variant.own_loss else target)
            grads = _grads(pipe.named_parameters())
            norm = pipe.clip_grad_norm_(MAX_NORM)
            torch.optim.SGD(pipe.parameters(), lr=LR).step()
            pipe.zero_grad()
            second = pipe.step(**call, target=None if variant.own_loss else target)
            results.append({
                "losses": (first.detach().clone(), second.detach().clone()), "grads": (grads, _grads(pipe.named_parameters())),
                "norm": norm.detach().clone(), "frontend": pipe.frontend, "seconds": time.perf_counter() - start,
            })
    return results


# ------------------------------------------------------------------ assertions
def eager(name: str, variant: Variant) -> dict:
    """What the rank function measures, from the eager model on the whole batch."""
    model, inputs, target = make_case(name, variant)

    def step() -> torch.Tensor:
        if variant.own_loss:
            loss = model(**inputs, labels=target).loss
        else:
            loss = lm_loss(model(**inputs), target)
        loss.backward()
        return loss.detach()

    first = step()
    grads = _grads(model.named_parameters())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.zero_grad()
    second = step()
    return {"losses": (first, second), "grads": (grads, _grads(model.named_parameters())), "norm": norm}


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)


def assert_close(got: torch.Tensor, expected: torch.Tensor, tol: dict[str, float], what: str) -> None:
    """Relative to the tensor's largest entry: float32 sums over other micro-batches
    round differently in the entries near zero."""
    atol = max(tol["atol"], tol["rtol"] * float(expected.abs().max()))
    torch.testing.assert_close(got, expected, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{what}: {m}")


def check_against_eager(name: str, layout: str, variants: list[Variant], ranks: list[list[dict]]) -> None:
    for k, variant in enumerate(variants):
        ref = eager(name, variant)
        tol = tolerances(variant.dtype)
        held: set[str] = set()
        for rank, results in enumerate(ranks):
            got = results[k]
            where = f"{name} {layout} [{variant}] rank {rank}"
            assert_close(got["norm"], ref["norm"], tol, f"{where}: clip_grad_norm_")
            for n in range(2):
                # HF's own loss is float32 whatever the model's dtype: held to that
                expected = ref["losses"][n]
                assert got["losses"][n].dtype == expected.dtype, (where, got["losses"][n].dtype, expected.dtype)
                assert_close(got["losses"][n], expected, tolerances(expected.dtype), f"{where}: loss of step {n + 1}")
                for param, grad in got["grads"][n].items():
                    assert grad is not None, f"{where}: {param} has no gradient after step {n + 1}"
                    assert_close(grad, ref["grads"][n][param], tol, f"{where}: step {n + 1}: grad of {param}")
            held |= set(got["grads"][0])
        missing = set(ref["grads"][0]) - held
        assert not missing, f"{name} {layout} [{variant}]: parameters held by no rank: {missing}"


def run_and_check(name: str, layout: str, variants: list[Variant] = VARIANTS) -> list[list[dict]]:
    nprocs, _ = LAYOUTS[layout]
    ranks = launch(run_variants, nprocs, (name, layout, variants), timeout=LAUNCH_TIMEOUT)
    check_against_eager(name, layout, variants, ranks)
    return ranks


# ------------------------------------------------------------------------ tests
SAMPLE = {("gpt2", "1f1b"), ("gpt2", "fsdp2x2")}  # llama-dp2x2 and the rest: make test-llm
GRID = [
    pytest.param(name, layout, marks=() if (name, layout) in SAMPLE else pytest.mark.slow, id=f"{name}-{layout}")
    for name in MODELS
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("name", "layout"), GRID)
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_llm_step_under_torchrun_matches_eager(name: str, layout: str) -> None:
    run_and_check(name, layout)
