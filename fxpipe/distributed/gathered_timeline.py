"""Every rank's events of the last call, gathered into one pipeline timeline.

Each rank records its own actions in seconds from the moment it started the call (see the
executor). After every call, :func:`publish` leaves them in the job's store (one small
packet per rank, in one of a few slots by call number; a store write costs well under a
millisecond). :func:`collect` reads the packets of the pipeline's ranks for one call, on
whichever rank asks and only when it asks: no collective, so ``pipe.timeline()`` may be
called on one rank alone (``if rank == 0: pipe.timeline().plot(...)``). Each rank's events
are shifted by the wall-clock time at which it started the call, which puts them on one
clock: ranks on one host share their clock exactly; ranks on several hosts are as well
aligned as their clocks (NTP keeps them within about a millisecond).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from fxpipe.distributed.faults import RankFailedError, Watchdog
from fxpipe.inspection.timeline import EVENT_OPS, Event

DEVICE_CHARS = 32  # a device name's room in a packet ("cuda:0", "cpu")
FIELDS = 6  # worker, stage, micro-batch, op, start, end
HEADER = 2 + DEVICE_CHARS  # the step's wall-clock start, the number of events, the device
_POLL = 0.02  # seconds between looks at a late rank's slot


def pack(events: Sequence[Event], started: float, device: str) -> torch.Tensor:
    """One rank's events as a float64 tensor: ``started`` (wall-clock seconds when its
    step began), the number of events, its device name's characters, then per event its
    worker, stage, micro-batch, op (an index into ``EVENT_OPS``), start and end."""
    name = [float(ord(c)) for c in device[:DEVICE_CHARS]]
    header = [started, float(len(events)), *name, *[0.0] * (DEVICE_CHARS - len(name))]
    body = [
        value
        for e in events
        for value in (e.worker, e.stage, e.microbatch, EVENT_OPS.index(e.op), e.start, e.end)
    ]
    return torch.tensor(header + body, dtype=torch.float64)


def unpack(packet: torch.Tensor, shift: float) -> list[Event]:
    """The events of a :func:`pack` ed tensor, their times moved later by ``shift`` seconds."""
    values = packet.tolist()
    count = int(values[1])
    device = "".join(chr(int(c)) for c in values[2:HEADER] if c)
    events = []
    for k in range(count):
        worker, stage, microbatch, op, start, end = values[HEADER + FIELDS * k : HEADER + FIELDS * (k + 1)]
        events.append(Event(int(worker), int(stage), int(microbatch), EVENT_OPS[int(op)], start + shift, end + shift, device))
    return events


SLOTS = 4  # calls whose packets the store keeps per rank (a rank is at most one call ahead of its pipeline)


def _key(watchdog: Watchdog, rank: int, call: int) -> str:
    return f"{watchdog.prefix}timeline/{rank}/{call % SLOTS}"


def publish(watchdog: Watchdog, call: int, events: Sequence[Event], started: float, device: str) -> None:
    """Leave this rank's events of call number ``call`` in the job's store."""
    packet = torch.cat([torch.tensor([float(call)], dtype=torch.float64), pack(events, started, device)])
    watchdog.store.set(_key(watchdog, watchdog.rank, call), packet.numpy().tobytes())


def collect(watchdog: Watchdog, ranks: Sequence[int], call: int, timeout: float) -> list[Event]:
    """The events of call number ``call`` on every rank of ``ranks``, on one clock (seconds
    from the earliest rank's start). Waits up to ``timeout`` seconds for a rank that has not
    finished the call yet; raises RankFailedError naming it when it does not."""
    deadline = time.monotonic() + timeout
    packets: dict[int, torch.Tensor] = {}
    while len(packets) < len(ranks):
        for rank in ranks:
            if rank not in packets:
                packet = _read(watchdog, rank, call)
                if packet is not None:
                    packets[rank] = packet
        if len(packets) == len(ranks):
            break
        failure = watchdog.recorded()
        if failure is not None:
            raise failure
        if time.monotonic() > deadline:
            late = [r for r in ranks if r not in packets]
            raise RankFailedError(
                f"rank {late[0]} has not finished call {call} of the pipeline after {timeout:g} s, so its part of the "
                "timeline is missing (it is slow, stuck or gone; pipe.timeline(gather=False) shows this rank's alone)",
                late[0],
            )
        time.sleep(_POLL)
    origin = min(float(p[0]) for p in packets.values())
    return [e for r in ranks for e in unpack(packets[r], float(packets[r][0]) - origin)]


def _read(watchdog: Watchdog, rank: int, call: int) -> torch.Tensor | None:
    """``rank``'s packet of call ``call``, None while its slot is empty or holds another call."""
    key = _key(watchdog, rank, call)
    if not watchdog.store.check([key]):
        return None
    values = torch.frombuffer(bytearray(watchdog.store.get(key)), dtype=torch.float64)
    return values[1:] if int(values[0]) == call else None


__all__ = ["collect", "pack", "publish", "unpack"]
