"""Failing loudly instead of hanging: the plan check at start, and waits with a deadline.

Ranks share the process group's key-value store (torchrun's agent store, or the one the
launcher hosts), under a prefix per pipeline. Two things go through it:

- **The plan fingerprint.** Every rank publishes a digest of what it compiled (the plan,
  the world layout, each stage's code, parameters and edges) and compares it with every
  other rank's before any tensor moves. A mismatch names the ranks and what differs.
- **The first failure.** A rank whose stage raises, or that sees a peer's connection
  drop, records ``"rank r (stage s) ..."`` once (first writer wins). Every rank waits
  for communication through :meth:`Watchdog.wait`, which blocks in a helper thread and
  looks at the store every ``poll`` seconds: on a recorded failure, or when nothing
  arrived within the plan's timeout, it raises :class:`RankFailedError` naming the rank
  and stage at fault, so no rank hangs on a dead peer.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_POLL = 0.2  # seconds between looks at the store while a wait is pending
_GRACE = 1.0  # seconds to wait for a failing peer's own report before blaming the link


class RankFailedError(RuntimeError):
    """Another rank (or this one's peer link) failed; ``rank`` and ``stage`` name it."""

    def __init__(self, message: str, rank: int | None = None, stage: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage


class PlanMismatchError(RuntimeError):
    """Ranks compiled different plans or models; the message names them and the difference."""


class PeerLost(Exception):
    """A communication op failed because the link to ``peer`` broke."""

    def __init__(self, peer: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.peer = peer
        self.cause = cause


def _encode(message: str, rank: int | None, stage: int | None) -> str:
    return json.dumps({"message": message, "rank": rank, "stage": stage})


class Watchdog:
    """Waits on communication with a deadline and reports failures through the store.

    store: a c10d Store; prefix: this pipeline's key prefix; rank: this process's rank;
    stage_of_rank: a description of the stages each rank runs (for messages);
    first_stage: the first stage a rank runs (the ``stage`` of errors naming it);
    timeout: seconds a wait may last before the peer it waits on is declared failed.
    """

    def __init__(
        self, store: Any, prefix: str, rank: int, stage_of_rank: Callable[[int], str], first_stage: Callable[[int], int], timeout: float
    ) -> None:
        self.store = store
        self.key = f"{prefix}failure"
        self.rank = rank
        self.stage_of_rank = stage_of_rank
        self.first_stage = first_stage
        self.timeout = timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- reporting
    def report(self, message: str, rank: int, stage: int | None = None) -> RankFailedError:
        """Record a failure (unless one already is) and return the error for the first one."""
        try:
            self.store.compare_set(self.key, "", _encode(message, rank, stage))
        except Exception:  # noqa: BLE001 - the store itself may be gone: keep our own report
            return RankFailedError(message, rank, stage)
        return self.recorded() or RankFailedError(message, rank, stage)

    def recorded(self) -> RankFailedError | None:
        """The failure another rank recorded, if any."""
        try:
            if not self.store.check([self.key]):
                return None
            data = json.loads(self.store.get(self.key))
        except Exception as err:  # noqa: BLE001 - an unreachable store means its host died
            return RankFailedError(f"the rendezvous store is unreachable ({err}); its host process died", None, None)
        return RankFailedError(data["message"], data["rank"], data["stage"])

    # ------------------------------------------------------------------ waiting
    def wait(self, works: Sequence[tuple[Any, int]], what: Callable[[], str]) -> None:
        """Wait for every ``(work, peer)``; raise RankFailedError instead of hanging.

        ``what()`` describes what is awaited (for the timeout message).
        """
        pending = []
        for work, peer in works:
            if not work.is_completed():
                pending.append((work, peer))
                continue
            try:
                work.wait()  # already done: returns at once, or raises what went wrong
            except Exception as err:  # noqa: BLE001 - the link to that peer broke
                raise self._lost(PeerLost(peer, err)) from err
        works = pending
        if not works:
            return  # the common case with prefetched receives: no thread hand-off
        done = threading.Event()
        outcome: list[BaseException] = []
        self._submit((works, done, outcome))
        deadline = time.monotonic() + self.timeout
        while not done.wait(_POLL):
            failure = self.recorded()
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                peers = sorted({peer for _, peer in works})
                names = ", ".join(f"rank {p} ({self.stage_of_rank(p)})" for p in peers)
                raise self.report(
                    f"rank {self.rank} waited {self.timeout:.0f} s for {what()} from {names}: "
                    "that rank is stuck or dead (raise Plan(timeout=...) if it is only slow)",
                    peers[0],
                    self.first_stage(peers[0]),
                )
        if outcome:
            err = outcome[0]
            if isinstance(err, PeerLost):
                raise self._lost(err)
            raise err

    def _lost(self, err: PeerLost) -> RankFailedError:
        end = time.monotonic() + _GRACE
        while time.monotonic() < end:
            failure = self.recorded()
            if failure is not None:
                return failure
            time.sleep(0.05)
        failure = self.report(
            f"rank {err.peer} ({self.stage_of_rank(err.peer)}) died or dropped its connection "
            f"(seen by rank {self.rank}: {err.cause})",
            err.peer,
            self.first_stage(err.peer),
        )
        failure.__cause__ = err.cause
        return failure

    def _submit(self, job: tuple) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="fxpipe-comm-wait", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            works, done, outcome = self._jobs.get()
            for work, peer in works:
                try:
                    work.wait()
                except Exception as err:  # noqa: BLE001 - handed to the waiting thread
                    outcome.append(PeerLost(peer, err))
                    break
            done.set()


def fingerprint(parts: dict[str, str]) -> dict[str, str]:
    """Digest of each named part of a compiled plan, plus ``"all"`` over them all."""
    digests = {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in parts.items()}
    digests["all"] = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    return digests


def check_same_plan(store: Any, prefix: str, rank: int, world: int, parts: dict[str, str], summary: str, timeout: float) -> None:
    """Compare this rank's plan fingerprint with every other rank's, before anything runs.

    Raises PlanMismatchError naming the ranks that differ from rank 0 and the parts that
    differ (``plan``, ``layout``, ``stage 2`` ...), RankFailedError naming the ranks that
    did not reach this point within ``timeout`` seconds.
    """
    import datetime

    mine = fingerprint(parts)
    store.set(f"{prefix}plan/{rank}", json.dumps({"digests": mine, "summary": summary}))
    keys = [f"{prefix}plan/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as err:  # noqa: BLE001 - a store timeout: name who is missing
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RankFailedError(
            f"rank(s) {missing} did not finish compiling within {timeout:.0f} s (they crashed, or run "
            f"a different script): {err}",
            missing[0] if missing else None,
        ) from err
    reference = json.loads(store.get(keys[0]))
    problems = []
    for r in range(world):
        theirs = reference if r == 0 else json.loads(store.get(keys[r]))
        if theirs["digests"]["all"] == reference["digests"]["all"]:
            continue
        diff = sorted(k for k in reference["digests"] if k != "all" and theirs["digests"].get(k) != reference["digests"][k])
        problems.append(f"rank {r} differs from rank 0 in {', '.join(diff)}: rank 0 has {reference['summary']}; rank {r} has {theirs['summary']}")
    if problems:
        raise PlanMismatchError(
            "ranks compiled different pipelines; every rank must run the same script with the same "
            "model, plan and example inputs:\n  " + "\n  ".join(problems)
        )
