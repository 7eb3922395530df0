"""Micro-batches of different shapes in one step (``pipe.step(microbatches=[...])``) and
structured values (a document mask as a registered pytree) across stages.

The reference is eager PyTorch running the same micro-batches one after another, a mean
loss normalised over the whole step: the sum of every micro-batch's sum divided by the
step's count of scored tokens (-100 labels left out).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from doc_masks import DocLM, MaskBuilder, Opaque, allowed, document_mask
from torch import nn

import fxpipe
from fxpipe.batching.microbatch import MicrobatchError
from fxpipe.distributed import launch
from fxpipe.distributed.fsdp import full
from fxpipe.schedules import Action

LENGTHS = (5, 9, 13, 16)
SCHEDULES = {  # name: (schedule, chunks)
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "interleaved": ("interleaved-1f1b", 2),
    "zb-h1": ("zb-h1", 1),
    "zb-v": ("zb-v", 2),
    "custom": (None, 1),  # filled below: a callable
}


def forwards_then_backwards(stages: int, microbatches: int) -> list[list[Action]]:
    """A custom schedule: each worker runs its stage's forwards, then its backwards in reverse."""
    return [
        [Action("F", s, i) for i in range(microbatches)] + [Action("B", s, i) for i in reversed(range(microbatches))]
        for s in range(stages)
    ]


