"""The simulator's predictions and what a Timeline reports, exports and draws."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.schedule_sim import simulate
from fxpipe.schedules import Action, ScheduleError, gpipe, make_schedule, one_f_one_b, zb_h1, zb_v
from fxpipe.timeline import Event, Timeline


@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.integers(1, 8),
    st.integers(1, 16),
)
def test_unit_cost_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, stages, microbatches):
    timeline = simulate(make_schedule(name, stages, microbatches), stages, 1.0, 1.0)
    expected = (stages - 1) / (microbatches + stages - 1)
    assert abs(timeline.bubble_fraction - expected) < 1e-9
    assert timeline.step_time == 2 * (microbatches + stages - 1)


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (4, 2), (1, 3), (8, 8)])
def test_1f1b_holds_min_p_m_microbatches_on_stage_0_and_gpipe_holds_all(stages, microbatches):
    one_f = simulate(one_f_one_b(stages, microbatches), stages, 1.0, 2.0)
    assert one_f.peak_in_flight()[0] == min(stages, microbatches)
    assert one_f.peak_in_flight()[stages - 1] == 1
    all_f = simulate(gpipe(stages, microbatches), stages, 1.0, 2.0)
    assert all_f.peak_in_flight()[0] == microbatches


def test_comm_time_delays_consumers_on_other_workers_in_both_directions():
    timeline = simulate(gpipe(2, 1), 2, 1.0, 1.0, comm_time=0.5)
    start = {(e.op, e.stage): e.start for e in timeline.events}
    assert start == {("F", 0): 0.0, ("F", 1): 1.5, ("B", 1): 2.5, ("B", 0): 4.0}
    assert timeline.step_time == 5.0


def test_comm_time_is_free_between_stages_on_one_worker():
    timeline = simulate(make_schedule("interleaved-1f1b", 2, 1, chunks=2), 2, 1.0, 1.0, 9.0)
    assert timeline.step_time == 4.0


def test_callable_costs_receive_stage_and_microbatch_and_edges():
    seen_edges = []

    def comm(src: int, dst: int, microbatch: int) -> float:
        seen_edges.append((src, dst, microbatch))
        return 0.0

    timeline = simulate(
        gpipe(2, 2),
        2,
        forward_time=lambda s, m: 1.0 + s,
        backward_time=lambda s, m: 10.0 * (m + 1),
        comm_time=comm,
        microbatch_overhead=0.25,
    )
    durations = {(e.op, e.stage, e.microbatch): e.end - e.start for e in timeline.events}
    assert durations[("F", 1, 0)] == 2.25
    assert durations[("B", 0, 1)] == 20.25
    assert sorted(seen_edges) == [(0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1)]


def test_simulate_follows_skip_connections():
    # Stage 2 reads stage 0 directly; the slow link between them dominates both ways.
    def comm(src: int, dst: int, microbatch: int) -> float:
        return 5.0 if {src, dst} == {0, 2} else 0.0

    timeline = simulate(gpipe(3, 1), 3, 1.0, 1.0, comm, deps=[(0, 1), (1, 2), (0, 2)])
    start = {(e.op, e.stage): e.start for e in timeline.events}
    assert start[("F", 2)] == 6.0
    assert start[("B", 0)] == 8.0 + 5.0


def test_simulate_reports_deadlock_as_schedule_error():
    actions = gpipe(2, 1)
    actions[1].reverse()
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(actions, 2, 1.0, 1.0)


def test_simulate_rejects_negative_costs():
    with pytest.raises(ValueError, match="F time for F0:0 is negative"):
        simulate(gpipe(1, 1), 1, -1.0, 1.0)


def test_timeline_rejects_unknown_kind_and_out_of_range_workers():
    with pytest.raises(ValueError, match="kind must be one of"):
        Timeline([], 1, kind="guessed")
    with pytest.raises(ValueError, match="worker outside 0..0"):
        Timeline([Event(1, 0, 0, "F", 0.0, 1.0)], 1)


def test_event_rejects_unknown_op_and_negative_duration():
    with pytest.raises(ValueError, match="op must be one of"):
        Event(0, 0, 0, "X", 0.0, 1.0)
    with pytest.raises(ValueError, match="ends"):
        Event(0, 0, 0, "F", 2.0, 1.0)


def _measured() -> Timeline:
    events = [
        Event(0, 0, 0, "F", 10.0, 11.0, "cpu"),
        Event(0, 0, 0, "send", 11.0, 11.5, "cpu"),
        Event(1, 1, 0, "recv", 11.0, 11.5, "cuda:0"),
        Event(1, 1, 0, "F", 11.5, 12.5, "cuda:0"),
        Event(1, 1, 0, "B", 12.5, 14.5, "cuda:0"),
        Event(0, 0, 0, "B", 14.5, 16.0, "cpu"),
    ]
    return Timeline(events, 2, kind="measured", activation_bytes={0: 3 * 2**20})


def test_step_time_busy_time_and_bubble_count_only_compute():
    timeline = _measured()
    assert timeline.step_time == 6.0
    assert timeline.busy_time(0) == 2.5
    assert timeline.busy_time(1) == 3.0
    assert timeline.bubble_fraction == pytest.approx(1 - 5.5 / 12)


def test_empty_timeline_has_zero_step_and_bubble():
    timeline = Timeline([], 2)
    assert (timeline.step_time, timeline.bubble_fraction, timeline.peak_in_flight()) == (0, 0, {})


def test_summary_and_to_dict_report_the_figures():
    timeline = _measured()
    text = timeline.summary()
    assert "step time 6.00 s, bubble 54.2%" in text
    assert "worker 1 (cuda:0): busy 3.00 s" in text
    assert "stage 0: up to 1 micro-batches in flight, 3.0 MiB of activations" in text
    data = json.loads(json.dumps(timeline.to_dict()))
    assert data["kind"] == "measured"
    assert data["busy_time"] == [2.5, 3.0]
    assert len(data["events"]) == 6


def test_chrome_trace_is_json_with_one_complete_event_per_action(tmp_path):
    timeline = simulate(make_schedule("1f1b", 3, 4), 3, 1e-3, 2e-3)
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    trace = json.loads(path.read_text())["traceEvents"]
    assert len(trace) == 2 * 3 * 4
    assert {e["ph"] for e in trace} == {"X"}
    first = min(trace, key=lambda e: e["ts"])
    assert first["name"] == "F s0 mb0"
    assert first["ts"] == 0 and first["dur"] == pytest.approx(1000.0)
    assert first["args"]["stage"] == 0 and first["args"]["microbatch"] == 0
    assert {e["pid"] for e in trace} == {0, 1, 2}


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_writes_the_format_named_by_the_extension(tmp_path, suffix):
    timeline = simulate(make_schedule("interleaved-1f1b", 4, 4, chunks=2), 4, 1e-3, 2e-3)
    path = tmp_path / f"timeline{suffix}"
    timeline.plot(path, other=_measured(), title="predicted against measured")
    assert path.stat().st_size > 0
    if suffix == ".png":
        import matplotlib.image

        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
    else:
        assert path.read_text().lstrip().startswith("<?xml")


# ------------------------------------------------------------------ split backwards: I and W
def _split(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe with each backward split: every forward, every I, then every W."""
    return [
        [Action(op, s, m) for op in "FIW" for m in range(microbatches)] for s in range(stages)
    ]


