"""1F1B and interleaved 1F1B: a ResNet-18 trained on upsampled digits over two devices.

Colossal-AI's pipeline guide, rebuilt on fxpipe: ResNet-18 (one-channel stem) on
scikit-learn's digits upsampled to 32x32, two pipeline devices, 4 micro-batches per
batch of 64, trained for a few epochs with momentum SGD under
  1f1b               two stages (cut at ``layer3``), one per device
  interleaved-1f1b   four stages (cut at ``layer2``, ``layer3``, ``layer4``), two chunks
                     per device: device 0 runs stages 0 and 2, device 1 stages 1 and 3
and once in eager PyTorch on the same batches (gradients accumulated over the same
micro-batches). A progress bar shows each run's loss; each epoch ends with the test
accuracy. Prints every run's mean loss and accuracy per epoch and the largest per-step
loss difference to eager (exit status 1 above 1e-4).

    .venv/bin/python examples/one_f_one_b_digits.py [--epochs 2] [--schedule both] [--plot docs/img/digits-1f1b-loss.png]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence

import torch
from common import (
    Run,
    add_training_options,
    digits_resnet18,
    limit_threads,
    load_digits,
    plot_losses,
    stage_devices,
    train_eager,
    train_pipeline,
    training_options,
)

import fxpipe

LOSS_TOLERANCE = 1e-4


def plan_for(schedule: str, microbatches: int) -> fxpipe.Plan:
    """Two devices; two stages for 1F1B, four (two chunks per device) when interleaved."""
    if schedule == "1f1b":
        return fxpipe.Plan(devices=stage_devices(2), split=["layer3"], schedule="1f1b", microbatches=microbatches)
    return fxpipe.Plan(
        devices=stage_devices(2), split=["layer2", "layer3", "layer4"], schedule="interleaved-1f1b",
        microbatches=microbatches, chunks=2,
    )


def main(argv: Sequence[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["1f1b", "interleaved-1f1b", "both"], default="both")
    add_training_options(parser, epochs=2, lr=0.02)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args(argv)
    limit_threads()

    data = load_digits(size=args.image_size, limit=200 if args.smoke else None)
    print(f"digits upsampled to {args.image_size}x{args.image_size}: {len(data.x_train)} train / {len(data.x_test)} test images")
    torch.manual_seed(0)
    model = digits_resnet18()
    options = training_options(args, smoke_steps=2)
    sgd = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9)  # noqa: E731
    schedules = ["1f1b", "interleaved-1f1b"] if args.schedule == "both" else [args.schedule]
    eager = train_eager("eager", model, stage_devices(2)[-1], args.microbatches, data, sgd, **options)
    runs = [eager]
    for schedule in schedules:
        plan = plan_for(schedule, args.microbatches)
        pipe, run = train_pipeline(schedule, copy.deepcopy(model), plan, data, sgd, **options)  # each from the same weights
        held = {d: [s.index for s in pipe.stages if s.device == d] for d in dict.fromkeys(s.device for s in pipe.stages)}
        print(f"\n{schedule}: {len(pipe.stages)} stages, {', '.join(f'{d} runs {s}' for d, s in held.items())}; "
              f"last step's bubble {pipe.timeline().bubble_fraction:.0%}")
        runs.append(run)

    epochs = range(len(eager.accuracies))
    print(f"\n{'run':<18}" + "".join(f"  {f'epoch {e + 1} loss':>12}  {'accuracy':>8}" for e in epochs) + "  time in steps")
    for run in runs:
        cells = "".join(f"  {run.epoch_loss(e):>12.4f}  {run.accuracies[e]:>8.2%}" for e in epochs)
        print(f"{run.label:<18}{cells}  {run.seconds:>10.1f} s")
    worst = 0.0
    for run in runs[1:]:
        diff = run.largest_difference(eager)
        worst = max(worst, diff)
        print(f"{run.label}: {len(run.losses)} steps, largest per-step loss difference to eager {diff:.2e}")
    if args.plot:
        plot_losses(runs, args.plot, "ResNet-18 on digits: pipelined and eager training loss")
        print(f"wrote {args.plot}")
    if worst > LOSS_TOLERANCE:
        raise SystemExit(f"pipelined losses differ from eager by {worst:.2e} (more than {LOSS_TOLERANCE})")
    return runs


if __name__ == "__main__":
    main()
