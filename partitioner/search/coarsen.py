"""Coarsens a layer graph into units the solver places whole, and refines a placement near its stage boundaries.

This is the multilevel scheme of graph partitioners (Karypis and Kumar, "A fast and high quality
multilevel scheme for partitioning irregular graphs", SIAM J. Sci. Comput. 20(1), 1998), cut to
what a pipeline needs. Every stage of a pipeline is a set of nodes closed under the graph's order,
so the units are runs of consecutive nodes in the topological order:

    coarsen     segments(): cut the topological order into a few hundred runs of about equal work
                and memory, cutting where few bytes cross (a contracted graph is acyclic because
                every edge between runs points forward)
    solve       place the runs whole (CP-SAT, or the exact DP on a chain)
    refine      around_boundaries(): every node within ``radius`` places of a stage boundary becomes
                a unit of its own that may move to the devices around it; the rest stay put in runs

A unit holds nodes of at most one colocation group (shared layer), so colocation constraints
between units are exactly those between nodes, and a pinned node is always a unit of its own.
The best placement of the units is only a placement of the nodes: a bound proven on the units
does not bound the layer graph (docs/cost-model.md, "Coarsening").

Example:
    >>> import partitioner as pt
    >>> from partitioner.synthetic import random_dag
    >>> costs = pt.CostModel(random_dag(100, seed=1), pt.Cluster.uniform(2, memory="16GiB"))
    >>> coarse = segments(costs, num_units=10)
    >>> len(coarse.units), sum(len(u) for u in coarse.units)
    (10, 100)
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx

from partitioner.cost import CostModel, forward_share
from partitioner.errors import InputError
from partitioner.graph import gradient_bytes, trainable_param_bytes

__all__ = [
    "Coarsening",
    "UnitCosts",
    "around_boundaries",
    "chain_quotient",
    "cut_bytes",
    "identity",
    "segments",
    "unit_costs",
]


@dataclass(frozen=True)
class Coarsening:
    """Nodes grouped into units: the solver gives every unit one device, every node of it runs there.

    ``units[i]`` lists the nodes of unit i in topological order, and the units follow the topological
    order too, so an edge between two units goes from the lower index to the higher. ``domains[i]``
    is the (lowest, highest) device index unit i may take; a pinned unit has lowest == highest.
    """

    units: tuple[tuple[str, ...], ...]  # nodes of each unit, in topological order
    domains: tuple[tuple[int, int], ...]  # (lowest, highest) device index per unit

    @property
    def num_units(self) -> int:
        """How many units the solver places."""
        return len(self.units)

    def unit_of(self) -> dict[str, int]:
        """{node: index of its unit}."""
        return {v: i for i, unit in enumerate(self.units) for v in unit}

    def expand(self, unit_devices: Sequence[int], devices: Sequence[str]) -> dict[str, str]:
        """{node: device name} from one device index per unit.

        Example:
            >>> Coarsening((("a", "b"), ("c",)), ((0, 1), (0, 1))).expand([0, 1], ["/GPU:0", "/GPU:1"])
            {'a': '/GPU:0', 'b': '/GPU:0', 'c': '/GPU:1'}
        """
        return {v: devices[k] for unit, k in zip(self.units, unit_devices) for v in unit}

    def project(self, assignment: Mapping[str, str], devices: Sequence[str]) -> list[int]:
        """One device index per unit from a node placement: the device of most of the unit's work
        (of its first node where there is no work), clipped to the unit's domain."""
        index = {name: k for k, name in enumerate(devices)}
        result = []
        for unit, (lo, hi) in zip(self.units, self.domains):
            counts: dict[int, int] = {}
            for v in unit:
                counts[index[assignment[v]]] = counts.get(index[assignment[v]], 0) + 1
            k = max(counts, key=lambda d: (counts[d], d == index[assignment[unit[0]]]))
            result.append(min(max(k, lo), hi))
        return result


@dataclass(frozen=True)
class UnitCosts:
    """The cost model summed over units: what the CP-SAT model of a coarsening needs.

    A node whose output is read in another unit is a *sender*: the device of each reading unit
    receives its output once, as for nodes in the fine model (docs/cost-model.md).
    """

    compute_s: list[list[float]]  # [unit][device index]: seconds of the unit's nodes on that device (kept)
    memory: list[int]  # bytes per unit (sum of its nodes' memory, kept, on the fullest stage)
    edges: list[tuple[int, int]]  # (unit, later unit) joined by at least one edge of the graph
    senders: list[tuple[str, int, tuple[int, ...]]]  # (node, its unit, the other units reading its output)
    colocated: list[list[int]]  # units that hold calls of one shared layer: one device for all
    # per mode of CostModel.modes (partitioner.cost.mode_cost): seconds [unit][device], and bytes [device][unit]
    # budgeted for the micro-batches in flight of the device's position (CostModel.device_in_flight)
    mode_compute_s: dict[str, list[list[float]]] = field(default_factory=dict)
    mode_memory: dict[str, list[list[int]]] = field(default_factory=dict)
    # per mode, bytes [unit] budgeted for the last stage's micro-batches in flight (CostModel.last_in_flight)
    mode_memory_last: dict[str, list[int]] = field(default_factory=dict)