def test_i_and_w_default_to_half_the_backward_time_each():
    timeline = simulate(zb_h1(2, 1), 2, 1.0, lambda s, m: 4.0 * (s + 1))
    durations = {(e.op, e.stage): e.duration for e in timeline.events}
    assert durations == {("F", 0): 1.0, ("F", 1): 1.0, ("I", 1): 4.0, ("W", 1): 4.0, ("I", 0): 2.0, ("W", 0): 2.0}


def test_input_and_weight_times_are_their_own_costs_of_stage_and_microbatch():
    seen = []

    def weight(stage: int, microbatch: int) -> float:
        seen.append((stage, microbatch))
        return 0.5

    timeline = simulate(_split(2, 2), 2, 1.0, 100.0, input_time=2.0, weight_time=weight)
    durations = {(e.op, e.stage, e.microbatch): e.duration for e in timeline.events}
    assert durations[("I", 0, 1)] == 2.0 and durations[("W", 1, 0)] == 0.5
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_gradient_an_i_sends_pays_comm_time_and_w_sends_nothing():
    timeline = simulate(_split(2, 1), 2, 1.0, 2.0, comm_time=0.5)
    start = {(e.op, e.stage): e.start for e in timeline.events}
    # F1 after F0 + comm; I1 at once; I0 after I1 + comm; each W right after its I
    assert start == {("F", 0): 0.0, ("F", 1): 1.5, ("I", 1): 2.5, ("W", 1): 3.5, ("I", 0): 4.0, ("W", 0): 5.0}


