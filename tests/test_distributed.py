"""One process per pipeline worker (gloo on 127.0.0.1): equal to eager, and failing loudly.

Each test starts its processes with ``fxpipe.distributed.launch``; the work runs in
module-level functions that return what they measured, and the assertions run here.
Several pipelines share one launch to keep the file fast on a 2-core machine.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torchvision
from test_randomness import PLANS, DropoutMLP
from test_randomness import run as run_dropout
from test_runtime import Blocks, WithAux
from test_tags_and_edges import Encoder, SkipOverStage, StructuredValues
from torch import nn

import fxpipe
from fxpipe.batching import microbatch
from fxpipe.distributed import LaunchError, PlanMismatchError, RankFailedError, launch
from fxpipe.distributed.comm import (
    CommPlanError,
    Message,
    check_rendezvous,
    fused_groups,
    messages_for,
    nccl_plans,
)
from fxpipe.distributed.specs import LeafSpec, ValueSpec, derive_edge_specs, fake_extras
from fxpipe.passes.fake_replay import FakeReplay
from fxpipe.runtime.placement import skeleton
from fxpipe.schedules import make_schedule, stage_workers

CE = nn.CrossEntropyLoss()
LAUNCH_TIMEOUT = 120


class TiedLM(nn.Module):
    """An embedding whose weight is also the output head's: the two uses end up on different ranks."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx))).mean(1))