def _check_pins(pins: Mapping[str, int] | None, costs: CostModel) -> dict[str, int]:
    pins = dict(pins or {})
    for v, k in pins.items():
        if v not in costs.compute_s or not 0 <= k < len(costs.devices):
            raise InputError(
                f"pins must map nodes of the layer graph to device indices 0..{len(costs.devices) - 1}. "
                f"Received: {v!r} -> {k!r}."
            )
    return pins


def identity(costs: CostModel, pins: Mapping[str, int] | None = None) -> Coarsening:
    """One unit per node, any device (or its pinned device): the fine problem itself.

    Args:
        costs: the cost model of the layer graph and cluster.
        pins: {node: device index} placements that must hold.
    """
    pins = _check_pins(pins, costs)
    last = len(costs.devices) - 1
    return Coarsening(
        tuple((v,) for v in costs.order),
        tuple((pins[v], pins[v]) if v in pins else (0, last) for v in costs.order),
    )


def _node_weights(costs: CostModel) -> list[float]:
    """Each node's share of the work or of the memory, whichever is larger (plus a little per node,
    so that nodes without work or memory still spread over units)."""
    order = costs.order
    work = [sum(costs.compute_s[v]) for v in order]
    memory = [float(costs.memory[v]) for v in order]
    total_work, total_memory = sum(work), sum(memory)
    floor = 0.05 / len(order)
    return [
        max(w / total_work if total_work > 0 else 0.0, m / total_memory if total_memory > 0 else 0.0, floor)
        for w, m in zip(work, memory)
    ]


def cut_bytes(costs: CostModel) -> list[int]:
    """cut[i] = bytes of the outputs that cross a cut just before position i of the topological order."""
    return _cut_bytes(costs)


def _cut_bytes(costs: CostModel) -> list[int]:
    """cut[i] = bytes of the outputs that cross a cut just before position i of the topological order."""
    position = {v: i for i, v in enumerate(costs.order)}
    n = len(costs.order)
    diff = [0] * (n + 1)
    for u in costs.order:
        successors = [position[s] for s in costs.graph.successors(u)]
        if successors and costs.out_bytes[u] > 0:
            diff[position[u] + 1] += costs.out_bytes[u]
            diff[max(successors) + 1] -= costs.out_bytes[u]
    return list(itertools.accumulate(diff))[:n]


def _forced_cuts(costs: CostModel, pins: Mapping[str, int]) -> list[int]:
    """Positions a unit boundary must fall before: around pinned nodes, and where one shared layer's
    calls give way to another's (so that a unit holds at most one colocation group)."""
    order, nodes = costs.order, costs.graph.nodes
    cuts = {0, len(order)}
    last_group = None
    for i, v in enumerate(order):
        if v in pins:
            cuts.update((i, i + 1))
        group = nodes[v].get("colocation_group")
        if group is not None:
            if last_group is not None and str(group) != last_group:
                cuts.add(i)
            last_group = str(group)
    return sorted(cuts)


def segments(
    costs: CostModel, num_units: int, pins: Mapping[str, int] | None = None, *, cuts: Iterable[int] = ()
) -> Coarsening:
    """Cuts the topological order into about ``num_units`` runs of similar work and memory.

    Each run ends, among the places where it holds 0.5 to 1.5 times its share of work (or memory),
    where the fewest bytes cross. Pinned nodes are runs of their own.

    Args:
        costs: the cost model of the layer graph and cluster.
        num_units: the number of runs to aim for (at least 1).
        pins: {node: device index} placements that must hold.
        cuts: positions in the topological order where a run must start, e.g. the stage boundaries
            of a plan to start from (so that the plan places whole runs).

    Raises:
        InputError: for a ``num_units`` below 1, or pins naming unknown nodes or devices.
    """
    if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
        raise InputError(f"num_units must be an integer >= 1. Received: {num_units!r}.")
    pins = _check_pins(pins, costs)
    order, n = costs.order, len(costs.order)
    weights = _node_weights(costs)
    prefix = [0.0, *itertools.accumulate(weights)]
    share = prefix[-1] / num_units
    cut = _cut_bytes(costs)
    forced = sorted(set(_forced_cuts(costs, pins)) | {i for i in cuts if 0 < i < n})
    units: list[tuple[str, ...]] = []
    start = 0
    while start < n:
        stop = forced[bisect.bisect_right(forced, start)]  # the next forced cut after start
        if prefix[stop] - prefix[start] <= 1.5 * share:
            end = stop
        else:
            # Candidate ends e (the run is [start, e)) with 0.5 to 1.5 shares of weight, before stop.
            first = max(bisect.bisect_left(prefix, prefix[start] + 0.5 * share), start + 1)
            last = max(bisect.bisect_right(prefix, prefix[start] + 1.5 * share) - 1, first)
            candidates = range(min(first, stop), min(last, stop) + 1)
            end = min(candidates, key=lambda e: (cut[e] if e < n else 0, abs(prefix[e] - prefix[start] - share)))
        units.append(tuple(order[start:end]))
        start = end
    last_device = len(costs.devices) - 1
    domains = tuple((pins[u[0]], pins[u[0]]) if u[0] in pins else (0, last_device) for u in units)
    return Coarsening(tuple(units), domains)


