"""Schedules as data: the generators, the checker's proofs and rejections, custom schedules."""

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpipe
from fxpipe.plan import Plan, PlanError
from fxpipe.planner.schedule_sim import simulate
from fxpipe.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    StageGraph,
    as_schedule,
    check_schedule,
    describe_schedule,
    dualpipe_v,
    forward_only,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    microbatch_count,
    min_microbatches,
    one_f_one_b,
    resolve_schedule,
    stage_workers,
    v_half,
    v_min,
    zb_h1,
    zb_v,
)


def F(stage: int, microbatch: int) -> Action:
    return Action("F", stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action("B", stage, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E743 - the op's own letter
    return Action("I", stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action("W", stage, microbatch)


CHUNKS = {"interleaved-1f1b": (1, 2, 3, 4), "zb-v": (2,), "v-half": (2,), "v-min": (2,), "dualpipev": (2,)}


def placement(name: str, stages: int, chunks: int) -> list[int]:
    """Where each built-in schedule puts stage s, as documented."""
    workers = stages // chunks
    if name in ("zb-v", "v-half", "v-min", "dualpipev"):
        return [min(s, stages - 1 - s) for s in range(stages)]
    return [s % workers for s in range(stages)]


def unit_timeline(actions, stages):
    """F, I and W one tick each, B two (an unsplit I + W)."""
    return simulate(actions, stages, 1.0, 2.0, input_time=1.0, weight_time=1.0)


@st.composite
def schedule_cases(draw: st.DrawFn) -> tuple[str, int, int, int]:
    name = draw(st.sampled_from(SCHEDULES))
    chunks = draw(st.sampled_from(CHUNKS.get(name, (1,))))
    workers = draw(st.integers(1, max(1, 8 // chunks)))
    return name, workers * chunks, draw(st.integers(min_microbatches(name, workers), 16)), chunks


@settings(deadline=None)  # a shared machine makes per-example timings unreliable
@given(schedule_cases())
def test_every_generated_schedule_is_complete_deadlock_free_placed_as_documented_and_simulates(case):
    name, stages, microbatches, chunks = case
    actions = make_schedule(name, stages, microbatches, chunks)
    assert len(actions) == stages // chunks
    check_schedule(actions, stages, microbatches)
    assert stage_workers(actions) == placement(name, stages, chunks)
    timeline = unit_timeline(actions, stages)
    ran = sorted((e.op, e.stage, e.microbatch) for e in timeline.events)
    assert ran == sorted((a.op, a.stage, a.microbatch) for todo in actions for a in todo)
    backward = {"dualpipev": None, "gpipe": "B", "1f1b": "B", "interleaved-1f1b": "B"}.get(name, "IW")
    if backward is None:  # dualpipev: whole B's in the steady state, I and W around it
        split = {(a.stage, a.microbatch) for todo in actions for a in todo if a.op == "I"}
        expected = {("F", s, m) for s in range(stages) for m in range(microbatches)}
        expected |= {(op, s, m) for s in range(stages) for m in range(microbatches) for op in ("IW" if (s, m) in split else "B")}
    else:
        expected = {(op, s, m) for op in "F" + backward for s in range(stages) for m in range(microbatches)}
    assert set(ran) == expected and len(ran) == len(expected)


@settings(deadline=None)  # a shared machine makes per-example timings unreliable
@given(schedule_cases())
def test_forward_only_schedule_passes_the_forward_only_check(case):
    name, stages, microbatches, chunks = case
    inference = forward_only(make_schedule(name, stages, microbatches, chunks))
    assert all(a.op == "F" for todo in inference for a in todo)
    check_schedule(inference, stages, microbatches, forward_only=True)


BUILTINS = [(name, chunks) for name in SCHEDULES for chunks in CHUNKS.get(name, (1,)) if (name, chunks) != ("interleaved-1f1b", 1)]

# The corners and the awkward counts of the p <= 16, m <= 64 grid: m below, at and past p and 2p.
SAMPLED_GRID = sorted(
    {(p, m) for p in (1, 2, 3, 5, 16) for m in (1, 2, p - 1, p + 1, 2 * p - 1, 2 * p + 1, 64) if m >= 1}
)


@pytest.mark.parametrize(("name", "chunks"), BUILTINS)
@pytest.mark.parametrize(("workers", "microbatches"), SAMPLED_GRID)
def test_every_builtin_schedule_is_deadlock_free_on_a_sample_of_the_grid(name, chunks, workers, microbatches):
    if microbatches < min_microbatches(name, workers):
        with pytest.raises(ScheduleError, match=f"needs at least 2p - 1 = {2 * workers - 1} micro-batches"):
            make_schedule(name, workers * chunks, microbatches, chunks)
        return
    check_schedule(make_schedule(name, workers * chunks, microbatches, chunks), workers * chunks, microbatches)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "chunks"), BUILTINS)
@pytest.mark.parametrize("workers", range(1, 17))
def test_every_builtin_schedule_is_deadlock_free_for_p_up_to_16_and_m_up_to_64(name, chunks, workers):
    for microbatches in range(min_microbatches(name, workers), 65):
        check_schedule(make_schedule(name, workers * chunks, microbatches, chunks), workers * chunks, microbatches)


def test_gpipe_runs_all_forwards_then_all_backwards_in_microbatch_order():
    assert gpipe(2, 3) == [
        [F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2)],
        [F(1, 0), F(1, 1), F(1, 2), B(1, 0), B(1, 1), B(1, 2)],
    ]


def test_1f1b_warms_up_then_alternates_then_cools_down():
    assert one_f_one_b(3, 4) == [
        [F(0, 0), F(0, 1), F(0, 2), B(0, 0), F(0, 3), B(0, 1), B(0, 2), B(0, 3)],
        [F(1, 0), F(1, 1), B(1, 0), F(1, 2), B(1, 1), F(1, 3), B(1, 2), B(1, 3)],
        [F(2, 0), B(2, 0), F(2, 1), B(2, 1), F(2, 2), B(2, 2), F(2, 3), B(2, 3)],
    ]


def test_1f1b_with_fewer_microbatches_than_stages_warms_up_with_all_of_them():
    assert one_f_one_b(4, 2)[0] == [F(0, 0), F(0, 1), B(0, 0), B(0, 1)]
    assert one_f_one_b(4, 2)[3] == [F(3, 0), B(3, 0), F(3, 1), B(3, 1)]


@pytest.mark.parametrize("workers", range(1, 6))
@pytest.mark.parametrize("microbatches", range(1, 12))
def test_interleaved_with_one_chunk_equals_1f1b(workers, microbatches):
    assert interleaved_1f1b(workers, microbatches, 1) == one_f_one_b(workers, microbatches)


def test_interleaved_places_stage_s_on_worker_s_mod_p():
    actions = interleaved_1f1b(2, 4, 2)
    assert {a.stage for a in actions[0]} == {0, 2}
    assert {a.stage for a in actions[1]} == {1, 3}
    assert actions[0][:4] == [F(0, 0), F(0, 1), F(2, 0), F(2, 1)]
    assert stage_workers(interleaved_1f1b(2, 4, 3)) == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("worker_counts", [range(1, 6), pytest.param(range(6, 9), marks=pytest.mark.slow)], ids=["1-5", "6-8"])
def test_interleaved_accepts_every_microbatch_count_on_a_grid(worker_counts):
    """The documented claim: any m >= 1 works, not only multiples of the worker count."""
    for workers in worker_counts:
        for chunks in range(1, 5):
            for microbatches in range(1, 3 * workers + 2):
                actions = interleaved_1f1b(workers, microbatches, chunks)
                check_schedule(actions, workers * chunks, microbatches)


@pytest.mark.parametrize(("workers", "chunks", "microbatches"), [(2, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_interleaved_divides_the_bubble_by_the_chunk_count(workers, chunks, microbatches):
    # With a stage's forward and backward each taking 1 / chunks of a 1F1B stage's time,
    # the step is (2 m + 2 (p - 1) / chunks) ticks: the bubble shrinks chunks-fold.
    stages = workers * chunks
    timeline = simulate(interleaved_1f1b(workers, microbatches, chunks), stages, 1.0, 1.0)
    assert timeline.step_time == 2 * chunks * microbatches + 2 * (workers - 1)


# ------------------------------------------------------------------ zero bubble
def test_zb_h1_is_1f1b_with_each_w_deferred_by_the_worker_index():
    assert zb_h1(3, 4) == [
        [F(0, 0), F(0, 1), F(0, 2), I(0, 0), W(0, 0), F(0, 3), I(0, 1), W(0, 1), I(0, 2), W(0, 2), I(0, 3), W(0, 3)],
        [F(1, 0), F(1, 1), I(1, 0), F(1, 2), I(1, 1), W(1, 0), F(1, 3), I(1, 2), W(1, 1), I(1, 3), W(1, 2), W(1, 3)],
        [F(2, 0), I(2, 0), F(2, 1), I(2, 1), F(2, 2), I(2, 2), W(2, 0), F(2, 3), I(2, 3), W(2, 1), W(2, 2), W(2, 3)],
    ]
    # without the W's, the order is 1F1B's with I for B
    for w, todo in enumerate(zb_h1(5, 7)):
        assert [a.op.replace("I", "B") for a in todo if a.op != "W"] == [a.op for a in one_f_one_b(5, 7)[w]]


@pytest.mark.parametrize("stages", range(1, 9))
def test_zb_h1_never_holds_more_microbatches_than_1f1b_on_any_worker(stages):
    for microbatches in range(1, 33):
        zero_bubble = unit_timeline(zb_h1(stages, microbatches), stages).peak_in_flight("worker")
        reference = unit_timeline(one_f_one_b(stages, microbatches), stages).peak_in_flight("worker")
        assert max(reference.values()) == min(stages, microbatches)
        assert all(held <= max(reference.values()) for held in zero_bubble.values()), (microbatches, zero_bubble)
        assert max(zero_bubble.values()) == max(reference.values())


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (3, 5), (4, 8), (4, 9), (8, 16), (8, 24), (16, 64)])
def test_zb_h1_idles_a_third_of_1f1b_with_unit_f_i_w(stages, microbatches):
    timeline = unit_timeline(zb_h1(stages, microbatches), stages)
    reference = unit_timeline(one_f_one_b(stages, microbatches), stages)
    assert timeline.step_time == 3 * microbatches + stages - 1
    assert reference.step_time == 3 * microbatches + 3 * (stages - 1)
    for w in range(stages):
        idle = timeline.step_time - timeline.busy_time(w)
        assert idle == stages - 1 == (reference.step_time - reference.busy_time(w)) / 3
    assert timeline.bubble_fraction == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))
    assert timeline.bubble_fraction < 0.5 * reference.bubble_fraction


def test_zb_h1_at_p4_m8_shrinks_the_bubble_from_27_to_11_percent():
    zero_bubble = unit_timeline(make_schedule("zb-h1", 4, 8), 4).bubble_fraction
    reference = unit_timeline(make_schedule("1f1b", 4, 8), 4).bubble_fraction
    assert (round(reference, 3), round(zero_bubble, 3)) == (0.273, 0.111)


@pytest.mark.parametrize("workers", range(1, 7))
def test_zb_v_puts_stage_s_and_2p_minus_1_minus_s_on_worker_s(workers):
    for microbatches in (1, workers, 2 * workers + 1):
        actions = zb_v(workers, microbatches)
        assert len(actions) == workers
        for w, todo in enumerate(actions):
            assert {a.stage for a in todo} == {w, 2 * workers - 1 - w}
        assert all(a.op in "FIW" for todo in actions for a in todo)


@pytest.mark.parametrize(("workers", "microbatches"), [(1, 2), (2, 4), (2, 5), (3, 6), (4, 8), (4, 11), (8, 16), (16, 32)])
def test_zb_v_has_the_least_possible_bubble_from_m_2p_with_unit_f_i_w(workers, microbatches):
    timeline = unit_timeline(zb_v(workers, microbatches), 2 * workers)
    assert timeline.step_time == 6 * microbatches + workers - 1
    assert timeline.bubble_fraction == pytest.approx((workers - 1) / (6 * microbatches + workers - 1))
    # 1F1B on the same workers, each worker's two stages as one: F = 2, B = 4 ticks
    reference = simulate(one_f_one_b(workers, microbatches), workers, 2.0, 4.0)
    for w in range(workers):
        assert (timeline.step_time - timeline.busy_time(w)) * 6 == reference.step_time - reference.busy_time(w)


@pytest.mark.slow
@pytest.mark.parametrize("workers", range(1, 17))
def test_zb_v_has_the_least_possible_bubble_for_every_m_from_2p_to_64(workers):
    for microbatches in range(2 * workers, 65):
        timeline = unit_timeline(zb_v(workers, microbatches), 2 * workers)
        assert timeline.step_time == 6 * microbatches + workers - 1, microbatches


@pytest.mark.parametrize("workers", [w if w in (1, 2, 4) else pytest.param(w, marks=pytest.mark.slow) for w in range(1, 9)])
def test_zb_v_holds_at_most_1f1b_peak_in_half_stages(workers):
    for microbatches in range(1, 33):
        held = unit_timeline(zb_v(workers, microbatches), 2 * workers).peak_in_flight("worker")
        reference = simulate(one_f_one_b(workers, microbatches), workers, 2.0, 4.0).peak_in_flight("worker")
        # each zb-v stage is half a 1F1B stage: 2p halves are 1F1B's p whole micro-batches
        assert max(held.values()) <= 2 * max(reference.values()) <= 2 * workers, (microbatches, held)


@pytest.mark.parametrize(("generator", "limit"), [(v_half, lambda p: max(p, 2)), (v_min, lambda p: max(-(-2 * p // 3), 2))])
@pytest.mark.parametrize("workers", range(1, 9))
def test_v_half_and_v_min_hold_at_most_their_share_of_1f1b_peak_in_half_stages(generator, limit, workers):
    for microbatches in (1, 2, workers, 2 * workers + 1, 3 * workers):
        actions = generator(workers, microbatches)
        check_schedule(actions, 2 * workers, microbatches)
        assert stage_workers(actions) == [min(s, 2 * workers - 1 - s) for s in range(2 * workers)]
        held = unit_timeline(actions, 2 * workers).peak_in_flight("worker")
        assert max(held.values()) <= limit(workers), (microbatches, held)


def test_v_half_and_v_min_at_p4_m8_hold_half_and_three_eighths_of_1f1b():
    """The issue's goal (<= 0.55x and <= 0.40x of 1F1B's peak), counted on the schedules:
    1F1B's worker 0 holds 4 whole-stage micro-batches, 8 half stages."""
    reference = simulate(one_f_one_b(4, 8), 4, 2.0, 4.0)
    one_f_one_b_halves = 2 * max(reference.peak_in_flight("worker").values())
    figures = {}
    for name in ("v-half", "v-min", "zb-v"):
        timeline = unit_timeline(make_schedule(name, 8, 8, chunks=2), 8)
        figures[name] = (max(timeline.peak_in_flight("worker").values()) / one_f_one_b_halves, timeline.step_time)
    assert figures == {"v-half": (0.5, 67.0), "v-min": (0.375, 88.0), "zb-v": (1.0, 51.0)}
    assert reference.step_time == 66.0


# ------------------------------------------------------------------ dualpipev
def _overlap_pairs(todo, earlier, later) -> int:
    """How many times a forward of one of the worker's stages is directly followed by a
    whole backward of its other stage: DualPipeV's F/B pairs."""
    other = {earlier: later, later: earlier}
    return sum(a.op == "F" and b.op == "B" and b.stage == other[a.stage] for a, b in zip(todo, todo[1:]))


@pytest.mark.parametrize("workers", range(1, 9))
def test_dualpipev_places_a_v_pairs_forwards_with_backwards_and_splits_only_warm_up_and_tail(workers):
    p = workers
    for microbatches in range(2 * p - 1, 4 * p + 1):
        actions = dualpipe_v(p, microbatches)
        check_schedule(actions, 2 * p, microbatches)
        assert stage_workers(actions) == [min(s, 2 * p - 1 - s) for s in range(2 * p)]
        for w, todo in enumerate(actions):
            earlier, later = w, 2 * p - 1 - w
            ops = [a.op for a in todo]
            assert ops.count("F") == 2 * microbatches
            # every backward exactly once: B, or I then W (the checker proves the order)
            assert ops.count("I") == ops.count("W") == 2 * p - 1 - w, (microbatches, w)
            assert ops.count("B") + ops.count("I") == 2 * microbatches
            # phase 4 pairs both ways, phase 5 pairs the later stage's forward with the earlier's B
            steady = microbatches - 2 * p + w + 1
            assert _overlap_pairs(todo, earlier, later) == 2 * steady + (p - 1 - w), (microbatches, w)
            # the first backward, of the later stage, ends the warm-up's 2q + 2(w + 1) forwards
            # (q = p - 1 - w; the worker at the turn, q = 0, opens phase 4, if any, with a forward)
            first_backward = next(k for k, a in enumerate(todo) if a.op != "F")
            assert first_backward == 2 * (p - 1 - w) + 2 * (w + 1) + (w == p - 1 and steady > 0)
            assert todo[first_backward].stage == later and todo[first_backward].microbatch == 0


@pytest.mark.parametrize("workers", range(2, 7))
def test_dualpipev_stays_deadlock_free_over_skip_connections(workers):
    """Edges past the next stage (a residual over a stage, the first stage feeding the last as
    a tied head does, the first feeding every stage) add waits the chain does not have."""
    stages = 2 * workers
    chain = [(s, s + 1) for s in range(stages - 1)]
    skips = [[(s, s + 2) for s in range(stages - 2)], [(0, stages - 1)], [(0, s) for s in range(2, stages)]]
    for microbatches in (2 * workers - 1, 2 * workers, 3 * workers):
        for extra in skips:
            resolve_schedule("dualpipev", stages, microbatches, chunks=2, deps=chain + extra)


def test_dualpipev_rejects_fewer_than_2p_minus_1_microbatches_naming_the_fix():
    with pytest.raises(ScheduleError, match=r"dualpipev needs at least 2p - 1 = 5 micro-batches on 3 workers .* got 4; use microbatches >= 5, or 'zb-v'"):
        dualpipe_v(3, 4)
    with pytest.raises(ScheduleError, match="at least 2p - 1 = 7"):
        make_schedule("dualpipev", 8, 6, chunks=2)
    with pytest.raises(ScheduleError, match="'dualpipev' runs two stages per worker, got chunks=1; set chunks=2"):
        make_schedule("dualpipev", 8, 8)
    assert make_schedule("dualpipev", 8, 7, chunks=2) == dualpipe_v(4, 7)
    assert [min_microbatches("dualpipev", p) for p in (1, 2, 4)] == [1, 3, 7]
    assert {min_microbatches(name, 4) for name in SCHEDULES if name != "dualpipev"} == {1}


def test_a_plan_with_too_few_microbatches_for_dualpipev_fails_at_partition_time():
    import torch
    from torch import nn

    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    plan = Plan(devices=["cpu:0", "cpu:1"], split=["1", "2", "3"], schedule="dualpipev", chunks=2, microbatches=2)
    for caught in (ScheduleError, PlanError):
        with pytest.raises(caught, match="plan.schedule=dualpipev: dualpipev needs at least 2p - 1 = 3 micro-batches on 2 workers"):
            fxpipe.partition(model, plan, example_inputs=(torch.randn(8, 4),))


@pytest.mark.parametrize("workers", range(1, 9))
def test_dualpipev_step_equals_zb_v_least_possible_and_beats_1f1b_with_unit_costs(workers):
    """F, I, W one tick, B two: the steady state's whole B's cost what ZB-V's I + W cost,
    and the warm-up's and the tail's W's fill the rest, so the step is ZB-V's 6m + p - 1."""
    p = workers
    for microbatches in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p):
        timeline = unit_timeline(dualpipe_v(p, microbatches), 2 * p)
        assert timeline.step_time == 6 * microbatches + p - 1 == unit_timeline(zb_v(p, microbatches), 2 * p).step_time
        reference = simulate(one_f_one_b(p, microbatches), p, 2.0, 4.0)  # a worker's two stages as one
        assert reference.step_time == 6 * microbatches + 6 * (p - 1)
        # a worker's two stages hold one half-stage activation more than ZB-V's 2p (p = 1,
        # m = 1 runs no pair, and holds 2)
        held = max(timeline.peak_in_flight("worker").values())
        assert held == (2 * p + 1 if (p, microbatches) != (1, 1) else 2), (microbatches, held)


@pytest.mark.slow
@pytest.mark.parametrize("workers", range(1, 17))
def test_dualpipev_step_is_6m_plus_p_minus_1_for_every_m_from_2p_to_64(workers):
    for microbatches in range(2 * workers, 65):
        assert unit_timeline(dualpipe_v(workers, microbatches), 2 * workers).step_time == 6 * microbatches + workers - 1


@pytest.mark.parametrize(
    ("forward", "backward", "inputs", "weights", "comm"),
    [(1.0, 2.0, 1.0, 1.0, 0.3), (1.0, 2.0, 1.5, 0.5, 0.0), (1.0, 2.0, 0.5, 1.5, 0.0), (1.0, 3.0, 1.5, 1.5, 0.2)],
)
def test_dualpipev_is_no_slower_than_zb_v_with_uneven_costs_and_messages(forward, backward, inputs, weights, comm):
    """ZB-V's order is fixed on a unit clock; DualPipeV's whole B's neither depend on how the
    backward divides into I and W nor send a gradient late: in these cases, from m = 2p,
    it is never slower (B = I + W)."""
    for p in (2, 3, 4, 6):
        for microbatches in (2 * p, 3 * p, 4 * p):
            costs = dict(input_time=inputs, weight_time=weights, comm_time=comm)
            ours = simulate(dualpipe_v(p, microbatches), 2 * p, forward, backward, **costs).step_time
            theirs = simulate(zb_v(p, microbatches), 2 * p, forward, backward, **costs).step_time
            assert ours <= theirs + 1e-9, (p, microbatches, ours, theirs)


def test_dualpipev_figures_in_the_docs_with_uneven_costs_and_messages():
    figures = []
    for costs in (dict(input_time=1.5, weight_time=0.5), dict(comm_time=0.3)):
        figures += [round(simulate(g(4, 8), 8, 1.0, 2.0, **costs).step_time, 6) for g in (dualpipe_v, zb_v)]
    assert figures == [54.5, 71.5, 55.4, 60.6]
    assert "54.5 ticks against ZB-V's 71.5" in DOC.read_text() and "55.4 against 60.6" in DOC.read_text()


def _tick_table(actions, stages) -> str:
    """The docstring tables' format: unit F, I, W (B two ticks, "~~" its second); upper
    case for a worker's first stage."""
    timeline = unit_timeline(actions, stages)
    workers = stage_workers(actions)
    first = {w: workers.index(w) for w in set(workers)}
    rows = [["."] * round(timeline.step_time) for _ in actions]
    for e in timeline.events:
        cell = f"{e.op}{e.microbatch}"
        rows[e.worker][round(e.start)] = cell if e.stage == first[e.worker] else cell.lower()
        for tick in range(round(e.start) + 1, round(e.end)):
            rows[e.worker][tick] = "~~"
    lines = ["tick      " + "".join(f"{t:<3}" for t in range(len(rows[0])))]
    lines += [f"worker {w}  " + "".join(f"{c:<3}" for c in row) for w, row in enumerate(rows)]
    return "\n".join(line.rstrip() for line in lines)


@pytest.mark.parametrize(("generator", "args", "stages"), [(zb_h1, (3, 5), 3), (zb_v, (2, 4), 4), (v_half, (3, 3), 6), (v_min, (3, 3), 6), (dualpipe_v, (2, 4), 4)])
def test_zero_bubble_docstring_tables_are_what_the_simulator_plays(generator, args, stages):
    table = _tick_table(generator(*args), stages)
    docstring = "\n".join(line.strip() for line in generator.__doc__.splitlines())
    assert table in docstring


def test_make_schedule_builds_the_zero_bubble_schedules():
    assert make_schedule("zb-h1", 4, 6) == zb_h1(4, 6)
    assert make_schedule("zb-v", 6, 7, chunks=2) == zb_v(3, 7)
    assert make_schedule("v-half", 6, 7, chunks=2) == v_half(3, 7)
    assert make_schedule("v-min", 6, 7, chunks=2) == v_min(3, 7)
    assert {"zb-h1", "zb-v", "v-half", "v-min"} <= set(SCHEDULES)


def test_make_schedule_asks_zb_v_for_two_chunks_and_an_even_stage_count():
    with pytest.raises(ScheduleError, match="'zb-v' runs two stages per worker, got chunks=1"):
        make_schedule("zb-v", 4, 8)
    with pytest.raises(ScheduleError, match="divisible by chunks=2"):
        make_schedule("zb-v", 5, 8, chunks=2)
    with pytest.raises(ScheduleError, match="'v-min' runs two stages per worker, got chunks=3"):
        make_schedule("v-min", 6, 8, chunks=3)
    with pytest.raises(ScheduleError, match="'zb-h1' runs one stage per worker.*'v-min' or 'dualpipev' \\(chunks=2\\)"):
        make_schedule("zb-h1", 4, 8, chunks=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4, 2), "num_workers must be at least 1, got 0"),
        ((2, 0, 2), "num_microbatches must be at least 1, got 0"),
        ((2, 4, 0), "chunks must be at least 1, got 0"),
    ],
)
def test_interleaved_rejects_counts_below_one(args, message):
    with pytest.raises(ScheduleError, match=message):
        interleaved_1f1b(*args)


@pytest.mark.parametrize("generator", [zb_h1, zb_v, v_half, v_min, dualpipe_v])
def test_zero_bubble_generators_reject_counts_below_one(generator):
    with pytest.raises(ScheduleError, match="num_microbatches must be at least 1, got 0"):
        generator(2, 0)
    with pytest.raises(ScheduleError, match="must be at least 1, got 0"):
        generator(0, 2)


def test_make_schedule_names_the_valid_schedules_for_an_unknown_name():
    with pytest.raises(
        ScheduleError, match="'pipedream'; choose one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v, v-half, v-min"
    ):
        make_schedule("pipedream", 4, 8)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_make_schedule_suggests_interleaved_for_chunks_above_one(name):
    with pytest.raises(ScheduleError, match="chunks=2.*'interleaved-1f1b'"):
        make_schedule(name, 4, 8, chunks=2)


def test_make_schedule_sends_lists_and_functions_to_resolve_schedule():
    with pytest.raises(ScheduleError, match=r"got custom schedule \(1 worker\); resolve_schedule takes lists"):
        make_schedule([[F(0, 0), B(0, 0)]], 1, 1)


def test_make_schedule_rejects_stages_not_divisible_by_chunks():
    with pytest.raises(ScheduleError, match="divisible by chunks=2"):
        make_schedule("interleaved-1f1b", 5, 8, chunks=2)


def test_make_schedule_interleaved_spreads_stages_over_stages_over_chunks_workers():
    assert make_schedule("interleaved-1f1b", 6, 4, chunks=3) == interleaved_1f1b(2, 4, 3)


# ------------------------------------------------------------------ the checker
def test_checker_reports_each_stuck_worker_and_what_it_waits_for():
    actions = [[F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)]]
    with pytest.raises(ScheduleError) as error:
        check_schedule(actions, 2, 1)
    message = str(error.value)
    assert "deadlock" in message
    assert "worker 0, position 1: B0:0 waits for B1:0" in message
    assert (
        "worker 1, position 0: B1:0 waits for F1:0, which comes later in the same list" in message
    )


def test_checker_rejects_crossed_orders_between_workers():
    # Worker 1 wants micro-batch 1 first, worker 0 holds it back behind a backward that
    # needs worker 1's backward of micro-batch 0: a cycle across workers.
    actions = [
        [F(0, 0), B(0, 0), F(0, 1), B(0, 1)],
        [F(1, 1), F(1, 0), B(1, 0), B(1, 1)],
    ]
    with pytest.raises(ScheduleError, match="worker 1, position 0: F1:1 waits for F0:1"):
        check_schedule(actions, 2, 2)


def test_checker_accepts_split_backwards_mixed_with_full_ones():
    # stage 1 splits micro-batch 0 only; stage 0 splits micro-batch 1 only
    actions = [
        [F(0, 0), F(0, 1), B(0, 0), I(0, 1), W(0, 1)],
        [F(1, 0), I(1, 0), F(1, 1), B(1, 1), W(1, 0)],
    ]
    check_schedule(actions, 2, 2)
    assert microbatch_count(actions) == 2


def test_checker_names_an_i_blocked_behind_the_consumers_i():
    # I0:0 needs I1:0 (stage 1 splits), which worker 1 queues behind F1:1, which needs
    # F0:1, which worker 0 queues behind I0:0.
    actions = [
        [F(0, 0), I(0, 0), W(0, 0), F(0, 1), I(0, 1), W(0, 1)],
        [F(1, 0), F(1, 1), I(1, 0), W(1, 0), I(1, 1), W(1, 1)],
    ]
    with pytest.raises(ScheduleError) as error:
        check_schedule(actions, 2, 2)
    message = str(error.value)
    assert "worker 0, position 1: I0:0 waits for I1:0, at position 2 of worker 1, queued behind F1:1" in message
    assert "worker 1, position 1: F1:1 waits for F0:1, at position 3 of worker 0, queued behind I0:0" in message


@pytest.mark.parametrize(
    ("worker_0", "message"),
    [
        ([F(0, 0), B(0, 0), I(0, 0), W(0, 0)], "B0:0 and I0:0 both run: a backward runs as B, or as I then W"),
        ([F(0, 0), B(0, 0), W(0, 0)], "B0:0 and W0:0 both run"),
        ([F(0, 0), I(0, 0)], "I0:0 runs but no worker runs W0:0"),
        ([F(0, 0), W(0, 0)], "W0:0 runs but no worker runs I0:0"),
        ([F(0, 0), W(0, 0), I(0, 0)], "worker 0 runs W0:0 before I0:0; W must follow its I"),
        ([F(0, 0)], r"no worker runs B0:0 \(a backward runs as B, or as I then W\)"),
        ([F(0, 0), I(0, 0), W(0, 0), W(0, 0)], "worker 0 runs W0:0 a second time"),
    ],
)
def test_checker_rejects_every_malformed_split_backward(worker_0, message):
    with pytest.raises(ScheduleError, match=message):
        check_schedule([worker_0], 1, 1)


def test_checker_rejects_a_worker_with_nothing_to_do():
    with pytest.raises(ScheduleError, match="worker 1 runs nothing; give it a stage or drop its list"):
        check_schedule([[F(0, 0), B(0, 0)], []], 1, 1)


def test_checker_lists_missing_and_duplicated_actions():
    actions = [[F(0, 0), F(0, 0), B(0, 0)], [F(1, 0)]]
    with pytest.raises(ScheduleError) as error:
        check_schedule(actions, 2, 1)
    assert "worker 0 runs F0:0 a second time" in str(error.value)
    assert "no worker runs B1:0" in str(error.value)


def test_checker_rejects_a_stage_split_across_workers_and_out_of_range_actions():
    actions = [[F(0, 0), B(0, 0), F(1, 0)], [B(1, 0), F(2, 0)]]
    with pytest.raises(ScheduleError) as error:
        check_schedule(actions, 2, 1)
    assert "stage 1 already runs on worker 0" in str(error.value)
    assert "F2:0, which is not part of a schedule of 2 stages and 1 micro-batches" in str(
        error.value
    )


@pytest.mark.parametrize("op", ["B", "I", "W"])
def test_checker_rejects_backwards_in_a_forward_only_schedule(op):
    with pytest.raises(ScheduleError, match=f"{op}0:0, which is not part of a forward-only schedule"):
        check_schedule([[F(0, 0), Action(op, 0, 0)]], 1, 1, forward_only=True)


def test_checker_follows_custom_dependencies():
    # Stage 2 reads stage 0 directly (a skip connection), so it cannot run first.
    actions = [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)], [F(2, 0), B(2, 0)]]
    check_schedule(actions, 3, 1, deps=[(0, 1), (1, 2), (0, 2)])
    skip_first = [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)], [F(2, 0), B(2, 0)]]
    with pytest.raises(ScheduleError, match="F2:0 waits for F0:0"):
        check_schedule(skip_first, 3, 1, deps=[(0, 2), (1, 2)])


