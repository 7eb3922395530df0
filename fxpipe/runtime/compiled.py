"""``Plan(compile=...)``: a stage's forward and backward run as compiled code.

:class:`CompiledStage` wraps one stage's GraphModule (fxpipe's own stage graph, with its
send/recv boundary, keyed random ops and, under zero-bubble schedules, the weight-gradient
deferral) in ``torch.compile``: Dynamo captures the stage's forward, AOTAutograd derives
its backward and partitions the joint graph into a forward and a backward graph, and
Inductor compiles both. The runner calls it where it would call the module, so recompute
(the forward run again under ``enable_grad`` in the backward: a second graph), keyed
dropout and loss scaling behave as in eager stages.

Each graph Dynamo hands the backend is timed (AOTAutograd compiles the backward with the
forward when the shapes are static), so :attr:`CompiledStage.graphs` and
:attr:`CompiledStage.seconds` say what compiling cost; ``pipe.summary()`` prints them. A
call Dynamo has seen before (same shapes, grad mode, train/eval) compiles nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

_COMPILE_LOCK = threading.Lock()  # two stages' first calls in two threads compile one after the other
_CALLING = threading.local()  # the CompiledStage whose call Dynamo is compiling for, per thread
_BACKENDS: dict[str, Callable] = {}  # one backend per options: Dynamo recompiles a frame for a new backend


class CompiledStage:
    """Stage ``index``'s module under ``torch.compile`` with ``options`` (the dict form of
    ``Plan.compile``; ``{}`` for True). ``graphs``: graphs compiled so far; ``seconds``:
    the time spent compiling them.

    Every stage with the same options shares one backend: helper functions the stage
    graphs call (fxpipe's keyed random ops, the weight-gradient deferral) are one code
    object for all stages, and Dynamo would compile them again for each new backend."""

    def __init__(self, index: int, module: nn.Module, options: Mapping[str, Any]) -> None:
        self.index = index
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
        return f"stage {self.index}: {self.graphs} graph(s) compiled in {self.seconds:.1f} s"


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
        return torch._TorchCompileInductorWrapper(options.get("mode"), options.get("options"), options.get("dynamic"))
    if isinstance(backend, str):
        return torch._dynamo.lookup_backend(backend)
    return backend


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
