"""``python -m fxpipe.distributed -n N script.py [args]``: a script on N local processes.

torch's elastic agent (what ``torchrun`` runs) starts the N processes and ends the others
as soon as one fails; fxpipe hands it a rendezvous whose store listens on 127.0.0.1 alone
(``--address`` to choose another), and gives the ranks a per-job secret for signing
failure records (see ``fxpipe/distributed/launch.py`` for both).

The rank to blame is the one the ranks named (:mod:`fxpipe.distributed.blame`), not the
first process that exited: when rank 1 is stopped, rank 0 names it after ``Plan.timeout``
and exits first. A watcher thread reads that record while the job runs; a named rank still
running ``_KILL_AFTER`` seconds later (stopped, or hung in a C call) is killed with SIGKILL
here, instead of after the agent's 30 s grace for ranks that ignore SIGTERM. The exit
status is 0 when every rank succeeded, otherwise the blamed rank's exit code (128 + N
when signal N ended it, as shells report it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fxpipe.distributed.blame import Culprit, read_culprit, read_pid
from fxpipe.distributed.launch import LOOPBACK, job_store, private_environment
from fxpipe.distributed.signing import new_secret

_BACKEND = "fxpipe-local"
_POLL = 0.2  # seconds between the watcher's looks at the store
_KILL_AFTER = 2.0  # seconds a named rank has to exit on its own (one that raised exits in < 1 s)


class _LocalRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous for one node, around a store that already listens where
    fxpipe bound it (the static one would create a store listening on every interface)."""

    def __init__(self, store: Any, address: str, run_id: str, timeout: int) -> None:
        super().__init__(address, store.port, 0, 1, run_id, timeout)
        self._store = store

    def get_backend(self) -> str:
        return _BACKEND


def _rendezvous(params: RendezvousParameters) -> _LocalRendezvous:
    return _LocalRendezvous(params.config["store"], params.config["address"], params.run_id, int(params.config["timeout"]))


class _Watcher:
    """Reads the culprit the ranks name while the job runs, and kills that rank (SIGKILL)
    when it is still running ``_KILL_AFTER`` seconds later."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.culprit: Culprit | None = None
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fxpipe-launcher-watch", daemon=True)
        self._thread.start()

    def stop(self) -> Culprit | None:
        """Stop watching; the culprit the ranks named, if they did."""
        self._stop.set()
        self._thread.join()
        return self.culprit or read_culprit(self.store)

    def _run(self) -> None:
        while not self._stop.wait(_POLL):
            culprit = read_culprit(self.store)
            if culprit is None:
                continue
            self.culprit = culprit
            pid = read_pid(self.store, culprit.rank)
            deadline = time.monotonic() + _KILL_AFTER
            while pid is not None and _our_running_child(pid) and time.monotonic() < deadline:
                if self._stop.wait(_POLL):
                    return
            if pid is not None and _our_running_child(pid):
                os.kill(pid, signal.SIGKILL)
                self.killed = True
            return


def _our_running_child(pid: int) -> bool:
    """Whether ``pid`` is a running (not exited) child of this process: only such a
    process is killed, whatever pid a record names."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    state, parent = fields[0], int(fields[1])
    return parent == os.getpid() and state not in ("Z", "X")


def _status(exitcode: int) -> int:
    return exitcode if exitcode >= 0 else 128 - exitcode


def _blame(err: ChildFailedError, watcher: _Watcher) -> int:
    """Print which rank failed first (the one the ranks named, when they named one that
    failed) and return its exit status."""
    culprit = watcher.stop()
    rank, failure = err.get_first_failure()
    if culprit is not None and culprit.rank in err.failures:
        rank, failure = culprit.rank, err.failures[culprit.rank]
    how = f"killed by signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    if culprit is not None and culprit.rank == rank:
        ended = ", ended by this launcher once the others had named it" if watcher.killed else ""
        print(f"python -m fxpipe.distributed: rank {rank} failed first, as the ranks named it ({how}{ended}): "
              f"{culprit.message}; the other ranks were ended", file=sys.stderr)
    else:
        print(f"python -m fxpipe.distributed: rank {rank} failed first ({how}; its error is above); the other "
              "ranks were ended", file=sys.stderr)
    return _status(failure.exitcode)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script on N processes; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m fxpipe.distributed", description="Run a script on N local processes, as torchrun does.")
    parser.add_argument("-n", "--nproc", type=int, required=True, help="processes: pipeline workers × data_parallel")
    parser.add_argument("--address", default=LOOPBACK, help="address the rendezvous store listens on (default: loopback only)")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs="...")
    ns = parser.parse_args(argv)

    rendezvous_handler_registry.register(_BACKEND, _rendezvous)
    store = job_store(ns.address)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=ns.nproc, run_id=uuid.uuid4().hex, rdzv_backend=_BACKEND,
        rdzv_endpoint=ns.address, rdzv_configs={"store": store, "address": ns.address}, max_restarts=0,
    )
    # the workers inherit this process's environment
    os.environ.update(private_environment(ns.address, new_secret()))
    if ns.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    watcher = _Watcher(store)
    try:
        elastic_launch(config, sys.executable)("-u", ns.script, *ns.script_args)
    except ChildFailedError as err:
        return _blame(err, watcher)
    watcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
