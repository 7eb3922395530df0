"""Schedules as data: the generators, the checker's proofs and rejections, the simulator."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    StageGraph,
    check_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    worker_of,
)
from fxpipe.simulate import simulate


def F(stage: int, microbatch: int) -> Action:
    return Action("F", stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action("B", stage, microbatch)


@st.composite
def schedule_cases(draw: st.DrawFn) -> tuple[str, int, int, int]:
    name = draw(st.sampled_from(SCHEDULES))
    chunks = draw(st.integers(1, 4)) if name == "interleaved-1f1b" else 1
    workers = draw(st.integers(1, max(1, 8 // chunks)))
    return name, workers * chunks, draw(st.integers(1, 16)), chunks


@given(schedule_cases())
def test_every_generated_schedule_is_complete_deadlock_free_and_simulates(case):
    name, stages, microbatches, chunks = case
    actions = make_schedule(name, stages, microbatches, chunks)
    assert len(actions) == stages // chunks
    check_schedule(actions, stages, microbatches)
    for worker, todo in enumerate(actions):
        assert all(worker_of(a.stage, stages, chunks) == worker for a in todo)
    timeline = simulate(actions, stages, forward_time=1.0, backward_time=2.0)
    ran = {(e.op, e.stage, e.microbatch) for e in timeline.events}
    assert ran == {(op, s, m) for op in "FB" for s in range(stages) for m in range(microbatches)}
    assert len(timeline.events) == 2 * stages * microbatches


@given(schedule_cases())
def test_forward_only_schedule_passes_the_forward_only_check(case):
    name, stages, microbatches, chunks = case
    inference = forward_only(make_schedule(name, stages, microbatches, chunks))
    assert all(a.op == "F" for todo in inference for a in todo)
    check_schedule(inference, stages, microbatches, forward_only=True)


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
    assert [worker_of(s, 6, 3) for s in range(6)] == [0, 1, 0, 1, 0, 1]


def test_interleaved_accepts_every_microbatch_count_on_a_grid():
    """The documented claim: any m >= 1 works, not only multiples of the worker count."""
    for workers in range(1, 9):
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


def test_make_schedule_names_the_valid_schedules_for_an_unknown_name():
    with pytest.raises(
        ScheduleError, match="'pipedream'; choose one of gpipe, 1f1b, interleaved-1f1b"
    ):
        make_schedule("pipedream", 4, 8)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_make_schedule_suggests_interleaved_for_chunks_above_one(name):
    with pytest.raises(ScheduleError, match="chunks=2.*'interleaved-1f1b'"):
        make_schedule(name, 4, 8, chunks=2)


def test_make_schedule_rejects_stages_not_divisible_by_chunks():
    with pytest.raises(ScheduleError, match="divisible by chunks=2"):
        make_schedule("interleaved-1f1b", 5, 8, chunks=2)


def test_make_schedule_interleaved_spreads_stages_over_stages_over_chunks_workers():
    assert make_schedule("interleaved-1f1b", 6, 4, chunks=3) == interleaved_1f1b(2, 4, 3)


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


def test_checker_rejects_backwards_in_a_forward_only_schedule():
    with pytest.raises(ScheduleError, match="B0:0, which is not part of a forward-only schedule"):
        check_schedule(gpipe(1, 1), 1, 1, forward_only=True)


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


def test_action_prints_short_and_rejects_unknown_ops():
    assert str(F(1, 3)) == "F1:3"
    with pytest.raises(ScheduleError, match="op must be one of"):
        Action("W", 0, 0)


def test_worker_of_rejects_out_of_range_stage():
    with pytest.raises(ScheduleError, match="stage 4 is outside 0..3"):
        worker_of(4, 4, 2)
