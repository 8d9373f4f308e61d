"""Plans a layer graph on a cluster: the front door ``solve`` and its search over device orders.

``solve`` dispatches: chains without pins or shared layers go to the exact DP (partitioner.search.chain); other
graphs to the CP-SAT model (partitioner.search.cpsat), solved whole or, above a size, in two levels
(partitioner.search.multilevel); both start from the legal plans of partitioner.search.starts. With
``device_order="search"`` it solves a few candidate pipeline orders and keeps the shortest simulated step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping, Sequence

import networkx as nx

from partitioner.cluster import Cluster, reorder
from partitioner.cost import CostModel
from partitioner.errors import InfeasiblePlanError, InputError, PartitionerError, SolverTimeoutError
from partitioner.graph import colocation_groups, is_chain
from partitioner.infeasibility import explain_infeasible
from partitioner.plan import Plan
from partitioner.problem import Problem, Reductions
from partitioner.score import score_assignment, shorter_step, smaller_bottleneck, with_step_bound
from partitioner.search.baselines import check_stage_count
from partitioner.search.chain import exact_chain_for
from partitioner.search.cpsat import add_hint, build_model, cp_model, decode, solve_model
from partitioner.search.exhaustive import against_every_plan
from partitioner.search.multilevel import coarse_chain_plan, solve_coarsened
from partitioner.search.options import SolverOptions
from partitioner.search.order import (
    by_speed,
    candidate_orders,
    check_device_order,
    device_classes,
    fast_island,
    fastest_on_heaviest,
    signature,
)
from partitioner.search.refine import refine_step
from partitioner.search.starts import best_start, exact_chain_start, fill_start, fits_with_recompute, legal_baselines
from partitioner.verdict import TOLERANCE, least_bound, on_bottleneck

# coarsen=None coarsens above these sizes (nodes x devices). Measured in benchmarks/planner_speed:
# below them the fine model is solved (or the chain DP runs) in a few seconds.
AUTO_COARSEN_DAG = 4_000
AUTO_COARSEN_CHAIN = 8_000
# Starts of the step refinement on a DAG of at most MULTI_START_NODES nodes: the solver's plan and the best
# legal baselines in other orders (larger graphs: the solver's plan alone). Measured on planner_quality's
# random DAGs: with 3 starts one case of 239 stayed 2.7% above brute force (the best plan reverses the
# device order the solver chose), with 8 none; a start costs milliseconds at 10 nodes, a second at 1,000.
REFINED_STARTS = 8
MULTI_START_NODES = 64


# On clusters of up to this many devices the order search tries every distinct pipeline order (3! = 6 at most).
EVERY_ORDER_UP_TO = 3


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
    num_replicas: int = 1,
    reductions: Reductions | None = None,
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
            in flight (M for GPipe, 1 on its last stage; min(K - s, M) on stage s of K for 1F1B; the chain DP
            budgets each stage that, CP-SAT the device at position k of D CostModel.device_in_flight[k]) and
            its step time is that schedule simulated.
        options: search knobs (workers, seed, hints, resolution, coarsening).
        recompute: "never" (every stage keeps its activations), "always" (every stage but the last
            recomputes its forward in the backward: more compute, activations of one micro-batch plus
            the stage's inputs per micro-batch in flight) or "auto" (the planner recomputes a stage
            only where that is needed to fit; it never shortens a step). ``Plan.recompute`` says which.
        num_replicas: D, the data-parallel copies this pipeline is one of (``plan_replicas`` plans replica 0 so):
            each stage's memory counts the packed gradients its all-reduce holds.
        reductions: where each stage's ``R`` with the other replicas runs (``problem.Reductions``, priced by
            ``cost.reduce_s``): the search then minimises the step with them (the plan's ``reduce_times``); None
            leaves them out.

    Returns:
        A Plan with status "optimal" (proven) or "feasible", judged on what was minimised: with
        ``SolverOptions.shortest_step`` (the default) and on chains (the exact DP minimises the step),
        the step, against ``step_lower_bound_s`` (``CostModel.step_lower_bound_s``, or the exact GPipe
        search's proof); on a DAG with ``shortest_step=False``, the bottleneck, against the proven
        ``lower_bound_s`` (with ``device_order="search"``, a bound over every pipeline order, not only
        the plan's own). ``Plan.gap`` and ``Plan.objective`` say which.

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
    problem = Problem(
        graph,
        cluster,
        num_microbatches=num_microbatches,
        optimizer_slots=optimizer_slots,
        cost=cost,
        schedule=schedule,
        recompute=recompute,
        num_replicas=num_replicas,
        reductions=reductions,
    )
    return solve_problem(problem, time_limit_s=time_limit_s, pins=pins, options=options)


def solve_problem(
    problem: Problem,
    *,
    time_limit_s: float = 10.0,
    pins: Mapping[str, str] | None = None,
    options: SolverOptions | None = None,
) -> Plan:
    """:func:`solve` for a :class:`partitioner.Problem` (graph, cluster, M, slots, cost, schedule, recompute),
    validated when it was built; the other arguments, the search's own, are :func:`solve`'s.

    Raises:
        InfeasiblePlanError, SolverTimeoutError, InputError: as :func:`solve`.

    Example:
        >>> import partitioner as pt
        >>> cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12)
        >>> problem = pt.Problem(pt.chain_graph([1e12] * 4), cluster, num_microbatches=4)
        >>> plan = solve_problem(problem, time_limit_s=5)
        >>> plan.num_stages, plan.step_time_s, plan.status
        (2, 10.0, 'optimal')
    """
    started = time.perf_counter()
    options = options or SolverOptions()
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise InputError(f"time_limit_s must be a positive number of seconds. Received: {time_limit_s!r}.")
    if options.coarsen is not None and not isinstance(options.coarsen, bool):
        raise InputError(f"SolverOptions.coarsen must be True, False or None (auto). Received: {options.coarsen!r}.")
    check_device_order(options.device_order)
    costs = CostModel.from_problem(problem)
    check_stage_count(costs)
    pins = _check_pins(pins, costs)
    plan = _search(costs, pins, options, started=started, time_limit_s=float(time_limit_s))
    deadline = started + float(time_limit_s)
    return against_every_plan(plan, costs, pins, options.device_order, started=started, deadline=deadline)


def _search(
    costs: CostModel, pins: Mapping[str, str], options: SolverOptions, *, started: float, time_limit_s: float
) -> Plan:
    """:func:`solve`'s search, after its arguments are checked: the chain DP, or CP-SAT (in one order or
    several, coarsened or not) and the refinements of its plan; judged on what it minimised."""
    graph, cluster, schedule = costs.graph, costs.cluster, costs.schedule
    chain = options.exact_chains and not pins and is_chain(graph) and not colocation_groups(graph)
    size = len(costs.order) * len(costs.devices)
    coarsen = options.coarsen
    if coarsen is None:
        coarsen = size > (AUTO_COARSEN_CHAIN if chain else AUTO_COARSEN_DAG)
    if chain and not coarsen:
        try:
            plan = exact_chain_for(costs, device_order=options.device_order)  # judged on the step already
        except InfeasiblePlanError as err:
            return with_step_bound(_fitting_baseline(err, costs, legal_baselines(costs, pins), started), costs)
        stepped = _shortest_step(plan, costs, legal_baselines(costs, pins), started) if options.shortest_step else plan
        if stepped is plan:
            return plan
        # a baseline at least as short as the DP's plan: proven optimal where that plan was
        return with_step_bound(
            stepped, costs, proven_s=plan.step_lower_bound_s, proven_optimal=plan.status == "optimal"
        )
    called, call_limit_s = started, float(time_limit_s)
    island = fast_island(cluster) if not pins and options.shortest_step else None
    island_plan = None
    if island is not None:  # a third of the time: the devices of one node alone
        island_plan = _island_plan(graph, costs, island, time_limit_s / 3, options, schedule=schedule)
        time_limit_s = max(started + time_limit_s - time.perf_counter(), 0.1)
        started = time.perf_counter()
    try:
        if options.device_order == "search":
            plan = _search_orders(
                costs, pins, options, chain=chain, coarsen=coarsen, started=started, time_limit_s=time_limit_s
            )
        else:
            plan = _solve_in_order(
                costs, pins, options, chain=chain, coarsen=coarsen, started=started, time_limit_s=time_limit_s
            )
    except PartitionerError:
        if island_plan is None:
            raise
        return with_step_bound(island_plan, costs)
    if island_plan is not None and shorter_step(island_plan, plan):
        # a bound on any plan of the whole cluster holds for the island's too
        plan = on_bottleneck(island_plan, plan.lower_bound_s)
    if not options.shortest_step:
        return plan  # CP-SAT's least bottleneck: status and gap against its bound on the bottleneck
    if not coarsen:
        plan = _refined(plan, costs, pins, options, called, deadline=called + call_limit_s)
    return with_step_bound(plan, costs)  # chosen by its step: status and gap against the bound on the step


def _refined(
    plan: Plan, costs: CostModel, pins: Mapping[str, str], options: SolverOptions, called: float, *, deadline: float
) -> Plan:
    """``plan``, or the plan of shorter simulated step that local moves find (partitioner.search.refine) from it
    and, with ``device_order="search"``, no pins and at most MULTI_START_NODES nodes, from the best legal
    baselines in other device orders (every arrangement of partitioner.search.order.candidate_orders, the
    REFINED_STARTS - 1 shortest steps).

    The search minimised the bottleneck; the moves judge the step. ``plan``'s lower bound, a bound on
    the bottleneck of every plan, stays (the status here says whether the new plan's bottleneck meets
    it; :func:`solve` then judges the plan on its step, ``partitioner.score.with_step_bound``).
    """
    exchange = options.device_order == "search"
    starts = [plan]
    if exchange and not pins and len(costs.order) <= MULTI_START_NODES:
        others = []
        for order in candidate_orders(costs.cluster):
            legal = legal_baselines(costs.on(reorder(costs.cluster, order)), pins)
            others += [p for p in legal if p.devices != plan.devices or p.assignment != plan.assignment]
        others.sort(key=lambda p: (p.step_time_s, p.bottleneck_s, p.devices))
        starts += others[: REFINED_STARTS - 1]
    best = plan
    for start in starts:
        found = refine_step(
            costs.on(reorder(costs.cluster, list(start.devices))),
            start.assignment,
            pins=pins,
            deadline=deadline,
            exchange=exchange,
            seed=options.seed,
        )
        if found is not None:
            names, assignment = found
            start = score_assignment(assignment, costs.on(reorder(costs.cluster, list(names))), method="refined")
        if shorter_step(start, best):
            best = start
    if best is plan:
        return plan
    refined = score_assignment(
        best.assignment,
        costs.on(reorder(costs.cluster, list(best.devices))),
        method=f"{plan.method}, then step refinement",
        solve_time_s=time.perf_counter() - called,
    )
    return on_bottleneck(refined, plan.lower_bound_s)


def _island_plan(
    graph: nx.DiGraph,
    costs: CostModel,
    island: Sequence[int],
    time_limit_s: float,
    options: SolverOptions,
    schedule: str,
) -> Plan | None:
    """The plan on the devices of ``island`` alone (partitioner.search.order.fast_island), scored on the whole
    cluster (the other devices idle, listed after them), or None when nothing fits there.

    More devices than one node's must never give a longer step than that node alone: a step objective
    would see it, the bottleneck the search minimises does not (the slow links between nodes cost
    little per stage but add to the fill and drain).
    """
    cluster = costs.cluster
    rest = [k for k in range(cluster.num_devices) if k not in island]
    try:
        plan = solve(
            graph,
            reorder(cluster, [*island, *rest]).take(len(island)),
            num_microbatches=costs.num_microbatches,
            optimizer_slots=costs.optimizer_slots,
            time_limit_s=time_limit_s,
            cost=costs.cost,
            schedule=schedule,
            options=options,
            recompute=costs.recompute,
        )
    except PartitionerError:
        return None
    order = [*plan.devices, *(cluster.names[k] for k in rest)]
    return score_assignment(
        plan.assignment,
        costs.on(reorder(cluster, order)),
        method=f"{plan.method} on {len(island)} of {cluster.num_devices} devices (one island of fast links)",
        status="heuristic",
        solve_time_s=plan.solve_time_s,
        recompute=plan.recompute,
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
    legal = [*starts, *legal_baselines(costs, pins)] if options.hint or options.shortest_step else []
    deadline = started + float(time_limit_s)
    found = None
    try:
        if coarsen:
            found = solve_coarsened(costs, pins, options, legal, chain=chain, started=started, deadline=deadline)
            if found is None and time.perf_counter() >= deadline:
                raise _timeout_error(costs, time_limit_s, pins)
        plan = found or _solve_fine(costs, pins, options, legal, time_limit_s=time_limit_s, started=started)
    except SolverTimeoutError:
        raise
    except InfeasiblePlanError as err:
        return _fitting_baseline(err, costs, legal or legal_baselines(costs, pins), started)
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
    """The best plan over a few candidate pipeline orders (:func:`_candidate_orders`), each solved in its
    turn with an equal share of the time left: the shortest simulated step, or with
    ``options.shortest_step`` off the least bottleneck (what is then minimised); ties go to the earlier order.

    Each order's CP-SAT bound holds for the plans of that order only: with ``shortest_step`` off, the plan
    returned is judged by :func:`_verdict_over_orders`. (The step's verdict, made after, uses a bound that
    holds in every order.)

    Raises the first order's error when no order gives a plan.
    """
    deadline = started + float(time_limit_s)
    candidates = _candidate_orders(costs, pins)
    better = shorter_step if options.shortest_step else smaller_bottleneck
    best: Plan | None = None
    bounds: list[float | None] = []  # each order's bound on its plans' bottleneck; None: unknown
    first_error: PartitionerError | None = None
    for i, (order, start) in enumerate(candidates):
        now = time.perf_counter()
        share = max((deadline - now) / (len(candidates) - i), 0.05)
        permuted = costs if order == tuple(range(len(costs.devices))) else costs.on(reorder(costs.cluster, order))
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
            bounds.append(None)
            continue
        except InfeasiblePlanError as err:  # no plan in this order fits the search's budget
            first_error = first_error or err
            continue
        bounds.append(plan.lower_bound_s)
        if best is None or better(plan, best):
            best = plan
    if best is None:
        assert first_error is not None
        raise first_error
    best = dataclasses.replace(best, solve_time_s=time.perf_counter() - started)
    # _candidate_orders lists every distinct order on up to EVERY_ORDER_UP_TO devices, and on interchangeable
    # devices (one class: every order has one signature) the one order it solves is every order
    every_order = len(costs.devices) <= EVERY_ORDER_UP_TO or len(device_classes(costs.cluster)) == 1
    judged = _verdict_over_orders(best, bounds, costs, every_order=every_order)
    if options.shortest_step:  # judged on its step after; its bound on the bottleneck, over orders, stays
        return dataclasses.replace(best, lower_bound_s=judged.lower_bound_s)
    return judged


def _verdict_over_orders(best: Plan, bounds: Sequence[float | None], costs: CostModel, *, every_order: bool) -> Plan:
    """``best``'s least bottleneck judged over every pipeline order, not only its own.

    Its ``lower_bound_s`` becomes the least of the orders' bounds where every distinct order was solved to
    a bound (an order that fits nothing bounds nothing), else ``costs.lower_bound_s()``, which holds in any
    order. It stays "optimal" only if its own order proved it and no other order's bound is below its
    bottleneck (its own bound, rounded down by CP-SAT's time unit, is what its own proof already covers).
    """
    over_orders = least_bound(bounds) if every_order else None
    if over_orders is not None:
        others = list(bounds)
        if best.lower_bound_s in others:  # best is one of the orders' plans
            others.remove(best.lower_bound_s)
        bound, beaten = over_orders, any(b is not None and best.bottleneck_s > b * (1 + TOLERANCE) for b in others)
    else:
        bound = costs.lower_bound_s()
        beaten = best.bottleneck_s > bound * (1 + TOLERANCE)
    proven = best.status == "optimal" and not beaten  # its own order proved it, and no other order beats it
    return on_bottleneck(best, bound, proven=proven, searched=best.status != "heuristic")


def _candidate_orders(costs: CostModel, pins: Mapping[str, str]) -> list[tuple[tuple[int, ...], Plan | None]]:
    """Pipeline orders for CP-SAT, each with a legal plan in that order to start from, or None.

    In this order, orders alike in every cost (order.signature) once: the cluster's own; the order (and
    devices used) of the exact chain DP on the graph read as a chain of runs of its topological order
    (the bytes crossing each cut on the edges), whose plan is the start; the devices fastest first;
    and Metis' heaviest stage on the fastest device, for the stages of the best legal baseline (where
    the devices' speeds differ). At most four of them; on up to EVERY_ORDER_UP_TO devices, every
    distinct order follows them: none of the four may fit where another does (a larger device needed
    in the middle of the pipeline, found by tests/partitioner/test_dag_step.py).
    """
    cluster = costs.cluster
    num_devices = len(costs.devices)
    orders: list[tuple[int, ...]] = [tuple(range(num_devices))]
    starts: dict[tuple[int, ...], Plan] = {}
    coarse = coarse_chain_plan(costs, pins)
    if coarse is not None:
        order = tuple(cluster.index(d) for d in coarse.devices)
        orders.append(order)
        starts[order] = coarse
    orders.append(by_speed(cluster))
    legal = legal_baselines(costs, pins)
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
    candidates = list(chosen.values())[:4]
    if num_devices <= EVERY_ORDER_UP_TO:
        listed = {signature(cluster, order) for order, _ in candidates}
        for order in itertools.permutations(range(num_devices)):
            key = signature(cluster, order)
            if key not in listed:
                listed.add(key)
                candidates.append((order, None))
    return candidates


def _shortest_step(plan: Plan, costs: CostModel, legal: Sequence[Plan], started: float) -> Plan:
    """``plan``, or the legal baseline whose simulated step is shorter, keeping ``plan``'s proven bound."""
    others = [p for p in legal if p.assignment != plan.assignment]
    best = min(others, key=lambda p: (p.step_time_s, p.bottleneck_s), default=None)
    if best is None or best.step_time_s >= plan.step_time_s * (1 - 1e-9):
        return plan
    shorter = score_assignment(
        best.assignment,
        costs,
        method=f"{best.method} (shorter step than {plan.method})",
        solve_time_s=time.perf_counter() - started,
    )
    return on_bottleneck(shorter, plan.lower_bound_s)


