"""Start N local processes for a quick run or a test: ``fxpipe.distributed.launch(fn, nprocs)``.

Each child gets the environment torchrun gives (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), so ``fxpipe.compile`` in ``fn`` runs
distributed exactly as under torchrun, and returns its value to the parent.

Safe on a shared machine:

- **Nothing listens beyond 127.0.0.1** unless the caller gives ``address``. The parent
  hosts the rendezvous store (as torchrun's agent does, ``TORCHELASTIC_USE_AGENT_STORE``,
  so it outlives any rank) on a socket it bound itself: ``TCPStore`` on its own listens on
  every interface. The ranks' gloo (and NCCL) sockets are pinned to the loopback
  interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, unless already set).
- **A per-job secret** (``FXPIPE_JOB_SECRET``, see :mod:`fxpipe.distributed.signing`)
  goes to the ranks in their environment, never into the store: failure records are
  believed only when signed with it, because any local user can reach a loopback port.
- **The parent's module path.** Children are forked from a forkserver that imported
  torch once (so a rank starts in about 50 ms). Its ``python -c`` would put the current
  directory first on ``sys.path``, so a file there named like any module it imports would
  run; it starts in safe-path mode (``PYTHONSAFEPATH``, Python ≥ 3.11) with the parent's
  ``sys.path`` instead. The children themselves run with the parent's ``sys.path``.
- **A failure ends the job.** When a rank raises or dies, the others get ``grace``
  seconds to finish (long enough for fxpipe's watchdog to name the culprit on every
  rank), then are ended; :class:`LaunchError` names the rank that failed first, as the
  ranks named it (:mod:`fxpipe.distributed.blame`).

Why not ``torch.distributed.launcher.api.elastic_launch``? It ends the other workers on
the first failure and reports the root cause, and ``python -m fxpipe.distributed``
(``fxpipe/distributed/__main__.py``) uses it for scripts. For ``launch(fn)`` it cannot do
three things: it returns no value when any worker fails, so the survivors' own reports
(which rank they blamed, how fast: what fxpipe's failure tests check) are lost; it
installs SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers in the calling process and leaves them
there (Ctrl-C in a notebook or pytest then raises its ``SignalException``); and its
rendezvous backends create their ``TCPStore`` listening on every interface. Started from
the same preloaded forkserver it is about as fast (0.15–0.2 s vs 0.12 s for two ranks
returning at once), so speed is not the reason.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fxpipe.distributed.blame import read_culprit
from fxpipe.distributed.signing import SECRET_ENV, new_secret

LOOPBACK = "127.0.0.1"
# torch._dynamo: every rank's first compile imports it (fake tensors), about 2 s each otherwise
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "fxpipe"]
_STOP_WAIT = 2.0  # seconds between SIGTERM and SIGKILL when ending a rank


class LaunchError(RuntimeError):
    """Some ranks failed or did not finish.

    ``errors`` maps each such rank to its error text, in the order they failed (ranks the
    launcher ended come last); ``first`` is the rank that failed first (None when every
    rank merely ran out of time); ``results`` holds the other ranks' return values.
    """

    def __init__(self, errors: dict[int, str], results: dict[int, Any], first: int | None) -> None:
        if first is None:
            headline = f"rank(s) {list(errors)} did not finish in time"
        else:
            later = [r for r in errors if r != first]
            headline = f"rank {first} failed first" + (f"; then rank(s) {later}" if later else "")
        lines = "\n".join(f"--- rank {r} ---\n{text.rstrip()}" for r, text in errors.items())
        super().__init__(f"{headline}\n{lines}")
        self.errors = errors
        self.results = results
        self.first = first


def job_store(address: str = LOOPBACK) -> Any:
    """A ``TCPStore`` server that listens on ``address`` only.

    ``TCPStore(host, port, is_master=True)`` listens on every interface whatever ``host``
    says; given a socket bound here (``master_listen_fd``) it listens where that socket
    is bound. The store owns the socket from then on. Raises OSError when ``address`` is
    not an address of this machine.
    """
    from torch.distributed import TCPStore

    family, _, _, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server(sockaddr[:2], family=family)
    port = sock.getsockname()[1]
    return TCPStore(address, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][4][0])


def private_environment(address: str, secret: str) -> dict[str, str]:
    """What a job's ranks need besides torchrun's variables: the job secret and, for a
    loopback job, gloo's and NCCL's sockets pinned to the loopback interface (unless the
    caller's environment chose an interface already)."""
    env = {SECRET_ENV: secret}
    interface = _loopback_interface()
    if interface is not None and _ip(address).is_loopback:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = interface
    return env


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def _module_path() -> str:
    """The parent's ``sys.path`` as PYTHONPATH ('' is the current directory, made absolute)."""
    entries = dict.fromkeys(os.path.abspath(p) if p == "" else p for p in sys.path)
    return os.pathsep.join(entries)


@contextlib.contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _forkserver(modules: list[str]) -> Any:
    """The forkserver context, started (once per parent) with torch, fxpipe and ``modules``
    imported, so children start in milliseconds. The server gets the parent's sys.path
    through PYTHONPATH (Python 3.11's forkserver drops the one it is handed) and no
    current directory in front of it (safe-path mode)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + [m for m in modules if m != "__main__"])
    with _environment({"PYTHONPATH": _module_path(), "PYTHONSAFEPATH": "1"}):
        forkserver.ensure_running()
    return ctx


def _child(fn: Callable, args: tuple, env: dict[str, str], threads: int, conn: Any) -> None:
    # the whole environment, not an update: the forkserver's own (PYTHONSAFEPATH, the
    # PYTHONPATH above, an earlier job's variables) must not reach the user's code
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
        # serialised here: tensors sent as shared memory would need this process alive
        buffer = io.BytesIO()
        torch.save(result, buffer)
        conn.send(("ok", buffer.getvalue(), time.time()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}", time.time()))
    finally:
        conn.close()
        # skip interpreter teardown: a peer that died can leave process-group threads blocked
        os._exit(0)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    threads: int = 1,
    timeout: float = 600.0,
    grace: float = 5.0,
    address: str = LOOPBACK,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes forming one torch.distributed world.

    ``fn`` must be importable by name (a module-level function). Each process uses
    ``threads`` intra-op threads and the caller's environment plus ``env`` and the
    torchrun variables. The rendezvous store and the ranks' sockets listen on ``address``
    (default: loopback only). Returns the ranks' return values, in rank order.

    When a rank raises or dies, the others have ``grace`` seconds to finish, then are
    ended (SIGTERM, then SIGKILL); ranks still running after ``timeout`` seconds are
    killed. Raises LaunchError naming the rank that failed first (the one the ranks named,
    :mod:`fxpipe.distributed.blame`, else the first to fail), with every failed rank's
    traceback or exit code.
    """
    store = job_store(address)
    connect = LOOPBACK if _ip(address).is_unspecified else address  # "0.0.0.0": every interface
    ctx = _forkserver([fn.__module__])
    secret = new_secret()
    base = {
        **os.environ,
        **private_environment(address, secret),
        "MASTER_ADDR": connect,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "OMP_NUM_THREADS": str(threads),
        **(env or {}),
    }
    procs: list[Any] = []
    try:
        conns = []
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
            proc = ctx.Process(target=_child, args=(fn, tuple(args), child_env, threads, writer), name=f"fxpipe-rank-{rank}")
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        results, errors, first = _collect(procs, conns, timeout, grace)
        first = _named_first(store, secret, errors, first)
    finally:
        for proc in procs:
            _end(proc)
        del store
    if errors:
        raise LaunchError(errors, results, first)
    return [results[r] for r in range(nprocs)]


def _named_first(store: Any, secret: str, errors: dict[int, str], first: int | None) -> int | None:
    """The failed rank the ranks named (they know better than the order of exits), else ``first``."""
    named = read_culprit(store, secret)
    return named.rank if named is not None and named.rank in errors else first


def _collect(procs: list[Any], conns: list[Any], timeout: float, grace: float) -> tuple[dict[int, Any], dict[int, str], int | None]:
    """Each rank's result or error text (ordered by when they happened), and the rank that
    failed first (None if none failed before the deadline).

    Waits until every rank reported, ``timeout`` passed, or ``grace`` seconds after the
    first failure; ranks still running then are ended and listed as such.
    """
    import torch

    results: dict[int, Any] = {}
    failed: dict[int, tuple[float, str]] = {}
    waiting = {conn: rank for rank, conn in enumerate(conns)}
    start = time.monotonic()
    deadline = start + timeout
    why = f"still running after the launch timeout ({timeout:.0f} s)"
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for conn in multiprocessing.connection.wait(list(waiting), timeout=left):
            rank = waiting.pop(conn)
            try:
                status, value, when = conn.recv()
            except EOFError:
                procs[rank].join(1)
                failed[rank] = (time.time(), f"rank {rank} died (exit code {procs[rank].exitcode}) before reporting")
            else:
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failed[rank] = (when, value)
            if rank in failed and deadline > time.monotonic() + grace:
                deadline = time.monotonic() + grace
                first = min(failed, key=lambda r: failed[r][0])
                why = f"still running {grace:.0f} s after rank {first} failed"
    first = min(failed, key=lambda r: failed[r][0]) if failed else None
    for rank in waiting.values():
        failed[rank] = (float("inf"), f"rank {rank} was {why}; ended by the launcher")
    errors = {rank: text for rank, (_, text) in sorted(failed.items(), key=lambda kv: (kv[1][0], kv[0]))}
    return results, errors, first


def _end(proc: Any) -> None:
    """Let a rank that reported exit, or end it: SIGTERM first, SIGKILL if that is ignored."""
    proc.join(0.5)
    if proc.is_alive():
        proc.terminate()
        proc.join(_STOP_WAIT)
    if proc.is_alive():
        proc.kill()
        proc.join(_STOP_WAIT)
