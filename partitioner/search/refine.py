"""Shortens a legal placement's simulated step by local moves: the step-aware pass after CP-SAT.

CP-SAT minimises the bottleneck stage (partitioner.search.cpsat); users pay the step, which also pays the
fill and drain of the pipeline and the transfers on its links (partitioner.simulate). Starting from a
legal plan, this hill-climbs on the simulated step itself, trying in turn

- merges: every node of a stage onto the device of the next or the previous stage (a stage fewer);
- exchanges: two stages trade devices, or a stage moves to an idle device;
- moves: one node (or the calls of a shared layer, together) to another stage within the range its
  neighbours allow, so that every edge still goes forward, or to an idle device opening a new stage
  at any place in that range.

A move is kept when the plan still fits memory and its step is shorter (by more than a relative
1e-9); passes repeat until none is. It is a local search after Lin-Kernighan style boundary
refinement in graph partitioning (Kernighan and Lin, 1970; Karypis and Kumar's METIS), judged by the
simulator instead of a cut. Each descent simulates the neighbours in the order of a cheap lower bound
on their step (:func:`_step_bound`) and stops at a local optimum once the bounds reach its step; then
an iterated local search (seeded random moves, a descent again) runs until PATIENCE restarts in a row
find nothing shorter. Its work is bounded by counts (MAX_SIMULATIONS plans simulated, MAX_WORK node
visits), so the same input gives the same plan; a wall-clock deadline also ends it, on large graphs.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Mapping

from partitioner.cluster import reorder
from partitioner.cost import CostModel, Evaluation
from partitioner.graph import colocation_groups
from partitioner.schedule import Schedule
from partitioner.search.order import device_classes
from partitioner.simulate import simulate_assignment

# Work bounds: at most MAX_SIMULATIONS plans simulated, and MAX_WORK node visits (each plan scored, or
# simulated, visits every node once: e.g. 100 plans of 1,000 nodes). On the loaded 2-core development
# machine a plan of 10 nodes takes 1-8 ms to simulate (M = 1-16), 10-20 ms at 1,000 nodes; the search
# added 1-3 s to solve on a random DAG of 200 or 1,000 nodes on 4 devices.
MAX_SIMULATIONS = 1_000
MAX_WORK = 100_000
KICK_MOVES = 2  # random moves between two descents of the iterated local search
PATIENCE = 12  # the search ends after this many restarts in a row that found no shorter step
MIN_GAIN = 1e-9  # a move is kept when it shortens the step by more than this fraction


class _Search:
    """What the moves may touch, the cost models of the pipeline orders met, and the simulation budget."""

    def __init__(self, costs: CostModel, pins: Mapping[str, str], deadline: float, exchange: bool) -> None:
        self.base = costs
        self.deadline = deadline
        self.simulations = 0
        self.work = 0
        self.models: dict[tuple[int, ...], CostModel] = {}
        self.schedules: dict[int, Schedule] = {}
        # the plans met, by stages and devices: (the step, True) once simulated, else (a bound on it, False)
        self.seen: dict[tuple[object, ...], tuple[float, bool] | None] = {}
        groups = {v: tuple(nodes) for nodes in colocation_groups(costs.graph).values() for v in nodes}
        seen: set[str] = set()
        self.units: list[tuple[str, ...]] = []  # what a move moves: a node, or a shared layer's calls
        for v in costs.order:
            if v not in seen and not (set(groups.get(v, (v,))) & set(pins)):
                unit = groups.get(v, (v,))
                seen.update(unit)
                self.units.append(unit)
        self.fixed = set(costs.order) - seen  # pinned nodes, and the calls of a shared layer with one pinned
        # With pins the stages keep their devices and order (a pinned node would change device).
        self.exchange = exchange and not pins
        self.classes = device_classes(costs.cluster)  # interchangeable devices: one idle device of each is tried

    def exhausted(self) -> bool:
        return self.simulations >= MAX_SIMULATIONS or self.work >= MAX_WORK or time.perf_counter() >= self.deadline

    def step(self, stages: tuple[int, ...], where: Mapping[str, int], beat: float = math.inf) -> float | None:
        """The simulated step of the plan, or None when it does not fit memory or cannot be shorter than ``beat``.

        ``stages`` lists the used devices (indices in the base cluster) in pipeline order; the idle
        ones follow in the base order (an idle device costs nothing, wherever it is listed). A plan
        is simulated only when a bound on its step (:func:`_step_bound`) is shorter than ``beat``; each
        plan at most once.
        """
        key = (stages, tuple(where[v] for v in self.base.order))
        if key not in self.seen:
            self.seen[key] = self._evaluate(stages, where)
        found = self.seen[key]
        if found is None:
            return None
        value, exact = found
        if not exact and value < beat * (1 - MIN_GAIN):
            self.simulations += 1
            self.work += len(self.base.order)
            value, exact = self._simulate(stages, where), True
            self.seen[key] = (value, exact)
        return value if value < beat * (1 - MIN_GAIN) or beat == math.inf else None  # exact when below beat

    def bound(self, stages: tuple[int, ...], where: Mapping[str, int]) -> float | None:
        """The plan's step if simulated, else a bound on it; None when it does not fit memory."""
        key = (stages, tuple(where[v] for v in self.base.order))
        if key not in self.seen:
            self.seen[key] = self._evaluate(stages, where)
        found = self.seen[key]
        return None if found is None else found[0]

    def _evaluate(self, stages: tuple[int, ...], where: Mapping[str, int]) -> tuple[float, bool] | None:
        """(a lower bound on the step, False), or None when the plan does not fit memory."""
        self.work += len(self.base.order)
        costs = self._costs(stages)
        evaluation = costs.evaluate({v: self.base.devices[k] for v, k in where.items()})
        if not costs.fits(evaluation):
            return None
        return _step_bound(costs, evaluation), False

    def _costs(self, stages: tuple[int, ...]) -> CostModel:
        order = (*stages, *(k for k in range(len(self.base.devices)) if k not in stages))
        if order not in self.models:
            self.models[order] = self.base.on(reorder(self.base.cluster, order))
        return self.models[order]

    def _simulate(self, stages: tuple[int, ...], where: Mapping[str, int]) -> float:
        costs = self._costs(stages)
        assignment = {v: self.base.devices[k] for v, k in where.items()}
        num_stages = len(stages)
        if num_stages not in self.schedules:  # built and validated once per stage count
            self.schedules[num_stages] = Schedule.make(costs.schedule, num_stages, costs.num_microbatches)
        return simulate_assignment(costs, assignment, schedule=self.schedules[num_stages]).step_time_s