def test_stage_graph_rejects_dependencies_out_of_range_or_on_itself():
    with pytest.raises(ScheduleError, match=r"\(0, 3\) names a stage outside 0..2"):
        StageGraph(3, [(0, 3)])
    with pytest.raises(ScheduleError, match="cannot feed itself"):
        StageGraph(3, [(1, 1)])


def test_prerequisites_of_backward_are_own_forward_and_consumers_backwards():
    graph = StageGraph(3, [(0, 1), (0, 2), (1, 2)])
    assert graph.prerequisites(F(2, 5)) == [F(0, 5), F(1, 5)]
    assert graph.prerequisites(B(0, 5)) == [F(0, 5), B(1, 5), B(2, 5)]
    assert graph.prerequisites(B(2, 5)) == [F(2, 5)]


def test_prerequisites_take_each_consumers_gradient_from_its_i_where_it_splits():
    graph = StageGraph(3, [(0, 1), (0, 2), (1, 2)])
    split = {(2, 5), (0, 5)}
    assert graph.prerequisites(I(0, 5), split) == [F(0, 5), B(1, 5), I(2, 5)]
    assert graph.prerequisites(B(1, 5), split) == [F(1, 5), I(2, 5)]
    assert graph.prerequisites(W(0, 5), split) == [I(0, 5)]
    with pytest.raises(ScheduleError, match="W3:0 names a stage outside 0..2"):
        graph.prerequisites(W(3, 0))


