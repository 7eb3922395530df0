"""Memory: each stage's predicted against its measured peak, checkpoint="auto" under a
memory cap, and the memory-controlled V schedules against 1F1B.

Two models, random weights, 4 workers on logical CPU devices in one process (the local
executor), one intra-op thread per worker:
  lm        a GPT-2 (transformers' GPT2LMHeadModel, 16 layers, width 64, 256-token
            vocabulary, its own loss from labels=), batch 16 x 64 tokens
  resnet18  torchvision's ResNet-18 (10 classes, cross entropy), batch 16 at 64x64
Eight micro-batches throughout (p=4, m=8). Three parts, each printed as a table:

1. predicted vs measured: per schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v; 1F1B,
   GPipe and ZB-H1 on 4 stages of 4 layers / ResNet stages, the others on 8 stages, 2 per
   worker) one training step, and ``pipe.memory()`` per stage: the peak (parameters +
   gradients + buffers + activations) and the activations alone, predicted (a fake run
   of each stage walked through the schedule) and measured (saved-tensor hooks in the
   step). Goal: every stage within 15%.
2. checkpoint="auto" under a cap: the lm on 1F1B, one memory cap for every device, set
   between what the most loaded stage needs keeping its activations and what recomputing
   every stage needs (a device must hold its stages' parameters, gradients, Adam's two
   moments, buffers and activations). checkpoint=False exceeds it, True fits, "auto"
   chooses per stage. Measured: each stage's peak plus Adam's moments (two per
   parameter) against the cap, and the step time (median of interleaved rounds). Goal:
   auto fits every stage and is >= 15% faster than checkpoint=True.
3. V schedules: the lm on 1f1b and interleaved-1f1b against v-half and v-min (and zb-v):
   the most activation bytes any device holds at once, measured, as a ratio of 1F1B's,
   and the step times. Goals: v-half <= 0.55x, v-min <= 0.40x.

With --plot PATH, predicted against measured per stage (part 1) as a scatter plot.
NOTE: 4 workers share this machine's cores, so step times measure total work more than
bubbles (see examples/benchmarks/zero_bubble.py).

    .venv/bin/python examples/benchmarks/memory.py [--plot docs/img/memory-predicted-vs-measured.png]
        [--rounds 3] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fxpipe
from fxpipe.inspection import format as fmt

FIVE = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)]
V_CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-v", 2), ("v-half", 2), ("v-min", 2)]
DEVICES = [f"cpu:{k}" for k in range(4)]
ADAM_STATES = 2


@dataclass
class Case:
    """A model, its step's arguments and its split points for 4 and for 8 stages."""

    name: str
    model: nn.Module
    kwargs: dict
    target: Any
    loss_fn: Any
    split4: list[str]
    split8: list[str]

    def plan(self, schedule: str, chunks: int, **extra: Any) -> fxpipe.Plan:
        split = self.split4 if chunks == 1 else self.split8
        return fxpipe.Plan(devices=DEVICES, split=split, schedule=schedule, chunks=chunks, microbatches=8, **extra)

    def compile(self, plan: fxpipe.Plan) -> Any:
        return fxpipe.compile(copy.deepcopy(self.model), plan, example_kwargs=self.kwargs, loss_fn=self.loss_fn)

    def step(self, pipe: Any) -> float:
        start = time.perf_counter()
        pipe.step(target=self.target, **self.kwargs)
        seconds = time.perf_counter() - start
        pipe.zero_grad()
        return seconds


def lm(quick: bool) -> Case:
    import transformers

    torch.manual_seed(0)
    layers, width, length = (8, 32, 16) if quick else (16, 64, 64)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, vocab_size=256, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    ids = torch.randint(3, 256, (16, length))
    split4 = [f"transformer.h.{layers * k // 4}" for k in range(1, 4)]
    split8 = [f"transformer.h.{layers * k // 8}" for k in range(1, 8)]
    return Case("lm", transformers.GPT2LMHeadModel(config), dict(input_ids=ids, labels=ids), None, None, split4, split8)