def _step_bound(costs: CostModel, evaluation: Evaluation) -> float:
    """A lower bound on the simulated step of a placement, whatever its schedule: the most over stages s of

        M (forward(s) + backward(s))    s runs every micro-batch's forward and backward, one at a time
        + head(s)                       before its first forward, micro-batch 0 crosses the stages before it
        + tail(s)                       after its last backward, that micro-batch's gradient goes back down

    head(s) = max over stages p sending to s of head(p) + forward(p) + the activation's seconds on (p, s);
    tail(s) = max over such p of the gradient's seconds on (s, p) + backward(p) + tail(p); links and
    passes as partitioner.simulate times them.
    """
    stages = evaluation.stage_costs
    position = {name: k for k, name in enumerate(costs.devices)}
    used = [position[name] for name in evaluation.stages]
    senders: dict[int, list[tuple[int, int]]] = {}
    for (a, b), sent in (evaluation.sent_bytes or {}).items():
        senders.setdefault(b, []).append((a, sent))
    head = [0.0] * len(stages)
    tail = [0.0] * len(stages)
    for b in range(len(stages)):  # senders come first in pipeline order
        for a, sent in senders.get(b, []):
            head[b] = max(head[b], head[a] + stages[a].forward_s + sent / costs.cluster.bandwidth(used[a], used[b]))
            tail[b] = max(tail[b], sent / costs.cluster.bandwidth(used[b], used[a]) + stages[a].backward_s + tail[a])
    return max(costs.num_microbatches * (c.forward_s + c.backward_s) + head[s] + tail[s] for s, c in enumerate(stages))


def refine_step(
    costs: CostModel,
    assignment: Mapping[str, str],
    *,
    pins: Mapping[str, str] | None = None,
    deadline: float | None = None,
    exchange: bool = True,
    seed: int = 0,
) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """A placement of shorter simulated step found by local moves from ``assignment``, or None.

    Args:
        costs: the cost model (graph, cluster in the pipeline order of ``assignment``, M, schedule, ...).
        assignment: a legal placement {node: device name}: every edge forward in ``costs.cluster``'s order.
        pins: {node: device name} that must hold (pinned nodes never move, and every stage keeps its
            device when there are pins).
        deadline: a ``time.perf_counter()`` time after which no more plans are simulated.
        exchange: whether stages may change devices and places (False keeps the order given: merges, moves,
            and new stages on idle devices at their places in it).
        seed: the seed of the random moves that restart the descent from its local optima.

    Returns:
        (every device name in the new pipeline order, the new placement), or None when no move
        shortened the step.

    Example:
        >>> costs = pt.CostModel(graph, cluster, num_microbatches=4)     # doctest: +SKIP
        >>> found = refine_step(costs, plan.assignment)                 # doctest: +SKIP
    """
    search = _Search(costs, dict(pins or {}), time.perf_counter() + 3600 if deadline is None else deadline, exchange)
    index = {name: k for k, name in enumerate(costs.devices)}
    where = {v: index[assignment[v]] for v in costs.order}
    stages = tuple(sorted(set(where.values())))
    best = search.step(stages, where)
    if best is None:
        return None
    start = best
    stages, where, best = _descend(search, stages, where, best)
    # Iterated local search: KICK_MOVES random moves from the best plan (seeded: the same input gives the same
    # plan), then descend again; the better plan is kept.
    rng = random.Random(seed)
    failed = 0
    while failed < PATIENCE and not search.exhausted():
        kicked = (stages, where)
        for _ in range(KICK_MOVES):
            kicks = [c for c in _neighbours(search, *kicked) if search.bound(*c) is not None]  # those that fit
            if not kicks:
                break
            kicked = rng.choice(kicks)
        found = search.step(*kicked)
        if found is None:
            failed += 1
            continue
        kicked_stages, kicked_where, found = _descend(search, *kicked, found)
        if found < best * (1 - MIN_GAIN):
            stages, where, best, failed = kicked_stages, kicked_where, found, 0
        else:
            failed += 1
    if best >= start * (1 - MIN_GAIN):
        return None
    order = [*stages, *(k for k in range(len(costs.devices)) if k not in stages)]
    if not exchange:  # the given order, idle devices in their places (every stage is at its own)
        order = list(range(len(costs.devices)))
    return tuple(costs.devices[k] for k in order), {v: costs.devices[k] for v, k in where.items()}


