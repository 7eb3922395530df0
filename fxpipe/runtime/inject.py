"""Fault injection, a testing tool: kill, stop, hang, raise or return NaN at a chosen action.

Off unless asked. ``FXPIPE_INJECT`` lists the faults, one or more separated by ``;``::

    FXPIPE_INJECT="hang:rank=2:action=F2:1"
    FXPIPE_INJECT="raise:action=B1:0:step=2;nan:action=F0:3"

Each fault is ``KIND:action=A[:rank=R][:step=N][:seconds=S]``:

- ``kill``: the process sends itself SIGKILL (distributed runs only: the local executor
  ignores it, since it would end the caller too);
- ``stop``: the process sends itself SIGSTOP, as a rank frozen by a debugger, a swapped-out
  host or a hung driver (distributed runs only, as ``kill``): alive to the operating
  system, silent to its peers, until something kills it;
- ``hang``: the action sleeps ``seconds`` (default 3600) before it runs;
- ``raise``: the action raises :class:`InjectedFault`;
- ``nan``: every floating tensor the stage's forward returns becomes NaN (F actions only);
- ``action``: the action it strikes, as the schedule prints it (``F2:1`` is the forward
  of stage 2 on micro-batch 1, ``B0:3`` a backward);
- ``rank``: the rank it strikes in a distributed run (default: whichever runs the
  action); the local executor ignores it, the action names the stage;
- ``step``: strike the N-th time this process reaches the action (default 1; every step
  runs each action once, so ``step=2`` lets one clean step run first).

The variable is read once per process, at its first pipeline call (so a rank forked from
a server that imported fxpipe reads its own environment). The action loop both executors
run calls :meth:`Faults.fire` once an action's inputs have arrived, just before it runs,
only when faults are armed: without them the hot path pays one check of an attribute. :func:`injected` arms faults for a
block of code in this process, for tests that run the local executor.

``FXPIPE_INJECT_LOG`` names a file that every fault appends one JSON line to (kind,
action, rank, wall-clock time) just before it strikes, so a test measures the time from
the fault to each rank's error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

ENV = "FXPIPE_INJECT"
LOG_ENV = "FXPIPE_INJECT_LOG"
KINDS = ("kill", "stop", "hang", "raise", "nan")
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}  # sent to this process
_ACTION = re.compile(r"^[A-Z]\d+:\d+$")
_FIELD = re.compile(r"(\w+)=(.*?)(?=:\w+=|$)")


class FaultSpecError(ValueError):
    """``FXPIPE_INJECT`` (or :func:`injected`'s argument) is malformed; the message says how."""


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault throws."""


@dataclass
class Fault:
    """One fault: ``kind`` strikes ``action`` (``"F2:1"``) on ``rank`` (None: any) the
    ``step``-th time the process reaches it; a hang lasts ``seconds``."""

    kind: str
    action: str
    rank: int | None = None
    step: int = 1
    seconds: float = 3600.0
    reached: int = 0

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return f"{self.kind} at {self.action}{where} (time {self.step} it runs)"


def parse(text: str) -> list[Fault]:
    """The faults ``text`` describes (see the module docstring); [] for an empty text.

    Raises FaultSpecError naming the part that is wrong and the form to write.
    """
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, rest = part.partition(":")
        if kind not in KINDS:
            raise FaultSpecError(f"{ENV}: fault {part!r} has kind {kind!r}; write one of {', '.join(KINDS)} first, e.g. 'hang:rank=2:action=F2:1'")
        fields = dict(_FIELD.findall(rest))
        unknown = sorted(set(fields) - {"action", "rank", "step", "seconds"})
        if unknown or not re.fullmatch(r"(\w+=.*?)(:\w+=.*?)*", rest):
            raise FaultSpecError(f"{ENV}: fault {part!r}: write KIND:action=A[:rank=R][:step=N][:seconds=S] (unknown or malformed {unknown or rest!r})")
        action = fields.get("action", "")
        if not _ACTION.match(action):
            raise FaultSpecError(f"{ENV}: fault {part!r} needs action=OP STAGE:MICROBATCH as the schedule prints it, e.g. action=F2:1")
        if kind == "nan" and not action.startswith("F"):
            raise FaultSpecError(f"{ENV}: fault {part!r}: a nan fault poisons a forward's outputs; give an F action")
        try:
            fault = Fault(
                kind,
                action,
                int(fields["rank"]) if "rank" in fields else None,
                int(fields.get("step", 1)),
                float(fields.get("seconds", 3600.0)),
            )
        except ValueError:
            raise FaultSpecError(f"{ENV}: fault {part!r}: rank and step are integers, seconds a number") from None
        if fault.step < 1 or fault.seconds < 0:
            raise FaultSpecError(f"{ENV}: fault {part!r}: step counts from 1 and seconds is not negative")
        faults.append(fault)
    return faults


class Faults:
    """The faults armed in this process, by the action they strike."""

    def __init__(self, faults: list[Fault]) -> None:
        self.by_action: dict[str, list[Fault]] = {}
        for fault in faults:
            self.by_action.setdefault(fault.action, []).append(fault)
        self._lock = threading.Lock()  # local workers reach actions from several threads

    def fire(self, action: Any, module: torch.nn.Module, rank: int | None = None) -> None:
        """Strike ``action`` (an Action) if a fault is armed for it: kill, hang or raise
        here (or stop); for ``nan``, poison the outputs of ``module``'s next forward. ``rank``:
        this process's rank, None in the local executor (rank filters, kill and stop faults
        then do not apply). Raises InjectedFault for a ``raise`` fault."""
        for fault in self.by_action.get(str(action), ()):
            if rank is not None and fault.rank is not None and fault.rank != rank:
                continue
            if rank is None and fault.kind in _SIGNALS:
                continue
            with self._lock:
                fault.reached += 1
                if fault.reached != fault.step:
                    continue
            _log(fault, rank)
            if fault.kind in _SIGNALS:
                os.kill(os.getpid(), _SIGNALS[fault.kind])
            elif fault.kind == "hang":
                time.sleep(fault.seconds)
            elif fault.kind == "raise":
                where = f" on rank {rank}" if rank is not None else ""
                raise InjectedFault(f"injected fault: raise at {action}{where}")
            else:
                _poison_next_forward(module)


def _poison_next_forward(module: torch.nn.Module) -> None:
    def poison(mod: torch.nn.Module, args: Any, output: Any) -> Any:
        handle.remove()
        # multiplied rather than replaced, so the autograd graph stays as it was
        return pytree.tree_map_only(torch.Tensor, lambda t: t * float("nan") if t.is_floating_point() else t, output)

    handle = module.register_forward_hook(poison)


def _log(fault: Fault, rank: int | None) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps({"kind": fault.kind, "action": fault.action, "rank": rank, "time": time.time()})
    with open(path, "a") as log:  # written before a kill: the line survives the process
        log.write(line + "\n")


_armed: tuple[int, Faults | None] = (-1, None)  # (pid that read the environment, its faults)
_override: list[Faults | None] = []


def armed() -> Faults | None:
    """The faults armed in this process (None when none): those of :func:`injected`'s
    innermost block, else ``FXPIPE_INJECT``, read once per process. Raises
    FaultSpecError when the variable is malformed."""
    global _armed
    if _override:
        return _override[-1]
    pid = os.getpid()
    if _armed[0] != pid:
        faults = parse(os.environ.get(ENV, ""))
        _armed = (pid, Faults(faults) if faults else None)
    return _armed[1]


@contextlib.contextmanager
def injected(spec: str) -> Iterator[Faults]:
    """Arm the faults ``spec`` describes (``FXPIPE_INJECT``'s syntax) in this process for
    the block, instead of the environment's; yields them (``reached`` counts per fault).
    Raises FaultSpecError for a malformed ``spec``."""
    faults = Faults(parse(spec))
    _override.append(faults)
    try:
        yield faults
    finally:
        _override.remove(faults)
