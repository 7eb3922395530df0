"""Is a specialised trace right for a call? A check on fake tensors, nothing computed.

A trace is specialised (``passes/signature.py``): constants, the None pattern, and under
torch.export the sizes. Its :class:`TraceKey` says which calls it serves, but the key only
sees the arguments: a Python branch on something else (a module attribute changed after
tracing, a global flag) is invisible to it. :func:`check_generalises` closes that gap for
the first call of every new signature: it runs the user's model eagerly on fake tensors
(``FakeTensorMode``, with parameters and buffers swapped for fakes by
``torch.func.functional_call``: the model's state is not touched and nothing is computed)
and the traced graph on the same fake inputs (shape propagation), and compares what they
return: structure, every tensor's shape and dtype, every other value.

Models whose eager forward cannot run on fake tensors (data-dependent output shapes such
as ``nonzero``, ``.item()`` in Python control flow) are not checked: the function says so
and the key alone vouches for the trace (a trace of such a model cannot have specialised on
those values silently either: fx and export both refuse data-dependent branches).

Writes ``node.meta["val"]`` for the call (the shape propagation pass).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.passes.fake_replay import quiet_meta_failures
from fxpipe.passes.kernel_dtypes import KernelDtypes
from fxpipe.passes.meta import MODULE_PATH, VAL
from fxpipe.passes.module_state import preserved_module_state
from fxpipe.passes.moves import MovesIgnored
from fxpipe.passes.shape_prop import describe, propagate_shapes
from fxpipe.passes.trace import inference_only_defaults
from fxpipe.passes.trace_errors import user_line
from fxpipe.passes.traced import Traced, TraceError
from fxpipe.passes.uncompiled import eager_code


class TraceMismatch(TraceError):
    """A trace computes something else than the model for a call: trace that call again."""


def eager_on_fake(
    model: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any],
    devices: Mapping[str, Any] | None = None,
    shape_of: Callable[[torch.Tensor], tuple[int, ...]] | None = None,
    kernel_dtypes: bool = False,
) -> Any:
    """What ``model(*args, **kwargs)`` returns, computed on fake tensors: shapes, dtypes and
    structure, no values. The model's parameters, buffers, attributes and the global RNG
    are left as they were. Raises what the model's forward raises on fake tensors.

    devices: where each parameter and buffer (by name) really lives, for a model whose
    tensors stand on the meta device (a skeleton): the fakes are made there, so a forward
    that creates tensors on the default device meets them where eager would. shape_of:
    the shape to fake each input tensor at (default its own), to ask "what if the batch
    were larger". kernel_dtypes: also keep the dtype rules of real kernels
    (:class:`KernelDtypes`), so that a forward real tensors of these dtypes would fail fails.
    """
    # defaults bound too: a tensor default must be faked like any input
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    args, kwargs = bound.args, bound.kwargs
    devices = dict(devices or {})
    # real tensors the forward makes itself (constants, plain attributes) are allowed in
    with torch.random.fork_rng(devices=[]), eager_code(), FakeTensorMode(allow_non_fake_inputs=True):
        state = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False)),
        }
        made: dict[int, torch.Tensor] = {}  # one fake per tensor: tied names share it, as functional_call wants
        fakes = {}
        for name, t in state.items():
            if id(t) not in made:
                made[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=devices.get(name, t.device))
            fakes[name] = made[id(t)]
        on_meta = any(torch.device(f.device).type == "meta" for f in fakes.values())

        def fake_input(t: torch.Tensor) -> torch.Tensor:
            shape = tuple(shape_of(t)) if shape_of is not None else tuple(t.shape)
            device = "meta" if on_meta else t.device
            return torch.empty(shape, dtype=t.dtype, device=device)

        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake_input, (tuple(args), dict(kwargs)))
        # CUDA moves in forward are left out, as the trace leaves them out (passes/moves.py)
        with preserved_module_state(model), MovesIgnored(), quiet_meta_failures(), (KernelDtypes() if kernel_dtypes else contextlib.nullcontext()):
            return torch.func.functional_call(model, fakes, fake_args, fake_kwargs, tie_weights=True, strict=False)


def check_generalises(
    model: nn.Module,
    traced: Traced,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    resolve: Callable[[str], Any] | None = None,
    mode: FakeTensorMode | None = None,
) -> bool:
    """Check that ``traced`` computes what ``model(*args, **kwargs)`` computes, on fake tensors.

    ``resolve(target)`` fetches the graph's modules and tensors (default: the traced
    GraphModule's own attributes); ``mode``: the FakeTensorMode they belong to, for a trace
    made on fake tensors. Returns True when checked, False when the eager model
    cannot run on fake tensors (data-dependent shapes: unchecked, see the module doc).
    Raises SignatureError when the call does not fit the trace's signature, TraceMismatch
    naming the first output that differs, the two values, and the module and source line
    of the graph node that made it.
    """
    kwargs = dict(kwargs or {})
    inputs = traced.bind_inputs(tuple(args), kwargs)
    devices = getattr(model, "fxpipe_devices", None)  # a skeleton says where its tensors live
    try:
        # eager called as the trace was: inference-only options left out at their traced value
        # (use_cache=False), else an eval-mode call compares a generation cache the trace omits
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
        untraced = inference_only_defaults(model, bound.signature, bound, {})
        expected = eager_on_fake(model, tuple(args), {**kwargs, **untraced}, devices)
    except Exception:  # noqa: BLE001 - data-dependent: fake tensors cannot say
        return False
    gm = traced.graph_module
    on_meta = any(t.is_meta and torch.device((devices or {}).get(n, "meta")).type == "meta" for n, t in model.named_parameters())
    if on_meta:  # a model built on the meta device
        inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), inputs)
    propagate_shapes(gm, inputs, resolve, mode)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    got = traced.build_output(torch.fx.map_arg(output.args[0], lambda n: n.meta.get(VAL)))
    mismatch = _first_difference(expected, got)
    if mismatch is None:
        return True
    path, want, have = mismatch
    raise TraceMismatch(
        f"the trace of {type(model).__name__} ({traced.frontend}, {traced.key}) does not compute what the model "
        f"does for this call: output {path or '(the whole output)'} is {have} in the trace but {want} in eager; "
        f"{_origin(output, path, traced)}. The model's code depends on something besides its arguments: trace "
        "this call again, or make the dependency an argument of forward"
    )


def _first_difference(expected: Any, got: Any) -> tuple[str, str, str] | None:
    """(path, eager's value, the trace's value) of the first output that differs, or None."""
    want, want_spec = pytree.tree_flatten_with_path(expected)
    have, have_spec = pytree.tree_flatten_with_path(got)
    if want_spec != have_spec:
        return "", _structure(expected), _structure(got)
    for (path, a), (_, b) in zip(want, have):
        if not _same(a, b):
            return pytree.keystr(path), describe(a) if isinstance(a, torch.Tensor) else repr(a), describe(b) if isinstance(b, torch.Tensor) else repr(b)
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not known to differ
        return True


def _structure(value: Any) -> str:
    return str(pytree.tree_structure(value)).replace("\n", " ")


class _Ref:
    """A graph output leaf, stood in for while the output structure is rebuilt."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.node = node


def _origin(output: torch.fx.Node, path: str, traced: Traced) -> str:
    """Which node made the differing output: its module and, where recorded, source line."""
    built = traced.build_output(torch.fx.map_arg(output.args[0], _Ref))
    refs = {pytree.keystr(p): leaf for p, leaf in pytree.tree_flatten_with_path(built)[0]}
    ref = refs.get(path)
    if not isinstance(ref, _Ref):
        return "the graph's output structure was fixed when it was traced"
    node = ref.node
    line = user_line(node.meta.get("stack_trace") or "")
    where = f" at {line[0]}: `{line[1]}`" if line else ""
    return f"the trace made it in module '{node.meta.get(MODULE_PATH) or '(root)'}'{where}"
