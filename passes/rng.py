"""Randomness pass: every random op of a stage draws from a generator the runtime keys.

torch has one global CPU generator, shared by the threads that run stages, so dropout
through it is neither reproducible nor the same under two schedules, and checkpoint
recompute draws new masks. Instead, the compiler gives the randomness an explicit key:

1. :func:`number_random_ops`, on the whole traced graph before partitioning, writes
   ``node.meta["rng_key"]`` (0, 1, 2, ... in graph order) on every node that draws random
   numbers, so a node's key does not depend on the split. A random op fxpipe cannot key
   (an unknown custom op, randomness inside ``torch.cond``) gets a warning naming it.
2. :func:`make_randomness_explicit`, per stage ``GraphModule`` after codegen, appends the
   placeholder ``fxpipe_rng_seed`` (an int, the stage's last argument) and rewrites each
   keyed node to draw from a generator seeded by (seed, key) (see ``passes/keyed.py``):
   - ops that take ``generator=`` (``torch.rand``, ``bernoulli``, ``Tensor.uniform_``,
     aten's seeded ops, ``nn.init`` functions) get one from ``keyed.generator``; an aten
     overload without it is swapped for its ``.generator`` twin;
   - the dropout family and ``scaled_dot_product_attention``, which take no generator,
     become the keyed functions of ``passes/keyed.py`` with the same arguments;
   - an opaque callee (a call_module of ``nn.MultiheadAttention``, a user leaf module, a
     Python function fx kept whole, a module or function the fx frontend runs whole because
     it cannot trace into it: ``node.meta["opaque"]``, keyed when it drew random numbers
     in its fake run) runs under ``scope.call`` / ``scope.scoped`` (see
     ``passes/scope.py``): a dispatch mode routes the random ops inside, around that call
     only.

The runtime passes one seed per (step, micro-batch), derived from a ``step_seed`` drawn
once per step from the caller's generator; see docs/randomness.md.

Reads ``node.meta["val"]`` (where present) to find the tensor that decides an op's device.
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.passes import keyed, scope
from fxpipe.passes.meta import MODULE_PATH, OPAQUE, OPAQUE_DRAWS, RNG_KEY, RNG_SEED, VAL
from fxpipe.passes.mode import TrainingFlag
from fxpipe.passes.opaque import OpaqueCall
from fxpipe.passes.ops import draws_random, generator_overload, overloads_of

aten = torch.ops.aten


@dataclass(frozen=True)
class _Keying:
    """How one random node is rewritten.

    how: "generator" (add ``generator=``; ``target`` is the overload that takes it, or
    None to keep the target), "replace" (call ``target``, a keyed function, with the same
    arguments plus ``extra`` and ``generator=``), "module" (``scope.call``), "scope"
    (``scope.scoped(target)``) or "unkeyable" (``reason`` says why and what to do).
    """

    how: Literal["generator", "replace", "module", "scope", "unkeyable"]
    target: Any = None
    extra: dict = field(default_factory=dict)
    reason: str = ""


def _replacements() -> dict[Any, _Keying]:
    table = {
        F.dropout: _Keying("replace", keyed.dropout),
        F.dropout1d: _Keying("replace", keyed.dropout1d),
        F.dropout2d: _Keying("replace", keyed.dropout2d),
        F.dropout3d: _Keying("replace", keyed.dropout3d),
        F.alpha_dropout: _Keying("replace", keyed.alpha_dropout),
        F.feature_alpha_dropout: _Keying("replace", keyed.feature_alpha_dropout),
        F.scaled_dot_product_attention: _Keying("replace", keyed.attention),
        aten.scaled_dot_product_attention.default: _Keying("replace", keyed.attention),
        torch.native_dropout: _Keying("replace", keyed.native_dropout),
        aten.native_dropout.default: _Keying("replace", keyed.native_dropout),
    }
    kinds = {"dropout": {}, "feature_dropout": {"feature": True}, "alpha_dropout": {"alpha": True}}
    kinds["feature_alpha_dropout"] = {"feature": True, "alpha": True}
    for name, flags in kinds.items():
        for suffix, inplace in (("", {}), ("_", {"inplace": True})):
            rule = _Keying("replace", keyed.aten_dropout, {**flags, **inplace})
            table[getattr(torch, name + suffix)] = rule
            table[getattr(aten, name + suffix).default] = rule
    return table


_REPLACEMENTS = _replacements()

# Python functions of torch.nn.functional that draw random numbers and take no generator
_SCOPED_FUNCTIONS = {
    f
    for name in (
        "gumbel_softmax", "rrelu", "multi_head_attention_forward", "fractional_max_pool2d",
        "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
        "fractional_max_pool3d_with_indices", "_fractional_max_pool2d", "_fractional_max_pool3d",
    )
    if (f := getattr(F, name, None)) is not None
}


# ------------------------------------------------------------------ which nodes draw
def _draws(ops: tuple[torch._ops.OpOverload, ...]) -> _Keying | None:
    """The keying of a call to one of ``ops`` (the overloads it may resolve to), or None."""
    random = [op for op in ops if draws_random(op)]
    if not random:
        return None
    if len(ops) == 1:
        overload = generator_overload(ops[0])
        if overload is not None:
            return _Keying("generator", overload if overload is not ops[0] else None)
    elif any(generator_overload(op) is op for op in random):
        return _Keying("generator")  # the call picks the overload that takes generator=
    if all(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd") for op in random):
        return _Keying("scope")  # its decomposition's random ops are visible to a KeyedScope
    names = ", ".join(str(op) for op in random)
    return _Keying(
        "unkeyable",
        reason=f"{names} draws random numbers and takes no generator (give the operator a "
        "'Generator? generator=None' argument, or call it outside the pipelined model)",
    )


def _is_user_function(target: Any) -> bool:
    """A Python function from outside torch and fxpipe that fx kept whole (``fx.wrap``,
    as torchvision's ``stochastic_depth``): its randomness is out of sight."""
    if not isinstance(target, types.FunctionType):
        return False
    package = (target.__module__ or "").split(".")[0]
    return package not in ("torch", "fxpipe", "_operator", "operator", "math", "builtins")


@functools.cache
def _takes_generator(target: Any) -> bool:
    try:
        return "generator" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def module_may_draw(module: nn.Module) -> bool:
    """Whether a module called whole (a leaf) may draw random numbers in training.

    True when it or a submodule is a dropout with p > 0 or an RReLU, a MultiheadAttention
    or RNN with dropout > 0, or a class from outside torch (whose forward fxpipe cannot
    see). A ``TransformerEncoderLayer(dropout=0.0)`` draws nothing and runs unscoped.
    """
    for m in module.modules():
        if isinstance(m, TrainingFlag):
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 or isinstance(m, nn.RReLU):
            return True
        if isinstance(m, nn.MultiheadAttention | nn.RNNBase) and m.dropout > 0:
            return True
        if not type(m).__module__.startswith("torch."):
            return True
    return False


def _subgraphs_draw(node: fx.Node, root: nn.Module | None) -> bool:
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and root is not None:
            sub = _attribute(root, arg.target)
            if isinstance(sub, fx.GraphModule) and any(_keying(n, sub) for n in sub.graph.nodes):
                return True
    return False


def _keying(node: fx.Node, root: nn.Module | None) -> _Keying | None:
    """How to key ``node``, or None when it draws no random numbers (or is keyed already)."""
    if node.op not in ("call_function", "call_method", "call_module") or node.kwargs.get("generator") is not None:
        return None
    target = node.target
    if OPAQUE in node.meta and (node.op == "call_module" or isinstance(target, OpaqueCall)):
        # run whole by the fx frontend: keyed in a scope if it drew random numbers when traced
        if not node.meta.get(OPAQUE_DRAWS, True):
            return None
        return _Keying("module") if node.op == "call_module" else _Keying("scope")
    if node.op == "call_module":
        if root is None:
            raise ValueError(f"node '{node.name}' calls module '{target}': pass the graph's root module")
        return _Keying("module") if module_may_draw(_attribute(root, target)) else None
    if node.op == "call_function" and target in _REPLACEMENTS:
        return None if _draws_nothing(node) else _REPLACEMENTS[target]
    if node.op == "call_function" and target in _SCOPED_FUNCTIONS:
        return _Keying("scope")
    ops = overloads_of(node)
    if ops:
        return _draws(ops)
    if isinstance(target, torch._ops.HigherOrderOperator):
        if _subgraphs_draw(node, root):
            return _Keying(
                "unkeyable",
                reason=f"random ops inside {target.__name__} (a higher-order op) cannot be keyed "
                "(move them out of its branches or body)",
            )
        return None
    if _takes_generator(target):
        return _Keying("generator")
    if _is_user_function(target):
        return _Keying("scope")
    return None


def _bound_arguments(node: fx.Node) -> dict[str, Any] | None:
    """The call's arguments by parameter name, defaults included (None if unknown)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        ops = overloads_of(node)  # a builtin (torch.dropout, F.scaled_dot_product_attention)
        target = ops[0] if len(ops) == 1 and not _has_signature(target) else target
    try:
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema.arguments
            bound = {a.name: a.default_value for a in schema if a.has_default_value()}
            bound.update(zip((a.name for a in schema), node.args))
            bound.update(node.kwargs)
            return bound
        call = inspect.signature(target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return None
    call.apply_defaults()
    return dict(call.arguments)


def _has_signature(target: Any) -> bool:
    try:
        inspect.signature(target)
    except (TypeError, ValueError):
        return False
    return True


def _draws_nothing(node: fx.Node) -> bool:
    """True for a dropout or attention call whose probability is a literal 0 or whose
    training flag is a literal False (GPT-2 with ``resid_pdrop=0``, SDPA without
    ``dropout_p``): it needs no generator, and keying it would cost one per call."""
    bound = _bound_arguments(node)
    if bound is None:
        return False
    for name in ("p", "dropout_p"):
        value = bound.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value == 0:
            return True
    return any(bound.get(name) is False for name in ("training", "train"))


def _attribute(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def number_random_ops(graph: fx.Graph, root: nn.Module | None = None) -> int:
    """Write ``node.meta["rng_key"]`` (0, 1, ... in graph order) on every random node.

    Run it on the whole graph before partitioning: the stages' nodes keep their keys, so
    a node draws the same numbers whatever the split. ``root`` resolves call_module
    targets (default: the graph's owning module). Renumbering gives the same keys.
    Returns how many nodes were keyed. Warns, naming the node and its module path, for
    each random op that cannot be keyed (it keeps drawing from torch's global generator).
    """
    root = root if root is not None else graph.owning_module
    count = 0
    for node in graph.nodes:
        node.meta.pop(RNG_KEY, None)
        how = _keying(node, root)
        if how is None:
            continue
        if how.how == "unkeyable":
            where = node.meta.get(MODULE_PATH) or "the model's forward"
            warnings.warn(
                f"fxpipe: node '{node.name}' in {where}: {how.reason}. It draws from torch's global "
                "generator, so its result differs between runs, schedules and checkpoint recompute",
                stacklevel=2,
            )
            continue
        node.meta[RNG_KEY] = count
        count += 1
    return count


# ------------------------------------------------------------------ the rewrite
def make_randomness_explicit(gm: fx.GraphModule) -> bool:
    """Make every keyed random node of a stage draw from ``fxpipe_rng_seed``.

    Appends the placeholder ``fxpipe_rng_seed`` as the last forward argument (if some
    node is keyed) and rewrites the keyed nodes as the module docstring says; recompiles
    ``gm``. Idempotent. Returns whether the stage takes the seed argument. Raises
    ValueError when a random node has no key (run :func:`number_random_ops` on the whole
    graph before partitioning) or the stage's forward takes ``*args`` (no argument can
    follow it).
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    existing = next((p for p in placeholders if p.target == RNG_SEED), None)
    todo = []
    for node in graph.nodes:
        how = _keying(node, gm)
        if how is None or how.how == "unkeyable":
            continue
        if RNG_KEY not in node.meta:
            raise ValueError(
                f"node '{node.name}' ({node.meta.get(MODULE_PATH) or node.target}) draws random numbers "
                "but has no rng key: call number_random_ops on the whole graph before partitioning, so "
                "every stage's nodes are numbered the same whatever the split"
            )
        todo.append((node, how))
    if not todo:
        return existing is not None
    seed = existing or _seed_placeholder(graph, placeholders)
    for node, how in todo:
        _rewrite(graph, node, how, seed)
    graph.lint()
    gm.recompile()
    return True


def _seed_placeholder(graph: fx.Graph, placeholders: list[fx.Node]) -> fx.Node:
    variadic = [p.target for p in placeholders if str(p.target).startswith("*")]
    if variadic:
        raise ValueError(
            f"this stage draws random numbers but its forward takes {variadic[0]}, after which fxpipe "
            f"cannot append the {RNG_SEED} argument; give the model's forward named arguments"
        )
    # a seed after arguments with defaults needs one too; the runtime always passes it
    default = (None,) if any(p.args for p in placeholders) else ()
    if placeholders:
        with graph.inserting_after(placeholders[-1]):
            seed = graph.placeholder(RNG_SEED, default_value=default[0] if default else inspect.Signature.empty)
    else:
        with graph.inserting_before(next(iter(graph.nodes), None)):
            seed = graph.placeholder(RNG_SEED)
    seed.meta[VAL] = 0
    return seed


def _where(node: fx.Node) -> Any:
    """The argument whose device the op's random numbers live on: its first tensor
    argument, else its ``device=``, else None (the default device)."""
    inputs = [a for a in node.all_input_nodes if a.op != "get_attr" or isinstance(a.meta.get(VAL), torch.Tensor)]
    tensors = [a for a in inputs if isinstance(a.meta.get(VAL), torch.Tensor)]
    if tensors:
        return tensors[0]
    if "device" in node.kwargs:
        return node.kwargs["device"]
    unknown = [a for a in inputs if VAL not in a.meta]
    return unknown[0] if unknown else None


def _rewrite(graph: fx.Graph, node: fx.Node, how: _Keying, seed: fx.Node) -> None:
    key = node.meta[RNG_KEY]
    if how.how in ("generator", "replace"):
        with graph.inserting_before(node):
            gen = graph.create_node("call_function", keyed.generator, (seed, key, _where(node)), name=f"{node.name}_generator")
        if how.target is not None:
            node.target = how.target
        node.kwargs = {**node.kwargs, **how.extra, "generator": gen}
    elif how.how == "module":
        with graph.inserting_before(node):
            module = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
        node.op, node.target = "call_function", scope.call
        node.args = (module, seed, key, *node.args)
    else:  # scope
        fn = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
        node.op, node.target = "call_function", scope.scoped(fn)
        node.args = (seed, key, *node.args)