def test_action_prints_short_and_rejects_unknown_ops_and_bad_indices():
    assert str(F(1, 3)) == "F1:3" and str(W(0, 2)) == "W0:2"
    with pytest.raises(ScheduleError, match="op must be one of"):
        Action("X", 0, 0)
    with pytest.raises(ScheduleError, match="Action stage must be an int >= 0, got -1"):
        Action("F", -1, 0)
    with pytest.raises(ScheduleError, match="Action microbatch must be an int >= 0, got 1.0"):
        Action("F", 0, 1.0)
    with pytest.raises(ScheduleError, match="Action microbatch must be an int >= 0, got True"):
        Action("F", 0, True)


def test_stage_workers_reads_the_placement_and_rejects_split_or_missing_stages():
    assert stage_workers([[F(1, 0)], [F(0, 0), F(2, 0)]]) == [1, 0, 1]
    with pytest.raises(ScheduleError, match="stage 0 runs on workers 0 and 1"):
        stage_workers([[F(0, 0)], [B(0, 0)]])
    with pytest.raises(ScheduleError, match="no worker runs stage\\(s\\) 1"):
        stage_workers([[F(0, 0), F(2, 0)]])


# ------------------------------------------------------------------ custom schedules
def _two_stage_zero_bubble(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """A custom schedule as a user would write it: GPipe's forwards, backwards split, W's last."""
    return [
        [F(s, m) for m in range(num_microbatches)]
        + [I(s, m) for m in range(num_microbatches)]
        + [W(s, m) for m in range(num_microbatches)]
        for s in range(num_stages)
    ]


def test_resolve_schedule_builds_names_and_checks_them_against_the_stage_graph():
    assert resolve_schedule("zb-v", 4, 3, chunks=2) == zb_v(2, 3)
    assert resolve_schedule("1f1b", 3, 2, deps=[(0, 1), (1, 2), (0, 2)]) == one_f_one_b(3, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'zz'"):
        resolve_schedule("zz", 2, 2)


def test_resolve_schedule_takes_a_schedule_as_data_and_returns_a_copy():
    data = _two_stage_zero_bubble(2, 3)
    actions = resolve_schedule(data, 2, 3, chunks=5)  # chunks is for names only
    assert actions == data and actions is not data and actions[0] is not data[0]
    assert stage_workers(actions) == [0, 1]
    tuples = tuple(tuple(todo) for todo in data)
    assert resolve_schedule(tuples, 2, 3) == data


def test_resolve_schedule_takes_a_callable_of_stages_and_microbatches():
    seen = []

    def mine(num_stages: int, num_microbatches: int):
        seen.append((num_stages, num_microbatches))
        return _two_stage_zero_bubble(num_stages, num_microbatches)

    assert resolve_schedule(mine, 3, 5) == _two_stage_zero_bubble(3, 5)
    assert seen == [(3, 5)]


def test_resolve_schedule_rejects_a_deadlocking_custom_schedule_naming_the_blocked_actions():
    data = _two_stage_zero_bubble(2, 2)
    data[1] = [F(1, 0), I(1, 1), F(1, 1), I(1, 0), W(1, 0), W(1, 1)]
    with pytest.raises(ScheduleError) as error:
        resolve_schedule(data, 2, 2)
    assert "worker 1, position 1: I1:1 waits for F1:1, which comes later in the same list" in str(error.value)
    with pytest.raises(ScheduleError, match="I1:1 waits for F1:1"):
        resolve_schedule(lambda p, m: data, 2, 2)


def test_resolve_schedule_rejects_an_incomplete_custom_schedule_naming_what_is_missing():
    data = _two_stage_zero_bubble(2, 2)
    del data[0][-1]
    with pytest.raises(ScheduleError, match="I0:1 runs but no worker runs W0:1"):
        resolve_schedule(data, 2, 2)
    with pytest.raises(ScheduleError, match=r"no worker runs F1:0, B1:0, F1:1, B1:1 \(a backward runs as B"):
        resolve_schedule([data[0]], 2, 2)


def test_resolve_schedule_rejects_data_for_another_microbatch_count():
    with pytest.raises(ScheduleError, match="runs 3 micro-batches, but this step has 4.*Plan\\(microbatches=3\\)"):
        resolve_schedule(_two_stage_zero_bubble(2, 3), 2, 4)


def test_resolve_schedule_names_a_callable_that_raises_or_returns_junk():
    def broken(num_stages: int, num_microbatches: int):
        raise KeyError("oops")

    with pytest.raises(ScheduleError, match=r"broken\(2, 3\) raised KeyError: 'oops'"):
        resolve_schedule(broken, 2, 3)
    with pytest.raises(ScheduleError, match=r"what .*<lambda>\(2, 3\) returned\[0\]\[0\] is 'F0:0', not an fxpipe.Action"):
        resolve_schedule(lambda p, m: [["F0:0"]], 2, 3)
    with pytest.raises(ScheduleError, match="must be a list holding one list of fxpipe.Action per worker, got NoneType"):
        resolve_schedule(lambda p, m: None, 2, 3)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1f1b-ish", "must be a list holding one list of fxpipe.Action per worker, got str"),
        ([], "is empty; give one list of fxpipe.Action per worker"),
        ([F(0, 0)], r"\[0\] is Action\(op='F', stage=0, microbatch=0\), not a list"),
        ([[("F", 0, 0)]], r"\[0\]\[0\] is \('F', 0, 0\), not an fxpipe.Action; write fxpipe.Action\('F', 0, 0\)"),
        ([[F(0, 0)], 7], r"\[1\] is 7, not a list"),
    ],
)
def test_as_schedule_names_the_entry_that_is_not_an_action_list(value, message):
    with pytest.raises(ScheduleError, match=message):
        as_schedule(value, "plan.schedule")


