"""Pipeline x sharded data parallelism (``Plan(fsdp=True)``): every schedule equal to eager
with each stage's parameters split over its replicas, checkpoints across layouts, the rule
that keeps or frees gathered parameters, and the errors.

The distributed cases run on 4 gloo ranks (2 stages x 2 replicas; 4 stages on 2 workers
x 2 replicas for the interleaved and V schedules), several pipelines per launch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import eager_microbatch_step
from test_zero_bubble import SPLIT4, Mixed
from torch import nn
from torch.distributed.tensor import DTensor

import fxpipe
from fxpipe.distributed import launch
from fxpipe.distributed.fsdp import full, keep_gathered, local, reshard_choice

CE = nn.CrossEntropyLoss()
LAUNCH_TIMEOUT = 240
LR = 0.1


class TiedDeep(nn.Module):
    """An LM whose head reuses the embedding's weight: under 1F1B the two uses are on two
    ranks, under ZB-V on one rank (stages 0 and 3)."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h.mean(1))


def sharded_plan(schedule: str, m: int = 2, split: list[str] | None = None, **extra) -> dict:
    """2 stages x 2 replicas, or 4 stages on 2 workers x 2 replicas (interleaved, zb-v,
    dualpipev)."""
    four = schedule in ("interleaved-1f1b", "zb-v", "dualpipev")
    split = split or (SPLIT4 if four else ["blocks.3"])
    return dict(devices=["cpu:0", "cpu:1"], split=split, schedule=schedule, microbatches=m, data_parallel=2, fsdp=True, chunks=2 if four else 1, **extra)


def model_of(name: str) -> nn.Module:
    torch.manual_seed(0)
    return (Mixed() if name == "mixed" else TiedDeep()).double()


def data(n: int = 10, vocab: int = 20, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (n, 5), generator=generator), torch.randint(0, classes, (n,), generator=generator)


def _pipeline_and_eager(name: str, plan: dict) -> tuple:
    """Model ``name`` compiled under ``plan``, its batch, and an eager copy with its SGD."""
    model = model_of(name)
    ids, t = data(vocab=11 if name == "tied" else 20, classes=11 if name == "tied" else 3)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    return model, ids, t, ref, ref_opt, fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=CE)


def two_steps_against_eager(name: str, plan: dict) -> dict:
    """Two SGD steps of the pipeline and of eager on the same batch: each step's loss
    error, the second step's largest (gathered) gradient error, and what this rank holds."""
    model, ids, t, ref, ref_opt, pipe = _pipeline_and_eager(name, plan)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    loss_errors = []
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(ids, target=t)
        eager = eager_microbatch_step(ref, (ids,), t, CE, plan["microbatches"] * plan["data_parallel"])
        loss_errors.append(abs(float(loss) - float(eager)))
        grads = {n: full(p.grad) for n, p in pipe.named_parameters()}  # every rank, in the same order
        opt.step()
        ref_opt.step()
    expected = dict(ref.named_parameters())
    grad_error = max(float((g - expected[n].grad).abs().max()) for n, g in grads.items())
    held = sum(local(p).numel() for p in pipe.parameters())
    whole = sum(p.numel() for p in pipe.parameters())
    return {"loss": max(loss_errors), "grad": grad_error, "held": held / whole, "sharded": all(isinstance(p, DTensor) for p in pipe.parameters())}


def schedule_cases(cases: list[tuple[str, str, dict]]) -> dict:
    return {(name, schedule, tuple(sorted(extra))): two_steps_against_eager(name, sharded_plan(schedule, **extra)) for name, schedule, extra in cases}


