"""The simulator's predictions and what a Timeline reports, exports and draws."""

import json
import tempfile
import time
from pathlib import Path

import matplotlib
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fxpipe
from fxpipe.distributed import launch
from fxpipe.inspection.timeline import Event, Timeline
from fxpipe.planner.schedule_sim import simulate
from fxpipe.schedules import Action, ScheduleError, gpipe, make_schedule, one_f_one_b, zb_h1, zb_v


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
    trace = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(trace) == 2 * 3 * 4
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
    trace = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["cat"], e["tid"]) for e in trace} == {("F", 0), ("I", 0), ("W", 0)}
    assert any(e["name"] == "W s1 mb0" for e in trace)


def test_gantt_legend_names_i_and_w_in_their_own_colours():
    from fxpipe.inspection.gantt import legend_entries

    zero_bubble = simulate(zb_v(2, 4), 4, 1.0, 2.0)
    entries = legend_entries([zero_bubble])
    labels = [e["label"] for e in entries]
    assert labels[:4] == ["forward", "input gradients (I)", "weight gradients (W)", "idle (bubble)"]
    assert "weight gradients (W), later chunk" in labels and "backward" not in labels
    colours = [e["color"] for e in entries if "color" in e]
    assert len(set(colours)) == len(colours)
    plain = [e["label"] for e in legend_entries([simulate(one_f_one_b(2, 2), 2, 1.0, 2.0), _measured()])]
    assert plain == ["forward", "backward", "idle (bubble)", "send / recv"]


def test_gantt_legend_of_dualpipev_names_whole_and_split_backwards_of_both_chunks_apart():
    from fxpipe.inspection.gantt import legend_entries

    entries = legend_entries([simulate(make_schedule("dualpipev", 8, 8, chunks=2), 8, 1.0, 2.0)])
    labels = [e["label"] for e in entries]
    kinds = ("forward", "backward", "input gradients (I)", "weight gradients (W)")
    assert set(labels) == {"idle (bubble)", *kinds, *(f"{kind}, later chunk" for kind in kinds)}
    colours = [e["color"] for e in entries if "color" in e]
    assert len(set(colours)) == len(colours) == 8


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipev"])
def test_plot_draws_zero_bubble_timelines(tmp_path, name):
    chunks = 2 if name in ("zb-v", "dualpipev") else 1
    timeline = simulate(make_schedule(name, 4 * chunks, 8, chunks), 4 * chunks, 1e-3, 2e-3)
    path = tmp_path / f"{name}.png"
    timeline.plot(path, title=f"{name}, p=4, m=8")
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[1] > 1000


def test_events_take_every_action_op():
    for op in ("F", "B", "I", "W", "send", "recv"):
        assert Event(0, 0, 0, op, 0.0, 1.0).op == op


# ------------------------------------------------------------------ whole-pipeline traces
def _trace(timeline: Timeline, tmp_path) -> list[dict]:
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    return json.loads(path.read_text())["traceEvents"]


def _flows(trace: list[dict]) -> dict[int, tuple[dict, dict]]:
    """Each flow's start ("s") and finish ("f") event, by id."""
    ends: dict[int, dict[str, dict]] = {}
    for e in trace:
        if e["ph"] in ("s", "f"):
            ends.setdefault(e["id"], {})[e["ph"]] = e
    assert all(set(pair) == {"s", "f"} for pair in ends.values()), ends
    return {k: (pair["s"], pair["f"]) for k, pair in ends.items()}


def _enclosing(trace: list[dict], pid: int, ts: float) -> dict:
    """The action slice of process ``pid`` that holds time ``ts``."""
    slices = [e for e in trace if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 0 and e["ts"] <= ts <= e["ts"] + e["dur"]]
    assert len(slices) == 1, (pid, ts, slices)
    return slices[0]


