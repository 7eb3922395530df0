"""Fake-tensor replay: a graph run on fake tensors, each distinct computation run once.

One replay serves shape propagation (``shape_prop``), the cost pass (``node_costs``) and the
distributed runtime's per-signature edge specs: it returns every node's value with each
tensor a ``FakeTensor`` (shape, strides, dtype, device, requires_grad; no data, nothing
computed), and leaves the model's parameters and buffers untouched.

Why it is fast at LLM scale
---------------------------
A 48-layer transformer repeats one layer's computations 48 times on equal shapes, and
running an op on fake tensors costs about as much Python as a small real op. So every
compute node gets a *key*: what it computes (function, method name, or the called module's
class, configuration and parameter shapes) and the shapes, strides, dtypes, devices and
``requires_grad`` of its inputs, with constants by value. The first node with a key runs on
fake tensors and leaves an :class:`OutputTemplate`; every later node with that key (under
the same grad mode and autocast) gets new fake tensors built from the template, without
running anything. Templates also record where
each output's memory comes from (new, a view of an input, the input itself written in
place), which the cost pass needs and storage identity alone would no longer tell.

torch's ``FakeTensorProp`` and ``ShapeProp`` do not fit: they run every node (no template
reuse), expect parameters already faked on the module, and write ``node.meta`` themselves.

When a node cannot run on fake tensors
----------------------------------------
A node whose fake run fails is run for real, once, on real tensors of its recorded shapes
and dtypes with its real non-tensor arguments (:meth:`FakeReplay.real_run_reasons` says
which and why). Two kinds of failure end there: data-dependent output shapes (a routing
``nonzero``), whose sizes are then those of the values the real run saw (``estimated``),
and a fake kernel whose meta rules are stricter than the real one (``torch._grouped_mm``'s
meta kernel applies GPU dtype rules that the CPU kernel does not), whose sizes are facts.
When the real run fails too, the fake run's error is raised: it is the model's.

The real tensors keep the program's structure: the example's own values where they are
known at compile time (the model's inputs, buffers and parameters, and every value computed
from inputs, buffers and sizes alone, such as masks, token counts and positions: computed
for real once asked for; a size or count the fake run computed, ``features.numel()``, is a
fact unless it comes from a data-dependent estimate), else stand-ins of the recorded shape:
True for booleans (a check holds), zeros for integers (an index in range, empty groups) and
for floats. So a check that compares image tokens with image features runs on the example's
real counts, as eager does.

Reads the graph only (``node.meta`` is not written here).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module

from fxpipe.passes.assumed import check_assumed
from fxpipe.passes.kernel_dtypes import KernelDtypeError, KernelDtypes
from fxpipe.passes.meta import MODULE_PATH
from fxpipe.passes.targets import resolver

DATA_DEPENDENT = "data-dependent output shapes: sized by a real run on the example's values or stand-ins"
COMPUTE_NODE_OPS = ("call_module", "call_function", "call_method")
_CONSTANTS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
# attributes longer than this are keyed by identity: a vocabulary list is not a configuration
_MAX_PLAIN_LENGTH = 64
_PLAIN_KINDS = frozenset({bool, int, float, str, type(None)})  # exactly these types: (type, value) as _CONSTANTS gives
# the nn.Module internals a module signature reads separately
_MODULE_STATE = ("_parameters", "_buffers", "_modules")


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """torch logs every meta kernel that refuses, at ERROR with its traceback
    (``torch._subclasses.fake_tensor``); fxpipe handles those failures itself (the node runs
    for real, or fxpipe's own error names it), so the log is held back while fakes run."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True)
class TensorTemplate:
    """A tensor a node returns: its metadata and where its memory comes from.

    alias: None when the op allocated new memory; ``("in", j)`` when it shares the storage
    of the node's ``j``-th input tensor (see :func:`input_tensors`); ``("out", k)`` when it
    shares that of the node's ``k``-th output leaf. same: it *is* that tensor (an in-place op
    or a pass-through such as ``getitem``); written: the op wrote into it (in place).
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    alias: tuple[str, int] | None = None
    same: bool = False
    written: bool = False

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class OutputTemplate:
    """What a node returns, tensors as :class:`TensorTemplate`: its pytree structure (None
    when the output is one leaf) and leaves. memoisable: False when a leaf is an object that
    cannot be rebuilt from the template (the node then runs every time)."""

    spec: Any
    leaves: tuple[Any, ...]
    memoisable: bool = True

    @property
    def tensors(self) -> list[TensorTemplate]:
        return [leaf for leaf in self.leaves if isinstance(leaf, TensorTemplate)]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor returned."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def new_bytes(self) -> int:
        """Bytes of the tensors in new memory (views and in-place results count 0)."""
        return sum(t.nbytes for t in self.tensors if t.alias is None)

    @property
    def only_aliases(self) -> bool:
        """True when the node allocates nothing and writes nothing: a view, a shape read, a
        pass-through (``getitem`` of a tuple). Such a node moves no activation bytes."""
        return all(t.alias is not None and not t.written for t in self.tensors)


def input_tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The distinct tensors among a call's arguments, in the order templates number them."""
    tensors: list[torch.Tensor] = []
    _describe((args, kwargs), tensors)
    return tensors


class FakeReplay:
    """Runs graphs on fake tensors, each distinct computation once (see the module doc).

    device: when given, every tensor (inputs, parameters, buffers) is faked on this device,
    e.g. "cpu" to run a skeleton whose parameters live on the meta device; mode: the
    FakeTensorMode to run in (one whose fakes the graph's modules already hold), else a new one.
    After :meth:`run`: ``values`` maps every node run to its value, ``keys`` every compute
    node to its key (nodes with equal keys compute alike), ``templates`` every compute node
    to its OutputTemplate, ``runs`` counts the compute nodes that really ran, and
    ``estimated`` holds the nodes that could not run on fake tensors (data-dependent) and
    ran for real on stand-in values: their sizes are those the stand-ins gave, not facts;
    ``real_runs`` maps every node that ran for real (or reused such a run's template) to
    why; ``refused`` is the first op whose dtypes a real kernel would refuse
    (:mod:`~fxpipe.passes.kernel_dtypes`; the fake kernel ran it), else None. real_inputs:
    whether real tensors handed to :meth:`run`/:meth:`step` for
    placeholders hold the example's values (False when they are placeholders of the right
    shape only, e.g. ``new_empty``): only then are they used by a real run. assumptions:
    False skips the trace's checks of the sizes it branched on (``check_assumed`` nodes):
    a replay at another batch size that asks only how values flow.
    """

    def __init__(
        self, device: str | torch.device | None = None, mode: FakeTensorMode | None = None, real_inputs: bool = True, assumptions: bool = True,
    ) -> None:
        self.mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
        self.device = torch.device(device) if device is not None else None
        self.values: dict[fx.Node, Any] = {}
        self.keys: dict[fx.Node, Hashable] = {}
        self.templates: dict[fx.Node, OutputTemplate] = {}
        self.runs = 0
        self._memo: dict[Hashable, OutputTemplate] = {}
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(real) -> (real, fake)
        self._signatures: dict[int, tuple[Any, Hashable]] = {}  # id(module) -> (module, signature)
        self._made: set[int] = set()  # ids of template-built leaves that require grad
        self._context: Hashable = ()  # grad mode and autocast of the current run
        self.estimated: set[fx.Node] = set()  # nodes whose value came from a real run on zeros
        self._estimated_keys: set[Hashable] = set()
        self.real_runs: dict[fx.Node, str] = {}
        self._real_keys: dict[Hashable, str] = {}
        self._real_inputs = real_inputs
        self._assumptions = assumptions
        self._ran_for_real: str | None = None
        self._given: dict[fx.Node, Any] = {}  # placeholders and get_attr nodes: their real values
        self._reals: dict[fx.Node, Any] = {}  # nodes computed for real from inputs and buffers (None: not computable)
        self.refused: KernelDtypeError | None = None  # the first op a real kernel would refuse for its dtypes
        self._unsure: dict[fx.Node, bool] = {}  # nodes computed from a data-dependent estimate

    def run(
        self,
        gm: fx.GraphModule | fx.Graph,
        inputs: Sequence[Any],
        resolve: Callable[[str], Any] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """Run ``gm``'s graph (or the graph ``gm``) on fakes of ``inputs`` (one value per
        placeholder; real or fake tensors); returns the output's value. ``resolve(target)``
        fetches a module or tensor by qualified name (default: ``gm``'s attributes; needed
        for a bare graph); ``progress(done, total)`` is called
        every 64 nodes. Raises what a node raises on fake tensors, with a note naming it.
        """
        resolve = resolve or resolver(gm)
        nodes = list(gm.nodes if isinstance(gm, fx.Graph) else gm.graph.nodes)
        pending = iter(inputs)
        output = None
        for k, node in enumerate(nodes):
            if progress is not None and k % 64 == 0:
                progress(k, len(nodes))
            if node.op == "placeholder":
                self.step(node, resolve, self._placeholder(node, pending))
            else:
                self.step(node, resolve)
            if node.op == "output":
                output = self.values[node]
        if progress is not None:
            progress(len(nodes), len(nodes))
        self.release_real_values()
        return output

    def release_real_values(self) -> None:
        """Forget the example's real values held for real runs (inputs, and masks or
        positions computed from them): a replay kept after its run holds no real tensors."""
        self._given.clear()
        self._reals.clear()
        self._unsure.clear()

    def step(self, node: fx.Node, resolve: Callable[[str], Any], value: Any = None) -> Any:
        """Run one node whose inputs have run (a placeholder takes ``value``, faked); records
        and returns its value. Runs in the caller's grad mode and autocast; raises what the
        node raises on fake tensors, with a note naming it."""
        # a template holds for the grad mode and autocast it was made under
        self._context = (torch.is_grad_enabled(), *((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))
        # fakes are made directly (``_new``): only a node that really runs enters the fake mode
        if node.op == "placeholder":
            if self._real_inputs and _holds_values(value):
                self._given[node] = value
            value = pytree.tree_map_only(torch.Tensor, self._input, value)
        elif node.op == "get_attr":
            real = resolve(node.target)
            if _holds_values(real):
                self._given[node] = real
            value = self.fake(real)
        elif node.op == "output":
            value = fx.map_arg(node.args[0], self.values.__getitem__)
        else:
            value = self._compute(node, resolve)
        self.values[node] = value
        return value

    def fake(self, value: Any) -> Any:
        """``value`` with every tensor replaced by its fake (one fake per real tensor, so
        tied weights stay tied); other values as they are."""
        if isinstance(value, torch.Tensor):
            entry = self._fakes.get(id(value))
            if entry is None:
                entry = (value, self.fake_like(value))
                self._fakes[id(value)] = entry
            return entry[1]
        if isinstance(value, list | tuple | dict):
            return pytree.tree_map_only(torch.Tensor, self.fake, value)
        return value

    def fake_like(self, t: torch.Tensor, requires_grad: bool | None = None) -> torch.Tensor:
        """A new fake tensor with ``t``'s shape, strides, dtype and device (the replay's
        device when it has one) that requires grad as ``t`` does unless told otherwise."""
        return self._new(
            tuple(t.shape), t.stride(), t.dtype, self.device or t.device,
            t.requires_grad if requires_grad is None else requires_grad, track=False,
        )

    def execute(self, node: fx.Node, args: tuple, kwargs: dict, resolve: Callable[[str], Any], state: dict[str, Any] | None = None) -> Any:
        """Run one compute node on fake ``args``/``kwargs`` (inside this replay's fake mode).

        ``state`` replaces a called module's parameters and buffers (default: their fakes).
        """
        if node.op == "call_module":
            module = resolve(node.target)
            if state is None:
                state = {name: self.fake(t) for name, t in _module_tensors(module)}
            try:
                # the module's own tensors replaced by fakes for this call only
                return torch.func.functional_call(module, state, args, kwargs, tie_weights=True, strict=False)
            except Exception as err:  # noqa: BLE001 - e.g. a leaf module with data-dependent control flow
                return self._run_for_real(node, module, args, kwargs, err)
        fn = (lambda obj, *rest, **kw: getattr(obj, node.target)(*rest, **kw)) if node.op == "call_method" else node.target
        if fn is check_assumed and not self._assumptions:
            return None
        try:
            with self._modules_faked((args, kwargs)):
                return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - run for real; if that fails too, ``err`` is raised
            if fn is check_assumed and isinstance(err, DataDependentOutputException | DynamicOutputShapeException):
                # a trace's assumption on values the fake tensors do not hold: it is checked
                # on the call's real values when the stage runs, never on stand-ins here
                return None
            return self._run_for_real(node, fn, args, kwargs, err)

    def real_run_reasons(self) -> dict[fx.Node, str]:
        """Every node that ran for real instead of on fake tensors (or reused the template
        of such a run), with why; see the module doc."""
        return dict(self.real_runs)

    @contextlib.contextmanager
    def _modules_faked(self, value: Any) -> Iterator[None]:
        """Modules handed to a function as values (an opaque callee's ``self``, a keyed
        scope's callee) hold this replay's fakes of their tensors for the call."""
        modules = [m for m in pytree.tree_leaves(value) if isinstance(m, torch.nn.Module)]
        with contextlib.ExitStack() as stack:
            for module in modules:
                state = {name: self.fake(t) for name, t in _module_tensors(module)}
                stack.enter_context(_reparametrize_module(module, state, tie_weights=True, strict=False))
            yield

    # ------------------------------------------------------------------ internals
    def _placeholder(self, node: fx.Node, pending: Any) -> Any:
        if str(node.target).startswith("*"):
            return list(pending)
        try:
            return next(pending)
        except StopIteration:
            if node.args:
                return node.args[0]
            raise TypeError(f"fake replay: no input given for placeholder {node.name!r}") from None

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        """A model input's fake. A real one keeps what a graph may check of it (export's
        guards read a view's ``_base``); one faked elsewhere or moved to the replay's device
        keeps its metadata."""
        if self.device is None and not isinstance(t, FakeTensor):
            return self.mode.from_tensor(t, static_shapes=True)
        return self.fake_like(t)

    def _compute(self, node: fx.Node, resolve: Callable[[str], Any]) -> Any:
        args = fx.map_arg(node.args, self.values.__getitem__)
        kwargs = fx.map_arg(node.kwargs, self.values.__getitem__)
        tensors: list[torch.Tensor] = []
        key = (self._context, self._target(node, resolve), _describe(args, tensors, self._signature), _describe(kwargs, tensors, self._signature))
        self.keys[node] = key
        template = self._memo.get(key)
        if template is not None:
            self.templates[node] = template
            if key in self._estimated_keys:
                self.estimated.add(node)
            if key in self._real_keys:
                self.real_runs[node] = self._real_keys[key]
            return self._build(template, tensors)
        self.runs += 1
        self._ran_for_real = None
        dtypes = KernelDtypes(record=True)
        try:
            with quiet_meta_failures(), self.mode, dtypes:
                args, kwargs = self._writable((args, kwargs))
                tensors = input_tensors(args, kwargs)
                versions = [t._version for t in tensors]
                out = self.execute(node, args, kwargs, resolve)
            self.refused = self.refused or dtypes.refused
            if self._ran_for_real is not None:
                self.real_runs[node] = self._real_keys[key] = self._ran_for_real
                if self._ran_for_real == DATA_DEPENDENT:
                    self.estimated.add(node)
                    self._estimated_keys.add(key)
        except Exception as err:
            if hasattr(err, "add_note"):  # Python 3.11+
                where = node.meta.get(MODULE_PATH)
                err.add_note(f"fxpipe: while running node {node.name!r}{f' (module {where!r})' if where else ''} on fake tensors")
            raise
        template = _template(out, tensors, versions)
        self.templates[node] = template
        if template.memoisable:
            self._memo[key] = template
        return out

    def _target(self, node: fx.Node, resolve: Callable[[str], Any]) -> Hashable:
        if node.op == "call_module":
            return ("call_module", self._signature(resolve(node.target)))
        return (node.op, _hashable(node.target))

    def _signature(self, module: torch.nn.Module) -> Hashable:
        """``module_signature(module)``, computed once per module."""
        entry = self._signatures.get(id(module))
        if entry is None:
            entry = (module, module_signature(module))
            self._signatures[id(module)] = entry
        return entry[1]

    def _new(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device, requires_grad: bool, track: bool) -> torch.Tensor:
        """A fake tensor built directly rather than through the fake mode's dispatch (~10x
        cheaper: it needs nothing but metadata). ``track``: it stands for an op's result."""
        with unset_fake_temporarily():  # inside the mode, the meta tensor would be dispatched to it
            fake = FakeTensor(self.mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)
            if requires_grad:
                fake.requires_grad_(True)
            if track:
                self._made.add(id(fake))
        return fake

    def _build(self, template: OutputTemplate, tensors: list[torch.Tensor]) -> Any:
        leaves: list[Any] = []
        for leaf in template.leaves:
            if not isinstance(leaf, TensorTemplate):
                leaves.append(leaf)
            elif leaf.same:
                kind, j = leaf.alias
                leaves.append(tensors[j] if kind == "in" else leaves[j])
            else:
                device = self.device or leaf.device
                leaves.append(self._new(leaf.shape, leaf.stride, leaf.dtype, device, leaf.requires_grad, track=True))
        return leaves[0] if template.spec is None else pytree.tree_unflatten(leaves, template.spec)

    def _writable(self, value: Any) -> Any:
        """Template-built tensors that require grad are leaves, which an in-place op may not
        write: a node that really runs gets clones (non-leaves, as in the traced program)."""
        clones: dict[int, torch.Tensor] = {}

        def clone(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in self._made:
                return t
            if id(t) not in clones:
                clones[id(t)] = t.clone()
            return clones[id(t)]

        return pytree.tree_map_only(torch.Tensor, clone, value)

    def _run_for_real(self, node: fx.Node, fn: Callable, args: tuple, kwargs: dict, err: Exception) -> Any:
        """Run ``fn`` (the node's function or module) for real and fake the result, for a
        node that failed on fake tensors with ``err``: on the example's values where they
        are known, stand-ins of the recorded shapes elsewhere (see the module doc). Modules
        (``fn`` itself, or among its arguments) run on copies of their tensors and the
        global RNG is restored, so nothing of the model changes. An output requires grad
        where an input or a parameter does (as autograd would make it). Raises ``err`` when
        the real run fails too."""
        modules = [m for m in pytree.tree_leaves((fn, args, kwargs)) if isinstance(m, torch.nn.Module)]
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors += [t for m in modules for t in m.parameters()]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[]), contextlib.ExitStack() as stack:
            real_args = self._real_arguments(node, args, kwargs)
            copies: dict[int, torch.Tensor] = {}
            for module in modules:
                state = {name: copies.setdefault(id(t), _real_copy(t)) for name, t in _module_tensors(module)}
                stack.enter_context(_reparametrize_module(module, state, tie_weights=True, strict=False))
            data_dependent = isinstance(err, DataDependentOutputException | DynamicOutputShapeException)
            try:
                with torch.no_grad():
                    out = fn(*real_args[0], **real_args[1])
            except Exception:
                if data_dependent or isinstance(fn, torch.nn.Module):
                    raise  # code that branched on values failed on them: its own error
                raise err from None  # the real kernel refuses it too: the fake run's error is the model's
        self._ran_for_real = DATA_DEPENDENT if data_dependent else _meta_rule(err)
        return pytree.tree_map_only(torch.Tensor, lambda t: self.fake_like(t, requires_grad=needs_grad and t.is_floating_point()), out)

    def _real_arguments(self, node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Real arguments for a real run of ``node``: the example's values where they are
        known (``node``'s arguments computed from inputs and buffers alone), stand-ins of
        the fake ``args``/``kwargs`` elsewhere. The node's own non-tensor arguments stay."""
        stand_ins = pytree.tree_map_only(torch.Tensor, _stand_in, (tuple(args), dict(kwargs)))
        if (len(node.args), tuple(node.kwargs)) != (len(args), tuple(kwargs)):
            return stand_ins
        real = (fx.map_arg(tuple(node.args), self._real_value), fx.map_arg(dict(node.kwargs), self._real_value))
        return _real_or_stand_in(real, stand_ins)

    def _real_value(self, node: fx.Node) -> Any:
        """``node``'s value on the example, computed for real when it comes from the
        inputs, buffers and constants alone (no parameter, no module call); None when unknown."""
        if node in self._reals:
            return self._reals[node]
        order = _ancestors(node)
        for n in order:
            if n not in self._unsure:
                self._unsure[n] = n in self.estimated or any(self._unsure[a] for a in n.all_input_nodes)
            if n not in self._reals:
                self._reals[n] = self._compute_real(n)
        return self._reals[node]

    def _compute_real(self, node: fx.Node) -> Any:
        fake = self.values.get(node)
        if node.op in ("call_function", "call_method") and _is_size(fake) and not self._unsure[node]:
            return fake  # a size or count the fake run computed (``features.numel()``): a fact, not a stand-in
        if node.op in ("placeholder", "get_attr"):
            value = self._given.get(node)
            if isinstance(value, torch.nn.Parameter) or value is None or not _same_layout(value, self.values.get(node)):
                return None  # weights are not what masks and counts come from; a real run takes stand-ins
            return pytree.tree_map_only(torch.Tensor, _real_copy, value)  # copies: the example stays as given
        if node.op not in COMPUTE_NODE_OPS or node.op == "call_module":
            return None
        inputs = node.all_input_nodes
        if any(self._reals.get(n) is None for n in inputs):
            return None
        args, kwargs = fx.map_arg((node.args, node.kwargs), self._reals.__getitem__)
        try:
            with unset_fake_temporarily(), torch.random.fork_rng(devices=[]), torch.no_grad():
                out = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" else node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - not computable for real: stand-ins take its place
            return None
        if any(isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.is_meta) for t in pytree.tree_leaves(out)):
            return None
        return out if _same_layout(out, self.values.get(node)) else None



def replay(
    gm: fx.GraphModule,
    inputs: Sequence[Any],
    resolve: Callable[[str], Any] | None = None,
    device: str | torch.device | None = None,
    progress: Callable[[int, int], None] | None = None,
    mode: FakeTensorMode | None = None,
) -> FakeReplay:
    """Run ``gm`` once on fake tensors; returns the :class:`FakeReplay` holding every node's
    value (``.values``), key and template. See :class:`FakeReplay` and :meth:`FakeReplay.run`
    for the arguments and what it raises. Runs in the caller's grad mode and autocast."""
    fake_run = FakeReplay(device, mode)
    fake_run.run(gm, inputs, resolve, progress)
    return fake_run


def module_signature(module: torch.nn.Module) -> Hashable:
    """What decides a module call's result shapes and cost: its class, configuration
    (attributes by value; objects by identity), parameter and buffer metadata, children."""
    state = tuple((name, _plain(value)) for name, value in vars(module).items() if name not in _MODULE_STATE)
    params = tuple((name, _plain(p)) for name, p in module._parameters.items())
    buffers = tuple((name, _plain(b)) for name, b in module._buffers.items())
    children = tuple((name, None if c is None else module_signature(c)) for name, c in module._modules.items())
    return (type(module), state, params, buffers, children)


def _module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)))


def _tensor_meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad, t.layout)