def assert_equal_to_eager(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        for case, got in per_rank.items():
            assert got["loss"] < 1e-12 and got["grad"] < 1e-10, (rank, case, got)
            assert got["sharded"] and got["held"] < 0.75, (rank, case, got)  # about half of each stage's parameters


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_sharded_stages_match_eager_under_1f1b_interleaved_zb_h1_and_zb_v_on_four_gloo_ranks() -> None:
    cases = [("mixed", s, {}) for s in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")]
    assert_equal_to_eager(launch(schedule_cases, 4, (cases,), timeout=LAUNCH_TIMEOUT))


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_tied_weights_freed_parameters_and_recompute_stay_equal_to_eager_when_sharded() -> None:
    cases = [
        ("tied", "1f1b", {"split": ["blocks.1"]}),  # embedding and head on two ranks
        ("tied", "zb-v", {"split": ["blocks.0", "blocks.1", "blocks.2"]}),  # on one rank, two stages
        ("mixed", "zb-v", {"reshard_after_forward": True}),
        ("mixed", "1f1b", {"checkpoint": True, "reshard_after_forward": [True, False]}),
    ]
    assert_equal_to_eager(launch(schedule_cases, 4, (cases,), timeout=LAUNCH_TIMEOUT))


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_sharded_stages_match_eager_under_dualpipev_on_four_gloo_ranks() -> None:
    """2 workers x 2 sharded replicas, 5 micro-batches each (dualpipev's least is 3): one
    micro-batch per row, so the replicas' cut is eager's; and the tied LM (embedding and head
    on one rank) with recompute."""
    cases = [
        ("mixed", "dualpipev", {"m": 5}),
        ("tied", "dualpipev", {"m": 5, "split": ["blocks.0", "blocks.1", "blocks.2"], "checkpoint": True}),
    ]
    assert_equal_to_eager(launch(schedule_cases, 4, (cases,), timeout=LAUNCH_TIMEOUT))


# ---------------------------------------------------------------- the keep-or-free rule
def test_a_stage_alone_on_its_rank_keeps_its_gathered_parameters_even_over_memory() -> None:
    assert keep_gathered({0: 100.0}, resident=50.0, memory=10.0) == {0: True}


def test_stages_keep_their_parameters_while_the_peak_fits_and_free_them_beyond() -> None:
    # one stage kept costs as much as both: the other is gathered for its own actions anyway
    assert keep_gathered({0: 100.0, 3: 100.0}, resident=50.0, memory=250.0) == {0: True, 3: True}
    assert keep_gathered({0: 100.0, 3: 100.0}, resident=50.0, memory=249.0) == {0: False, 3: False}
    # peaks: none kept 100, stage 0 kept 200, stages 0 and 1 (or 0 and 2) kept 210
    assert keep_gathered({0: 100.0, 1: 100.0, 2: 10.0}, resident=0.0, memory=205.0) == {0: True, 1: False, 2: False}


def test_reshard_choice_follows_the_plan_and_names_a_wrong_length() -> None:
    ids, _ = data()
    part = fxpipe.partition(Mixed(), fxpipe.Plan(**sharded_plan("zb-v", reshard_after_forward=[True, False, False, True])), example_inputs=(ids,))
    assert reshard_choice(part, [0, 3], 2) == {0: True, 3: True}
    assert reshard_choice(part, [1, 2], 2) == {1: False, 2: False}
    part = fxpipe.partition(Mixed(), fxpipe.Plan(**sharded_plan("zb-v", reshard_after_forward=[True, False])), example_inputs=(ids,))
    with pytest.raises(fxpipe.PlanError, match=r"reshard_after_forward lists 2 value\(s\) but the plan has 4 stages"):
        reshard_choice(part, [0, 3], 2)
    # chosen: tiny stages fit any memory, so every stage keeps its parameters gathered
    part = fxpipe.partition(Mixed(), fxpipe.Plan(**sharded_plan("zb-v")), example_inputs=(ids,))
    assert reshard_choice(part, [0, 3], 2) == {0: False, 3: False}
    specs = {"cpu:0": fxpipe.DeviceSpec(flops=1e9, memory=1.0, bandwidth=1e9)}
    part = fxpipe.partition(Mixed(), fxpipe.Plan(**sharded_plan("zb-v"), device_specs=specs), example_inputs=(ids,))
    assert reshard_choice(part, [0, 3], 2) == {0: True, 3: True}  # one memory unit: both freed after each action


# ---------------------------------------------------------------- errors
def test_sharding_is_refused_in_one_process_and_its_options_are_checked() -> None:
    ids, _ = data()
    with pytest.raises(fxpipe.PlanError, match=r"plan.fsdp=True shards each stage .* launch under torchrun"):
        fxpipe.compile(Mixed(), dict(fsdp=True, data_parallel=2), example_inputs=(ids,))
    with pytest.raises(fxpipe.PlanError, match=r"plan.fsdp = 'yes': must be True or False"):
        fxpipe.Plan(fsdp="yes")
    with pytest.raises(fxpipe.PlanError, match=r"applies to sharded stages only: set plan.fsdp=True"):
        fxpipe.Plan(reshard_after_forward=True)
    with pytest.raises(fxpipe.PlanError, match=r"give True, False, one bool per stage"):
        fxpipe.Plan(fsdp=True, reshard_after_forward="always")


# ---------------------------------------------------------------- state, checkpoints, clipping
def eager_after_one_step(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    ref = model_of("mixed")
    ids, t = data()
    eager_microbatch_step(ref, (ids,), t, CE, 4)
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
            p.grad = None
    return ref, ids, t


def checkpoint_cases(path: str) -> dict:
    """pp=2 x dp=2 sharded: one SGD step, its state dict, clipping, a DCP save; then a
    pp=4 pipeline (not sharded) loads the checkpoint, and one sharded again loads the pp=4
    one's: every next-step loss against eager's."""
    import torch.distributed.checkpoint as dcp

    out = {}
    ref, ids, t = eager_after_one_step()
    sharded = fxpipe.compile(model_of("mixed"), sharded_plan("1f1b"), example_inputs=(ids,), loss_fn=CE)
    sharded.step(ids, target=t)
    clipped = copy.deepcopy(model_of("mixed"))
    eager_microbatch_step(clipped, (ids,), t, CE, 4)
    eager_norm = torch.nn.utils.clip_grad_norm_(clipped.parameters(), 0.05)
    norm = sharded.clip_grad_norm_(0.05)
    expected = dict(clipped.named_parameters())
    out["norm"] = abs(float(norm) - float(eager_norm))
    out["clipped"] = max(float((full(p.grad) - expected[n].grad).abs().max()) for n, p in sharded.named_parameters())
    sharded.zero_grad()
    sharded.step(ids, target=t)
    torch.optim.SGD(sharded.parameters(), lr=LR).step()
    state = sharded.state_dict()
    want = ref.state_dict()
    out["state"] = (sorted(state) == sorted(k for k in want if k in state), max(float((v - want[k]).abs().max()) for k, v in state.items()))
    dcp.save(sharded.sharded_state_dict(), checkpoint_id=f"{path}/pp2dp2")
    eager_next = float(eager_microbatch_step(copy.deepcopy(ref), (ids,), t, CE, 4))
    four = dict(devices=[f"cpu:{k}" for k in range(4)], split=SPLIT4, microbatches=4)
    torch.manual_seed(5)
    deep = fxpipe.compile(Mixed().double(), four, example_inputs=(ids,), loss_fn=CE)  # other weights until loaded
    dcp.load(deep.sharded_state_dict(), checkpoint_id=f"{path}/pp2dp2")
    out["pp4 after pp2dp2"] = abs(float(deep.step(ids, target=t)) - eager_next)
    dcp.save(deep.sharded_state_dict(), checkpoint_id=f"{path}/pp4")
    again = fxpipe.compile(Mixed().double(), sharded_plan("zb-v"), example_inputs=(ids,), loss_fn=CE)
    dcp.load(again.sharded_state_dict(), checkpoint_id=f"{path}/pp4")
    out["zb-v pp2dp2 after pp4"] = abs(float(again.step(ids, target=t)) - eager_next)
    again.load_state_dict(model_of("mixed").state_dict())  # whole tensors in: each rank keeps its shard
    out["loaded whole"] = max(float((v - model_of("mixed").state_dict()[k]).abs().max()) for k, v in again.state_dict().items())
    return out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_sharded_checkpoint_loads_into_another_layout_and_state_and_clipping_equal_eager(tmp_path) -> None:
    for rank, got in enumerate(launch(checkpoint_cases, 4, (str(tmp_path),), timeout=LAUNCH_TIMEOUT)):
        assert got["norm"] < 1e-12 and got["clipped"] < 1e-12, (rank, got)
        same_keys, state_error = got["state"]
        assert same_keys and state_error < 1e-12, (rank, got)
        for case in ("pp4 after pp2dp2", "zb-v pp2dp2 after pp4"):
            assert got[case] < 1e-12, (rank, case, got)
        assert got["loaded whole"] == 0.0, (rank, got)


# ---------------------------------------------------------------- gathering and freeing
def gathered_before_each_action(reshard: bool) -> dict:
    """Per call (a step, then a forward), each of this rank's actions and whether its
    stage's parameters were gathered before fxpipe's hook ran; whether any stage is still
    gathered after the calls."""
    ids, t = data()
    pipe = fxpipe.compile(model_of("mixed"), sharded_plan("zb-v", reshard_after_forward=reshard), example_inputs=(ids,), loss_fn=CE)
    seen: list[tuple[str, bool]] = []

    class Record:
        def before(self, action, runner, step) -> None:
            seen.append((str(action), not isinstance(next(runner.module.parameters()), DTensor)))

        def after(self, action, runner, step) -> None:
            pass

    pipe.action_hooks.append(Record())
    pipe.step(ids, target=t)
    step = list(seen)
    seen.clear()
    pipe(ids)
    gathered_after = any(not isinstance(p, DTensor) for m in pipe._modules for p in m.parameters())
    return {"step": step, "forward": list(seen), "after": gathered_after}


def export_signatures_case() -> dict:
    """Export bakes the sequence length in: a second length is a new trace, whose stages use
    the sharded units' gathered parameters."""
    out = {}
    model = model_of("mixed")
    ref = copy.deepcopy(model)
    ids, t = data()
    pipe = fxpipe.compile(model, sharded_plan("zb-h1", frontend="export"), example_inputs=(ids,), loss_fn=CE)
    for length in (5, 7):
        pipe.zero_grad()
        ref.zero_grad()
        ids = torch.randint(0, 20, (10, length), generator=torch.Generator().manual_seed(length))
        loss = pipe.step(ids, target=t)
        eager = eager_microbatch_step(ref, (ids,), t, CE, 4)
        expected = dict(ref.named_parameters())
        grad = max(float((full(p.grad) - expected[n].grad).abs().max()) for n, p in pipe.named_parameters())
        out[length] = (abs(float(loss) - float(eager)), grad)
    out["signatures"] = len(pipe.signatures)
    return out


def freeing_and_signature_cases() -> dict:
    return {"freed": gathered_before_each_action(True), "kept": gathered_before_each_action(False), "export": export_signatures_case()}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_parameters_are_freed_after_each_action_or_kept_until_reduced_and_new_signatures_share_the_shards() -> None:
    for rank, got in enumerate(launch(freeing_and_signature_cases, 4, (), timeout=LAUNCH_TIMEOUT)):
        for call in ("step", "forward"):
            freed, kept = got["freed"][call], got["kept"][call]
            assert freed and not any(gathered for _, gathered in freed), (rank, call, freed)  # every action found its stage freed
            first: set[str] = set()
            for action, gathered in kept:
                stage = action[1:].split(":")[0]
                assert gathered == (stage in first), (rank, call, action, kept)  # gathered from the stage's first action on
                first.add(stage)
        assert not got["freed"]["after"] and not got["kept"]["after"], (rank, got)  # every call ends sharded
        assert got["export"]["signatures"] == 2, (rank, got)
        for length in (5, 7):
            loss_error, grad_error = got["export"][length]
            assert loss_error < 1e-12 and grad_error < 1e-10, (rank, length, got)


# ---------------------------------------------------------------- a replica that dies
def killed_replica_case(victim: int) -> dict:
    """Rank ``victim`` (stage 0 of replica 1) dies after a step; the next step's all-gather
    with it fails on its replica peer, whose error must name it."""
    import os
    import signal
    import time

    from fxpipe.distributed import RankFailedError

    ids, t = data()
    pipe = fxpipe.compile(model_of("mixed"), {**sharded_plan("1f1b"), "timeout": 20}, example_inputs=(ids,), loss_fn=CE)
    pipe.step(ids, target=t)
    if pipe.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        pipe.step(ids, target=t)
    except RankFailedError as err:
        return {"rank": err.rank, "message": str(err), "elapsed": time.monotonic() - start}
    return {"rank": None, "message": "no error", "elapsed": 0.0}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_dead_replica_is_named_by_the_ranks_sharing_its_stage_and_the_others() -> None:
    from fxpipe.distributed import LaunchError

    with pytest.raises(LaunchError) as info:
        launch(killed_replica_case, 4, (2,), timeout=LAUNCH_TIMEOUT)
    assert list(info.value.errors) == [2], info.value
    for rank, got in info.value.results.items():
        assert got["rank"] == 2 and "rank 2" in got["message"] and got["elapsed"] < 20, (rank, got)


def optimizer_on_the_model(name: str, plan: dict, steps: int = 3) -> dict:
    """SGD on ``model.parameters()`` (built after compiling, as with FSDP2's fully_shard)
    against eager: each step's loss error; whether the model now holds the pipeline's
    sharded parameters (and which of its names lead to them)."""
    model, ids, t, ref, ref_opt, pipe = _pipeline_and_eager(name, plan)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    errors = []
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(ids, target=t)
        eager = eager_microbatch_step(ref, (ids,), t, CE, plan["microbatches"] * plan["data_parallel"])
        errors.append(abs(float(loss) - float(eager)))
        opt.step()
        ref_opt.step()
    own = {id(p) for p in model.parameters()}
    return {
        "loss": errors,
        "own": all(id(p) in own for p in pipe.parameters()),
        "sharded": [n for n, p in model.named_parameters() if isinstance(p, DTensor)],
        "tied": model.head.weight is model.emb.weight if name == "tied" else True,
    }


def own_parameter_cases() -> dict:
    one_stage = dict(devices=["cpu:0"], split=[], microbatches=2, data_parallel=2, fsdp=True)
    return {"tied": optimizer_on_the_model("tied", one_stage), "mixed": optimizer_on_the_model("mixed", one_stage)}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_an_optimizer_on_the_models_parameters_trains_the_sharded_pipeline_as_eager() -> None:
    """Plan(fsdp=True) on 2 ranks (1 stage x 2 replicas): the model holds the sharded
    parameters the pipeline trains, so SGD on model.parameters() follows eager, float64."""
    for rank, cases in enumerate(launch(own_parameter_cases, 2, timeout=LAUNCH_TIMEOUT)):
        for name, got in cases.items():
            assert max(got["loss"]) < 1e-12, (rank, name, got)
            assert got["own"] and got["sharded"] and got["tied"], (rank, name, got)
