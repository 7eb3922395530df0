"""Every rank's events of the last step, gathered into one pipeline timeline.

Each rank records its own actions in seconds from the moment it started the step (see
``RankExecutor.run``). :func:`gather_events` collects them on every rank of one pipeline
(a replica's ``"pp"`` group) and puts them on one clock, shifting each rank's events by
the wall-clock time at which it started: two all-gathers, after the step and only when a
timeline is asked for, so steps pay nothing for it. Ranks on one host share their clock
exactly; ranks on several hosts are as well aligned as their clocks (NTP keeps them within
about a millisecond).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fxpipe.distributed.faults import Watchdog
from fxpipe.timeline import EVENT_OPS, Event

DEVICE_CHARS = 32  # a device name's room in a packet ("cuda:0", "cpu")
FIELDS = 6  # worker, stage, micro-batch, op, start, end
HEADER = 2 + DEVICE_CHARS  # the step's wall-clock start, the number of events, the device


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


def gather_events(
    events: Sequence[Event], started: float, device: torch.device, group: dist.ProcessGroup, watchdog: Watchdog
) -> list[Event]:
    """Returns the events of every rank of ``group`` on one clock (seconds from the
    earliest rank's start). A collective: every rank of ``group`` calls it after the same
    step. Raises RankFailedError (through ``watchdog``) when a rank of the group is gone."""
    peers = dist.get_process_group_ranks(group)
    mine = pack(events, started, str(device)).to(device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in peers]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), watchdog, peers)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.float64, device=device)
    padded[: mine.numel()] = mine
    packets = [torch.zeros_like(padded) for _ in peers]
    _wait(dist.all_gather(packets, padded, group=group, async_op=True), watchdog, peers)
    packets = [p.cpu() for p in packets]
    origin = min(float(p[0]) for p in packets)
    return [e for p in packets for e in unpack(p, float(p[0]) - origin)]


def _wait(work: dist.Work, watchdog: Watchdog, peers: Sequence[int]) -> None:
    watchdog.wait([(work, None)], lambda: "the other ranks' timelines of the last step", peers=peers)


__all__ = ["gather_events", "pack", "unpack"]
