"""Checks that a plan is one the runtime can execute: the same validator the runtime and the tests use."""

from __future__ import annotations

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.errors import PlanError
from partitioner.graph import colocation_groups
from partitioner.order import same_devices
from partitioner.plan import Plan
from partitioner.units import format_bytes


def validate_plan(plan: Plan, graph: nx.DiGraph, cluster: Cluster, *, check_memory: bool = True) -> None:
    """Raises PlanError unless ``plan`` places exactly ``graph``'s nodes on ``cluster`` legally.

    Checked: every node has a device and no unknown node or device appears; the plan was made for
    this cluster's devices (listed in any order: ``plan.devices`` is the pipeline order the planner
    chose); every edge goes forward in that order (no backward traffic);
    colocated nodes share a device; ``plan.recompute`` gives one mode per stage and keeps the last
    stage; every device's memory (in each stage's mode) holds what is put on it (unless
    ``check_memory`` is False, e.g. when the graph was profiled at another batch size).

    Example:
        >>> validate_plan(plan, graph, cluster)   # doctest: +SKIP
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"Expected a partitioner.Plan. Received: {type(plan).__name__}.")
    cluster = same_devices(cluster, plan.devices)  # a plan lists the devices in the pipeline order it chose
    if tuple(cluster.names) != tuple(plan.devices):
        raise PlanError(
            f"The plan was made for devices {list(plan.devices)} but the cluster has {cluster.names}. "
            "Plan again for this cluster."
        )
    costs = CostModel(
        graph,
        cluster,
        num_microbatches=plan.num_microbatches,
        optimizer_slots=plan.optimizer_slots,
        schedule=plan.schedule,
    )
    where = costs.check_assignment(plan.assignment)
    if len(plan.recompute) != plan.num_stages or plan.recompute[-1:] == (True,):
        raise PlanError(
            f"The plan's recompute {list(plan.recompute)} must give one bool per stage ({plan.num_stages} "
            "stages, True: recomputed) and keep the last stage (never recomputed). Plan again."
        )
    for u, v in graph.edges:
        if where[u] > where[v]:
            raise PlanError(
                f"Edge '{u}' -> '{v}' goes backward: '{u}' is on {plan.assignment[u]} (stage position "
                f"{where[u]}) but '{v}' is on {plan.assignment[v]} (position {where[v]}). Stages must "
                "follow the graph's order so activations only flow forward."
            )
    for group, nodes in colocation_groups(graph).items():
        placed = sorted({plan.assignment[v] for v in nodes})
        if len(placed) > 1:
            raise PlanError(
                f"Colocation group '{group}' (a shared layer) is split across {placed}; its nodes "
                f"{nodes} share weights and must be on one device."
            )
    if not check_memory:
        return
    evaluation = costs.evaluate(plan.assignment, plan.recompute)
    for device in cluster.devices:
        need = evaluation.memory_bytes[device.name]
        if need > device.memory_bytes:
            raise PlanError(
                f"Device {device.name} needs {format_bytes(need)} but holds {format_bytes(device.memory_bytes)} "
                f"(with {evaluation.in_flight[device.name]} micro-batches in flight under {plan.schedule}, "
                f"M={plan.num_microbatches}, and {plan.optimizer_slots} optimizer slots"
                + (", its forward recomputed" if _recomputed(plan, device.name) else "")
                + "). Plan again with the memory constraint, use fewer micro-batches, the 1f1b schedule"
                + ("." if _recomputed(plan, device.name) else ", or recompute='auto'.")
            )


def _recomputed(plan: Plan, device: str) -> bool:
    """True iff ``device`` runs a stage of ``plan`` that recomputes its forward."""
    return device in plan.stages and plan.recompute[plan.stages.index(device)]
