"""Plans a chain: the front door ``exact_chain``, the search over device orders, and which chain algorithm runs.

For a chain of N layers and K devices in pipeline order, every legal plan cuts the chain into
contiguous blocks on increasing devices (some devices may stay empty). A block's compute and memory
are those of its mode (partitioner.cost.mode_cost): kept, or recomputed (forward twice, the received
tensor held per micro-batch in flight and the block's activations once), the fastest that fits and the
recompute policy allows (never the last block).

Three algorithms, one module each, on the tables of partitioner.search.bottleneck_dp:

- partitioner.search.bottleneck_dp: the least bottleneck, exactly (``objective="bottleneck"``; the
  floor the step search starts from).
- partitioner.search.threshold_search: the shortest step (``objective="step"``, the default): exact
  for GPipe, the starts of the local search for 1F1B.
- partitioner.search.local_search: 1F1B's splits improved by local moves, scored by the schedule's replay.

:func:`_shortest_step` runs the step objective's algorithms on every candidate order and simulates the
few best splits; :func:`_search_orders` runs the bottleneck DP on every candidate order and prefix.

With ``device_order="search"`` (the default) the pipeline order is a decision too: the DPs run on every
candidate order of partitioner.search.order (orders of classes of interchangeable devices). One table covers
every subset of an order's devices (a block may skip devices). Under the bottleneck objective each
prefix's plan (least bottleneck, then fewest bytes) is simulated, and the shortest step wins (then the
least bottleneck, then the fewest bytes, then the first candidate): ties go the same way every run.
"""

from __future__ import annotations

import dataclasses
import time

import networkx as nx
import numpy as np

from partitioner.cluster import Cluster, reorder
from partitioner.cost import CostModel
from partitioner.errors import InputError
from partitioner.graph import colocation_groups, is_chain
from partitioner.infeasibility import explain_infeasible
from partitioner.plan import Plan
from partitioner.schedule import schedule_family
from partitioner.score import score_assignment, shorter_step, with_step_bound
from partitioner.search.baselines import BASELINES, check_stage_count, split_with
from partitioner.search.bottleneck_dp import _dynamic_program, _prefix_tables, _rebuild, _solve_chain, _Tables, _tables
from partitioner.search.exhaustive import against_every_plan
from partitioner.search.local_search import _local_search
from partitioner.search.order import (
    candidate_orders,
    check_device_order,
    every_order_searched,
    fastest_on_heaviest,
    signature,
)
from partitioner.search.threshold_search import (
    STEP_TOLERANCE,
    _bottleneck_splits,
    _closed_form_search,
    _Found,
    _least_bottlenecks,
    _threshold_search,
)
from partitioner.verdict import on_bottleneck

OBJECTIVES = ("step", "bottleneck")
FINALISTS = 4  # splits simulated (and for GPipe improved when the formula falls short), shortest steps first
LOCAL_STARTS = 12  # 1F1B: splits of each order the local search starts from, shortest steps first
# 1F1B overlaps fill and drain with the steady state more than GPipe does: its threshold searches
# weigh the sum of stage times (fill and drain) against the period (steady state) these ways.
ONE_F_ONE_B_WEIGHTS = (1.0, 0.5, 0.0)
# GPipe's threshold search is exact when one stage holds both the longest forward and backward; the local
# search (on the exact formula) covers the other case on chains up to this long.
LOCAL_MAX_NODES = 64


