"""Zero-bubble schedules end to end: I/W split stages equal eager, locally and on gloo ranks."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import assert_grads_match, eager_microbatch_step
from torch import nn

import fxpipe
from fxpipe.distributed import launch

CE = nn.CrossEntropyLoss()
LAUNCH_TIMEOUT = 180


class Mixed(nn.Module):
    """Every kind of weight the I/W split handles (embedding, linear, convolution, addmm
    with a parameter) and one it leaves to I (LayerNorm), in eight blocks."""

    def __init__(self, width: int = 12, vocab: int = 20) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(6))
        self.norm = nn.LayerNorm(width)
        self.w = nn.Parameter(torch.randn(width, 3) / width)
        self.b = nn.Parameter(torch.zeros(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h).mean(1)
        return torch.addmm(self.b, h, self.w)


def _data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 20, (n, 5)), torch.randint(0, 3, (n,))


SPLIT4 = ["blocks.1", "blocks.3", "blocks.5"]
SPLIT8 = ["conv", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5"]
V_SHAPED = ("zb-v", "v-half", "v-min", "dualpipev")


def zb_plan(schedule: str, m: int, workers: int = 2, **extra) -> dict:
    """ZB-H1 on 4 devices; a V schedule on ``workers`` devices (2: 4 stages, 4: 8 stages)."""
    if schedule in V_SHAPED:
        split = SPLIT4 if workers == 2 else SPLIT8
        return dict(devices=[f"cpu:{k}" for k in range(workers)], split=split, schedule=schedule, chunks=2, microbatches=m, **extra)
    return dict(devices=[f"cpu:{k}" for k in range(4)], split=SPLIT4, schedule=schedule, microbatches=m, **extra)


# every schedule x count x checkpoint under fx; export's graphs (aten ops) at two counts;
# the memory-controlled V schedules on 2 and 4 workers
CASES = [(s, m, c, "fx", 2) for s in ("zb-h1", "zb-v") for m in (1, 3, 4, 8) for c in (False, True)]
CASES += [(s, m, c, "export", 2) for s in ("zb-h1", "zb-v") for m in (4, 8) for c in (False, True)]
CASES += [(s, m, c, "fx", w) for s in ("v-half", "v-min") for m, c, w in ((1, False, 2), (5, False, 2), (8, True, 2), (8, False, 4))]


@pytest.mark.parametrize("schedule,m,checkpoint,frontend,workers", CASES)
def test_zero_bubble_schedules_match_eager_locally(schedule: str, m: int, checkpoint: bool, frontend: str, workers: int) -> None:
    torch.manual_seed(0)
    model = Mixed().double()
    ids, t = _data(10 if m <= 4 else 16)
    ref = copy.deepcopy(model)
    plan = zb_plan(schedule, m, workers, checkpoint=checkpoint, frontend=frontend)
    pipe = fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=CE)
    assert any("weight_grads" in s.extra_inputs for s in pipe.stages)  # the I/W split is in effect
    loss = pipe.step(ids, target=t)
    torch.testing.assert_close(loss, eager_microbatch_step(ref, (ids,), t, CE, m), rtol=1e-12, atol=1e-12)
    assert_grads_match(pipe, ref, rtol=1e-10, atol=1e-12)
    ops = {e.op for e in pipe.timeline().events}
    assert {"I", "W"} <= ops and "B" not in ops


# dualpipev's least count on 2 workers (3 = 2p - 1), 2p, and more, with and without
# recompute; on 4 workers (8 stages) at its least count (7) and at 2p (8)
DUALPIPEV_CASES = [(m, c, "fx", 2) for m in (3, 4, 8) for c in (False, True)] + [(8, False, "export", 2), (7, False, "fx", 4), (8, True, "fx", 4)]


@pytest.mark.parametrize("m,checkpoint,frontend,workers", DUALPIPEV_CASES)
def test_dualpipev_matches_eager_locally(m: int, checkpoint: bool, frontend: str, workers: int) -> None:
    torch.manual_seed(0)
    model = Mixed().double()
    ids, t = _data(16)
    ref = copy.deepcopy(model)
    pipe = fxpipe.compile(model, zb_plan("dualpipev", m, workers, checkpoint=checkpoint, frontend=frontend), example_inputs=(ids,), loss_fn=CE)
    loss = pipe.step(ids, target=t)
    torch.testing.assert_close(loss, eager_microbatch_step(ref, (ids,), t, CE, m), rtol=1e-12, atol=1e-12)
    assert_grads_match(pipe, ref, rtol=1e-10, atol=1e-12)
    events = [e for e in pipe.timeline().events if e.op in ("F", "B", "I", "W")]  # not the recv waits
    assert {(e.stage, e.worker) for e in events} == {(s, min(s, 2 * workers - 1 - s)) for s in range(2 * workers)}
    # whole backwards in the steady state, I and W in the warm-up and the tail
    assert {e.op for e in events} == {"F", "B", "I", "W"}
    # per worker: 2m F, 2m B or I, and a W for each of its 2p - 1 - w I's
    assert len(events) == sum(4 * m + 2 * workers - 1 - w for w in range(workers))
    with torch.no_grad():  # inference runs the schedule's forwards only, in its order
        torch.testing.assert_close(pipe(ids), ref(ids), rtol=1e-12, atol=1e-12)


def test_after_I_only_what_W_needs_is_held() -> None:
    """The first tanh's output is needed by the input gradient (the second tanh's backward),
    not by any weight gradient: it is gone once the stage's I has run, while the deferred W
    still holds what the two linears' weight gradients need."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Tanh(), nn.Linear(8, 3)).double()
    x, t = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 3, (4,))
    pipe = fxpipe.compile(model, dict(microbatches=1, schedule=[[fxpipe.Action("F", 0, 0), fxpipe.Action("I", 0, 0), fxpipe.Action("W", 0, 0)]]), example_inputs=(x,), loss_fn=CE)
    runner = next(iter(pipe._programs.values())).runners[0]
    held: dict[str, weakref.ref] = {}
    tanh = pipe.stages[0].module.get_submodule("1")
    tanh.register_forward_hook(lambda mod, args, out: held.update(tanh=weakref.ref(out)))
    original = runner.backward_weight

    def check_then_w(i, ctx):
        gc.collect()
        held["alive_at_w"] = held["tanh"]() is not None
        held["deferred"] = len(ctx.deferred[(0, i)])
        return original(i, ctx)

    runner.backward_weight = check_then_w
    pipe.step(x, target=t)
    assert held["deferred"] == 2  # the two linears' weight gradients waited for W
    assert not held["alive_at_w"], "the activation set outlived I"


