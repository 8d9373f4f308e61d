"""Places a large graph in two levels: runs of nodes first, then the nodes near the stage boundaries.

Multilevel partitioning after Karypis and Kumar, "A fast and high quality multilevel scheme for
partitioning irregular graphs" (SIAM J. Sci. Comput. 1998), used by ``solve`` above a size
(``SolverOptions.coarsen``): the runs of partitioner.search.coarsen.segments are placed whole (by the exact
chain DP on chains, by the CP-SAT model of partitioner.search.cpsat otherwise), then the nodes near the stage
boundaries are placed again one by one with the rest held in place, for as long as that improves the
plan. Such a plan is not proven optimal: its lower bound is the cost model's (total work over total
speed, or the costliest node), since a bound proven on units does not hold for the nodes.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from partitioner.cluster import reorder
from partitioner.cost import CostModel
from partitioner.errors import PartitionerError
from partitioner.graph import colocation_groups
from partitioner.plan import Plan
from partitioner.score import score_assignment
from partitioner.search.chain import exact_chain_for
from partitioner.search.coarsen import Coarsening, around_boundaries, chain_quotient, cut_bytes, segments
from partitioner.search.cpsat import add_hint, build_model, cp_model, decode, solve_model
from partitioner.search.starts import Candidate, best_of, best_start, fill_start
from partitioner.verdict import TOLERANCE, on_bottleneck

if TYPE_CHECKING:
    from partitioner.search.options import SolverOptions

# Runs per device in the coarse model: CP-SAT (a sketch for the refinement) and the chain DP (exact).
COARSE_UNITS_PER_DEVICE = 16
COARSE_UNITS_PER_DEVICE_DP = 32


def solve_coarsened(
    costs: CostModel,
    pins: Mapping[str, str],
    options: SolverOptions,
    legal: Sequence[Plan],
    *,
    chain: bool,
    started: float,
    deadline: float,
) -> Plan | None:
    """Places runs of nodes, then refines near the stage boundaries; None if that found no plan.

    Chains (without pins or shared layers) place their units with the exact DP, everything else
    with CP-SAT. The plan is never worse than the best legal baseline, which is also the start
    when the coarse units find nothing better.
    """
    num_nodes, num_devices = len(costs.order), len(costs.devices)
    pinned = {v: costs.cluster.index(d) for v, d in pins.items()}
    reserve_s = 0.1 + 5e-5 * num_nodes  # scoring the final plan
    lower_bound = costs.lower_bound_s()
    best = None
    if options.hint:
        start = best_start(legal)
        if start is not None:
            best = Candidate(start.bottleneck_s, start.transfer_bytes, start.assignment)
        else:
            best = fill_start(costs, pins)

    def good_enough(found: Candidate) -> bool:
        return found.bottleneck_s * (1 - options.relative_gap) <= lower_bound * (1 + TOLERANCE)

    # Coarse: a dozen or two runs per device, none straddling a stage boundary of the start (which is
    # then a placement of runs: a complete hint). The DP takes more runs; CP-SAT only needs a sketch
    # and a short time, as the refinement does the fine work.
    per_device, most = (COARSE_UNITS_PER_DEVICE_DP, 400) if chain else (COARSE_UNITS_PER_DEVICE, 256)
    num_units = min(num_nodes, per_device * num_devices, most)
    cuts = []
    if best is not None:
        where = [best.assignment[v] for v in costs.order]
        cuts = [i for i in range(1, num_nodes) if where[i] != where[i - 1]]
    coarse = segments(costs, num_units, pinned, cuts=cuts)
    share = 0.15 if best is not None else 0.5
    until = time.perf_counter() + share * (deadline - reserve_s - time.perf_counter())
    found = _place_chain_units(costs, coarse) if chain else _place_units(costs, coarse, best, until, options)
    best = best_of(costs, best, found)

    # Refine: nodes within about one run's length of a boundary move one by one, while that gains.
    radius = max(12, math.ceil(num_nodes / coarse.num_units))
    while best is not None and not good_enough(best) and deadline - time.perf_counter() - reserve_s > 0.2:
        units = around_boundaries(costs, best.assignment, radius, pinned)
        if chain:
            found = _place_chain_units(costs, units)
        else:
            found = _place_units(costs, units, best, deadline - reserve_s, options)
        better = best_of(costs, best, found)
        if better is best:
            break
        best = better
    if best is None:
        return None
    plan = score_assignment(
        best.assignment,
        costs,
        method="exact_chain+coarsen" if chain else "cp-sat+coarsen",
        solve_time_s=time.perf_counter() - started,
    )
    return on_bottleneck(plan, lower_bound)


def _place_units(
    costs: CostModel, units: Coarsening, start: Candidate | None, until: float, options: SolverOptions
) -> dict[str, str] | None:
    """CP-SAT on ``units``, hinted with ``start``, done by ``until`` (perf_counter); the placement found, or None."""
    m = build_model(costs, {}, options, units=units)
    if start is not None:
        add_hint(m, costs, start.assignment)
    time_limit_s = until - time.perf_counter()
    if time_limit_s < 0.05:
        return None
    status, solver = solve_model(m, time_limit_s, options, relative_gap=options.relative_gap)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return decode(m, solver, costs)


def _place_chain_units(costs: CostModel, units: Coarsening) -> dict[str, str] | None:
    """The exact DP on the chain of ``units``; the placement found, or None when none fits."""

    try:
        # the order is chosen outside (solve's search); the plan refines CP-SAT's, which minimises the bottleneck
        plan = exact_chain_for(
            costs.of(chain_quotient(costs.graph, units, cost=costs.cost)), device_order="given", objective="bottleneck"
        )
    except PartitionerError:
        return None
    return {v: plan.assignment[unit[0]] for unit in units.units for v in unit}


def coarse_chain_plan(costs: CostModel, pins: Mapping[str, str]) -> Plan | None:
    """The chain DP's plan (order and devices searched) on runs of the topological order, scored on the
    graph itself in the order it chose; None when it does not fit, splits a shared layer or moves a pin."""

    num_units = min(len(costs.order), COARSE_UNITS_PER_DEVICE_DP * len(costs.devices), 400)
    units = segments(costs, num_units)
    cut = cut_bytes(costs)
    starts = list(itertools.accumulate(len(u) for u in units.units))[:-1]
    quotient = chain_quotient(costs.graph, units, cost=costs.cost, edge_bytes=[cut[i] for i in starts])
    try:
        plan = exact_chain_for(costs.of(quotient))
    except PartitionerError:
        return None
    assignment = {v: plan.assignment[unit[0]] for unit in units.units for v in unit}
    groups = colocation_groups(costs.graph).values()
    if any(assignment[v] != d for v, d in pins.items()) or any(len({assignment[v] for v in g}) > 1 for g in groups):
        return None
    permuted = costs.on(reorder(costs.cluster, list(plan.devices)))
    if not permuted.fits(permuted.evaluate(assignment)):
        return None
    return score_assignment(assignment, permuted, method="exact_chain on runs")
