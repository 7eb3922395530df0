"""Micro-batches: cut the batch along dim 0, and put outputs back together.

A batch of N samples cut into m micro-batches gets sizes as even as possible
(10 into 4 → 3, 3, 2, 2). Tensors whose dim 0 equals N are cut, inside registered pytrees
too (a dataclass or NamedTuple mask is cut leaf by leaf); everything else (non-tensor
arguments, tensors of another leading size, 0-d tensors) is passed whole to every
micro-batch. An object fxpipe cannot look into (not a registered pytree) that holds
batch-sized tensors is an error: passed whole, every micro-batch would see the whole
batch's. A step's target is cut the same way, and must be batch-sized.

A step may instead be given its micro-batches as a list (``pipe.step(microbatches=[...])``):
each entry one micro-batch's arguments, of any sizes. :func:`listed_calls` checks that
the entries agree on everything but sizes and the contexts of registered pytree classes (a
mask's ``seq_len``), which a signature of their own serves (:func:`argument_structure`).

Outputs are put back together by what they are, decided at compile time: an output
whose dim 0 follows the input batch (``fxpipe.batching.batched_outputs``) is concatenated; any
other tensor output (a 0-d auxiliary loss, per-layer statistics) is merged only as
``Plan(output_merge={path: "cat" | "stack" | "sum" | "mean"})`` says. An output's
*path* names it inside the model's return value: tuple or list indices, dict keys and
namedtuple fields joined by dots ("1", "aux", "0.aux"); a bare tensor's path is "".
"""

from __future__ import annotations

import inspect
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

MERGE_MODES = ("cat", "stack", "sum", "mean")


class MicrobatchError(ValueError):
    """The batch cannot be cut, or the outputs merged, as the plan asks."""


class LossFunctionError(TypeError):
    """``loss_fn`` cannot take the model's output as it is; the message says what to pass."""


def batch_size(values: Any) -> int | None:
    """The leading size of the first tensor with at least one dimension, or None."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def split_sizes(n: int, m: int) -> list[int]:
    """Sizes of m micro-batches of an n-sample batch, as even as possible, larger first."""
    if m > n:
        raise MicrobatchError(
            f"plan.microbatches = {m} but the batch has only {n} samples; use at most {n} "
            "micro-batches (Plan(microbatches=...)) or a larger batch"
        )
    return [n // m + (1 if i < n % m else 0) for i in range(m)]


def split(values: Any, m: int) -> tuple[list[Any], list[int]]:
    """Cut every batch-sized tensor in ``values`` (any pytree) into m micro-batches.

    Returns (one pytree per micro-batch, their sizes). Raises MicrobatchError when there
    are fewer samples than micro-batches or no tensor to cut.
    """
    n = batch_size(values)
    if n is None:
        if m == 1:
            return [values], [1]
        raise MicrobatchError("no tensor input with a batch dimension to cut into micro-batches; use Plan(microbatches=1)")
    sizes = split_sizes(n, m)
    leaves, spec = pytree.tree_flatten(values)
    columns = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n:
            columns.append(list(torch.split(leaf, sizes)))
        else:
            columns.append([leaf] * m)
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(m)], sizes


def first_rows(values: Any, n: int, rows: int) -> Any:
    """``values`` (any pytree) with every tensor of batch size ``n`` cut to its first ``rows``
    samples: a call the size of one of its micro-batches."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:rows] if t.dim() > 0 and t.shape[0] == n else t, values)


def split_step(inputs: Any, target: Any, m: int) -> tuple[list[Any], list[Any], list[int]]:
    """Cut a training step's inputs and target into m micro-batches.

    Returns (inputs per micro-batch, target per micro-batch, sizes). Every tensor of the
    target with a dim 0 must have the inputs' batch size: target row i belongs to sample
    i. Raises MicrobatchError naming the target tensor and both sizes when it does not,
    and what :func:`split` raises.
    """
    n = batch_size(inputs)
    if n is not None:
        for path, leaf in leaves_with_paths(target):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != n:
                where = "target" + "".join(_accessor(path))
                raise MicrobatchError(
                    f"{where} has {leaf.shape[0]} samples (shape {tuple(leaf.shape)}) but the inputs have "
                    f"{n}: pass one target row per input sample (target[i] belongs to sample i). A tensor "
                    "that is the same for every sample belongs in loss_fn (a closure), not in target"
                )
    pieces, sizes = split((inputs, target), m)
    return [p[0] for p in pieces], [p[1] for p in pieces], sizes


