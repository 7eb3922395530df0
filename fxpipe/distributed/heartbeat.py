"""What every rank is doing, published in the job's store for the others to read.

Each rank's :class:`Beacon` holds its current :class:`Doing` (running an action of a stage,
or waiting, and then for which ranks and which of their stages) and a thread of its own
publishes it under ``{prefix}state/{rank}``: at once when it changes (at most every
``_MIN_GAP`` seconds, so a fast loop of actions costs one store write per gap) and every
``BEAT`` seconds regardless, with a counter that advances on every write. The thread keeps
beating while the rank computes or sleeps in a C call; it stops when the process dies or
holds the interpreter. A reader tells the three apart by reading twice (:func:`read_states`).

Records are signed with the job secret (:mod:`fxpipe.distributed.signing`), so a process
outside the job cannot make a rank look busy, waiting or dead: a record that does not
verify reads as absent.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from fxpipe.distributed.signing import sign, verify
from fxpipe.distributed.teardown import retire

BEAT = 0.5  # seconds between a rank's writes when nothing changes
_MIN_GAP = 0.02  # seconds between two writes at least


@dataclass(frozen=True)
class Doing:
    """A rank's state: ``phase`` "running", "waiting" or "failed"; ``what`` it runs or
    awaits ("F2:1", "the inputs of B1:0", "compiling"); ``stage`` the stage it is on (None
    outside actions); ``waits`` (rank, stage awaited or None) for each rank it waits on;
    ``since``: monotonic start time."""

    phase: str
    what: str
    stage: int | None = None
    waits: tuple[tuple[int, int | None], ...] = ()
    since: float = field(default_factory=time.monotonic)


class Beacon:
    """Publishes one rank's :class:`Doing` to ``store`` under ``key`` from its own thread."""

    def __init__(self, store: Any, key: str) -> None:
        self.doing = Doing("running", "set-up")
        self._store = store
        self._key = key
        self._count = 0
        self._published_stage: int | None = None
        self._lock = threading.Lock()  # one writer at a time, so the store holds the latest state
        self._changed = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=_publish, args=(weakref.ref(self), self._changed, self._stopped), name="fxpipe-heartbeat", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop publishing and join the thread (idempotent). A thread still inside the
        store's C++ client after ``timeout`` seconds (a stopped store host) is left to
        :mod:`fxpipe.distributed.teardown`, which keeps it from aborting the process at exit."""
        self._stopped.set()
        self._changed.set()
        retire(self._thread, timeout)

    def set(self, doing: Doing, exact_stage: bool = False) -> None:
        """Make ``doing`` this rank's state; the thread publishes it within ``_MIN_GAP``.

        ``exact_stage``: if the published state names another stage, publish this one
        before returning (one store write, a few microseconds), so that the stage is known
        even if the process dies right after.
        """
        self.doing = doing
        if exact_stage:
            with self._lock:
                if self._published_stage != doing.stage:
                    self._write()
                    return
        self._changed.set()

    def write(self) -> bool:
        """Publish the current state; False when the store is gone."""
        with self._lock:
            return self._write()

    def _write(self) -> bool:
        d = self.doing
        record = json.dumps(
            {"n": self._count, "phase": d.phase, "what": d.what, "stage": d.stage, "waits": d.waits, "elapsed": time.monotonic() - d.since}
        )
        self._count += 1
        try:
            self._store.set(self._key, sign(self._key, record))
        except Exception:  # noqa: BLE001 - the store went away with its host: nothing to publish to
            return False
        self._published_stage = d.stage
        return True


def _publish(beacon: weakref.ref, changed: threading.Event, stopped: threading.Event) -> None:
    """The heartbeat loop, while the beacon lives (a weak reference: the pipeline owning it
    can be collected), is not closed, and its store answers."""
    while not stopped.is_set():
        owner = beacon()
        if owner is None:
            return
        changed.clear()
        if not owner.write():
            return
        del owner
        if stopped.wait(_MIN_GAP):
            return
        changed.wait(BEAT - _MIN_GAP)


def read_states(store: Any, prefix: str, world: int) -> dict[int, dict | None]:
    """Every rank's last published state (None: never published, not genuine, or the store
    is unreachable); a dict with n, phase, what, stage, waits and elapsed."""
    states: dict[int, dict | None] = {}
    for r in range(world):
        key = f"{prefix}state/{r}"
        try:
            payload = verify(key, store.get(key)) if store.check([key]) else None
            states[r] = json.loads(payload) if payload is not None else None
        except Exception:  # noqa: BLE001 - an unreachable store or a malformed record: nothing known
            states[r] = None
    return states
