"""``Stage``: one piece of the pipeline, as users inspect it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxpipe.passes.partition import Edge


@dataclass
class Stage:
    """One pipeline stage.

    index: position in the pipeline; device: logical device name ("cpu:1", "cuda:0");
    module: the stage's ``fx.GraphModule`` (its ``.code`` reads like its forward);
    inputs: the recv edges feeding it (stage 0 also takes the model's inputs, named in
    ``model_inputs``); outputs: the send edges leaving it; reason: why its nodes are there.

    Compile-time facts the runtimes read instead of recomputing: ``recv_ids`` /
    ``send_ids`` (each edge's index in the partitioned graph's edge list, in argument /
    output order), ``mutated_inputs`` (argument positions its forward writes in place),
    ``extra_inputs`` (the roles of the trailing arguments compiler passes added: "rng_seed",
    "weight_grads") and ``buffers_written`` (buffers its forward updates in place, by name:
    a checkpoint recompute restores them); ``recompute`` (what it keeps for backward:
    False, True or "selective", as ``Plan.checkpoint`` resolves for it), ``offload``
    (its saved tensors go to host memory between forward and backward) and
    ``split_backward`` (the schedule runs its backward as "I" and "W": its graph defers the
    weight gradients op by op when it has the "weight_grads" role, a compiled stage splits
    its compiled backward graph).
    """

    index: int
    device: str
    module: fx.GraphModule
    inputs: list[Edge]
    outputs: list[Edge]
    reason: str = ""
    model_inputs: list[str] = field(default_factory=list)
    module_paths: list[str] = field(default_factory=list)
    recv_ids: list[int] = field(default_factory=list)
    send_ids: list[int] = field(default_factory=list)
    mutated_inputs: frozenset[int] = frozenset()
    extra_inputs: tuple[str, ...] = ()
    buffers_written: tuple[str, ...] = ()
    recompute: bool | str = False
    offload: bool = False
    split_backward: bool = False

    @property
    def num_nodes(self) -> int:
        return sum(1 for n in self.module.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    @property
    def recv_bytes(self) -> int:
        return sum(e.nbytes for e in self.inputs)

    @property
    def send_bytes(self) -> int:
        return sum(e.nbytes for e in self.outputs)

    @property
    def module_range(self) -> str:
        """First and last module paths the stage runs, e.g. ``layer2.0.conv1 … layer3.1.bn2``."""
        paths = [p for p in self.module_paths if p]
        if not paths:
            return "(root)"
        return paths[0] if paths[0] == paths[-1] else f"{paths[0]} … {paths[-1]}"

    def __repr__(self) -> str:
        return (
            f"Stage({self.index}, device={self.device!r}, nodes={self.num_nodes}, "
            f"params={self.num_parameters}, inputs={[e.name for e in self.inputs]}, "
            f"outputs={[e.name for e in self.outputs]})"
        )
