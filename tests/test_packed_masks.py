"""Packed fine-tuning with FlexAttention-style masks (issue 35).

Each micro-batch of a listed step carries its own ``PackedMask`` (tests/packed_masks.py),
built from its own document lengths, with its sequence length in the pytree *context*:
micro-batches of other lengths have other tree specs, and each distinct context is traced
once. A whole-batch mask is cut with the batch, under torch.fx and under torch.export
(whose trace keeps the batch dim symbolic). The reference is eager PyTorch over the same
micro-batches, one after another, in float64: the step's summed token losses over its
count of scored tokens (-100 left out).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from doc_masks import document_mask
from packed_masks import VOCAB, PackedLM, packed_mask
from torch import nn

import fxpipe
from fxpipe.batching.microbatch import MicrobatchError
from fxpipe.distributed import launch
from fxpipe.distributed.fsdp import full

LENGTHS = (5, 9, 13, 16, 9)  # the second 9 has other documents than the first
SCHEDULES = {"1f1b": 1, "zb-h1": 1, "zb-v": 2}  # name: chunks


def plan_for(schedule: str, **fields) -> fxpipe.Plan:
    """2 workers: 2 stages, or 4 stages in a V (zb-v) over PackedLM's 4 blocks."""
    if SCHEDULES[schedule] == 2:
        return fxpipe.Plan(split=["blocks.1", "blocks.2", "blocks.3"], devices=["cpu:0", "cpu:1", "cpu:1", "cpu:0"], schedule=schedule, chunks=2, **fields)
    return fxpipe.Plan(split=["blocks.2"], devices=["cpu:0", "cpu:1"], schedule=schedule, **fields)


def packed_batches(seed: int, lengths=LENGTHS) -> tuple[list[dict], list[torch.Tensor]]:
    """One micro-batch per length (2 rows, then 1, alternately), each row 1 to 3 documents,
    its mask built from its own document lengths; targets with -100 over a half row."""
    g = torch.Generator().manual_seed(seed)
    entries, targets = [], []
    for k, length in enumerate(lengths):
        rows = 2 - k % 2
        cuts = [sorted(torch.randint(1, length, (2,), generator=g).tolist()) for _ in range(rows)]
        docs = [[n for n in (a, b - a, length - b) if n > 0] for a, b in cuts]
        entries.append({"ids": torch.randint(0, VOCAB, (rows, length), generator=g), "mask": packed_mask(docs)})
        target = torch.randint(0, VOCAB, (rows, length), generator=g)
        target[0, length // 2 :] = -100
        targets.append(target)
    return entries, targets


def token_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100)


