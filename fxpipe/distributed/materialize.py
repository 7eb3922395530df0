"""Each rank builds only its own stages: models bigger than one process.

A model built under ``with torch.device("meta"):`` has shapes but no storage. The
compiler traces and partitions it as usual (shape propagation runs on meta tensors); each
rank then copies only its own stage modules, allocates their parameters and buffers on
its device and fills them from ``weights``:

- a mapping from the model's state_dict names to tensors (only this rank's keys are read,
  so a lazily loading mapping is read lazily);
- a path to a ``.safetensors`` file (opened with ``safe_open``: only this rank's tensors
  are read) or to a ``torch.save`` checkpoint (loaded with ``mmap=True``: pages of other
  stages' tensors are never touched);
- a callable ``init(stage_module)`` run on each of this rank's stage modules;
- ``None``: the model's own ``reset_parameters()`` on every submodule that has one.

A real (non-meta) model's stage modules on this rank hold the model's own parameters and
buffers, moved in place to the rank's device (as FSDP2 does): an optimizer built on
``model.parameters()`` updates them, and the other stages' tensors stay where they are. A
meta tensor cannot become real in place, so a model built on the meta device gets new
tensors on the rank's stages (``pipe.parameters()`` lists them), and so does
``Plan(fsdp=True)``, whose stages hold the parameters' shards.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fxpipe.runtime.placement import copy_module, move_in_place

Weights = Mapping[str, torch.Tensor] | str | os.PathLike | Callable[[nn.Module], None] | None


class MaterializeError(ValueError):
    """A stage's parameters cannot be filled as asked; the message names them."""


def check_weights_apply(weights: Weights, distributed: bool) -> None:
    """Raise MaterializeError when ``weights`` is given to a compile that runs in one process.

    ``weights=`` fills each rank's own stages; in one process the pipeline takes the
    model's own tensors, so the weights would be silently ignored. Loading them into the
    model first says the same thing once, in the user's code.
    """
    if weights is None or distributed:
        return
    raise MaterializeError(
        "weights= fills each process's own stages when the model is compiled distributed (torchrun, "
        "python -m fxpipe.distributed, fxpipe.distributed.launch); this compile runs in one process and "
        "uses the model's own tensors. Load the weights into the model before compiling: "
        "model.load_state_dict(torch.load(path)) (assign=True for a model built on the meta device), "
        "or call pipe.load_state_dict(...) afterwards"
    )


def open_weights(weights: Weights) -> Mapping[str, torch.Tensor] | Callable[[nn.Module], None] | None:
    """A lazily read mapping for a checkpoint path; mappings, callables and None as they are.

    Raises MaterializeError naming the file when it is missing, is not a readable
    ``.safetensors`` or ``torch.save`` checkpoint, or holds something other than a state
    dict (names to tensors).
    """
    if weights is None or callable(weights) or isinstance(weights, Mapping):
        return weights
    path = os.fspath(weights)
    if not os.path.isfile(path):
        raise MaterializeError(f"weights={path!r}: no such file")
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            return _SafetensorsMapping(safe_open(path, framework="pt", device="cpu"))
        except Exception as err:  # noqa: BLE001 - safetensors' own error type: name the file
            raise MaterializeError(
                f"weights={path!r} is not a readable .safetensors file ({_first_line(err)}); it may be "
                "truncated: write it again with safetensors.torch.save_file(model.state_dict(), path)"
            ) from err
    if not zipfile.is_zipfile(path):
        raise MaterializeError(
            f"weights={path!r} is not a torch.save checkpoint: not a zip archive (truncated, another "
            "format, or torch.save's pre-1.6 format); write it with torch.save(model.state_dict(), path)"
        )
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f" (a {found.group(1)})" if found else ""
        raise MaterializeError(
            f"weights={path!r} holds Python objects besides tensors{what}, which fxpipe does not unpickle "
            "(torch.load(weights_only=True)); save model.state_dict() instead"
        ) from err
    except Exception as err:  # noqa: BLE001 - a damaged archive: name the file
        raise MaterializeError(f"weights={path!r} could not be read as a torch.save checkpoint ({_first_line(err)})") from err
    _check_state_dict(path, state)
    return state


def _check_state_dict(path: str, state: Any) -> None:
    if not isinstance(state, Mapping):
        raise MaterializeError(
            f"weights={path!r} holds a {type(state).__name__}, not a state dict (names to tensors); "
            "write it with torch.save(model.state_dict(), path)"
        )
    others = {k: type(v).__name__ for k, v in state.items() if not isinstance(v, torch.Tensor)}
    if others:
        listed = ", ".join(f"{k!r} ({t})" for k, t in list(others.items())[:5])
        nested = [k for k, v in state.items() if isinstance(v, Mapping)]
        hint = (
            f"; a training checkpoint? pass its state dict: weights=torch.load(path)[{nested[0]!r}], or save that entry alone"
            if nested
            else "; save model.state_dict() instead"
        )
        raise MaterializeError(f"weights={path!r} holds entries that are not tensors: {listed}{hint}")


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


