"""Training checkpoints: crash-safe, verified, and independent of the pipeline's layout.

``save_checkpoint(path, pipe, optimizer, scheduler, extra)`` writes the model's state, the
optimizer's and the scheduler's with ``torch.distributed.checkpoint`` (DCP), every rank its
own share, all keyed by the model's names:

- ``model.<key>``: the model's state_dict keys (``pipe.sharded_state_dict()``);
- ``optimizer.state.<param name>.<key>``: each parameter's optimizer state (momentum,
  ``exp_avg``, ``step``, ...);
- ``optimizer.group.<param name>``: the hyperparameters of the group holding that
  parameter (``lr``, ``betas``, ``initial_lr``, ...);
- ``scheduler`` and ``extra``: pickled objects.

So a checkpoint written by 2 stages loads into 3 stages, one stage, another schedule, or a
single process after a run on several ranks: each process reads the names it holds, and
DCP reassembles tensors saved in shards.

Atomic: the files go to a temporary sibling directory (``<path>.saving``), then a manifest
of their SHA-256 hashes, then the directory takes ``path``'s place in one rename (Linux's
``renameat2(RENAME_EXCHANGE)``; elsewhere two renames, the old checkpoint kept at
``<path>.old`` until the new one is in place, and ``load_checkpoint`` looks there if
``path`` is gone). A process killed at any point of a save leaves the previous checkpoint
loadable. Verified: ``load_checkpoint`` checks every file against the manifest first and
raises :class:`CheckpointError` naming a file that is missing, truncated or altered.

``FXPIPE_CHECKPOINT_PAUSE="write:S"`` (or ``"swap:S"``), a testing tool, makes a save sleep
S seconds once the data files are written (or once everything is written, before the swap),
so a test can kill the process inside the save.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MANIFEST = "fxpipe-manifest.json"
_FORMAT = 1
_MODEL, _STATE, _GROUP = "model.", "optimizer.state.", "optimizer.group."
_SCHEDULER, _EXTRA = "scheduler", "extra"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message names the file
    or entry at fault and what to do."""


# ------------------------------------------------------------------ saving
def save_checkpoint(
    path: str | os.PathLike,
    pipe: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: Any = None,
    keep: int = 1,
) -> None:
    """Write ``pipe``'s model state (and ``optimizer``'s, ``scheduler``'s, ``extra``) to the
    directory ``path``, replacing a checkpoint there only once the new one is complete.

    Every process of a distributed pipeline must call it (DCP's collectives). ``extra``: any
    picklable object (a step count, RNG states), returned by :func:`load_checkpoint`.
    ``keep``: how many checkpoints to keep, the newest at ``path``: the one it replaces
    becomes ``<path>.1``, an older ``<path>.1`` becomes ``<path>.2``, and so on up to
    ``<path>.<keep - 1>`` (each loadable as a checkpoint of its own); 1 keeps only the newest.
    Raises CheckpointError when the optimizer holds state for a parameter that is not one
    of the pipeline's model's, or when the directory cannot be written; ValueError when
    ``keep`` is not a positive integer.
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"save_checkpoint(keep={keep!r}): give how many checkpoints to keep, an integer >= 1 (1: only the newest)")
    path = os.path.abspath(os.fspath(path))
    staging = path + ".saving"
    state = _model_entries(pipe)
    if optimizer is not None:
        state.update(_optimizer_entries(pipe, optimizer))
    if scheduler is not None:
        state[_SCHEDULER] = pickle.dumps(scheduler.state_dict())
    if extra is not None:
        state[_EXTRA] = pickle.dumps(extra)
    _on_first_rank(lambda: shutil.rmtree(staging, ignore_errors=True))  # a save killed earlier
    with _one_process_quietly():
        dcp.save(state, storage_writer=_PausingWriter(staging), no_dist=not _distributed())
    _on_first_rank(lambda: _finish(staging, path, keep))


def _model_entries(pipe: Any) -> dict[str, Any]:
    return {_MODEL + key: tensor for key, tensor in pipe.sharded_state_dict().items()}


def _optimizer_entries(pipe: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state and group hyperparameters under the model's parameter names.
    Parameters the pipeline does not hold here (other ranks' stages) carry no state and
    are left to the ranks that hold them."""
    names = {id(p): name for name, p in pipe.named_parameters()}
    entries: dict[str, Any] = {}
    for index, group in enumerate(optimizer.param_groups):
        hyper = pickle.dumps({k: v for k, v in group.items() if k != "params"})
        for param in group["params"]:
            name = names.get(id(param))
            state = optimizer.state.get(param, {})
            if name is None:
                if state:
                    raise CheckpointError(
                        f"the optimizer holds state for a parameter of shape {tuple(param.shape)} (group {index}) that is "
                        "not one of the pipeline's model's, so it has no name to be saved under; build the optimizer "
                        "on model.parameters() or pipe.parameters()"
                    )
                continue
            entries[_GROUP + name] = hyper
            for key, value in state.items():
                entries[f"{_STATE}{name}.{key}"] = value.detach() if isinstance(value, torch.Tensor) else pickle.dumps(value)
    return entries