def plan_for(name: str, **fields) -> fxpipe.Plan:
    """A 2-worker plan of DocLM (4 blocks) under schedule ``name``: 2 stages, or 4 with 2 chunks."""
    schedule, chunks = SCHEDULES[name]
    split = ["blocks.1", "blocks.2", "blocks.3"] if chunks == 2 else ["blocks.2"]
    devices = ["cpu:0", "cpu:1", "cpu:1", "cpu:0"] if name == "zb-v" else ["cpu:0", "cpu:1"] * (len(split) // 2 + 1)
    return fxpipe.Plan(
        split=split, devices=devices[: len(split) + 1], schedule=schedule or forwards_then_backwards, chunks=chunks,
        microbatches=2, **fields,
    )


def doc_batches(seed: int = 0, lengths=LENGTHS) -> tuple[list[tuple], list[torch.Tensor]]:
    """Micro-batches of packed rows, one per length (batch sizes 2, 1, 2, 1), each with its
    own document mask built from its own document lengths; targets with -100 tails."""
    g = torch.Generator().manual_seed(seed)
    entries, targets = [], []
    for k, length in enumerate(lengths):
        rows = 2 - k % 2
        cuts = [sorted(torch.randint(1, length, (2,), generator=g).tolist()) for _ in range(rows)]
        docs = [[a, b - a, length - b] for a, b in cuts]
        docs = [[n for n in row if n > 0] for row in docs]
        ids = torch.randint(0, 32, (rows, length), generator=g)
        target = torch.randint(0, 32, (rows, length), generator=g)
        target[0, length // 2 :] = -100
        entries.append((ids, document_mask(docs)))
        targets.append(target)
    return entries, targets


def token_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100)


def eager_step(model: nn.Module, entries: list, targets: list) -> torch.Tensor:
    """Eager over the micro-batches one after another: the step's summed token losses over
    its count of scored tokens; backpropagated."""
    count = sum(int((t != -100).sum()) for t in targets)
    loss = sum(F.cross_entropy(model(*e).flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum") for e, t in zip(entries, targets)) / count
    loss.backward()
    return loss.detach()


def grad_error(pipe, model: nn.Module) -> float:
    """The largest gradient difference relative to the gradient's own largest entry (a
    sharded stage's gradients gathered first: every rank must ask)."""
    eager = dict(model.named_parameters())
    return max(float((full(p.grad) - eager[k].grad).abs().max() / eager[k].grad.abs().max().clamp_min(1e-30)) for k, p in pipe.named_parameters())


# ------------------------------------------------------------------ locally
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_listed_microbatches_of_four_lengths_equal_eager_under_every_schedule(name: str) -> None:
    torch.manual_seed(0)
    model = DocLM().double()
    ref = copy.deepcopy(model)  # eager's copy: the pipeline's parameters are the model's own
    entries, targets = doc_batches()
    pipe = fxpipe.compile(model, plan_for(name), example_inputs=entries[0], loss_fn=token_mean)
    loss = pipe.step(microbatches=entries, targets=targets)
    eager = eager_step(ref, entries, targets)
    assert torch.allclose(loss, eager, rtol=1e-12, atol=0), (float(loss), float(eager))
    assert grad_error(pipe, ref) < 1e-12
    with torch.no_grad():
        outputs = pipe(microbatches=entries)
        assert isinstance(outputs, list) and len(outputs) == len(entries)
        for out, entry in zip(outputs, entries):
            assert torch.allclose(out, model(*entry), rtol=1e-12, atol=1e-14)


def test_memory_of_a_listed_step_is_predicted_from_its_largest_microbatch() -> None:
    torch.manual_seed(0)
    model = DocLM().double()
    entries, targets = doc_batches()
    pipe = fxpipe.compile(model, plan_for("1f1b"), example_inputs=entries[0], loss_fn=token_mean)  # the shortest as example
    pipe.step(microbatches=entries, targets=targets)
    for row in pipe.memory():  # predicted from the (2, 16) micro-batch, not scaled from the (2, 5) example
        assert abs(row.predicted_peak - row.measured_peak) / row.measured_peak < 0.25, str(pipe.memory())


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_each_microbatch_sees_its_own_document_mask_as_it_crosses_the_stages(schedule: str) -> None:
    """The AttentionMask a leaf module builds in stage 0 reaches stages 1 and 2 as one pytree
    (a tensor and a Python value), micro-batch by micro-batch; every micro-batch's mask is
    built from its own document lengths (micro-batches 3 and 5 have one shape, and other
    documents)."""
    torch.manual_seed(0)
    model = DocLM(build_masks=True).double()
    ref = copy.deepcopy(model)  # eager's copy: the pipeline's parameters are the model's own
    entries, targets = doc_batches(1, LENGTHS + (9, 16))
    assert entries[3][0].shape == entries[5][0].shape and not torch.equal(entries[3][1].document, entries[5][1].document)
    plan = fxpipe.Plan(split=["blocks.1", "blocks.3"], devices=["cpu"] * 3, schedule=schedule, frontend="fx", leaf_modules=[MaskBuilder])
    pipe = fxpipe.compile(model, plan, example_inputs=entries[0], loss_fn=token_mean)
    crossing = [e.description for s in pipe.stages for e in s.inputs if e.name == "masks"]
    assert crossing == ["(bool[2, 5, 5], int)"] * 2, crossing  # the whole structure crosses
    loss = pipe.step(microbatches=entries, targets=targets)
    eager = eager_step(ref, entries, targets)
    assert torch.allclose(loss, eager, rtol=1e-12, atol=0)
    assert grad_error(pipe, ref) < 1e-12


def test_a_mask_dataclass_is_cut_with_the_batch_and_an_opaque_one_is_refused() -> None:
    torch.manual_seed(0)
    model = DocLM().double()
    ids = torch.randint(0, 32, (4, 8))
    mask = document_mask([[8], [3, 5], [2, 2, 4], [7, 1]])
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["blocks.2"], devices=["cpu"] * 2, microbatches=2), example_inputs=(ids, mask), loss_fn=token_mean)
    assert torch.allclose(pipe(ids, mask), model(ids, mask), atol=1e-12)  # rows 0-1 and 2-3 each see their own documents
    with pytest.raises(MicrobatchError, match=r"an input of type Opaque holds tensors of the batch's size 4 .*register_dataclass\(Opaque\)"):
        pipe.step(ids, Opaque(document=mask.document), target=ids)


def test_a_later_step_with_lengths_seen_before_does_not_trace_again() -> None:
    """Whatever the frontend (one program for every length, or one per length), a step
    whose lengths were all seen before costs no trace."""
    import llm_models

    torch.manual_seed(0)
    model = llm_models.gpt2(layers=2).double()
    g = torch.Generator().manual_seed(0)
    batches = {n: torch.randint(3, 64, (2, n), generator=g) for n in LENGTHS}
    plan = fxpipe.Plan(split=["transformer.h.1"], devices=["cpu"] * 2, microbatches=2)
    pipe = fxpipe.compile(model, plan, example_inputs=(batches[5],), loss_fn=lambda out, t: token_mean(out.logits, t))
    traces = []
    retrace = pipe._compiler.retrace
    pipe._compiler = dataclasses.replace(pipe._compiler, retrace=lambda *a: traces.append(1) or retrace(*a))
    pipe.step(microbatches=[(batches[n],) for n in LENGTHS], targets=[batches[n] for n in LENGTHS])
    first = len(traces)
    assert first in (0, 3) and len(pipe.signatures) == first + 1, pipe.signatures
    for order in ([16, 5, 13, 9], [9, 9, 5, 16, 13]):
        pipe.step(microbatches=[(batches[n],) for n in order], targets=[batches[n] for n in order])
    assert len(traces) == first


def test_input_gradients_of_listed_microbatches_are_eagers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs = [torch.randn(2, n, 4, dtype=torch.float64, requires_grad=True) for n in (3, 7)]
    targets = [torch.randn(2, n, 3, dtype=torch.float64) for n in (3, 7)]
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["2"], devices=["cpu"] * 2), example_inputs=(xs[0],), loss_fn=F.mse_loss)
    loss = pipe.step(microbatches=xs, targets=targets)
    pipe_grads = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    eager = sum(F.mse_loss(model(x), t, reduction="sum") for x, t in zip(xs, targets)) / sum(t.numel() for t in targets)
    eager.backward()
    assert torch.allclose(loss, eager.detach(), rtol=1e-12)
    assert all(torch.allclose(a, x.grad, rtol=1e-12, atol=1e-15) for a, x in zip(pipe_grads, xs))