def test_chrome_trace_names_a_process_per_worker_and_draws_each_message_as_a_flow(tmp_path):
    timeline = simulate(one_f_one_b(3, 4), 3, 1e-3, 2e-3, comm_time=1e-4)
    trace = _trace(timeline, tmp_path)
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "worker 0: stage 0", 1: "worker 1: stage 1", 2: "worker 2: stage 2"}
    flows = _flows(trace)
    assert len(flows) == 2 * 2 * 4  # two links, an activation and a gradient per micro-batch
    for start, finish in flows.values():
        sender, receiver = _enclosing(trace, start["pid"], start["ts"]), _enclosing(trace, finish["pid"], finish["ts"])
        if start["cat"] == "activation":
            assert (sender["cat"], receiver["cat"]) == ("F", "F")
            assert receiver["args"]["stage"] == sender["args"]["stage"] + 1
        else:
            assert (sender["cat"], receiver["cat"]) == ("B", "B")
            assert receiver["args"]["stage"] == sender["args"]["stage"] - 1
        assert sender["args"]["microbatch"] == receiver["args"]["microbatch"]
        assert finish["ts"] >= start["ts"] and finish["bp"] == "e"


def test_flows_follow_skip_links_and_not_stages_sharing_a_worker(tmp_path):
    skip = simulate(gpipe(3, 1), 3, 1.0, 1.0, deps=[(0, 1), (1, 2), (0, 2)])
    assert [(kind, a.stage, b.stage) for kind, a, b in skip.messages() if kind == "activation"] == [
        ("activation", 0, 1), ("activation", 0, 2), ("activation", 1, 2),
    ]
    # interleaved: stages 1 and 2 sit on different workers, 0 and 2 on the same one
    interleaved = simulate(make_schedule("interleaved-1f1b", 4, 2, chunks=2), 4, 1.0, 1.0)
    pairs = {(a.stage, b.stage) for kind, a, b in interleaved.messages() if kind == "activation"}
    assert pairs == {(0, 1), (1, 2), (2, 3)}
    assert all(a.worker != b.worker for _, a, b in interleaved.messages())
    split = simulate(zb_h1(2, 2), 2, 1.0, 2.0)
    assert {(a.op, b.op) for kind, a, b in split.messages() if kind == "gradient"} == {("I", "I")}


def test_a_gathered_timeline_names_its_rows_and_processes_by_rank(tmp_path):
    events = [Event(0, 2, 0, "F", 0.0, 1.0, "cpu"), Event(1, 3, 0, "F", 1.5, 2.0, "cpu"), Event(1, 3, 0, "B", 2.0, 3.0, "cpu")]
    timeline = Timeline(events, 2, kind="measured", ranks=[2, 3], deps=[(2, 3)])
    assert timeline.process_name(1) == "rank 3: stage 3, cpu"
    assert "  rank 2 (cpu): busy 1.00 s" in timeline.summary()
    names = [e["args"]["name"] for e in _trace(timeline, tmp_path) if e["name"] == "process_name"]
    assert names == ["rank 2: stage 2, cpu", "rank 3: stage 3, cpu"]
    assert timeline.to_dict()["ranks"] == [2, 3]
    with pytest.raises(ValueError, match="one rank per worker"):
        Timeline(events, 2, ranks=[0])


# ------------------------------------------------------------------ gathered under torchrun
LATE = 0.5  # seconds rank 0 starts its step after rank 1