def _finish(staging: str, path: str, keep: int) -> None:
    """Hash the written files into the manifest, then put ``staging`` in ``path``'s place;
    the checkpoint it replaces is kept as ``<path>.1`` when ``keep`` > 1 (:func:`_retire`)."""
    _write_manifest(staging)
    _pause("swap")
    if os.path.exists(path):
        if _exchange(staging, path):
            _retire(staging, path, keep)
        else:
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(staging, path)
            _retire(old, path, keep)
    else:
        os.rename(staging, path)
        shutil.rmtree(path + ".old", ignore_errors=True)  # a save killed between its two renames left it
    _sync_directory(os.path.dirname(path))


def _retire(replaced: str, path: str, keep: int) -> None:
    """The checkpoint just replaced (now at ``replaced``) becomes ``<path>.1``, the older ones
    move up one number, the one past ``<path>.<keep - 1>`` is deleted; with ``keep`` 1 the
    replaced one is deleted. Only renames: a process killed here loses at most the replaced
    checkpoint (the next save clears ``replaced``), never the one at ``path``."""
    if keep == 1:
        shutil.rmtree(replaced)
        return
    shutil.rmtree(f"{path}.{keep - 1}", ignore_errors=True)
    for k in range(keep - 2, 0, -1):
        if os.path.exists(f"{path}.{k}"):
            os.rename(f"{path}.{k}", f"{path}.{k + 1}")
    os.rename(replaced, f"{path}.1")


