"""Scores a placement into a Plan: the cost model's figures and the step of its schedule simulated.

:class:`partitioner.plan.Plan` is a plain record; this is where one is made from a placement, so that
``plan.py`` needs no simulator (and the simulator can take plans); ``Plan.cost_model`` builds the cost
model a plan was made with.

Example:
    >>> costs = pt.CostModel(graph, cluster, num_microbatches=8, recompute="auto")    # doctest: +SKIP
    >>> plan = score_assignment(assignment, costs, method="manual")                    # doctest: +SKIP
    >>> plan.step_time_s == pt.simulate(plan, graph, cluster).step_time_s              # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from partitioner.cost import CostModel
from partitioner.errors import ClusterError, PlanError
from partitioner.graph import structure
from partitioner.plan import STATUSES, Plan
from partitioner.simulate import simulate_assignment
from partitioner.verdict import on_step


def score_assignment(
    assignment: Mapping[str, str],
    costs: CostModel,
    *,
    method: str,
    status: str = "heuristic",
    lower_bound_s: float | None = None,
    solve_time_s: float = 0.0,
    recompute: Sequence[bool] | None = None,
) -> Plan:
    """Scores ``assignment`` {node: device name} with ``costs`` and returns the plan.

    The plan is for ``costs.schedule``: its memory counts that schedule's micro-batches in flight and
    its step time is that schedule simulated. ``recompute`` gives each stage's mode (True:
    recomputed); by default ``costs.recompute`` chooses them ("auto": where kept activations do not fit).

    Args:
        assignment: {node: device name} for every node of ``costs.graph``.
        costs: the cost model (graph, cluster, M, optimizer slots, cost source, schedule, recompute).
        method: the planner's name, recorded in the plan.
        status: "optimal", "feasible" or "heuristic".
        lower_bound_s: a proven lower bound on the bottleneck (capped at the plan's bottleneck).
        solve_time_s: wall-clock seconds the planner took.
        recompute: one bool per stage, or None for ``costs.recompute``'s choice.

    Raises:
        PlanError: for an unknown status, a placement that does not match the graph or cluster, an
            edge that goes backward, or a ``recompute`` that does not give one bool per stage.
    """
    if status not in STATUSES:
        raise PlanError(f"status must be one of {STATUSES}. Received: {status!r}.")
    ev = costs.evaluate(assignment, recompute)
    simulated = simulate_assignment(costs, assignment, schedule=costs.schedule, recompute=ev.recompute)
    if lower_bound_s is not None:
        lower_bound_s = min(lower_bound_s, ev.bottleneck_s)
    return Plan(
        assignment={v: assignment[v] for v in costs.order},
        devices=tuple(costs.devices),
        method=method,
        status=status,
        num_microbatches=costs.num_microbatches,
        optimizer_slots=costs.optimizer_slots,
        cost=costs.cost,
        stage_times=ev.stage_times,
        compute_times=ev.compute_times,
        receive_times=ev.receive_times,
        memory_bytes=ev.memory_bytes,
        capacity_bytes={d.name: d.memory_bytes for d in costs.cluster.devices},
        bottleneck_s=ev.bottleneck_s,
        lower_bound_s=lower_bound_s,
        step_time_s=simulated.step_time_s,
        serial_step_s=costs.serial_step_s(),
        transfer_bytes=ev.transfer_bytes,
        solve_time_s=solve_time_s,
        model_name=costs.graph.graph.get("model_name"),
        fill_drain_step_s=ev.step_time_s,
        schedule=costs.schedule,
        recompute=ev.recompute,
        structure=structure(costs.graph),
        step_overhead_s=step_overhead_s(costs),
        priced_replicas=costs.num_replicas,
        reduce_times=costs.reduce_times(assignment),  # in the step already, where the cost model prices them
    )


def step_overhead_s(costs: CostModel) -> float:
    """The profile's ``step_overhead_s`` (the step's own work beside the pipeline) where it was measured on a
    device of this cluster (``profiled_device``), else 0: that work is dispatch and small ops more than
    FLOPs, so a figure measured on one kind of device says nothing of another's.

    Example:
        >>> import partitioner as pt
        >>> graph = pt.chain_graph([1e9])
        >>> graph.graph.update(step_overhead_s=0.002, profiled_device="/job:localhost/replica:0/task:0/device:CPU:0")
        >>> step_overhead_s(CostModel(graph, pt.Cluster.uniform(1, memory="1GiB", prefix="/CPU:")))
        0.002
        >>> step_overhead_s(CostModel(graph, pt.Cluster.uniform(1, memory="1GiB")))  # planned for /GPU:0
        0.0
    """
    overhead, where = costs.graph.graph.get("step_overhead_s"), costs.graph.graph.get("profiled_device")
    if not overhead or where is None:
        return 0.0
    try:
        costs.cluster.index(str(where))  # any spelling of the device's name
    except ClusterError:
        return 0.0
    return float(overhead)


def shorter_step(plan: Plan, than: Plan) -> bool:
    """True iff ``plan`` has a shorter simulated step than ``than``, then a smaller bottleneck, then fewer bytes."""
    return _first_smaller(
        (plan.step_time_s, than.step_time_s),
        (plan.bottleneck_s, than.bottleneck_s),
        (plan.transfer_bytes, than.transfer_bytes),
    )


def smaller_bottleneck(plan: Plan, than: Plan) -> bool:
    """True iff ``plan`` has a smaller bottleneck than ``than``, then a shorter simulated step, then fewer bytes."""
    return _first_smaller(
        (plan.bottleneck_s, than.bottleneck_s),
        (plan.step_time_s, than.step_time_s),
        (plan.transfer_bytes, than.transfer_bytes),
    )


def _first_smaller(*pairs: tuple[float, float]) -> bool:
    """True iff the first pair whose values differ by more than one part in 1e9 has the smaller first value."""
    for a, b in pairs:
        if a < b * (1 - 1e-9):
            return True
        if a > b * (1 + 1e-9):
            return False
    return False


def with_step_bound(
    plan: Plan, costs: CostModel, *, proven_s: float | None = None, proven_optimal: bool = False
) -> Plan:
    """``plan`` judged on its step, for planners that minimise it: ``step_lower_bound_s`` is the larger
    of ``costs.step_lower_bound_s()`` (every legal plan of the graph, cluster, M and schedule) and
    ``proven_s`` (a planner's own proven bound on the step), capped at the plan's step; the status is
    "optimal" when the step meets that bound or ``proven_optimal`` (the planner proved it), else
    "feasible" ("heuristic" stays for a plan the search did not find): ``partitioner.verdict``'s rule.

    ``costs`` may list the devices in another order than the plan (the bound holds for every order).

    Example:
        >>> import partitioner as pt
        >>> costs = pt.CostModel(pt.chain_graph([1e12] * 2), pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12))
        >>> one_device = score_assignment(dict.fromkeys(costs.order, "/GPU:0"), costs, method="manual")
        >>> plan = with_step_bound(one_device, costs)  # M = 1: nothing overlaps, one device is the best
        >>> plan.step_time_s, plan.step_lower_bound_s, plan.status, plan.gap
        (2.0, 2.0, 'optimal', 0.0)
    """
    bound = max(costs.step_lower_bound_s(), proven_s if proven_s is not None else 0.0)
    return on_step(plan, bound, proven=proven_optimal, searched=plan.status != "heuristic")
