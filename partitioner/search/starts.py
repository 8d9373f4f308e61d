"""Legal start solutions for the solvers: the baselines that fit, the exact chain DP, a greedy memory fill.

They serve as CP-SAT's hint (partitioner.search.cpsat.add_hint), as the multilevel driver's first plan, as rivals
of the solver's plan on the simulated step, and as the quick check behind "a plan fits with recompute".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from partitioner.cost import CostModel
from partitioner.errors import PartitionerError
from partitioner.graph import colocation_groups, is_chain
from partitioner.plan import Plan
from partitioner.search import baselines
from partitioner.search.chain import exact_chain_for


class Candidate(NamedTuple):
    """A legal placement found on the way, with what decides between two of them."""

    bottleneck_s: float
    transfer_bytes: int
    assignment: dict[str, str]


def best_of(costs: CostModel, best: Candidate | None, assignment: dict[str, str] | None) -> Candidate | None:
    """``best`` or ``assignment``, whichever has the smaller bottleneck (then fewer bytes sent)."""
    if assignment is None:
        return best
    found = costs.evaluate(assignment)
    if not costs.fits(found):
        return best
    if best is None or (found.bottleneck_s, found.transfer_bytes) < best[:2]:
        return Candidate(found.bottleneck_s, found.transfer_bytes, dict(assignment))
    return best


def best_start(candidates: Sequence[Plan]) -> Plan | None:
    """The least bottleneck (then fewest bytes) among legal plans, as a search hint."""
    return min(candidates, key=lambda p: (p.bottleneck_s, p.transfer_bytes), default=None)


def legal_baselines(costs: CostModel, pins: Mapping[str, str]) -> list[Plan]:
    """The baselines' plans, scored with ``costs``, that fit, keep the pins and keep shared layers together."""
    groups = colocation_groups(costs.graph).values()
    return [
        p
        for p in (baselines.split_with(costs, name) for name in baselines.BASELINES)
        if p.fits_memory
        and all(p.assignment[v] == d for v, d in pins.items())
        and all(len({p.assignment[v] for v in nodes}) == 1 for nodes in groups)
    ]


def exact_chain_start(costs: CostModel, pins: Mapping[str, str]) -> list[Plan]:
    """The exact DP's plan (it fits) when the graph is a chain without shared layers and the plan keeps the pins."""

    if not is_chain(costs.graph) or colocation_groups(costs.graph):
        return []
    with contextlib.suppress(PartitionerError):
        # a start for CP-SAT, which minimises the bottleneck
        plan = exact_chain_for(costs, device_order="given", objective="bottleneck")
        return [plan] if all(plan.assignment[v] == d for v, d in pins.items()) else []
    return []


def fits_with_recompute(costs: CostModel, pins: Mapping[str, str]) -> bool:
    """True iff a plan that fits exists when stages may recompute ("auto"), for a problem planned with
    recompute="never" that has none: a legal baseline or the greedy fill fits (a quick check, not a search)."""
    if costs.recompute != "never":
        return False
    auto = costs.with_recompute("auto")
    return bool(legal_baselines(auto, pins)) or fill_start(auto, pins) is not None


def fill_start(costs: CostModel, pins: Mapping[str, str]) -> Candidate | None:
    """Runs of the topological order, each device filled up to a time target and its memory: a legal
    start where no baseline fits (they balance work or layers, not memory); None if none is legal.

    Devices are filled in pipeline order; a device is left for the next one once the next run would
    overflow its memory or its time target (the cost model's lower bound plus 2%, 10%, 30%, or none:
    the best of the four is returned). Runs never split the calls of a shared layer. Each device's
    memory is budgeted for the most micro-batches its stage can hold (CostModel.device_in_flight).
    """
    order = costs.order
    position = {v: i for i, v in enumerate(order)}
    joined = [False] * len(order)  # position i continues the run of position i - 1
    for nodes in colocation_groups(costs.graph).values():
        for i in range(min(position[v] for v in nodes) + 1, max(position[v] for v in nodes) + 1):
            joined[i] = True
    runs: list[list[str]] = []
    for i, v in enumerate(order):
        if runs and joined[i]:
            runs[-1].append(v)
        else:
            runs.append([v])
    capacity = [d.memory_bytes for d in costs.cluster.devices]
    # [k][node]: the least bytes of a node on device k (the mode that needs least, k's budget)
    least = [
        {v: min(costs.node_memory_bytes(mode, held)[v] for mode in costs.modes) for v in order}
        for held in costs.device_in_flight
    ]
    last = len(capacity) - 1
    best: Candidate | None = None
    for slack in (0.02, 0.1, 0.3, math.inf):
        target = costs.lower_bound_s() * (1 + slack)
        k, load, held = 0, 0.0, 0
        assignment: dict[str, str] = {}
        for run in runs:
            while k < last and (
                held + sum(least[k][v] for v in run) > capacity[k]
                or (held > 0 and load + sum(costs.compute_s[v][k] for v in run) > target)
            ):
                k, load, held = k + 1, 0.0, 0
            need = sum(least[k][v] for v in run)
            if held + need > capacity[k]:
                break
            assignment.update(dict.fromkeys(run, costs.devices[k]))
            load += sum(costs.compute_s[v][k] for v in run)
            held += need
        else:
            if all(assignment[v] == d for v, d in pins.items()):
                best = best_of(costs, best, assignment)
    return best
