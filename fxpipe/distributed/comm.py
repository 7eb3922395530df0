"""Messages between ranks: what each action receives before it runs and sends after.

For one rank's action list, ``F(s, i)`` receives micro-batch i's activation on every
edge into stage s whose producer runs on another rank, and sends its outputs on every
edge leaving for another rank; ``B(s, i)`` and ``I(s, i)`` receive the gradients of its
outputs and send the gradients of its inputs; ``W(s, i)`` exchanges nothing. Only tensor leaves travel (non-tensor leaves are
known from the edge's spec), and a gradient message carries only the leaves a gradient
flows through. Every message is identified by ``(kind, edge, micro-batch)``.

How the ops are posted depends on the backend, and both ways are deadlock-free for any
schedule ``check_schedule`` accepts:

- **gloo** (``prefetch``): each op has a unique tag, so ranks may post in any order.
  Sends are posted as soon as their action finishes and never waited on until the end
  of the step; the receives of action k+1 are posted before action k computes, so
  transfers overlap compute. A rank only ever blocks on a receive whose sender's action
  precedes it in the schedule's dependency order: the checker's proof applies.
- **nccl** (``fused``): NCCL matches ops by order and a send blocks its stream until the
  receiver posts, so ranks must agree on an order. The sends of action k and the
  receives of action k+1 go out as one ``batch_isend_irecv`` group (as
  torch.distributed.pipelining's fused 1F1B does); :func:`check_rendezvous` proves,
  before anything runs, that the groups of all ranks complete under NCCL's rules.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch.distributed as dist

from fxpipe.distributed.specs import ValueSpec
from fxpipe.runtime.interpret import ACT, GRAD, inbound, outbound
from fxpipe.schedules import Action


class CommPlanError(RuntimeError):
    """The per-rank message order cannot work on this backend (it would mismatch or hang)."""


@dataclass(frozen=True)
class Message:
    """One value crossing between ranks: its kind, edge, micro-batch, the other rank, and
    the leaf positions (in the edge's ValueSpec) whose tensors travel."""

    kind: str
    edge: int
    microbatch: int
    peer: int
    leaves: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.edge, self.microbatch)


@dataclass
class ActionMessages:
    """Per action of one rank's list: the messages received before it and sent after it."""

    recvs: list[list[Message]]
    sends: list[list[Message]]


def messages_for(
    actions: Sequence[Action],
    recv_edges: Sequence[Sequence[int]],
    send_edges: Sequence[Sequence[int]],
    edge_ends: Sequence[tuple[int, int]],
    rank_of_stage: Callable[[int], int],
    rank: int,
    spec: Callable[[int, int], ValueSpec],
) -> ActionMessages:
    """The messages of one rank's action list.

    recv_edges / send_edges: per stage, edge ids in argument / output order; edge_ends:
    (src stage, dst stage) per edge; rank_of_stage: the rank holding a stage in this
    replica; spec(edge, micro-batch): the edge's ValueSpec for that micro-batch.
    """
    def remote(kind: str, edges: Sequence[int], end: int, i: int) -> list[Message]:
        """Messages for the edges whose other end (``end`` 0: source, 1: destination) is remote."""
        out = []
        for e in edges:
            peer = rank_of_stage(edge_ends[e][end])
            leaves = spec(e, i).tensors if kind == ACT else spec(e, i).grads
            if peer != rank and kind == ACT:
                _check_sendable(spec(e, i), e, edge_ends[e], peer)
            if peer != rank and leaves:
                out.append(Message(kind, e, i, peer, tuple(leaves)))
        return out

    recvs: list[list[Message]] = []
    sends: list[list[Message]] = []
    for action in actions:
        s, i = action.stage, action.microbatch
        kind, edges = inbound(action, recv_edges[s], send_edges[s])  # an ACT from the producer (end 0)
        recvs.append(remote(kind, edges, 0 if kind == ACT else 1, i))
        kind, edges = outbound(action, recv_edges[s], send_edges[s])  # an ACT to the consumer (end 1)
        sends.append(remote(kind, edges, 1 if kind == ACT else 0, i))
    return ActionMessages(recvs, sends)


