"""Failing loudly instead of hanging: the plan check at start, and waits with a deadline.

Ranks share the process group's key-value store (torchrun's agent store, or the one the
launcher hosts), under a prefix per pipeline. Two things go through it:

- **The plan fingerprint.** Every rank publishes a digest of what it compiled (the plan,
  the world layout, each stage's code, parameters and edges) and compares it with every
  other rank's before any tensor moves. A mismatch names the ranks and what differs.
- **What each rank is doing.** A heartbeat thread per rank publishes, every half second,
  whether it runs an action (which, for how long) or waits (for which ranks), with a
  counter that advances on every beat.
- **The first failure.** A rank whose stage raises, or that sees a peer's connection
  drop, records ``"rank r (stage s) ..."`` once (first writer wins). Every rank waits
  for communication through :meth:`Watchdog.wait`, which blocks in a helper thread and
  looks at the store every ``poll`` seconds: on a recorded failure it raises that one;
  when nothing arrived within the plan's timeout, or a link broke, it follows the
  published waits from the ranks it waited for to the one that is stuck running, or
  whose heartbeat stopped, and records that rank: :class:`RankFailedError` names the
  culprit, not the neighbour that was waiting on it.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from fxpipe.distributed.signing import publish_first, read_verified

_POLL = 0.2  # seconds between looks at the store while a wait is pending
_GRACE = 1.0  # seconds to wait for a failing peer's own report before blaming the link
_BEAT = 0.5  # seconds between a rank's published states


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

    def __init__(self, peer: int | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.peer = peer
        self.cause = cause


def _encode(message: str, rank: int | None, stage: int | None) -> str:
    return json.dumps({"message": message, "rank": rank, "stage": stage})


class Watchdog:
    """Waits on communication with a deadline; names the rank at fault, exactly.

    store: a c10d Store; prefix: this pipeline's key prefix; rank / world: this process and
    the world size; stage_of_rank: a description of the stages each rank runs (for
    messages); first_stage: the first stage a rank runs (the ``stage`` of errors naming
    it); timeout: seconds a wait may last.

    Every rank publishes what it is doing (running an action, or waiting for which ranks)
    to the store from a heartbeat thread every ``_BEAT`` seconds, with a counter that
    advances on each beat. A wait that outlasts the timeout does not blame the peer it
    waits for, which may itself be waiting: it follows the chain of published waits to the
    rank that is running (for longer than it should) or whose heartbeat stopped (killed,
    or stuck holding the interpreter), and records that one.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        stage_of_rank: Callable[[int], str],
        first_stage: Callable[[int], int],
        timeout: float,
        world: int | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.key = f"{prefix}failure"
        self.rank = rank
        self.world = world if world is not None else rank + 1
        self.stage_of_rank = stage_of_rank
        self.first_stage = first_stage
        self.timeout = timeout
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # (phase, what, peers, since): set by the calling thread, published by the heartbeat
        self._doing: tuple[str, str, tuple[int, ...], float] = ("running", "set-up", (), time.monotonic())
        self._beat = threading.Thread(target=_heartbeat, args=(weakref.ref(self), store, f"{prefix}state/{rank}"), name="fxpipe-heartbeat", daemon=True)
        self._beat.start()

    # ---------------------------------------------------------------- state
    def running(self, what: str) -> None:
        """This rank now computes ``what`` (an action such as ``F2:3``)."""
        self._doing = ("running", what, (), time.monotonic())

    def _state(self, count: int) -> str:
        phase, what, peers, since = self._doing
        return json.dumps({"n": count, "phase": phase, "what": what, "peers": list(peers), "elapsed": time.monotonic() - since})

    def _read_states(self) -> dict[int, dict]:
        states = {}
        for r in range(self.world):
            try:
                states[r] = json.loads(self.store.get(f"{self.prefix}state/{r}")) if self.store.check([f"{self.prefix}state/{r}"]) else None
            except Exception:  # noqa: BLE001 - the store is gone with its host
                states[r] = None
        return states

    def culprit(self, peers: Sequence[int]) -> tuple[int, str]:
        """The rank at the end of the chain of waits that starts at ``peers``, and why.

        Reads every rank's published state twice, two beats apart: a rank whose counter did
        not move is dead or stuck; a running rank ends a chain; a waiting one passes the
        blame on to the ranks it waits for.
        """
        first = self._read_states()
        time.sleep(2.5 * _BEAT)
        second = self._read_states()
        dead = {r for r in range(self.world) if r != self.rank and (second[r] is None or (first[r] is not None and second[r]["n"] == first[r]["n"]))}
        running: list[tuple[float, int, str]] = []  # (seconds running, rank, why) at the chains' ends
        for start in peers:
            seen: set[int] = set()
            r = start
            while r not in seen:
                seen.add(r)
                state = second.get(r)
                if r in dead:
                    doing = f" while {state['phase']} {state['what']}" if state else ""
                    return r, f"rank {r} ({self.stage_of_rank(r)}) stopped responding{doing}: it died or is stuck"
                if state["phase"] == "running":
                    running.append((state["elapsed"], r, f"rank {r} ({self.stage_of_rank(r)}) has been running {state['what']} for {state['elapsed']:.1f} s"))
                    break
                nxt = [q for q in state["peers"] if q not in seen and q != self.rank]
                if not nxt:
                    break
                r = nxt[0]
        if running:
            _, r, why = max(running)
            return r, why
        r = peers[0]
        return r, f"rank {r} ({self.stage_of_rank(r)}) did not answer"

    # ---------------------------------------------------------------- reporting
    def report(self, message: str, rank: int | None, stage: int | None = None) -> RankFailedError:
        """Record a failure (unless one already is) and return the error for the first one."""
        self._doing = ("failed", message[:200], (), time.monotonic())
        try:
            data = json.loads(publish_first(self.store, self.key, _encode(message, rank, stage)))
        except Exception:  # noqa: BLE001 - the store itself may be gone: keep our own report
            return RankFailedError(message, rank, stage)
        return RankFailedError(data["message"], data["rank"], data["stage"])

    def recorded(self) -> RankFailedError | None:
        """The failure a rank of this job recorded, if any (signed records only, when the
        launcher gave the job a secret: a record forged by another process is ignored)."""
        try:
            payload = read_verified(self.store, self.key)
            if payload is None:
                return None
            data = json.loads(payload)
        except Exception as err:  # noqa: BLE001 - an unreachable store means its host died
            return RankFailedError(f"the rendezvous store is unreachable ({err}); its host process died", None, None)
        return RankFailedError(data["message"], data["rank"], data["stage"])

    # ------------------------------------------------------------------ waiting
    def wait(self, works: Sequence[tuple[Any, int | None]], what: Callable[[], str], peers: Sequence[int] | None = None) -> None:
        """Wait for every ``(work, peer)``; raise RankFailedError instead of hanging.

        ``what()`` describes what is awaited; ``peers``: the ranks the wait depends on (a
        collective's group; default the works' peers). A wait that outlasts the timeout,
        or a broken link, names the rank found by :meth:`culprit`.
        """
        peers = tuple(peers) if peers is not None else tuple(sorted({p for _, p in works if p is not None}))
        pending = []
        for work, peer in works:
            if not work.is_completed():
                pending.append((work, peer))
                continue
            try:
                work.wait()  # already done: returns at once, or raises what went wrong
            except Exception as err:  # noqa: BLE001 - the link to that peer broke
                raise self._lost(PeerLost(peer, err), peers) from err
        works = pending
        if not works:
            return  # the common case with prefetched receives: no thread hand-off
        previous = self._doing
        self._doing = ("waiting", what(), peers, time.monotonic())
        done = threading.Event()
        outcome: list[BaseException] = []
        self._submit((works, done, outcome))
        deadline = time.monotonic() + self.timeout
        while not done.wait(_POLL):
            failure = self.recorded()
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                culprit, why = self.culprit(peers or (self.rank,))
                raise self.report(
                    f"{why}; rank {self.rank} waited {self.timeout:.0f} s for {what()} "
                    "(raise Plan(timeout=...) if it is only slow)",
                    culprit,
                    self.first_stage(culprit),
                )
        self._doing = previous
        if outcome:
            err = outcome[0]
            if isinstance(err, PeerLost):
                raise self._lost(err, peers)
            raise err

    def lost(self, cause: BaseException, peers: Sequence[int]) -> RankFailedError:
        """The error for a communication op that failed at once with ``cause`` (posting to a
        peer that is gone): the rank at fault among ``peers``' chains."""
        return self._lost(PeerLost(peers[0] if len(peers) == 1 else None, cause), peers)

    def _lost(self, err: PeerLost, peers: Sequence[int]) -> RankFailedError:
        """A link broke: the rank that failed first is recorded by now, or is found."""
        end = time.monotonic() + _GRACE
        while time.monotonic() < end:
            failure = self.recorded()
            if failure is not None:
                return failure
            time.sleep(0.05)
        culprit, why = self.culprit([err.peer] if err.peer is not None else list(peers) or [self.rank])
        failure = self.report(f"{why} (seen by rank {self.rank}: {err.cause})", culprit, self.first_stage(culprit))
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


def _heartbeat(watchdog: weakref.ref, store: Any, key: str) -> None:
    """Publish the watchdog's state every beat while it lives (a thread of its own, so a
    rank busy in a long op, or sleeping, still beats; one stuck holding the interpreter
    stops)."""
    count = 0
    while True:
        dog = watchdog()
        if dog is None:
            return
        try:
            store.set(key, dog._state(count))
        except Exception:  # noqa: BLE001 - the store went away with its host: nothing to publish to
            return
        del dog
        count += 1
        time.sleep(_BEAT)


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
