"""Collective data parallelism: a ResNet-18 on digits with ``data_parallel=2`` under torchrun.

PaddlePaddle's data-parallel guide, rebuilt on fxpipe. Every process runs this script;
``fxpipe.compile`` sees ``WORLD_SIZE`` > 1 and returns a DistributedPipeline holding this
rank's stages. ``Plan(data_parallel=2)`` makes two replicas of the pipeline: each takes
its half of every batch (every rank passes the whole batch; replica r keeps shard r),
runs its micro-batches, and the replicas' gradients are averaged with all-reduce once
per step, so every replica holds the same weights.

  --stages 1   one stage per replica: plain data parallelism (world 2)
  --stages 2   2 stages x 2 replicas, cut at ``layer3`` (world 4): rank r is stage r % 2
               of replica r // 2

Every rank checks the first step against eager PyTorch on the whole batch, cut into
replicas x micro-batches (the micro-batches the replicas run): the loss and each of its
parameters' averaged gradients (exit status 1 above 1e-4). Rank 0 keeps training the eager
copy and prints both losses every step. They agree to float rounding for the first steps,
then drift: all-reduce adds the replicas' gradients in another order than eager
accumulates micro-batches, and this BatchNorm ResNet on small micro-batches amplifies
rounding (eager alone drifts as much when it merely reorders its own accumulation:
``--eager-drift`` shows it).
Afterwards the test accuracy, as trained and with BatchNorm statistics re-estimated:
running statistics are per replica (each sees its shard) and lag the weights early in
training, the replicas' more than eager's (half the micro-batches per step).

    python -m fxpipe.distributed -n 2 examples/data_parallel.py               # torchrun, 2 processes
    python -m fxpipe.distributed -n 4 examples/data_parallel.py --stages 2    # 2 stages x 2 replicas
    torchrun --standalone --nproc-per-node 4 examples/data_parallel.py --stages 2
    python examples/data_parallel.py     # no torchrun: both worlds, via fxpipe.distributed.launch
                                         # (--stages N: only that one)

On GPUs each process takes ``cuda:LOCAL_RANK`` (NCCL); on CPUs the processes use gloo.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from common import (
    Digits,
    accuracy,
    digits_resnet18,
    eager_step,
    eval_forward,
    largest_grad_difference,
    load_digits,
    reestimate_batchnorm,
    stage_devices,
)
from torch import nn

import fxpipe
import fxpipe.distributed

LOSS_TOLERANCE = 1e-4


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, choices=[1, 2], help="pipeline stages per replica (default: 1 under torchrun, both without)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="global batch: each of the 2 replicas takes half")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per replica")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--smoke", action="store_true", help="two steps on a subset (for tests)")
    parser.add_argument(
        "--eager-drift", action="store_true",
        help="no pipeline: train two eager copies that add the same micro-batch gradients in two orders, print how far they drift",
    )
    return parser.parse_args(argv)


def run(argv: Sequence[str] | None = None) -> dict[str, float]:
    """One rank's part: compile, train, compare with eager (rank 0), measure accuracy."""
    args = parse(argv)
    args.stages = args.stages or 1
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    replicas = world // args.stages
    torch.manual_seed(0)  # every rank builds the same model; replica 0's weights are broadcast anyway
    data = load_digits(size=32, limit=300 if args.smoke else None)
    steps = 2 if args.smoke else args.steps
    batch = 16 if args.smoke else args.batch
    model = digits_resnet18()
    loss_fn = nn.CrossEntropyLoss()
    plan = fxpipe.Plan(
        devices=stage_devices(args.stages), split=["layer3"] if args.stages == 2 else "tags",
        schedule="1f1b", microbatches=args.microbatches, data_parallel=replicas,
    )
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, plan, example_inputs=(data.x_train[:batch],), loss_fn=loss_fn)
    eager.to(pipe.device)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"world {world}: {args.stages} stage(s) x {replicas} replicas; {pipe}")
    say(f"{'step':>4}  {'pipelined':>10}  {'eager':>10}  {'difference':>10}")

    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=args.lr, momentum=0.9)
    first_loss_difference = 0.0
    grad_difference = 0.0
    order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        idx = order[(step * batch) % (len(order) - batch) :][:batch]
        x, t = data.x_train[idx], data.y_train[idx]
        opt.zero_grad()
        loss = pipe.step(x, target=t)
        if step == 0 or rank == 0:  # every rank checks the first step's gradients; rank 0 keeps the eager twin
            eager_opt.zero_grad()
            ref = eager_step(eager, x, t, loss_fn, replicas * args.microbatches)
        if step == 0:
            diff = torch.tensor([largest_grad_difference(pipe, eager)], device=pipe.device)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            grad_difference = diff.item()
            first_loss_difference = abs(loss.item() - ref.item())
        opt.step()
        if rank == 0:
            eager_opt.step()
            say(f"{step:>4}  {loss.item():>10.6f}  {ref.item():>10.6f}  {loss.item() - ref.item():>+10.2e}")

    say(f"\nstep 0 against eager: loss difference {first_loss_difference:.2e}, largest gradient difference over all ranks {grad_difference:.2e}")
    as_trained = (test_accuracy(pipe, data, replicas), accuracy(eval_forward(eager), data.x_test, data.y_test))
    # BatchNorm statistics lag the weights early in training, the replicas' more (each runs
    # half the micro-batches per step): re-estimated on training images, the weights compare
    images = data.x_train[: 10 * batch]
    reestimate_batchnorm([pipe.stages[s].module for s in pipe.local_stages], pipe, images, batch)
    reestimate_batchnorm([eager], lambda x: eager(x.to(pipe.device)), images, batch)
    reestimated = (test_accuracy(pipe, data, replicas), accuracy(eval_forward(eager), data.x_test, data.y_test))
    say(f"test accuracy after {steps} steps: pipelined {as_trained[0]:.2%}, eager {as_trained[1]:.2%}")
    say(f"  with BatchNorm statistics re-estimated on {len(images)} training images: pipelined {reestimated[0]:.2%}, eager {reestimated[1]:.2%}")
    if grad_difference > LOSS_TOLERANCE or first_loss_difference > LOSS_TOLERANCE:
        raise SystemExit(f"rank {rank}: the data-parallel pipeline's first step differs from eager by more than {LOSS_TOLERANCE}")
    return {"grad_difference": grad_difference, "loss_difference": first_loss_difference, "accuracy": reestimated[0]}


