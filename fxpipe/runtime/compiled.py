"""``Plan(compile=...)``: a stage's forward and backward run as compiled code.

:class:`CompiledStage` wraps one stage's GraphModule (fxpipe's own stage graph, with its
send/recv boundary, keyed random ops and, under zero-bubble schedules, the weight-gradient
deferral) in ``torch.compile``: Dynamo captures the stage's forward, AOTAutograd derives
its backward and partitions the joint graph into a forward and a backward graph, and
Inductor compiles both. The runner calls it where it would call the module, so recompute
(the forward run again under ``enable_grad`` in the backward: a second graph), keyed
dropout and loss scaling behave as in eager stages.

Under a zero-bubble schedule (``split=True``) the backward Inductor compiles is split into
I (input gradients) and W (weight gradients), both compiled, as
:mod:`fxpipe.runtime.split_backward` describes: the runner sets :attr:`CompiledStage.store`
to the list W goes to while it runs the backward.

Each graph compiled is counted and timed: what Dynamo hands the backend (with Inductor,
AOTAutograd's forward graph) and, with Inductor, each backward graph AOTAutograd compiles
at the first backward (two under zero bubble: I and W). :attr:`CompiledStage.graphs` and
:attr:`CompiledStage.seconds` say what compiling cost; ``pipe.summary()`` prints them. A
call Dynamo has seen before (same shapes, grad mode, train/eval) compiles nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn

from fxpipe.runtime.split_backward import compile_backward

_COMPILE_LOCK = threading.Lock()  # two stages' first calls in two threads compile one after the other
_CALLING = threading.local()  # the CompiledStage whose call Dynamo is compiling for, per thread
_BACKENDS: dict[str, Callable] = {}  # one backend per options: Dynamo recompiles a frame for a new backend


class CompiledStage:
    """Stage ``index``'s module under ``torch.compile`` with ``options`` (the dict form of
    ``Plan.compile``; ``{}`` for True); ``split``: its backward runs as I and W. ``graphs``:
    graphs compiled so far; ``seconds``: the time spent compiling them; ``store``: where a
    split backward's W goes (None: W runs in the backward).

    Every stage with the same options shares one backend: helper functions the stage
    graphs call (fxpipe's keyed random ops, the weight-gradient deferral) are one code
    object for all stages, and Dynamo would compile them again for each new backend."""

    def __init__(self, index: int, module: nn.Module, options: Mapping[str, Any], split: bool = False) -> None:
        self.index = index
        self.module = module
        self.split = split
        self.store: list | None = None
        self.graphs = 0
        self.seconds = 0.0
        options = dict(options)
        self._call = torch.compile(module, backend=_shared_backend(options), fullgraph=options.get("fullgraph", False), dynamic=options.get("dynamic"))

    def __call__(self, *args: Any) -> Any:
        _CALLING.stage = self
        try:
            if self.graphs == 0:
                with _COMPILE_LOCK:
                    return self._call(*args)
            return self._call(*args)
        finally:
            _CALLING.stage = None

    def describe(self) -> str:
        """One line: what was compiled and how long it took."""
        split = ", backward split into I and W" if self.split else ""
        return f"stage {self.index}: {self.graphs} graph(s) compiled in {self.seconds:.1f} s{split}"

    @contextlib.contextmanager
    def deferring(self, store: list | None) -> Any:
        """A backward run in this block sends its W to ``store`` (None: runs it at once)."""
        self.store = store
        try:
            yield
        finally:
            self.store = None


def _shared_backend(options: dict[str, Any]) -> Callable:
    key = repr(sorted((k, v) for k, v in options.items() if k != "fullgraph"))
    if key not in _BACKENDS:
        _BACKENDS[key] = _timed(_backend(options))
    return _BACKENDS[key]


def _backend(options: dict[str, Any]) -> Callable:
    """The backend ``torch.compile`` would build for these options: Inductor with its mode
    and options, or the named backend."""
    backend = options.get("backend", "inductor")
    if backend == "inductor":
        return functools.partial(_inductor, torch._TorchCompileInductorWrapper(options.get("mode"), options.get("options"), options.get("dynamic")))
    if isinstance(backend, str):
        return torch._dynamo.lookup_backend(backend)
    return backend


def _inductor(wrapper: Any, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor as ``wrapper`` (what ``torch.compile`` builds for the options) runs it, each
    backward graph compiled by :func:`_inner`: counted, and split for a zero-bubble stage.
    For those AOTAutograd's cache is left out (a cached backward would not be split), and
    so are donated buffers: I would reuse the memory of saved activations W reads later."""
    # as torch.compile does: Inductor loads when it is used
    from torch._inductor.compile_fx import compile_fx

    stage = getattr(_CALLING, "stage", None)
    inner = functools.partial(_inner, stage, _parameter_names(stage, example_inputs))
    split = stage is not None and stage.split
    with functorch_config.patch(enable_autograd_cache=False, donated_buffer=False) if split else contextlib.nullcontext():
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=wrapper.config)


def _parameter_names(stage: CompiledStage | None, example_inputs: Sequence[Any]) -> list[str | None]:
    """Per graph input, the name of the stage parameter it is (None for the others, and
    for all when the backward is not split)."""
    if stage is None or not stage.split:
        return [None] * len(example_inputs)
    names = {id(p): name for name, p in stage.module.named_parameters()}
    return [names.get(id(t)) for t in example_inputs]


def _inner(stage: CompiledStage | None, names: list[str | None], gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable:
    if not options.get("is_backward") or stage is None:
        from torch._inductor.compile_fx import compile_fx_inner

        return compile_fx_inner(gm, example_inputs, **options)
    return compile_backward(gm, example_inputs, options, stage, names)


def _timed(backend: Callable) -> Callable:
    """``backend``, each graph it compiles counted and timed on the stage being called."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        compiled = backend(gm, example_inputs)
        record = getattr(_CALLING, "stage", None)
        if record is not None:
            record.seconds += time.perf_counter() - start
            record.graphs += 1
        return compiled

    return compile_graph


def compile_options(setting: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``Plan.compile`` as ``torch.compile`` options, or None for eager stages."""
    if setting is False:
        return None
    return {} if setting is True else dict(setting)