def mlp(width: int = 16, depth: int = 4, classes: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def eager_reference(model: nn.Module, args: tuple, target: torch.Tensor, m: int) -> tuple[nn.Module, float]:
    """A copy of ``model`` after eager forward/backward over the pipeline's micro-batches."""
    ref = copy.deepcopy(model)
    pieces, sizes = microbatch.split((list(args), target), m)
    loss_of = microbatch.weighted_loss(CE, lambda i, out: out, [p[1] for p in pieces], microbatch.loss_weights(sizes, CE))
    total = 0.0
    for i, (inputs, _) in enumerate(pieces):
        loss = loss_of(i, ref(*inputs))
        loss.backward()
        total += float(loss)
    return ref, total


def compare(pipe, ref: nn.Module, eager_loss: float, loss: torch.Tensor) -> dict:
    """This rank's differences to eager: loss, and the largest gradient difference."""
    expected = dict(ref.named_parameters())
    worst = 0.0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"rank {pipe.rank}: {name} has no gradient"
        worst = max(worst, float((p.grad - expected[name].grad).abs().max() / (expected[name].grad.abs().max() + 1e-6)))
    return {"loss_err": abs(float(loss) - eager_loss), "grad_err": worst, "params": [n for n, _ in pipe.named_parameters()]}


def check_case(model: nn.Module, plan: dict, args: tuple, target: torch.Tensor, m_eager: int | None = None, **compile_kw) -> dict:
    plan = fxpipe.Plan(**plan)
    model.zero_grad()  # the pipeline's parameters are the model's: an earlier case's gradients are on them
    ref, eager_loss = eager_reference(model, args, target, m_eager or plan.microbatches)
    pipe = fxpipe.compile(model, plan, example_inputs=args, loss_fn=CE, **compile_kw)
    loss = pipe.step(*args, target=target)
    return compare(pipe, ref, eager_loss, loss)


# ---------------------------------------------------------------- rank functions
def two_rank_cases() -> dict:
    torch.manual_seed(0)
    out = {}
    x, t = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    resnet = torchvision.models.resnet18(num_classes=10)
    for schedule in ("gpipe", "1f1b"):
        plan = dict(devices=["cpu:0", "cpu:1"], split=["layer3"], schedule=schedule, microbatches=4)
        out[f"resnet18 {schedule}"] = check_case(resnet, plan, (x,), t)
    plan = dict(devices=["cpu:0", "cpu:1"], split=["layer2", "layer3", "layer4"], schedule="interleaved-1f1b", chunks=2, microbatches=4)
    out["resnet18 interleaved"] = check_case(resnet, plan, (x,), t)

    xs, ts = torch.randn(8, 12), torch.randint(0, 3, (8,))
    plan = dict(devices=["cpu:0", "cpu:1"], split=["b", "c", "out"], schedule="interleaved-1f1b", chunks=2, microbatches=3)
    out["skip interleaved"] = check_case(SkipOverStage(), plan, (xs,), ts)
    # recomputed in backward, with a skip edge that stays on one rank (stage 0 -> stage 2)
    out["skip interleaved checkpoint"] = check_case(SkipOverStage(), {**plan, "checkpoint": True}, (xs,), ts)

    xv, tv = torch.randn(8, 6), torch.randint(0, 2, (8,))
    plan = dict(devices=["cpu:0", "cpu:1"], microbatches=4, frontend="fx", concrete_args={"extra": None}, leaf_modules=[Encoder])
    out["structured values"] = check_case(StructuredValues(), plan, (xv,), tv)

    tokens, tt = torch.randint(0, 11, (8, 5)), torch.randint(0, 11, (8,))
    out["tied across ranks"] = check_case(TiedLM(), dict(devices=["cpu:0", "cpu:1"], split=["mid"], microbatches=4), (tokens,), tt)

    # new input signatures: another batch size, then a short batch with uneven micro-batches
    net = mlp()
    pipe = fxpipe.compile(net, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["4"], microbatches=4), example_inputs=(torch.randn(8, 16),), loss_fn=CE)
    for n in (8, 12, 5, 12):
        xb, tb = torch.randn(n, 16), torch.randint(0, 3, (n,))
        pipe.zero_grad()
        ref, eager_loss = eager_reference(net, (xb,), tb, 4)
        out[f"mlp batch {n}"] = compare(pipe, ref, eager_loss, pipe.step(xb, target=tb))
    y = pipe(xb)
    out["forward"] = None if y is None else float((y - net(xb)).abs().max())
    out["signatures"] = sum(len(p.specs) for p in pipe._programs.values())

    # one runtime for both executors: a step under no_grad still computes every gradient,
    # and a float64 model's loss crosses ranks in float64
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["4"], microbatches=4)
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    net.zero_grad()  # the last pipeline's gradients are on the model's own parameters
    ref, eager_loss = eager_reference(net, (x,), t, 4)
    pipe = fxpipe.compile(net, plan, example_inputs=(x,), loss_fn=CE)
    with torch.no_grad():
        out["no_grad step"] = compare(pipe, ref, eager_loss, pipe.step(x, target=t))
    net64, x64 = mlp().double(), x.double()
    ref, eager_loss = eager_reference(net64, (x64,), t, 4)
    pipe = fxpipe.compile(net64, plan, example_inputs=(x64,), loss_fn=CE)
    loss = pipe.step(x64, target=t)
    out["float64"] = {**compare(pipe, ref, eager_loss, loss), "dtype": str(loss.dtype)}
    # the input's gradient reaches the caller on the rank whose stage reads the input
    xg, xe = x64.clone().requires_grad_(), x64.clone().requires_grad_()
    pipe.step(xg, target=t)
    CE(copy.deepcopy(net64)(xe), t).backward()
    out["input grad"] = None if xg.grad is None else float((xg.grad - xe.grad).abs().max())

    # the caller's autocast reaches every rank, and is part of the input signature: a float32
    # step first, then the same shapes under bf16 autocast
    blocks, xb, tb = Blocks(), torch.randn(8, 6, 32), torch.randint(0, 5, (8,))
    pipe = fxpipe.compile(blocks, dict(devices=["cpu:0", "cpu:1"], split=["blocks.2"], microbatches=4), example_inputs=(xb,), loss_fn=CE)
    pipe.step(xb, target=tb)
    pipe.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, eager_loss = eager_reference(blocks, (xb,), tb, 4)
        loss = pipe.step(xb, target=tb)
    out["autocast"] = {**compare(pipe, ref, eager_loss, loss), "dtype": str(loss.dtype)}

    # an unbatched output (a 0-d aux loss) merged on the last rank as the plan says
    aux_model, xa = WithAux().double(), torch.randn(10, 16, dtype=torch.float64)
    pipe = fxpipe.compile(aux_model, dict(devices=["cpu:0", "cpu:1"], split=["b"], microbatches=4, output_merge={"aux": "mean"}), example_inputs=(xa,))
    got = pipe(xa)
    out["aux"] = None if got is None else float((got["aux"] - aux_model(xa)["aux"]).abs())

    # dropout: the same masks as the local executor draws from the same seed
    loss, grads = dropout_case()
    out["dropout"] = {"loss": float(loss), "grads": grads}
    return out