def test_listed_microbatches_that_disagree_are_named_with_the_fix() -> None:
    torch.manual_seed(0)
    model = DocLM()
    entries, targets = doc_batches()
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["blocks.2"], devices=["cpu"] * 2), example_inputs=entries[0], loss_fn=token_mean)
    windowed = (entries[1][0], dataclasses.replace(entries[1][1], window=4))
    with pytest.raises(MicrobatchError, match=r"micro-batch 1 passes other arguments .*mask: DocumentMask\(int64\[\*, \*\], 0\) -> DocumentMask\(int64\[\*, \*\], 4\)"):
        pipe.step(microbatches=[entries[0], windowed], targets=targets[:2])
    with pytest.raises(MicrobatchError, match=r"micro-batch 1 passes other arguments .*ids: int64\[\*, \*\] -> int32\[\*, \*\]"):
        pipe.step(microbatches=[entries[0], {"ids": entries[1][0].int(), "mask": entries[1][1]}], targets=targets[:2])
    with pytest.raises(MicrobatchError, match="targets= has 3 entries but microbatches= has 4"):
        pipe.step(microbatches=entries, targets=targets[:3])
    with pytest.raises(MicrobatchError, match="must be a non-empty list"):
        pipe.step(microbatches=[], targets=[])
    with pytest.raises(MicrobatchError, match="either one batch's arguments .* or microbatches="):
        pipe.step(*entries[0], microbatches=entries, targets=targets)
    with pytest.raises(MicrobatchError, match=r"microbatches\[0\] is of type list"):
        pipe(microbatches=[list(entries[0])])
    with pytest.raises(MicrobatchError, match=r"microbatches\[1\] does not fit the model's forward"):
        pipe(microbatches=[entries[0], (entries[1][0],)])


class LongExtra(nn.Module):
    """Sends stage 1 one more value for sequences longer than 6 (a branch on the size, which
    torch.export resolves per length)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        extra = h.sum(1, keepdim=True) if x.shape[1] > 6 else None
        h = self.b(h)
        return h + extra if extra is not None else h


def test_microbatches_whose_traces_cross_other_edges_are_refused_with_the_fix() -> None:
    model = LongExtra()
    xs = [torch.randn(2, n, 4) for n in (4, 8)]
    pipe = fxpipe.compile(model, fxpipe.Plan(split=["b"], devices=["cpu"] * 2, frontend="export"), example_inputs=(xs[0],), loss_fn=F.mse_loss)
    with pytest.raises(MicrobatchError, match=r"micro-batch 1's input signature \(x: f32\[\*, 8, 4\]\) was traced into stages that exchange other values .*frontend='fx'"):
        pipe.step(microbatches=xs, targets=[torch.zeros(2, n, 4) for n in (4, 8)])


@pytest.mark.parametrize("family, loss", [("gpt2", "labels"), ("llama", "loss_fn")])
def test_hf_models_with_padded_labels_at_four_lengths_equal_eager(family: str, loss: str) -> None:
    check_hf_listed(family, loss, "1f1b")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("family, loss", [(f, k) for f in ("gpt2", "llama") for k in ("labels", "loss_fn")])
def test_hf_models_at_four_lengths_equal_eager_under_the_schedules(family: str, loss: str, schedule: str) -> None:
    check_hf_listed(family, loss, schedule)


def hf_batches(seed: int, lengths=LENGTHS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, labels with -100 over the first sample's first half) per length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, length in enumerate(lengths):
        ids = torch.randint(3, 64, (2 - k % 2, length), generator=g)
        labels = ids.clone()
        labels[0, : length // 2] = -100
        out.append((ids, labels))
    return out


def hf_eager(model: nn.Module, batches: list, loss: str) -> torch.Tensor:
    """Eager over the micro-batches one after another, normalised over the step. A model's
    own loss is a mean over its shifted labels: times each micro-batch's count, it is the sum."""
    if loss == "labels":
        counts = [int((labels[:, 1:] != -100).sum()) for _, labels in batches]
        total = sum(model(input_ids=ids, labels=labels).loss * n for (ids, labels), n in zip(batches, counts)) / sum(counts)
    else:
        count = sum(int((labels != -100).sum()) for _, labels in batches)
        total = sum(F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten(), reduction="sum") for ids, labels in batches) / count
    total.backward()
    return total.detach()