def _descend(
    search: _Search, stages: tuple[int, ...], where: dict[str, int], step: float
) -> tuple[tuple[int, ...], dict[str, int], float]:
    """Descent from the plan (stages, where) of simulated ``step`` to a local optimum (or until the budget
    ends); returns that plan and its step. The neighbours are simulated in the order of their bounds
    (:func:`_step_bound`); the first shorter step is taken, and none is once the bounds reach the step."""
    improved = True
    while improved and not search.exhausted():
        improved = False
        ranked = []
        for i, candidate in enumerate(_neighbours(search, stages, where)):
            if search.exhausted():
                break
            bound = search.bound(*candidate)
            if bound is not None and bound < step * (1 - MIN_GAIN):
                ranked.append((bound, i, candidate))
        ranked.sort(key=lambda item: item[:2])
        for _, _, candidate in ranked:
            if search.exhausted():
                break
            found = search.step(*candidate, beat=step)
            if found is not None:
                (stages, where), step, improved = candidate, found, True
                break  # the neighbourhood of the new plan next
    return stages, where, step


def _neighbours(
    search: _Search, stages: tuple[int, ...], where: Mapping[str, int]
) -> Iterator[tuple[tuple[int, ...], dict[str, int]]]:
    """Yields (stages, where) of every merge, exchange and move from the plan (stages, where).

    ``stages`` lists the used devices in pipeline order, ``where`` gives each node's device.
    """
    graph = search.base.graph
    num_devices = len(search.base.devices)
    idle = [k for k in range(num_devices) if k not in stages]
    fixed = {where[v] for v in search.fixed}  # devices that keep their stage (pinned nodes)
    count = {k: 0 for k in stages}  # nodes per stage
    for k in where.values():
        count[k] += 1
    # Merges: a stage onto the next or the previous one.
    for s in range(len(stages) - 1):
        for src, dst in ((stages[s], stages[s + 1]), (stages[s + 1], stages[s])):
            if src not in fixed:
                yield tuple(k for k in stages if k != src), {v: dst if k == src else k for v, k in where.items()}
    # Exchanges: two stages trade devices, or a stage moves to an idle device (one of each class).
    if search.exchange:
        spare = [next(k for k in c if k in idle) for c in search.classes if any(k in idle for k in c)]
        for s, a in enumerate(stages):
            for b in [*stages[s + 1 :], *spare]:
                swap = {a: b, b: a}
                yield tuple(swap.get(k, k) for k in stages), {v: swap.get(k, k) for v, k in where.items()}
    # Moves of one unit to another stage within the range its neighbours allow, or to an idle device
    # opening a stage at any place in that range.
    position = {k: s for s, k in enumerate(stages)}
    for unit in search.units:
        members = set(unit)
        after = max((position[where[u]] for v in unit for u in graph.predecessors(v) if u not in members), default=-1)
        before = min(
            (position[where[w]] for v in unit for w in graph.successors(v) if w not in members), default=len(stages)
        )
        here = position[where[unit[0]]]
        alone = count[stages[here]] == len(unit)
        for s in range(max(after, 0), min(before, len(stages) - 1) + 1):  # stages holding no edge backward
            if s != here:
                moved = dict(where)
                moved.update(dict.fromkeys(unit, stages[s]))
                yield tuple(k for k in stages if not (alone and k == stages[here])), moved
        if alone:  # to an idle device: an exchange
            continue
        for k in idle:
            # The new stage goes before stages[s] (last for s = len): anywhere, or at k's place in the given order.
            places = range(after + 1, before + 1) if search.exchange else [sum(1 for j in stages if j < k)]
            for s in places:
                if not after < s <= before:
                    continue
                moved = dict(where)
                moved.update(dict.fromkeys(unit, k))
                yield (*stages[:s], k, *stages[s:]), moved