def test_describe_schedule_gives_a_short_name_for_every_kind():
    assert describe_schedule("zb-h1") == "zb-h1"
    assert describe_schedule(_two_stage_zero_bubble) == "_two_stage_zero_bubble"
    assert describe_schedule(_two_stage_zero_bubble(3, 2)) == "custom schedule (3 workers)"


def test_schedule_api_is_exported_from_fxpipe():
    assert (fxpipe.Action, fxpipe.check_schedule, fxpipe.ScheduleError) == (Action, check_schedule, ScheduleError)
    fxpipe.check_schedule(_two_stage_zero_bubble(2, 2), 2, 2)


# ------------------------------------------------------------------ Plan(schedule=...)
def test_plan_takes_a_schedule_as_data_which_fixes_the_microbatch_count():
    data = _two_stage_zero_bubble(2, 3)
    plan = Plan(schedule=data)
    assert plan.microbatches == 3
    assert plan.schedule == data and plan.schedule is not data
    assert Plan(schedule=tuple(map(tuple, data)), microbatches=3) == plan
    assert "Action(op='W', stage=1, microbatch=2)" in repr(plan)
    assert Plan.coerce({"schedule": data}) == plan
    assert plan.replace(schedule="1f1b") == Plan(schedule="1f1b", microbatches=3)