def gathered_timeline_case() -> dict:
    """A 2-rank 1F1B step whose rank 0 starts late: this rank's own timeline, the gathered
    one, its Chrome trace and the text of its chart."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, t = torch.randn(8, 16), torch.randint(0, 3, (8,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["2"], microbatches=4)
    pipe = fxpipe.compile(net, plan, example_inputs=(x,), loss_fn=torch.nn.CrossEntropyLoss())
    if pipe.rank == 0:
        time.sleep(LATE)
    pipe.step(x, target=t)
    own, gathered = pipe.timeline(gather=False), pipe.timeline()
    pipe.step(x, target=t)
    if pipe.rank == 1:  # one rank alone may ask: the other is busy with its own code
        work = lambda tl: sorted((e.op, e.stage, e.microbatch) for e in tl.events if e.op in "FB")  # noqa: E731
        assert work(pipe.timeline()) == work(gathered) and {e.worker for e in gathered.events} == {0, 1}
    else:
        time.sleep(LATE)
    with tempfile.TemporaryDirectory() as folder, matplotlib.rc_context({"svg.fonttype": "none"}):
        gathered.to_chrome_trace(Path(folder) / "trace.json")
        gathered.plot(Path(folder) / "timeline.svg")
        trace = json.loads((Path(folder) / "trace.json").read_text())["traceEvents"]
        chart = (Path(folder) / "timeline.svg").read_text()
    return {"own": own, "gathered": gathered, "trace": trace, "chart": chart}


@pytest.mark.timeout(150)
def test_timeline_under_torchrun_gathers_every_ranks_events_on_one_clock():
    ranks = launch(gathered_timeline_case, 2, timeout=120)
    first, second = ranks[0]["gathered"], ranks[1]["gathered"]
    assert first.events == second.events and first.ranks == second.ranks == [0, 1]
    work = {(e.op, e.stage, e.microbatch): e for e in first.events if e.op in ("F", "B")}
    assert set(work) == {(op, s, m) for op in "FB" for s in (0, 1) for m in range(4)}
    for rank, result in enumerate(ranks):  # each rank's actions, as long as it measured them
        own = sorted(e.duration for e in result["own"].events if e.op in ("F", "B"))
        assert own == pytest.approx(sorted(e.duration for e in work.values() if e.worker == rank), abs=1e-6)
    # one clock: rank 0 started LATE seconds after rank 1, yet no action starts before the one
    # whose value it needs (an action's end is read after it posted its sends, so compare starts)
    for m in range(4):
        assert work["F", 1, m].start > work["F", 0, m].start
        assert work["B", 0, m].start > work["B", 1, m].start
    assert work["F", 0, 0].start >= LATE - 0.1  # rank 1 waited for rank 0's late start
    # the pipeline's bubble: both ranks' busy time over both ranks' step
    busy = sum(r["own"].busy_time(rank) for rank, r in enumerate(ranks))
    assert first.bubble_fraction == pytest.approx(1 - busy / (2 * first.step_time), rel=1e-6)

    trace = ranks[0]["trace"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "rank 0: stage 0, cpu", 1: "rank 1: stage 1, cpu"}
    flows = _flows(trace)
    assert sorted((s["cat"], s["pid"], f["pid"]) for s, f in flows.values()) == [("activation", 0, 1)] * 4 + [("gradient", 1, 0)] * 4
    assert "rank 0 (cpu)" in ranks[0]["chart"] and "rank 1 (cpu)" in ranks[0]["chart"]


def test_a_squeezed_gantt_chart_numbers_every_kth_box_never_none(tmp_path) -> None:
    """Boxes narrower than any readable number (64 micro-batches of 1 ms in a 2 s step):
    every k-th micro-batch is numbered beside its box, in each row and for each op."""
    import matplotlib.pyplot as plt

    from fxpipe.inspection import gantt

    events = [
        Event(w, w, m, op, start, start + 1e-3)
        for w in range(2) for m in range(64)
        for op, start in (("F", 0.01 * m + 0.002 * w), ("B", 1.0 + 0.01 * m + 0.002 * w))
    ]
    timeline = Timeline(events, 2)
    points_per_second = 30 * 72 * 0.8 / 2.0
    size, stride = gantt._labels(events, points_per_second)
    assert size >= 5 and stride > 1
    fig, ax = plt.subplots()
    gantt._draw(timeline, ax, 1e3, (size, stride), points_per_second)
    numbers = [int(t.get_text()) for t in ax.texts]
    plt.close(fig)
    assert numbers and all(n % stride == 0 for n in numbers)
    assert len(numbers) == 2 * 2 * len(range(0, 64, stride))  # both rows, forward and backward
    timeline.plot(tmp_path / "squeezed.png", other=timeline)  # the chart itself draws
    assert (tmp_path / "squeezed.png").stat().st_size > 0