def _check_sendable(value: ValueSpec, edge: int, ends: tuple[int, int], peer: int) -> None:
    """Raise CommPlanError when an edge value holds tensors inside an object that is not a
    registered pytree: only tensor leaves travel, so the receiver would see the object of
    the signature's fake run instead of this micro-batch's."""
    if value.unsendable:
        kind = value.unsendable[0]
        raise CommPlanError(
            f"the value on edge {edge} (stage {ends[0]} -> stage {ends[1]}, rank {peer}) holds tensors inside an object of type {kind}, "
            f"which is not a registered pytree, so they cannot be sent: only tensors and constants travel between ranks. "
            f"Register it (torch.utils._pytree.register_dataclass({kind}), or register_pytree_node) so its tensors travel "
            "with each micro-batch"
        )


def in_sender_order(plans: dict[int, ActionMessages]) -> dict[int, ActionMessages]:
    """The same plans with receives moved earlier so that, on every (sender → receiver)
    channel, the receiver posts in the order the sender sends (what NCCL needs).

    Interleaved schedules can make a rank need a message before one its peer sends
    first; the earlier message's receive is then posted too (its buffer waits until its
    action runs). Sends never move: they follow their action.
    """
    order: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for sender, plan in plans.items():
        for sends in plan.sends:
            for msg in sends:
                order[(sender, msg.peer)].append(msg)
    result = {}
    for receiver, plan in plans.items():
        pointer: dict[int, int] = defaultdict(int)
        posted: set[tuple] = set()
        recvs = []
        for wanted in plan.recvs:
            group = []
            for msg in wanted:
                sender = msg.peer
                while msg.key not in posted:
                    early = order[(sender, receiver)][pointer[sender]]
                    pointer[sender] += 1
                    posted.add(early.key)
                    group.append(replace(early, peer=sender))
            recvs.append(group)
        result[receiver] = ActionMessages(recvs, plan.sends)
    return result


def fused_groups(messages: ActionMessages) -> list[tuple[list[Message], list[Message]]]:
    """The (sends, recvs) groups a rank posts under NCCL: sends of action k-1 with the
    receives of action k, and a last group with the final sends."""
    groups = []
    previous: list[Message] = []
    for recvs, sends in zip(messages.recvs, messages.sends):
        groups.append((previous, recvs))
        previous = sends
    groups.append((previous, []))
    return groups


Groups = list[tuple[list[Message], list[Message]]]


def _match(groups_by_rank: dict[int, Groups]) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """(rank, group, op) -> (partner rank, group, op): the n-th send on a channel meets its
    n-th receive. Raises CommPlanError when they carry different messages."""
    sent: dict[tuple[int, int], list[tuple[int, int, Message]]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[int, int, Message]]] = defaultdict(list)
    for rank, groups in groups_by_rank.items():
        for g, (sends, recvs) in enumerate(groups):
            for k, msg in enumerate(sends):
                sent[(rank, msg.peer)].append((g, k, msg))
            for k, msg in enumerate(recvs):
                received[(msg.peer, rank)].append((g, len(sends) + k, msg))
    partner = {}
    for (a, b) in set(sent) | set(received):
        outgoing, incoming = sent.get((a, b), []), received.get((a, b), [])
        if len(incoming) != len(outgoing):
            raise CommPlanError(f"rank {a} sends {len(outgoing)} message(s) to rank {b}, which receives {len(incoming)}")
        for (ga, ka, ma), (gb, kb, mb) in zip(outgoing, incoming):
            if ma.key != mb.key:
                raise CommPlanError(f"rank {a} sends {ma.key} to rank {b} where rank {b} expects {mb.key}: NCCL would mismatch them")
            partner[(a, ga, ka)] = (b, gb, kb)
            partner[(b, gb, kb)] = (a, ga, ka)
    return partner


def _run(groups_by_rank: dict[int, Groups], partner: dict) -> dict[int, int]:
    """Each rank's first group that never completes (its length when all do)."""
    position = {rank: 0 for rank in groups_by_rank}
    while True:
        ready = []
        for rank, g in position.items():
            groups = groups_by_rank[rank]
            if g < len(groups) and all(
                position[partner[(rank, g, k)][0]] >= partner[(rank, g, k)][1] for k in range(len(groups[g][0]) + len(groups[g][1]))
            ):
                ready.append(rank)
        if not ready:
            return position
        for rank in ready:
            position[rank] += 1