def dropout_case() -> tuple[torch.Tensor, dict]:
    """A dropout MLP's 1F1B step after manual_seed(7), in this process (local or a rank)."""
    torch.manual_seed(0)
    model = DropoutMLP().double()
    x, t = torch.randn(10, 16, dtype=torch.float64), torch.randint(0, 3, (10,))
    return run_dropout(model, PLANS["1f1b"], x, t)


def four_rank_cases() -> dict:
    torch.manual_seed(0)
    out = {}
    xs, ts = torch.randn(8, 12), torch.randint(0, 3, (8,))
    for schedule in ("gpipe", "1f1b"):
        plan = dict(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], split=["b", "c", "out"], schedule=schedule, microbatches=4)
        out[f"skip {schedule}"] = check_case(SkipOverStage(), plan, (xs,), ts)
    # 2 stages x 2 replicas against eager on the full batch (10 samples: shards of 5, micro-batches of 3 and 2)
    x, t = torch.randn(10, 16), torch.randint(0, 3, (10,))
    plan = dict(devices=["cpu:0", "cpu:1"], split=["4"], microbatches=2, data_parallel=2)
    out["dp 2x2"] = check_case(mlp(), plan, (x,), t, m_eager=1)
    pipe = fxpipe.compile(mlp(), plan, example_inputs=(x,), loss_fn=CE)
    pipe.step(x, target=t)
    timeline = pipe.timeline()  # this replica's pipeline, gathered
    out["dp 2x2 timeline"] = (timeline.ranks, sorted({e.worker for e in timeline.events}))
    plan = dict(devices=["cpu:0"], split=[], microbatches=1, data_parallel=4)
    out["dp 1x4"] = check_case(mlp(), plan, (x,), t, m_eager=1)
    return out


def meta_cases(path: str) -> dict:
    torch.manual_seed(0)
    eager = mlp(width=32, depth=6)
    eager.load_state_dict(torch.load(path.replace(".safetensors", ".pt")))
    with torch.device("meta"):
        model = mlp(width=32, depth=6)
    x, t = torch.randn(8, 32), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["6"], microbatches=4)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE, weights=path)
    held = pipe.state_dict()
    same = all(torch.equal(v, eager.state_dict()[k]) for k, v in held.items())
    others = [s.index for s in pipe.stages if s.index not in pipe.local_stages]
    meta_elsewhere = all(p.is_meta for s in others for p in pipe.stages[s].module.parameters())
    ref, eager_loss = eager_reference(eager, (x,), t, 4)
    result = compare(pipe, ref, eager_loss, pipe.step(x, target=t))
    fresh = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)  # the modules' reset_parameters
    finite = all(bool(torch.isfinite(p).all()) for p in fresh.parameters())
    return {**result, "same_weights": same, "keys": sorted(held), "meta_elsewhere": meta_elsewhere, "reset_finite": finite}


def killed_rank_case(victim: int) -> dict:
    torch.manual_seed(0)
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], split=["2", "4", "6"], microbatches=4, timeout=20)
    pipe = fxpipe.compile(mlp(), plan, example_inputs=(x,), loss_fn=CE)
    pipe.step(x, target=t)
    if pipe.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return failure_of(lambda: pipe.step(x, target=t))


def failure_of(step) -> dict:
    """The RankFailedError ``step()`` raises: which rank and stage it names, and how fast."""
    start = time.monotonic()
    try:
        step()
    except RankFailedError as err:
        return {"rank": err.rank, "stage": err.stage, "message": str(err), "elapsed": time.monotonic() - start}
    return {"rank": None, "stage": None, "message": "no error", "elapsed": 0.0}


def raising_stage_case() -> dict:
    torch.manual_seed(0)
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pipe = fxpipe.compile(mlp(), fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["4"], microbatches=4, timeout=20), example_inputs=(x,), loss_fn=CE)

    def boom(module, args, output):
        raise ValueError("boom in stage 1")

    if pipe.rank == 1:
        pipe.stages[1].module.register_forward_hook(boom)
    return failure_of(lambda: pipe.step(x, target=t))


