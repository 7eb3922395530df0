"""From ``fxpipe.compile`` to the first step across ranks: every failure reaches every rank.

Under torchrun (or fxpipe's launcher) each rank's ``fxpipe.compile``:

1. **joins the job's store** (``MASTER_ADDR:MASTER_PORT``) and starts publishing what it
   does (:func:`join`). Joining only connects: it waits for nobody, unlike torch's env://
   rendezvous, where rank 0's store waits for every rank to connect and then
   ``init_process_group`` waits again, so a rank that never came surfaced as a raw
   ``DistStoreError`` after twice the timeout, naming nobody;
2. does its own work: traces and partitions the model, places and loads its stages;
3. **meets the others** (:func:`check_same_plan`): publishes its plan's fingerprint and
   waits for everyone's, watching the store for failures meanwhile;
4. only then connects the ranks (``init_process_group``: gloo and NCCL connect every pair
   and cannot be interrupted) and runs the set-up collectives.

A rank whose steps 1–3 raise records ``rank r failed while compiling: ...`` before it
re-raises (:func:`failures_recorded`), and every rank waiting in step 3 raises
RankFailedError with that message at once. A rank that never gets there is named when the
timeout runs out, from its published state: it never joined (crashed before compile, did
not start, runs another script), stopped responding (died), or is still busy (compiling
slowly). Ranks whose plans differ all raise PlanMismatchError (a RankFailedError).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from fxpipe.distributed.faults import PlanMismatchError, RankFailedError, Watchdog
from fxpipe.schedules import describe_schedule

_instances = itertools.count()  # pipelines compiled in this process: the same count on every rank


def join(timeout: float) -> Watchdog:
    """This rank's watchdog for a new pipeline, on the job's store.

    Uses the default process group's store when the script initialised torch.distributed;
    otherwise connects to ``MASTER_ADDR:MASTER_PORT`` (hosting the store on rank 0 unless
    a launcher's agent hosts it, ``TORCHELASTIC_USE_AGENT_STORE``), waiting for nobody.
    Raises RankFailedError when the store cannot be reached within ``timeout`` seconds,
    naming rank 0 when rank 0 was to host it.
    """
    prefix = f"fxpipe/{next(_instances)}/"
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        return Watchdog(store, prefix, dist.get_rank(), dist.get_world_size(), timeout)
    if "RANK" not in os.environ:
        raise RankFailedError("WORLD_SIZE is set but RANK is not: start every rank with torchrun (or fxpipe.distributed.launch), which set both")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host = None if agent else 0
    try:
        if host != rank:
            _reachable(address, port, timeout)
        listen = {"master_listen_fd": _listening_socket(address, port), "use_libuv": True} if host == rank else {}
        store = dist.TCPStore(
            address, port, world, is_master=host == rank, timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False, multi_tenant=True, **listen,
        )
    except Exception as err:  # noqa: BLE001 - DistNetworkError/DistStoreError/RuntimeError by version
        if host == rank:
            raise RankFailedError(f"rank {rank} could not host the job's store at {address}:{port} (is MASTER_PORT taken?): {err}", rank) from err
        who = "rank 0, which hosts it under env:// rendezvous, did not start or died" if host == 0 else "the launcher that hosts it is gone"
        raise RankFailedError(
            f"rank {rank} could not reach the job's store at {address}:{port} within {timeout:g} s: {who} "
            f"(or MASTER_ADDR/MASTER_PORT are wrong): {err}",
            host,
        ) from err
    return Watchdog(store, prefix, rank, world, timeout, store_host=host)


def _listening_socket(address: str, port: int) -> int:
    """A socket listening on ``address:port`` only, for the store rank 0 hosts (given no
    socket, ``TCPStore`` listens on every interface whatever its host says); returns its
    file descriptor, which the store then owns. Raises OSError when ``address`` is not
    this machine's or the port is taken."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(sockaddr[:2], family=family).detach()


def _reachable(address: str, port: int, timeout: float) -> None:
    """Return once ``address:port`` accepts a connection; raise TimeoutError after ``timeout``
    seconds. (TCPStore's own client retries each attempt for the whole timeout, so a store
    that never comes fails only after about twice the timeout, with C++ stack traces.)"""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing accepted a connection: {err}") from err
            time.sleep(0.1)


@contextlib.contextmanager
def failures_recorded(watchdog: Watchdog) -> Iterator[None]:
    """Record an error this rank raises in the block for the other ranks (then re-raise it).

    The other ranks, waiting at a meeting point or in a step, raise RankFailedError naming
    this rank and what it was doing. A RankFailedError (another rank's failure, read here)
    is not recorded again.
    """
    try:
        yield
    except RankFailedError:
        raise
    except Exception as err:
        watchdog.report(f"rank {watchdog.rank} failed while {watchdog.activity}: {type(err).__name__}: {err}", watchdog.rank)
        raise


def fingerprint(parts: dict[str, str]) -> dict[str, str]:
    """Digest of each named part of a compiled plan, plus ``"all"`` over them all."""
    digests = {name: hashlib.sha256(text.encode()).hexdigest()[:16] for name, text in parts.items()}
    digests["all"] = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    return digests


def check_same_plan(watchdog: Watchdog, parts: dict[str, str], summary: str) -> None:
    """Compare this rank's plan fingerprint with every other rank's, before anything runs
    (the start-up meeting point: every rank has compiled and loaded its stages here).

    Raises PlanMismatchError naming the ranks that differ from rank 0 and the parts that
    differ (``plan``, ``layout``, ``stage 2`` ...); RankFailedError when a rank failed
    before this point or did not reach it within the timeout (see :meth:`Watchdog.gather`).
    """
    published = watchdog.gather("plan", json.dumps({"digests": fingerprint(parts), "summary": summary}), "compiling")
    theirs = {r: json.loads(text) for r, text in published.items()}
    reference = theirs[0]
    problems, differing = [], []
    for r in range(watchdog.world):
        if theirs[r]["digests"]["all"] == reference["digests"]["all"]:
            continue
        diff = sorted(k for k in reference["digests"] if k != "all" and theirs[r]["digests"].get(k) != reference["digests"][k])
        differing.append(r)
        problems.append(f"rank {r} differs from rank 0 in {', '.join(diff)}: rank 0 has {reference['summary']}; rank {r} has {theirs[r]['summary']}")
    if problems:
        raise PlanMismatchError(
            "ranks compiled different pipelines; every rank must run the same script with the same "
            "model, plan and example inputs:\n  " + "\n  ".join(problems),
            differing[0],
        )


def plan_parts(part: Any, layout: Any) -> dict[str, str]:
    """What every rank must agree on, by part: the plan, the world layout, each stage."""
    plan = part.plan
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    fields["schedule"] = describe_schedule(plan.schedule)  # a function's repr holds its address
    if isinstance(plan.compile, dict):  # so may a backend given as a function
        fields["compile"] = {k: getattr(v, "__qualname__", v) for k, v in plan.compile.items()}
    parts = {"plan": repr(sorted(fields.items(), key=lambda kv: kv[0])), "layout": f"world {layout.world} workers {layout.workers} replicas {layout.replicas}"}
    for s in part.stages:
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in list(s.module.named_parameters()) + list(s.module.named_buffers())]
        edges = [(e.name, e.src, e.dst, e.description) for e in s.inputs + s.outputs]
        parts[f"stage {s.index}"] = f"{s.module.code}\n{tensors}\n{edges}"
    return parts


def plan_summary(part: Any, layout: Any) -> str:
    """One line describing the plan, for mismatch messages."""
    p = part.plan
    return (
        f"{part.num_stages} stages, split={p.split!r}, schedule={describe_schedule(p.schedule)}, microbatches={p.microbatches}, "
        f"chunks={p.chunks}, data_parallel={p.data_parallel}, world={layout.world}"
    )