def resnet18(quick: bool) -> Case:
    import torchvision

    torch.manual_seed(0)
    size = 32 if quick else 64
    x, t = torch.randn(16, 3, size, size), torch.randint(0, 10, (16,))
    split8 = ["layer1.1", "layer2", "layer2.1", "layer3", "layer3.1", "layer4", "layer4.1"]
    return Case("resnet18", torchvision.models.resnet18(num_classes=10), dict(x=x), t, nn.CrossEntropyLoss(), ["layer2", "layer3", "layer4"], split8)


# ------------------------------------------------------------------ 1. predicted vs measured
def predicted_vs_measured(cases: list[tuple[Case, list[tuple[str, int]]]]) -> list[tuple[str, str, Any]]:
    print("1. predicted vs measured, per stage (peak = parameters + gradients + buffers + activations)")
    print(f"{'model':<9} {'schedule':<17} {'stage':>5} {'peak meas':>10} {'peak pred':>10} {'error':>7} {'acts meas':>10} {'acts pred':>10} {'error':>7}")
    rows = []
    for case, schedules in cases:
        for schedule, chunks in schedules:
            pipe = case.compile(case.plan(schedule, chunks))
            case.step(pipe)
            for r in pipe.memory():
                acts_error = r.predicted_activations / r.activations_peak - 1
                print(
                    f"{case.name:<9} {schedule:<17} {r.index:>5} {fmt.nbytes(r.measured_peak):>10} {fmt.nbytes(r.predicted_peak):>10} "
                    f"{r.error:>+7.1%} {fmt.nbytes(r.activations_peak):>10} {fmt.nbytes(r.predicted_activations):>10} {acts_error:>+7.1%}"
                )
                rows.append((case.name, schedule, r))
    worst = max(abs(r.error) for _, _, r in rows)
    worst_acts = max(abs(r.predicted_activations / r.activations_peak - 1) for _, _, r in rows)
    print(f"worst peak error {worst:.1%}, worst activations error {worst_acts:.1%} over {len(rows)} stages (goal: peaks within 15%)\n")
    return rows


# ------------------------------------------------------------------ 2. checkpoint="auto" under a cap
def under_a_cap(case: Case, rounds: int, steps: int) -> None:
    needs = {ck: [e.memory for e in fxpipe.partition(case.model, case.plan("1f1b", 1, checkpoint=ck), example_kwargs=case.kwargs).estimates()] for ck in (False, True)}
    cap = (max(needs[False]) + max(needs[True] + sorted(needs[False])[:-1])) / 2
    spec = fxpipe.DeviceSpec(flops=8e10, memory=cap, bandwidth=1e10)
    print(f"2. checkpoint='auto' under a cap of {fmt.nbytes(cap)} per device ({case.name}, 1f1b): predicted need per stage")
    for ck, need in needs.items():
        print(f"   checkpoint={ck!s:<5} " + " ".join(f"{fmt.nbytes(n):>10}" for n in need) + ("  exceeds the cap" if max(need) > cap else "  fits"))
    pipes = {ck: case.compile(case.plan("1f1b", 1, checkpoint=ck, device_specs={"cpu": spec})) for ck in (False, True, "auto")}
    print("   auto chose: " + ", ".join(f"stage {s.index} {s.recompute}" for s in pipes["auto"].stages))
    times: dict[Any, list[float]] = {ck: [] for ck in pipes}
    for pipe in pipes.values():
        case.step(pipe)  # warm-up, and the measured step
    for _ in range(rounds):
        for ck, pipe in pipes.items():
            times[ck] += [case.step(pipe) for _ in range(steps)]
    print(f"   {'checkpoint':<10} {'step':>9}   measured peak + Adam's moments per stage (cap {fmt.nbytes(cap)})")
    for ck, pipe in pipes.items():
        held = [r.measured_peak + ADAM_STATES * r.parameters for r in pipe.memory()]
        verdict = "fits" if max(held) <= cap else "EXCEEDS"
        print(f"   {ck!s:<10} {fmt.seconds(statistics.median(times[ck])):>9}   " + " ".join(f"{fmt.nbytes(h):>10}" for h in held) + f"  {verdict}")
    speedup = statistics.median(times[True]) / statistics.median(times["auto"])
    print(f"   checkpoint=True / auto step time: {speedup:.2f}x (goal >= 1.15x, auto fitting every stage)\n")