def exact_chain(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    num_microbatches: int = 1,
    optimizer_slots: int = 2,
    cost: str = "flops",
    schedule: str = "gpipe",
    recompute: str = "never",
    device_order: str = "search",
    objective: str = "step",
) -> Plan:
    """Returns the plan of a chain graph with the shortest step (or the least bottleneck).

    With ``objective="step"`` (the default) the plan has the shortest simulated step over every split,
    stage count and (with "search") device order (each device at its own speed: on devices that share a
    processor the step searched is a bound from below on the simulated one)
    (partitioner.search.threshold_search): status
    "optimal" when that is proven (GPipe, every order searched, or a step that meets
    ``CostModel.step_lower_bound_s``), else "feasible"; ``step_lower_bound_s`` is the proven bound on the
    step and ``gap`` is against it. ``lower_bound_s`` stays a bound on the bottleneck.
    ``objective="bottleneck"`` is the DP of the least bottleneck (``gap`` against ``lower_bound_s``):

    With ``device_order="given"`` the stages follow the cluster's order (devices may stay idle) and
    the plan has the least bottleneck, then the fewest bytes sent. With "search" (the default) the
    order and the devices used are chosen too (module docstring, last paragraph): the plan has the shortest simulated
    step among the least-bottleneck plans of every candidate order and every prefix of it, and
    ``Plan.devices`` is the order chosen. Its ``lower_bound_s`` is the least bottleneck of any order
    when the search covers every order of the device classes (status "optimal" when the plan reaches
    it), else the cost model's bound.

    Memory is budgeted per stage as the plan is scored (partitioner.search.bottleneck_dp, "Memory"):
    ``schedule`` "gpipe" holds M micro-batches on every stage but the last (1 there), "1f1b" min(K - s, M)
    on stage s of K.
    ``recompute`` ("never", "always", "auto") chooses each block's mode: "always" recomputes every
    block but the last, "auto" the fastest mode that fits (kept where it fits).

    Raises:
        InputError: when the graph is not a single chain or has colocation groups, or for an unknown
            ``device_order`` or ``objective``.
        InfeasiblePlanError: when no split fits in memory.

    Example:
        >>> plan = exact_chain(pt.chain_graph([1e9] * 8), pt.Cluster.uniform(4, memory="1GiB"))  # doctest: +SKIP
    """
    costs = CostModel(
        graph,
        cluster,
        num_microbatches=num_microbatches,
        optimizer_slots=optimizer_slots,
        cost=cost,
        schedule=schedule,
        recompute=recompute,
    )
    return exact_chain_for(costs, device_order=device_order, objective=objective)


def exact_chain_for(costs: CostModel, *, device_order: str = "search", objective: str = "step") -> Plan:
    """:func:`exact_chain` for the graph, cluster and settings (M, optimizer slots, cost source,
    schedule, recompute) of ``costs``: the entry for planners that hold a CostModel already.

    Raises:
        InputError, InfeasiblePlanError: as :func:`exact_chain`.

    Example:
        >>> import partitioner as pt
        >>> cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12)
        >>> costs = pt.CostModel(pt.chain_graph([1e12] * 4), cluster, num_microbatches=4)
        >>> plan = exact_chain_for(costs)
        >>> plan.num_stages, plan.step_time_s, plan.status
        (2, 10.0, 'optimal')
    """
    started = time.perf_counter()
    check_device_order(device_order)
    if objective not in OBJECTIVES:
        raise InputError(
            f"objective must be one of {OBJECTIVES} ('step': the shortest simulated step; 'bottleneck': the "
            f"least time of the slowest stage). Received: {objective!r}."
        )
    graph = costs.graph
    if not is_chain(graph):
        raise InputError(
            "exact_chain needs a chain (every layer feeds only the next one); this graph branches. "
            "Use partitioner.solve, which handles any DAG."
        )
    if colocation_groups(graph):
        raise InputError("exact_chain does not handle shared layers (colocation groups); use partitioner.solve.")
    check_stage_count(costs)
    if objective == "step":
        plan = _shortest_step(costs, device_order, started)
    elif device_order == "search":
        plan = _search_orders(costs, started)
    else:
        found = _solve_chain(costs)
        if found is None:
            raise explain_infeasible(costs, fits_with_recompute=_fits_with_recompute(costs))
        assignment, optimum = found
        plan = score_assignment(assignment, costs, method="exact_chain", solve_time_s=time.perf_counter() - started)
        # the DP's least bottleneck in the cluster's order, over every split that fits: proven, so not judged
        # again (solve's starts and coarsening call this once per candidate order)
        return on_bottleneck(plan, optimum, proven=True)
    # 1F1B's step search is not exact (local moves): on a small chain the best of every legal plan decides;
    # MAX_PLANS bounds that work, so no deadline
    return against_every_plan(plan, costs, {}, device_order, started=started, deadline=float("inf"))


def _search_orders(costs: CostModel, started: float) -> Plan:
    """The plan of the shortest simulated step over the candidate orders of ``costs.cluster`` and their prefixes."""
    cluster = costs.cluster
    best: Plan | None = None
    bound = np.inf
    for order in _orders(costs):
        identity = list(order) == list(range(cluster.num_devices))
        permuted = costs if identity else costs.on(reorder(cluster, order))
        best, order_bound = _prefix_plans(permuted, best)
        bound = min(bound, order_bound)
    if best is None:
        raise explain_infeasible(costs, fits_with_recompute=_fits_with_recompute(costs))
    # the least bottleneck of every order where every order was searched, else a bound in any order
    lower_bound = float(bound) if every_order_searched(cluster) else costs.lower_bound_s()
    return on_bottleneck(dataclasses.replace(best, solve_time_s=time.perf_counter() - started), lower_bound)