class _SafetensorsMapping(Mapping):
    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.names = set(handle.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.names:
            raise KeyError(key)
        return self.handle.get_tensor(key)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def materialize(
    modules: dict[int, nn.Module],
    device: torch.device,
    weights: Weights,
    aliases: Mapping[str, list[str]],
    own: bool = True,
) -> dict[int, nn.Module]:
    """Copies of this rank's stage modules with real tensors on ``device``.

    modules: stage index -> stage module (referencing the user's model, possibly on meta);
    aliases: every name of each tensor of the model (tied weights have several); own:
    whether the copies hold the model's own (real) parameters, moved in place, or copies of
    them (FSDP replaces the parameters by their shards, which the model then takes,
    :func:`fxpipe.distributed.fsdp.hand_to_model`: the model's own, moved, would keep whole
    copies on the device). Buffers are the model's own, moved, either way.
    Tensors shared between the stages stay shared. Raises MaterializeError naming the
    stage and tensor that no checkpoint entry or ``reset_parameters`` fills.
    """
    memo: dict[int, Any] = {}
    fresh: dict[int, tuple[int, str]] = {}  # id of allocated-from-meta tensor -> (stage, name)
    for s, module in modules.items():
        for path, sub in module.named_modules():
            for slot in (sub._parameters, sub._buffers):
                for name, tensor in slot.items():
                    if tensor is None or id(tensor) in memo:
                        continue
                    if tensor.is_meta:
                        memo[id(tensor)] = _allocated(tensor, device)
                        fresh[id(memo[id(tensor)])] = (s, f"{path}.{name}" if path else name)
                    elif own or slot is sub._buffers:
                        move_in_place(tensor, device)
                        memo[id(tensor)] = tensor  # the model's own object
                    else:
                        memo[id(tensor)] = _copied(tensor, device)
    copies = {s: copy_module(m, memo) for s, m in modules.items()}  # generated code shared
    source = open_weights(weights)
    if callable(source) and not isinstance(source, Mapping):
        with torch.no_grad():
            for module in copies.values():
                source(module)
        return copies
    if isinstance(source, Mapping):
        _load(copies, source, aliases, fresh)
        return copies
    if fresh:
        _reset(copies, fresh)
    return copies


def _allocated(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _as_kind_of(tensor, torch.empty_like(tensor, device=device))


def _copied(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _as_kind_of(tensor, tensor.detach().to(device))


def _as_kind_of(tensor: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


def _load(copies: dict[int, nn.Module], state: Mapping[str, torch.Tensor], aliases: Mapping[str, list[str]], fresh: dict) -> None:
    missing = []
    seen: set[int] = set()
    with torch.no_grad():
        for s, module in copies.items():
            for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
                if id(tensor) in seen:
                    continue
                key = next((k for k in aliases.get(name, [name]) if k in state), None)
                if key is None:
                    if id(tensor) in fresh:
                        missing.append(f"{name} (stage {s})")
                    continue
                value = state[key]
                if not isinstance(value, torch.Tensor):
                    raise MaterializeError(f"weights[{key!r}] is a {type(value).__name__}, not a tensor")
                if tuple(value.shape) != tuple(tensor.shape):
                    raise MaterializeError(f"weights[{key!r}] has shape {tuple(value.shape)}, stage {s} expects {tuple(tensor.shape)}")
                tensor.copy_(value)
                seen.add(id(tensor))
    if missing:
        raise MaterializeError(
            f"the weights have no entry for {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}; "
            "pass a state dict or checkpoint holding every key of model.state_dict()"
        )


def _reset(copies: dict[int, nn.Module], fresh: dict[int, tuple[int, str]]) -> None:
    filled: set[int] = set()
    with torch.no_grad():
        for module in copies.values():
            for sub in module.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset) and sub is not module:
                    reset()
                    filled.update(id(t) for t in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)))
    unfilled = [f"{name} (stage {s})" for key, (s, name) in fresh.items() if key not in filled]
    if unfilled:
        raise MaterializeError(
            f"{', '.join(unfilled[:8])}{' …' if len(unfilled) > 8 else ''} belong to no module with "
            "reset_parameters(), so nothing can initialise them on this rank; pass weights= (a state "
            "dict, a .safetensors or torch.save checkpoint path, or an init function)"
        )