# ------------------------------------------------------------------ 3. V schedules
def v_schedules(case: Case, rounds: int, steps: int, schedules: list[tuple[str, int]]) -> None:
    pipes = {name: case.compile(case.plan(name, chunks)) for name, chunks in schedules}
    held = {}
    for name, pipe in pipes.items():
        case.step(pipe)
        held[name] = max(d.activations_peak for d in pipe.memory().devices)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(rounds):
        for name, pipe in pipes.items():
            times[name] += [case.step(pipe) for _ in range(steps)]
    step = {name: statistics.median(t) for name, t in times.items()}
    print(f"3. V schedules ({case.name}, p=4, m=8): the most activations a device holds at once (measured), step time")
    print(f"   {'schedule':<17} {'activations':>11} {'/ 1f1b':>7} {'step':>9} {'/ 1f1b':>7} {'/ interleaved':>13}")
    for name in pipes:
        interleaved = f"{step[name] / step['interleaved-1f1b']:>12.2f}x" if "interleaved-1f1b" in step else ""
        print(
            f"   {name:<17} {fmt.nbytes(held[name]):>11} {held[name] / held['1f1b']:>6.3f}x {fmt.seconds(step[name]):>9} "
            f"{step[name] / step['1f1b']:>6.2f}x {interleaved}"
        )
    print(f"   v-half/1f1b {held['v-half'] / held['1f1b']:.3f}x (goal <= 0.55x), v-min/1f1b {held['v-min'] / held['1f1b']:.3f}x (goal <= 0.40x)\n")


def plot(rows: list[tuple[str, str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    markers = {"lm": "o", "resnet18": "s"}
    for ax, what, pred, meas in (
        (axes[0], "peak (state + activations)", lambda r: r.predicted_peak, lambda r: r.measured_peak),
        (axes[1], "activations kept for backward", lambda r: r.predicted_activations, lambda r: r.activations_peak),
    ):
        schedules = list(dict.fromkeys(s for _, s, _ in rows))
        for k, schedule in enumerate(schedules):
            for model, marker in markers.items():
                own = [r for m, s, r in rows if s == schedule and m == model]
                if own:
                    ax.scatter([meas(r) / 2**20 for r in own], [pred(r) / 2**20 for r in own], marker=marker, color=f"C{k}", s=28,
                               label=f"{model}, {schedule}")
        low = min(min(meas(r), pred(r)) for _, _, r in rows) / 2**20 * 0.8
        high = max(max(meas(r), pred(r)) for _, _, r in rows) / 2**20 * 1.25
        line = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)), 50)
        ax.plot(line, line, "k-", linewidth=0.8, label="predicted = measured")
        ax.fill_between(line, line * 0.85, line * 1.15, color="grey", alpha=0.2, label="±15%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # decades only: minor labels collide
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("measured (MiB)")
        ax.set_ylabel("predicted (MiB)")
        ax.set_title(f"per stage: {what}")
    axes[1].legend(fontsize=6, ncol=2, loc="upper left")
    fig.suptitle("pipe.memory(): predicted against measured, every stage of 5 schedules (p=4, m=8)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--plot", help="write part 1's predicted-vs-measured scatter plot to this PNG")
    parser.add_argument("--quick", action="store_true", help="small sizes, fewer schedules, one round (for tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    language, vision = lm(quick), resnet18(quick)
    cases = [(language, [FIVE[1]]), (vision, [FIVE[4]])] if quick else [(language, FIVE), (vision, FIVE)]
    rows = predicted_vs_measured(cases)
    rounds, steps = (1, 1) if quick else (args.rounds, args.steps)
    under_a_cap(language, rounds, steps)
    v_schedules(language, rounds, steps, [V_CASES[0], *V_CASES[3:]] if quick else V_CASES)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
