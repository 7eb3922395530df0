"""device_guard pipelines: ResNet-50 over two GPUs, and an embedding table kept on the CPU.

PaddlePaddle's pipeline guide, rebuilt on fxpipe. The model's ``forward`` says where each
part runs with ``fxpipe.device_guard`` (a no-op in eager mode); fxpipe turns each
tagged block into a pipeline stage.

  --model resnet50     ResNet-50: stem, layer1 and layer2 under ``device_guard("gpu:0")``,
                       layer3, layer4 and the head under ``device_guard("gpu:1")``
  --model embedding    a 200,000-row embedding table under ``device_guard("cpu")`` (the
                       host's large memory) feeding an MLP under ``device_guard("gpu:0")``

With enough GPUs the tags' devices are used as written; with one GPU both GPU tags share
it; without CUDA every stage falls back to a logical CPU device (``cpu:0``, ``cpu:1``) via
``Plan(devices=...)``, which overrides the tags' devices. Trains on random data with
momentum SGD over micro-batches (GPipe by default, as Paddle's guide; one random batch,
used for every step), checks the first step's loss and gradients against eager PyTorch,
and prints the time of every step.

    .venv/bin/python examples/device_guard_resnet.py [--model resnet50|embedding] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Sequence

import torch
import torchvision
from common import (
    EmbeddingClassifier,
    eager_step,
    fallback_devices,
    largest_grad_difference,
    limit_threads,
    random_tokens,
    synchronize,
    torch_device,
)
from torch import nn
from torchvision.models.resnet import Bottleneck

import fxpipe

GRAD_TOLERANCE = 1e-4


class GuardedResNet50(torchvision.models.ResNet):
    """torchvision's ResNet-50 (same modules, same state_dict keys) with its forward in
    two ``device_guard`` blocks."""

    def __init__(self, num_classes: int = 1000, layers: Sequence[int] = (3, 4, 6, 3)) -> None:
        super().__init__(Bottleneck, list(layers), num_classes=num_classes)

    def _forward_impl(self, x: torch.Tensor) -> torch.Tensor:
        with fxpipe.device_guard("gpu:0"):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer2(self.layer1(x))
        with fxpipe.device_guard("gpu:1"):
            x = self.layer4(self.layer3(x))
            x = torch.flatten(self.avgpool(x), 1)
            return self.fc(x)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "embedding"], default="resnet50")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--image-size", type=int, default=64, help="resnet50: input images are SIZE x SIZE")
    parser.add_argument("--vocab", type=int, default=200_000, help="embedding: rows of the table")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch, two steps (for tests)")
    args = parser.parse_args(argv)
    limit_threads()
    torch.manual_seed(0)

    if args.model == "resnet50":
        tags = ["gpu:0", "gpu:1"]
        model = GuardedResNet50(num_classes=10, layers=(1, 1, 1, 1) if args.smoke else (3, 4, 6, 3))
        size = 32 if args.smoke else args.image_size
        x, target = torch.randn(args.batch, 3, size, size), torch.randint(0, 10, (args.batch,))
    else:
        tags = ["cpu", "gpu:0"]
        vocab = 1000 if args.smoke else args.vocab
        model = EmbeddingClassifier(vocab=vocab, hidden=64 if args.smoke else 1024)
        x, target = random_tokens(args.batch, 16, vocab)
    if args.smoke:
        args.steps = 2
    devices = fallback_devices(tags)
    where = f"CUDA absent or short of GPUs: the tags {tags} run on {devices}" if devices else f"running on the tags' devices {tags}"
    print(f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {where}")

    loss_fn = nn.CrossEntropyLoss()
    plan = fxpipe.Plan(devices=devices, split="tags", schedule=args.schedule, microbatches=args.microbatches)
    eager = copy.deepcopy(model)
    start = time.perf_counter()
    pipe = fxpipe.compile(model, plan, example_inputs=(x,), loss_fn=loss_fn)
    print(f"compiled in {time.perf_counter() - start:.1f} s\n")
    print(pipe.summary(), "\n")

    # the first step, checked against eager running the same micro-batches
    eager.to(torch_device(pipe.stages[-1].device))
    loss = pipe.step(x, target=target)
    eager_loss = eager_step(eager, x, target, loss_fn, args.microbatches)
    worst = largest_grad_difference(pipe, eager)
    print(f"first step: loss {loss.item():.6f} (eager {eager_loss.item():.6f}); largest gradient difference {worst:.2e}")
    if worst > GRAD_TOLERANCE or abs(loss.item() - eager_loss.item()) > GRAD_TOLERANCE:
        raise SystemExit("the pipeline's gradients differ from eager's")

    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    opt.step()
    times = []
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        start = time.perf_counter()
        loss = pipe.step(x, target=target)
        opt.step()
        synchronize()
        times.append(time.perf_counter() - start)
        print(f"step {step}: loss {loss.item():.4f}  {times[-1]:.3f} s  ({args.batch / times[-1]:.0f} samples/s)")
    tl = pipe.timeline()
    best = min(times)
    print(f"\nfastest step {best:.3f} s ({args.batch / best:.0f} samples/s); last step's bubble {tl.bubble_fraction:.0%}")
    return {"first_loss": loss.item(), "grad_difference": worst, "fastest_step": best}


if __name__ == "__main__":
    main()
