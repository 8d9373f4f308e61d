"""Chooses the number of micro-batches and the schedule for a global batch: plans each, keeps the fewest
micro-batches within a margin of the shortest step.

M and the schedule are decisions like the placement: for a global batch of B samples, every candidate
M (the divisors of B up to :data:`MAX_MICROBATCHES`) and schedule ("gpipe", "1f1b") is planned by
:func:`partitioner.solve` on the layer graph rescaled to micro-batches of B / M samples
(:func:`partitioner.rescale_graph`). Of the plans that fit, those of the fewest micro-batches whose
simulated step (``Plan.step_time_s``) is within :data:`MARGIN` (5%) of the shortest win, and of them
the shorter step (ties: GPipe): what the cost model does not price grows with M (docs/cost-model.md,
"Choosing M"), so a step predicted a few percent shorter with more micro-batches is within the
prediction's error, and the smaller M is the safer pick. A user may fix either: an int M or a named
schedule is the only candidate of its kind; ``margin=0`` keeps the shortest predicted step alone.

The time budget: a chain (the exact DP, milliseconds) solves every candidate, each with an equal share.
A DAG (CP-SAT, which needs seconds) is first screened: each candidate's best baseline split (uniform,
by parameters, by time, on the first 1, 2, 4, ... devices) that fits is simulated, and only the
:data:`SOLVED_DAG_CANDIDATES` of the shortest screened steps are solved, each with an equal share of
the budget. Shares are fixed, not what earlier candidates left, so the same input gives the same plan.
The screen itself runs outside the budget (about 1 s per candidate on a 10,000-node DAG, docs/cost-model.md).

What makes the choice more than "the most micro-batches": the bubble, (K - 1) / (M + K - 1), shrinks
as M grows, but each forward and backward of a stage pays its device's fixed ``action_overhead_s``
once per micro-batch (docs/cost-model.md), so M x 2 x overhead grows; and activations held per stage
shrink with the micro-batch (GPipe holds M of them before its last stage, 1F1B at most K - s), so a
larger M or 1F1B may be what fits.

Example:
    >>> import partitioner as pt
    >>> graph = pt.chain_graph([4e11] * 8, activation_bytes=[2**20] * 8, edge_bytes=[2**20] * 7)
    >>> graph.graph.update(batch_size=64, num_microbatches=1)  # costs measured for the whole batch
    >>> cluster = pt.Cluster.uniform(4, memory="16GiB", flops_per_s=100e12, action_overhead_s=20e-6)
    >>> choice = choose(graph, cluster, batch_size=64, time_limit_s=5)
    >>> choice.plan.num_microbatches, choice.plan.schedule, choice.plan.num_stages  # 10.3 ms: within 5% of 10.2
    (16, 'gpipe', 4)
    >>> [(c.num_microbatches, round(c.step_time_s * 1e3, 1)) for c in choice.candidates if c.schedule == "gpipe"]
    [(1, 32.0), (2, 20.2), (4, 14.3), (8, 11.5), (16, 10.3), (32, 10.2), (64, 11.1)]
    >>> choose(graph, cluster, batch_size=64, time_limit_s=5, margin=0).plan.num_microbatches
    32
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.errors import InfeasiblePlanError, InputError, PartitionerError, SolverTimeoutError
from partitioner.graph import check_batch, colocation_groups, is_chain, rescale_graph
from partitioner.plan import Plan
from partitioner.schedule import SCHEDULES, check_schedule_name
from partitioner.search import baselines
from partitioner.search.solve import solve
from partitioner.simulate import simulate_assignment

MAX_MICROBATCHES = 64  # the most micro-batches "auto" tries (the runtime calls each stage 2 x M times a step)
SOLVED_DAG_CANDIDATES = 3  # candidates CP-SAT solves on a DAG: those of the shortest screened steps
AUTO = "auto"
# A plan of fewer micro-batches wins if its simulated step is within this share of the shortest: what the cost
# model does not price grows with M (the runtime's work per micro-batch beside its layers; devices that share
# cores slowing each other while the pipeline overlaps them), so within its error the smaller M is the safer pick
MARGIN = 0.05
TIMED_SIZES = 4  # the most micro-batch sizes a timed profile measures for "auto" (timed_sizes)


@dataclass(frozen=True)
class Candidate:
    """One (M, schedule) tried, with its plan's simulated step or the reason it has none."""

    num_microbatches: int  # M
    schedule: str  # "gpipe" or "1f1b"
    step_time_s: float | None  # the plan's simulated step; None when no plan was found
    error: str | None  # why no plan was found (the planner's message, or why it was not solved), else None
    screened_step_s: float | None = None  # DAGs: the best fitting baseline's simulated step (None: none fits)
    solved: bool = True  # False: screened out on a DAG, never given to the planner


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided: the plan, the layer graph it was made for, and every candidate tried."""

    plan: Plan  # its num_microbatches and schedule are the ones chosen
    graph: nx.DiGraph  # the graph rescaled to the chosen micro-batch: validate and simulate the plan with it
    candidates: tuple[Candidate, ...]  # in the order tried: M ascending, then gpipe before 1f1b
    margin: float = MARGIN  # the share of the shortest simulated step within which fewer micro-batches won


def candidate_microbatches(batch_size: int, num_microbatches: int | str = AUTO) -> list[int]:
    """The numbers of micro-batches to try: the divisors of ``batch_size`` up to MAX_MICROBATCHES, or the one given.

    Raises:
        InputError: for a batch size below 1, or a num_microbatches that is neither "auto" nor an
            integer from 1 to batch_size.

    Example:
        >>> candidate_microbatches(24), candidate_microbatches(24, 5)
        ([1, 2, 3, 4, 6, 8, 12, 24], [5])
    """
    if num_microbatches == AUTO:
        check_batch(batch_size, 1)
        return [m for m in range(1, min(batch_size, MAX_MICROBATCHES) + 1) if batch_size % m == 0]
    if isinstance(num_microbatches, str):
        raise InputError(
            "num_microbatches must be 'auto' (the planner chooses M) or an integer >= 1. "
            f"Received: {num_microbatches!r}."
        )
    check_batch(batch_size, num_microbatches)
    return [num_microbatches]


def timed_sizes(batch_size: int, num_microbatches: int | str = AUTO, most: int = TIMED_SIZES) -> list[int]:
    """The micro-batch sizes a timed profile should measure for :func:`choose` to price each M tried.

    The sizes of the candidates (ceil(batch_size / M), :func:`candidate_microbatches`), all of them where
    there are at most ``most``, else ``most`` of them spread evenly along the sorted sizes, the smallest
    and the largest included (``partitioner.rescale_graph`` reads the others off the line between the
    nearest two measured).

    Example:
        >>> timed_sizes(256), timed_sizes(24, most=8), timed_sizes(24, 4)
        ([4, 16, 64, 256], [1, 2, 3, 4, 6, 8, 12, 24], [6])
    """
    sizes = sorted({math.ceil(batch_size / m) for m in candidate_microbatches(batch_size, num_microbatches)})
    if len(sizes) <= most:
        return sizes
    picks = sorted({round(i * (len(sizes) - 1) / (most - 1)) for i in range(most)})
    return [sizes[i] for i in picks]


def candidate_schedules(schedule: str = AUTO) -> list[str]:
    """The schedules to try: both for "auto" (GPipe first, which wins ties), else the one named.

    Example:
        >>> candidate_schedules(), candidate_schedules("1f1b")
        (['gpipe', '1f1b'], ['1f1b'])
    """
    if schedule == AUTO:
        return list(SCHEDULES)
    if not isinstance(schedule, str):
        raise InputError(f"schedule must be 'auto' or one of {SCHEDULES}. Received: {schedule!r}.")
    check_schedule_name(schedule)
    return [schedule]


def plan_for_batch(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    batch_size: int | None = None,
    num_microbatches: int | str = AUTO,
    schedule: str = AUTO,
    recompute: str = "never",
    time_limit_s: float = 10.0,
    **solve_options: Any,
) -> Plan:
    """Plans ``graph`` for a global batch, choosing M and the schedule where they are "auto".

    The plan records what was chosen (``plan.num_microbatches``, ``plan.schedule``); its costs are per
    micro-batch of ``batch_size / plan.num_microbatches`` samples, so validate or simulate it with
    ``rescale_graph(graph, batch_size, plan.num_microbatches)`` (or use :func:`choose`, which returns
    that graph). See :func:`choose` for the arguments.

    Example:
        >>> import partitioner as pt
        >>> graph = pt.chain_graph([4e9] * 4, activation_bytes=[2**20] * 4)
        >>> graph.graph.update(batch_size=16, num_microbatches=1)
        >>> cluster = pt.Cluster.uniform(2, memory="16GiB", action_overhead_s=1e-3)
        >>> plan = plan_for_batch(graph, cluster, batch_size=16, schedule="1f1b")
        >>> plan.num_microbatches, plan.schedule, plan.num_stages  # the overhead outweighs any pipeline
        (1, '1f1b', 1)
    """
    return choose(
        graph,
        cluster,
        batch_size=batch_size,
        num_microbatches=num_microbatches,
        schedule=schedule,
        recompute=recompute,
        time_limit_s=time_limit_s,
        **solve_options,
    ).plan


def choose(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    batch_size: int | None = None,
    num_microbatches: int | str = AUTO,
    schedule: str = AUTO,
    recompute: str = "never",
    time_limit_s: float = 10.0,
    margin: float | None = None,
    **solve_options: Any,
) -> Choice:
    """Plans every candidate (M, schedule) and returns the fewest micro-batches within ``margin`` of the shortest step.

    Args:
        graph: a layer graph that records the batch its costs were measured at (``micro_batch_size``,
            or ``batch_size`` and ``num_microbatches``), as ``profiles.profile_model`` writes it.
        cluster: the devices.
        batch_size: samples per step; the graph's own ``batch_size`` when None.
        num_microbatches: "auto" (the divisors of ``batch_size`` up to MAX_MICROBATCHES) or a fixed M.
        schedule: "auto" (GPipe and 1F1B), "gpipe" or "1f1b".
        recompute: "never", "always" or "auto", passed to every ``solve``.
        time_limit_s: the whole budget, shared equally by the candidates solved (every one on a chain,
            the SOLVED_DAG_CANDIDATES best screened on a DAG; a fixed share each, so the same input gives
            the same plan).
        margin: how much longer a simulated step (``Plan.step_time_s``) may be than the shortest and
            still win by having fewer micro-batches (0.05: 5%); :data:`MARGIN` when None, 0 for the
            shortest step alone.
        **solve_options: the other arguments of :func:`partitioner.solve` (optimizer_slots, cost, pins,
            options).

    Returns:
        A Choice: the plan (the fewest micro-batches among those simulated within ``margin`` of the
        shortest step, then the shorter step of that M, GPipe on ties), the rescaled graph it was made
        for, and every candidate's step or error.

    Raises:
        InfeasiblePlanError: no candidate fits (SolverTimeoutError where none was found in time); the
            message lists the candidates and quotes the planner's error for the one that holds the
            fewest activations (the most micro-batches, 1F1B).
        InputError, GraphError: a bad batch size, M, schedule or time limit, or a graph that does not
            record its batch size.
    """
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise InputError(f"time_limit_s must be a positive number of seconds. Received: {time_limit_s!r}.")
    margin = MARGIN if margin is None else margin
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf:
        raise InputError(
            f"margin must be a share >= 0 of the shortest simulated step (0.05 for 5%). Received: {margin!r}."
        )
    if batch_size is None:
        batch_size = graph.graph.get("batch_size")
        if batch_size is None:
            raise InputError(
                "batch_size is needed to choose or rescale the micro-batches, and the layer graph records none. "
                "Pass batch_size= (samples per step), or profile the model with 'partitioner profile'."
            )
    counts = candidate_microbatches(batch_size, num_microbatches)
    schedules = candidate_schedules(schedule)
    scaled = {m: rescale_graph(graph, batch_size=batch_size, num_microbatches=m) for m in counts}
    pairs = [(m, name) for m in counts for name in schedules]
    screened: dict[tuple[int, str], float | None] = {}
    chain = is_chain(graph) and not colocation_groups(graph) and not solve_options.get("pins")
    if chain or len(pairs) <= SOLVED_DAG_CANDIDATES:
        chosen = pairs
    else:
        splits = _baseline_splits(scaled[counts[0]], cluster, solve_options)
        for m, name in pairs:
            costs = _costs(scaled[m], cluster, m, name, recompute, solve_options)
            screened[(m, name)] = _screen(costs, splits)
        # Shortest screened step first; where no baseline fits, the most micro-batches (1F1B) first: they hold least.
        ranked = sorted(
            pairs,
            key=lambda p: (
                (0, screened[p], p[0], schedules.index(p[1]))
                if screened[p] is not None
                else (1, 0.0, -p[0], -schedules.index(p[1]))
            ),
        )
        chosen = sorted(ranked[:SOLVED_DAG_CANDIDATES], key=pairs.index)
    share_s = time_limit_s / len(chosen)
    planned: list[tuple[Plan, nx.DiGraph]] = []  # in the order tried: M ascending, GPipe first
    tried: list[Candidate] = []
    failures: list[tuple[Candidate, PartitionerError]] = []
    for m, name in pairs:
        screen = screened.get((m, name))
        if (m, name) not in chosen:
            note = f"not solved: {len(chosen)} candidates were screened ahead of it"
            tried.append(Candidate(m, name, None, note, screen, solved=False))
            continue
        try:
            plan = solve(
                scaled[m],
                cluster,
                num_microbatches=m,
                schedule=name,
                recompute=recompute,
                time_limit_s=share_s,
                **solve_options,
            )
        except InfeasiblePlanError as error:  # SolverTimeoutError included
            tried.append(Candidate(m, name, None, str(error), screen))
            failures.append((tried[-1], error))
            continue
        tried.append(Candidate(m, name, plan.step_time_s, None, screen))
        planned.append((plan, scaled[m]))
    if not planned:
        raise _no_candidate_fits(tried, failures, batch_size)
    # the fewest micro-batches among the plans simulated within the margin of the shortest step (the pipeline's
    # step: the step's own work beside it is the same at every M and moves no pick), then that M's shortest
    # step (ties: GPipe, tried first)
    shortest = min(plan.step_time_s for plan, _ in planned)
    fewest = min(p.num_microbatches for p, _ in planned if p.step_time_s <= shortest * (1 + margin) * (1 + 1e-9))
    best: tuple[Plan, nx.DiGraph] | None = None
    for pair in planned:
        if pair[0].num_microbatches == fewest and (
            best is None or pair[0].step_time_s < best[0].step_time_s * (1 - 1e-9)
        ):
            best = pair
    assert best is not None  # the plan of the shortest step is within the margin of itself
    return Choice(plan=best[0], graph=best[1], candidates=tuple(tried), margin=margin)


def _costs(
    graph: nx.DiGraph, cluster: Cluster, num_microbatches: int, schedule: str, recompute: str, solve_options: Any
) -> CostModel:
    """The cost model ``solve`` builds for these arguments."""
    return CostModel(
        graph,
        cluster,
        num_microbatches=num_microbatches,
        optimizer_slots=solve_options.get("optimizer_slots", 2),
        cost=solve_options.get("cost", "flops"),
        schedule=schedule,
        recompute=recompute,
        num_replicas=solve_options.get("num_replicas", 1),
        reductions=solve_options.get("reductions"),
    )


def _baseline_splits(graph: nx.DiGraph, cluster: Cluster, solve_options: Any) -> list[dict[str, str]]:
    """The baseline splits (uniform, by parameters, by time) on the first 1, 2, 4, ... devices, each once.

    They are the same for every M and schedule: a split balances counts, weights or compute, and the
    compute of every node scales alike with the micro-batch.
    """
    costs = _costs(graph, cluster, 1, "gpipe", "never", solve_options)
    sizes = sorted({min(2**i, cluster.num_devices) for i in range(cluster.num_devices.bit_length() + 1)})
    splits: list[dict[str, str]] = []
    for size in (k for k in sizes if k <= graph.number_of_nodes()):
        prefix = costs.on(cluster.take(size)) if size < cluster.num_devices else costs
        for name in baselines.BASELINES:
            assignment = baselines.split_with(prefix, name).assignment
            if assignment not in splits:
                splits.append(assignment)
    return splits


def _screen(costs: CostModel, splits: Sequence[dict[str, str]]) -> float | None:
    """The shortest simulated step under ``costs`` of the splits that fit, or None when none fits."""
    capacity = {d.name: d.memory_bytes for d in costs.cluster.devices}
    steps = []
    for assignment in splits:
        simulation = simulate_assignment(costs, assignment)
        if all(simulation.peak_memory_bytes[d] <= capacity[d] for d in simulation.stages):
            steps.append(simulation.step_time_s)
    return min(steps, default=None)


def _no_candidate_fits(
    tried: Sequence[Candidate], failures: Sequence[tuple[Candidate, PartitionerError]], batch_size: int
) -> InfeasiblePlanError:
    """One error for a choice where no candidate has a plan: the candidates, then the closest one's message."""
    closest, error = failures[-1]  # candidates are tried M ascending, GPipe first: the last holds the fewest
    counts = sorted({c.num_microbatches for c in tried})
    schedules = list(dict.fromkeys(c.schedule for c in tried))
    kind = SolverTimeoutError if isinstance(error, SolverTimeoutError) else InfeasiblePlanError
    return kind(
        f"No plan for batch {batch_size} with M in {counts} and schedule(s) {schedules}. The one holding the "
        f"fewest activations of those solved, M={closest.num_microbatches} with {closest.schedule}: {error}"
    )