def _describe(value: Any, tensors: list[torch.Tensor], module_key: Callable[[torch.nn.Module], Hashable] = id) -> Hashable:
    """A hashable description of a call argument; collects its distinct tensors in order.
    A module handed over as a value is described by ``module_key`` (default: identity)."""
    if isinstance(value, torch.Tensor):
        for j, seen in enumerate(tensors):
            if seen is value:
                return ("same", j)
        tensors.append(value)
        return _tensor_meta(value)
    if isinstance(value, list | tuple):
        return (type(value), tuple(_describe(v, tensors, module_key) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _describe(v, tensors, module_key)) for k, v in value.items()))
    if isinstance(value, slice):
        return (slice, _describe((value.start, value.stop, value.step), tensors, module_key))
    if isinstance(value, torch.nn.Module):
        return ("module", module_key(value))
    return (type(value), _hashable(value))


def _plain(value: Any) -> Hashable:
    """A module attribute by value where that is cheap and meaningful, else by identity."""
    kind = type(value)
    if kind in _PLAIN_KINDS or ((kind is dict or kind is OrderedDict) and not value):  # most attributes: flags, sizes, empty hook tables
        return (kind, () if kind is dict or kind is OrderedDict else value)
    if isinstance(value, _CONSTANTS):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return _tensor_meta(value)
    if isinstance(value, list | tuple | set | frozenset) and len(value) <= _MAX_PLAIN_LENGTH:
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return (type(value), tuple(_plain(v) for v in items))
    if isinstance(value, dict) and len(value) <= _MAX_PLAIN_LENGTH:
        return (type(value), tuple((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, torch.nn.Module):
        return ("module", id(value))
    return (type(value), _hashable(value))


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _storage(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
        return None


def _template(out: Any, tensors: list[torch.Tensor], versions: list[int]) -> OutputTemplate:
    """The template of ``out``, the result of a call on ``tensors`` (their versions before it)."""
    if isinstance(out, torch.Tensor):
        leaves, spec = [out], None
    else:
        leaves, spec = pytree.tree_flatten(out)
    storages = [_storage(t) for t in tensors]
    made: list[tuple[torch.Tensor, Any]] = []
    result: list[Any] = []
    memoisable = True
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            result.append(_tensor_template(leaf, tensors, storages, versions, made))
            made.append((leaf, _storage(leaf)))
            continue
        made.append((None, None))
        if not _is_constant(leaf):
            memoisable = False
        result.append(leaf)
    return OutputTemplate(spec, tuple(result), memoisable)


def _tensor_template(leaf: torch.Tensor, tensors: list[torch.Tensor], storages: list[Any], versions: list[int], made: list[tuple[Any, Any]]) -> TensorTemplate:
    meta = (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
    for j, t in enumerate(tensors):
        if t is leaf:
            return TensorTemplate(*meta, ("in", j), same=True, written=t._version != versions[j])
    for k, (t, _) in enumerate(made):
        if t is leaf:
            return TensorTemplate(*meta, ("out", k), same=True)
    storage = _storage(leaf)
    if storage is not None:
        for j, s in enumerate(storages):
            if s is not None and s == storage:
                return TensorTemplate(*meta, ("in", j), written=tensors[j]._version != versions[j])
        for k, (_, s) in enumerate(made):
            if s is not None and s == storage:
                return TensorTemplate(*meta, ("out", k))
    return TensorTemplate(*meta)


def _is_constant(value: Any) -> bool:
    if isinstance(value, _CONSTANTS):
        return True
    return isinstance(value, tuple) and all(isinstance(v, _CONSTANTS) for v in value)


def _is_size(value: Any) -> bool:
    """Whether a node's fake value is a plain size or count (an int, or a tuple of them)."""
    if isinstance(value, tuple):
        return bool(value) and all(type(v) is int for v in value)
    return type(value) is int


def _real_copy(t: torch.Tensor) -> torch.Tensor:
    """A real copy of a module's tensor (zeros for one on the meta device or faked: a
    skeleton's, whose values nobody has)."""
    if t.is_meta or isinstance(t, FakeTensor):
        return _zeros_like(t)
    return t.detach().clone()


def _real_or_stand_in(real: Any, stand_in: Any) -> Any:
    """``stand_in`` with a copy of each real tensor that ``real`` (the same structure, None
    where unknown) holds in its place."""
    if isinstance(real, torch.Tensor) and isinstance(stand_in, torch.Tensor):
        return _real_copy(real)
    if isinstance(real, list | tuple) and isinstance(stand_in, list | tuple) and len(real) == len(stand_in):
        merged = [_real_or_stand_in(r, s) for r, s in zip(real, stand_in)]
        return tuple(merged) if isinstance(stand_in, tuple) else merged
    if isinstance(real, dict) and isinstance(stand_in, dict) and real.keys() == stand_in.keys():
        return {k: _real_or_stand_in(real[k], v) for k, v in stand_in.items()}
    return stand_in


def _meta_rule(err: Exception) -> str:
    """Why a node that the real kernel runs failed on fake tensors, in one line."""
    text = str(err).strip().splitlines()
    return f"its fake kernel refused what the real one runs ({type(err).__name__}: {text[0] if text else ''})"


def _holds_values(value: Any) -> bool:
    """Whether ``value`` holds real tensors with data (not fake, not on the meta device)."""
    leaves = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return bool(leaves) and not any(isinstance(t, FakeTensor) or t.is_meta for t in leaves)


def _same_layout(real: Any, fake: Any) -> bool:
    """Whether a real value has the structure, shapes and dtypes of a node's fake value."""
    real_leaves, real_spec = pytree.tree_flatten(real)
    fake_leaves, fake_spec = pytree.tree_flatten(fake)
    if real_spec != fake_spec:
        return False
    for r, f in zip(real_leaves, fake_leaves):
        if isinstance(r, torch.Tensor) != isinstance(f, torch.Tensor):
            return False
        if isinstance(r, torch.Tensor) and (tuple(r.shape) != tuple(f.shape) or r.dtype != f.dtype):
            return False
    return True


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node it depends on, producers first."""
    seen: set[fx.Node] = set()
    order: list[fx.Node] = []
    stack: list[tuple[fx.Node, bool]] = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        stack.append((n, True))
        stack.extend((a, False) for a in n.all_input_nodes if a not in seen)
    return order


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A real tensor of ``t``'s shape and dtype whose values keep a program's structure:
    True for booleans (a check holds), zeros otherwise (an index in range, empty groups)."""
    out = _zeros_like(t)
    return out.fill_(True) if out.dtype == torch.bool else out


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tuple(int(d) for d in t.shape), dtype=t.dtype, device="cpu" if t.device.type == "meta" else t.device)


__all__ = ["DATA_DEPENDENT", "FakeReplay", "OutputTemplate", "TensorTemplate", "input_tensors", "module_signature", "quiet_meta_failures", "replay"]