def _orders(costs: CostModel) -> list[tuple[int, ...]]:
    """The pipeline orders searched: ``candidate_orders``, and Metis' order when it is not among them."""
    cluster = costs.cluster
    orders = list(candidate_orders(cluster))
    metis = _metis_order(costs)
    if metis is not None and signature(cluster, metis) not in {signature(cluster, o) for o in orders}:
        orders.append(metis)
    return orders


def _metis_order(costs: CostModel) -> tuple[int, ...] | None:
    """Metis' order (partitioner.search.order.fastest_on_heaviest) for the stages of the baseline split of the
    shortest step that fits, where device speeds differ and the candidate orders do not cover every
    arrangement: it interleaves device kinds, which the contiguous runs of ``candidate_orders`` do not.
    None otherwise."""
    cluster = costs.cluster
    if every_order_searched(cluster) or len({d.flops_per_s for d in cluster.devices}) < 2:
        return None
    legal = [p for p in (split_with(costs, name) for name in BASELINES) if p.fits_memory]
    if not legal:
        return None
    base = min(legal, key=lambda p: (p.step_time_s, p.bottleneck_s))
    work = [sum(float(costs.graph.nodes[v]["flops"]) for v in base.nodes_on(d)) for d in base.stages]
    return fastest_on_heaviest(cluster, work)


def _prefix_plans(costs: CostModel, best: Plan | None) -> tuple[Plan | None, float]:
    """``best``, or the least-bottleneck plan (fewest bytes among ties) on a prefix of ``costs.cluster``'s
    order whose simulated step is shorter, scored on the whole order; and the least bottleneck of any prefix.

    One table serves every prefix: table[k, n] is the best split ending on device k (each stage budgeted
    for its own micro-batches in flight), so the least over k < s is the best on the first s devices.
    Prefixes go longest first, and one is skipped when no
    plan on it can step faster than ``best``: a step lasts at least M times the busiest stage's compute
    (at least the average, W / s, with W the work on the fastest device of the prefix for each node) and,
    under GPipe, (M - 1) times it plus every stage's compute (a micro-batch passes every stage there and back).
    """
    num_devices, n = len(costs.devices), len(costs.order)
    m = costs.num_microbatches
    kept = np.array([costs.compute_s[v] for v in costs.order]).reshape(n, num_devices)
    least_work = np.minimum.accumulate(kept, axis=1).sum(axis=0)  # [s - 1]: W on the first s devices
    least = np.inf
    tables = _tables(costs)
    table, _ = _dynamic_program(tables)
    for s in range(num_devices, 0, -1):
        bottleneck = float(table[:s, n].min())
        least = min(least, bottleneck)
        if not np.isfinite(bottleneck):
            continue
        work = float(least_work[s - 1])
        floor = schedule_family(costs.schedule).least_step(work, s, m)
        if best is not None and floor >= best.step_time_s:
            continue
        assignment = _rebuild(costs, _prefix_tables(tables, s), bottleneck)
        plan = score_assignment(assignment, costs, method="exact_chain", status="feasible")
        if best is None or shorter_step(plan, best):
            best = plan
    return best, float(least)


def _fits_with_recompute(costs: CostModel) -> bool:
    """True iff some split fits when stages may recompute ("auto"), for a problem that fits no split without."""
    if costs.recompute != "never":
        return False
    tables = _tables(costs.with_recompute("auto"))
    least, _ = _least_bottlenecks(tables, [len(tables.capacity)])[0]
    return bool(np.isfinite(least))


