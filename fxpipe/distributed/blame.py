"""The job's culprit, as its ranks named it, and each rank's process id: for the launcher.

A launcher sees processes exit; the first to exit is often not the one at fault (a rank
that was stopped exits last, when it is killed). The ranks know better: the first
failure a rank records (:meth:`fxpipe.distributed.faults.Watchdog.report`) names the rank
at fault. It is copied here under one key for the whole job, ``fxpipe/job/culprit``
(first writer wins), and every rank publishes its process id under ``fxpipe/job/pid/R``,
both signed with the job secret (:mod:`fxpipe.distributed.signing`), on the store the
launcher hosts (a ``PrefixStore`` the ranks see is unwrapped to that store, so the keys
are the same for every rank and for the launcher). The launcher then blames the rank the
ranks named, and ends it when it does not exit on its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from fxpipe.distributed.signing import publish_first, read_verified, sign

CULPRIT_KEY = "fxpipe/job/culprit"
PID_KEY = "fxpipe/job/pid/{rank}"


@dataclass(frozen=True)
class Culprit:
    """The rank the job's ranks named first, and their message."""

    rank: int
    message: str


def _root(store: Any) -> Any:
    """The store under any ``PrefixStore`` wrappers: the one the launcher hosts."""
    while getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store
    return store


def publish_pid(store: Any, rank: int) -> None:
    """Publish this process's id as ``rank``'s, for the launcher to end it if it stops."""
    key = PID_KEY.format(rank=rank)
    try:
        _root(store).set(key, sign(key, str(os.getpid())))
    except Exception:  # noqa: BLE001 - a store already gone: the watchdog's first wait names its host
        pass


def publish_culprit(store: Any, rank: int, message: str) -> None:
    """Name ``rank`` as the job's culprit unless a rank named one already."""
    publish_first(_root(store), CULPRIT_KEY, json.dumps({"rank": rank, "message": message}))


def read_culprit(store: Any, secret: str | None = None) -> Culprit | None:
    """The culprit the ranks named (signed with ``secret``, default the job's); None if none
    yet, or when the record is not genuine or the store does not answer."""
    try:
        payload = read_verified(store, CULPRIT_KEY, secret)
    except Exception:  # noqa: BLE001 - a store that does not answer names nobody
        return None
    if payload is None:
        return None
    data = json.loads(payload)
    return Culprit(int(data["rank"]), str(data["message"]))


def read_pid(store: Any, rank: int, secret: str | None = None) -> int | None:
    """``rank``'s process id as it published it; None when absent or not genuine."""
    try:
        payload = read_verified(store, PID_KEY.format(rank=rank), secret)
    except Exception:  # noqa: BLE001 - a store that does not answer names nobody
        return None
    return int(payload) if payload is not None else None
