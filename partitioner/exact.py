"""Dynamic programs for chains: the plan of the shortest step, and of the least bottleneck.

For a chain of N layers and K devices in pipeline order, every legal plan cuts the chain into
contiguous blocks on increasing devices (some devices may stay empty). A block's compute and memory
are those of its mode (partitioner.cost.mode_cost): kept, or recomputed (forward twice, the received
tensor held per micro-batch in flight and the block's activations once), the fastest that fits and the
recompute policy allows (never the last block).

The step objective (the default, docs/cost-model.md "The objective: the step"). Users pay the simulated
step. For GPipe it has a closed form over the stages' forward f, backward b, received activation a and
returned gradient g (:func:`_split_step`, equal to the simulator's step)::

    step = sum_s (f + b + a + g)_s + (M - 1) * (max_s max(f_s, a_s) + max_s max(b_s, g_s))

With ``period(s) = max(f, a) + max(b, g)``, :func:`_step_program` finds, for a threshold T, the least
sum of stage times over splits whose every period is at most T (a min-sum DP), and
:func:`_threshold_search` bisects on T to minimise ``sum + (M - 1) * max period`` (the GPipe step when
one stage holds both maxima, below it otherwise), dropping intervals of T whose bound cannot win. The
splits met are ranked by the exact formula, the best few simulated. The DPs are banded
(:func:`_banded_program`): a block's compute and memory bound how far it reaches, and a block on device
k must end where the devices after k can still cover the rest (:func:`_viable_ends`), so near the least
period, where the search spends its DPs, each device's cuts lie in a narrow window: O(K^2 window^2)
work instead of O(K^2 N^2). The search starts from the least bottleneck, found the same way
(:func:`_least_bottleneck`: banded min-max DPs at limits growing from a floor; the whole table of the
bottleneck DP below on small chains).

1F1B has no closed form (a stage's warm-up forwards and its first backward wait on different stages).
Its step is still exact for a given split: :func:`_split_step` replays the schedule on the stages'
(f, b, a, g) (partitioner.simulate.chain_step), the simulator's step without its spans. The search is
not exact: the threshold searches (weighing sum and period as ONE_F_ONE_B_WEIGHTS say) and the
least-bottleneck split of every prefix of devices give starts, and a local search
(:func:`_local_search`: boundaries moved, stages split, merged or moved to an idle device) improves the
LOCAL_STARTS shortest, scored by the replay (the searches side by side, each round's neighbours of all
of them replayed together, each split once). On the 200 1F1B cases of benchmarks/planner_quality
("Random chains against brute force") every plan is within 0.1% of the best enumerated; hypothesis
found one 0.33% off (tests/partitioner/test_exact_step.py).

The bottleneck objective (``objective="bottleneck"``), with ``f[k][j]`` the best bottleneck that puts
layers ``[0, j)`` on devices up to ``k`` with layer ``j - 1`` on ``k``::

    f[k'][j] = min over k < k', i < j of  max(f[k][i], compute(k', i, j) + bytes(i - 1) / bw(k, k'))
               subject to memory(i, j) <= capacity(k')

O(K^2 N^2) work per mode, vectorised over j. This is the chain case of the dynamic programs of
PipeDream (Narayanan et al., SOSP 2019) and of Tarnawski et al., "Efficient algorithms for device
placement of DNN graph operators" (NeurIPS 2020), with our cost model (docs/cost-model.md).

Memory: each block is budgeted for the micro-batches its stage holds, in_flight(K - s) (M for GPipe,
min(K - s, M) for 1F1B on stage s of K), the figure :meth:`CostModel.evaluate` charges. K - s is the
number of stages from s to the end of the pipeline, so every DP carries it as a *level*: the table of
level r holds splits whose last block has r stages from it to the end (itself included), and a block
of level r follows one of level r + 1 (:func:`_by_level`). Levels that budget alike are one: the top
level R stands for every r >= R and follows itself (GPipe: the single level 1, R = 1; 1F1B: R =
min(number of devices, M)). The answer is level 1's (the last stage) at the chain's end. A block of
level r leaves r - 1 stages for later devices, so only the first D - r + 1 devices take it: about
K^3 N^2 / 6 block figures for 1F1B with M >= K, three times one table of every device (K^2 N^2 / 2,
GPipe's). Where the whole chain fits the smallest device at the top level's budget, memory cannot bind
and the top level alone serves every stage (:func:`_memory_binds`). The banded programs go level by
level too; their viable ends (:func:`_viable_ends`) budget every block as the last stage (level 1, the
most room), so they drop no split that fits, whatever its blocks' levels.

With ``device_order="search"`` (the default) the pipeline order is a decision too: the DPs run on every
candidate order of partitioner.order (orders of classes of interchangeable devices). One table covers
every subset of an order's devices (a block may skip devices). Under the bottleneck objective each
prefix's plan (least bottleneck, then fewest bytes) is simulated, and the shortest step wins (then the
least bottleneck, then the fewest bytes, then the first candidate): ties go the same way every run.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import networkx as nx
import numpy as np

from partitioner.baselines import BASELINES, check_stage_count, split_with
from partitioner.cluster import Cluster, reorder
from partitioner.cost import CostModel, in_flight, mode_cost
from partitioner.errors import InputError
from partitioner.graph import colocation_groups, is_chain
from partitioner.infeasibility import explain_infeasible
from partitioner.order import candidate_orders, check_device_order, every_order_searched, fastest_on_heaviest, signature
from partitioner.plan import Plan
from partitioner.score import score_assignment, shorter_step, with_step_bound
from partitioner.simulate import chain_step

OBJECTIVES = ("step", "bottleneck")
STEP_TOLERANCE = 1e-4  # relative: the threshold search stops once no split can beat its best by more
MAX_PROGRAMS = 64  # step DPs per device order at most
PROGRAM_WORK = 1.3e8  # ... and block figures (cells of _step_program over its levels, times modes) per order
# the least bottleneck of the step search: the whole table (_dynamic_program) up to this many cells of one
# level (K^2 N^2 / 2), where a banded program's fixed cost per device pair is the larger (about 400 nodes on 2
# devices, 170 on 4, 90 on 8); banded programs (_least_bottleneck) above
FULL_TABLE_CELLS = 1e6
FINALISTS = 4  # splits simulated (and for GPipe improved when the formula falls short), shortest steps first
LOCAL_STARTS = 12  # 1F1B: splits of each order the local search starts from, shortest steps first
# 1F1B overlaps fill and drain with the steady state more than GPipe does: its threshold searches
# weigh the sum of stage times (fill and drain) against the period (steady state) these ways.
ONE_F_ONE_B_WEIGHTS = (1.0, 0.5, 0.0)
LOCAL_ROUNDS = 32  # moves at most from each start
LOCAL_WINDOW = 16  # nodes a boundary moves at most, and cut points tried per stage split
# GPipe's threshold search is exact when one stage holds both the longest forward and backward; the local
# search (on the exact formula) covers the other case on chains up to this long.
LOCAL_MAX_NODES = 64


class _Mode(NamedTuple):
    """One mode's figures along the chain (partitioner.cost.mode_cost), as the DP reads them."""

    prefix: np.ndarray  # [i, k]: seconds of nodes [0, i) on device k in this mode
    forward: np.ndarray  # [i, k]: seconds of the forward passes of nodes [0, i) on device k in this mode
    backward: np.ndarray  # [i, k]: seconds of their backward passes (prefix = forward + backward)
    mem_prefix: np.ndarray  # [i]: bytes budgeted for nodes [0, i) in this mode
    boundary: np.ndarray  # [i]: bytes a stage in this mode budgets for receiving node i's output
    allowed: np.ndarray  # [j]: whether a stage ending just before node j may take this mode
    # [k]: the fixed seconds a stage's forward and backward pay on device k (action_overhead_s, per mode_cost)
    fixed_forward: np.ndarray
    fixed_backward: np.ndarray


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
    stage count and (with "search") device order (module docstring, "The step objective"): status
    "optimal" when that is proven (GPipe, every order searched, or a step that meets
    ``CostModel.step_lower_bound_s``), else "feasible"; ``step_lower_bound_s`` is the proven bound on the
    step and ``gap`` is against it. ``lower_bound_s`` stays a bound on the bottleneck.
    ``objective="bottleneck"`` is the DP of the least bottleneck (``gap`` against ``lower_bound_s``):

    With ``device_order="given"`` the stages follow the cluster's order (devices may stay idle) and
    the plan has the least bottleneck, then the fewest bytes sent. With "search" (the default) the
    order and the devices used are chosen too (module docstring): the plan has the shortest simulated
    step among the least-bottleneck plans of every candidate order and every prefix of it, and
    ``Plan.devices`` is the order chosen. Its ``lower_bound_s`` is the least bottleneck of any order
    when the search covers every order of the device classes (status "optimal" when the plan reaches
    it), else the cost model's bound.

    Memory is budgeted per stage as the plan is scored (module docstring): ``schedule`` "gpipe" holds M
    micro-batches on every stage, "1f1b" min(K - s, M) on stage s of K.
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
        return _shortest_step(costs, device_order, started)
    if device_order == "search":
        return _search_orders(costs, started)
    found = _solve_chain(costs)
    if found is None:
        raise explain_infeasible(costs, fits_with_recompute=_fits_with_recompute(costs))
    assignment, optimum = found
    return score_assignment(
        assignment,
        costs,
        method="exact_chain",
        status="optimal",
        lower_bound_s=optimum,
        solve_time_s=time.perf_counter() - started,
    )


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
    proven = every_order_searched(cluster)
    lower_bound = float(bound) if proven else costs.lower_bound_s()
    return dataclasses.replace(
        best,
        status="optimal" if proven and best.bottleneck_s <= lower_bound * (1 + 1e-9) else "feasible",
        lower_bound_s=min(lower_bound, best.bottleneck_s),
        solve_time_s=time.perf_counter() - started,
    )