def _shortest_step(costs: CostModel, device_order: str, started: float) -> Plan:
    """The plan of the shortest simulated step over the candidate orders (the cluster's own with
    "given"), every subset of devices in each, and every split (module docstring)."""
    cluster = costs.cluster
    orders = _orders(costs) if device_order == "search" else [tuple(range(cluster.num_devices))]
    scored: list[CostModel] = []
    found: list[_Found] = []
    searched: list[tuple[int, _Tables]] = []  # (order, tables) of each search: _Found.order indexes it
    # a schedule with a closed form of the step (GPipe) is searched exactly on its least bound, once; another
    # (1F1B) with several weights of its period, from every prefix of the devices, then improved by local moves
    closed_form = schedule_family(costs.schedule).closed_form
    weights = () if closed_form else ONE_F_ONE_B_WEIGHTS
    best = dict.fromkeys(weights, np.inf)
    step_bound, least, complete = np.inf, np.inf, True
    for index, order in enumerate(orders):
        identity = list(order) == list(range(cluster.num_devices))
        permuted = costs if identity else costs.on(reorder(cluster, order))
        scored.append(permuted)
        tables = _tables(permuted)
        num_devices = len(tables.capacity)
        # the least bottleneck on these devices (every prefix of them for 1F1B's starts) and its split
        sizes = [num_devices] if closed_form else range(1, num_devices + 1)
        bottlenecks = _least_bottlenecks(tables, sizes)
        least_here = bottlenecks[-1][0]
        least = min(least, least_here)
        # no split's stage times sum to less than every node kept (modes[0]) on its fastest device
        least_sum = float(np.diff(tables.modes[0].prefix, axis=0).min(axis=1).sum())
        searched.append((index, tables))
        splits: list[_Found] = []
        if closed_form:  # GPipe: the least bound of the step, exactly; the least-bottleneck split first among equals
            shortest = min([np.inf, *(f.step for f in found)])
            splits = _bottleneck_splits(tables, bottlenecks, len(searched) - 1, costs)
            searched_splits, bound, done = _closed_form_search(
                tables, costs.schedule, costs.num_microbatches, len(searched) - 1, shortest, least_here
            )
            splits += searched_splits
            step_bound, complete = min(step_bound, bound), complete and done
        for weight in weights:
            found_here, bound, done = _threshold_search(
                tables,
                costs.schedule,
                costs.num_microbatches,
                len(searched) - 1,
                best[weight],
                weight,
                least_here,
                least_sum,
            )
            splits += found_here
            best[weight] = min([best[weight], *(f.objective for f in found_here)])
            if weight == 1.0:
                step_bound, complete = min(step_bound, bound), complete and done
        if not closed_form:  # 1F1B: improve the best splits found and the least-bottleneck ones
            starts = {
                f.blocks: f for f in [*splits, *_bottleneck_splits(tables, bottlenecks, len(searched) - 1, costs)]
            }
            ranked = sorted(starts.values(), key=lambda f: f.step)[:LOCAL_STARTS]
            splits += _local_search(tables, costs.schedule, costs.num_microbatches, ranked)
        found += splits
    if not found:
        raise explain_infeasible(costs, fits_with_recompute=_fits_with_recompute(costs))
    least_step = min(f.step for f in found)
    if closed_form and least_step > step_bound * (1 + STEP_TOLERANCE) and len(costs.order) <= LOCAL_MAX_NODES:
        # the search's objective fell short of the formula (stages of different forward shares): improve the
        # best splits of each search
        for group, (_, tables) in enumerate(searched):
            ranked = sorted((f for f in found if f.order == group), key=lambda f: f.step)[:FINALISTS]
            found += _local_search(tables, costs.schedule, costs.num_microbatches, ranked)
    plan: Plan | None = None
    seen: set[tuple[object, ...]] = set()
    for candidate in sorted(found, key=lambda f: (f.step, f.objective, f.order)):
        key = (searched[candidate.order][0], candidate.blocks)
        if key in seen:
            continue
        seen.add(key)
        permuted = scored[searched[candidate.order][0]]
        assignment = {v: permuted.devices[k] for k, start, end in candidate.blocks for v in permuted.order[start:end]}
        simulated = score_assignment(assignment, permuted, method="exact_chain", status="feasible")
        if plan is None or shorter_step(simulated, plan):
            plan = simulated
        if len(seen) == FINALISTS:
            break
    assert plan is not None  # found is not empty
    proven = complete and closed_form and (device_order == "given" or every_order_searched(cluster))
    optimal = proven and plan.step_time_s <= step_bound * (1 + STEP_TOLERANCE) + 1e-15
    lower_bound = float(least) if device_order == "given" or every_order_searched(cluster) else costs.lower_bound_s()
    plan = dataclasses.replace(
        plan, lower_bound_s=min(lower_bound, plan.bottleneck_s), solve_time_s=time.perf_counter() - started
    )
    # judged on the step: the search's own bound where it is proven, the cost model's on any plan always
    return with_step_bound(plan, costs, proven_s=float(step_bound) if proven else None, proven_optimal=optimal)