def run_hf_listed(pipe, batches: list, loss: str) -> torch.Tensor:
    if loss == "labels":
        return pipe.step(microbatches=[{"input_ids": ids, "labels": labels} for ids, labels in batches])
    return pipe.step(microbatches=[(ids,) for ids, _ in batches], targets=[labels for _, labels in batches])


def hf_pipe(model: nn.Module, family: str, loss: str, batches: list, **plan) -> object:
    import llm_models

    example = {"labels": batches[0][1]} if loss == "labels" else None
    loss_fn = None if loss == "labels" else (lambda out, t: token_mean(out.logits, t))
    plan = fxpipe.Plan(split=llm_models.FAMILIES[family].split[-1:], devices=["cpu"] * 2, **plan)
    return fxpipe.compile(model, plan, example_inputs=(batches[0][0],), example_kwargs=example, loss_fn=loss_fn)


def check_hf_listed(family: str, loss: str, schedule: str) -> None:
    """HF's own loss upcasts the logits to float32: its loss and gradients agree to float32's precision."""
    import llm_models

    torch.manual_seed(0)
    model = llm_models.FAMILIES[family].build().double()
    ref = copy.deepcopy(model)  # eager's copy: the pipeline's parameters are the model's own
    batches = hf_batches(0)
    pipe = hf_pipe(model, family, loss, batches, schedule=schedule)
    result = run_hf_listed(pipe, batches, loss)
    eager = hf_eager(ref, batches, loss)
    tolerance = 1e-6 if loss == "labels" else 1e-12
    assert torch.allclose(result.double(), eager.double(), rtol=tolerance, atol=0), (float(result), float(eager))
    assert grad_error(pipe, ref) < tolerance


# ------------------------------------------------------------------ torchrun
def listed_on_ranks(names: list[str]) -> dict:
    """On 2 ranks: DocLM under each schedule (its masks built per micro-batch, crossing the
    ranks as a pytree under 1f1b and zb-h1); an object that is no pytree, refused."""
    import torch.distributed as dist

    result = {}
    entries, targets = doc_batches(2, LENGTHS + (9, 16))  # micro-batches 3 and 5: one shape, other documents
    for name in names:
        torch.manual_seed(0)
        model = DocLM(build_masks=name in ("1f1b", "zb-h1")).double()
        ref = copy.deepcopy(model)  # eager's copy: the pipeline's parameters are the model's own
        plan = plan_for(name, frontend="fx", leaf_modules=[MaskBuilder])
        with fxpipe.compile(model, plan, example_inputs=entries[0], loss_fn=token_mean) as pipe:
            loss = pipe.step(microbatches=entries, targets=targets)
            outputs = pipe(microbatches=entries)
            with torch.no_grad():
                out_error = None if outputs is None else max(float((o - model(*e)).abs().max()) for o, e in zip(outputs, entries))
            result[name] = (float(loss), float(eager_step(ref, entries, targets)), grad_error(pipe, ref), out_error)
    model = DocLM(build_masks=True)
    model.masks.forward = lambda mask: Opaque(allowed=allowed(mask.document, mask.window))
    with fxpipe.compile(model, fxpipe.Plan(split=["blocks.2"], devices=["cpu"] * 2, frontend="fx", leaf_modules=[MaskBuilder]), example_inputs=entries[0], loss_fn=token_mean) as pipe:
        try:
            pipe(microbatches=entries[:2])
        except Exception as err:  # noqa: BLE001 - the message is what is checked
            result["opaque"] = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return result


# make test runs two schedules (masks crossing the ranks as a pytree, and a V schedule), make
# test-slow the rest
RANK_SAMPLE = ("1f1b", "zb-v")


@pytest.mark.parametrize("names", [
    pytest.param(RANK_SAMPLE, id="sample"),
    pytest.param(tuple(n for n in sorted(SCHEDULES) if n not in RANK_SAMPLE), id="rest", marks=pytest.mark.slow),
])
def test_listed_microbatches_on_two_ranks_under_every_schedule(names: tuple[str, ...]) -> None:
    names = list(names)
    for rank, result in enumerate(launch(listed_on_ranks, 2, (names,), timeout=300)):
        for name in names:
            loss, eager, err, out_error = result[name]
            assert abs(loss - eager) <= 1e-12 * abs(eager) and err < 1e-12, (rank, name, result[name])
            assert out_error is None or out_error < 1e-12, (rank, name, out_error)
        assert "holds tensors inside an object of type Opaque, which is not a registered pytree" in result["opaque"], result["opaque"]


