"""The cost model: how long each stage takes and how much memory each device needs for a placement.

One :class:`CostModel` is shared by every planner (CP-SAT, the exact chain DP, the baselines), so all
plans are scored by the same formulas; docs/cost-model.md writes them down::

    compute(d)    = sum over nodes v on d of flops(v) / flops_per_s(d)
                    (or, with cost="time", time_s(v) * profiled_flops_per_s / flops_per_s(d))
    receive(d)    = sum over nodes u on another device with a successor on d of
                    out_bytes(u) / bw(dev(u), d) + out_bytes(u) / bw(d, dev(u))   (activation, then its gradient)
    stage_time(d) = compute(d) + receive(d)           bottleneck = max over used devices
    memory(d)     = sum over v on d of param_bytes(v) * (2 + optimizer_slots)
                    + in_flight(s) * activation_bytes(v)          d runs stage s
    in_flight(s)  = the most micro-batches stage s holds under the schedule: M for GPipe, min(K - s, M) for 1F1B
    step_time     = (M + K - 1) * bottleneck          for K stages and M micro-batches (either schedule)

Planners cannot know a node's stage before they place it, so they budget each node's activations
``max_in_flight`` times, the most any stage holds on this cluster (M for GPipe, min(number of devices,
M) for 1F1B); :meth:`CostModel.evaluate` then counts each stage's own figure.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.errors import InputError, PlanError
from partitioner.graph import topological_order, validate_graph
from partitioner.schedule import Schedule, check_schedule_name

COST_SOURCES = ("flops", "time")


@dataclass(frozen=True)
class Evaluation:
    """Every figure of one placement under the cost model, keyed by device name."""

    compute_times: dict[str, float]  # seconds of forward + backward per micro-batch
    receive_times: dict[str, float]  # seconds per micro-batch receiving activations and sending their gradients
    stage_times: dict[str, float]  # compute + receive
    memory_bytes: dict[str, int]  # weights, gradients, optimizer slots and in-flight activations
    in_flight: dict[str, int]  # micro-batches whose activations each device holds at most (0 when unused)
    bottleneck_s: float  # the slowest used stage
    step_time_s: float  # (M + K - 1) * bottleneck
    transfer_bytes: int  # bytes received by all stages per micro-batch
    stages: tuple[str, ...]  # used devices in pipeline order


class CostModel:
    """Precomputes per-node costs of a layer graph on a cluster and scores placements.

    Args:
        graph: a layer graph (see partitioner.graph).
        cluster: the devices, in pipeline order.
        num_microbatches: M, the number of micro-batches per step.
        optimizer_slots: optimizer state per weight: 2 for Adam, 1 for momentum SGD, 0 for SGD.
        cost: "flops" (portable, the default) or "time" (measured ``time_s`` rescaled by speed).
        schedule: "gpipe" or "1f1b": how many micro-batches' activations a stage holds (in_flight).

    Raises:
        InputError: for a nonsensical number of micro-batches or slots, or an unknown cost source or schedule.
        GraphError: when the graph breaks the layer-graph contract.
    """

    def __init__(
        self,
        graph: nx.DiGraph,
        cluster: Cluster,
        *,
        num_microbatches: int = 1,
        optimizer_slots: int = 2,
        cost: str = "flops",
        schedule: str = "gpipe",
    ) -> None:
        validate_graph(graph)
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise InputError(f"num_microbatches must be an integer >= 1. Received: {num_microbatches!r}.")
        if isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots, int) or optimizer_slots < 0:
            raise InputError(
                f"optimizer_slots must be an integer >= 0 (2 for Adam, 0 for SGD). Received: {optimizer_slots!r}."
            )
        if cost not in COST_SOURCES:
            raise InputError(f"cost must be one of {COST_SOURCES}. Received: {cost!r}.")
        check_schedule_name(schedule)
        self.graph = graph
        self.cluster = cluster
        self.num_microbatches = num_microbatches
        self.optimizer_slots = optimizer_slots
        self.cost = cost
        self.schedule = schedule
        self.order = topological_order(graph)
        self.devices = cluster.names
        # What the planners budget per node: the most micro-batches any stage holds if every device is a stage.
        self.max_in_flight = max(
            in_flight(schedule, len(self.devices), num_microbatches, s) for s in range(len(self.devices))
        )
        self.compute_s = {v: self._compute_row(v) for v in self.order}  # [node][device index]
        self.memory = {v: self._node_memory(v) for v in self.order}
        self.out_bytes = {
            u: max((int(b) for _, _, b in graph.out_edges(u, data="bytes")), default=0) for u in self.order
        }

    def _compute_row(self, node: str) -> list[float]:
        data = self.graph.nodes[node]
        if self.cost == "time":
            time_s = data.get("time_s")
            if time_s is None:
                raise InputError(
                    f"cost='time' needs a measured time_s on every node; node '{node}' has none. "
                    "Profile with measure_time=True, or use cost='flops'."
                )
            reference = self.graph.graph.get("profiled_flops_per_s") or max(d.flops_per_s for d in self.cluster.devices)
            return [float(time_s) * reference / d.flops_per_s for d in self.cluster.devices]
        return [float(data["flops"]) / d.flops_per_s for d in self.cluster.devices]

    def _node_memory(self, node: str) -> int:
        """Bytes ``node`` needs on any stage: its weights' and its activations' share of ``max_in_flight``."""
        return self.weight_bytes(node) + self.max_in_flight * int(self.graph.nodes[node]["activation_bytes"])

    def weight_bytes(self, node: str) -> int:
        """Bytes of ``node``'s weights, their gradients and the optimizer's slots."""
        return int(self.graph.nodes[node]["param_bytes"]) * (2 + self.optimizer_slots)

    def receive_s(self, node: str, sender: int, receiver: int) -> float:
        """Seconds per micro-batch that ``node``'s output costs the link between ``sender`` and ``receiver``.

        The activation goes forward (sender to receiver) and its gradient comes back (receiver to sender);
        GPipe runs every forward before any backward, so the two transfers do not overlap and both count.
        """
        if sender == receiver:
            return 0.0
        size = self.out_bytes[node]
        return size / self.cluster.bandwidth(sender, receiver) + size / self.cluster.bandwidth(receiver, sender)

    def serial_step_s(self) -> float:
        """Seconds for one step of M micro-batches on the fastest device alone, ignoring its memory."""
        fastest = max(range(len(self.devices)), key=lambda k: self.cluster.devices[k].flops_per_s)
        return self.num_microbatches * sum(self.compute_s[v][fastest] for v in self.order)

    def lower_bound_s(self) -> float:
        """A bottleneck no placement can beat: the work spread perfectly, or the costliest node."""
        speed = [d.flops_per_s for d in self.cluster.devices]
        fastest = max(range(len(speed)), key=speed.__getitem__)
        total = sum(self.compute_s[v][fastest] for v in self.order) * speed[fastest] / sum(speed)
        single = max(min(row) for row in self.compute_s.values())
        return max(total, single)

    def check_assignment(self, assignment: Mapping[str, str]) -> dict[str, int]:
        """Returns {node: device index}, or raises PlanError if nodes or devices do not match."""
        missing = [v for v in self.order if v not in assignment]
        extra = sorted(set(assignment) - set(self.graph.nodes))
        if missing or extra:
            raise PlanError(
                "The plan does not match the layer graph: "
                + (f"{len(missing)} node(s) have no device (e.g. {missing[:5]})" if missing else "")
                + ("; " if missing and extra else "")
                + (f"{len(extra)} node(s) are not in the graph (e.g. {extra[:5]})" if extra else "")
                + ". Plan again for this model, or profile the model the plan was made for."
            )
        index = {name: k for k, name in enumerate(self.devices)}
        unknown = sorted({d for d in assignment.values() if d not in index})
        if unknown:
            raise PlanError(
                f"The plan uses device(s) {unknown} that the cluster lacks. The cluster has: {self.devices}."
            )
        return {v: index[assignment[v]] for v in self.order}

    def evaluate(self, assignment: Mapping[str, str]) -> Evaluation:
        """Scores a placement {node: device name} with the formulas in the module docstring."""
        where = self.check_assignment(assignment)
        k_total = len(self.devices)
        compute = [0.0] * k_total
        receive = [0.0] * k_total
        weights = [0] * k_total
        activations = [0] * k_total
        transfer = 0
        for v in self.order:
            k = where[v]
            compute[k] += self.compute_s[v][k]
            weights[k] += self.weight_bytes(v)
            activations[k] += int(self.graph.nodes[v]["activation_bytes"])
            for receiver in sorted({where[s] for s in self.graph.successors(v)} - {k}):
                receive[receiver] += self.receive_s(v, k, receiver)
                transfer += self.out_bytes[v]
        used = sorted(set(where.values()))
        stage = [compute[k] + receive[k] for k in range(k_total)]
        bottleneck = max(stage[k] for k in used)
        num_stages = len(used)
        held = [0] * k_total
        for s, k in enumerate(used):
            held[k] = in_flight(self.schedule, num_stages, self.num_microbatches, s)
        memory = [weights[k] + held[k] * activations[k] for k in range(k_total)]
        return Evaluation(
            compute_times=dict(zip(self.devices, compute, strict=False)),
            receive_times=dict(zip(self.devices, receive, strict=False)),
            stage_times=dict(zip(self.devices, stage, strict=False)),
            memory_bytes=dict(zip(self.devices, memory, strict=False)),
            in_flight=dict(zip(self.devices, held, strict=False)),
            bottleneck_s=bottleneck,
            step_time_s=(self.num_microbatches + num_stages - 1) * bottleneck,
            transfer_bytes=transfer,
            stages=tuple(self.devices[k] for k in used),
        )

    def fits(self, evaluation: Evaluation) -> bool:
        """True iff every device's memory holds what the placement puts on it."""
        return all(evaluation.memory_bytes[d.name] <= d.memory_bytes for d in self.cluster.devices)


def in_flight(schedule: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """Micro-batches whose activations ``stage`` holds at most under ``schedule``: M for GPipe, min(K - s, M) for 1F1B.

    The one place the planners, the cost model and the validator take this figure from; it is the
    schedule's own count (``Schedule.max_in_flight``), not a second formula.

    Example:
        >>> [in_flight("1f1b", 4, 8, s) for s in range(4)], in_flight("gpipe", 4, 8, 0)
        ([4, 3, 2, 1], 8)
    """
    return _schedule(schedule, num_stages, num_microbatches).max_in_flight(stage)


@functools.lru_cache(maxsize=64)
def _schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    return Schedule.make(name, num_stages, num_microbatches)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle share of a GPipe step: (K - 1) / (M + K - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def relative_gap(value: float, bound: float | None) -> float | None:
    """(value - bound) / value, or None without a bound; 0 when both are 0."""
    if bound is None:
        return None
    if value <= 0:
        return 0.0
    return max(0.0, (value - bound) / value) if math.isfinite(value) else None