def around_boundaries(
    costs: CostModel, assignment: Mapping[str, str], radius: int, pins: Mapping[str, int] | None = None
) -> Coarsening:
    """Units for refining ``assignment``: free nodes near stage boundaries, fixed runs elsewhere.

    A node lying within ``radius`` places (in the topological order) of a node with a neighbour on
    another device may move to the devices of the nodes within ``radius`` places and of its
    neighbours; where that leaves more than its own device, it is a unit of its own. Consecutive
    nodes that cannot move and share a device form one unit fixed to that device.

    Args:
        costs: the cost model of the layer graph and cluster.
        assignment: {node: device name}, a legal placement to refine.
        radius: how many places on either side of a boundary are free to move (>= 0).
        pins: {node: device index} placements that must hold.

    Raises:
        InputError: for a negative ``radius``, or pins naming unknown nodes or devices.
    """
    if isinstance(radius, bool) or not isinstance(radius, int) or radius < 0:
        raise InputError(f"radius must be an integer >= 0. Received: {radius!r}.")
    pins = _check_pins(pins, costs)
    graph, order = costs.graph, costs.order
    n = len(order)
    where = costs.check_assignment(assignment)
    labels = [where[v] for v in order]

    def neighbours(v: str) -> list[str]:
        return [*graph.predecessors(v), *graph.successors(v)]

    diff = [0] * (n + 1)
    for i, v in enumerate(order):
        if any(where[w] != labels[i] for w in neighbours(v)):
            diff[max(0, i - radius)] += 1
            diff[min(n, i + radius + 1)] -= 1
    free = [c > 0 for c in itertools.accumulate(diff)][:n]
    forced = set(_forced_cuts(costs, pins))

    units: list[tuple[str, ...]] = []
    domains: list[tuple[int, int]] = []
    run: list[str] = []

    def close_run() -> None:
        if run:
            units.append(tuple(run))
            domains.append((where[run[0]], where[run[0]]))
            run.clear()

    for i, v in enumerate(order):
        lo = hi = labels[i]
        if free[i]:  # the devices within radius places, and those of its neighbours
            seen = labels[max(0, i - radius) : i + radius + 1] + [where[w] for w in neighbours(v)]
            lo, hi = min(seen), max(seen)
        if i in forced or lo < hi or v in pins or (run and where[run[-1]] != labels[i]):
            close_run()
        if v in pins:
            units.append((v,))
            domains.append((pins[v], pins[v]))
        elif lo < hi:
            units.append((v,))
            domains.append((lo, hi))
        else:
            run.append(v)
    close_run()
    return Coarsening(tuple(units), tuple(domains))


