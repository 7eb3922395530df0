"""Pipeline x data parallelism: what sharding (``Plan(fsdp=True)``) saves per rank, and its step time.

4 gloo processes, 1 thread each: 2 stages x 2 replicas, 1F1B, 4 micro-batches per replica,
an MLP stack (8 x 1024 linear layers, 8.4 M parameters), AdamW.

- **Memory**: each rank's parameter, gradient and optimizer-state bytes after a step (the
  tensors it holds: a sharded tensor's own shard), replicated (``fsdp=False``) and sharded
  (``fsdp=True``). Goal: sharded <= 0.55x replicated at 2 replicas.
- **Step time** (optimizer step included, and shown apart), the slowest rank's median over
  the steps, of
  - fxpipe's bucketed all-reduce (``fsdp=False``, the reference),
  - ``replicate()``: torch's replicated data parallelism on FSDP2
    (``torch.distributed._composable.replicate_with_fsdp``) driven by the same code as
    ``fsdp=True`` (``ShardedStages.make_unit`` replaced), measured to decide whether it
    should replace the all-reduce,
  - ``fsdp=True`` with each stage's gathered parameters kept until its reduction (what the
    memory estimates choose for one stage per rank), and freed after every action
    (``reshard_after_forward=True``: an all-gather before every F and B).
  The variants take turns, round after round; each ratio is the median over the rounds of
  the variant's time over the all-reduce's in the same round.

    python examples/benchmarks/data_parallel.py            # ~3 minutes on 2 cores
    python examples/benchmarks/data_parallel.py --quick    # one short round
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import fxpipe
from fxpipe.distributed import launch
from fxpipe.distributed.fsdp import ShardedStages, local
from fxpipe.inspection import format as fmt

BATCH, WIDTH, DEPTH = 128, 1024, 8
VARIANTS = {
    # name: (plan fields, use torch's replicate() as the unit)
    "all-reduce (fsdp=False)": ({}, False),
    "replicate()": ({"fsdp": True}, True),
    "fsdp=True, kept gathered": ({"fsdp": True, "reshard_after_forward": False}, False),
    "fsdp=True, freed after each action": ({"fsdp": True, "reshard_after_forward": True}, False),
}


def mlp_stack() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def replicated_unit(module: nn.Module, mesh) -> nn.Module:
    """``module`` as a replicate() unit: parameters whole on every replica, gradients all-reduced."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    unit = replicate(module, mesh=mesh)
    unit._get_fsdp_state()._lazy_init()
    return unit


def held_bytes(pipe, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this rank holds."""
    params = list(pipe.parameters())
    size = lambda t: local(t).numel() * t.element_size()  # noqa: E731
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(v) for v in state),
    }


def run(variant: str, steps: int) -> dict:
    """One rank's part: compile, ``steps`` AdamW steps; its step times and held bytes."""
    torch.set_num_threads(1)
    fields, replicated = VARIANTS[variant]
    if replicated:
        ShardedStages.make_unit = staticmethod(replicated_unit)
    torch.manual_seed(0)
    x, t = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    plan = fxpipe.Plan(devices=["cpu:0", "cpu:1"], split=[str(DEPTH)], microbatches=4, data_parallel=2, **fields)
    pipe = fxpipe.compile(mlp_stack(), plan, example_inputs=(x,), loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    times, optimizer = [], []
    for _ in range(steps + 1):  # the first step warms up
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        pipe.step(x, target=t)
        stepped = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        optimizer.append(time.perf_counter() - stepped)
    return {"time": statistics.median(times[1:]), "optimizer": statistics.median(optimizer[1:]), "bytes": held_bytes(pipe, opt)}


def memory_table(results: dict[str, list[dict]]) -> float:
    """Print each rank's held bytes, replicated and sharded; return the largest ratio."""
    print("per-rank bytes after a step: parameters + gradients + AdamW state (2 stages x 2 replicas)")
    print(f"  {'rank':<5} {'replicated':>12} {'sharded':>12} {'sharded/replicated':>20}")
    ratios = []
    for rank, (plain, sharded) in enumerate(zip(results["all-reduce (fsdp=False)"], results["fsdp=True, kept gathered"])):
        a, b = sum(plain["bytes"].values()), sum(sharded["bytes"].values())
        ratios.append(b / a)
        print(f"  {rank:<5} {fmt.nbytes(a):>12} {fmt.nbytes(b):>12} {b / a:>19.2f}x")
    print(f"  largest: {max(ratios):.2f}x (goal <= 0.55x)")
    return max(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    optimizer: dict[str, list[float]] = {v: [] for v in VARIANTS}
    last: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for variant in VARIANTS:
            last[variant] = launch(run, 4, (variant, steps), timeout=600)
            times[variant].append(max(r["time"] for r in last[variant]))
            optimizer[variant].append(max(r["optimizer"] for r in last[variant]))
    memory_table(last)
    reference = "all-reduce (fsdp=False)"
    print(f"\nstep time, slowest rank's median of {steps} steps, {rounds} round(s); ratio: median over rounds of time / all-reduce's")
    print(f"  {'':<38} {'step':>10} {'ratio':>8} {'of which AdamW':>15}")
    for variant, values in times.items():
        ratio = statistics.median(v / r for v, r in zip(values, times[reference]))
        print(f"  {variant:<38} {fmt.seconds(statistics.median(values)):>10} {ratio:>7.2f}x {fmt.seconds(statistics.median(optimizer[variant])):>15}")


if __name__ == "__main__":
    main()
