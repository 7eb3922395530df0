"""``python -m fxpipe.distributed -n N script.py [args]``: a script on N local processes.

torch's elastic agent (what ``torchrun`` runs) starts the N processes, ends the others
as soon as one fails and names the first failure; fxpipe only hands it a rendezvous
whose store listens on 127.0.0.1 alone (``--address`` to choose another), and gives the
ranks a per-job secret for signing failure records (see ``fxpipe/distributed/launch.py``
for both). The exit status is 0 when every rank succeeded, otherwise the first failed
rank's exit code (1 if it was killed by a signal).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from fxpipe.distributed.launch import LOOPBACK, job_store, private_environment
from fxpipe.distributed.signing import new_secret

_BACKEND = "fxpipe-local"


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script on N processes; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m fxpipe.distributed", description="Run a script on N local processes, as torchrun does.")
    parser.add_argument("-n", "--nproc", type=int, required=True, help="processes: pipeline workers × data_parallel")
    parser.add_argument("--address", default=LOOPBACK, help="address the rendezvous store listens on (default: loopback only)")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs="...")
    ns = parser.parse_args(argv)

    rendezvous_handler_registry.register(_BACKEND, _rendezvous)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=ns.nproc, run_id=uuid.uuid4().hex, rdzv_backend=_BACKEND,
        rdzv_endpoint=ns.address, rdzv_configs={"store": job_store(ns.address), "address": ns.address}, max_restarts=0,
    )
    # the workers inherit this process's environment
    os.environ.update(private_environment(ns.address, new_secret()))
    if ns.nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    try:
        elastic_launch(config, sys.executable)("-u", ns.script, *ns.script_args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        how = f"killed by signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"python -m fxpipe.distributed: rank {rank} failed first ({how}; its error is above); the other "
              "ranks were ended", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
