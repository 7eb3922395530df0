"""Device names as users write them, and the torch devices they run on.

fxpipe accepts ``"cpu"``, ``"cpu:N"`` (distinct *logical* CPU devices: they plan and
report as separate devices but run on the same host CPU), ``"cuda:N"`` and Paddle's
``"gpu:N"`` alias. Everything else is rejected with the list of accepted spellings.
"""

from __future__ import annotations

import re

import torch

_DEVICE_RE = re.compile(r"^(cpu|cuda|gpu)(?::(\d+))?$")


class DeviceError(ValueError):
    """A device name fxpipe does not understand, or one this machine cannot provide."""


def normalize_device(name: str | torch.device, where: str = "device") -> str:
    """Return the canonical logical name of a device: ``"cpu"``, ``"cpu:N"`` or ``"cuda:N"``.

    ``"gpu:N"`` becomes ``"cuda:N"``; a bare ``"cuda"``/``"gpu"`` means ``"cuda:0"``.
    Raises DeviceError naming ``where`` (for example ``plan.devices[2]``) when the name is
    not a device fxpipe knows.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise DeviceError(f"{where}: expected a device name such as 'cpu' or 'cuda:0', got {name!r}")
    match = _DEVICE_RE.match(name.strip().lower())
    if match is None:
        raise DeviceError(
            f"{where}: unknown device {name!r}; use 'cpu', 'cpu:N' (a logical CPU device), "
            "'cuda:N' or its alias 'gpu:N'"
        )
    kind, index = match.groups()
    if kind == "cpu":
        return "cpu" if index is None else f"cpu:{index}"
    return f"cuda:{index or 0}"


def torch_device(name: str) -> torch.device:
    """The torch device a logical device runs on (every ``cpu:N`` is the host CPU)."""
    name = normalize_device(name)
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def check_available(name: str, where: str = "device") -> None:
    """Raise DeviceError when ``name`` is a CUDA device this process cannot use."""
    name = normalize_device(name, where)
    if not name.startswith("cuda"):
        return
    index = int(name.split(":")[1])
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        have = "CUDA is not available here" if count == 0 else f"this machine has {count} CUDA device(s)"
        raise DeviceError(
            f"{where} = {name!r} but {have}; place the stage on 'cpu' or 'cpu:N', or plan "
            "without the hardware with fxpipe.partition(model, plan, example_inputs=...)"
        )


def default_devices(num_stages: int) -> list[str]:
    """One device per stage: the visible GPUs in turn when CUDA is present, else logical CPUs."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        return [f"cuda:{i % count}" for i in range(num_stages)]
    return [f"cpu:{i}" for i in range(num_stages)]
