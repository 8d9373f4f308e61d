"""Builds and solves the CP-SAT placement model: minimise the pipeline bottleneck, then bytes sent.

The formulation is the pipeline-partitioning MIP of Tarnawski et al., "Efficient algorithms for
device placement of DNN graph operators" (NeurIPS 2020), restricted to stages in a fixed device
order, with the contiguity of stages expressed by "prefix" variables so that CP-SAT propagates
the order of every edge directly. It places *units* (see partitioner.coarsen): one node each for
the layer graph itself, runs of nodes on a coarsened graph. Unit U may take the devices of its
domain lo(U)..hi(U) (all devices, or its pinned one); outside it x is 0 and y is 0 below, 1 above:

    x[U, k] == 1  iff unit U runs on device k
    y[U, k] == 1  iff unit U runs on device k or earlier          (y[U, k] = sum_{t <= k} x[U, t])
    r[u, k] == 1  iff node u's output is received by device k      (u elsewhere, a reader on k)
    z[u, j, k] == 1 iff device k receives u's output from device j (only where bandwidth depends on j)

    edge U -> V:     y[V, k] <= y[U, k]  for every k              (stage(U) <= stage(V))
    c[k] == 1      iff the stage on device k recomputes its forward  (only when recompute != "never")

    memory:          sum_U mem(U) x[U, k] <= capacity(k)      (activations counted max_in_flight times)
                     in the mode c[k] gives: kept, or recomputed, which adds in(u) r[u, k] for received tensors
    stage time:      T >= sum_U compute(U, k) x[U, k] + sum_u recv(u, k) r[u, k]   (compute in c[k]'s mode)
    last stage:      c[k] => some unit on a device after k    ("always": <=>)
    objective:       minimise T * W + sum_{u, k} bytes(u) r[u, k]   (W > any byte term: lexicographic)

The modes' compute and memory per unit come from the cost model (partitioner.cost.mode_cost).

Times and bytes are scaled to integers (``time_resolution`` steps for the slowest device running
everything; ``byte_resolution`` steps for all possible transfers), so "optimal" is exact up to that
resolution; the plan's figures are then recomputed in floating point by the cost model.

Large graphs are coarsened first (``SolverOptions.coarsen``; multilevel partitioning after Karypis
and Kumar, SIAM J. Sci. Comput. 1998): the runs of partitioner.coarsen.segments are placed whole,
then the nodes near the stage boundaries are placed again one by one with the rest held in place,
for as long as that improves the plan. Such a plan is not proven optimal: its lower bound is the
cost model's (total work over total speed, or the costliest node), since a bound proven on units
does not hold for the nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import networkx as nx

from partitioner import baselines
from partitioner.baselines import check_stage_count
from partitioner.cluster import Cluster
from partitioner.coarsen import (
    Coarsening,
    UnitCosts,
    around_boundaries,
    chain_quotient,
    cut_bytes,
    identity,
    segments,
    unit_costs,
)
from partitioner.cost import CostModel
from partitioner.errors import InfeasiblePlanError, InputError, PartitionerError, SolverTimeoutError
from partitioner.graph import colocation_groups, is_chain
from partitioner.infeasibility import explain_infeasible
from partitioner.order import by_speed, check_device_order, fastest_on_heaviest, reorder, signature
from partitioner.plan import Plan
from partitioner.score import score_assignment, shorter_step

# TensorFlow loads its runtime with RTLD_GLOBAL. Imported before OR-Tools, its abseil and protobuf
# symbols win over OR-Tools' own and CP-SAT crashes in Solve (google/or-tools#3230; here with
# tensorflow-cpu 2.21 and ortools 9.15). RTLD_DEEPBIND (Linux) makes OR-Tools bind to its own.
_DLOPEN_FLAGS = sys.getdlopenflags() if hasattr(os, "RTLD_DEEPBIND") else None
if _DLOPEN_FLAGS is not None:
    sys.setdlopenflags(_DLOPEN_FLAGS | os.RTLD_DEEPBIND)
try:
    from ortools.sat.python import cp_model
finally:
    if _DLOPEN_FLAGS is not None:
        sys.setdlopenflags(_DLOPEN_FLAGS)

# coarsen=None coarsens above these sizes (nodes x devices). Measured in benchmarks/planner_speed:
# below them the fine model is solved (or the chain DP runs) in a few seconds.
AUTO_COARSEN_DAG = 4_000
AUTO_COARSEN_CHAIN = 8_000
# Runs per device in the coarse model: CP-SAT (a sketch for the refinement) and the chain DP (exact).
COARSE_UNITS_PER_DEVICE = 16
COARSE_UNITS_PER_DEVICE_DP = 32
# Deterministic time (CP-SAT's count of work) per second of a time limit, with SolverOptions.deterministic.
# Measured on the 2-core development machine under load: InceptionV3 on 8 devices, one worker, about 0.5
# deterministic units per wall-clock second; with 0.4 the wall-clock limit rarely ends the search first.
DETERMINISTIC_TIME_PER_S = 0.4


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the CP-SAT search that most users leave alone."""

    num_workers: int = 8  # parallel search workers (with deterministic=False); 0 = CP-SAT's default here
    seed: int = 0  # random seed, for reproducible runs
    # True: one CP-SAT worker that stops on a deterministic time budget (CP-SAT's own count of work,
    # DETERMINISTIC_TIME_PER_S per second of the limit), so the same input gives the same plan; the wall-clock
    # limit still holds and, on a machine so loaded that it ends the search first, runs can differ. Parallel
    # workers never repeat (whichever finds a solution first wins), and CP-SAT's deterministic interleaved
    # search spends its whole budget even on tiny models. False: num_workers in parallel, more search per second.
    deterministic: bool = True
    # "search": the planner chooses which device runs which stage (partitioner.order; Plan.devices is the
    # order chosen); "given": stages follow the cluster's order, for pipelines wired by hand.
    device_order: str = "search"
    hint: bool = True  # start from the best baseline (or the exact DP on chains) that fits
    exact_chains: bool = True  # solve chains without pins by the exact DP (partitioner.exact) instead
    log: bool = False  # print CP-SAT's search log
    time_resolution: int = 1_000_000  # integer steps for the slowest device running the whole graph
    byte_resolution: int = 10_000  # integer steps for all transfers the graph could make
    relative_gap: float = 0.0  # stop once (bottleneck - bound) / bottleneck is below this
    coarsen: bool | None = None  # place runs of nodes, then refine near boundaries; None = above AUTO_COARSEN_*
    # Return the legal baseline instead when its simulated step is shorter than the solver's plan's
    # (the solver minimises the bottleneck; the step also pays fill, drain and transfers, see docs/cost-model.md).
    shortest_step: bool = True


