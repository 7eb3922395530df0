"""Split solver: the exact min-max cut of an ordered graph into contiguous stages.

The problem (:class:`SplitProblem`): items ``0..N-1`` in a topological order, ``K``
stages in a fixed order (stage ``k`` runs on device ``k``, devices may differ in speed
and memory). Stage ``k`` takes the items ``[i, j)`` and costs

    time_k(i, j)   = T_k[j] - T_k[i] + recv_per_byte[k] * cut[i] + send_per_byte[k] * cut[j] + fixed[k]
    memory_k(i, j) = S[j] - S[i] + in_flight[k] * (A[j] - A[i])

where ``T_k`` is the prefix sum of the items' times on device ``k``, ``cut[c]`` the bytes
of values live across the cut before item ``c`` (what a stage starting or ending there
receives or sends), ``S`` and ``A`` prefix sums of persistent state bytes and of
activation bytes per micro-batch. :func:`solve` returns the split minimising the slowest
stage's time with every stage within its device's memory, or raises
:class:`SplitInfeasible` with the least memory each stage would need.

Why it is exact: for a bound ``B``, "can items ``[0, j)`` fill stages ``0..k`` with every
stage at most ``B``" is decided for every ``j`` at once from the answer for ``k - 1``:
``time_k(i, j) <= B`` rewrites to ``T_k[i] - recv_per_byte[k] * cut[i] >= T_k[j] +
send_per_byte[k] * cut[j] + fixed[k] - B``, so it is a range-maximum query over the
reachable ``i`` in the memory window ``[lo_k(j), j - 1]`` (memory grows with the range,
so the window's left end is a binary search). Feasibility is monotone in ``B``, and every
feasible ``B`` yields a split whose slowest stage is at most ``B``; bisection that jumps
to that split's own bottleneck converges on the optimum, the bottleneck of a real split.
A feasibility test is ``O(K N log N)`` tensor work, so 10,000 items split in well under a
second. Orders come from networkx (:func:`ordered_problem_inputs`).

:func:`refine` then moves the cuts while a caller-given prediction of the whole step (a
simulation of the schedule) improves: with few micro-batches the fill and drain, not the
slowest stage alone, set a step's time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import networkx as nx
import torch

_NEG = -math.inf


class SplitInfeasible(ValueError):
    """No split fits the devices' memory. ``boundaries`` is the split that needs the least
    memory relative to each device's limit; ``needed`` its bytes per stage."""

    def __init__(self, message: str, boundaries: list[int], needed: list[float], limits: list[float]) -> None:
        super().__init__(message)
        self.boundaries = boundaries
        self.needed = needed
        self.limits = limits