def _stuck(groups_by_rank: dict[int, Groups], position: dict[int, int]) -> dict[int, int]:
    """The ranks whose groups do not all complete, with the group each stops at."""
    return {r: g for r, g in position.items() if g < len(groups_by_rank[r])}


def _deadlock(stuck: dict[int, int]) -> CommPlanError:
    detail = "; ".join(f"rank {r} at group {g}" for r, g in sorted(stuck.items()))
    return CommPlanError(f"the send/recv groups would deadlock under NCCL ({detail})")


def check_rendezvous(groups_by_rank: dict[int, Groups]) -> None:
    """Prove that every rank's groups complete when ops match in order (NCCL's rule).

    A send from a to b matches the receive on b from a with the same position in the
    (a → b) channel. A rank's groups run one after the other (one stream); an op completes
    once its partner's group has started, and a group once all its ops have. Raises
    CommPlanError when two matched ops carry different messages or when no group can
    complete.
    """
    stuck = _stuck(groups_by_rank, _run(groups_by_rank, _match(groups_by_rank)))
    if stuck:
        raise _deadlock(stuck)


def nccl_plans(plans: dict[int, ActionMessages]) -> dict[int, ActionMessages]:
    """Plans whose fused groups provably complete under NCCL (see :func:`check_rendezvous`).

    Receives follow their senders' order (:func:`in_sender_order`). Where two ranks'
    groups would still wait on each other (each sends what the other receives only in a
    later group), the waiting receives move up into the group that is running, which is
    always possible: a receive only needs its buffer. Raises CommPlanError if a wait
    cycle involves sends alone.
    """
    groups = {r: fused_groups(p) for r, p in in_sender_order(plans).items()}
    while True:
        partner = _match(groups)
        position = _run(groups, partner)
        stuck = _stuck(groups, position)
        if not stuck:
            break
        moved = False
        for rank, g in stuck.items():
            for k in range(len(groups[rank][g][0]) + len(groups[rank][g][1])):
                peer, h, j = partner[(rank, g, k)]
                head = position[peer]
                if head >= h or j < len(groups[peer][h][0]):
                    continue  # already started, or a send (sends stay after their action)
                target = groups[peer][head][1]
                for later in range(head + 1, h + 1):
                    recvs = groups[peer][later][1]
                    last = j - len(groups[peer][h][0]) if later == h else len(recvs) - 1
                    take = [m for n, m in enumerate(recvs) if m.peer == rank and n <= last]
                    target.extend(take)
                    groups[peer][later] = (groups[peer][later][0], [m for m in recvs if not any(m is t for t in take)])
                moved = True
                break
            if moved:
                break
        if not moved:
            raise _deadlock(stuck)
    return {r: ActionMessages([recvs for _, recvs in groups[r][: len(plans[r].recvs)]], plans[r].sends) for r in plans}


def tag_of(msg: Message, leaf: int, num_edges: int) -> int:
    """A tag unique to (kind, edge, micro-batch, leaf) so gloo matches out-of-order posts."""
    tag = ((msg.microbatch * num_edges + msg.edge) * 2 + (msg.kind == GRAD)) * 64 + leaf % 64
    return tag % (2**31 - 1)


def post(sends: list[tuple[Message, list]], recvs: list[tuple[Message, list]], num_edges: int) -> tuple[list, list]:
    """Post sends and receives as one batched group.

    Returns ``(send_works, recv_works)``, each a list of ``(work, peer)``. When the backend
    coalesces the group into fewer works (NCCL), all of them are returned as receive works:
    waiting for them waits for the whole group.
    """
    ops, peers = [], []
    for msgs, op in ((sends, dist.isend), (recvs, dist.irecv)):
        for msg, tensors in msgs:
            for leaf, tensor in zip(msg.leaves, tensors):
                ops.append(dist.P2POp(op, tensor, msg.peer, tag=tag_of(msg, leaf, num_edges)))
                peers.append(msg.peer)
    if not ops:
        return [], []
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(peers):
        return [], [(work, peers[0]) for work in works]
    pairs = list(zip(works, peers))
    n_send = sum(len(msg.leaves) for msg, _ in sends)
    return pairs[:n_send], pairs[n_send:]