def tensors_inside(value: Any) -> list[torch.Tensor]:
    """The tensors an object that is no tensor and no registered pytree holds in its
    attributes (one level deep, and inside tuples, lists and dicts there): what passing it
    whole would hand every micro-batch, or what a message between ranks cannot carry."""
    if isinstance(value, torch.Tensor | nn.Module | type) or not hasattr(value, "__dict__"):
        return []
    found = []
    for attribute in vars(value).values():
        found += [t for t in pytree.tree_leaves(attribute) if isinstance(t, torch.Tensor)]
    return found


def check_cuttable(values: Any, m: int) -> None:
    """Raise MicrobatchError when an object in ``values`` (a call's arguments) that is no
    tensor and no registered pytree holds tensors of the batch's size and the batch is cut
    into ``m`` > 1 micro-batches: passed whole, every micro-batch would see the whole batch's."""
    n = batch_size(values)
    if m > 1 and n is not None:
        for leaf in pytree.tree_leaves(values):
            _check_cuttable(leaf, n)


def _check_cuttable(value: Any, n: int) -> None:
    batched = [t for t in tensors_inside(value) if t.dim() > 0 and t.shape[0] == n]
    if batched:
        kind = type(value).__name__
        raise MicrobatchError(
            f"an input of type {kind} holds tensors of the batch's size {n} (shape {tuple(batched[0].shape)}), but it is "
            f"not a registered pytree, so fxpipe cannot cut it: every micro-batch would see the whole batch's. Register "
            f"it (torch.utils._pytree.register_dataclass({kind}), or register_pytree_node), or build one per "
            "micro-batch and pass pipe.step(microbatches=[...])"
        )


# ------------------------------------------------------------------ micro-batch lists
def listed_calls(entries: Any, targets: Any, forward: Any) -> tuple[list[tuple[tuple, dict]], list[Any]]:
    """The micro-batches of ``pipe.step(microbatches=entries, targets=targets)``.

    Each entry is one micro-batch's positional arguments (a tuple), keyword arguments (a
    dict) or its single tensor argument; ``forward`` is the model's forward, to bind them.
    Returns ((args, kwargs) per micro-batch, one target per micro-batch: None each when
    ``targets`` is None). Raises MicrobatchError for an empty list, an entry of another
    kind, a targets list of another length, or entries whose arguments differ in anything
    but sizes and registered classes' contexts (naming the micro-batch and the argument).
    """
    if not isinstance(entries, list | tuple) or not entries:
        raise MicrobatchError(
            f"microbatches= must be a non-empty list of micro-batches (got {describe(entries)}): one entry per "
            "micro-batch, each a tuple of positional arguments, a dict of keyword arguments or a tensor"
        )
    calls = [_call_of(i, entry) for i, entry in enumerate(entries)]
    if targets is None:
        targets = [None] * len(calls)
    elif not isinstance(targets, list | tuple) or len(targets) != len(calls):
        count = f"has {len(targets)} entries" if isinstance(targets, list | tuple) else f"is of type {type(targets).__name__}"
        raise MicrobatchError(
            f"targets= {count} but microbatches= has {len(calls)}: pass a list with one target per micro-batch "
            "(targets[i] is scored against micro-batch i's output)"
        )
    signature = inspect.signature(forward)
    first = argument_structure(signature, 0, *calls[0])
    for i, call in enumerate(calls[1:], start=1):
        differences = [f"{name}: {a} -> {b}" for name, a, b in _paired(first, argument_structure(signature, i, *call))]
        if differences:
            raise MicrobatchError(
                f"micro-batch {i} passes other arguments than micro-batch 0 ({'; '.join(differences)}): the entries of "
                "microbatches= may differ in their tensors' sizes (sequence length, batch size) and in the Python values "
                "a registered pytree class keeps in its context (a mask's seq_len: traced once per value), not in which "
                "arguments are given, their dtypes, ranks, containers, children or constants; run the others in a step of their own"
            )
    return calls, list(targets)