@dataclass
class _Model:
    """The CP-SAT model and the handles decode() needs."""

    model: cp_model.CpModel
    units: Coarsening  # what x places: one node per unit for the layer graph itself
    unit_costs: UnitCosts
    x: dict[tuple[int, int], cp_model.IntVar]  # only inside each unit's domain
    y: dict[tuple[int, int], cp_model.IntVar]  # only for lo(U) <= k < hi(U)
    r: dict[tuple[str, int], cp_model.IntVar]
    z: dict[tuple[str, int, int], cp_model.IntVar]
    c: dict[int, cp_model.IntVar]  # only when stages may recompute
    bottleneck: cp_model.IntVar
    weight: int  # W: objective = bottleneck * W + byte term
    time_unit_s: float  # seconds per integer time step
    sender_matters: set[int]  # receiving devices whose receive time depends on the sender's device


def solve(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    num_microbatches: int = 1,
    optimizer_slots: int = 2,
    time_limit_s: float = 10.0,
    pins: Mapping[str, str] | None = None,
    cost: str = "flops",
    schedule: str = "gpipe",
    options: SolverOptions | None = None,
    recompute: str = "never",
) -> Plan:
    """Places every node of ``graph`` on a device of ``cluster`` with CP-SAT.

    Args:
        graph: a layer graph (see partitioner.graph), e.g. from profiles.profile_model.
        cluster: the devices in pipeline order, their memory, speed and links.
        num_microbatches: M, the micro-batches per step.
        optimizer_slots: state per weight: 2 for Adam, 1 for momentum, 0 for SGD.
        time_limit_s: wall-clock budget of the whole call; the best plan so far is returned.
        pins: {node: device name} placements that must hold.
        cost: "flops" or "time" (measured time_s); see docs/cost-model.md.
        schedule: "gpipe" or "1f1b": the plan records it, its memory counts that schedule's micro-batches
            in flight (the constraints budget every node for the fullest stage: M for GPipe, min(number
            of devices, M) for 1F1B) and its step time is that schedule simulated.
        options: search knobs (workers, seed, hints, resolution, coarsening).
        recompute: "never" (every stage keeps its activations), "always" (every stage but the last
            recomputes its forward in the backward: more compute, activations of one micro-batch plus
            the stage's inputs per micro-batch in flight) or "auto" (the planner recomputes a stage
            only where that is needed to fit; it never shortens a step). ``Plan.recompute`` says which.

    Returns:
        A Plan with status "optimal" (proven) or "feasible" and the proven ``lower_bound_s``.

    Raises:
        InfeasiblePlanError: no placement fits; the message says what does not fit and by how much.
        SolverTimeoutError: the time limit passed before any feasible plan was found.
        InputError, GraphError, ClusterError: malformed arguments.

    Example:
        >>> cluster = pt.Cluster.uniform(4, memory="16GiB")            # doctest: +SKIP
        >>> plan = pt.solve(graph, cluster, num_microbatches=8)        # doctest: +SKIP
        >>> plan.status, plan.gap                                      # doctest: +SKIP
        ('optimal', 0.0)
    """
    started = time.perf_counter()
    options = options or SolverOptions()
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise InputError(f"time_limit_s must be a positive number of seconds. Received: {time_limit_s!r}.")
    if options.coarsen is not None and not isinstance(options.coarsen, bool):
        raise InputError(f"SolverOptions.coarsen must be True, False or None (auto). Received: {options.coarsen!r}.")
    check_device_order(options.device_order)
    costs = CostModel(
        graph,
        cluster,
        num_microbatches=num_microbatches,
        optimizer_slots=optimizer_slots,
        cost=cost,
        schedule=schedule,
        recompute=recompute,
    )
    check_stage_count(costs)
    pins = _check_pins(pins, costs)
    chain = options.exact_chains and not pins and is_chain(graph) and not colocation_groups(graph)
    size = len(costs.order) * len(costs.devices)
    coarsen = options.coarsen
    if coarsen is None:
        coarsen = size > (AUTO_COARSEN_CHAIN if chain else AUTO_COARSEN_DAG)
    if chain and not coarsen:
        from partitioner.exact import exact_chain

        plan = exact_chain(
            graph,
            cluster,
            num_microbatches=num_microbatches,
            optimizer_slots=optimizer_slots,
            cost=cost,
            schedule=schedule,
            recompute=recompute,
            device_order=options.device_order,
        )
        return _shortest_step(plan, costs, _legal_baselines(costs, pins), started) if options.shortest_step else plan
    if options.device_order == "search":
        return _search_orders(
            costs, pins, options, chain=chain, coarsen=coarsen, started=started, time_limit_s=time_limit_s
        )
    return _solve_in_order(
        costs, pins, options, chain=chain, coarsen=coarsen, started=started, time_limit_s=time_limit_s
    )


