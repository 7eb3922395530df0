"""Exact loss normalisation: a step's mean is the step's sum over the step's count.

A mean-reduced loss divides a sum by a count: the number of target tokens that are not
``ignore_index`` (or their class weights) for ``cross_entropy`` and ``nll_loss``, the
number of elements for ``mse_loss`` and the other element-wise losses, the batch for
``kl_div(reduction="batchmean")``. Weighting each micro-batch's mean by its share of the
samples gives the full-batch value only when every sample counts the same; with padding
it does not (the gradient-accumulation bug of padded fine-tuning). So while a step runs,
every call of a known reduced loss is replaced by its *sum* times a factor that turns the
per-sample weighting the step applies afterwards into sum / (the step's count):

    micro-batch i's term = sum_i * total / (n_i * count)      (weighted by n_i / total)

``count`` is counted before the first backward, over every micro-batch of every replica,
from the targets alone: for a ``loss_fn`` by running it on meta copies of the output with
the real targets (:func:`count_calls`; the first micro-batch's output resized, or, for
micro-batches of different shapes, each one's output from a fake run of the model), for a
model's own loss by running the part of the graph that computes the loss's target from the
model's inputs (``fxpipe.passes.input_slice``).
Terms a loss adds outside these calls (``out.pow(2).mean()``) keep the per-sample weighting.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fxpipe.batching import microbatch

aten = torch.ops.aten
_ENUM = {0: None, 1: "mean", 2: "sum"}  # at::Reduction


@dataclass(frozen=True)
class LossRule:
    """How one loss function reduces: its parameters in order (positional, then keyword-only),
    how its ``reduction`` is spelled (a string, or at::Reduction's int in aten ops) and
    what its mean divides by (``kind``: "class" indices/probabilities, "elementwise", "kl")."""

    names: tuple[str, ...]
    keyword_only: frozenset[str]
    defaults: dict[str, Any]
    kind: str
    enum: bool

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = dict(self.defaults)
        bound.update(zip(self.names, args))
        bound.update(kwargs)
        return bound

    def reduction(self, bound: dict[str, Any]) -> str | None:
        """"mean", "sum", "batchmean" or None (not reduced, or the deprecated
        size_average/reduce arguments: left alone)."""
        if bound.get("size_average") is not None or bound.get("reduce") is not None:
            return None
        r = bound.get("reduction", "mean")
        return _ENUM.get(r) if self.enum else r if r in ("mean", "sum", "batchmean") else None

    def count(self, bound: dict[str, Any]) -> float:
        """What a mean of this call divides by, from its target (and weight, input shape)."""
        target = bound["target"]
        if self.kind == "kl" and bound.get("reduction") == "batchmean":
            return float(bound["input"].shape[0]) if "input" in bound else float(target.shape[0])
        if self.kind == "class" and not target.is_floating_point():
            keep = target != bound.get("ignore_index", -100)
            weight = bound.get("weight")
            if weight is None:
                return float(keep.sum())
            return float((weight.to(target.device)[torch.where(keep, target, 0)] * keep).sum())
        if self.kind == "class":  # class probabilities: a mean over the samples (and extra dims)
            return float(target.numel() // target.shape[1]) if target.dim() > 1 else 1.0
        first = bound.get("input", bound.get("self"))
        if isinstance(first, torch.Tensor):
            return float(torch.broadcast_shapes(first.shape, target.shape).numel())
        return float(target.numel())

    def summed(self, func: Callable, bound: dict[str, Any]) -> torch.Tensor:
        """The call with ``reduction`` set to sum."""
        bound = dict(bound, reduction=2 if self.enum else "sum")
        args = [bound[n] for n in self.names if n not in self.keyword_only]
        return func(*args, **{n: bound[n] for n in self.keyword_only if n in bound})


def _python_rule(func: Callable, kind: str) -> LossRule:
    params = inspect.signature(func).parameters.values()
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    keyword_only = frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
    return LossRule(names, keyword_only, defaults, kind, enum=False)


def _aten_rule(op: Any, kind: str) -> LossRule:
    arguments = op._schema.arguments
    names = tuple("target" if a.name == "target" else "input" if a.name == "self" else a.name for a in arguments)
    defaults = {n: a.default_value for n, a in zip(names, arguments) if a.has_default_value()}
    keyword_only = frozenset(n for n, a in zip(names, arguments) if a.kwarg_only)
    return LossRule(names, keyword_only, defaults, kind, enum=True)


def _rules() -> dict[Any, LossRule]:
    rules: dict[Any, LossRule] = {}
    for func, kind in [
        (F.cross_entropy, "class"), (F.nll_loss, "class"), (F.mse_loss, "elementwise"), (F.l1_loss, "elementwise"),
        (F.smooth_l1_loss, "elementwise"), (F.huber_loss, "elementwise"), (F.binary_cross_entropy, "elementwise"),
        (F.binary_cross_entropy_with_logits, "elementwise"), (F.soft_margin_loss, "elementwise"), (F.kl_div, "kl"),
    ]:
        rules[func] = _python_rule(func, kind)
    for name, kind in [
        ("cross_entropy_loss", "class"), ("nll_loss", "class"), ("nll_loss_nd", "class"), ("mse_loss", "elementwise"),
        ("l1_loss", "elementwise"), ("smooth_l1_loss", "elementwise"), ("huber_loss", "elementwise"),
        ("binary_cross_entropy", "elementwise"), ("binary_cross_entropy_with_logits", "elementwise"),
        ("soft_margin_loss", "elementwise"), ("kl_div", "kl"),
    ]:
        packet = getattr(aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            rules[packet.default] = _aten_rule(packet.default, kind)
    return rules


RULES = _rules()


def rule_of(target: Any) -> LossRule | None:
    """The rule of a graph node's or a call's target, None for anything else."""
    try:
        return RULES.get(target)
    except TypeError:  # unhashable targets are no loss
        return None


class _LossCalls(TorchFunctionMode):
    """Hands every reduced call of a known loss to ``on_call(rule, func, bound)``.

    meta_mixed: any other call that mixes meta tensors with real ones runs on meta copies
    of the real ones (counting runs a loss on a meta output and real targets: ``out - t``
    is a meta value, while a target that only the target makes stays real)."""

    def __init__(self, on_call: Callable[[LossRule, Callable, dict], torch.Tensor], meta_mixed: bool = False) -> None:
        super().__init__()
        self.on_call = on_call
        self.meta_mixed = meta_mixed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = rule_of(func)
        if rule is not None:
            bound = rule.bind(args, kwargs)
            if rule.reduction(bound) is not None:
                return self.on_call(rule, func, bound)
        if self.meta_mixed:
            args, kwargs = _all_meta_if_mixed(args, kwargs)
        return func(*args, **kwargs)


def _all_meta_if_mixed(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.is_meta for t in tensors) or all(t.is_meta for t in tensors):
        return args, kwargs
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_meta else t.to("meta"), (args, kwargs))


class NormalisationError(RuntimeError):
    """A step's loss calls differ from the ones counted before it ran."""


@dataclass
class StepCounts:
    """Per loss call of a step (in call order): its reduction and its count over the whole
    step (every micro-batch of every replica). ``total``: the step's samples."""

    reductions: list[str]
    counts: list[float]
    total: int

    def scaled(self, size: int) -> contextlib.AbstractContextManager:
        """A context in which a micro-batch of ``size`` samples computes its loss terms as
        sum × total / (size × count): weighted by size / total, they sum to the step's mean."""
        calls = itertools.count()

        def on_call(rule: LossRule, func: Callable, bound: dict) -> torch.Tensor:
            k = next(calls)
            reduction = rule.reduction(bound)
            if k >= len(self.counts) or self.reductions[k] != reduction:
                raise NormalisationError(
                    f"loss call {k + 1} ({getattr(func, '__name__', func)}, reduction={reduction!r}) was not among the "
                    f"{len(self.counts)} loss calls counted before the step ({self.reductions}): the loss must make "
                    "the same calls for every micro-batch"
                )
            divide = 1.0 if reduction == "sum" else self.counts[k]
            return rule.summed(func, bound) * (self.total / (size * divide))

        return _LossCalls(on_call)


def count_calls(run: Callable[[], Any]) -> tuple[list[str], list[float]]:
    """Run ``run()`` with every known loss call counted instead of computed (it returns a
    zero on the meta device); returns (reductions, counts) in call order."""
    reductions: list[str] = []
    counts: list[float] = []

    def on_call(rule: LossRule, func: Callable, bound: dict) -> torch.Tensor:
        reductions.append(rule.reduction(bound))
        counts.append(rule.count(bound))
        return torch.zeros((), device="meta")

    with torch.no_grad(), _LossCalls(on_call, meta_mixed=True):
        run()
    return reductions, counts


@dataclass
class ModelLosses:
    """The reduced loss calls a model's last stage makes, in graph (= call) order, and how
    to count them before the step: ``targets(*model_inputs)`` returns (target, weight) of
    every call, computed from the inputs alone; ``calls`` holds each call's rule and its
    constant arguments."""

    calls: list[tuple[LossRule, dict[str, Any]]]
    targets: Callable[..., tuple]

    def count(self, flat_inputs: Sequence[Any]) -> tuple[list[str], list[float]]:
        """(reductions, counts) of one micro-batch's loss calls."""
        values = self.targets(*flat_inputs)
        reductions, counts = [], []
        for k, (rule, constants) in enumerate(self.calls):
            bound = dict(constants, target=values[2 * k], weight=values[2 * k + 1])
            reductions.append(rule.reduction(bound))
            counts.append(rule.count(bound))
        return reductions, counts


def model_losses(nodes: Sequence[Any], slicer: Callable[[list], Callable[..., tuple] | None]) -> ModelLosses | None:
    """The ModelLosses of a last stage's graph ``nodes``: None when it makes no reduced loss
    call, or one whose reduction is not a constant or whose target is not a function of
    the model's inputs (``slicer(values)`` returns None)."""
    calls, values = [], []
    for node in nodes:
        rule = rule_of(node.target) if node.op == "call_function" else None
        if rule is None:
            continue
        bound = rule.bind(node.args, node.kwargs)
        if isinstance(bound.get("reduction"), torch.fx.Node):
            return None
        if rule.reduction(bound) is None:
            continue
        values += [bound.get("target"), bound.get("weight")]
        calls.append((rule, {k: v for k, v in bound.items() if not isinstance(v, torch.fx.Node)}))
    if not calls:
        return None
    targets = slicer(values)
    return ModelLosses(calls, targets) if targets is not None else None


def meta_like(value: Any, rows: int, size: int) -> Any:
    """``value`` with every tensor on the meta device, dim 0 of ``rows`` made ``size``."""

    def one(t: torch.Tensor) -> torch.Tensor:
        shape = (size, *t.shape[1:]) if t.dim() > 0 and t.shape[0] == rows else tuple(t.shape)
        return torch.empty(shape, dtype=t.dtype, device="meta")

    return pytree.tree_map_only(torch.Tensor, one, value)


def add_counts(parts: Iterator[tuple[list[str], list[float]]], total: int) -> StepCounts | None:
    """The step's counts from each micro-batch's (reductions, counts); None when no loss
    call was found. Raises NormalisationError when micro-batches make different calls."""
    reductions: list[str] | None = None
    counts: list[float] = []
    for i, (r, c) in enumerate(parts):
        if reductions is None:
            reductions, counts = r, list(c)
        elif r != reductions:
            raise NormalisationError(f"micro-batch {i} makes the loss calls {r}, micro-batch 0 makes {reductions}")
        else:
            counts = [a + b for a, b in zip(counts, c)]
    if not reductions:
        return None
    return StepCounts(reductions, counts, total)


def fallback_message(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (
        f"fxpipe: the loss's normalisation over the step could not be counted ({type(err).__name__}: "
        f"{text[0] if text else ''}); each micro-batch's loss is weighted by its share of the samples, which "
        "equals the full-batch loss only when every sample counts alike (no ignore_index padding, no class "
        "weights). See docs/training-loop.md, 'How losses are normalised'"
    )


Counter = Callable[[Any, int], StepCounts | None]
"""Counts a step's loss calls from one micro-batch's output (and its rows), when it exists."""


def step_loss(
    loss_fn: Any,
    build_output: Callable[[int, Any], Any],
    targets: list[Any],
    sizes: list[int],
    total: int,
    scale: float,
    counts: StepCounts | Counter | None,
) -> Callable[[int, Any], torch.Tensor]:
    """``loss_of(i, stage_output)``: micro-batch i's term of the step's loss.

    ``build_output(i, out)``: what the model returns from micro-batch i's last-stage
    output; ``targets``/``sizes``: this process's micro-batches; ``total``: the step's
    samples; ``scale``: the replicas (their gradients are averaged). ``counts``: the
    step's counts (without ``loss_fn``: the model's own loss calls, scaled in its last
    stage already, so their terms are only weighted by size / total), a :data:`Counter`
    run on the first micro-batch's output, or None: each micro-batch's loss weighted by
    its share of the samples (exact when every sample counts alike).
    """
    per_sample = microbatch.weighted_loss(loss_fn, build_output, targets, microbatch.loss_weights(sizes, loss_fn, total, scale))
    by_share = microbatch.weighted_loss(loss_fn, build_output, targets, [scale * n / total for n in sizes])
    if counts is None:
        return per_sample
    if loss_fn is None:
        return by_share
    state: dict[str, StepCounts | None] = {}

    def loss_of(i: int, out: Any) -> torch.Tensor:
        if "counts" not in state:
            state["counts"] = counts if isinstance(counts, StepCounts) else counts(build_output(i, out), sizes[i])
        known = state["counts"]
        if known is None:
            return per_sample(i, out)
        with known.scaled(sizes[i]):
            return by_share(i, out)

    return loss_of


def count_loss_fn(loss_fn: Any, cases: Iterable[tuple[Any, Any]], total: int) -> StepCounts | None:
    """The step's counts of ``loss_fn``'s reduced loss calls, from (a micro-batch's output
    as meta tensors, its real target) per micro-batch of the step; None when it makes none.
    Raises what ``loss_fn`` raises on them, and NormalisationError when micro-batches make
    different calls."""
    return add_counts((count_calls(lambda out=out, t=t: loss_fn(out, t)) for out, t in cases), total)


__all__ = ["Counter", "LossRule", "ModelLosses", "model_losses", "NormalisationError", "RULES", "StepCounts", "add_counts", "count_calls", "count_loss_fn", "meta_like", "rule_of", "step_loss"]