def test_plan_takes_a_callable_and_keeps_the_default_microbatch_count():
    plan = Plan(schedule=_two_stage_zero_bubble)
    assert plan.schedule is _two_stage_zero_bubble and plan.microbatches == 4
    assert plan == Plan(schedule=_two_stage_zero_bubble, microbatches=4)
    assert resolve_schedule(plan.schedule, 2, plan.microbatches) == _two_stage_zero_bubble(2, 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"schedule": "zigzag"}, "plan.schedule = 'zigzag': choose one of .*zb-h1, zb-v, v-half, v-min, dualpipev, or write your own"),
        ({"schedule": 3}, "plan.schedule must be a list holding one list of fxpipe.Action per worker, got int"),
        ({"schedule": [[F(0, 0), "B0:0"]]}, r"plan.schedule\[0\]\[1\] is 'B0:0', not an fxpipe.Action"),
        ({"schedule": [[F(0, 0), B(0, 0)]], "microbatches": 2}, "plan.microbatches = 2, but plan.schedule runs 1 micro-batches"),
        ({"schedule": "zb-v"}, "'zb-v' runs two stages per worker, got chunks=1; set chunks=2 \\(two stages per device, in a V\\)"),
        ({"schedule": "zb-v", "chunks": 3}, "got chunks=3; set chunks=2"),
        ({"schedule": "zb-h1", "chunks": 2}, "plan.chunks = 2: .*schedule 'interleaved-1f1b' \\(any chunks\\) or 'zb-v'"),
        ({"schedule": "v-half"}, "'v-half' runs two stages per worker, got chunks=1; set chunks=2 \\(two stages per device, in a V\\)"),
        ({"schedule": "dualpipev", "chunks": 3}, "'dualpipev' runs two stages per worker, got chunks=3; set chunks=2 \\(two stages per device, in a V\\)"),
    ],
)
def test_plan_rejects_schedule_fields_of_the_wrong_kind_with_the_fix(fields, message):
    with pytest.raises(PlanError, match=message):
        Plan(**fields)