def _fitting_baseline(err: InfeasiblePlanError, costs: CostModel, legal: Sequence[Plan], started: float) -> Plan:
    """The legal baseline of the shortest simulated step when the search found no plan, else ``err``.

    CP-SAT budgets the device at position k of D for the most micro-batches its stage can hold (with
    1F1B, min(D - k, M): CostModel.device_in_flight) and counts memory in KiB rounded up, while a plan
    is scored for what each of its stages holds (K - s on stage s) in bytes: a split can fit where the
    search's budget rules it out (the chain DP's budget is each stage's own). The plan then has no
    bound (status "heuristic"), and its method says why it was chosen.
    """
    if not legal:
        raise err
    best = min(legal, key=lambda p: (p.step_time_s, p.bottleneck_s))
    return score_assignment(
        best.assignment,
        costs,
        method=f"{best.method} (fits; the search's memory budget, the most each device's stage can hold, fit none)",
        solve_time_s=time.perf_counter() - started,
    )


def _check_pins(pins: Mapping[str, str] | None, costs: CostModel) -> dict[str, str]:
    pins = dict(pins or {})
    unknown_nodes = sorted(v for v in pins if v not in costs.compute_s)
    if unknown_nodes:
        raise InputError(f"Pinned node(s) {unknown_nodes[:5]} are not in the layer graph.")
    # each pin in the cluster's own spelling of its device; raises ClusterError listing the devices that exist
    return {v: costs.cluster.names[costs.cluster.index(device)] for v, device in pins.items()}


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
        hint = best_start([*legal, *exact_chain_start(costs, pins)]) or fill_start(costs, pins)
        if hint is not None:
            add_hint(m, costs, hint.assignment)
    left_s = max(started + time_limit_s - time.perf_counter(), 0.01)
    status, solver = solve_model(m, left_s, options, relative_gap=options.relative_gap)
    if status == cp_model.INFEASIBLE:
        raise explain_infeasible(costs, pins, fits_with_recompute=fits_with_recompute(costs, pins))
    if status == cp_model.MODEL_INVALID:
        raise PartitionerError(f"Internal error: the CP-SAT model is invalid ({m.model.validate()}). Please report it.")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _timeout_error(costs, time_limit_s, pins)
    assignment = decode(m, solver, costs)
    bound_steps = math.floor(solver.best_objective_bound / m.weight + 1e-9)
    # the model's stage times leave out the fixed cost of a stage's forward and backward, which every stage pays
    fixed = 2 * min(costs.action_overhead_s)
    lower_bound = max(bound_steps * m.time_unit_s + fixed, costs.lower_bound_s())
    plan = score_assignment(assignment, costs, method="cp-sat", solve_time_s=time.perf_counter() - started)
    return on_bottleneck(plan, lower_bound, proven=status == cp_model.OPTIMAL)


def _timeout_error(costs: CostModel, time_limit_s: float, pins: Mapping[str, str]) -> SolverTimeoutError:
    recompute = (
        " A plan fits with recompute='auto' (stages run their forward again in the backward instead of "
        "keeping activations): plan with it."
        if fits_with_recompute(costs, pins)
        else ""
    )
    return SolverTimeoutError(
        f"CP-SAT found no feasible plan within time_limit_s={time_limit_s} for {len(costs.order)} "
        f"nodes on {len(costs.devices)} devices. Raise time_limit_s, or loosen memory so a plan is easier "
        f"to find.{recompute}"
    )
