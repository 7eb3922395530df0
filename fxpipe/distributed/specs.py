"""What crosses each edge, per input signature: shapes and dtypes known before anything runs.

A rank receives a value by posting ``irecv`` into buffers of the right shape and dtype,
so both ends must agree on them without asking each other. Every rank holds a *skeleton*
of every stage (the stage module with its parameters and buffers on the ``meta``
device: no memory) and runs the whole pipeline once on fake tensors for a micro-batch's
input signature, with the compiler's fake replay (``fxpipe.passes.fake_replay``, handed in
by the pipeline: a layer repeated across stages runs once). That gives, for every edge,
the pytree of the value it carries: tensor
leaves become :class:`LeafSpec` (shape, dtype, whether a gradient flows back) and
non-tensor leaves (None, Python numbers, strings) are kept as the values themselves, so
they never travel. The result is cached per signature: another batch size or the short
last batch of an epoch costs one fake run, never a runtime shape exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.batching.microbatch import tensors_inside


class SignatureError(RuntimeError):
    """A stage cannot be run on fake tensors (its output depends on the data)."""


@dataclass(frozen=True)
class LeafSpec:
    """One tensor leaf of an edge value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class ValueSpec:
    """An edge value: its pytree structure, tensor leaves as LeafSpec, other leaves as is."""

    treespec: Any
    leaves: tuple[Any, ...]

    @cached_property
    def tensors(self) -> list[int]:
        """Positions of the tensor leaves (the only ones that are sent)."""
        return [k for k, leaf in enumerate(self.leaves) if isinstance(leaf, LeafSpec)]

    @cached_property
    def unsendable(self) -> list[str]:
        """The types of the constant leaves that hold tensors (objects that are no
        registered pytree): a message cannot carry them."""
        return [type(leaf).__name__ for leaf in self.leaves if not isinstance(leaf, LeafSpec) and tensors_inside(leaf)]

    @cached_property
    def grads(self) -> list[int]:
        """Positions of the tensor leaves whose gradient goes back to the producer."""
        return [k for k, leaf in enumerate(self.leaves) if isinstance(leaf, LeafSpec) and leaf.requires_grad]

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The value, from received tensors (in ``tensors`` order) and the constant leaves;
        tensors require grad as the sender's did."""
        it = iter(tensors)
        leaves = [next(it).requires_grad_(leaf.requires_grad) if isinstance(leaf, LeafSpec) else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.treespec)


def value_spec(value: Any) -> ValueSpec:
    leaves, treespec = pytree.tree_flatten(value)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(LeafSpec(tuple(int(d) for d in leaf.shape), leaf.dtype, bool(leaf.requires_grad)))
        else:
            out.append(leaf)
    return ValueSpec(treespec, tuple(out))


def fake_extras(stage: Any) -> list[Any]:
    """Stand-ins for a stage's trailing compiler-added arguments in a fake run: any seed
    (shapes do not depend on it), no weight-gradient store."""
    return [0 if role == "rng_seed" else None for role in stage.extra_inputs]


def derive_edge_specs(
    skeletons: Sequence[nn.Module],
    recv_edges: Sequence[Sequence[int]],
    send_edges: Sequence[Sequence[int]],
    inputs: list,
    train: bool,
    autocast: Any = None,
    extras: Sequence[Sequence[Any]] | None = None,
    *,
    replay: Any,
) -> dict[int, ValueSpec]:
    """Run every stage on fake tensors for one micro-batch; return each edge's ValueSpec.

    skeletons: per stage, a meta copy (see :func:`skeleton`); recv_edges / send_edges:
    per stage, the edge ids of its inputs after the model's (in argument order) and of
    its output tuple; inputs: the micro-batch's flat model inputs (real or fake);
    autocast: the caller's ``AutocastState`` (edges carry what autocast makes of them);
    extras: per stage, values for its trailing compiler-added arguments (a seed, a store);
    replay: the fake-tensor runner (the compiler's ``FakeReplay(device="cpu")``, handed in:
    one replay for every stage, so a layer repeated across stages runs once).
    Raises SignatureError naming the stage when a stage cannot run on fake tensors.
    """
    values: dict[int, Any] = {}
    last_sender = max((s for s, sends in enumerate(send_edges) if sends), default=-1)
    autocast_applied = autocast.applied() if autocast is not None else contextlib.nullcontext()
    with torch.set_grad_enabled(train), autocast_applied:
        for s in range(last_sender + 1):
            args = list(inputs) if s == 0 else []
            args += [values[e] for e in recv_edges[s]]
            args += list(extras[s]) if extras is not None else []
            try:
                out = replay.run(skeletons[s], args)
            except Exception as err:
                raise SignatureError(
                    f"stage {s} cannot run on fake tensors for this input signature, so the shapes it "
                    f"sends are unknown: {type(err).__name__}: {err}"
                ) from err
            for k, edge in enumerate(send_edges[s]):
                values[edge] = out[k]
    return {edge: value_spec(v) for edge, v in values.items()}