@dataclass
class SplitProblem:
    """A contiguous split of ``N`` ordered items over ``K`` stages (see the module doc).

    item_time: ``K x N`` seconds of item ``n`` on stage ``k``'s device; cut_bytes: ``N + 1``
    bytes live across each cut (index ``c`` is the cut before item ``c``); recv_per_byte,
    send_per_byte, fixed_time, in_flight, memory: one value per stage; state_bytes,
    activation_bytes: one value per item.
    """

    item_time: torch.Tensor
    cut_bytes: torch.Tensor
    recv_per_byte: Sequence[float]
    send_per_byte: Sequence[float]
    fixed_time: Sequence[float]
    state_bytes: torch.Tensor
    activation_bytes: torch.Tensor
    in_flight: Sequence[float]
    memory: Sequence[float]

    def __post_init__(self) -> None:
        f64 = torch.float64
        self.item_time = torch.as_tensor(self.item_time, dtype=f64).reshape(len(self.memory), -1)
        self.cut_bytes = torch.as_tensor(self.cut_bytes, dtype=f64)
        self.state_bytes = torch.as_tensor(self.state_bytes, dtype=f64)
        self.activation_bytes = torch.as_tensor(self.activation_bytes, dtype=f64)
        zero = torch.zeros(1, dtype=f64)
        self._T = torch.cat([zero.expand(self.num_stages, 1), self.item_time.cumsum(1)], 1)
        self._S = torch.cat([zero, self.state_bytes.cumsum(0)])
        self._A = torch.cat([zero, self.activation_bytes.cumsum(0)])
        if self.cut_bytes.numel() != self.num_items + 1:
            raise ValueError(f"cut_bytes needs {self.num_items + 1} values (one per cut), got {self.cut_bytes.numel()}")

    @property
    def num_stages(self) -> int:
        return len(self.memory)

    @property
    def num_items(self) -> int:
        return self.item_time.shape[1]

    def stage_time(self, k: int, i: int, j: int) -> float:
        """Seconds stage ``k`` takes for items ``[i, j)``: compute plus send/recv."""
        return float(
            self._T[k, j] - self._T[k, i] + self.recv_per_byte[k] * self.cut_bytes[i]
            + self.send_per_byte[k] * self.cut_bytes[j] + self.fixed_time[k]
        )

    def stage_state(self, i: int, j: int) -> float:
        """Persistent bytes of items ``[i, j)``."""
        return float(self._S[j] - self._S[i])

    def stage_memory(self, k: int, i: int, j: int) -> float:
        """Bytes stage ``k`` holds for items ``[i, j)``: state plus in-flight activations."""
        return float(self._S[j] - self._S[i] + self.in_flight[k] * (self._A[j] - self._A[i]))

    def bottleneck(self, boundaries: Sequence[int]) -> float:
        """The slowest stage's time for ``boundaries`` (``K + 1`` values, 0 first, N last)."""
        return max(self.stage_time(k, boundaries[k], boundaries[k + 1]) for k in range(self.num_stages))

    def clustered(self, starts: Sequence[int]) -> SplitProblem:
        """The same problem over clusters of consecutive items (cluster ``c`` holds items
        ``[starts[c], starts[c + 1])``; ``starts[0] == 0``): cuts only between clusters, each
        cluster's time, state and activations the sum of its items'. A split of it maps back
        to this problem's items through ``starts`` (plus ``N`` at the end)."""
        edges = torch.tensor([*starts, self.num_items])
        return SplitProblem(
            item_time=self._T[:, edges[1:]] - self._T[:, edges[:-1]],
            cut_bytes=self.cut_bytes[edges],
            recv_per_byte=self.recv_per_byte,
            send_per_byte=self.send_per_byte,
            fixed_time=self.fixed_time,
            state_bytes=self._S[edges[1:]] - self._S[edges[:-1]],
            activation_bytes=self._A[edges[1:]] - self._A[edges[:-1]],
            in_flight=self.in_flight,
            memory=self.memory,
        )


@dataclass
class Split:
    """A solved split: stage ``k`` holds items ``[boundaries[k], boundaries[k + 1])``."""

    boundaries: list[int]
    stage_times: list[float]
    stage_memory: list[float]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)


