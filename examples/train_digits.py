"""A real training run: a small CNN on scikit-learn's digits, 1F1B over two stages.

The CNN's convolutions are stage 0 and its classifier stage 1 (``split=["classifier"]``);
each batch of 64 is cut into 4 micro-batches and trained with Adam on the 1F1B schedule.
An eager copy of the model is trained on the same batches (accumulating gradients over
the same micro-batches). Prints the pipelined and the eager loss every few steps, the
test accuracy of both after every epoch and the largest per-step loss difference. Exit
status 1 below 95% test accuracy or when a step's losses differ by more than 1e-4.

    .venv/bin/python examples/train_digits.py [--epochs 10] [--plot docs/img/train-digits-loss.png]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence

import torch
from common import (
    DigitsCNN,
    Run,
    add_training_options,
    limit_threads,
    load_digits,
    plot_losses,
    stage_devices,
    train_eager,
    train_pipeline,
    training_options,
)

import fxpipe

TARGET_ACCURACY = 0.95
LOSS_TOLERANCE = 1e-4


def main(argv: Sequence[str] | None = None) -> tuple[Run, Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_options(parser, epochs=10, lr=2e-3)
    parser.add_argument("--print-every", type=int, default=25, help="print the two losses every N steps")
    args = parser.parse_args(argv)
    limit_threads()

    data = load_digits(limit=300 if args.smoke else None)
    plan = fxpipe.Plan(devices=stage_devices(2), split=["classifier"], schedule="1f1b", microbatches=args.microbatches)
    print(f"digits: {len(data.x_train)} train / {len(data.x_test)} test 8x8 images; {plan.devices}, 1F1B, {plan.microbatches} micro-batches")
    torch.manual_seed(0)
    model = DigitsCNN()
    options = training_options(args, smoke_steps=4)
    adam = lambda params: torch.optim.Adam(params, lr=args.lr)  # noqa: E731
    pipe, pipelined = train_pipeline("1F1B, 2 stages", copy.deepcopy(model), plan, data, adam, **options)  # eager starts from the same weights
    eager = train_eager("eager", model, plan.devices[-1], plan.microbatches, data, adam, **options)
    print(pipe.summary(), "\n")

    print(f"{'step':>5}  {'pipelined loss':>14}  {'eager loss':>14}  {'difference':>10}")
    last = len(pipelined.losses) - 1
    for step, (a, b) in enumerate(zip(pipelined.losses, eager.losses)):
        if step % args.print_every == 0 or step == last:
            print(f"{step:>5}  {a:>14.6f}  {b:>14.6f}  {abs(a - b):>10.2e}")
    for epoch, (a, b) in enumerate(zip(pipelined.accuracies, eager.accuracies)):
        print(f"epoch {epoch + 1:>2}: mean loss {pipelined.epoch_loss(epoch):.4f}; test accuracy pipelined {a:.2%}, eager {b:.2%}")
    worst = pipelined.largest_difference(eager)
    print(
        f"\n{len(pipelined.losses)} steps; largest per-step loss difference {worst:.2e}; "
        f"final test accuracy {pipelined.accuracies[-1]:.2%}; time in steps: pipelined {pipelined.seconds:.1f} s, eager {eager.seconds:.1f} s"
    )
    if args.plot:
        plot_losses([eager, pipelined], args.plot, "DigitsCNN on digits: pipelined and eager training loss")
        print(f"wrote {args.plot}")
    if worst > LOSS_TOLERANCE:
        raise SystemExit(f"pipelined losses differ from eager by more than {LOSS_TOLERANCE}")
    if not args.smoke and pipelined.accuracies[-1] < TARGET_ACCURACY:
        raise SystemExit(f"test accuracy {pipelined.accuracies[-1]:.2%} is below {TARGET_ACCURACY:.0%}")
    return pipelined, eager


if __name__ == "__main__":
    main()