def _orders(costs: CostModel) -> list[tuple[int, ...]]:
    """The pipeline orders searched: ``candidate_orders``, and Metis' order when it is not among them."""
    cluster = costs.cluster
    orders = list(candidate_orders(cluster))
    metis = _metis_order(costs)
    if metis is not None and signature(cluster, metis) not in {signature(cluster, o) for o in orders}:
        orders.append(metis)
    return orders


def _metis_order(costs: CostModel) -> tuple[int, ...] | None:
    """Metis' order (partitioner.order.fastest_on_heaviest) for the stages of the baseline split of the
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
        floor = max(m * work / s, work) if costs.schedule != "gpipe" else (m - 1) * work / s + work
        if best is not None and floor >= best.step_time_s:
            continue
        assignment = _rebuild(costs, _prefix_tables(tables, s), bottleneck)
        plan = score_assignment(assignment, costs, method="exact_chain", status="feasible")
        if best is None or shorter_step(plan, best):
            best = plan
    return best, float(least)


Blocks = tuple[tuple[int, int, int], ...]  # (device index in the order, first node, end node) per stage


class _Tables(NamedTuple):
    """What the DP reads: the modes' figures along the chain, and each device's memory and links."""

    modes: list[_Mode]  # budgeted for one level's micro-batches in flight (levels[-1] unless _level chose)
    capacity: list[int]
    out_bytes: np.ndarray
    bandwidth: list[list[float]]
    # [r - 1]: the modes budgeted for a stage r stages from the pipeline's end (itself included), r = 1..R;
    # the last also for every r > R (module docstring, "Memory")
    levels: tuple[list[_Mode], ...]


def _level(tables: _Tables, r: int) -> _Tables:
    """``tables`` budgeted for a stage r stages from the end of the pipeline (itself included)."""
    return tables._replace(modes=tables.levels[min(r, len(tables.levels)) - 1])


def _prefix_tables(tables: _Tables, num_devices: int) -> _Tables:
    """``tables`` for the first ``num_devices`` devices only."""
    s = num_devices

    def cut(modes: list[_Mode]) -> list[_Mode]:
        return [
            m._replace(
                prefix=m.prefix[:, :s],
                forward=m.forward[:, :s],
                backward=m.backward[:, :s],
                fixed_forward=m.fixed_forward[:s],
                fixed_backward=m.fixed_backward[:s],
            )
            for m in modes
        ]

    return _Tables(
        cut(tables.modes),
        tables.capacity[:s],
        tables.out_bytes,
        [row[:s] for row in tables.bandwidth[:s]],
        tuple(cut(modes) for modes in tables.levels),
    )


def _rebuild(costs: CostModel, tables: _Tables, optimum: float) -> dict[str, str]:
    """The split with the fewest bytes sent among those whose every stage takes at most ``optimum``."""
    return {
        v: costs.devices[k] for k, start, end in _least_bytes_split(tables, optimum) for v in costs.order[start:end]
    }


def _least_bytes_split(tables: _Tables, optimum: float) -> Blocks:
    """The blocks of :func:`_rebuild`'s split."""
    n = tables.modes[0].prefix.shape[0] - 1
    sent, parent = _dynamic_program(tables, limit=optimum * (1 + 1e-9))
    return _blocks(parent, int(np.argmin(sent[:, n])), n)


def _blocks(parent: np.ndarray, last: int, n: int) -> Blocks:
    """The split a DP's ``parent`` table ([level - 1, k, j], :func:`_by_level`) gives for nodes [0, n)
    ending on device ``last`` (the last stage: level 1)."""
    blocks, k, j, level = [], last, n, 0
    while j > 0:
        k_prev, i = (int(x) for x in parent[level, k, j])
        blocks.append((k, i, j))
        k, j, level = k_prev, i, min(level + 1, len(parent) - 1)
    return tuple(reversed(blocks))