def _write_manifest(directory: str) -> None:
    files = {name: _digest(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}
    manifest = os.path.join(directory, MANIFEST)
    with open(manifest, "w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _digest(file: str) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"sha256": sha.hexdigest(), "bytes": os.path.getsize(file)}


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic rename; False where the system cannot."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if rename(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"swapping {a} and {b}: {os.strerror(code)}")


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _PausingWriter(dcp.FileSystemWriter):
    """DCP's file writer, pausing before the metadata when a test asks (see the module doc)."""

    def finish(self, metadata: Any, results: Any) -> None:
        _pause("write")
        super().finish(metadata, results)


def _pause(stage: str) -> None:
    asked = os.environ.get("FXPIPE_CHECKPOINT_PAUSE", "")
    where, _, seconds = asked.partition(":")
    if where == stage:
        time.sleep(float(seconds or 3600))


# ------------------------------------------------------------------ loading
def load_checkpoint(path: str | os.PathLike, pipe: Any, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into ``pipe`` (in place), and
    into ``optimizer`` and ``scheduler`` when given; returns the saved ``extra`` (None if
    none). Any layout: the model's names find their tensors.

    Every process of a distributed pipeline must call it. Raises CheckpointError when
    there is no checkpoint at ``path``, when a file is missing or its contents differ from
    the manifest's hash (naming the file), or when the checkpoint lacks what is asked
    (model keys, the optimizer's or scheduler's state).
    """
    directory = _resolved(os.path.abspath(os.fspath(path)))
    verify(directory)
    stored = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    state = _model_entries(pipe)
    missing = [key[len(_MODEL):] for key in state if key not in stored]
    if missing:
        raise CheckpointError(f"{directory} has no entry for the model's {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}: saved from another model?")
    names = _optimizer_names(pipe, optimizer) if optimizer is not None else []
    if optimizer is not None:
        state.update(_optimizer_template(directory, stored, pipe, names))
    for key, wanted in ((_SCHEDULER, scheduler is not None), (_EXTRA, _EXTRA in stored)):
        if wanted:
            if key not in stored:
                raise CheckpointError(f"{directory} holds no {key} state: it was saved without one")
            state[key] = b""
    with _one_process_quietly():
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=not _distributed())
    if optimizer is not None:
        _restore_optimizer(optimizer, pipe, state)
    if scheduler is not None:
        scheduler.load_state_dict(pickle.loads(state[_SCHEDULER]))
    return pickle.loads(state[_EXTRA]) if _EXTRA in state else None


def _resolved(path: str) -> str:
    """The checkpoint directory for ``path``: itself, or the previous checkpoint that a
    save killed between its two renames left at ``<path>.old``."""
    for candidate in (path, path + ".old"):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
    if os.path.isdir(path):
        raise CheckpointError(f"{path} holds no {MANIFEST}: not written by fxpipe.save_checkpoint, or its save did not finish")
    raise CheckpointError(f"no checkpoint at {path}")


def verify(directory: str) -> None:
    """Check every file of the checkpoint in ``directory`` against its manifest's size and
    SHA-256 hash. Raises CheckpointError naming the first file missing or differing."""
    with open(os.path.join(directory, MANIFEST)) as f:
        try:
            files = json.load(f)["files"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{os.path.join(directory, MANIFEST)} is damaged ({err}); the checkpoint cannot be verified") from err
    for name, expected in files.items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing from the checkpoint")
        found = _digest(file)
        if found != expected:
            what = "truncated or extended" if found["bytes"] != expected["bytes"] else "altered"
            raise CheckpointError(
                f"{file} is {what}: its SHA-256 hash differs from the manifest's ({found['bytes']} bytes, "
                f"{expected['bytes']} written); load an earlier checkpoint"
            )


def _optimizer_names(pipe: Any, optimizer: torch.optim.Optimizer) -> list[list[str | None]]:
    """Per group, each parameter's model name (None for parameters not held here)."""
    names = {id(p): name for name, p in pipe.named_parameters()}
    return [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]


def _optimizer_template(directory: str, stored: dict, pipe: Any, names: list[list[str | None]]) -> dict[str, Any]:
    """Where DCP loads the optimizer's entries: a tensor of the stored size and dtype per
    state entry (shaped like the parameter, and sharded like it, where it is), bytes for
    the rest."""
    params = dict(pipe.named_parameters())
    template: dict[str, Any] = {}
    for name in (n for group in names for n in group if n is not None):
        if _GROUP + name not in stored:
            raise CheckpointError(f"{directory} holds no optimizer state for {name}: it was saved without an optimizer, or from another model")
        template[_GROUP + name] = b""
        for key in (k for k in stored if k.startswith(f"{_STATE}{name}.") and "." not in k[len(_STATE) + len(name) + 1 :]):
            meta = stored[key]
            if not isinstance(meta, TensorStorageMetadata):
                template[key] = b""
            elif tuple(meta.size) == tuple(params[name].shape) and meta.properties.dtype == params[name].dtype:
                template[key] = torch.zeros_like(params[name].detach())  # where the parameter is, sharded as it is
            else:
                template[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return template


def _restore_optimizer(optimizer: torch.optim.Optimizer, pipe: Any, loaded: dict[str, Any]) -> None:
    """Hand the loaded entries to ``optimizer.load_state_dict`` in its own numbering (it
    moves the state to each parameter's device and dtype)."""
    names = _optimizer_names(pipe, optimizer)
    state: dict[int, dict] = {}
    groups = []
    index = 0
    for group, group_names in zip(optimizer.param_groups, names):
        hyper = next((pickle.loads(loaded[_GROUP + n]) for n in group_names if n is not None), None)
        if hyper is None:  # none of its parameters is held here: it stays as it is
            hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(index, index + len(group_names)))})
        for name in group_names:
            if name is not None:
                entries = _entries_of(loaded, name)
                if entries:
                    state[index] = entries
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _entries_of(loaded: dict[str, Any], name: str) -> dict[str, Any]:
    prefix = f"{_STATE}{name}."
    return {
        key[len(prefix) :]: value if isinstance(value, torch.Tensor) else pickle.loads(value)
        for key, value in loaded.items()
        if key.startswith(prefix) and "." not in key[len(prefix) :]
    }


# ------------------------------------------------------------ coordination
def _on_first_rank(work: Any) -> None:
    """Run ``work`` on rank 0 (the only process when not distributed); every rank raises
    what it raised, after it finished."""
    if not _distributed():
        work()
        return
    failure = [None]
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as err:  # noqa: BLE001 - handed to every rank below
            failure = [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointError(f"rank 0 could not write the checkpoint: {failure[0]}")



def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