def _solve_in_order(
    costs: CostModel,
    pins: Mapping[str, str],
    options: SolverOptions,
    *,
    chain: bool,
    coarsen: bool,
    started: float,
    time_limit_s: float,
    starts: Sequence[Plan] = (),
) -> Plan:
    """The plan with stages in ``costs.cluster``'s order: CP-SAT (coarsened or not), or the best legal
    baseline or plan of ``starts`` when its simulated step is shorter."""
    # The baselines that fit serve twice: as the search's start, and as rivals of its answer on the simulated step.
    legal = [*starts, *_legal_baselines(costs, pins)] if options.hint or options.shortest_step else []
    deadline = started + float(time_limit_s)
    found = None
    if coarsen:
        found = _solve_coarsened(costs, pins, options, legal, chain=chain, started=started, deadline=deadline)
        if found is None and time.perf_counter() >= deadline:
            raise _timeout_error(costs, time_limit_s, pins)
    plan = found or _solve_fine(costs, pins, options, legal, time_limit_s=time_limit_s, started=started)
    return _shortest_step(plan, costs, legal, started) if options.shortest_step else plan


def _search_orders(
    costs: CostModel,
    pins: Mapping[str, str],
    options: SolverOptions,
    *,
    chain: bool,
    coarsen: bool,
    started: float,
    time_limit_s: float,
) -> Plan:
    """The shortest simulated step over a few candidate pipeline orders (:func:`_candidate_orders`),
    each solved in its turn with an equal share of the time left; ties go to the earlier order.

    Raises the first order's error when no order gives a plan.
    """
    deadline = started + float(time_limit_s)
    candidates = _candidate_orders(costs, pins)
    best: Plan | None = None
    first_error: PartitionerError | None = None
    for i, (order, start) in enumerate(candidates):
        now = time.perf_counter()
        share = max((deadline - now) / (len(candidates) - i), 0.05)
        permuted = (
            costs if order == tuple(range(len(costs.devices))) else costs.on(reorder(costs.cluster, order))
        )
        try:
            plan = _solve_in_order(
                permuted,
                pins,
                options,
                chain=chain,
                coarsen=coarsen,
                started=now,
                time_limit_s=share,
                starts=[start] if start is not None else [],
            )
        except SolverTimeoutError:
            first_error = first_error or _timeout_error(costs, time_limit_s, pins)  # the whole call's limit
            continue
        except InfeasiblePlanError as err:
            first_error = first_error or err
            continue
        if best is None or shorter_step(plan, best):
            best = plan
    if best is None:
        assert first_error is not None
        raise first_error
    return dataclasses.replace(best, solve_time_s=time.perf_counter() - started)


