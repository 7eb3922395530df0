"""What the examples share: devices, the digits data, the models, the eager reference.

Every example imports this module (``from common import ...``; the examples folder is
on ``sys.path`` when a script in it runs). Nothing here is part of fxpipe's API.

- ``stage_devices(n)``, ``fallback_devices(tags)``: devices from
  ``torch.cuda.device_count()``, logical CPU devices without CUDA.
- ``load_digits``: scikit-learn's handwritten digits (they ship with the package), split
  into train and test, optionally upsampled to a larger square image.
- ``digits_resnet18``, ``DigitsCNN``, ``EmbeddingClassifier``: the models the examples train.
- ``eager_step``: eager PyTorch running the same micro-batches one after another, the
  reference every pipelined step is compared with.
- ``train_pipeline`` / ``train_eager``: the same training loop (``train``) over a
  pipeline or an eager model, fed the same batches, so their loss curves compare;
  ``add_training_options``, ``training_options`` and ``plot_losses`` for the scripts
  that train.
- ``reestimate_batchnorm``: BatchNorm statistics recomputed on given images.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxpipe
from fxpipe.devices import default_devices, torch_device

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


# ------------------------------------------------------------------- devices
def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def stage_devices(n: int) -> list[str]:
    """``n`` stage devices chosen from ``torch.cuda.device_count()``: one GPU each when
    there are enough, the GPUs in turn when fewer, logical CPUs ``cpu:0 … cpu:n-1``
    without CUDA."""
    return default_devices(n)


def fallback_devices(tags: Sequence[str]) -> list[str] | None:
    """Devices for a model tagged with ``tags`` (in stage order) on this machine: None
    (the tags' own devices) when every tagged GPU exists; the one GPU for every GPU tag
    when there is one; logical CPU devices ``cpu:0 … cpu:n-1`` without CUDA."""
    gpus = gpu_count()
    wanted = [int(t.split(":")[1]) for t in tags if t.startswith(("gpu", "cuda"))]
    if all(i < gpus for i in wanted):
        return None
    if gpus:
        return [t if t.startswith("cpu") else "cuda:0" for t in tags]
    return [f"cpu:{i}" for i in range(len(tags))]


def limit_threads() -> None:
    """One intra-op thread unless OMP_NUM_THREADS says otherwise: each logical CPU device
    ("cpu:N") is then one core, as each GPU is one device, and stage threads do not fight
    over a small shared machine (two OpenMP threads per op on two busy cores stall)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def synchronize() -> None:
    for i in range(gpu_count()):
        torch.cuda.synchronize(i)


# ---------------------------------------------------------------------- data
@dataclass
class Digits:
    """Train and test tensors: images ``(N, 1, size, size)`` in [-1, 1], labels ``(N,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(size: int = 8, test_fraction: float = 0.2, limit: int | None = None, seed: int = 0) -> Digits:
    """scikit-learn's 1,797 8x8 digits, shuffled with ``seed`` and split train/test.

    ``size`` > 8 upsamples bilinearly (a 32x32 digit fits an ImageNet-style ResNet's
    stride); ``limit`` keeps only the first samples (for smoke runs).
    """
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    if limit is not None:
        x, y = x[:limit], y[:limit]
    if size != x.shape[-1]:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    cut = len(x) - max(1, int(len(x) * test_fraction))
    return Digits(x[:cut], y[:cut], x[cut:], y[cut:])


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, epoch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled mini-batches, the same for every caller with the same epoch."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [(x[idx], y[idx]) for idx in order.split(batch_size)]


# -------------------------------------------------------------------- models
def digits_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with a one-channel stem, for (upsampled) digits."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digits: two convolutions, then a two-layer classifier."""

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class EmbeddingClassifier(nn.Module):
    """An embedding-heavy model: a large token table (most of the parameters, few FLOPs)
    feeding a compute-heavy MLP. ``device_guard`` keeps the table on the host CPU and
    tags the MLP for the first accelerator ("gpu:0", Paddle's alias of "cuda:0")."""

    def __init__(self, vocab: int = 200_000, dim: int = 64, hidden: int = 1024, depth: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layers: list[nn.Module] = [nn.Linear(dim, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.mlp = nn.Sequential(*layers, nn.Linear(hidden, num_classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with fxpipe.device_guard("cpu"):
            pooled = self.embed(tokens).mean(dim=1)
        with fxpipe.device_guard("gpu:0"):
            return self.mlp(pooled)


def random_tokens(batch: int, length: int, vocab: int, num_classes: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``(batch, length)`` and labels, from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen), torch.randint(0, num_classes, (batch,), generator=gen)


# ------------------------------------------------------------ eager reference
def eager_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor, loss_fn: LossFn, microbatches: int) -> torch.Tensor:
    """Eager gradient accumulation over the micro-batches a pipeline cuts ``x`` into.

    Each micro-batch's mean loss is weighted by its share of the batch, so the summed
    loss is the full batch's and the gradients are what one pipelined step gives.
    Returns the (detached) batch loss.
    """
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    for xi, ti in zip(x.tensor_split(microbatches), target.tensor_split(microbatches)):
        loss = loss_fn(model(xi.to(device)), ti.to(device)) * (len(xi) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def largest_grad_difference(pipe: Any, model: nn.Module) -> float:
    """The largest absolute difference between a pipeline's gradients and ``model``'s."""
    reference = dict(model.named_parameters())
    worst = 0.0
    for name, param in pipe.named_parameters():
        if param.grad is not None and reference[name].grad is not None:
            worst = max(worst, (param.grad.cpu() - reference[name].grad.cpu()).abs().max().item())
    return worst


@torch.no_grad()
def accuracy(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    """Share of ``x`` whose arg-max prediction equals ``y``."""
    correct = 0
    for xi, yi in zip(x.split(batch_size), y.split(batch_size)):
        correct += (forward(xi).argmax(dim=1).cpu() == yi).sum().item()
    return correct / len(x)


def progress(items: Iterable, desc: str, enabled: bool = True, total: int | None = None) -> Iterator:
    """A tqdm progress bar over ``items`` (plain iteration when disabled)."""
    if not enabled:
        return iter(items)
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True)


# ------------------------------------------------------------- training loops
@dataclass
class Run:
    """One training run: the loss of every step, the test accuracy after every epoch,
    the step count at the end of every epoch, and the seconds spent in steps."""

    label: str
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    epoch_ends: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def epoch_loss(self, epoch: int) -> float:
        """Mean training loss over the steps of ``epoch`` (0-based)."""
        start = self.epoch_ends[epoch - 1] if epoch else 0
        steps = self.losses[start : self.epoch_ends[epoch]]
        return sum(steps) / max(1, len(steps))

    def largest_difference(self, other: Run) -> float:
        """The largest per-step loss difference to ``other`` (the runs must be as long)."""
        if len(self.losses) != len(other.losses):
            raise ValueError(f"{self.label} ran {len(self.losses)} steps, {other.label} {len(other.losses)}")
        return max((abs(a - b) for a, b in zip(self.losses, other.losses)), default=0.0)


def eval_forward(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward in eval mode that puts ``module`` (a Pipeline or nn.Module) back in train mode."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        module.eval()
        try:
            if isinstance(module, nn.Module):
                x = x.to(next(module.parameters()).device)
            return module(x)
        finally:
            module.train()

    return forward


def reestimate_batchnorm(modules: Iterable[nn.Module], forward: Callable[[torch.Tensor], Any], images: torch.Tensor, batch_size: int) -> None:
    """Replace the running statistics of every BatchNorm in ``modules`` by their plain
    average over ``images``, fed through ``forward`` (a Pipeline or the model) in train
    mode; the layers keep cumulative averaging (``momentum=None``) afterwards."""
    norms = [m for module in modules for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    with torch.no_grad():
        for x in images.split(batch_size):
            forward(x)


def train(
    label: str,
    module: Any,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    data: Digits,
    epochs: int,
    batch_size: int,
    show_progress: bool = True,
    max_steps: int | None = None,
) -> Run:
    """Train with ``step(x, target) -> loss`` (which leaves the gradients in place) and
    ``optimizer`` on the shuffled training batches of every epoch; after each epoch
    measure ``module``'s test accuracy. Every caller sees the same batches in the same
    order, so a pipeline and its eager twin are fed alike. ``max_steps`` stops early."""
    run = Run(label)
    for epoch in range(epochs):
        bar = progress(batches(data.x_train, data.y_train, batch_size, epoch), f"{label}, epoch {epoch + 1}/{epochs}", show_progress)
        for x, t in bar:
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = step(x, t)
            optimizer.step()
            synchronize()
            run.seconds += time.perf_counter() - start
            run.losses.append(loss.item())
            if show_progress:
                bar.set_postfix(loss=f"{run.losses[-1]:.4f}")
            if max_steps is not None and len(run.losses) >= max_steps:
                break
        run.epoch_ends.append(len(run.losses))
        run.accuracies.append(accuracy(eval_forward(module), data.x_test, data.y_test))
        if max_steps is not None and len(run.losses) >= max_steps:
            break
    return run


def train_pipeline(label: str, model: nn.Module, plan: fxpipe.Plan, data: Digits, make_optimizer: OptimizerFactory, **options: Any) -> tuple[Any, Run]:
    """Compile ``model`` with ``plan`` (cross-entropy loss) and ``train`` it; returns
    (pipeline, Run). The pipeline's parameters are the model's: the model is trained."""
    loss_fn = nn.CrossEntropyLoss()
    batch = options.get("batch_size", 64)
    pipe = fxpipe.compile(model, plan, example_inputs=(data.x_train[:batch],), loss_fn=loss_fn)
    run = train(label, pipe, lambda x, t: pipe.step(x, target=t), make_optimizer(pipe.parameters()), data, **options)
    return pipe, run


def train_eager(label: str, model: nn.Module, device: str, microbatches: int, data: Digits, make_optimizer: OptimizerFactory, **options: Any) -> Run:
    """Train a copy of ``model`` on ``device`` in eager PyTorch, accumulating gradients
    over the same micro-batches a pipeline would (``eager_step``); returns the Run."""
    loss_fn = nn.CrossEntropyLoss()
    eager = copy.deepcopy(model).to(torch_device(device))
    return train(label, eager, lambda x, t: eager_step(eager, x, t, loss_fn, microbatches), make_optimizer(eager.parameters()), data, **options)


def add_training_options(parser: argparse.ArgumentParser, epochs: int, lr: float) -> None:
    """The options every training example takes: epochs, batch, micro-batches, learning
    rate, a loss-curve plot, no progress bar, and ``--smoke`` (a few steps, for tests)."""
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--plot", help="write the pipelined and eager loss curves to this PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a subset of the data (for tests)")


def training_options(args: argparse.Namespace, smoke_steps: int) -> dict[str, Any]:
    """``train``'s keyword arguments from ``add_training_options``' options: with
    ``--smoke``, one epoch cut after ``smoke_steps`` steps."""
    return dict(
        epochs=1 if args.smoke else args.epochs, batch_size=args.batch, show_progress=not args.no_progress,
        max_steps=smoke_steps if args.smoke else None,
    )


def plot_losses(runs: list[Run], path: str, title: str) -> None:
    """Per-step loss curves; the first run (eager) dotted on top of the pipelined ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    reference, *pipelined = runs
    for k, run in enumerate(pipelined):
        ax.plot(run.losses, color=f"C{k}", linewidth=4 - 1.5 * k, alpha=0.5, label=run.label)
    ax.plot(reference.losses, color="black", linestyle=(0, (1, 2)), linewidth=1, label=reference.label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