def test_accuracy(pipe: fxpipe.distributed.DistributedPipeline, data: Digits, replicas: int) -> float:
    """Each replica classifies its shard of the test set; the last stage's ranks count."""
    pipe.eval()
    with torch.no_grad():
        out = pipe(data.x_test)
    pipe.train()
    correct = torch.zeros(1, device=pipe.device)
    if out is not None:
        shard = data.y_test.tensor_split(replicas)[pipe.layout.replica]
        correct += (out.argmax(dim=1).cpu() == shard).sum().item()
    dist.all_reduce(correct)
    return correct.item() / len(data.y_test)


def eager_drift(args: argparse.Namespace) -> list[float]:
    """Eager only: two copies of the model on the same batches and micro-batches, one
    accumulating the second half of each batch first. Returns the largest gradient
    difference per step: how much this model amplifies a change in rounding alone."""
    torch.manual_seed(0)
    data = load_digits(size=32)
    first = digits_resnet18()
    second = copy.deepcopy(first)
    loss_fn = nn.CrossEntropyLoss()
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in (first, second)]
    drift = []
    m = 2 * args.microbatches
    for step in range(min(args.steps, 6)):
        x, t = data.x_train[step * args.batch :][: args.batch], data.y_train[step * args.batch :][: args.batch]
        half = len(x) // 2
        for opt in opts:
            opt.zero_grad()
        eager_step(first, x, t, loss_fn, m)
        eager_step(second, torch.cat([x[half:], x[:half]]), torch.cat([t[half:], t[:half]]), loss_fn, m)
        drift.append(largest_grad_difference(second, first))
        print(f"step {step}: largest gradient difference between the two orders {drift[-1]:.2e}")
        for opt in opts:
            opt.step()
    return drift


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    """Under torchrun: this rank's part. Otherwise: launch both worlds locally."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return [run(argv)]
    from fxpipe.distributed import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    if parse(argv).eager_drift:
        eager_drift(parse(argv))
        return []
    chosen = parse(argv).stages
    results = []
    for stages in [chosen] if chosen else [1, 2]:
        world = 2 * stages
        print(f"\n=== fxpipe.distributed.launch: {world} processes, --stages {stages} ===", flush=True)
        results.append(launch(run, world, [[*argv, "--stages", str(stages)]] if not chosen else [argv])[0])
    return results


if __name__ == "__main__":
    main()
