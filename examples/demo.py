"""fxpipe demo: ResNet-50 cut into pipeline stages, trained with 1F1B, checked against eager.

Runs on this machine's devices: one stage per GPU when CUDA is present, otherwise two
logical CPU devices. Prints the partition summary, one stage's generated code, a few
training steps with loss and step time, and the largest gradient difference to eager
PyTorch running the same micro-batches.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Sequence

import torch
import torchvision
from torch import nn

import fxpipe
from fxpipe.devices import torch_device


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Runs the demo; returns the first step's losses and largest gradient difference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="a batch of 4 at 32x32, 2 micro-batches, one step (for tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch, args.image_size, args.microbatches = 1, 4, 32, 2
    torch.manual_seed(0)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [f"cuda:{i}" for i in range(gpus)] if gpus >= 2 else ["cuda:0", "cuda:0"] if gpus == 1 else ["cpu:0", "cpu:1"]
    model = torchvision.models.resnet50(weights=None, num_classes=10)
    eager = copy.deepcopy(model).to(torch_device(devices[-1]))
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    target = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    plan = fxpipe.Plan(devices=devices, split=["layer3"], schedule="1f1b", microbatches=args.microbatches)
    start = time.perf_counter()
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=loss_fn)
    print(f"compiled in {time.perf_counter() - start:.1f} s\n")
    print(pipe.summary(), "\n")
    code = pipe.stages[1].module.code.strip().splitlines()
    print(f"stage 1's generated code ({len(code)} lines), first 12:")
    print("\n".join(code[:12]), "\n    ...\n")

    # one step checked against eager gradient accumulation over the same micro-batches
    loss = pipe.step(x, target=target)
    eager_loss = torch.zeros((), device=next(eager.parameters()).device)
    for xi, ti in zip(x.tensor_split(args.microbatches), target.tensor_split(args.microbatches)):
        piece = loss_fn(eager(xi.to(eager_loss.device)), ti.to(eager_loss.device)) * (len(xi) / len(x))
        piece.backward()
        eager_loss += piece.detach()
    reference = dict(eager.named_parameters())
    worst = max((p.grad - reference[n].grad.to(p.device)).abs().max().item() for n, p in pipe.named_parameters())
    first_loss = loss.item()
    print(f"loss: pipeline {first_loss:.6f}  eager {eager_loss.item():.6f}")
    print(f"largest gradient difference over {len(reference)} parameters: {worst:.2e}")
    if worst > 1e-4 or abs(loss.item() - eager_loss.item()) > 1e-4:
        raise SystemExit("gradients differ from eager")
    print("gradients equal eager's (to float tolerance)\n")

    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    opt.step()
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        start = time.perf_counter()
        loss = pipe.step(x, target=target)
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}  step time {time.perf_counter() - start:.2f} s")
    tl = pipe.timeline()
    print(f"\nmeasured last step: {tl.step_time:.2f} s, bubble fraction {tl.bubble_fraction:.0%}")
    return {"loss": first_loss, "eager_loss": eager_loss.item(), "grad_difference": worst}


if __name__ == "__main__":
    main()
