"""Two torchrun agents on one machine stand for two hosts: ``--nnodes 2 --nproc-per-node 2``
with c10d rendezvous on 127.0.0.1, so ranks 2 and 3 have ``LOCAL_RANK`` 0 and 1.

Each agent runs tests/multinode_script.py: a 4-stage pipeline, then 2 stages x 2 replicas,
each equal to eager on the whole batch. What the recipe in docs/distributed.md ("Several
hosts") runs on real hosts, with the rendezvous endpoint and the gloo interface on loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "multinode_script.py"
TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return next(n for n in ("lo", "lo0") if n in names)


def agent(endpoint: str, run_id: str) -> subprocess.Popen:
    """One host's torchrun: 2 processes, joining the 2-node rendezvous at ``endpoint``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--max-restarts", "0", str(SCRIPT),
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": loopback_interface(), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 60)
def test_two_torchrun_agents_with_c10d_rendezvous_match_eager_with_local_rank_not_rank() -> None:
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    agents = [agent(endpoint, run_id) for _ in range(2)]
    outputs = []
    try:
        for proc in agents:
            outputs.append(proc.communicate(timeout=TIMEOUT))
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    log = "\n".join(out + err[-3000:] for out, err in outputs)
    assert [proc.returncode for proc in agents] == [0, 0], log
    results = [json.loads(line.removeprefix("RESULT ")) for out, _ in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    by_case: dict[str, dict[int, dict]] = {}
    for r in results:
        by_case.setdefault(r["case"], {})[r["env"]["RANK"]] = r
    assert sorted(by_case) == ["2 stages x 2 replicas", "4 stages"], log
    for case, ranks in by_case.items():
        assert sorted(ranks) == [0, 1, 2, 3], (case, log)
        for rank, r in ranks.items():
            assert r["env"]["WORLD_SIZE"] == 4 and r["env"]["LOCAL_RANK"] == rank % 2, r
            assert r["env"]["GROUP_RANK"] == rank // 2, r  # the node: ranks 2 and 3 are on the second
            assert r["pipe_rank"] == rank, r  # fxpipe's rank is RANK, not LOCAL_RANK
            assert r["loss_err"] < 1e-12 and r["grad_err"] < 1e-12, r
    four, replicated = by_case["4 stages"], by_case["2 stages x 2 replicas"]
    assert [four[r]["local_stages"] for r in range(4)] == [[0], [1], [2], [3]]
    assert [replicated[r]["local_stages"] for r in range(4)] == [[0], [1], [0], [1]]
    assert not set(four[0]["params"]) & set(four[2]["params"])  # local rank 0 on both nodes: other stages
    assert replicated[0]["params"] == replicated[2]["params"]