def test_a_deadlocking_custom_schedule_is_rejected_before_anything_runs() -> None:
    model = Mixed()
    ids, _ = _data()
    A = fxpipe.Action
    # worker 0 wants stage 1's input gradient before stage 1 has its forward input
    bad = [[A("F", 0, 0), A("B", 0, 0)], [A("B", 1, 0), A("F", 1, 0)]]
    with pytest.raises(fxpipe.PlanError, match=r"(?s)deadlock.*B0:0 waits for B1:0.*B1:0 waits for F1:0"):
        fxpipe.compile(model, dict(devices=["cpu:0", "cpu:1"], split=["blocks.3"], schedule=bad), example_inputs=(ids,))


# ---------------------------------------------------------------- distributed
def zb_rank_cases(cases: list[tuple[str, int, bool, int]], workers: int = 2) -> dict:
    """Each case: (schedule, micro-batches, checkpoint, data_parallel); errors against eager.
    ``workers``: the world size, the devices of a V schedule."""
    out = {}
    for schedule, m, checkpoint, dp in cases:
        torch.manual_seed(0)
        model = Mixed().double()
        ids, t = _data(10 if m <= 4 else 16)
        ref = copy.deepcopy(model)
        eager_loss = eager_microbatch_step(ref, (ids,), t, CE, m * dp if dp > 1 else m)
        plan = zb_plan(schedule, m, workers, checkpoint=checkpoint, data_parallel=dp)
        if dp > 1:  # 2 stages per replica
            plan.update(devices=["cpu:0", "cpu:1"], split=["blocks.3"])
        pipe = fxpipe.compile(model, plan, example_inputs=(ids,), loss_fn=CE)
        loss = pipe.step(ids, target=t)
        expected = dict(ref.named_parameters())
        worst = max(float((p.grad - expected[n].grad).abs().max()) for n, p in pipe.named_parameters())
        out[(schedule, m, checkpoint, dp)] = (abs(float(loss) - float(eager_loss)), worst)
    return out


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_zero_bubble_and_v_schedules_match_eager_on_two_gloo_ranks() -> None:
    cases = [("zb-v", 1, False, 1), ("zb-v", 3, False, 1), ("zb-v", 4, True, 1), ("zb-v", 8, False, 1)]
    cases += [("v-half", 5, False, 1), ("v-min", 8, True, 1)]
    cases += [("dualpipev", 3, False, 1), ("dualpipev", 4, True, 1), ("dualpipev", 8, False, 1)]
    for errors in launch(zb_rank_cases, 2, (cases,), timeout=LAUNCH_TIMEOUT):
        for case, (loss_err, grad_err) in errors.items():
            assert loss_err < 1e-12 and grad_err < 1e-10, (case, loss_err, grad_err)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_zero_bubble_and_v_schedules_match_eager_on_four_gloo_ranks_with_checkpoint_and_data_parallelism() -> None:
    cases = [("zb-h1", 1, False, 1), ("zb-h1", 4, True, 1), ("zb-h1", 8, False, 1), ("zb-h1", 2, False, 2)]
    cases += [("v-half", 8, False, 1), ("v-min", 8, False, 1)]
    for errors in launch(zb_rank_cases, 4, (cases, 4), timeout=LAUNCH_TIMEOUT):
        for case, (loss_err, grad_err) in errors.items():
            assert loss_err < 1e-12 and grad_err < 1e-10, (case, loss_err, grad_err)