def _call_of(i: int, entry: Any) -> tuple[tuple, dict]:
    if isinstance(entry, torch.Tensor):
        return (entry,), {}
    if isinstance(entry, tuple):
        return entry, {}
    if isinstance(entry, Mapping):
        return (), dict(entry)
    raise MicrobatchError(
        f"microbatches[{i}] is of type {type(entry).__name__}: pass each micro-batch as a tuple of positional "
        "arguments, a dict of keyword arguments, or a single tensor"
    )


def argument_structure(signature: inspect.Signature, i: int, args: tuple, kwargs: dict) -> dict[str, tuple[str, str]]:
    """Micro-batch ``i``'s arguments bound to the forward's ``signature`` (defaults applied),
    each described without its sizes: (what to show, ``int64[*, *]``, ``None``,
    ``DocumentMask(int64[*, *], 0)``; what to compare, the pytree structure too). Raises
    MicrobatchError when they do not fit the forward."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise MicrobatchError(f"microbatches[{i}] does not fit the model's forward{signature}: {err}") from None
    bound.apply_defaults()
    return {name: _shape_free(value) for name, value in bound.arguments.items()}


def _shape_free(value: Any) -> tuple[str, str]:
    leaves, spec = pytree.tree_flatten(value)
    described = [
        f"{str(t.dtype).replace('torch.', '')}[{', '.join('*' * t.dim())}]" if isinstance(t, torch.Tensor) else repr(t)
        for t in leaves
    ]
    return _rendered(spec, iter(described)), f"{_context_free(spec)} {described}"


# containers whose context is part of what they hold (dict keys, a NamedTuple's class,
# a deque's maxlen): a different context is a different container
_CONTEXT_IS_STRUCTURE = (dict, OrderedDict, defaultdict, deque)


def _context_free(spec: pytree.TreeSpec) -> str:
    """The pytree structure, without the context of registered classes: the Python values
    a class keeps beside its children (a BlockMask's sequence lengths) are traced as
    constants, so a micro-batch whose context differs gets a signature (a trace) of its own."""
    if spec.is_leaf():
        return "*"
    keep = issubclass(spec.type, _CONTEXT_IS_STRUCTURE) or pytree.is_namedtuple_class(spec.type)
    context = f"{spec.context!r}" if keep else ""
    return f"{spec.type.__qualname__}{context}({', '.join(_context_free(c) for c in spec.children())})"


def _rendered(spec: pytree.TreeSpec, leaves: Iterator[str]) -> str:
    if spec.is_leaf():
        return next(leaves)
    children = [_rendered(child, leaves) for child in spec.children()]
    if spec.type is dict:
        return "{" + ", ".join(f"{k!r}: {c}" for k, c in zip(spec.context, children)) + "}"
    if spec.type is type(None):
        return "None"
    return f"{spec.type.__name__}({', '.join(children)})"


def _paired(first: dict[str, tuple[str, str]], other: dict[str, tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(argument, micro-batch 0's, the other's) for every argument whose structure differs."""
    absent = ("absent", "absent")
    pairs = [(name, first.get(name, absent), other.get(name, absent)) for name in {**first, **other}]
    return [(name, a[0], b[0]) for name, a, b in pairs if a[1] != b[1]]


# ------------------------------------------------------------------ output paths
def leaves_with_paths(tree: Any) -> list[tuple[tuple, Any]]:
    """(key path, leaf) for every leaf, in ``pytree.tree_leaves`` order."""
    try:
        return pytree.tree_flatten_with_path(tree)[0]
    except ValueError:  # a container registered without key paths: number its children
        leaves, spec = pytree.tree_flatten(tree)
        return list(zip(_index_paths(spec), leaves))


def _index_paths(spec: pytree.TreeSpec, prefix: tuple = ()) -> list[tuple]:
    if spec.is_leaf():
        return [prefix]
    return [p for i, child in enumerate(spec.children()) for p in _index_paths(child, (*prefix, pytree.SequenceKey(i)))]


def _name(entry: Any) -> str:
    for field in ("key", "idx", "name"):
        if hasattr(entry, field):
            return str(getattr(entry, field))
    return str(entry)


def path_of(key_path: tuple) -> str:
    """The dotted name of an output leaf ("0.aux"; "" for the output itself)."""
    return ".".join(_name(entry) for entry in key_path)


def _accessor(key_path: tuple) -> list[str]:
    """Python that reaches a leaf: ``[0]``, ``['aux']``, ``.logits``."""
    parts = []
    for entry in key_path:
        if isinstance(entry, pytree.GetAttrKey):
            parts.append(f".{entry.name}")
        elif isinstance(entry, pytree.MappingKey):
            parts.append(f"[{entry.key!r}]")
        else:
            parts.append(f"[{_name(entry)}]")
    return parts


def _label(path: str) -> str:
    return f"output {path!r}" if path else "the output"


def describe(value: Any) -> str:
    """A short structural description: ``tuple (Tensor[4, 2], Tensor[])``."""

    def inner(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor{list(v.shape)}"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k!r}: {inner(x)}" for k, x in v.items()) + "}"
        if isinstance(v, tuple | list):
            body = ", ".join(inner(x) for x in v)
            return f"[{body}]" if isinstance(v, list) else f"({body})"
        return type(v).__name__

    return f"{type(value).__name__} {inner(value)}"


def describe_tensor(t: torch.Tensor) -> str:
    """``float16[8, 3, 64, 64]``: a tensor's dtype and shape, as messages name an input."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def signature(value: Any) -> tuple:
    """A hashable description of a micro-batch's inputs: shapes and dtypes, constants as is."""
    leaves, spec = pytree.tree_flatten(value)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("T", tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        else:
            parts.append(("C", repr(leaf)))
    return (str(spec), tuple(parts))


def structure(values: Any) -> tuple:
    """What the batch dimension of outputs can depend on, without the sizes themselves:
    the pytree structure, each tensor's rank and dtype, and the other values as they are."""
    leaves, spec = pytree.tree_flatten(values)
    return (str(spec), tuple((t.dim(), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves))


def check_output_merge(output_merge: Mapping[str, str], batched: Mapping[str, bool]) -> None:
    """Raise MicrobatchError when ``output_merge`` names a path that is no tensor output
    (``batched`` lists them; nothing is checked when it is empty: unknown)."""
    unknown = sorted(set(output_merge) - set(batched))
    if batched and unknown:
        known = ", ".join(repr(p) for p in batched)
        raise MicrobatchError(f"plan.output_merge names {unknown}, but the model's tensor outputs are {known}")


# ------------------------------------------------------------------ merging
def unbatched_paths(output: Any, output_inputs: list[frozenset[int]] | None, flat_inputs: list) -> frozenset[str]:
    """The paths of ``output``'s leaves that depend on no input cut into micro-batches
    (``output_inputs``: per leaf, the flat input positions it reads, from the graph): the
    same in every micro-batch, so returned once."""
    leaves = leaves_with_paths(output)
    if output_inputs is None or len(output_inputs) != len(leaves):
        return frozenset()
    n = batch_size(flat_inputs)
    cut = {
        k for k, value in enumerate(flat_inputs)
        if any(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n for t in pytree.tree_leaves(value))
    }
    return frozenset(path_of(key_path) for (key_path, _), reads in zip(leaves, output_inputs) if not reads & cut)


def merge(
    outputs: list[Any],
    sizes: list[int] | None = None,
    batched: Mapping[str, bool] | None = None,
    output_merge: Mapping[str, str] | None = None,
    once: frozenset[str] = frozenset(),
    own_loss: list[float] | None = None,
    batch_lists: bool = False,
) -> Any:
    """Put micro-batch outputs (of the model's structure) back together.

    batch_lists: the program iterated over the batch (``Partitioned.batch_lengths``), so a
    list output may hold one entry per sample (Llava's ``image_outputs.pooler_output``): a
    list as long as its micro-batch in every micro-batch is joined into one list.

    own_loss: the weights of each micro-batch's ``loss`` output (a model's own scalar loss)
    in the step's loss (its token counts' shares): that output is merged as their weighted sum.

    sizes: the micro-batch sizes ("mean" weights by them); batched: from
    :func:`batched_outputs`, at compile time; output_merge: ``Plan.output_merge``.
    A tensor with an ``output_merge`` entry is merged as it says ("cat" along dim 0,
    "stack" on a new dim 0, "sum", or "mean": the micro-batch values weighted by their
    sizes, so a mean-reduced loss equals its full-batch value); other batched tensors are
    concatenated along dim 0. Tensors in ``once`` (they depend on no input that was cut,
    :func:`unbatched_paths`) are returned once, from the first micro-batch. Leaves that
    are not tensors are kept from the first micro-batch when all agree, and returned as a
    list otherwise. ``batched=None`` (no
    compile-time answer) concatenates every tensor with a dim 0, as before.

    Raises MicrobatchError for a tensor output that is not batched and has no
    ``output_merge`` entry when there are several micro-batches, naming its path and the
    option.
    """
    output_merge = output_merge or {}
    if len(outputs) == 1 and not output_merge:
        return outputs[0]
    if batch_lists and sizes is not None:
        outputs = [_rows_marked(o, n) for o, n in zip(outputs, sizes)]
    flat = [leaves_with_paths(o) for o in outputs]
    spec = pytree.tree_structure(outputs[0])
    merged = []
    for column in zip(*flat):
        values = [leaf for _, leaf in column]
        path = path_of(column[0][0])
        if isinstance(values[0], _Rows) and all(isinstance(v, _Rows) for v in values):
            merged.append([item for v in values for item in v.items])
        elif own_loss is not None and path == "loss" and path not in output_merge and isinstance(values[0], torch.Tensor) and values[0].dim() == 0:
            merged.append(sum(v.to(values[0].device) * w for v, w in zip(values, own_loss)))
        elif path in once and path not in output_merge and isinstance(values[0], torch.Tensor) and not (batched or {}).get(path, False):
            merged.append(values[0])
        else:
            merged.append(_merge_leaf(path, values, sizes, batched, output_merge))
    return pytree.tree_unflatten(merged, spec)


class _Rows:
    """A list output with one entry per sample of its micro-batch (a leaf while merging)."""

    def __init__(self, items: list) -> None:
        self.items = items


def _rows_marked(output: Any, rows: int) -> Any:
    """``output`` with every list of ``rows`` entries held as one :class:`_Rows` leaf."""
    return pytree.tree_map(lambda x: _Rows(x) if type(x) is list and len(x) == rows else x, output, is_leaf=lambda x: type(x) is list and len(x) == rows)


def _merge_leaf(path: str, values: list[Any], sizes: list[int] | None, batched: Mapping[str, bool] | None, output_merge: Mapping[str, str]) -> Any:
    first = values[0]
    mode = output_merge.get(path)
    if mode is None and isinstance(first, torch.Tensor):
        if batched is None:
            mode = "cat" if first.dim() > 0 else None
        elif batched.get(path, False):
            mode = "cat"
        elif len(values) > 1:
            known = "does not follow the batch" if path in batched else "was not known at compile time to follow the batch"
            fit = "cat" if _rows_follow(values, sizes) else "mean"
            others = ", ".join(repr(m) for m in ("cat", "stack", "sum", "mean") if m != fit)
            raise MicrobatchError(
                f"{_label(path)} is a tensor of shape {tuple(first.shape)} whose dim 0 {known}, so fxpipe will not "
                f"concatenate it over the {len(values)} micro-batches; say how to merge it: "
                f"Plan(output_merge={{{path!r}: {fit!r}}}) (or {others}; 'cat' joins rows that follow the micro-batches, "
                "'mean' weights micro-batches by size)"
            )
    if mode is None:
        return first if all(_same(first, other) for other in values[1:]) else list(values)
    if not isinstance(first, torch.Tensor):
        raise MicrobatchError(f"plan.output_merge[{path!r}] = {mode!r}, but {_label(path)} is a {type(first).__name__}, not a tensor")
    values = [v.to(first.device) for v in values]
    if mode == "cat":
        return torch.cat(values)
    if mode == "stack":
        return torch.stack(values)
    if mode == "sum":
        return torch.stack(values).sum(0)
    if sizes is None:
        raise ValueError("merge: 'mean' needs the micro-batch sizes")
    return torch.stack([v * n for v, n in zip(values, sizes)]).sum(0) / sum(sizes)


def _rows_follow(values: list[torch.Tensor], sizes: list[int] | None) -> bool:
    """Whether every micro-batch's value has as many rows as its micro-batch has samples
    (or a fixed multiple of them): a batch dim, which ``'cat'`` merges."""
    if sizes is None or any(v.dim() == 0 for v in values) or any(n == 0 for n in sizes):
        return False
    ratios = {v.shape[0] / n for v, n in zip(values, sizes)}
    return len(ratios) == 1 and next(iter(ratios)).is_integer() and next(iter(ratios)) >= 1


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are different
        return False


# ---------------------------------------------------------------------- loss
def loss_weights(sizes: list[int], loss_fn: Any, total: int | None = None, scale: float = 1.0) -> list[float]:
    """Weights that make the micro-batch losses sum to the whole batch's loss.

    A mean-reduced loss (torch's default) is weighted by its micro-batch's share of
    ``total`` samples (default ``sum(sizes)``; data parallelism passes the global batch),
    a ``reduction="sum"`` loss by 1; every weight is then multiplied by ``scale``.
    """
    total = sum(sizes) if total is None else total
    if getattr(loss_fn, "reduction", "mean") == "sum":
        return [scale] * len(sizes)
    return [scale * n / total for n in sizes]


def weighted_loss(loss_fn: Any, build_output: Any, targets: list[Any], weights: list[float]) -> Any:
    """``loss_of(i, stage_output)``: micro-batch i's loss times ``weights[i]``.

    ``build_output(i, out)`` turns micro-batch i's last-stage output into what the model
    returns. Without a
    ``loss_fn`` the model's output (or its ``.loss``) must be a scalar loss; otherwise
    ``loss_of`` raises ValueError saying so. When ``loss_fn`` fails on an output that is
    not a tensor (a tuple, a dict) with a TypeError or AttributeError, ``loss_of`` raises
    LossFunctionError describing the output and how to pass the part the loss needs.
    """

    def loss_of(i: int, out: Any) -> torch.Tensor:
        out = build_output(i, out)
        if loss_fn is not None:
            try:
                loss = loss_fn(out, targets[i])
            except (TypeError, AttributeError) as err:
                if isinstance(out, torch.Tensor):
                    raise
                raise LossFunctionError(_loss_hint(loss_fn, out, err)) from err
            check_loss_value(loss_fn, loss)
        else:
            loss = getattr(out, "loss", out)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise ValueError("step() needs a loss: pass loss_fn to fxpipe.compile, or return a scalar loss from forward")
        return loss * weights[i]

    return loss_of


def loss_name(loss_fn: Any) -> str:
    """How messages name a loss function: its class for a module, else its ``__name__``."""
    if isinstance(loss_fn, nn.Module):
        return type(loss_fn).__name__
    return getattr(loss_fn, "__name__", type(loss_fn).__name__)


def check_loss_value(loss_fn: Any, loss: Any) -> None:
    """Raise LossFunctionError unless ``loss`` (what ``loss_fn`` returned) is a tensor of
    one element, what a step backpropagates: a per-sample loss (``reduction="none"``), a
    float or None are named with the fix."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return
    if isinstance(loss, torch.Tensor):
        got, fix = f"a Tensor{list(loss.shape)}", "reduce it to one number (reduction='mean' or 'sum', or .mean())"
    elif isinstance(loss, int | float):
        got, fix = f"a Python {type(loss).__name__} ({loss!r})", "return the tensor itself, not .item() or float(...)"
    else:
        got, fix = ("None" if loss is None else describe(loss)), "return the loss tensor"
    raise LossFunctionError(f"loss_fn ({loss_name(loss_fn)}) returned {got}, not a scalar tensor that backward can start from: {fix}")


def _loss_hint(loss_fn: Any, out: Any, err: BaseException) -> str:
    tensors = [key_path for key_path, leaf in leaves_with_paths(out) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    pick = "out" + "".join(_accessor(tensors[0])) if tensors else "out[...]"
    if isinstance(loss_fn, nn.Module):
        name, fix = type(loss_fn).__name__, f"ce = {type(loss_fn).__name__}(); loss_fn=lambda out, t: ce({pick}, t)"
    else:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        call = name if name.isidentifier() else "loss"
        fix = f"loss_fn=lambda out, t: {call}({pick}, t)"
    cause = str(err).strip().splitlines()
    return (
        f"loss_fn ({name}) got the model's output, a {describe(out)}, and failed "
        f"({type(err).__name__}: {cause[0] if cause else ''}); give it the part it scores, e.g. {fix}"
    )


def microbatch_inputs(part: Any, microbatches: int) -> tuple[list, int]:
    """The flat model inputs of the first micro-batch of ``part``'s example batch cut into
    ``microbatches``, and its size."""
    flat = part.bind_inputs(part.example_inputs, part.example_kwargs)
    inputs, _, sizes = split_step(flat, None, min(microbatches, batch_size(flat) or 1))
    return inputs[0], sizes[0]