def _by_level(
    tables: _Tables, program: Callable[[_Tables, np.ndarray | None, int], tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Runs a DP level by level (module docstring, "Memory"): table[k, j] of level 1 (the last stage ends
    on device k at node j), and the parents of every level, [level - 1, k, j].

    ``program(level_tables, source, num_devices)`` fills one level's table from ``source``, the table
    of the level after it (None: its own, for the top level, which stands for every level above it),
    for blocks on the first ``num_devices`` devices only (D - r + 1 at level r: r - 1 stages follow).
    """
    num_devices = len(tables.capacity)
    source, parents = None, []
    for r in range(len(tables.levels), 0, -1):
        table, parent = program(_level(tables, r), source, num_devices - r + 1)
        source = table
        parents.append(parent)
    assert source is not None  # there is at least one level
    return source, np.stack(parents[::-1])


def _solve_chain(costs: CostModel) -> tuple[dict[str, str], float] | None:
    """The least-bottleneck split of ``costs.graph`` (a chain), fewest bytes among ties; None if none fits."""
    tables = _tables(costs)
    best, _ = _dynamic_program(tables)
    optimum = float(best[:, len(costs.order)].min())
    if not np.isfinite(optimum):
        return None
    return _rebuild(costs, tables, optimum), optimum


def _in_flight_levels(costs: CostModel) -> list[int]:
    """[r - 1]: the micro-batches a stage r stages from the end of its pipeline (itself included) holds,
    for r = 1..R, with R the least level from which every stage holds as many (module docstring, "Memory").

    ``in_flight(schedule, K, M, s)`` depends on K - s alone (M for GPipe, min(K - s, M) for 1F1B), so a
    stage r from the end of any pipeline holds in_flight(schedule, r, M, 0).

    Example:
        >>> import partitioner as pt
        >>> graph, cluster = pt.chain_graph([1e9] * 6), pt.Cluster.uniform(4, memory="1GiB")
        >>> _in_flight_levels(pt.CostModel(graph, cluster, num_microbatches=3, schedule="1f1b"))
        [1, 2, 3]
        >>> _in_flight_levels(pt.CostModel(graph, cluster, num_microbatches=3, schedule="gpipe"))
        [3]
    """
    m = costs.num_microbatches
    held = [in_flight(costs.schedule, r, m, 0) for r in range(1, len(costs.devices) + 1)]
    while len(held) > 1 and held[-2] == held[-1]:
        held.pop()
    return held


def _memory_binds(costs: CostModel, num_in_flight: int) -> bool:
    """False when the whole chain, in every mode with ``num_in_flight`` micro-batches and its largest
    received tensor, fits the smallest device: then every block fits wherever it goes, at this budget
    and every smaller one, and one level serves every stage."""
    smallest = min(d.memory_bytes for d in costs.cluster.devices)
    for mode in costs.modes:
        whole = sum(costs.node_memory_bytes(mode, num_in_flight).values())
        received = max(costs.input_memory_bytes(mode, num_in_flight).values(), default=0)
        if whole + received > smallest:
            return True
    return False


def _tables(costs: CostModel) -> _Tables:
    """The DP's inputs for ``costs`` (a chain), each level budgeted for its micro-batches in flight."""
    held = _in_flight_levels(costs)
    if len(held) > 1 and not _memory_binds(costs, held[-1]):
        held = held[-1:]  # the top level alone: its tables are every level's
    levels = tuple(_modes(costs, c) for c in held)
    k_total = len(costs.devices)
    capacity = [d.memory_bytes for d in costs.cluster.devices]
    out_bytes = np.array([costs.out_bytes[v] for v in costs.order], dtype=np.float64)
    bandwidth = [[costs.cluster.bandwidth(k, k2) for k2 in range(k_total)] for k in range(k_total)]
    return _Tables(levels[-1], capacity, out_bytes, bandwidth, levels)


def _modes(costs: CostModel, num_in_flight: int) -> list[_Mode]:
    """The figures of ``costs.modes`` along the chain, memory budgeted for ``num_in_flight`` micro-batches."""
    order = costs.order
    n, k_total = len(order), len(costs.devices)
    last = np.arange(n + 1) == n  # a block ending at n is the last stage: never recomputed
    modes = []
    for mode in costs.modes:
        compute = np.array([costs.mode_compute_s[mode][v] for v in order])  # [node, device]
        node = [[costs.node_cost(v, mode, k) for k in range(k_total)] for v in order]
        forward = np.array([[c.forward_s for c in row] for row in node]).reshape(n, k_total)
        backward = np.array([[c.backward_s for c in row] for row in node]).reshape(n, k_total)
        memory = costs.node_memory_bytes(mode, num_in_flight)
        received = costs.input_memory_bytes(mode, num_in_flight)
        overhead = np.array(costs.action_overhead_s, dtype=np.float64)
        fixed = mode_cost(mode, forward_s=1.0, backward_s=1.0)  # how often each pass pays it in this mode
        modes.append(
            _Mode(
                prefix=np.vstack([np.zeros(k_total), np.cumsum(compute, axis=0)]),
                forward=np.vstack([np.zeros(k_total), np.cumsum(forward, axis=0)]),
                backward=np.vstack([np.zeros(k_total), np.cumsum(backward, axis=0)]),
                mem_prefix=np.concatenate([[0], np.cumsum([memory[v] for v in order])]).astype(np.float64),
                boundary=np.array([received[v] for v in order], dtype=np.float64),
                allowed=~last if mode == "recomputed" else (last if costs.recompute == "always" else ~last | last),
                fixed_forward=fixed.forward_s * overhead,
                fixed_backward=fixed.backward_s * overhead,
            )
        )
    return modes


def _fits_with_recompute(costs: CostModel) -> bool:
    """True iff some split fits when stages may recompute ("auto"), for a problem that fits no split without."""
    if costs.recompute != "never":
        return False
    tables = _tables(costs.with_recompute("auto"))
    least, _ = _least_bottlenecks(tables, [len(tables.capacity)])[0]
    return bool(np.isfinite(least))


def _dynamic_program(tables: _Tables, limit: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fills table[k, j] over layers [0, j) with layer j - 1 on device k, the last stage, and the parents
    to rebuild it (:func:`_by_level`: each stage budgeted for its own micro-batches in flight).

    A block takes the fastest of ``modes`` that fits and is allowed for it. Without ``limit`` the table
    holds the least bottleneck (min-max); with it, the fewest bytes sent (min-sum) over splits whose
    every stage takes at most ``limit`` seconds.
    """
    return _by_level(tables, lambda level, source, usable: _level_program(level, source, usable, limit))


def _level_program(
    tables: _Tables, source: np.ndarray | None, usable: int, limit: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """One level of :func:`_dynamic_program`: blocks on the first ``usable`` devices after a split of
    ``source`` (the next level's table; None: this level's own)."""
    modes, capacity, out_bytes, bandwidth = tables.modes, tables.capacity, tables.out_bytes, tables.bandwidth
    num_devices, n = modes[0].prefix.shape[1], modes[0].prefix.shape[0] - 1
    table = np.full((num_devices, n + 1), np.inf)
    parent = np.full((num_devices, n + 1, 2), -1, dtype=np.int64)  # (previous device, block start)
    source = table if source is None else source
    for k2 in range(usable):
        first = np.full(n + 1, np.inf)  # the first block starts the chain on k2: nothing received
        for mode in modes:
            fits = (mode.mem_prefix <= capacity[k2]) & mode.allowed
            fixed = mode.fixed_forward[k2] + mode.fixed_backward[k2]
            first = np.minimum(first, np.where(fits, mode.prefix[:, k2] + fixed, np.inf))
        if limit is not None:
            first = np.where(first <= limit, 0.0, np.inf)
        first[0] = np.inf
        better = first < table[k2]
        table[k2][better] = first[better]
        parent[k2][better] = (-1, 0)
        for k in range(k2):
            receive = out_bytes / bandwidth[k][k2] + out_bytes / bandwidth[k2][k]  # as CostModel.receive_s
            byte_limit = None if limit is None else (out_bytes, limit)
            _relax(table, parent, source, k, k2, modes, capacity[k2], receive, byte_limit)
    return table, parent


def _relax(
    best: np.ndarray,
    parent: np.ndarray,
    source: np.ndarray,
    k: int,
    k2: int,
    modes: list[_Mode],
    capacity: int,
    receive: np.ndarray,
    byte_limit: tuple[np.ndarray, float] | None = None,
) -> None:
    """Improves best[k2, j] with blocks [i, j) on k2 after a block ending at i - 1 on k, of ``source`` (in place).

    Without ``byte_limit`` ``best`` holds bottlenecks (min-max). With ``byte_limit=(out_bytes, T)``
    it holds bytes sent (min-sum) over splits whose every stage takes at most T seconds.
    """
    n = modes[0].prefix.shape[0] - 1
    starts = np.flatnonzero(np.isfinite(source[k, 1:n])) + 1  # i in [1, n) with a finite source[k, i]
    ends = np.arange(n + 1)
    chunk = max(1, 2_000_000 // ((n + 1) * len(modes)))
    for lo in range(0, len(starts), chunk):
        i = starts[lo : lo + chunk][:, None]
        after = ends[None, :] > i
        stage = np.full((len(i), n + 1), np.inf)
        for mode in modes:
            prefix = mode.prefix[:, k2]
            held = mode.mem_prefix[None, :] - mode.mem_prefix[i] + mode.boundary[i - 1]
            fits = after & (held <= capacity) & mode.allowed[None, :]
            fixed = mode.fixed_forward[k2] + mode.fixed_backward[k2]
            stage = np.minimum(stage, np.where(fits, prefix[None, :] - prefix[i] + fixed + receive[i - 1], np.inf))
        valid = np.isfinite(stage)
        if byte_limit is None:
            cand = np.maximum(source[k, i], stage)
        else:
            cand = source[k, i] + byte_limit[0][i - 1]
            valid &= stage <= byte_limit[1]
        cand = np.where(valid, cand, np.inf)
        arg = np.argmin(cand, axis=0)
        value = cand[arg, ends]
        better = value < best[k2]
        best[k2][better] = value[better]
        parent[k2, better, 0] = k
        parent[k2, better, 1] = i[arg[better], 0]


# ----- the step objective ---------------------------------------------------------------------------


class _Found(NamedTuple):
    """A split the step search found: its stages and their figures, and the order it is for."""

    step: float  # _split_step(): the simulated step of the split
    objective: float  # what the threshold search minimises: sum of stage times + (M - 1) * the longest period
    order: int  # index of the search that found it (its device order and tables)
    blocks: tuple[tuple[int, int, int], ...]  # (device index in the order, first node, end node) per stage


def _period(schedule: str, f: Any, b: Any, a: Any, g: Any) -> Any:
    """The seconds per micro-batch a stage adds to the steady state (scalars or arrays alike).

    f, b: its forward and backward seconds; a, g: its activation received and gradient sent back.
    GPipe runs all forwards, then all backwards: a forward phase paced by max(f, a) and a backward
    phase paced by max(b, g). 1F1B alternates them: a period of f + b (each link paces its own way).
    """
    if schedule == "gpipe":
        return np.maximum(f, a) + np.maximum(b, g)
    return np.maximum(np.maximum(f + b, a), g)


def _split_step(schedule: str, num_microbatches: int, figures: list[tuple[float, float, float, float]]) -> float:
    """The simulated step of a split whose stages have ``figures`` (f, b, a, g) each, in pipeline order.

    GPipe: a closed form. Each phase is a flow shop of M equal jobs whose machines are the stages and
    the links in between, so it lasts the sum of their times plus M - 1 times the slowest:
    sum(f + a) + (M - 1) max(f, a)  +  sum(b + g) + (M - 1) max(b, g).

    1F1B has no such form (a stage's warm-up forwards and its first backward wait on different stages):
    the schedule is replayed on the figures (partitioner.simulate.chain_step), O(K M).
    """
    return _split_steps(schedule, num_microbatches, [figures])[0]


def _split_steps(
    schedule: str, num_microbatches: int, splits: list[list[tuple[float, float, float, float]]]
) -> list[float]:
    """:func:`_split_step` of each split of ``splits``; the 1F1B replays of splits with as many stages run together."""
    m = num_microbatches
    if schedule == "gpipe":
        steps = []
        for figures in splits:
            total = sum(f + b + a + g for f, b, a, g in figures)
            forward = max(max(f, a) for f, _, a, _ in figures)
            backward = max(max(b, g) for _, b, _, g in figures)
            steps.append(total + (m - 1) * (forward + backward))
        return steps
    result = [0.0] * len(splits)
    by_count: dict[int, list[int]] = {}
    for index, figures in enumerate(splits):
        by_count.setdefault(len(figures), []).append(index)
    for indices in by_count.values():
        stacked = np.array([splits[i] for i in indices]).transpose(2, 1, 0)  # [figure, stage, split]
        for i, step in zip(indices, chain_step(schedule, m, *stacked)):
            result[i] = float(step)
    return result


def _stage_compute(
    tables: _Tables,
    k2: int,
    starts: np.ndarray,
    links: tuple[np.ndarray, np.ndarray],
    schedule: str | None,
    limit: float,
    ends: np.ndarray | None = None,
) -> np.ndarray:
    """[start, end]: the least compute seconds of block [start, end) on device k2 in a mode that fits
    its memory, is allowed there, and keeps the stage's period under ``schedule`` (its stage time,
    compute + receive, for None) within ``limit``; inf where none.

    ``starts`` is a column of block starts (0: the first block, which receives nothing); ``links``
    the activation and gradient seconds of each start's received tensor (columns too); ``ends`` the
    block ends to compute (all, 0..N, by default).
    """
    n = tables.modes[0].prefix.shape[0] - 1
    ends = np.arange(n + 1) if ends is None else ends
    a, g = links
    best = np.full((len(starts), len(ends)), np.inf)
    for mode in tables.modes:
        # memory grows with the end: each start's blocks fit up to an end (its received tensor counts)
        received = np.where(starts > 0, mode.boundary[np.maximum(starts - 1, 0)], 0.0)
        room = tables.capacity[k2] + mode.mem_prefix[starts] - received
        last = np.searchsorted(mode.mem_prefix, room, side="right") - 1
        fits = (ends[None, :] > starts) & (ends[None, :] <= last) & mode.allowed[ends][None, :]
        forward, backward = mode.forward[:, k2], mode.backward[:, k2]
        f = forward[ends][None, :] - forward[starts] + mode.fixed_forward[k2]
        b = backward[ends][None, :] - backward[starts] + mode.fixed_backward[k2]
        if np.isfinite(limit):
            fits &= (f + b + a + g if schedule is None else _period(schedule, f, b, a, g)) <= limit
        best = np.minimum(best, np.where(fits, f + b, np.inf))
    return best


def _reach(tables: _Tables, k2: int, starts: np.ndarray, limit: float) -> np.ndarray:
    """The last end j of a block [start, j) on k2 that fits its memory in some mode and whose compute
    can be within ``limit``, per start (a period is at least the compute, and no node computes less in
    any mode than kept, modes[0])."""
    n = tables.modes[0].prefix.shape[0] - 1
    reach = np.full(len(starts), -1, dtype=np.int64)
    for mode in tables.modes:  # memory: as _stage_compute's ``last``
        received = np.where(starts > 0, mode.boundary[np.maximum(starts - 1, 0)], 0.0)
        room = tables.capacity[k2] + mode.mem_prefix[starts] - received
        reach = np.maximum(reach, np.searchsorted(mode.mem_prefix, room, side="right") - 1)
    if np.isfinite(limit):
        fastest = tables.modes[0].prefix[:, k2]
        reach = np.minimum(reach, np.searchsorted(fastest, fastest[starts] + limit * (1 + 1e-12), side="right") - 1)
    return np.asarray(np.minimum(reach, n))


def _links(tables: _Tables, k: int, k2: int, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of the activation (k -> k2) and of its gradient (k2 -> k) cut before each start."""
    size = tables.out_bytes[starts - 1]
    return size / tables.bandwidth[k][k2], size / tables.bandwidth[k2][k]  # as CostModel.receive_s, one way each


def _viable_ends(tables: _Tables, limit: float) -> np.ndarray:
    """[k]: the first end j from which nodes [j, N) can still be covered by the devices after k, every
    block's compute within ``limit`` (the kept compute, modes[0], is the least of any mode) and its
    memory, less the tensor it receives, within its device's in some mode at the smallest budget a
    stage can have (level 1's, the last stage's: the most room; module docstring, "Memory").

    A relaxation (transfers and received tensors left out, any mode anywhere, every block budgeted as
    the last stage), so a split ending a block on k before it has no completion, whatever its blocks'
    levels: :func:`_banded_program` leaves those cells out. Each device's block goes as far back as it
    can: from a start further back no device after it reaches N.
    """
    modes = tables.levels[0]
    num_devices, n = len(tables.capacity), modes[0].prefix.shape[0] - 1
    first = np.full(num_devices, n, dtype=np.int64)
    for k in range(num_devices - 2, -1, -1):
        end = first[k + 1]
        back = min(
            int(np.searchsorted(m.mem_prefix, m.mem_prefix[end] - tables.capacity[k + 1], side="left")) for m in modes
        )
        if np.isfinite(limit):
            fastest = modes[0].prefix[:, k + 1]
            # generous: never drops a split that fits
            back = max(back, int(np.searchsorted(fastest, fastest[end] - limit * (1 + 1e-9), side="left")))
        first[k] = min(end, back)
    return first


def _step_program(tables: _Tables, schedule: str, limit: float) -> tuple[np.ndarray, np.ndarray, int]:
    """table[k, j]: the least sum of stage times (compute + receive) over splits of nodes [0, j) whose
    last stage ends on device k, every stage's period at most ``limit`` and its memory budgeted for its
    own micro-batches in flight (:func:`_by_level`); the parents to rebuild them; and the number of
    (start, end) cells computed, the DP's work (:func:`_banded_program`)."""
    return _banded_program(tables, limit, schedule, "time")


def _banded_program(
    tables: _Tables, limit: float, schedule: str | None, value: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """table[k, j] over splits of nodes [0, j) whose last stage ends on device k, every stage keeping
    within ``limit`` its period under ``schedule`` (its stage time, compute + receive, for None) and its
    memory budgeted for its own micro-batches in flight (:func:`_by_level`); the parents of every level
    to rebuild them; and the number of (start, end) cells computed, over every level.

    ``value`` says what the table holds: "time", the least sum of stage times; "bottleneck", the least
    longest stage time; "bytes", the fewest bytes sent. Ties go to the first device, then the first start.

    A finite ``limit`` bounds how far a block reaches (:func:`_reach`), so each start's ends are a
    band, not the whole chain, and how early a block on device k may end (:func:`_viable_ends`: the
    devices after k must cover the rest). Near the least feasible limit both leave a narrow window of
    cut positions per device: the work falls from O(N^2) per device pair to O(N * band), and near
    that limit to about the window squared.
    """
    viable = _viable_ends(tables, limit)
    work = 0

    def level(level_tables: _Tables, source: np.ndarray | None, usable: int) -> tuple[np.ndarray, np.ndarray]:
        nonlocal work
        table, parent, cells = _banded_level(level_tables, limit, schedule, value, viable, source, usable)
        work += cells
        return table, parent

    table, parent = _by_level(tables, level)
    return table, parent, work


def _banded_level(
    tables: _Tables,
    limit: float,
    schedule: str | None,
    value: str,
    viable: np.ndarray,
    source: np.ndarray | None,
    usable: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """One level of :func:`_banded_program`: blocks on the first ``usable`` devices after a split of
    ``source`` (the next level's table; None: this level's own), each ending no earlier than ``viable``
    says for its device; and the number of (start, end) cells computed."""
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    table = np.full((num_devices, n + 1), np.inf)
    parent = np.full((num_devices, n + 1, 2), -1, dtype=np.int64)  # (previous device, block start)
    source = table if source is None else source
    none = np.zeros((1, 1))
    budget = max(1, 2_000_000 // len(tables.modes))  # array cells per chunk of starts
    work = 0
    for k2 in range(usable):
        zero = np.zeros(1, dtype=np.int64)
        ends = np.arange(max(1, int(viable[k2])), int(_reach(tables, k2, zero, limit)[0]) + 1)
        if len(ends):
            first = _stage_compute(tables, k2, zero[:, None], (none, none), schedule, limit, ends)[0]
            work += len(ends)
            if value == "bytes":
                first = np.where(np.isfinite(first), 0.0, np.inf)
            better = first < table[k2, ends]
            table[k2, ends[better]] = first[better]
            parent[k2, ends[better]] = (-1, 0)
        for k in range(k2):
            starts = np.flatnonzero(np.isfinite(source[k, 1:n])) + 1
            reach = _reach(tables, k2, starts, limit)
            keep = reach >= viable[k2]  # a start whose block cannot reach a viable end is no use
            starts, reach = starts[keep], reach[keep]
            if not len(starts):
                continue
            band = max(1, int((reach - np.maximum(starts, viable[k2] - 1)).max()))
            chunk = max(1, budget // band - band)  # a chunk's ends span its starts and one band
            for lo in range(0, len(starts), chunk):
                i = starts[lo : lo + chunk][:, None]
                ends = np.arange(max(int(i[0, 0]) + 1, int(viable[k2])), int(reach[lo : lo + chunk].max()) + 1)
                if not len(ends):
                    continue
                a, g = _links(tables, k, k2, i)
                stage = _stage_compute(tables, k2, i, (a, g), schedule, limit, ends) + a + g
                work += stage.size
                if value == "time":
                    cand = source[k, i] + stage
                elif value == "bottleneck":
                    cand = np.maximum(source[k, i], stage)
                else:
                    cand = np.where(np.isfinite(stage), source[k, i] + tables.out_bytes[i - 1], np.inf)
                arg = np.argmin(cand, axis=0)
                best = cand[arg, np.arange(len(ends))]
                better = best < table[k2, ends]
                table[k2, ends[better]] = best[better]
                parent[k2, ends[better], 0] = k
                parent[k2, ends[better], 1] = i[arg[better], 0]
    return table, parent, work


def _least_bottlenecks(tables: _Tables, sizes: Sequence[int]) -> list[tuple[float, Blocks]]:
    """(least bottleneck, its split of fewest bytes) on the first s of ``tables``' devices (any subset of
    them, in order), for each s of ``sizes``; (inf, ()) where none fits: from one :func:`_dynamic_program`
    table on small problems (FULL_TABLE_CELLS), else from :func:`_least_bottleneck` on each prefix."""
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    if num_devices**2 * n**2 / 2 > FULL_TABLE_CELLS:
        return [_least_bottleneck(_prefix_tables(tables, s)) for s in sizes]
    table, _ = _dynamic_program(tables)
    result: list[tuple[float, Blocks]] = []
    for s in sizes:
        least = float(table[:s, n].min())
        result.append((least, _least_bytes_split(_prefix_tables(tables, s), least) if np.isfinite(least) else ()))
    return result


def _least_bottleneck(tables: _Tables) -> tuple[float, Blocks]:
    """The least bottleneck (longest stage time) of any split on ``tables``' devices (any subset of them,
    in order), and the split of it with the fewest bytes sent (the first among ties); (inf, ()) when
    none fits.

    The same as :func:`_dynamic_program` and :func:`_least_bytes_split`, by banded programs
    (:func:`_banded_program`): at a limit at or above the least bottleneck the min-max program finds it
    exactly, below it finds none. Limits grow from a floor (the least compute spread over the devices,
    or the costliest node) by 1/64, 1/32, ... of it, so the last tried is at most about twice as far
    above the least bottleneck as needed, and each try is cheap while its limit stays near the floor;
    past a ceiling (no stage can take longer) the program runs unbanded, at most 27 tries in all.
    """
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    nodes = np.diff(tables.modes[0].prefix, axis=0).min(axis=1)
    floor = max(float(nodes.sum()) / num_devices, float(nodes.max(initial=0.0)))
    # no stage takes longer: every node in its slowest mode on its slowest device, the largest fixed
    # seconds and the slowest transfer; from there on a limit prunes nothing
    ceiling = sum(
        float(np.diff(m.prefix, axis=0).max(axis=1).sum() + (m.fixed_forward + m.fixed_backward).max())
        for m in tables.modes
    ) + 2 * float(tables.out_bytes.max(initial=0.0)) / min(min(row) for row in tables.bandwidth)
    step = floor / 64
    while True:
        # the whole table past the ceiling, or a million floors above the floor (an infinite ceiling)
        limit = floor + step if 0 < step < floor * 2**20 and floor + step < ceiling else np.inf
        table, _, _ = _banded_program(tables, limit, None, "bottleneck")
        least = float(table[:, n].min())
        if np.isfinite(least) or not np.isfinite(limit):
            break
        step *= 2
    if not np.isfinite(least):
        return least, ()
    sent, parent, _ = _banded_program(tables, least * (1 + 1e-9), None, "bytes")
    return least, _blocks(parent, int(np.argmin(sent[:, n])), n)


def _block_figures(
    tables: _Tables, previous: int, k2: int, start: int, end: int, schedule: str, limit: float = np.inf
) -> tuple[float, float, float, float] | None:
    """(f, b, a, g) of block [start, end) on k2 after a stage on ``previous`` (-1: none), in the mode
    _stage_compute chooses for it (the least compute that fits, is allowed and keeps the period within
    ``limit``; the first mode among equals), for one block in scalars; None when no mode fits."""
    a = g = 0.0
    if previous >= 0:
        size = tables.out_bytes[start - 1]
        a, g = size / tables.bandwidth[previous][k2], size / tables.bandwidth[k2][previous]
    best: tuple[float, float, float, float] | None = None
    for mode in tables.modes:
        received = mode.boundary[start - 1] if start > 0 else 0.0
        if not (end > start and mode.allowed[end]):
            continue
        if mode.mem_prefix[end] > tables.capacity[k2] + mode.mem_prefix[start] - received:
            continue
        f = float(mode.forward[end, k2] - mode.forward[start, k2] + mode.fixed_forward[k2])
        b = float(mode.backward[end, k2] - mode.backward[start, k2] + mode.fixed_backward[k2])
        if np.isfinite(limit) and _period(schedule, f, b, a, g) > limit:
            continue
        if best is None or f + b < best[0] + best[1]:
            best = (f, b, float(a), float(g))
    return best


def _threshold_search(
    tables: _Tables,
    schedule: str,
    num_microbatches: int,
    order: int,
    incumbent: float,
    weight: float,
    least_bottleneck: float,
    least_sum: float,
) -> tuple[list[_Found], float, bool]:
    """Splits that minimise weight * sum(stage times) + (M - 1) * max(period) on ``tables``' devices
    (any subset of them in order), by bisection on the period threshold T; with a lower bound on that
    objective over every split, and whether the search finished (else it stopped after MAX_PROGRAMS DPs or
    PROGRAM_WORK cells of them).

    The DP at threshold T gives s(T), the least sum among splits whose periods are all <= T, and
    s is non-increasing in T. A split y with period p(y) in an interval (lo, hi] of thresholds has
    sum(y) >= s(hi), so its objective is at least w s(hi) + (M - 1) lo: intervals whose bound reaches
    the best objective found (``incumbent`` from other orders, then this search's) are dropped, the
    others halved. The split found at hi has period p <= hi, and no split with a period in [p, hi] beats
    it, so an interval shrinks to (lo, p] at once.

    The search starts at the least bottleneck ``least_bottleneck`` of these devices (a split within it
    exists), and above it only up to where (M - 1) * T alone exceeds the best found less
    w * ``least_sum`` (a bound on any split's sum): the DP's work is a band below the threshold
    (:func:`_step_program`), so small thresholds are cheap.
    """
    n = tables.modes[0].prefix.shape[0] - 1
    m = num_microbatches
    found: list[_Found] = []
    work = 0

    def run(limit: float) -> tuple[float, float] | None:
        nonlocal work
        table, parent, cells = _step_program(tables, schedule, limit)
        work += cells * len(tables.modes)
        k = int(np.argmin(table[:, n]))
        if not np.isfinite(table[k, n]):
            return None
        stages = _blocks(parent, k, n)
        figures = _figures(tables, stages, schedule, limit)
        assert figures is not None  # the DP found them
        total = sum(f + b + a + g for f, b, a, g in figures)
        period = max(float(_period(schedule, *x)) for x in figures)
        found.append(
            _Found(
                _split_step(schedule, m, figures),
                weight * total + (m - 1) * period,
                order,
                stages,
            )
        )
        return total, period

    # The least-bottleneck split's stages take at most ``least_bottleneck`` (compute + receive), so its
    # periods too: the DP at that threshold finds a split, an incumbent, at the cost of a narrow band.
    start = run(least_bottleneck * (1 + 1e-9)) if np.isfinite(least_bottleneck) else run(np.inf)
    if start is None:
        return found, np.inf, True
    best = min(incumbent, weight * start[0] + (m - 1) * start[1])
    # No period is below the compute of the busiest stage, at least the least sum spread over every
    # device (kept, on its fastest device: a lower bound for any mode) or the costliest node.
    nodes = np.diff(tables.modes[0].prefix, axis=0).min(axis=1)
    floor = max(least_sum / len(tables.capacity), float(nodes.max(initial=0.0))) * (1 - 1e-9)
    heap = [
        (weight * start[0] + (m - 1) * floor, floor, start[1], start[0])
    ]  # (bound, lo, hi, s(hi)): periods in (lo, hi]
    programs = 1
    # A split whose period exceeds T_max cannot beat ``best``: w * sum >= w * least_sum.
    top = (best - weight * least_sum) / (m - 1) if m > 1 else np.inf
    if top > least_bottleneck * (1 + 1e-9):
        result = run(top)
        programs += 1
        if result is not None and result[1] > least_bottleneck:
            best = min(best, weight * result[0] + (m - 1) * result[1])
            heapq.heappush(heap, (weight * result[0] + (m - 1) * least_bottleneck, least_bottleneck, *result[::-1]))
    while heap and heap[0][0] < best * (1 - STEP_TOLERANCE) and programs < MAX_PROGRAMS and work < PROGRAM_WORK:
        _, lo, hi, at_hi = heapq.heappop(heap)
        mid = (lo + hi) / 2
        result = run(mid)
        programs += 1
        if result is not None:
            at_mid, period = result
            best = min(best, weight * at_mid + (m - 1) * period)
            heapq.heappush(heap, (weight * at_mid + (m - 1) * lo, lo, period, at_mid))
        heapq.heappush(heap, (weight * at_hi + (m - 1) * mid, mid, hi, at_hi))
    complete = not heap or heap[0][0] >= best * (1 - STEP_TOLERANCE)
    bound = min(best, heap[0][0]) if heap else best
    return found, bound, complete


def _shortest_step(costs: CostModel, device_order: str, started: float) -> Plan:
    """The plan of the shortest simulated step over the candidate orders (the cluster's own with
    "given"), every subset of devices in each, and every split (module docstring)."""
    cluster = costs.cluster
    orders = _orders(costs) if device_order == "search" else [tuple(range(cluster.num_devices))]
    scored: list[CostModel] = []
    found: list[_Found] = []
    searched: list[tuple[int, _Tables]] = []  # (order, tables) of each search: _Found.order indexes it
    weights = (1.0,) if costs.schedule == "gpipe" else ONE_F_ONE_B_WEIGHTS
    best = dict.fromkeys(weights, np.inf)
    step_bound, least, complete = np.inf, np.inf, True
    for index, order in enumerate(orders):
        identity = list(order) == list(range(cluster.num_devices))
        permuted = costs if identity else costs.on(reorder(cluster, order))
        scored.append(permuted)
        tables = _tables(permuted)
        num_devices = len(tables.capacity)
        # the least bottleneck on these devices (every prefix of them for 1F1B's starts) and its split
        sizes = range(1, num_devices + 1) if costs.schedule != "gpipe" else [num_devices]
        bottlenecks = _least_bottlenecks(tables, sizes)
        least_here = bottlenecks[-1][0]
        least = min(least, least_here)
        # no split's stage times sum to less than every node kept (modes[0]) on its fastest device
        least_sum = float(np.diff(tables.modes[0].prefix, axis=0).min(axis=1).sum())
        searched.append((index, tables))
        splits: list[_Found] = []
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
        if costs.schedule != "gpipe":  # 1F1B: improve the best splits found and the least-bottleneck ones
            starts = {
                f.blocks: f for f in [*splits, *_bottleneck_splits(tables, bottlenecks, len(searched) - 1, costs)]
            }
            ranked = sorted(starts.values(), key=lambda f: f.step)[:LOCAL_STARTS]
            splits += _local_search(tables, costs.schedule, costs.num_microbatches, ranked)
        found += splits
    if not found:
        raise explain_infeasible(costs, fits_with_recompute=_fits_with_recompute(costs))
    least_step = min(f.step for f in found)
    if (
        costs.schedule == "gpipe"
        and least_step > step_bound * (1 + STEP_TOLERANCE)
        and len(costs.order) <= LOCAL_MAX_NODES
    ):
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
    proven = complete and costs.schedule == "gpipe" and (device_order == "given" or every_order_searched(cluster))
    optimal = proven and plan.step_time_s <= step_bound * (1 + STEP_TOLERANCE) + 1e-15
    lower_bound = float(least) if device_order == "given" or every_order_searched(cluster) else costs.lower_bound_s()
    plan = dataclasses.replace(
        plan, lower_bound_s=min(lower_bound, plan.bottleneck_s), solve_time_s=time.perf_counter() - started
    )
    # judged on the step: the search's own bound where it is proven, the cost model's on any plan always
    return with_step_bound(plan, costs, proven_s=float(step_bound) if proven else None, proven_optimal=optimal)


def _bottleneck_splits(
    tables: _Tables, bottlenecks: list[tuple[float, Blocks]], order: int, costs: CostModel
) -> list[_Found]:
    """The least-bottleneck splits (fewest bytes among ties) of :func:`_least_bottleneck` on each prefix
    of ``tables``' devices (``bottlenecks``), as starts for the 1F1B local search."""
    result = []
    for least, split in bottlenecks:
        figures = _figures(tables, split, costs.schedule) if np.isfinite(least) else None
        if figures is not None:
            result.append(_Found(_split_step(costs.schedule, costs.num_microbatches, figures), np.inf, order, split))
    return result


def _figures(
    tables: _Tables, blocks: Blocks, schedule: str, limit: float = np.inf
) -> list[tuple[float, float, float, float]] | None:
    """(f, b, a, g) of each stage of ``blocks``, or None when a block fits in no mode (each budgeted for
    its own micro-batches in flight)."""
    figures = []
    previous = -1
    for s, (k, start, end) in enumerate(blocks):
        block = _block_figures(_level(tables, len(blocks) - s), previous, k, start, end, schedule, limit)
        if block is None:
            return None
        figures.append(block)
        previous = k
    return figures


def _neighbours(blocks: Blocks, num_devices: int) -> list[Blocks]:
    """Splits one move away from ``blocks``: a boundary moved, a stage split onto an idle device
    between its neighbours', two stages merged, or a stage moved to such an idle device. On long
    chains a boundary moves at most LOCAL_WINDOW nodes and a stage splits at most at LOCAL_WINDOW points."""
    result: list[Blocks] = []
    used = {k for k, _, _ in blocks}
    count = len(blocks)
    for s in range(count):
        k, start, end = blocks[s]
        low = blocks[s - 1][0] if s > 0 else -1
        high = blocks[s + 1][0] if s + 1 < count else num_devices
        idle = [d for d in range(low + 1, high) if d not in used]
        for d in idle:  # the stage on another device
            result.append((*blocks[:s], (d, start, end), *blocks[s + 1 :]))
        cuts = range(start + 1, end)
        if len(cuts) > LOCAL_WINDOW:
            cuts = range(start + 1, end, -(-len(cuts) // LOCAL_WINDOW))
        for cut in cuts:  # split: one part stays on k, the other goes to an idle device on its side
            for d in idle:
                pair = ((k, start, cut), (d, cut, end)) if d > k else ((d, start, cut), (k, cut, end))
                result.append((*blocks[:s], *pair, *blocks[s + 1 :]))
        if s + 1 < count:
            k2, _, end2 = blocks[s + 1]
            for d in (k, k2):  # merge with the next stage
                result.append((*blocks[:s], (d, start, end2), *blocks[s + 2 :]))
            lo, hi = max(start + 1, end - LOCAL_WINDOW), min(end2 - 1, end + LOCAL_WINDOW)
            for cut in range(lo, hi + 1):  # move the boundary
                if cut != end:
                    result.append((*blocks[:s], (k, start, cut), (k2, cut, end2), *blocks[s + 2 :]))
    return result


@dataclasses.dataclass
class _Walk:
    """One local search of :func:`_local_search`: where it stands, the best split it visited, its path."""

    current: Blocks
    current_step: float
    best: Blocks
    shortest: float  # the step of ``best``
    visited: set[Blocks]
    candidates: list[Blocks] = dataclasses.field(default_factory=list)  # this round's unvisited neighbours


def _local_search(tables: _Tables, schedule: str, num_microbatches: int, starts: list[_Found]) -> list[_Found]:
    """Each of ``starts`` improved by :func:`_neighbours` moves: for 1F1B, whose step the threshold
    search's objective only approximates, and for GPipe where stages differ in forward share. Each round
    moves to the neighbour of the shortest step (:func:`_split_step`) not visited yet, sideways too
    (equal steps, plateaus), and stops when every neighbour is worse or after LOCAL_ROUNDS rounds; the
    best split visited is returned, one per start.

    The searches run side by side, one round of all of them at a time, so that the neighbours of every
    search are replayed together (one partitioner.simulate.chain_step per stage count) and a split met
    by several searches, or again, is replayed once: each search takes the path it would take alone.
    """
    num_devices = len(tables.capacity)
    blocks_seen: dict[tuple[int, int, int, int, int], tuple[float, float, float, float] | None] = {}
    levels = [_level(tables, r) for r in range(1, len(tables.levels) + 1)]
    steps: dict[Blocks, float | None] = {}  # the step of each split met, None where a block fits no mode

    def figures_of(split: Blocks) -> list[tuple[float, float, float, float]] | None:
        figures, previous = [], -1
        for s, (k, start, end) in enumerate(split):
            level = min(len(split) - s, len(levels))  # its micro-batches in flight (module docstring, "Memory")
            key = (previous, k, start, end, level)
            if key not in blocks_seen:
                blocks_seen[key] = _block_figures(levels[level - 1], previous, k, start, end, schedule)
            block = blocks_seen[key]
            if block is None:
                return None
            figures.append(block)
            previous = k
        return figures

    walks = [_Walk(f.blocks, f.step, f.blocks, f.step, {f.blocks}) for f in starts]
    active = list(walks)
    for _ in range(LOCAL_ROUNDS):
        pending: dict[Blocks, list[tuple[float, float, float, float]]] = {}
        for walk in active:
            walk.candidates = [c for c in _neighbours(walk.current, num_devices) if c not in walk.visited]
            for candidate in walk.candidates:
                if candidate not in steps and candidate not in pending:
                    figures = figures_of(candidate)
                    if figures is None:
                        steps[candidate] = None
                    else:
                        pending[candidate] = figures
        steps.update(zip(pending, _split_steps(schedule, num_microbatches, list(pending.values()))))
        moved = []
        for walk in active:
            scored = [(step, c) for c in walk.candidates if (step := steps[c]) is not None]
            if not scored:
                continue
            value, candidate = min(scored)
            if value > walk.current_step * (1 + 1e-12):
                continue
            walk.visited.add(candidate)
            walk.current, walk.current_step = candidate, value
            if value < walk.shortest * (1 - 1e-12):
                walk.best, walk.shortest = candidate, value
            moved.append(walk)
        active = moved
        if not active:
            break
    return [found._replace(step=walk.shortest, blocks=walk.best) for found, walk in zip(starts, walks)]
