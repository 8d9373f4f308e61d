"""Checks that a plan is one the runtime can execute: the same validator the runtime and the tests use."""

from __future__ import annotations

import dataclasses

import networkx as nx

from partitioner.cluster import Cluster, same_devices
from partitioner.errors import PlanError
from partitioner.graph import colocation_groups, structure, topological_order
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
    costs = plan.cost_model(graph, cluster, cost="flops")  # memory and structure: no times needed
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


def match_names(plan: Plan, graph: nx.DiGraph) -> Plan:
    """``plan`` with ``graph``'s node names, where its own names differ but its architecture is the graph's.

    Keras makes names up by counting (``dense_6`` the second time a ``build()`` runs in a process, or
    after ``keras.models.clone_model``), so a plan saved for one build names nodes another build lacks.
    Where the plan records its structure (``plan.structure``) and it equals the graph's
    (``partitioner.graph.structure``: layer types, configs and edges, in topological order), node i of
    the plan is node i of the graph. A plan with the graph's names, or without a structure, is returned
    as it is (``validate_plan`` then says which names differ).

    Raises:
        PlanError: naming the first node where the plan's structure and the graph's differ.

    Example:
        >>> plan = match_names(plan, profile_model(model_built_again))   # doctest: +SKIP
    """
    names = topological_order(graph)
    if set(names) == set(plan.assignment) or not plan.structure:
        return plan
    theirs, ours = list(plan.structure), list(structure(graph))
    if theirs != ours:
        if not ours:
            raise PlanError(
                "The plan's node names differ from the model's, and the model's layer graph has no config "
                "digests to match them by. Profile the model with profiles.profile_model, or plan again for it."
            )
        i = next(i for i in range(max(len(theirs), len(ours))) if theirs[i : i + 1] != ours[i : i + 1])
        planned = list(plan.assignment)
        plan_node = f"'{planned[i]}' ({theirs[i]})" if i < len(theirs) else "nothing (it has fewer nodes)"
        model_node = f"'{names[i]}' ({ours[i]})" if i < len(ours) else "nothing (it has fewer nodes)"
        raise PlanError(
            f"The plan was made for another model: node {i} in topological order is {model_node} in this "
            f"model but {plan_node} in the plan (type, config digest <- positions of the nodes read). Plan "
            "again for this model (runtime.plan_and_wrap does both), or load the plan made for it."
        )
    return dataclasses.replace(plan, assignment=dict(zip(names, plan.assignment.values(), strict=True)))