def test_plan_accepts_every_schedule_name_with_its_chunks():
    for name in SCHEDULES:
        for chunks in CHUNKS.get(name, (1,)):
            assert Plan(schedule=name, chunks=chunks).microbatches == 4


# ------------------------------------------------------------------ docs/schedules.md
DOC = Path(__file__).resolve().parents[1] / "docs" / "schedules.md"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_docs_tables_are_what_the_generators_play():
    text = DOC.read_text()
    assert _tick_table(zb_h1(4, 8), 4) in text
    assert _tick_table(zb_v(2, 4), 4) in text
    assert _tick_table(v_half(3, 3), 6) in text
    assert _tick_table(v_min(3, 3), 6) in text
    assert _tick_table(dualpipe_v(2, 4), 4) in text


def test_docs_custom_schedule_examples_run_and_print_what_the_docs_show(capsys):
    namespace: dict = {}
    text = DOC.read_text()
    for block in _doc_blocks():
        if "fxpipe.compile" not in block:
            exec(compile(block, str(DOC), "exec"), namespace)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(printed) == 1 + 3 + 8
    for line in printed:
        assert f"# {line}" in text, line


def test_docs_custom_schedule_trains_equal_to_eager():
    import copy

    import torch

    namespace: dict = {}
    for block in _doc_blocks():
        exec(compile(block, str(DOC), "exec"), namespace)
    model, x, t = namespace["model"], namespace["x"], namespace["t"]
    reference = copy.deepcopy(model)
    torch.nn.CrossEntropyLoss()(reference(x), t).backward()
    assert torch.allclose(namespace["loss"], torch.nn.CrossEntropyLoss()(reference(x), t))
    got = dict(namespace["pipe"].named_parameters())
    for name, param in reference.named_parameters():
        assert torch.allclose(got[name].grad, param.grad, atol=1e-6), name