def unit_costs(costs: CostModel, coarsening: Coarsening) -> UnitCosts:
    """Sums the cost model over the units of ``coarsening``."""
    graph, num_devices = costs.graph, len(costs.devices)
    unit_of = coarsening.unit_of()
    compute = [[sum(costs.compute_s[v][k] for v in unit) for k in range(num_devices)] for unit in coarsening.units]
    memory = [sum(costs.memory[v] for v in unit) for unit in coarsening.units]
    edges = sorted({(unit_of[u], unit_of[v]) for u, v in graph.edges if unit_of[u] != unit_of[v]})
    senders = []
    for u in costs.order:
        if costs.out_bytes[u] <= 0:
            continue
        readers = tuple(sorted({unit_of[s] for s in graph.successors(u)} - {unit_of[u]}))
        if readers:
            senders.append((u, unit_of[u], readers))
    groups: dict[str, set[int]] = {}
    for v, group in graph.nodes(data="colocation_group"):
        if group is not None:
            groups.setdefault(str(group), set()).add(unit_of[v])
    colocated = [sorted(units) for units in groups.values() if len(units) > 1]
    mode_compute: dict[str, list[list[float]]] = {"kept": compute}
    mode_memory: dict[str, list[list[int]]] = {}
    mode_memory_last: dict[str, list[int]] = {}
    for mode in costs.modes:
        if mode != "kept":
            rows = costs.mode_compute_s[mode]
            mode_compute[mode] = [
                [sum(rows[v][k] for v in unit) for k in range(num_devices)] for unit in coarsening.units
            ]
        by_count: dict[int, list[int]] = {}
        for held in [*costs.device_in_flight, costs.last_in_flight]:
            if held not in by_count:
                node = costs.node_memory_bytes(mode, held)
                by_count[held] = [sum(node[v] for v in unit) for unit in coarsening.units]
        mode_memory[mode] = [by_count[held] for held in costs.device_in_flight]
        mode_memory_last[mode] = by_count[costs.last_in_flight]
    return UnitCosts(compute, memory, edges, senders, colocated, mode_compute, mode_memory, mode_memory_last)


def chain_quotient(
    graph: nx.DiGraph, coarsening: Coarsening, *, cost: str = "flops", edge_bytes: Sequence[int] | None = None
) -> nx.DiGraph:
    """The layer graph of a chain's units: one node per unit (named after its first node) with the
    summed flops, weights (and trainable weights), activations, model inputs and outputs (and time_s),
    the forward FLOPs that split the unit's work as its nodes split theirs (``cost``: by FLOPs or by
    measured time), and the edge bytes between consecutive units.

    On a chain this is exact: a unit's only output read elsewhere is its last node's. ``edge_bytes``
    (one per pair of consecutive units) replaces the edge bytes, for a DAG read as the chain of its runs
    (e.g. the bytes crossing each cut, :func:`cut_bytes`): an estimate that the DAG's cost model then checks.

    Raises:
        InputError: when the units do not follow the chain one after the other.
    """
    names = [unit[0] for unit in coarsening.units]
    quotient = nx.DiGraph(**graph.graph)
    for name, unit in zip(names, coarsening.units):
        data = [graph.nodes[v] for v in unit]
        flops = float(sum(d["flops"] for d in data))
        attrs: dict[str, object] = {
            "flops": flops,
            "param_bytes": int(sum(d["param_bytes"] for d in data)),
            "trainable_param_bytes": int(sum(trainable_param_bytes(d) for d in data)),
            "activation_bytes": int(sum(d["activation_bytes"] for d in data)),
            # what the runtime holds for the unit's nodes all step (CostModel.step_bytes)
            "model_input_bytes": int(sum(d.get("model_input_bytes") or 0 for d in data)),
            "model_output_bytes": int(sum(d.get("model_output_bytes") or 0 for d in data)),
            # the gradients the unit's backward makes: its nodes' (gradient_bytes: where a node's profile does
            # not say its output bytes, its activations, as the cost model prices the node alone)
            "output_bytes": int(sum(gradient_bytes(d) for d in data)),
        }
        timed = all(d.get("time_s") is not None for d in data)
        if timed:
            attrs["time_s"] = float(sum(d["time_s"] for d in data))
        if any(d.get("accumulate_time_s") for d in data):  # the unit's weight gradients summed per micro-batch
            attrs["accumulate_time_s"] = float(sum(d.get("accumulate_time_s") or 0.0 for d in data))
        work = [float(d["time_s"]) if cost == "time" and timed else float(d["flops"]) for d in data]
        if sum(work) > 0 and flops > 0:  # the unit's forward share is its nodes' forward work over their work
            share = sum(w * forward_share(d) for w, d in zip(work, data)) / sum(work)
            attrs["forward_flops"] = min(flops, share * flops)
        quotient.add_node(name, **attrs)
    if edge_bytes is not None:
        if len(edge_bytes) != len(names) - 1:
            raise InputError(
                f"chain_quotient needs one edge_bytes per pair of consecutive units ({len(names) - 1}). "
                f"Received: {len(edge_bytes)}."
            )
        for (a, b), size in zip(itertools.pairwise(names), edge_bytes):
            quotient.add_edge(a, b, bytes=int(size))
        return quotient
    for (a, b), unit in zip(itertools.pairwise(names), coarsening.units):
        if not graph.has_edge(unit[-1], b):
            raise InputError(f"chain_quotient needs units that follow a chain; '{unit[-1]}' does not feed '{b}'.")
        quotient.add_edge(a, b, bytes=graph.edges[unit[-1], b]["bytes"])
    return quotient
