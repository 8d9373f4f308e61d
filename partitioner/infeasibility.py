"""Explains why no plan fits: which layer or how much memory is missing, and what to do about it."""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from partitioner.cost import CostModel
from partitioner.errors import InfeasiblePlanError
from partitioner.graph import colocation_groups
from partitioner.schedule import FAMILIES, schedule_family
from partitioner.units import format_bytes


def _advice(costs: CostModel, fits_with_recompute: bool) -> str:
    # the schedules whose first device holds fewer micro-batches than this one's (1F1B's min(D, M) < GPipe's M)
    fewer = [
        family.name
        for family in FAMILIES.values()
        if family.in_flight(len(costs.devices), costs.num_microbatches, 0) < costs.max_in_flight
    ]
    recompute = (
        "Plan with recompute='auto': a split fits when stages run their forward again in the backward "
        "instead of keeping its activations (more compute, far less memory). Or add"
    )
    return (
        (recompute if fits_with_recompute else "Add")
        + " devices or devices with more memory, lower the batch size or the number of micro-batches, "
        + (f"plan for the {' or '.join(fewer)} schedule (fewer micro-batches in flight), " if fewer else "")
        + "or use mixed precision."
    )


def _least_in_flight(costs: CostModel) -> int:
    """The fewest micro-batches any stage of any plan holds: 1 under GPipe and 1F1B (the last stage); the
    schedule's own count (``CostModel.device_in_flight``)."""
    return min(costs.device_in_flight)


def _what(costs: CostModel) -> str:
    least = _least_in_flight(costs)
    rule = schedule_family(costs.schedule).in_flight_rule(costs.num_microbatches)
    held = f"activations of {least} micro-batch(es) in flight under {costs.schedule} ({rule})"
    if costs.looped:
        held += " and the gradients a backward makes of one micro-batch's outputs while it runs"
    if costs.recompute != "never":
        held += f", in the mode that needs least, recompute={costs.recompute!r}"
    return f"weights, gradients and {costs.optimizer_slots} optimizer slot(s) of trainable weights, {held}"


def _need(costs: CostModel, node: str) -> int:
    """The least bytes ``node`` can need in a stage: its figure in the mode that needs least (without
    the received tensors a recomputed stage holds) on a stage holding the fewest micro-batches any
    stage holds, so no plan needs less."""
    least = _least_in_flight(costs)
    return min(costs.node_memory_bytes(mode, least)[node] for mode in costs.modes)


def _split_group(
    costs: CostModel, grouped: Mapping[str, list[str]], pins: Mapping[str, str]
) -> InfeasiblePlanError | None:
    """The error for pins on two devices among a shared layer's calls and the layers between them.

    The calls of a shared layer run on one device, and stages follow the graph's order, so every
    layer on a path from one call to another runs there too (a tied embedding: the whole model).
    """
    for group, nodes in grouped.items():
        span = set(nodes)
        for first in nodes:
            below = nx.descendants(costs.graph, first)
            for last in nodes:
                if last != first:
                    span |= below & nx.ancestors(costs.graph, last)
        pinned: dict[str, str] = {}  # device -> the first node of the span pinned to it
        for v in costs.order:
            if v in span and v in pins:
                pinned.setdefault(pins[v], v)
        if len(pinned) > 1:
            (one, u), (other, v) = list(pinned.items())[:2]
            return InfeasiblePlanError(
                f"Pins split shared layer '{group}': its calls {nodes} share weights, so they run on one device, "
                f"and stages follow the graph's order, so the {len(span)} layers from its first call to its last "
                f"run there too; but '{u}' is pinned to {one} and '{v}' to {other}. Pin them to one device or "
                "leave them unpinned (a model whose first and last layers share weights, such as a tied "
                "embedding, runs as one stage)."
            )
    return None


def explain_infeasible(
    costs: CostModel, pins: Mapping[str, str] | None = None, *, fits_with_recompute: bool = False
) -> InfeasiblePlanError:
    """Returns the most specific InfeasiblePlanError for a problem with no feasible plan.

    Checks, in order: a single layer (or shared-layer group) larger than any device that may hold
    it; more memory in total than the devices hold; then a generic message for splits that fail
    only because stages must follow the graph's order. ``fits_with_recompute`` (the caller found a
    plan that fits with recompute="auto") turns the advice to recomputation.
    """
    pins = dict(pins or {})
    capacity = {d.name: d.memory_bytes for d in costs.cluster.devices}
    largest = max(capacity.values())
    units = [[v] for v in costs.order]
    grouped = colocation_groups(costs.graph)
    if grouped:
        in_group = {v for nodes in grouped.values() for v in nodes}
        units = [[v] for v in costs.order if v not in in_group] + list(grouped.values())
    advice = _advice(costs, fits_with_recompute)
    for nodes in units:
        need = sum(_need(costs, v) for v in nodes)
        pinned = {pins[v] for v in nodes if v in pins}
        limit = capacity[next(iter(pinned))] if len(pinned) == 1 else largest
        where = f"its pinned device {next(iter(pinned))}" if len(pinned) == 1 else "the largest device"
        if need > limit:
            label = f"layer '{nodes[0]}'" if len(nodes) == 1 else f"shared layer group {nodes}"
            return InfeasiblePlanError(
                f"{label} alone needs {format_bytes(need)} ({_what(costs)}) but {where} holds "
                f"{format_bytes(limit)}. Received: devices={costs.devices}. {advice}"
            )
    total = sum(_need(costs, v) for v in costs.order)
    held = costs.cluster.total_memory_bytes
    if total > held:
        return InfeasiblePlanError(
            f"The model needs {format_bytes(total)} in total ({_what(costs)}), the {len(capacity)} devices "
            f"hold {format_bytes(held)} ({format_bytes(total - held)} short). {advice}"
        )
    index = {d: k for k, d in enumerate(costs.devices)}
    for u, v in costs.graph.edges:
        if u in pins and v in pins and index[pins[u]] > index[pins[v]]:
            return InfeasiblePlanError(
                f"Pins contradict the pipeline order: '{u}' is pinned to {pins[u]} but its consumer '{v}' "
                f"to the earlier device {pins[v]}. Pin '{v}' to {pins[u]} or later, or reorder the cluster."
            )
    split = _split_group(costs, grouped, pins)
    if split is not None:
        return split
    return InfeasiblePlanError(
        f"The model needs {format_bytes(total)} of the {format_bytes(held)} the devices hold, but no split "
        "into stages that follow the graph's order fits every device (layers cannot be packed into the "
        f"gaps left by their neighbours). Received: devices={costs.devices}, pins={pins or None}. {advice}"
    )
