"""Distributed pipeline benchmark: fxpipe vs torch.distributed.pipelining, and peak memory.

Step time, 2 processes × 1 thread (gloo), 2 stages, 1F1B, 8 micro-batches, on an MLP stack
and ResNet-18 at 32×32, against
- the eager micro-batch loop in one process with 1 thread (same micro-batches),
- the ideal pipeline bound: eager × (m + p − 1) / (m · p),
- torch.distributed.pipelining with the same model, split, schedule and processes.

Peak memory per rank for a model whose weights exceed one rank's share: fxpipe builds the
model on the meta device and each rank reads only its stage from a safetensors file;
torch.distributed.pipelining builds the whole model on every rank and traces it.

    python examples/benchmarks/distributed.py            # ~2 minutes
    python examples/benchmarks/distributed.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn

import fxpipe
from fxpipe.distributed import launch
from fxpipe.planner.schedule_sim import simulate
from fxpipe.schedules import make_schedule

M = 8  # micro-batches
P = 2  # pipeline stages / processes


def mlp_stack(width: int = 1024, depth: int = 8, classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


CASES = {
    # name: (builder, input shape, split module path)
    "mlp 8x1024, batch 256": (lambda: mlp_stack(), (256, 1024), "8"),
    # at 32x32 layer4 holds most of the work; this split balances the two stages best
    "resnet18 32x32, batch 64": (lambda: torchvision.models.resnet18(num_classes=10), (64, 3, 32, 32), "layer4.0.conv2"),
}


def data(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    shape = CASES[case][1]
    return torch.randn(*shape), torch.randint(0, 10, (shape[0],))


def timed_steps(step, steps: int, warmup: int, sync) -> list[float]:
    times = []
    for k in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return times


def eager_run(case: str, steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = CASES[case][0]()
    x, t = data(case)
    loss_fn = nn.CrossEntropyLoss()
    xs, ts = x.chunk(M), t.chunk(M)

    def step() -> None:
        for xi, ti in zip(xs, ts):
            (loss_fn(model(xi), ti) / M).backward()

    return timed_steps(step, steps, warmup, lambda: None)


def fxpipe_run(case: str, steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = CASES[case][0]()
    x, t = data(case)
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[CASES[case][2]], schedule="1f1b", microbatches=M)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    times = timed_steps(lambda: pipe.step(x, target=t), steps, warmup, dist.barrier)
    events = pipe.timeline(gather=False).events
    # this rank's forward and backward per micro-batch, as they ran next to the other rank
    mean = {op: statistics.mean(e.end - e.start for e in events if e.op == op) for op in "FB"}
    return {"times": times, "stage": pipe.local_stages[0], "F": mean["F"], "B": mean["B"]}


def pipelining_run(case: str, steps: int, warmup: int) -> list[float]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = CASES[case][0]()
    x, t = data(case)
    pipe = pipeline(model, mb_args=(x.chunk(M)[0],), split_spec={CASES[case][2]: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=nn.CrossEntropyLoss())

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=t, losses=[])

    return timed_steps(step, steps, warmup, dist.barrier)


# ----------------------------------------------------------------- peak memory
def big_mlp() -> nn.Sequential:
    return mlp_stack(width=2048, depth=16)


class PeakAnonMemory:
    """Peak anonymous resident memory (MB) since start, sampled every millisecond.

    Anonymous memory is what tensors occupy; pages of a memory-mapped checkpoint are
    file-backed (the page cache can drop them) and are left out.
    """

    def __init__(self) -> None:
        self.base = self.now()
        self.peak = self.base
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    @staticmethod
    def now() -> float:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def growth(self) -> float:
        """Peak so far above the starting point, in MB."""
        self.peak = max(self.peak, self.now())
        return self.peak - self.base


def fxpipe_memory(path: str) -> dict:
    memory = PeakAnonMemory()
    with torch.device("meta"):
        model = big_mlp()
    x, t = torch.randn(64, 2048), torch.randint(0, 10, (64,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=["16"], microbatches=M)
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss(), weights=path)
    built = memory.growth()
    pipe.step(x, target=t)
    held = sum(p.numel() * p.element_size() for p in pipe.parameters()) / 2**20
    return {"after build": built, "after a step": memory.growth(), "weights held": held}


def pipelining_memory(path: str) -> dict:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    dist.init_process_group("gloo")
    memory = PeakAnonMemory()
    model = big_mlp()
    x, t = torch.randn(64, 2048), torch.randint(0, 10, (64,))
    pipe = pipeline(model, mb_args=(x.chunk(M)[0],), split_spec={"16": SplitPoint.BEGINNING})
    stage = pipe.build_stage(dist.get_rank(), torch.device("cpu"))
    built = memory.growth()
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=nn.CrossEntropyLoss())
    if dist.get_rank() == 0:
        schedule.step(x)
    else:
        schedule.step(target=t, losses=[])
    held = sum(p.numel() * p.element_size() for p in stage.submod.parameters()) / 2**20
    return {"after build": built, "after a step": memory.growth(), "weights held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 5 steps instead of 3 rounds of 10")
    ns = parser.parse_args()
    rounds, steps, warmup = (1, 5, 2) if ns.quick else (3, 10, 3)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; {P} processes x 1 thread "
        f"(gloo), 1F1B, {M} micro-batches; {rounds} interleaved round(s) of {steps} steps"
    )
    bound = (M + P - 1) / (M * P)
    print(f"{'model':26} {'stat':6} {'eager':>9} {'ideal':>9} {'fxpipe':>9} {'pipelining':>11} {'fxpipe/ideal':>13} {'fxpipe/pipelining':>18} {'fxpipe/schedule':>16}")
    for case in CASES:
        eager, ours, theirs, schedule = [], [], [], []
        for _ in range(rounds):
            eager += launch(eager_run, 1, (case, steps, warmup))[0]
            ranks = launch(fxpipe_run, P, (case, steps, warmup))
            ours += ranks[0]["times"]
            forward, backward = {r["stage"]: r["F"] for r in ranks}, {r["stage"]: r["B"] for r in ranks}
            played = simulate(make_schedule("1f1b", P, M), P, lambda s, i, f=forward: f[s], lambda s, i, b=backward: b[s])
            schedule.append(played.step_time)
            theirs += launch(pipelining_run, P, (case, steps, warmup))[0]
        # the median says what a run usually gets on this shared machine; the minimum is the
        # least disturbed step of each (other jobs only ever slow a step down)
        for stat, pick in (("median", statistics.median), ("min", min)):
            e, f, p, sched = pick(eager), pick(ours), pick(theirs), pick(schedule)
            ideal = e * bound
            print(
                f"{case if stat == 'median' else '':26} {stat:6} {e * 1e3:6.0f} ms {ideal * 1e3:6.0f} ms {f * 1e3:6.0f} ms {p * 1e3:8.0f} ms "
                f"{f / ideal:12.2f}x {f / p:17.2f}x {f / sched:15.2f}x"
            )
    print(
        "ideal = eager x (m+p-1)/(m*p); schedule = the 1F1B step simulated with each stage's forward and backward\n"
        "times measured during the fxpipe run (what the schedule allows with both ranks busy on this machine)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        path = os.path.join(tmp, "big_mlp.safetensors")
        torch.manual_seed(0)
        full = big_mlp()
        total = sum(p.numel() * p.element_size() for p in full.parameters()) / 2**20
        save_file(full.state_dict(), path)
        del full
        print(f"\npeak anonymous memory growth per rank (MB), MLP 16x2048 ({total:.0f} MB of weights), 2 stages, 1 step")
        for name, fn in (("fxpipe (meta + safetensors)", fxpipe_memory), ("torch.distributed.pipelining", pipelining_memory)):
            for rank, r in enumerate(launch(fn, P, (path,))):
                print(f"  {name:30} rank {rank}: after build {r['after build']:5.0f}, after a step {r['after a step']:5.0f}, weights held {r['weights held']:4.0f}")


if __name__ == "__main__":
    main()