def eager_step(model: nn.Module, entries: list[dict], targets: list[torch.Tensor]) -> torch.Tensor:
    count = sum(int((t != -100).sum()) for t in targets)
    losses = [F.cross_entropy(model(**e).flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum") for e, t in zip(entries, targets)]
    loss = sum(losses) / count
    loss.backward()
    return loss.detach()


def grad_error(pipe, model: nn.Module) -> float:
    """The largest gradient difference relative to that gradient's largest entry."""
    eager = dict(model.named_parameters())
    shared = [k for k, p in pipe.named_parameters() if p is eager[k]]
    assert not shared, f"the reference holds the pipeline's own parameters {shared[:3]}: compare with a copy made before compile"
    return max(float((full(p.grad) - eager[k].grad).abs().max() / eager[k].grad.abs().max()) for k, p in pipe.named_parameters())


def listed_step(schedule: str, seed: int = 0, **fields) -> tuple[float, float, float, object, nn.Module]:
    """(pipeline loss, eager loss, gradient error, pipeline, eager model) of one listed step."""
    torch.manual_seed(0)
    model = PackedLM().double()
    ref = copy.deepcopy(model)  # eager's own copy: the pipeline trains the model's own parameters
    entries, targets = packed_batches(seed)
    pipe = fxpipe.compile(model, plan_for(schedule, **fields), example_kwargs=entries[0], loss_fn=token_mean)
    loss = pipe.step(microbatches=entries, targets=targets)
    eager = eager_step(ref, entries, targets)
    return float(loss), float(eager), grad_error(pipe, ref), pipe, ref


# ------------------------------------------------------------------ locally
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_microbatch_trains_on_its_own_packed_mask_as_in_eager(schedule: str) -> None:
    loss, eager, err, pipe, model = listed_step(schedule)
    assert abs(loss - eager) <= 1e-12 * abs(eager) and err < 1e-12, (loss, eager, err)
    assert len(pipe.signatures) == 4, pipe.signatures  # one per distinct seq_len: 5, 9, 13, 16
    entries, _ = packed_batches(0)
    with torch.no_grad():
        for out, entry in zip(pipe(microbatches=entries), entries):
            assert torch.allclose(out, model(**entry), rtol=1e-12, atol=1e-14)
    assert len(pipe.signatures) == 4  # a forward of the same lengths traces nothing


def test_lengths_seen_before_are_not_traced_again() -> None:
    *_, pipe, ref = listed_step("1f1b")
    programs = dict(pipe._programs)
    entries, targets = packed_batches(3, (16, 9, 5, 9, 13))  # the same lengths, other documents and order
    ref.zero_grad()
    pipe.zero_grad()
    loss = pipe.step(microbatches=entries, targets=targets)
    eager = eager_step(ref, entries, targets)
    assert pipe._programs == programs
    assert abs(float(loss) - float(eager)) <= 1e-12 * abs(float(eager))
    assert grad_error(pipe, ref) < 1e-12


def test_a_causal_flag_that_changes_what_crosses_the_stages_is_refused_with_the_fix() -> None:
    """A bidirectional mask (causal=False) never reads ``pos``, so its stage 1 receives one
    value fewer: a step cannot mix it with causal masks (the message names the value and the
    flag's kind), and a step of its own trains as in eager."""
    torch.manual_seed(0)
    model = PackedLM().double()
    ref = copy.deepcopy(model)  # eager's own copy: the pipeline trains the model's own parameters
    entries, targets = packed_batches(4, (9, 9))
    entries[1]["mask"].causal = False
    pipe = fxpipe.compile(model, plan_for("1f1b"), example_kwargs=entries[0], loss_fn=token_mean)
    with pytest.raises(MicrobatchError, match=r"context \(9, False, True\)\)\) was traced .*stage 1 receives mask_0 for micro-batch 0 only.*a pytree class's context\) changes which values cross the stages"):
        pipe.step(microbatches=entries, targets=targets)
    entries[0]["mask"].causal = False
    loss = pipe.step(microbatches=entries, targets=targets)
    eager = eager_step(ref, entries, targets)
    assert abs(float(loss) - float(eager)) <= 1e-12 * abs(float(eager)) and grad_error(pipe, ref) < 1e-12
    assert [s.count("context (9, False, True)") for s in pipe.signatures] == [0, 1], pipe.signatures


def test_packed_masks_under_export_one_program_per_length() -> None:
    loss, eager, err, pipe, _ = listed_step("zb-h1", frontend="export")
    assert abs(loss - eager) <= 1e-12 * abs(eager) and err < 1e-12, (loss, eager, err)
    assert len(pipe.signatures) == 4, pipe.signatures


def test_masks_of_another_type_or_other_children_are_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    model = PackedLM().double()
    entries, targets = packed_batches(0)
    pipe = fxpipe.compile(model, plan_for("1f1b"), example_kwargs=entries[0], loss_fn=token_mean)
    unbiased = {"ids": entries[1]["ids"], "mask": packed_mask([[9]], bias=False)}
    with pytest.raises(MicrobatchError, match=r"micro-batch 1 passes other arguments .*mask: PackedMask\(int64\[\*, \*\], bool\[\*, \*, \*\], float64\[\*, \*\]\) -> PackedMask\(int64\[\*, \*\], bool\[\*, \*, \*\]\)\).*children"):
        pipe.step(microbatches=[entries[0], unbiased], targets=targets[:2])
    other_type = {"ids": entries[1]["ids"], "mask": document_mask([[4, 5]])}
    with pytest.raises(MicrobatchError, match=r"micro-batch 1 passes other arguments .*-> DocumentMask\(int64\[\*, \*\], 0\)"):
        pipe.step(microbatches=[entries[0], other_type], targets=targets[:2])


def whole_batch(rows: int, seed: int) -> tuple[torch.Tensor, object, torch.Tensor]:
    """(ids, its mask, targets) of ``rows`` rows of 12 tokens, each row its own documents."""
    g = torch.Generator().manual_seed(seed)
    docs = [[n for n in (a, b - a, 12 - b) if n > 0] for a, b in (sorted(torch.randint(1, 12, (2,), generator=g).tolist()) for _ in range(rows))]
    target = torch.randint(0, VOCAB, (rows, 12), generator=g)
    target[:, 9:] = -100
    return torch.randint(0, VOCAB, (rows, 12), generator=g), packed_mask(docs), target


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_whole_batch_mask_is_cut_with_the_batch_under_either_frontend(frontend: str, schedule: str) -> None:
    """Batch 8 cut into 4 micro-batches of 2 rows, each its rows' pos and same_doc and the
    shared bias; then a batch of 6 (micro-batches of 2 and 1): export's trace kept the
    batch dim symbolic, so neither frontend traces again."""
    torch.manual_seed(0)
    model = PackedLM().double()
    ref = copy.deepcopy(model)  # eager's own copy: the pipeline trains the model's own parameters
    ids, mask, target = whole_batch(8, 0)
    pipe = fxpipe.compile(model, plan_for(schedule, microbatches=4, frontend=frontend), example_inputs=(ids, mask), loss_fn=token_mean)
    for rows, seed in ((8, 0), (6, 1)):
        ids, mask, target = whole_batch(rows, seed)
        ref.zero_grad()
        pipe.zero_grad()
        loss = pipe.step(ids, target=target, mask=mask)
        eager = eager_step(ref, [{"ids": ids, "mask": mask}], [target])
        assert abs(float(loss) - float(eager)) <= 1e-12 * abs(float(eager)), (rows, float(loss), float(eager))
        assert grad_error(pipe, ref) < 1e-12
    assert len(pipe.signatures) == 1, pipe.signatures


# ------------------------------------------------------------------ torchrun
def packed_on_ranks(schedules: list[str]) -> dict[str, tuple[float, float, float]]:
    import torch.distributed as dist

    result = {}
    for schedule in schedules:
        loss, eager, err, pipe, _ = listed_step(schedule)
        pipe.close()
        result[schedule] = (loss, eager, err)
    dist.destroy_process_group()
    return result


def test_packed_masks_on_two_ranks_under_1f1b_zb_h1_and_zb_v() -> None:
    for rank, result in enumerate(launch(packed_on_ranks, 2, (sorted(SCHEDULES),), timeout=300)):
        for schedule, (loss, eager, err) in result.items():
            assert abs(loss - eager) <= 1e-12 * abs(eager) and err < 1e-12, (rank, schedule, loss, eager, err)


def packed_per_replica(schedule: str) -> tuple[float, float, float]:
    """2 stages x 2 replicas: replica r passes its own micro-batches (replica 1 other
    lengths, in another order); the reference is eager over both replicas'."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = PackedLM().double()
    ref = copy.deepcopy(model)  # eager's own copy: the pipeline trains the model's own parameters
    everyone = [packed_batches(0), packed_batches(1, (16, 7, 9, 16))]
    entries, targets = everyone[int(os.environ["RANK"]) // 2]
    plan = fxpipe.Plan(split=["blocks.2"], devices=["cpu"] * 2, schedule=schedule, data_parallel=2)
    with fxpipe.compile(model, plan, example_kwargs=everyone[0][0][0], loss_fn=token_mean) as pipe:  # one example on every rank
        loss = pipe.step(microbatches=entries, targets=targets)
        eager = eager_step(ref, everyone[0][0] + everyone[1][0], everyone[0][1] + everyone[1][1])
        out = (float(loss), float(eager), grad_error(pipe, ref))
    dist.destroy_process_group()
    return out


def test_packed_masks_per_replica_under_data_parallelism_equal_eager_over_both() -> None:
    for rank, (loss, eager, err) in enumerate(launch(packed_per_replica, 4, ("zb-h1",), timeout=300)):
        assert abs(loss - eager) <= 1e-12 * abs(eager) and err < 1e-12, (rank, loss, eager, err)


def test_a_batch_that_export_fixed_at_the_example_size_is_named_when_its_stages_fail(monkeypatch) -> None:
    """torch.export's symbolic-batch attempt made to fail (as it did for a registered class
    before dynamic shapes followed its children): the static program holds batch 8, and
    its stages fail on micro-batches of 2 rows; the error says why and what to do."""
    import fxpipe.passes.trace_export as trace_export

    monkeypatch.setattr(trace_export, "_dynamic_batch_shapes", lambda bound: {name: {0: "not a dim"} for name in bound.arguments})
    torch.manual_seed(0)
    model = PackedLM().double()
    ids, mask, target = whole_batch(8, 0)
    plan = fxpipe.Plan(split=["blocks.2"], devices=["cpu"] * 2, microbatches=4, frontend="export")
    pipe = fxpipe.compile(model, plan, example_inputs=(ids, mask), loss_fn=token_mean)
    with pytest.raises(MicrobatchError, match=r"traced with the batch size fixed at 8 \(torch.export specialised the batch size .*runs micro-batches of \[2\] rows: .*Plan\(frontend='fx'\).* A stage failed on them: .*is invalid for input of size"):
        pipe.step(ids, mask, target=target)