def test_a_full_backward_waits_for_the_consumers_i_when_the_consumer_splits():
    actions = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 1, 0), Action("I", 1, 0), Action("W", 1, 0)]]
    timeline = simulate(actions, 2, 1.0, 2.0, weight_time=10.0)
    start = {(e.op, e.stage): e.start for e in timeline.events}
    assert start[("B", 0)] == 3.0  # after I1 (1 tick), not after W1


def test_activations_stay_in_flight_until_w_not_i():
    events = [
        Event(0, 0, 0, "F", 0.0, 1.0),
        Event(0, 0, 0, "I", 1.0, 2.0),
        Event(0, 0, 1, "F", 2.0, 3.0),  # micro-batch 0 is still held: its W has not run
        Event(0, 0, 0, "W", 3.0, 4.0),
        Event(0, 0, 1, "B", 4.0, 5.0),
        Event(0, 0, 2, "F", 5.0, 6.0),
        Event(0, 0, 2, "I", 6.0, 7.0),
        Event(0, 0, 2, "W", 7.0, 8.0),
    ]
    timeline = Timeline(events, 1)
    assert timeline.peak_in_flight() == {0: 2}
    assert timeline.busy_time(0) == 8.0 and timeline.bubble_fraction == 0.0


def test_peak_in_flight_per_worker_adds_the_stages_a_worker_holds():
    timeline = simulate(zb_v(2, 4), 4, 1.0, 2.0)
    per_stage = timeline.peak_in_flight()
    per_worker = timeline.peak_in_flight("worker")
    assert set(per_worker) == {0, 1} and set(per_stage) == {0, 1, 2, 3}
    assert per_stage[0] + per_stage[3] >= per_worker[0] > max(per_stage[0], per_stage[3])
    assert per_worker[0] <= 4
    with pytest.raises(ValueError, match="per must be 'stage' or 'worker', got 'device'"):
        timeline.peak_in_flight("device")


def test_summary_chrome_trace_and_dict_count_i_and_w_as_work():
    timeline = simulate(zb_h1(2, 2), 2, 1e-3, 2e-3)
    assert timeline.busy_time(0) == pytest.approx(2 * (1e-3 + 1e-3 + 1e-3))
    text = timeline.summary()
    assert "worker 0: busy 6.00 ms (F 2.00 ms, I 2.00 ms, W 2.00 ms; " in text
    data = timeline.to_dict()
    assert data["peak_in_flight_per_worker"] == {0: 2, 1: 2}
    assert {e["op"] for e in data["events"]} == {"F", "I", "W"}


def test_chrome_trace_puts_i_and_w_on_the_action_track(tmp_path):
    timeline = simulate(zb_h1(2, 2), 2, 1e-3, 2e-3)
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    trace = json.loads(path.read_text())["traceEvents"]
    assert {(e["cat"], e["tid"]) for e in trace} == {("F", 0), ("I", 0), ("W", 0)}
    assert any(e["name"] == "W s1 mb0" for e in trace)


def test_gantt_legend_names_i_and_w_in_their_own_colours():
    from fxpipe.drawing.gantt import legend_entries

    zero_bubble = simulate(zb_v(2, 4), 4, 1.0, 2.0)
    entries = legend_entries([zero_bubble])
    labels = [e["label"] for e in entries]
    assert labels[:4] == ["forward", "input gradients (I)", "weight gradients (W)", "idle (bubble)"]
    assert "weight gradients (W), later chunk" in labels and "backward" not in labels
    colours = [e["color"] for e in entries if "color" in e]
    assert len(set(colours)) == len(colours)
    plain = [e["label"] for e in legend_entries([simulate(one_f_one_b(2, 2), 2, 1.0, 2.0), _measured()])]
    assert plain == ["forward", "backward", "idle (bubble)", "send / recv"]


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_plot_draws_zero_bubble_timelines(tmp_path, name):
    chunks = 2 if name == "zb-v" else 1
    timeline = simulate(make_schedule(name, 4 * chunks, 8, chunks), 4 * chunks, 1e-3, 2e-3)
    path = tmp_path / f"{name}.png"
    timeline.plot(path, title=f"{name}, p=4, m=8")
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[1] > 1000


def test_events_take_every_action_op():
    for op in ("F", "B", "I", "W", "send", "recv"):
        assert Event(0, 0, 0, op, 0.0, 1.0).op == op