# ------------------------------------------------------------------ one home for the plan's schedule
def test_a_plan_whose_schedule_cannot_run_raises_what_either_caller_catches():
    import torch
    from torch import nn

    for fields in ({"schedule": "zigzag"}, {"schedule": "zb-v"}, {"schedule": [[F(0, 0), "B0:0"]]}):
        for caught in (ScheduleError, PlanError):
            with pytest.raises(caught):
                Plan(**fields)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    incomplete = [[F(0, 0), B(0, 0)]]  # stage 1 never runs
    for caught in (fxpipe.ScheduleError, fxpipe.PlanError):
        with pytest.raises(caught, match="(?s)plan.schedule=custom schedule.*no worker runs F1:0"):
            fxpipe.partition(model, Plan(split=["1"], schedule=incomplete), example_inputs=(torch.randn(2, 4),))


def test_a_partition_resolves_each_count_once_and_keeps_its_stages_where_they_were_placed():
    import torch
    from torch import nn

    def moving(num_stages: int, num_microbatches: int):  # 1F1B, but its workers swap for 3 micro-batches
        lists = one_f_one_b(num_stages, num_microbatches)
        return lists[::-1] if num_microbatches == 3 else lists

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    part = fxpipe.partition(model, Plan(split=["1"], schedule=moving, microbatches=2), example_inputs=(torch.randn(4, 4),))
    assert part.actions() is part.actions(2, train=True) and part.actions() == one_f_one_b(2, 2)
    assert part.actions(2, train=False) == forward_only(one_f_one_b(2, 2))
    assert part.edge_ends == [(0, 1)] and part.deps == [(0, 1)]
    with pytest.raises(ScheduleError, match=r"puts the stages on workers \[1, 0\], but they were placed for workers \[0, 1\]"):
        part.actions(3)


@pytest.mark.parametrize(
    ("schedule", "chunks", "devices", "expected"),
    [
        ("1f1b", 1, ["a", "b", "c"], ["a", "b", "c"]),  # one per stage
        ("interleaved-1f1b", 2, ["a", "b"], ["a", "b", "a", "b"]),  # one per worker: stage s on worker s % 2
        ("zb-v", 2, ["a", "b"], ["a", "b", "b", "a"]),  # one per worker: a V
        ("zb-v", 2, ["a", "b", "c", "d"], ["a", "b", "c", "d"]),  # one per stage
    ],
)
def test_plan_stage_devices_is_the_one_placement_rule(schedule, chunks, devices, expected):
    plan = Plan(devices=[f"cpu:{'abcd'.index(d)}" for d in devices], schedule=schedule, chunks=chunks)
    workers = stage_workers(plan.actions(len(expected)))
    assert plan.stage_devices(workers) == [f"cpu:{'abcd'.index(d)}" for d in expected]
    with pytest.raises(PlanError, match=r"plan.devices lists 3 device\(s\) but the split gives"):
        plan.replace(devices=["cpu:0", "cpu:1", "cpu:2"]).stage_devices([0, 1, 1, 0])
