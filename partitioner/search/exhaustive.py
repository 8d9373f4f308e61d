"""Every legal plan of a small problem, enumerated: the exact optimum where the legal plans are few.

A bound that knows which splits fit. The bound on the step of any plan (``CostModel.step_lower_bound_s``)
is blind to memory: where memory rules out the balanced splits, the best legal plan can be far above it
and a planner that found that plan cannot say so. Where the legal plans are few, they are all scored:

- a *pipeline* is a sequence of 1..K distinct devices (stage s on the s-th); with ``device_order="search"``
  every such sequence up to swapping interchangeable devices (partitioner.search.order.device_classes;
  without that reduction where pins name devices), with "given" every subsequence of the cluster's order;
- a *placement* on s stages labels each node with a stage, every stage used, every edge going forward
  (stage of u <= stage of v: the rule of the CP-SAT model and of ``validate_plan``; a stage need not be
  contiguous in one topological order), the calls of a shared layer on one stage, the pins kept;
- each placement on each pipeline is scored as ``score_assignment`` scores a plan (``costs.recompute``
  chooses the stage modes), and those that fit in memory are legal.

Proof. Every plan a planner returns is a placement whose edges go forward on a sequence of distinct
devices, listed first in its ``Plan.devices`` (idle devices after them change no cost), that fits in
memory. Swapping two interchangeable devices changes no cost (partitioner.search.order.interchangeable),
so the sequences enumerated reach the value of every such plan. Hence the least value enumerated is a
value no legal plan beats (a bound), and the plan reaching it is optimal. The enumeration stops, giving
no bound, once the placements times pipelines would pass MAX_PLANS or the deadline passes.

Example:
    >>> import partitioner as pt
    >>> costs = pt.CostModel(pt.chain_graph([1e12] * 3), pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12))
    >>> best = least_plan(costs, {}, objective="step", device_order="search", deadline=float("inf"))
    >>> best.num_stages, best.step_time_s
    (2, 3.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Mapping, Sequence

from partitioner.cluster import reorder
from partitioner.cost import CostModel
from partitioner.graph import colocation_groups
from partitioner.plan import Plan
from partitioner.score import score_assignment, shorter_step, smaller_bottleneck, with_step_bound
from partitioner.search.order import _devices, _label_sequences, device_classes
from partitioner.verdict import TOLERANCE, on_bottleneck

MAX_PLANS = 2_000  # placements x pipelines enumerated at most: about a second of scoring on 10-node graphs
# Graphs of up to this many nodes are judged against every legal plan where those are few (MAX_PLANS):
# scoring a plan of 24 nodes takes about a millisecond.
MAX_ENUMERATED_NODES = 24


def against_every_plan(
    plan: Plan, costs: CostModel, pins: Mapping[str, str], device_order: str, *, started: float, deadline: float
) -> Plan:
    """``plan`` judged against the best of every legal plan (partitioner.search.exhaustive), a bound that
    knows which splits fit in memory, where the graph has at most MAX_ENUMERATED_NODES nodes and the legal
    plans are few: "optimal" with gap 0 where it is that best. Where the enumeration found a better plan
    (shorter step, or smaller bottleneck, as ``plan`` was chosen by), that plan is returned instead,
    optimal: the search's plan is not the best a user can have. ``plan`` unchanged where they are not
    enumerated. Used by :func:`partitioner.solve` and :func:`partitioner.exact_chain`.
    """
    if len(costs.order) > MAX_ENUMERATED_NODES or not plan.fits_memory:
        return plan
    objective = plan.objective
    best = least_plan(costs, pins, objective=objective, device_order=device_order, deadline=deadline)
    if best is None:
        return plan
    proven, searched = plan.status == "optimal", plan.status != "heuristic"

    def value(p: Plan) -> float:
        return p.step_time_s if objective == "step" else p.bottleneck_s

    if value(best) < value(plan) * (1 - TOLERANCE):  # strictly better on what it was chosen by
        # the search's bound on the bottleneck holds for every plan, this one too
        replaced = dataclasses.replace(best, method=f"{best.method} (better than {plan.method})")
        plan, proven = dataclasses.replace(replaced, lower_bound_s=plan.lower_bound_s), True
    plan = dataclasses.replace(plan, solve_time_s=time.perf_counter() - started)
    if objective == "step":  # the least step of every legal plan bounds the step of any
        return with_step_bound(plan, costs, proven_s=best.step_time_s, proven_optimal=proven)
    bound = max(plan.lower_bound_s or 0.0, best.bottleneck_s)  # the least bottleneck of every legal plan
    return on_bottleneck(plan, bound, proven=proven, searched=searched)


def least_plan(
    costs: CostModel, pins: Mapping[str, str], *, objective: str, device_order: str, deadline: float
) -> Plan | None:
    """The legal plan of the shortest simulated step (``objective="step"``) or the least bottleneck
    ("bottleneck") over every legal plan (module docstring), or None where there are more than MAX_PLANS,
    ``deadline`` (``time.perf_counter()``) passes first, or none fits.

    Ties go to the first enumerated (fewer stages first). The plan's status is "heuristic": the caller
    judges it (partitioner.verdict).
    """
    pipelines = _pipelines(costs, pins, device_order)
    placements: list[list[dict[str, int]]] = []
    count = 0
    for num_stages in range(1, min(len(costs.order), len(costs.devices)) + 1):
        found = _placements(costs, num_stages, MAX_PLANS - count)
        if found is None:
            return None
        placements.append(found)
        count += len(found) * sum(len(p) == num_stages for p in pipelines)
        if count > MAX_PLANS:
            return None
    better = shorter_step if objective == "step" else smaller_bottleneck
    best: Plan | None = None
    for pipeline in pipelines:
        idle = [k for k in range(len(costs.devices)) if k not in pipeline]
        listed = costs.on(reorder(costs.cluster, [*pipeline, *idle]))
        for labels in placements[len(pipeline) - 1]:
            if time.perf_counter() > deadline:
                return None
            assignment = {v: listed.devices[s] for v, s in labels.items()}
            if any(assignment[v] != d for v, d in pins.items()):
                continue
            if not listed.fits(listed.evaluate(assignment)):
                continue
            plan = score_assignment(assignment, listed, method="every legal plan enumerated")
            if best is None or better(plan, best):
                best = plan
    return best


def _pipelines(costs: CostModel, pins: Mapping[str, str], device_order: str) -> list[tuple[int, ...]]:
    """The sequences of distinct devices (indices) a plan's stages may run on (module docstring)."""
    num_devices = len(costs.devices)
    sizes = range(1, num_devices + 1)
    if device_order == "given":
        return [c for s in sizes for c in itertools.combinations(range(num_devices), s)]
    if pins:  # pins tell interchangeable devices apart
        return [p for s in sizes for p in itertools.permutations(range(num_devices), s)]
    classes = device_classes(costs.cluster)
    found = []
    for counts in itertools.product(*(range(len(c) + 1) for c in classes)):
        if sum(counts) > 0:
            found += [_devices(classes, labels) for labels in _label_sequences(list(counts))]
    return found


def _placements(costs: CostModel, num_stages: int, most: int) -> list[dict[str, int]] | None:
    """Every {node: stage} onto stages 0..num_stages-1, each used, every edge forward and every shared
    layer's calls on one stage; None where there are more than ``most``."""
    order: Sequence[str] = costs.order
    graph = costs.graph
    group_of = {v: name for name, nodes in colocation_groups(graph).items() for v in nodes}
    found: list[dict[str, int]] = []
    labels: dict[str, int] = {}
    shared: dict[str, int] = {}

    def place(i: int) -> Iterator[None]:
        if i == len(order):
            if len(set(labels.values())) == num_stages:
                yield
            return
        v = order[i]
        group = group_of.get(v)
        first = max((labels[u] for u in graph.predecessors(v)), default=0)
        for s in range(first, num_stages):
            if group is not None and shared.get(group, s) != s:
                continue
            labels[v] = s
            new = group is not None and group not in shared
            if group is not None and new:
                shared[group] = s
            yield from place(i + 1)
            if group is not None and new:
                del shared[group]
        labels.pop(v, None)

    for _ in place(0):
        found.append(dict(labels))
        if len(found) > most:
            return None
    return found