def listed_hf_on_ranks(family: str, loss: str, replicas: int, schedule: str, fields: dict | None = None) -> tuple:
    """One replica of 2 stages per pair of ranks; replica r passes its own micro-batches
    (its lengths reversed), the reference is eager over every replica's. ``fields``: more
    Plan fields (``fsdp``, ``frontend``)."""
    import llm_models
    import torch.distributed as dist

    torch.manual_seed(0)
    model = llm_models.FAMILIES[family].build().double()
    ref = copy.deepcopy(model)  # eager's copy: the pipeline's parameters are the model's own
    replica = int(os.environ["RANK"]) // 2  # compile initialises the process group
    everyone = [hf_batches(r, LENGTHS if r % 2 == 0 else LENGTHS[::-1]) for r in range(replicas)]
    with hf_pipe(model, family, loss, everyone[0], schedule=schedule, data_parallel=replicas, **(fields or {})) as pipe:  # one example on every rank
        result = run_hf_listed(pipe, everyone[replica], loss)
        eager = hf_eager(ref, [b for batches in everyone for b in batches], loss)
        out = (float(result), float(eager), grad_error(pipe, ref))
    dist.destroy_process_group()
    return out


def listed_per_replica(schedule: str, fsdp: bool = False) -> tuple:
    """DocLM on 2 stages x 2 replicas (replicated, or sharded with ``fsdp``): replica r
    passes its own micro-batches (replica 1 its lengths reversed, another count of
    tokens), the reference is eager over both replicas'."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = DocLM(build_masks=True).double()
    ref = copy.deepcopy(model)  # eager's copy: the pipeline's parameters are the model's own
    everyone = [doc_batches(r, LENGTHS if r == 0 else LENGTHS[::-1]) for r in range(2)]
    entries, targets = everyone[int(os.environ["RANK"]) // 2]  # compile initialises the process group
    plan = fxpipe.Plan(
        split=["blocks.2"], devices=["cpu"] * 2, schedule=schedule, data_parallel=2, fsdp=fsdp, frontend="fx", leaf_modules=[MaskBuilder]
    )
    with fxpipe.compile(model, plan, example_inputs=everyone[0][0][0], loss_fn=token_mean) as pipe:  # one example on every rank
        loss = pipe.step(microbatches=entries, targets=targets)
        eager = eager_step(ref, everyone[0][0] + everyone[1][0], everyone[0][1] + everyone[1][1])
        out = (float(loss), float(eager), grad_error(pipe, ref))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("fsdp", [pytest.param(False, marks=pytest.mark.slow), True])
def test_listed_microbatches_per_replica_equal_eager_over_every_replicas(fsdp: bool) -> None:
    for rank, (loss, eager, err) in enumerate(launch(listed_per_replica, 4, ("zb-h1", fsdp), timeout=300)):
        assert abs(loss - eager) <= 1e-12 * abs(eager) and err < 1e-12, (rank, loss, eager, err)


@pytest.mark.slow
@pytest.mark.parametrize("world, replicas", [(2, 1), (4, 2)])
@pytest.mark.parametrize("family, loss, schedule", [("gpt2", "loss_fn", "zb-h1"), ("llama", "labels", "1f1b"), ("llama", "loss_fn", "gpipe")])
def test_hf_listed_microbatches_on_ranks(world: int, replicas: int, family: str, loss: str, schedule: str) -> None:
    tolerance = 1e-6 if loss == "labels" else 1e-12
    for rank, (result, eager, err) in enumerate(launch(listed_hf_on_ranks, world, (family, loss, replicas, schedule), timeout=300)):
        assert abs(result - eager) <= tolerance * abs(eager) and err < tolerance, (rank, result, eager, err)


@pytest.mark.slow
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_hf_listed_microbatches_on_sharded_replicas(frontend: str) -> None:
    """2 stages x 2 sharded replicas (fsdp=True): one program for every length (fx) or one
    per length (export), every replica's own lengths."""
    fields = {"fsdp": True, "frontend": frontend}
    for rank, (result, eager, err) in enumerate(launch(listed_hf_on_ranks, 4, ("gpt2", "loss_fn", 2, "zb-h1", fields), timeout=300)):
        assert abs(result - eager) <= 1e-12 * abs(eager) and err < 1e-12, (rank, result, eager, err)
