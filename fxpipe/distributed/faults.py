"""Failing loudly instead of hanging: waits with a deadline that name the rank at fault.

Ranks share the job's key-value store (torchrun's agent store, the one fxpipe's launcher
hosts, or rank 0's), under a prefix per pipeline. Three things go through it:

- **What each rank is doing** (:mod:`fxpipe.distributed.heartbeat`): running an action of
  a stage, or waiting, and then for which ranks and which of their stages, with a counter
  that a live rank advances every half second.
- **Meeting points at start-up** (:meth:`Watchdog.gather`): every rank publishes a value
  (its plan fingerprint) and reads everyone's, watching for failures while it waits.
- **The first failure.** A rank whose stage raises, or that sees a peer's connection
  drop, records ``"rank r (stage s) ..."`` once (first writer wins, signed with the job
  secret). Every rank waits for communication through :meth:`Watchdog.wait`, which
  blocks in a helper thread and looks at the store every ``_POLL`` seconds: on a recorded
  failure it raises that one; when nothing arrived within the plan's timeout, or a link
  broke, :meth:`Watchdog.culprit` follows the published waits from the ranks it waited
  for to the one that is stuck running, or whose heartbeat stopped, and records that rank.
  The first record is copied to the job-wide key a launcher reads
  (:mod:`fxpipe.distributed.blame`), where each rank also publishes its process id.

Blame is exact because every wait says whom it waits for: a receive names its peer rank
and the stage whose output it needs, a collective its group. A rank that is alive and
waiting passes the blame on; the first rank in the chain that runs (for longer than the
timeout) or is silent is the culprit, with the stage it runs or, for a silent rank, the
stage it was last seen on (a rank publishes a move to another stage before it starts
there; within a stage its last state may be a moment old).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fxpipe.distributed.blame import publish_culprit, publish_pid
from fxpipe.distributed.heartbeat import BEAT, Beacon, Doing, read_states
from fxpipe.distributed.signing import publish_first, read_verified, sign, verify
from fxpipe.distributed.teardown import note_failure, retire

_POLL = 0.2  # seconds between looks at the store while a wait is pending
_GRACE = 1.0  # seconds to wait for a failing peer's own report before blaming the link


class RankFailedError(RuntimeError):
    """Another rank (or this one's peer link) failed; ``rank`` and ``stage`` name it."""

    def __init__(self, message: str, rank: int | None = None, stage: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage


class PlanMismatchError(RankFailedError):
    """Ranks compiled different plans or models; the message names them and the difference,
    ``rank`` the first rank that differs from rank 0."""


class PeerLost(Exception):
    """A communication op failed because the link to ``peer`` broke."""

    def __init__(self, peer: int | None, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.peer = peer
        self.cause = cause


def _encode(message: str, rank: int | None, stage: int | None) -> str:
    return json.dumps({"message": message, "rank": rank, "stage": stage})


def _no_stages(rank: int, stage: int | None = None) -> str:
    return f"stage {stage}" if stage is not None else ""


def _finish(works: list[tuple[Any, int | None]], done: threading.Event, outcome: list[BaseException]) -> None:
    """Wait for ``works`` on the wait thread, then let go of them (their tensors are the
    step's received and sent buffers) and wake the waiting thread."""
    for work, peer in works:
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(PeerLost(peer, err))
            break
    works.clear()
    done.set()


class Watchdog:
    """Waits on communication with a deadline; names the rank at fault, exactly.

    store: a c10d Store shared by the job; prefix: this pipeline's key prefix; rank / world:
    this process and the world size; timeout: seconds a wait may last; store_host: the rank
    whose process hosts the store (rank 0 under a plain env:// rendezvous; None when a
    launcher's agent does), blamed when the store becomes unreachable. Until
    :meth:`assign` gives the layout, ranks are named without their stages.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout: float, store_host: int | None = None) -> None:
        self.store = store
        self.prefix = prefix
        self.key = f"{prefix}failure"
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.store_host = store_host
        self.where: Callable[[int, int | None], str] = _no_stages
        self.first_stage: Callable[[int], int | None] = lambda r: None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._beacon = Beacon(store, f"{prefix}state/{rank}")
        publish_pid(store, rank)
        _LIVE.add(self)

    def assign(self, where: Callable[[int, int | None], str], first_stage: Callable[[int], int]) -> None:
        """Name ranks by their stages from now on: ``where(rank, stage)`` describes rank's
        stage (or its stages, for None); ``first_stage(rank)`` is its first stage."""
        self.where = where
        self.first_stage = first_stage

    def _name(self, rank: int, stage: int | None = None) -> str:
        where = self.where(rank, stage)
        return f"rank {rank} ({where})" if where else f"rank {rank}"

    # ---------------------------------------------------------------- state
    def running(self, what: str, stage: int | None = None) -> None:
        """This rank now computes ``what`` (an action such as ``F2:3``, of ``stage``; or a
        phase of start-up such as ``compiling``).

        The stage is published before this returns whenever the published state names
        another (a few times a step): a rank that dies is named with the stage it was on,
        which for a rank holding several stages (interleaved schedules) the other ranks
        cannot tell otherwise. Within a stage, the heartbeat thread publishes the change a
        moment later.
        """
        self._beacon.set(Doing("running", what, stage), exact_stage=stage is not None)

    @property
    def activity(self) -> str:
        """What this rank is doing now, as a phrase ("compiling", "running F2:1")."""
        doing = self._beacon.doing
        return doing.what if doing.phase == "running" and doing.stage is None else f"{doing.phase} {doing.what}"

    def culprit(self, waits: Sequence[tuple[int, int | None]]) -> tuple[int, int | None, str] | None:
        """The rank at fault behind ``waits`` ((rank, stage awaited) pairs), its stage, and
        why; None when every rank found is alive and waiting.

        Reads every rank's published state twice, 2.5 beats apart: a rank whose counter
        did not move (or that never published) is dead or stuck; a running rank ends a
        chain; a waiting one passes the blame on to the ranks it waits for. A silent rank
        is the culprit first, then the one running longest.
        """
        first = read_states(self.store, self.prefix, self.world)
        time.sleep(2.5 * BEAT)
        second = read_states(self.store, self.prefix, self.world)
        silent = {
            r for r in range(self.world)
            if r != self.rank and (second[r] is None or (first[r] is not None and second[r]["n"] == first[r]["n"]))
        }
        running: list[tuple[float, int, int | None, str]] = []
        via: dict[int, set[int | None]] = {}  # rank -> the stages of it that the chain waits on
        frontier = [(r, s) for r, s in waits]
        seen: list[int] = []  # in the order found: the nearest silent rank is blamed
        while frontier:
            r, stage = frontier.pop(0)
            via.setdefault(r, set()).add(stage)
            if r in seen:
                continue
            seen.append(r)
            state = second.get(r)
            if r in silent:
                continue
            if state["phase"] != "waiting":
                elapsed = state["elapsed"]
                what = f"been running {state['what']} for {elapsed:.1f} s" if state["phase"] == "running" else f"failed ({state['what']})"
                running.append((elapsed, r, state["stage"], f"{self._name(r, state['stage'])} has {what}"))
                continue
            frontier += [(q, s) for q, s in state["waits"] if q != self.rank]
        for r in [r for r in seen if r in silent]:
            # its last published stage is exact (a rank publishes a move to another stage
            # before it starts there); else the stage the chain waited on from it
            state = second.get(r) or first.get(r)
            awaited = {s for s in via[r] if s is not None}
            stage = (state or {}).get("stage")
            if stage is None:
                stage = awaited.pop() if len(awaited) == 1 else self.first_stage(r)
            if state is None:
                why = f"{self._name(r, stage)} never published its state: it did not start, or died before joining"
            else:
                why = f"{self._name(r, stage)} stopped responding (last seen {state['phase']} {state['what']}): it died or is stuck"
            return r, stage, why
        if running:
            _, r, stage, why = max(running, key=lambda found: found[0])
            return r, stage if stage is not None else self.first_stage(r), why
        return None

    # ---------------------------------------------------------------- reporting
    def report(self, message: str, rank: int | None, stage: int | None = None) -> RankFailedError:
        """Record a failure (unless one already is) and return the error for the first one."""
        self._beacon.set(Doing("failed", message[:200]))
        note_failure(message)
        try:
            data = json.loads(publish_first(self.store, self.key, _encode(message, rank, stage)))
            if data["rank"] is not None:
                publish_culprit(self.store, data["rank"], data["message"])
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
            failure = RankFailedError(data["message"], data["rank"], data["stage"])
        except Exception as err:  # noqa: BLE001 - an unreachable store means its host died
            failure = self._store_lost(err)
        note_failure(str(failure))
        return failure

    def _store_lost(self, err: BaseException) -> RankFailedError:
        if self.store_host is not None and self.store_host != self.rank:
            host = self.store_host
            return RankFailedError(f"{self._name(host)} died: it hosts the rendezvous store, which stopped answering ({err})", host, self.first_stage(host))
        return RankFailedError(f"the rendezvous store is unreachable ({err}); its host process died", None, None)

    # ------------------------------------------------------------------ waiting
    @contextlib.contextmanager
    def collective(self, what: str, peers: Sequence[int], stage: int | None = None) -> Iterator[None]:
        """Around a collective that a library runs and waits for itself (FSDP's all-gather
        and reduce-scatter): meanwhile this rank is published as waiting for ``peers`` (on
        ``stage``), so other ranks' blame passes through it to them; a broken link raises
        RankFailedError naming the rank at fault (:meth:`lost`), not this one."""
        previous = self._beacon.doing
        self._beacon.set(Doing("waiting", what, stage, tuple((p, stage) for p in peers)))
        try:
            yield
        except RuntimeError as err:
            if not peers:
                raise
            raise self.lost(err, list(peers), dict.fromkeys(peers, stage)) from err
        self._beacon.set(previous)

    def wait(
        self,
        works: Sequence[tuple[Any, int | None]],
        what: Callable[[], str],
        peers: Sequence[int] | None = None,
        stage: int | None = None,
        peer_stages: dict[int, int] | None = None,
    ) -> None:
        """Wait for every ``(work, peer)``; raise RankFailedError instead of hanging.

        ``what()`` describes what is awaited; ``peers``: the ranks the wait depends on (a
        collective's group; default the works' peers); ``stage``: this rank's stage that
        waits; ``peer_stages``: which stage of each peer the wait needs. A wait that
        outlasts the timeout, or a broken link, names the rank found by :meth:`culprit`.
        """
        peers = tuple(peers) if peers is not None else tuple(sorted({p for _, p in works if p is not None}))
        peers = tuple(p for p in peers if p != self.rank)
        waits = tuple((p, (peer_stages or {}).get(p)) for p in peers)
        pending = []
        for work, peer in works:
            if not work.is_completed():
                pending.append((work, peer))
                continue
            try:
                work.wait()  # already done: returns at once, or raises what went wrong
            except Exception as err:  # noqa: BLE001 - the link to that peer broke
                raise self._lost(PeerLost(peer, err), waits) from err
        if not pending:
            return  # the common case with prefetched receives: no thread hand-off
        previous = self._beacon.doing
        self._beacon.set(Doing("waiting", what(), stage, waits))
        done = threading.Event()
        outcome: list[BaseException] = []
        self._submit((pending, done, outcome))
        deadline = time.monotonic() + self.timeout
        while not done.wait(_POLL):
            failure = self.recorded()
            if failure is not None:
                raise failure
            if time.monotonic() > deadline:
                r, r_stage = waits[0] if waits else (self.rank, stage)
                found = self.culprit(waits) or (r, r_stage, f"{self._name(r, r_stage)} did not answer")
                culprit, culprit_stage, why = found
                raise self.report(
                    f"{why}; rank {self.rank} waited {self.timeout:g} s for {what()} "
                    "(raise Plan(timeout=...) if it is only slow)",
                    culprit,
                    culprit_stage,
                )
        if outcome:
            err = outcome[0]
            # the state stays "waiting" while the blame is worked out: this rank is not the culprit
            if isinstance(err, PeerLost):
                raise self._lost(err, waits)
            raise err
        self._beacon.set(previous)

    def lost(self, cause: BaseException, peers: Sequence[int], peer_stages: dict[int, int] | None = None) -> RankFailedError:
        """The error for a communication op that failed at once with ``cause`` (posting to a
        peer that is gone): the rank at fault among ``peers``' chains."""
        waits = tuple((p, (peer_stages or {}).get(p)) for p in peers)
        return self._lost(PeerLost(peers[0] if len(peers) == 1 else None, cause), waits)

    def _lost(self, err: PeerLost, waits: Sequence[tuple[int, int | None]]) -> RankFailedError:
        """A link broke: the rank that failed first is recorded by now, or is found."""
        end = time.monotonic() + _GRACE
        while time.monotonic() < end:
            failure = self.recorded()
            if failure is not None:
                return failure
            time.sleep(0.05)
        if err.peer is not None:
            waits = [w for w in waits if w[0] == err.peer] or [(err.peer, None)]
        found = self.culprit(waits)
        if found is None:  # every peer is alive and waiting: the fault is this rank's own
            found = (self.rank, None, f"rank {self.rank} failed while {self.activity}")
        culprit, stage, why = found
        failure = self.report(f"{why} (seen by rank {self.rank}: {err.cause})", culprit, stage)
        failure.__cause__ = err.cause
        return failure

    def _submit(self, job: tuple) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="fxpipe-comm-wait", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the heartbeat and the wait thread and join them (idempotent; also at exit).

        Waits already handed to the thread finish first: after a step returned, none is
        pending. After a failure the thread may wait forever on a peer that failed; it is
        then left to :mod:`fxpipe.distributed.teardown`, which ends the process at exit
        before that thread can abort it."""
        self._beacon.close(timeout)
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            retire(thread, timeout)
        _LIVE.discard(self)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            _finish(*job)
            job = None  # the works hold the step's message buffers: none outlives its wait

    # ---------------------------------------------------------------- start-up
    def gather(self, name: str, value: str, what: str) -> dict[int, str]:
        """Publish ``value`` under ``name`` and return every rank's (a meeting point).

        ``what`` says what the others were to do before this point ("compiling"). Raises
        the recorded RankFailedError as soon as a rank records one, and RankFailedError
        naming the ranks that did not arrive within the timeout: whether they never joined,
        stopped responding, or are still busy, from their published states.
        """
        key = f"{self.prefix}{name}/"
        self.store.set(f"{key}{self.rank}", sign(f"{key}{self.rank}", value))
        others = [r for r in range(self.world) if r != self.rank]
        self._beacon.set(Doing("waiting", f"every rank to finish {what}", None, tuple((r, None) for r in others)))
        deadline = time.monotonic() + self.timeout
        while True:
            failure = self.recorded()
            if failure is not None:
                raise failure
            try:
                missing = [r for r in others if not self.store.check([f"{key}{r}"])]
            except Exception:  # noqa: BLE001 - the store's host died; recorded() says who
                missing = others
            if not missing:
                break
            if time.monotonic() > deadline:
                raise self._missing(missing, what)
            time.sleep(_POLL)
        values = {}
        for r in range(self.world):
            payload = verify(f"{key}{r}", self.store.get(f"{key}{r}"))
            if payload is None:
                raise RankFailedError(f"the value rank {r} published at start-up is not signed with this job's secret", r)
            values[r] = payload
        self._beacon.set(Doing("running", "set-up"))
        return values

    def _missing(self, missing: list[int], what: str) -> RankFailedError:
        """The error naming the first of ``missing`` ranks that did not reach a meeting point."""
        failure = self.recorded()
        if failure is not None:
            return failure
        first = read_states(self.store, self.prefix, self.world)
        time.sleep(2.5 * BEAT)
        second = read_states(self.store, self.prefix, self.world)
        r = missing[0]
        state = second[r]
        if state is None:
            why = "never joined: it did not start, failed before fxpipe.compile, or runs another script"
        elif first[r] is not None and first[r]["n"] == state["n"]:
            why = f"stopped responding while {state['what']}: it died or is stuck"
        else:
            why = f"is still {state['what']} after {state['elapsed']:.1f} s"
        others = f" (also missing: ranks {missing[1:]})" if len(missing) > 1 else ""
        return self.report(
            f"{self._name(r)} {why}; rank {self.rank} waited {self.timeout:g} s for every rank to finish {what}{others} "
            "(raise Plan(timeout=...) if it is only slow)",
            r,
            self.first_stage(r),
        )


_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


_EXIT_JOIN = 0.5  # seconds a thread gets to end at exit: after a step returned, it ends at once


@atexit.register
def _close_all() -> None:
    """Join every watchdog's threads before the interpreter finalises (then, registered
    earlier, :func:`fxpipe.distributed.teardown.end_at_exit` runs)."""
    for watchdog in list(_LIVE):
        watchdog.close(_EXIT_JOIN)