def mismatched_plan_case() -> str:
    rank = int(os.environ["RANK"])
    x = torch.randn(8, 16)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["4"], microbatches=4 if rank == 0 else 2, timeout=20)
    try:
        fxpipe.compile(mlp(), plan, example_inputs=(x,), loss_fn=CE)
    except PlanMismatchError as err:
        return str(err)
    return "no error"


# ------------------------------------------------------------------------ tests
def assert_equal_to_eager(results: dict) -> None:
    for case, r in results.items():
        if isinstance(r, dict) and case not in ("autocast", "dropout"):
            assert r["loss_err"] < 1e-5, (case, r)
            assert r["grad_err"] < 1e-4, (case, r)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_gpipe_1f1b_interleaved_skip_and_structured_values_match_eager_on_two_ranks() -> None:
    ranks = launch(two_rank_cases, 2, timeout=LAUNCH_TIMEOUT)
    for r in ranks:
        assert_equal_to_eager(r)
    # each rank holds only its own stages' parameters; together they hold the model's
    first, second = ranks
    resnet = [n for n, _ in torchvision.models.resnet18(num_classes=10).named_parameters()]
    assert not set(first["resnet18 1f1b"]["params"]) & set(second["resnet18 1f1b"]["params"])
    assert sorted(first["resnet18 1f1b"]["params"] + second["resnet18 1f1b"]["params"]) == sorted(resnet)
    assert first["forward"] is None and second["forward"] < 1e-5  # outputs live on the last stage
    assert first["signatures"] == 4  # micro-batches of 2, 3, 2 and 1 samples: one fake run each
    assert "emb.weight" in first["tied across ranks"]["params"] and "emb.weight" in second["tied across ranks"]["params"]
    for r in ranks:
        assert r["float64"]["dtype"] == "torch.float64" and r["float64"]["loss_err"] < 1e-12, r["float64"]
        assert r["autocast"]["loss_err"] < 1e-2 and r["autocast"]["grad_err"] < 5e-2, r["autocast"]
    assert first["aux"] is None and second["aux"] < 1e-14
    assert first["input grad"] < 1e-12 and second["input grad"] is None
    local_loss, local_grads = dropout_case()
    assert first["dropout"]["loss"] == second["dropout"]["loss"] == float(local_loss)  # bitwise
    for r in ranks:
        for name, g in r["dropout"]["grads"].items():
            assert torch.equal(g, local_grads[name]), name


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_skip_edges_across_ranks_and_data_parallel_replicas_match_eager_on_four_ranks() -> None:
    ranks = launch(four_rank_cases, 4, timeout=LAUNCH_TIMEOUT)
    for r in ranks:
        assert_equal_to_eager(r)
    assert ranks[0]["dp 2x2"]["params"] == ranks[2]["dp 2x2"]["params"]  # replicas hold the same stage
    assert [r["dp 2x2 timeline"] for r in ranks] == [([0, 1], [0, 1])] * 2 + [([2, 3], [0, 1])] * 2


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_meta_model_is_materialised_per_rank_from_a_checkpoint(tmp_path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    eager = mlp(width=32, depth=6)
    save_file(eager.state_dict(), tmp_path / "mlp.safetensors")
    torch.save(eager.state_dict(), tmp_path / "mlp.pt")
    ranks = launch(meta_cases, 2, (str(tmp_path / "mlp.safetensors"),), timeout=LAUNCH_TIMEOUT)
    for r in ranks:
        assert r["same_weights"] and r["meta_elsewhere"] and r["reset_finite"], r
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
    assert sorted(ranks[0]["keys"] + ranks[1]["keys"]) == sorted(eager.state_dict())
    assert not set(ranks[0]["keys"]) & set(ranks[1]["keys"])


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_killed_rank_makes_every_other_rank_fail_naming_it_within_the_timeout() -> None:
    with pytest.raises(LaunchError) as info:
        launch(killed_rank_case, 4, (2,), timeout=LAUNCH_TIMEOUT)
    assert list(info.value.errors) == [2], info.value  # only the victim died
    for rank, r in info.value.results.items():
        assert (r["rank"], r["stage"]) == (2, 2), (rank, r)
        assert "rank 2 (stage 2)" in r["message"], (rank, r)
        assert r["elapsed"] < 20, (rank, r)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_stage_that_raises_is_named_on_every_rank() -> None:
    for rank, r in enumerate(launch(raising_stage_case, 2, timeout=LAUNCH_TIMEOUT)):
        assert (r["rank"], r["stage"]) == (1, 1), (rank, r)
        assert "boom in stage 1" in r["message"] and "F1:0" in r["message"], r
        assert r["elapsed"] < 20


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_mismatched_plans_are_detected_at_start() -> None:
    for message in launch(mismatched_plan_case, 2, timeout=LAUNCH_TIMEOUT):
        assert "rank 1 differs from rank 0 in plan" in message and "microbatches=2" in message, message


# ------------------------------------------------- in-process: message plans, specs
def chain_messages(schedule: str, num_stages: int, m: int, chunks: int = 1) -> dict:
    actions = make_schedule(schedule, num_stages, m, chunks)
    edges = [(s, s + 1) for s in range(num_stages - 1)]
    spec = ValueSpec(None, (LeafSpec((2, 4), torch.float32, True),))
    recv = [[e for e, (_, d) in enumerate(edges) if d == s] for s in range(num_stages)]
    send = [[e for e, (src, _) in enumerate(edges) if src == s] for s in range(num_stages)]
    owner = stage_workers(actions)
    plans = {w: messages_for(todo, recv, send, edges, lambda s: owner[s], w, lambda e, i: spec) for w, todo in enumerate(actions)}
    return {w: fused_groups(plan) for w, plan in nccl_plans(plans).items()}


@pytest.mark.parametrize(
    "schedule,stages,chunks",
    [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 2, 1), ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 6, 3), ("interleaved-1f1b", 8, 2), ("zb-h1", 4, 1), ("zb-v", 4, 2), ("zb-v", 8, 2), ("v-half", 8, 2), ("v-min", 8, 2)],
)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_fused_send_recv_groups_cannot_deadlock_under_nccl_ordering(schedule: str, stages: int, chunks: int, m: int) -> None:
    check_rendezvous(chain_messages(schedule, stages, m, chunks))