def _candidate_orders(costs: CostModel, pins: Mapping[str, str]) -> list[tuple[tuple[int, ...], Plan | None]]:
    """At most four pipeline orders for CP-SAT, each with a legal plan in that order to start from, or None.

    In this order, orders alike in every cost (partitioner.order.signature) once: the cluster's own; the order (and
    devices used) of the exact chain DP on the graph read as a chain of runs of its topological order
    (the bytes crossing each cut on the edges), whose plan is the start; the devices fastest first;
    and Metis' heaviest stage on the fastest device, for the stages of the best legal baseline (where
    the devices' speeds differ).
    """
    cluster = costs.cluster
    num_devices = len(costs.devices)
    orders: list[tuple[int, ...]] = [tuple(range(num_devices))]
    starts: dict[tuple[int, ...], Plan] = {}
    coarse = _coarse_chain_plan(costs, pins)
    if coarse is not None:
        order = tuple(cluster.index(d) for d in coarse.devices)
        orders.append(order)
        starts[order] = coarse
    orders.append(by_speed(cluster))
    legal = _legal_baselines(costs, pins)
    if legal and len({d.flops_per_s for d in cluster.devices}) > 1:  # equal speeds: no device is the fastest
        base = min(legal, key=lambda p: (p.step_time_s, p.bottleneck_s))
        work = [sum(float(costs.graph.nodes[v]["flops"]) for v in base.nodes_on(d)) for d in base.stages]
        orders.append(fastest_on_heaviest(cluster, work))
    # Orders alike in every cost are one; the chain DP's plan goes with the first of them.
    chosen: dict[tuple[object, ...], tuple[tuple[int, ...], Plan | None]] = {}
    for order in orders:
        key = signature(cluster, order)
        if key not in chosen or (order in starts and chosen[key][1] is None):
            chosen[key] = (order, starts.get(order))
    return list(chosen.values())[:4]


def _coarse_chain_plan(costs: CostModel, pins: Mapping[str, str]) -> Plan | None:
    """The chain DP's plan (order and devices searched) on runs of the topological order, scored on the
    graph itself in the order it chose; None when it does not fit, splits a shared layer or moves a pin."""
    from partitioner.exact import exact_chain

    num_units = min(len(costs.order), COARSE_UNITS_PER_DEVICE_DP * len(costs.devices), 400)
    units = segments(costs, num_units)
    cut = cut_bytes(costs)
    starts = list(itertools.accumulate(len(u) for u in units.units))[:-1]
    quotient = chain_quotient(costs.graph, units, cost=costs.cost, edge_bytes=[cut[i] for i in starts])
    try:
        plan = exact_chain(
            quotient,
            costs.cluster,
            num_microbatches=costs.num_microbatches,
            optimizer_slots=costs.optimizer_slots,
            cost=costs.cost,
            schedule=costs.schedule,
            recompute=costs.recompute,
        )
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


def _shortest_step(plan: Plan, costs: CostModel, legal: Sequence[Plan], started: float) -> Plan:
    """``plan``, or the legal baseline whose simulated step is shorter, keeping ``plan``'s proven bound."""
    others = [p for p in legal if p.assignment != plan.assignment]
    best = min(others, key=lambda p: (p.step_time_s, p.bottleneck_s), default=None)
    if best is None or best.step_time_s >= plan.step_time_s * (1 - 1e-9):
        return plan
    bound = plan.lower_bound_s
    return score_assignment(
        best.assignment,
        costs,
        method=f"{best.method} (shorter step than {plan.method})",
        status="optimal" if bound is not None and best.bottleneck_s <= bound else "feasible",
        lower_bound_s=bound,
        solve_time_s=time.perf_counter() - started,
    )


def _check_pins(pins: Mapping[str, str] | None, costs: CostModel) -> dict[str, str]:
    pins = dict(pins or {})
    unknown_nodes = sorted(v for v in pins if v not in costs.compute_s)
    if unknown_nodes:
        raise InputError(f"Pinned node(s) {unknown_nodes[:5]} are not in the layer graph.")
    for _v, device in pins.items():
        costs.cluster.index(device)  # raises ClusterError listing the devices that exist
    return pins


def _solve_fine(
    costs: CostModel,
    pins: Mapping[str, str],
    options: SolverOptions,
    legal: Sequence[Plan],
    *,
    time_limit_s: float,
    started: float,
) -> Plan:
    """One CP-SAT model with a unit per node; its bound is a bound of the layer graph."""
    m = build_model(costs, pins, options)
    if options.hint:
        hint = _best_start([*legal, *_exact_chain_start(costs, pins)]) or _fill_start(costs, pins)
        if hint is not None:
            _add_hint(m, costs, hint.assignment)
    left_s = max(started + time_limit_s - time.perf_counter(), 0.01)
    status, solver = _run(m, left_s, options, relative_gap=options.relative_gap)
    if status == cp_model.INFEASIBLE:
        raise explain_infeasible(costs, pins, fits_with_recompute=_fits_with_recompute(costs, pins))
    if status == cp_model.MODEL_INVALID:
        raise PartitionerError(f"Internal error: the CP-SAT model is invalid ({m.model.validate()}). Please report it.")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _timeout_error(costs, time_limit_s, pins)
    assignment = decode(m, solver, costs)
    bound_steps = math.floor(solver.best_objective_bound / m.weight + 1e-9)
    lower_bound = max(bound_steps * m.time_unit_s, costs.lower_bound_s())
    return score_assignment(
        assignment,
        costs,
        method="cp-sat",
        status="optimal" if status == cp_model.OPTIMAL else "feasible",
        lower_bound_s=lower_bound,
        solve_time_s=time.perf_counter() - started,
    )


