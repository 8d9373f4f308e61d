"""Data x pipeline: D replicas of a pipeline of up to K stages on the cluster's N devices, chosen by the step.

For a global batch of B samples, every D that divides B with D <= N is a candidate, with K = N // D
devices per replica (devices past D x K stay idle) and a per-replica batch of B / D. Pure data parallelism
(K = 1) and pure pipeline parallelism (D = 1) are two candidates of the same search. Replicas are laid on
the cluster's devices (in its order) in one of two ways:

    blocks   replica r on devices r*K .. r*K + K - 1: each pipeline inside a block of neighbours (a node),
             each stage's all-reduce between blocks (between nodes)
    strided  replica r on devices r, r + D, r + 2D, ...: each stage's group of D neighbours (one node's
             devices), the pipeline's transfers between groups

(with D = 1 or K = 1 the two are one). Replica 0's devices are planned by :func:`choose` for B / D samples
(M and the schedule chosen there too). Its step is that plan's simulated step (``partitioner.simulate``)
with, after each stage's last action, the stage's ``R`` (an "allreduce" span of the simulator's
timeline): its weight gradients all-reduced with the same stage of the other replicas
(``cost.allreduce_s``, a ring over the group's devices), so the step ends when the last ``R`` does.
``R`` does not overlap the stage's backward: the runtime runs it after the micro-batch loop
(``runtime.train_step``), as this prices it. The replicas' stages run alike, so the step of replica 0
is the step; where the replicas' devices share a processor (``Device.pool``: logical devices of one CPU),
replica 0 is planned and simulated with its share of each pool's capacity (C / D where every replica lies
on the pool), the other replicas computing alike at once. Memory is checked per device by the plan of replica
0 (every replica's devices hold the same), the packed copy of each stage's gradients its all-reduce takes
included (``cost.gradient_copies``).

Workers whose devices are in no one cluster file (``partitioner launch --workers D``, one pipeline each) are
planned one worker at a time: ``solve(num_replicas=D)`` prices the memory, and :func:`with_worker_reductions`
adds each stage's ``R`` over the workers' link.

The candidate of the shortest step wins (ties: fewer replicas, then blocks). Its plan records the
replicas' devices (``Plan.replica_devices``), each stage's ``R`` (``Plan.reduce_times``) and the step with
them (``Plan.step_time_s``). With M and the schedule fixed, its status is judged on the step against the
least of the candidates' proven pipeline bounds (``R`` only adds to a step, so each D's bound holds for
it with its ``R``), where every D gave a plan or was proven not to fit; with either chosen ("auto") a
pipeline's bound holds for its own M and schedule only, and the plan says "heuristic".

Example:
    >>> import partitioner as pt
    >>> graph = pt.chain_graph([4e11] * 4, param_bytes=[2**20] * 4, activation_bytes=[2**20] * 4)
    >>> graph.graph.update(batch_size=64, num_microbatches=1)
    >>> cluster = pt.Cluster.uniform(4, memory="96GiB", flops_per_s=100e12, bandwidth=100e9)
    >>> choice = plan_replicas(graph, cluster, batch_size=64, time_limit_s=5)
    >>> choice.plan.num_replicas, choice.plan.num_stages   # 4 MiB of weights: data parallel
    (4, 1)
    >>> [(c.num_replicas, c.layout, round(c.step_time_s * 1e3, 2)) for c in choice.candidates]
    [(1, 'blocks', 4.38), (2, 'blocks', 4.27), (2, 'strided', 4.27), (4, 'blocks', 4.06)]
    >>> heavy = pt.chain_graph([4e11] * 4, param_bytes=[2**33] * 4, activation_bytes=[2**20] * 4)
    >>> heavy.graph.update(batch_size=64, num_microbatches=1)
    >>> choice = plan_replicas(heavy, cluster, batch_size=64, time_limit_s=5)
    >>> choice.plan.num_replicas, choice.plan.num_stages   # 32 GiB of weights: a pipeline
    (1, 4)
    >>> # D = 2: each stage's R (172 ms) puts every M within choose's margin of the shortest step: M = 1 wins
    >>> [(c.num_replicas, c.step_time_s and round(c.step_time_s * 1e3, 1)) for c in choice.candidates]
    [(1, 4.4), (2, 179.8), (2, 179.8), (4, None)]
    >>> choice.best(devices_per_replica=1) is None        # data parallel does not fit: the reason says why
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from partitioner.cluster import Cluster, subset
from partitioner.cost import reduce_times
from partitioner.errors import InfeasiblePlanError, InputError, SolverTimeoutError
from partitioner.plan import Plan
from partitioner.problem import Reductions
from partitioner.search.choose import AUTO, choose
from partitioner.simulate import simulate
from partitioner.verdict import least_bound, on_step

LAYOUTS = ("blocks", "strided")


@dataclass(frozen=True)
class ReplicaCandidate:
    """One D x K tried: its plan (replica 0's, with the replicas recorded) and step, or why it has none."""

    num_replicas: int  # D
    devices_per_replica: int  # K: the devices replica 0's plan may use (it may use fewer)
    layout: str  # "blocks" or "strided"
    plan: Plan | None  # None when no plan fits
    reason: str = ""  # why no plan fits (the planner's message), else ""
    timed_out: bool = False  # True: the search found no plan in its time, which proves nothing about fitting

    @property
    def step_time_s(self) -> float | None:
        return None if self.plan is None else self.plan.step_time_s


@dataclass(frozen=True)
class ReplicaChoice:
    """What :func:`plan_replicas` decided: the plan, the layer graph it was made for, every candidate."""

    plan: Plan  # replica 0's placement, M and schedule; replica_devices, reduce_times, the step with R
    graph: nx.DiGraph  # the graph rescaled to a micro-batch of replica 0: validate and simulate with it
    candidates: tuple[ReplicaCandidate, ...]  # D ascending, blocks before strided

    def best(
        self, *, num_replicas: int | None = None, devices_per_replica: int | None = None
    ) -> ReplicaCandidate | None:
        """The fitting candidate of the shortest step among those with this D (or K), None if none fits."""
        fitting = [
            c
            for c in self.candidates
            if c.plan is not None
            and num_replicas in (None, c.num_replicas)
            and devices_per_replica in (None, c.devices_per_replica)
        ]
        return min(fitting, key=_rank, default=None)


def plan_replicas(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    batch_size: int | None = None,
    replicas: int | str = AUTO,
    num_microbatches: int | str = AUTO,
    schedule: str = AUTO,
    recompute: str = "never",
    time_limit_s: float = 10.0,
    **solve_options: Any,
) -> ReplicaChoice:
    """Chooses D replicas of a pipeline on ``cluster`` for a global batch, with their placement, M and schedule.

    Args:
        graph: a layer graph recording the batch its costs were measured at (as for :func:`choose`).
        cluster: every device, in the order replicas are laid on (see the module docstring).
        batch_size: the global batch B, split evenly over the replicas; the graph's own when None.
        replicas: "auto" (every D that divides B, up to the number of devices) or a fixed D.
        num_microbatches, schedule, recompute: per replica, as :func:`choose` takes them.
        time_limit_s: the whole budget, shared equally by the candidates.
        **solve_options: the other arguments of :func:`partitioner.solve` (optimizer_slots, cost, options).

    Returns:
        A ReplicaChoice: the plan of the shortest step with its ``R`` (ties: fewer replicas, then
        blocks), its rescaled graph, and every candidate.

    Raises:
        InfeasiblePlanError: no candidate fits; the message names each and why.
        InputError: a bad batch size or number of replicas.
    """
    batch_size = batch_size if batch_size is not None else graph.graph.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be the global batch, an integer >= 1. Received: {batch_size!r}.")
    if solve_options.get("pins"):
        raise InputError("pins fix one pipeline's devices; plan replicas without pins (or plan with replicas=1).")
    counts = _replica_counts(batch_size, cluster.num_devices, replicas)
    layouts = [(d, layout) for d in counts for layout in LAYOUTS if layout == "blocks" or 1 < d < cluster.num_devices]
    # a share of the budget per candidate that needs a search: one device per replica is planned at once
    share_s = time_limit_s / max(1, sum(cluster.num_devices // d > 1 for d, _ in layouts))
    tried: list[ReplicaCandidate] = []
    graphs: dict[tuple[int, str], nx.DiGraph] = {}
    bounds: list[float | None] = []
    for d, layout in layouts:
        groups = _groups(cluster, d, layout)
        if isinstance(num_microbatches, int) and batch_size // d < num_microbatches:
            reason = f"{batch_size // d} samples per replica cannot make {num_microbatches} micro-batches"
            tried.append(ReplicaCandidate(d, len(groups[0]), layout, None, reason))
            bounds.append(math.inf)  # outside the search: M is fixed
            continue
        try:
            chosen = choose(
                graph,
                _replica_zero(cluster, groups, name=cluster.name if d == 1 else f"{cluster.name}, replica 0 of {d}"),
                batch_size=batch_size // d,
                num_microbatches=num_microbatches,
                schedule=schedule,
                recompute=recompute,
                time_limit_s=share_s,
                num_replicas=d,  # each stage's all-reduce holds a packed copy of its gradients
                reductions=Reductions.over_groups(cluster, groups),  # and takes this long: the search weighs it
                **solve_options,
            )
        except InfeasiblePlanError as error:  # SolverTimeoutError included: no bound from it
            timed_out = isinstance(error, SolverTimeoutError) or "within time_limit_s" in str(error)
            tried.append(ReplicaCandidate(d, len(groups[0]), layout, None, str(error).splitlines()[0], timed_out))
            bounds.append(None if timed_out else math.inf)
            continue
        plan = _with_replicas(chosen.plan, chosen.graph, cluster, groups)
        tried.append(ReplicaCandidate(d, len(groups[0]), layout, plan))
        graphs[(d, layout)] = chosen.graph
        bounds.append(chosen.plan.step_lower_bound_s)
    fitting = [c for c in tried if c.plan is not None]
    if not fitting:
        lines = "\n".join(
            f"  D = {c.num_replicas} x K = {c.devices_per_replica} ({c.layout}): {c.reason}" for c in tried
        )
        raise InfeasiblePlanError(f"No number of replicas fits the batch of {batch_size} on {cluster.name}:\n{lines}")
    best = min(fitting, key=_rank)
    assert best.plan is not None
    fixed = num_microbatches != AUTO and schedule != AUTO  # else a plan's bound holds for its own M and schedule only
    plan = _verdict(best.plan, bounds if fixed else [None])
    return ReplicaChoice(plan=plan, graph=graphs[(best.num_replicas, best.layout)], candidates=tuple(tried))


def _replica_counts(batch_size: int, num_devices: int, replicas: int | str) -> list[int]:
    if replicas == AUTO:
        return [d for d in range(1, num_devices + 1) if batch_size % d == 0]
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputError(f"replicas must be 'auto' or an integer >= 1. Received: {replicas!r}.")
    if replicas > num_devices or batch_size % replicas:
        raise InputError(
            f"replicas={replicas} needs at least {replicas} devices and a batch it divides: the cluster has "
            f"{num_devices} devices, the batch {batch_size} samples. Expected a divisor of {batch_size} up to "
            f"{num_devices}, or replicas='auto'."
        )
    return [replicas]


def _groups(cluster: Cluster, num_replicas: int, layout: str) -> tuple[tuple[str, ...], ...]:
    """The devices of each replica, in the cluster's order (module docstring: blocks or strided)."""
    k = cluster.num_devices // num_replicas
    names = cluster.names
    if layout == "blocks":
        return tuple(tuple(names[r * k : (r + 1) * k]) for r in range(num_replicas))
    return tuple(tuple(names[r + j * num_replicas] for j in range(k)) for r in range(num_replicas))


def _replica_zero(cluster: Cluster, groups: Sequence[Sequence[str]], name: str) -> Cluster:
    """Replica 0's devices, with their links; where devices of one pool (a shared processor) serve several
    replicas, each pool's capacity scaled by replica 0's share of its devices there: the replicas compute
    alike at once, so while k of replica 0's devices of the pool compute, (share of all) / (share of replica
    0) x k do (C / D on a pool every replica lies on)."""
    zero = subset(cluster, groups[0], name=name)
    pools = {d.pool: d.pool_capacity for d in zero.devices if d.pool is not None}
    if not pools or len(groups) == 1:
        return zero
    members = [cluster.devices[cluster.index(n)] for group in groups for n in group]
    share = {
        pool: capacity * sum(d.pool == pool for d in zero.devices) / sum(d.pool == pool for d in members)
        for pool, capacity in pools.items()
    }
    return zero.with_pool_capacities(share)


def _with_replicas(plan: Plan, graph: nx.DiGraph, cluster: Cluster, groups: Sequence[Sequence[str]]) -> Plan:
    """``plan`` (replica 0's) with the replicas' devices, each stage's R after its last action, and the step."""
    position = {name: k for k, name in enumerate(groups[0])}
    replica_devices = tuple(tuple(group[position[d]] for d in plan.devices) for group in groups)
    priced = reduce_times(Reductions.over_groups(cluster, groups), graph, plan.assignment)
    times = {d: priced.get(d, 0.0) for d in plan.devices}
    if len(groups) == 1:
        return dataclasses.replace(plan, reduce_times=times)
    replicated = dataclasses.replace(plan, replica_devices=replica_devices, reduce_times=times)
    zero = _replica_zero(cluster, groups, cluster.name)
    step = simulate(replicated, graph, subset(zero, plan.devices)).step_time_s  # R priced by the simulator
    return dataclasses.replace(replicated, step_time_s=step)


def with_worker_reductions(plan: Plan, graph: nx.DiGraph, cluster: Cluster, bandwidth_bytes_per_s: float) -> Plan:
    """``plan`` (one worker's pipeline, priced as one of ``plan.priced_replicas``: ``solve(num_replicas=D)``) with
    each stage's ``R``: its weight gradients all-reduced with the same stage of the other D - 1 workers, a ring
    over a link of ``bandwidth_bytes_per_s`` between the workers (``cost.ring_allreduce_s``, the stage's device's
    fixed cost of an action), after the stage's last action; its step simulated with them and judged against its
    pipeline's bound on the step (``R`` only lengthens a step). The workers' link is not in a worker's cluster
    file, so it is given here. This prices a plan made without them (a baseline compared on the same step);
    ``solve(..., reductions=Reductions.between_workers(cluster, D, BW))`` weighs them in the search itself.

    Example:
        >>> import partitioner as pt
        >>> graph = pt.chain_graph([4e11] * 4, param_bytes=[2**28] * 4, activation_bytes=[2**20] * 4)
        >>> cluster = pt.Cluster.uniform(2, memory="16GiB", flops_per_s=100e12, bandwidth=100e9)
        >>> plan = pt.solve(graph, cluster, num_microbatches=4, num_replicas=2, time_limit_s=5)
        >>> priced = with_worker_reductions(plan, graph, cluster, 10e9)
        >>> [round(priced.reduce_times[d] * 1e3, 1) for d in priced.devices]  # 512 MiB a stage at 10 GB/s
        [53.7, 53.7]
        >>> priced.step_time_s > plan.step_time_s
        True
    """
    _check_worker_plan(plan)
    reductions = Reductions.between_workers(cluster, plan.priced_replicas, bandwidth_bytes_per_s)
    return with_reduce_times(plan, graph, cluster, reduce_times(reductions, graph, plan.assignment))


def with_reduce_times(plan: Plan, graph: nx.DiGraph, cluster: Cluster, reduce_times: dict[str, float]) -> Plan:
    """``plan`` (one worker's pipeline, priced as one of ``plan.priced_replicas``) with each stage's ``R`` taking
    ``reduce_times[device]`` seconds (a device left out: 0), after the stage's last action; its step simulated with
    them and judged against its pipeline's bound (``R`` only lengthens a step). ``with_worker_reductions`` prices
    them from the workers' link; ``runtime.plan_and_wrap`` with workers gives the times it measured.

    Example:
        >>> import partitioner as pt
        >>> graph = pt.chain_graph([4e11] * 4, param_bytes=[2**28] * 4, activation_bytes=[2**20] * 4)
        >>> cluster = pt.Cluster.uniform(2, memory="16GiB", flops_per_s=100e12, bandwidth=100e9)
        >>> plan = pt.solve(graph, cluster, num_microbatches=4, num_replicas=2, time_limit_s=5)
        >>> priced = with_reduce_times(plan, graph, cluster, {plan.devices[0]: 0.05})
        >>> round((priced.step_time_s - plan.step_time_s) * 1e3)  # stage 0 ends the step: all of its R shows
        50
    """
    _check_worker_plan(plan)
    unknown = sorted(set(reduce_times) - set(plan.devices))
    if unknown:
        raise InputError(
            f"reduce_times names devices the plan does not have: {unknown}. Expected some of {list(plan.devices)}."
        )
    priced = dataclasses.replace(plan, reduce_times={d: float(reduce_times.get(d, 0.0)) for d in plan.devices})
    priced = dataclasses.replace(priced, step_time_s=simulate(priced, graph, subset(cluster, plan.devices)).step_time_s)
    if plan.step_lower_bound_s is None:
        return priced
    return on_step(priced, plan.step_lower_bound_s, searched=plan.status != "heuristic")


def _check_worker_plan(plan: Plan) -> None:
    if plan.num_replicas > 1:
        raise InputError(
            f"The plan holds {plan.num_replicas} replicas of this cluster's devices (plan_replicas), whose all-reduce "
            "it prices already. Expected one worker's pipeline priced as one of D (solve(..., num_replicas=D))."
        )
    if plan.priced_replicas < 2:
        raise InputError(
            "The plan was priced for one worker: there is no all-reduce between workers to price. Expected a plan "
            "of one of D >= 2 workers (solve(..., num_replicas=D), partitioner plan --workers D)."
        )


def _rank(candidate: ReplicaCandidate) -> tuple[float, int, int]:
    assert candidate.plan is not None
    return (candidate.plan.step_time_s, candidate.num_replicas, LAYOUTS.index(candidate.layout))


def _verdict(plan: Plan, bounds: Sequence[float | None]) -> Plan:
    """``plan`` judged on its step against the least of the candidates' bounds (None where one is unknown)."""
    return on_step(plan, least_bound(bounds))