class _RangeMax:
    """Maximum of ``values[lo[q]..hi[q]]`` for fixed queries over changing values.

    A sparse table: level ``l`` holds the maxima of windows of width ``2**l``; each query
    reads two overlapping windows. The query positions are computed once.
    """

    def __init__(self, n: int, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.n = n
        self.widths = []
        offsets, offset, width = [], 0, 1
        while width <= n:
            offsets.append(offset)
            self.widths.append(width)
            offset += n - width + 1
            width *= 2
        self.valid = hi >= lo
        length = (hi - lo + 1).clamp(min=1)
        level = (torch.frexp(length.to(torch.float64))[1] - 1).long()
        step = torch.bitwise_left_shift(torch.ones_like(level), level)
        base = torch.tensor(offsets)[level]
        self.left = torch.where(self.valid, base + lo, torch.zeros_like(lo))
        self.right = torch.where(self.valid, base + hi - step + 1, torch.zeros_like(hi))

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        levels = [values]
        for width in self.widths[:-1]:
            prev = levels[-1]
            levels.append(torch.maximum(prev[:-width], prev[width:]))
        flat = torch.cat(levels)
        best = torch.maximum(flat[self.left], flat[self.right])
        return best.masked_fill(~self.valid, _NEG)


class _Solver:
    def __init__(self, problem: SplitProblem) -> None:
        self.p = problem
        self.g = [problem._T[k] - problem.recv_per_byte[k] * problem.cut_bytes for k in range(problem.num_stages)]
        self.h = [problem._T[k] + problem.send_per_byte[k] * problem.cut_bytes + problem.fixed_time[k] for k in range(problem.num_stages)]
        self._queries: dict[tuple[int, float], tuple[torch.Tensor, _RangeMax]] = {}

    def window(self, k: int, scale: float) -> tuple[torch.Tensor, _RangeMax]:
        """Per end ``j`` (1..N), the first start ``i`` within memory, and the query table."""
        key = (k, scale)
        if key not in self._queries:
            weight = self.p._S + self.p.in_flight[k] * self.p._A
            lo = torch.searchsorted(weight, weight[1:] - self.p.memory[k] * scale, side="left")
            n = self.p.num_items
            self._queries[key] = (lo, _RangeMax(n + 1, lo, torch.arange(n)))
        return self._queries[key]

    def reachable(self, bound: float, scale: float = 1.0) -> list[torch.Tensor]:
        """reach[k][j]: items [0, j) fill stages 0..k, each within ``bound`` and memory."""
        n = self.p.num_items
        reach = torch.zeros(n + 1, dtype=torch.bool)
        reach[0] = True
        out = []
        for k in range(self.p.num_stages):
            masked = self.g[k].masked_fill(~reach, _NEG)
            best = self.window(k, scale)[1](masked)
            ok = (best >= self.h[k][1:] - bound) & (best > _NEG)
            reach = torch.cat([torch.zeros(1, dtype=torch.bool), ok])
            out.append(reach)
        return out

    def backtrack(self, reach: list[torch.Tensor], bound: float, scale: float = 1.0) -> list[int]:
        n = self.p.num_items
        bounds = [n]
        j = n
        for k in range(self.p.num_stages - 1, -1, -1):
            lo = int(self.window(k, scale)[0][j - 1])
            if k == 0:
                i = 0
            else:
                cand = torch.arange(lo, j)
                cand = cand[reach[k - 1][lo:j]]
                cand = cand[self.g[k][cand] >= self.h[k][j] - bound]
                i = int(cand[torch.argmax(self.g[k][cand])])
            bounds.append(i)
            j = i
        return bounds[::-1]


def solve(problem: SplitProblem) -> Split:
    """The split of ``problem`` whose slowest stage is fastest, within every memory limit.

    Returns a :class:`Split`. Raises ValueError when there are fewer items than stages,
    and :class:`SplitInfeasible` when no split fits the memory limits (its message gives
    the bytes each stage needs for the least memory-hungry split).
    """
    K, n = problem.num_stages, problem.num_items
    if n < K:
        raise ValueError(f"{K} stages asked for but the graph has only {n} compute nodes; use fewer devices")
    solver = _Solver(problem)
    reach = solver.reachable(math.inf)
    if not bool(reach[-1][n]):
        _raise_infeasible(problem, solver)
    best = solver.backtrack(reach, math.inf)
    hi = problem.bottleneck(best)
    lo = 0.0
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        reach = solver.reachable(mid)
        if bool(reach[-1][n]):
            best = solver.backtrack(reach, mid)
            hi = problem.bottleneck(best)
        else:
            lo = mid
    return Split(
        best,
        [problem.stage_time(k, best[k], best[k + 1]) for k in range(K)],
        [problem.stage_memory(k, best[k], best[k + 1]) for k in range(K)],
    )


def refine(problem: SplitProblem, boundaries: Sequence[int], step_time: Callable[[list[int]], float]) -> list[int]:
    """Move the cuts of ``boundaries`` while ``step_time`` (a prediction of the whole step,
    such as a simulation of the schedule) improves: coordinate descent with steps halving
    from an eighth of a stage down to one item, every stage kept non-empty and within its
    memory. Returns a split whose ``step_time`` is at most that of ``boundaries``.

    The bottleneck sets the pace only when micro-batches are many; with few, a schedule
    fills and drains, and 1F1B for one runs faster when its early stages are a little
    heavier. ``solve`` is exact for the bottleneck; this adapts its answer to the schedule.
    """
    best = list(boundaries)
    K, n = problem.num_stages, problem.num_items
    value = step_time(best)
    step = max(n // (8 * K), 1)
    while step >= 1:
        for _ in range(64):  # passes over the cuts at this step size
            improved = False
            for c in range(1, K):
                for delta in (step, -step):
                    cand = best.copy()
                    cand[c] += delta
                    if not cand[c - 1] < cand[c] < cand[c + 1]:
                        continue
                    if any(problem.stage_memory(k, cand[k], cand[k + 1]) > problem.memory[k] for k in (c - 1, c)):
                        continue
                    v = step_time(cand)
                    if v < value * (1 - 1e-9):
                        best, value, improved = cand, v, True
                        break
            if not improved:
                break
        step //= 2
    return best


def _raise_infeasible(problem: SplitProblem, solver: _Solver) -> None:
    """Find the least memory scale that fits and report that split's needs."""
    n = problem.num_items
    lo, hi = 1.0, 2.0
    while not bool(solver.reachable(math.inf, hi)[-1][n]):
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if bool(solver.reachable(math.inf, mid)[-1][n]):
            hi = mid
        else:
            lo = mid
    bounds = solver.backtrack(solver.reachable(math.inf, hi), math.inf, hi)
    needed = [problem.stage_memory(k, bounds[k], bounds[k + 1]) for k in range(problem.num_stages)]
    limits = [float(m) for m in problem.memory]
    raise SplitInfeasible(
        f"no split fits the devices' memory; the least memory-hungry split needs {hi:.2f}x what they offer",
        bounds, needed, limits,
    )


def ordered_problem_inputs(
    graph: nx.DiGraph, program_order: Sequence[Hashable] | None = None
) -> tuple[list[Hashable], list[float]]:
    """A topological order of ``graph``'s nodes and the bytes live across each cut.

    Edges carry ``bytes`` (what the consumer needs from the producer; 0 if absent); a
    producer's value is counted once per cut however many consumers it has, using the
    largest ``bytes`` of its out-edges. ``program_order`` breaks ties (the fx program
    order, so the order is that order whenever it is topological). Returns (order,
    cut_bytes with ``len(order) + 1`` values). Raises networkx.NetworkXUnfeasible when
    ``graph`` has a cycle.
    """
    rank = {node: k for k, node in enumerate(program_order or ())}
    if len(rank) == len(graph) and all(rank.get(u, -1) < rank.get(v, -1) for u, v in graph.edges):
        # the program order is topological: the lexicographic sort by it is that order
        order = sorted(graph, key=rank.__getitem__)
    else:
        order = list(nx.lexicographical_topological_sort(graph, key=lambda v: rank.get(v, len(rank))))
    position = {node: k for k, node in enumerate(order)}
    delta = [0.0] * (len(order) + 2)
    successors = graph.succ
    for node in order:
        out = successors[node]
        if not out:
            continue
        last = max(position[v] for v in out)
        size = float(max(data.get("bytes", 0.0) for data in out.values()))
        start = position[node] + 1
        if last >= start:
            delta[start] += size
            delta[last + 1] -= size
    cuts, running = [], 0.0
    for c in range(len(order) + 1):
        running += delta[c]
        cuts.append(running)
    return order, cuts