def _timeout_error(costs: CostModel, time_limit_s: float, pins: Mapping[str, str]) -> SolverTimeoutError:
    recompute = (
        " A plan fits with recompute='auto' (stages run their forward again in the backward instead of "
        "keeping activations): plan with it."
        if _fits_with_recompute(costs, pins)
        else ""
    )
    return SolverTimeoutError(
        f"CP-SAT found no feasible plan within time_limit_s={time_limit_s} for {len(costs.order)} "
        f"nodes on {len(costs.devices)} devices. Raise time_limit_s, or loosen memory so a plan is easier "
        f"to find.{recompute}"
    )


def _solve_coarsened(
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
        start = _best_start(legal)
        if start is not None:
            best = _Candidate(start.bottleneck_s, start.transfer_bytes, start.assignment)
        else:
            best = _fill_start(costs, pins)

    def good_enough(found: _Candidate) -> bool:
        return found.bottleneck_s * (1 - options.relative_gap) <= lower_bound * (1 + 1e-9)

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
    best = _better(costs, best, found)

    # Refine: nodes within about one run's length of a boundary move one by one, while that gains.
    radius = max(12, math.ceil(num_nodes / coarse.num_units))
    while best is not None and not good_enough(best) and deadline - time.perf_counter() - reserve_s > 0.2:
        units = around_boundaries(costs, best.assignment, radius, pinned)
        if chain:
            found = _place_chain_units(costs, units)
        else:
            found = _place_units(costs, units, best, deadline - reserve_s, options)
        better = _better(costs, best, found)
        if better is best:
            break
        best = better
    if best is None:
        return None
    return score_assignment(
        best.assignment,
        costs,
        method="exact_chain+coarsen" if chain else "cp-sat+coarsen",
        status="optimal" if best.bottleneck_s <= lower_bound * (1 + 1e-9) else "feasible",
        lower_bound_s=lower_bound,
        solve_time_s=time.perf_counter() - started,
    )


def _place_units(
    costs: CostModel, units: Coarsening, start: _Candidate | None, until: float, options: SolverOptions
) -> dict[str, str] | None:
    """CP-SAT on ``units``, hinted with ``start``, done by ``until`` (perf_counter); the placement found, or None."""
    m = build_model(costs, {}, options, units=units)
    if start is not None:
        _add_hint(m, costs, start.assignment)
    time_limit_s = until - time.perf_counter()
    if time_limit_s < 0.05:
        return None
    status, solver = _run(m, time_limit_s, options, relative_gap=options.relative_gap)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return decode(m, solver, costs)


def _place_chain_units(costs: CostModel, units: Coarsening) -> dict[str, str] | None:
    """The exact DP on the chain of ``units``; the placement found, or None when none fits."""
    from partitioner.exact import exact_chain

    try:
        plan = exact_chain(
            chain_quotient(costs.graph, units, cost=costs.cost),
            costs.cluster,
            num_microbatches=costs.num_microbatches,
            optimizer_slots=costs.optimizer_slots,
            cost=costs.cost,
            schedule=costs.schedule,
            recompute=costs.recompute,
            device_order="given",  # the order is chosen outside (solve's search)
        )
    except PartitionerError:
        return None
    return {v: plan.assignment[unit[0]] for unit in units.units for v in unit}


class _Candidate(NamedTuple):
    """A legal placement found on the way, with what decides between two of them."""

    bottleneck_s: float
    transfer_bytes: int
    assignment: dict[str, str]


def _better(costs: CostModel, best: _Candidate | None, assignment: dict[str, str] | None) -> _Candidate | None:
    """``best`` or ``assignment``, whichever has the smaller bottleneck (then fewer bytes sent)."""
    if assignment is None:
        return best
    found = costs.evaluate(assignment)
    if not costs.fits(found):
        return best
    if best is None or (found.bottleneck_s, found.transfer_bytes) < best[:2]:
        return _Candidate(found.bottleneck_s, found.transfer_bytes, dict(assignment))
    return best


def _run(
    m: _Model, time_limit_s: float, options: SolverOptions, *, relative_gap: float
) -> tuple[Any, cp_model.CpSolver]:
    """Solves ``m`` within ``time_limit_s``; returns CP-SAT's status and the solver holding the answer."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    if options.deterministic:
        solver.parameters.max_deterministic_time = float(time_limit_s) * DETERMINISTIC_TIME_PER_S
    solver.parameters.num_workers = (
        1 if options.deterministic else options.num_workers or min(8, (os.cpu_count() or 1) * 4)
    )
    solver.parameters.random_seed = options.seed
    solver.parameters.log_search_progress = options.log
    solver.parameters.relative_gap_limit = relative_gap
    # Measured on random DAGs of 200-1000 nodes: symmetry detection and probing in presolve cost
    # seconds and never paid back (benchmarks/planner_speed).
    solver.parameters.symmetry_level = 0
    solver.parameters.cp_model_probing_level = 0
    return solver.solve(m.model), solver


def build_model(
    costs: CostModel, pins: Mapping[str, str], options: SolverOptions, *, units: Coarsening | None = None
) -> _Model:
    """Returns the CP-SAT model of placing ``units`` (default: every node alone) on ``costs.cluster``.

    ``pins`` apply to the default units; a coarsening carries its pins in its domains.
    See the module docstring for the formulation.
    """
    cluster, order = costs.cluster, costs.order
    num_devices = len(costs.devices)
    devices = range(num_devices)
    if units is None:
        units = identity(costs, {v: cluster.index(d) for v, d in pins.items()})
    uc = unit_costs(costs, units)
    domains = units.domains
    model = cp_model.CpModel()

    # Scaling: integer time steps and byte steps.
    # The costliest transfer per byte (receive_s is linear in the tensor's size).
    widest = max(order, key=costs.out_bytes.__getitem__)
    per_byte_s = (
        max(costs.receive_s(widest, j, k) for j in devices for k in devices if j != k) / costs.out_bytes[widest]
        if num_devices > 1 and costs.out_bytes[widest] > 0
        else 0.0
    )
    max_receive_s = sum(costs.out_bytes[u] * per_byte_s for u in order)
    slowest_mode = costs.modes[-1]  # recomputed when stages may recompute: never faster than kept
    horizon_s = max(sum(costs.mode_compute_s[slowest_mode][v][k] for v in order) for k in devices) + max_receive_s
    time_unit_s = horizon_s / options.time_resolution if horizon_s > 0 else 1.0
    total_bytes = sum(costs.out_bytes[u] for u in order) * max(num_devices - 1, 1)
    byte_unit = max(total_bytes / options.byte_resolution, 1.0)

    def steps(seconds: float) -> int:
        return round(seconds / time_unit_s)

    # ----- variables -----------------------------------------------------------------------------
    # x[U, k] == 1 iff unit U runs on device k (k in U's domain; a unit with one device has no variable)
    x = {
        (i, k): model.new_bool_var(f"x_{_name(units, i)}_{k}")
        for i, (lo, hi) in enumerate(domains)
        if lo < hi
        for k in range(lo, hi + 1)
    }
    # y[U, k] == 1 iff unit U runs on device k or earlier (lo(U) <= k < hi(U); 0 below, 1 from hi(U) on)
    y = {
        (i, k): model.new_bool_var(f"y_{_name(units, i)}_{k}")
        for i, (lo, hi) in enumerate(domains)
        for k in range(lo, hi)
    }

    def on(i: int, k: int) -> cp_model.IntVar | int:
        lo, hi = domains[i]
        return x[i, k] if lo < hi and lo <= k <= hi else int(lo == hi == k)

    def by(i: int, k: int) -> cp_model.IntVar | int:
        lo, hi = domains[i]
        return y[i, k] if lo <= k < hi else int(k >= hi)

    # r[u, k] == 1 iff device k receives u's output (u elsewhere, some reading unit on k)
    r = {}
    for u, home, readers in uc.senders:
        reach = {k for reader in readers for k in range(max(1, domains[reader][0]), domains[reader][1] + 1)}
        for k in sorted(reach):
            if not domains[home][0] == domains[home][1] == k:
                r[u, k] = model.new_bool_var(f"r_{u}_{k}")
    # z[u, j, k] == 1 iff device k receives u's output from device j (only where the sender matters)
    sender_matters = {
        k
        for k in range(1, num_devices)
        if len({(cluster.bandwidth(j, k), cluster.bandwidth(k, j)) for j in range(k)}) > 1
    }
    home_of = {u: home for u, home, _ in uc.senders}
    z = {
        (u, j, k): model.new_bool_var(f"z_{u}_{j}_{k}")
        for (u, k) in r
        if k in sender_matters
        for j in range(domains[home_of[u]][0], min(k, domains[home_of[u]][1] + 1))
    }
    # c[k] == 1 iff the stage on device k recomputes its forward in the backward (stages may recompute)
    recomputing = "recomputed" in costs.modes
    c = {k: model.new_bool_var(f"c_{k}") for k in devices} if recomputing else {}
    horizon_steps = steps(horizon_s) + len(order) + 1
    bottleneck = model.new_int_var(0, horizon_steps, "bottleneck")

    # ----- constraints ---------------------------------------------------------------------------
    for i, (lo, hi) in enumerate(domains):
        if lo < hi:
            model.add_exactly_one(x[i, k] for k in range(lo, hi + 1))
        for k in range(lo, hi):
            model.add(y[i, k] == sum(x[i, t] for t in range(lo, k + 1)))
            if k > lo:
                model.add_implication(y[i, k - 1], y[i, k])
    # Every edge goes forward: stage(U) <= stage(V), i.e. y[V, k] <= y[U, k].
    for a, b in uc.edges:
        for k in range(domains[b][0], min(domains[a][1], num_devices - 1)):
            _at_most(model, by(b, k), by(a, k))
    # Received tensors.
    for u, home, readers in uc.senders:
        for reader in readers:
            for k in range(max(1, domains[reader][0]), domains[reader][1] + 1):
                if (u, k) in r:
                    model.add(r[u, k] >= on(reader, k) - on(home, k))
    for u, j, k in z:
        model.add(z[u, j, k] >= on(home_of[u], j) + r[u, k] - 1)
    # The last stage is never recomputed: c[k] needs a unit on a later device ("always": c[k] iff there is one).
    for k, c_k in c.items():
        later: list[Any] = []  # literals "unit i runs after device k"
        for i, (lo, hi) in enumerate(domains):
            if k < hi:
                later.append(True if lo > k else y[i, k].Not())
        if any(lit is True for lit in later):
            if costs.recompute == "always":
                model.add(c_k == 1)
        elif not later:
            model.add(c_k == 0)
        else:
            model.add_bool_or(later).only_enforce_if(c_k)
            if costs.recompute == "always":
                for lit in later:
                    model.add_implication(lit, c_k)
    # Memory, in KiB rounded conservatively, in the stage's mode.
    received_on: dict[int, list[str]] = {k: [] for k in devices}
    for u, k in r:
        received_on[k].append(u)
    for k, device in enumerate(cluster.devices):
        capacity = device.memory_bytes // 1024
        for mode in costs.modes:
            memory = uc.mode_memory[mode]
            held = [
                math.ceil(memory[i] / 1024) * on(i, k)
                for i, (lo, hi) in enumerate(domains)
                if memory[i] > 0 and lo <= k <= hi
            ]
            held += [
                math.ceil(costs.input_memory[mode][u] / 1024) * r[u, k]
                for u in received_on[k]
                if costs.input_memory[mode][u] > 0
            ]
            constraint = model.add(sum(held) <= capacity)
            if c:
                constraint.only_enforce_if(c[k] if mode == "recomputed" else c[k].Not())
    # Shared layers stay together (pins are in the domains).
    for group in uc.colocated:
        for i in group[1:]:
            for k in range(min(domains[j][0] for j in group), max(domains[j][1] for j in group) + 1):
                _equal(model, on(i, k), on(group[0], k))
    # The bottleneck bounds every stage's compute (in its mode) + receive time.
    for k in devices:
        receive = []
        for u in received_on[k]:
            if k in sender_matters:
                lo, hi = domains[home_of[u]]
                receive += [steps(costs.receive_s(u, j, k)) * z[u, j, k] for j in range(lo, min(k, hi + 1))]
            else:
                receive.append(steps(costs.receive_s(u, 0, k)) * r[u, k])
        for mode in costs.modes:
            rows = uc.mode_compute_s[mode]
            compute = [steps(rows[i][k]) * on(i, k) for i, (lo, hi) in enumerate(domains) if lo <= k <= hi]
            constraint = model.add(bottleneck >= sum(compute) + sum(receive))
            if c and mode == "recomputed":
                constraint.only_enforce_if(c[k])

    # ----- objective: the bottleneck first, then the bytes sent ----------------------------------
    byte_terms = [round(costs.out_bytes[u] / byte_unit) * r[u, k] for (u, k) in r]
    weight = options.byte_resolution + len(r) + 1
    model.minimize(bottleneck * weight + sum(byte_terms))
    return _Model(model, units, uc, x, y, r, z, c, bottleneck, weight, time_unit_s, sender_matters)


def _name(units: Coarsening, i: int) -> str:
    """A unit's name in variable names: its node, or its first node and how many follow."""
    unit = units.units[i]
    return unit[0] if len(unit) == 1 else f"{unit[0]}+{len(unit) - 1}"


def _at_most(model: cp_model.CpModel, a: cp_model.IntVar | int, b: cp_model.IntVar | int) -> None:
    """a <= b for Boolean variables or the constants 0 and 1."""
    if isinstance(a, int) and isinstance(b, int):
        if a > b:
            model.add(False)
    elif isinstance(a, int):
        if a:
            model.add(b == 1)
    elif isinstance(b, int):
        if not b:
            model.add(a == 0)
    else:
        model.add_implication(a, b)


def _equal(model: cp_model.CpModel, a: cp_model.IntVar | int, b: cp_model.IntVar | int) -> None:
    """a == b for Boolean variables or the constants 0 and 1."""
    if isinstance(a, int) and isinstance(b, int):
        if a != b:
            model.add(False)
    else:
        model.add(a == b)


def decode(m: _Model, solver: cp_model.CpSolver, costs: CostModel) -> dict[str, str]:
    """Reads {node: device name} from a solved model."""
    unit_devices = []
    for i, (lo, hi) in enumerate(m.units.domains):
        unit_devices.append(next((k for k in range(lo, hi + 1) if lo == hi or solver.boolean_value(m.x[i, k])), lo))
    return m.units.expand(unit_devices, costs.devices)


def _best_start(candidates: Sequence[Plan]) -> Plan | None:
    """The least bottleneck (then fewest bytes) among legal plans, as a search hint."""
    return min(candidates, key=lambda p: (p.bottleneck_s, p.transfer_bytes), default=None)


def _legal_baselines(costs: CostModel, pins: Mapping[str, str]) -> list[Plan]:
    """The baselines' plans, scored with ``costs``, that fit, keep the pins and keep shared layers together."""
    groups = colocation_groups(costs.graph).values()
    return [
        p
        for p in (baselines.split_with(costs, name) for name in baselines.BASELINES)
        if p.fits_memory
        and all(p.assignment[v] == d for v, d in pins.items())
        and all(len({p.assignment[v] for v in nodes}) == 1 for nodes in groups)
    ]


def _exact_chain_start(costs: CostModel, pins: Mapping[str, str]) -> list[Plan]:
    """The exact DP's plan (it fits) when the graph is a chain without shared layers and the plan keeps the pins."""
    from partitioner.exact import exact_chain

    if not is_chain(costs.graph) or colocation_groups(costs.graph):
        return []
    with contextlib.suppress(PartitionerError):
        plan = exact_chain(
            costs.graph,
            costs.cluster,
            num_microbatches=costs.num_microbatches,
            optimizer_slots=costs.optimizer_slots,
            cost=costs.cost,
            schedule=costs.schedule,
            recompute=costs.recompute,
            device_order="given",
        )
        return [plan] if all(plan.assignment[v] == d for v, d in pins.items()) else []
    return []


def _fits_with_recompute(costs: CostModel, pins: Mapping[str, str]) -> bool:
    """True iff a plan that fits exists when stages may recompute ("auto"), for a problem planned with
    recompute="never" that has none: a legal baseline or the greedy fill fits (a quick check, not a search)."""
    if costs.recompute != "never":
        return False
    auto = CostModel(
        costs.graph,
        costs.cluster,
        num_microbatches=costs.num_microbatches,
        optimizer_slots=costs.optimizer_slots,
        cost=costs.cost,
        schedule=costs.schedule,
        recompute="auto",
    )
    return bool(_legal_baselines(auto, pins)) or _fill_start(auto, pins) is not None


def _fill_start(costs: CostModel, pins: Mapping[str, str]) -> _Candidate | None:
    """Runs of the topological order, each device filled up to a time target and its memory: a legal
    start where no baseline fits (they balance work or layers, not memory); None if none is legal.

    Devices are filled in pipeline order; a device is left for the next one once the next run would
    overflow its memory or its time target (the cost model's lower bound plus 2%, 10%, 30%, or none:
    the best of the four is returned). Runs never split the calls of a shared layer.
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
    last = len(capacity) - 1
    best: _Candidate | None = None
    for slack in (0.02, 0.1, 0.3, math.inf):
        target = costs.lower_bound_s() * (1 + slack)
        k, load, held = 0, 0.0, 0
        assignment: dict[str, str] = {}
        for run in runs:
            need = sum(min(costs.mode_memory[mode][v] for mode in costs.modes) for v in run)
            while k < last and (
                held + need > capacity[k] or (held > 0 and load + sum(costs.compute_s[v][k] for v in run) > target)
            ):
                k, load, held = k + 1, 0.0, 0
            if held + need > capacity[k]:
                break
            assignment.update(dict.fromkeys(run, costs.devices[k]))
            load += sum(costs.compute_s[v][k] for v in run)
            held += need
        else:
            if all(assignment[v] == d for v, d in pins.items()):
                best = _better(costs, best, assignment)
    return best


def _add_hint(m: _Model, costs: CostModel, assignment: Mapping[str, str]) -> None:
    """Hints every variable of ``m`` with ``assignment`` (projected on the units where it splits one)."""
    where = m.units.project(assignment, costs.devices)
    for (i, k), var in m.x.items():
        m.model.add_hint(var, where[i] == k)
    for (i, k), var in m.y.items():
        m.model.add_hint(var, where[i] <= k)
    received = {
        (u, where[reader])
        for u, home, readers in m.unit_costs.senders
        for reader in readers
        if where[reader] != where[home]
    }
    home_of = {u: home for u, home, _ in m.unit_costs.senders}
    for (u, k), var in m.r.items():
        m.model.add_hint(var, (u, k) in received)
    for (u, j, k), var in m.z.items():
        m.model.add_hint(var, (u, k) in received and where[home_of[u]] == j)
    # Each stage's mode as the plan would take it, and the bottleneck as the model counts it: the costliest
    # stage in integer steps.
    used = sorted(set(where))
    recomputed = costs.evaluate(m.units.expand(where, costs.devices)).recompute if m.c else (False,) * len(used)
    modes = dict(zip(used, recomputed, strict=True))
    for k, var in m.c.items():
        later = any(k2 > k for k2 in used)
        m.model.add_hint(var, modes.get(k, False) or (costs.recompute == "always" and later and k not in modes))
    stage = [0] * len(costs.devices)
    for i, k in enumerate(where):
        rows = m.unit_costs.mode_compute_s["recomputed" if modes.get(k, False) else "kept"]
        stage[k] += round(rows[i][k] / m.time_unit_s)
    for u, k in received:
        sender = where[home_of[u]] if k in m.sender_matters else 0
        stage[k] += round(costs.receive_s(u, sender, k) / m.time_unit_s)
    m.model.add_hint(m.bottleneck, max(stage))