@pytest.mark.parametrize("stages,m", [(4, 3), (4, 4), (4, 8), (8, 7), (8, 8), (8, 11), (12, 12)])
def test_dualpipev_send_recv_groups_cannot_deadlock_under_nccl_ordering(stages: int, m: int) -> None:
    """dualpipev's F/B pairs post an activation and a gradient back to back, on both edges of
    the V: from its least count (2p - 1) on."""
    check_rendezvous(chain_messages("dualpipev", stages, m, 2))


def test_rendezvous_check_reports_a_mismatched_order() -> None:
    a = Message("act", 0, 0, 1, (0,))
    b = Message("act", 0, 1, 1, (0,))
    groups = {0: [([a, b], [])], 1: [([], [Message("act", 0, 1, 0, (0,)), Message("act", 0, 0, 0, (0,))])]}
    with pytest.raises(CommPlanError, match="mismatch"):
        check_rendezvous(groups)
    deadlock = {0: [([], [Message("grad", 0, 0, 1, (0,))]), ([a], [])], 1: [([], [Message("act", 0, 0, 0, (0,))]), ([Message("grad", 0, 0, 0, (0,))], [])]}
    with pytest.raises(CommPlanError, match="deadlock"):
        check_rendezvous(deadlock)


def test_edge_specs_follow_the_micro_batch_and_keep_non_tensor_values() -> None:
    x = torch.randn(8, 6)
    part = fxpipe.partition(StructuredValues(), fxpipe.Plan(microbatches=4, frontend="fx", concrete_args={"extra": None}, leaf_modules=[Encoder]), example_inputs=(x,))
    ids = {id(e): k for k, e in enumerate(part.partitioned.edges)}
    recv = [[ids[id(e)] for e in s.inputs] for s in part.stages]
    send = [[ids[id(e)] for e in s.outputs] for s in part.stages]
    specs = derive_edge_specs(
        [skeleton(s.module) for s in part.stages], recv, send, part.bind_inputs((x[:3],), {}), train=True,
        extras=[fake_extras(s) for s in part.stages], replay=FakeReplay(device="cpu"),
    )
    leaves = [leaf for spec in specs.values() for leaf in spec.leaves]
    assert None in leaves and 3 in leaves and 6 in leaves  # None, the dict's number, x.size(1)
    tensors = [leaf for leaf in leaves if isinstance(leaf, LeafSpec)]
    assert {leaf.shape for leaf in tensors} == {(3, 6)} and torch.bool in {leaf.dtype for leaf in tensors}
    assert not any(leaf.requires_grad for leaf in tensors if leaf.dtype == torch.bool)


