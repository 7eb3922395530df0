"""The local launcher on a shared machine: loopback only, signed failure records, the
parent's module path, and a failure that ends the job in seconds."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fxpipe.distributed import LaunchError, launch
from fxpipe.distributed.signing import (
    SECRET_ENV,
    new_secret,
    publish_first,
    read_verified,
    sign,
    verify,
)

LAUNCH_TIMEOUT = 120


# ------------------------------------------------------------ helpers in the ranks
def _listening() -> list[tuple[str, int, int]]:
    """(address, port, inode) of every listening TCP socket in this network namespace."""
    found = []
    for name, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(name):
            continue
        for line in Path(name).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found.append((socket.inet_ntop(family, words), int(hex_port, 16), int(fields[9])))
    return found


def _own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_sockets_of_the_job() -> dict:
    """After a gloo all-reduce: where the store (in the parent) and this rank listen."""
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    port = int(os.environ["MASTER_PORT"])
    mine = _own_socket_inodes()
    listening = _listening()
    dist.barrier()
    dist.destroy_process_group()
    return {
        "store": [address for address, p, _ in listening if p == port],
        "rank": [address for address, _, inode in listening if inode in mine],
        "port": port,
        "sum": value.item(),
    }


def rank_1_raises() -> str:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=LAUNCH_TIMEOUT))
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    # waits on a key nobody writes, far longer than the test allows (the store is the parent's)
    dist.distributed_c10d._get_default_store().wait(["never"], datetime.timedelta(seconds=LAUNCH_TIMEOUT))
    return "not ended"


def rank_dies() -> str:
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(LAUNCH_TIMEOUT)
    return "not ended"


def records_between_ranks() -> dict:
    """Rank 1 forges a failure record without the secret; rank 0 then publishes its own."""
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    key = "fxpipe/test/failure"
    if dist.get_rank() == 1:
        store.compare_set(key, "", '{"message": "rank 0 failed", "rank": 0}')  # what any local process can do
    dist.barrier()
    forged_seen = read_verified(store, key)
    dist.barrier()  # every rank has looked at the forged record before a genuine one is written
    mine = publish_first(store, key, f"rank {dist.get_rank()} saw a failure") if dist.get_rank() == 0 else None
    dist.barrier()
    final = read_verified(store, key)
    dist.destroy_process_group()
    return {"forged_seen": forged_seen, "published": mine, "final": final, "secret": os.environ.get(SECRET_ENV)}


# ------------------------------------------------------------------------- tests
def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine's interfaces other than loopback, if any."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    finally:
        probe.close()
    return None


def _reachable(address: str, port: int) -> bool:
    with socket.socket() as client:
        client.settimeout(2)
        try:
            client.connect((address, port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_the_store_and_the_ranks_listen_on_loopback_only() -> None:
    first, second = launch(listening_sockets_of_the_job, 2, timeout=LAUNCH_TIMEOUT)
    assert first["sum"] == second["sum"] == 2.0
    assert first["store"] == ["127.0.0.1"], first
    for r in (first, second):
        assert r["rank"], "gloo opened no listening socket?"
        assert set(r["rank"]) == {"127.0.0.1"}, r


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_the_store_is_not_reachable_on_a_non_loopback_address() -> None:
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with socket.create_server(("0.0.0.0", 0)) as everywhere:
        if not _reachable(address, everywhere.getsockname()[1]):
            pytest.skip(f"{address} is not reachable from this machine even for a socket on every interface")
    from fxpipe.distributed.launch import job_store

    store = job_store()
    assert _reachable("127.0.0.1", store.port)
    assert not _reachable(address, store.port)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_rank_that_raises_ends_the_others_within_seconds_and_is_named_first() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(rank_1_raises, 2, timeout=LAUNCH_TIMEOUT)
    elapsed = time.monotonic() - start
    assert elapsed < 15, elapsed  # grace (5 s) + start-up, not the other rank's 120 s wait
    err = info.value
    assert err.first == 1 and list(err.errors) == [1, 0], err
    assert str(err).startswith("rank 1 failed first"), err
    assert "rank 1 gives up" in err.errors[1]
    assert "ended by the launcher" in err.errors[0] and "after rank 1 failed" in err.errors[0]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_rank_that_dies_ends_the_others_after_the_grace_period() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(rank_dies, 2, timeout=LAUNCH_TIMEOUT, grace=1)
    assert time.monotonic() - start < 10
    assert info.value.first == 0 and "died (exit code -9)" in info.value.errors[0]
    assert "ended by the launcher" in info.value.errors[1]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_a_failure_record_forged_without_the_job_secret_is_ignored() -> None:
    first, second = launch(records_between_ranks, 2, timeout=LAUNCH_TIMEOUT)
    assert first["forged_seen"] is None and second["forged_seen"] is None
    assert first["published"] == "rank 0 saw a failure"  # the forged record did not block it
    assert first["final"] == second["final"] == "rank 0 saw a failure"
    assert first["secret"] and first["secret"] == second["secret"]
    assert os.environ.get(SECRET_ENV) != first["secret"]  # the parent keeps no copy in its env
    again, _ = launch(records_between_ranks, 2, timeout=LAUNCH_TIMEOUT)
    assert again["secret"] != first["secret"]  # one secret per job


def test_signed_records_verify_only_with_their_secret_and_key() -> None:
    secret, other = new_secret(), new_secret()
    record = sign("p/failure", "rank 2 died", secret)
    assert verify("p/failure", record, secret) == "rank 2 died"
    assert verify("p/failure", record.encode(), secret) == "rank 2 died"
    assert verify("p/failure", record, other) is None  # another job's secret
    assert verify("q/failure", record, secret) is None  # copied to another pipeline's key
    assert verify("p/failure", "rank 2 died", secret) is None  # unsigned
    assert verify("p/failure", record.replace("rank 2", "rank 3"), secret) is None  # altered
    assert verify("p/failure", "garbage", None) == "garbage"  # no secret: nothing to check


def test_publish_first_keeps_the_first_genuine_record_and_replaces_forged_ones() -> None:
    store = dist.HashStore()
    secret = new_secret()
    store.set("k", b"\xff forged")
    assert read_verified(store, "k", secret) is None
    assert publish_first(store, "k", "first", secret) == "first"
    assert publish_first(store, "k", "second", secret) == "first"  # the first genuine writer wins
    assert read_verified(store, "k", secret) == "first"
    assert read_verified(store, "missing", secret) is None


def test_a_module_planted_in_the_current_directory_is_not_run(tmp_path: Path) -> None:
    app, cwd = tmp_path / "app", tmp_path / "cwd"
    app.mkdir()
    cwd.mkdir()
    marker = tmp_path / "planted-ran"
    # the ranks' function lives in app/; the caller runs from cwd/, where two files are
    # planted: one named like the function's module, one like a module torch imports
    (app / "probe.py").write_text(textwrap.dedent("""
        def where():
            import colorsys
            import typing_extensions
            return colorsys.__file__, typing_extensions.__file__
    """))
    (app / "driver.py").write_text(textwrap.dedent("""
        import probe
        from fxpipe.distributed import launch

        if __name__ == "__main__":
            for files in launch(probe.where, 2, timeout=120):
                print(*files)
    """))
    planted = f"open({str(marker)!r}, 'a').write(__name__ + ' ')\nraise ImportError('planted')\n"
    for name in ("probe", "colorsys", "typing_extensions"):
        (cwd / f"{name}.py").write_text(planted)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    run = subprocess.run([sys.executable, str(app / "driver.py")], cwd=cwd, env=env, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not marker.exists(), f"planted modules ran: {marker.read_text()}"
    lines = run.stdout.split("\n")
    assert len([line for line in lines if line]) == 2
    assert str(cwd) not in run.stdout


@pytest.mark.timeout(60)
def test_cli_ends_the_other_ranks_and_exits_non_zero(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import os, time
        if os.environ["RANK"] == "1":
            raise SystemExit(3)
        time.sleep(120)
    """))
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "fxpipe.distributed", "-n", "2", str(script)], capture_output=True, text=True, timeout=50)
    assert time.monotonic() - start < 30
    assert run.returncode == 3, run.stdout + run.stderr
    assert "rank 1 failed first (exit code 3" in run.stderr, run.stderr


ENV_RANK = """
import os, sys, json, torch
sys.path.insert(0, {tests!r})
from test_launch import _listening
import fxpipe
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
x = torch.randn(4, 4)
pipe = fxpipe.compile(model, fxpipe.Plan(devices=["cpu", "cpu"], split=["2"], microbatches=2), example_inputs=(x,))
pipe(x)
port = int(os.environ["MASTER_PORT"])
print(json.dumps(sorted({{address for address, p, _ in _listening() if p == port}})), flush=True)
pipe.close()
torch.distributed.barrier()
"""


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads listening sockets from Linux's /proc")
@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_the_store_rank_0_hosts_under_plain_env_variables_listens_on_master_addr_only() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    script = textwrap.dedent(ENV_RANK.format(tests=str(Path(__file__).parent)))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**base, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    rank0 = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert rank0 == ["127.0.0.1"], rank0  # never 0.0.0.0 or ::
