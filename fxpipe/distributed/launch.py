"""Start N local processes for a quick run or a test: ``fxpipe.distributed.launch(fn, nprocs)``.

Each child gets the environment torchrun gives (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), so ``fxpipe.compile`` in ``fn`` runs
distributed exactly as under torchrun. The parent hosts the rendezvous store (as
torchrun's agent does, ``TORCHELASTIC_USE_AGENT_STORE``), so it outlives any rank: a
rank that dies cannot take the others' failure reports with it. Children are forked
from a forkserver that imported torch once, so starting them costs little.

For scripts, ``python -m fxpipe.distributed -n N script.py [args]`` is torchrun's own
launcher (``torch.distributed.run --standalone``).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "fxpipe"]


class LaunchError(RuntimeError):
    """Some ranks failed; ``errors`` maps each failed rank to its error text."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any]) -> None:
        lines = "\n".join(f"--- rank {r} ---\n{text.rstrip()}" for r, text in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed: {sorted(errors)}\n{lines}")
        self.errors = errors
        self.results = results


def _child(fn: Callable, args: tuple, env: dict[str, str], threads: int, conn: Any) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
        # serialised here: tensors sent as shared memory would need this process alive
        buffer = io.BytesIO()
        torch.save(result, buffer)
        conn.send(("ok", buffer.getvalue()))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}"))
    finally:
        conn.close()
        # skip interpreter teardown: a peer that died can leave process-group threads blocked
        os._exit(0)


def _forkserver(modules: list[str]) -> Any:
    """The forkserver context, started (once per parent) with torch, fxpipe and ``modules``
    imported, so children start in milliseconds. The server gets the parent's sys.path
    through PYTHONPATH: Python 3.11's forkserver drops the one it is handed."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + [m for m in modules if m != "__main__"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    threads: int = 1,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes forming one torch.distributed world.

    ``fn`` must be importable by name (a module-level function). Each process uses
    ``threads`` intra-op threads. Returns the ranks' return values, in rank order.
    Raises LaunchError listing every rank that raised or died (with its traceback or
    exit code), or that was still running after ``timeout`` seconds (it is then killed).
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    ctx = _forkserver([fn.__module__])
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "OMP_NUM_THREADS": str(threads),
        **(env or {}),
    }
    procs, conns = [], []
    for rank in range(nprocs):
        reader, writer = ctx.Pipe(duplex=False)
        child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
        proc = ctx.Process(target=_child, args=(fn, tuple(args), child_env, threads, writer), name=f"fxpipe-rank-{rank}")
        proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    waiting = {conn: rank for rank, conn in enumerate(conns)}
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for conn in multiprocessing.connection.wait(list(waiting), timeout=left):
            rank = waiting.pop(conn)
            try:
                status, value = conn.recv()
            except EOFError:
                procs[rank].join(5)
                errors[rank] = f"rank {rank} died (exit code {procs[rank].exitcode}) before reporting"
                continue
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    for rank in waiting.values():
        errors[rank] = f"rank {rank} still running after {timeout:.0f} s; killed"
    for proc in procs:
        proc.join(5 if not waiting else 0.1)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    del store
    if errors:
        raise LaunchError(errors, results)
    return [results[r] for r in range(nprocs)]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fxpipe.distributed -n N script.py [args]``: torchrun, standalone, N processes."""
    import argparse

    from torch.distributed import run

    parser = argparse.ArgumentParser(prog="python -m fxpipe.distributed", description="Run a script on N local processes (torchrun --standalone).")
    parser.add_argument("-n", "--nproc", type=int, required=True, help="processes: pipeline workers × data_parallel")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs="...")
    ns = parser.parse_args(argv)
    run.main(["--standalone", "--nproc-per-node", str(ns.nproc), ns.script, *ns.script_args])