@pytest.mark.parametrize("m", [2, 3, 4, 5])
def test_interleaved_1f1b_in_the_local_executor_matches_eager(m: int) -> None:
    torch.manual_seed(0)
    x, t = torch.randn(10, 12), torch.randint(0, 3, (10,))
    model = SkipOverStage()
    ref, eager_loss = eager_reference(model, (x,), t, m)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["b", "c", "out"], schedule="interleaved-1f1b", chunks=2, microbatches=m)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    loss = pipe.step(x, target=t)
    assert abs(float(loss) - eager_loss) < 1e-5
    expected = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_nccl_pipeline_on_two_gpus_matches_eager() -> None:
    for r in launch(cuda_case, 2, timeout=LAUNCH_TIMEOUT):
        assert r["loss_err"] < 1e-4 and r["grad_err"] < 1e-3, r


def cuda_case() -> dict:
    torch.manual_seed(0)
    model = mlp()
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    ref, eager_loss = eager_reference(model, (x,), t, 4)
    plan = fxpipe.Plan(devices=["cuda:0", "cuda:1"], split=["4"], microbatches=4)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=CE)
    loss = pipe.step(x.to(pipe.device), target=t.to(pipe.device))
    expected = dict(ref.named_parameters())
    worst = max(float((p.grad.cpu() - expected[n].grad).abs().max()) for n, p in pipe.named_parameters())
    return {"loss_err": abs(float(loss) - eager_loss), "grad_err": worst}


SCRIPT = """
import torch, fxpipe
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
x, t = torch.randn(8, 8), torch.randint(0, 3, (8,))
pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4), example_inputs=(x,), loss_fn=torch.nn.CrossEntropyLoss())
loss = pipe.step(x, target=t)
print(f"rank {pipe.rank} {type(pipe).__name__} loss {loss.item():.6f}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_unchanged_script_runs_under_torchrun(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, "-m", "fxpipe.distributed", "-n", "2", str(script)], capture_output=True, text=True, timeout=170)
    found = sorted(re.findall(r"rank (\d) (\w+) loss (\d+\.\d{6})", run.stdout))
    assert run.returncode == 0 and [r for r, _, _ in found] == ["0", "1"], run.stdout + run.stderr
    assert {kind for _, kind, _ in found} == {"DistributedPipeline"}
    assert found[0][2] == found[1][2]  # the loss on every rank


def rank_tensor() -> dict:
    return {"rank": int(os.environ["RANK"]), "value": torch.arange(3.0) * int(os.environ["RANK"])}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_launch_returns_tensors_from_every_rank() -> None:
    results = launch(rank_tensor, 2, timeout=LAUNCH_TIMEOUT)
    assert [r["rank"] for r in results] == [0, 1]
    torch.testing.assert_close(results[1]["value"], torch.tensor([0.0, 1.0, 2.0]))


def replicas_with_batchnorm() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    x, t = torch.randn(8, 6), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)  # before the step, which updates the model's own statistics
    pipe = fxpipe.compile(model, fxpipe.Plan(data_parallel=2, microbatches=2), example_inputs=(x,), loss_fn=CE)
    pipe.step(x, target=t)
    # what each replica saw: its half of the batch, cut into two micro-batches
    shard = x[4:] if int(os.environ["RANK"]) else x[:4]
    for piece in shard.tensor_split(2):
        ref(piece)
    state = pipe.state_dict()
    return {"mean": state["1.running_mean"], "own": ref.state_dict()["1.running_mean"]}


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_batchnorm_statistics_are_averaged_over_replicas() -> None:
    first, second = launch(replicas_with_batchnorm, 2, timeout=LAUNCH_TIMEOUT)
    torch.testing.assert_close(first["mean"], second["mean"])
    torch.testing.assert_close(first["mean"], (first["own"] + second["own"]) / 2)
