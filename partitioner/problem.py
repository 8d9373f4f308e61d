"""The planning problem: what a plan is asked for, as one frozen record validated once where it is built.

A :class:`Problem` holds what every planner and the cost model need to know besides the search's own
knobs (time limit, pins, :class:`partitioner.SolverOptions`): the layer graph, the cluster, M, the
schedule, the optimizer slots, the recompute policy and the cost source. It is checked once, in
``__post_init__``; the keyword front doors (``CostModel(graph, cluster, ...)``, ``solve``,
``exact_chain``, the baselines) build one from their keywords and raise its errors, so they stay
what users call::

    keywords ──Problem(...)──▶ Problem ──CostModel.from_problem──▶ CostModel (costs.problem) ──▶ planners

The number of replicas is not a field: ``plan_replicas`` chooses it (like ``choose`` chooses M and the
schedule), and a cost model prices one replica's pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.errors import InputError
from partitioner.graph import validate_graph
from partitioner.schedule import check_schedule_name

COST_SOURCES = ("flops", "time")
RECOMPUTE = ("never", "always", "auto")


@dataclass(frozen=True)
class Reductions:
    """Where each stage's ``R`` runs, where the plan is one of D replicas: its weight gradients all-reduced (SUM)
    with the same stage of the other D - 1 replicas, a ring whose slowest link and slowest device's fixed cost of
    an action are given per device of this pipeline; ``cost.reduce_s`` prices it. In a ``Problem``, the search
    weighs each stage's ``R`` in the simulated step it minimises (``CostModel.reduce_times``).

    Example:
        >>> cluster = Cluster.uniform(2, memory="16GiB", bandwidth=100e9)
        >>> Reductions.between_workers(cluster, 4, 10e9).bandwidth_bytes_per_s  # 4 workers on a 10 GB/s link
        {'/GPU:0': 10000000000.0, '/GPU:1': 10000000000.0}
    """

    num_replicas: int  # D, the members of each stage's ring
    bandwidth_bytes_per_s: Mapping[str, float]  # device of this pipeline -> its ring's slowest link
    overhead_s: Mapping[str, float]  # device of this pipeline -> the fixed cost of an action on its ring

    @classmethod
    def between_workers(cls, cluster: Cluster, num_workers: int, bandwidth_bytes_per_s: float) -> Reductions:
        """One worker's pipeline on ``cluster``, of ``num_workers`` whose link carries ``bandwidth_bytes_per_s``
        (``partitioner plan --workers D --worker-bandwidth BW``): every stage's ring crosses that link."""
        if not bandwidth_bytes_per_s > 0:
            raise InputError(
                f"The workers' link needs a bandwidth > 0 in bytes per second. Received: {bandwidth_bytes_per_s!r}."
            )
        return cls(
            num_workers,
            {d.name: bandwidth_bytes_per_s for d in cluster.devices},
            {d.name: d.action_overhead_s for d in cluster.devices},
        )

    @classmethod
    def over_groups(cls, cluster: Cluster, groups: Sequence[Sequence[str]]) -> Reductions:
        """Replica 0's pipeline on ``groups[0]`` of ``cluster``'s devices, replica r's on ``groups[r]`` (the
        same positions): the stage on ``groups[0][k]`` reduces over ``[group[k] for group in groups]``, its
        slowest link and device read from ``cluster`` (as :func:`allreduce_s`)."""
        bandwidths, overheads = {}, {}
        for k, name in enumerate(groups[0]):
            index = [cluster.index(group[k]) for group in groups]
            ring = list(zip(index, index[1:] + index[:1]))
            bandwidths[name] = min((cluster.bandwidth(a, b) for a, b in ring if a != b), default=math.inf)
            overheads[name] = max(cluster.devices[i].action_overhead_s for i in index)
        return cls(len(groups), bandwidths, overheads)


@dataclass(frozen=True)
class Problem:
    """One planning problem: a layer graph on a cluster for M micro-batches under a schedule.

    Raises:
        InputError: for a nonsensical number of micro-batches or slots, or an unknown cost source,
            schedule or recompute policy.
        GraphError: when the graph breaks the layer-graph contract.

    Example:
        >>> import partitioner as pt
        >>> problem = pt.Problem(pt.chain_graph([1e12] * 4), pt.Cluster.uniform(2, memory="1GiB"), num_microbatches=4)
        >>> problem.num_microbatches, problem.schedule, problem.recompute
        (4, 'gpipe', 'never')
        >>> pt.Problem(problem.graph, problem.cluster, schedule="zb")
        Traceback (most recent call last):
        ...
        partitioner.errors.InputError: schedule must be one of ('gpipe', '1f1b'). Received: 'zb'.
    """

    graph: nx.DiGraph  # the layer graph (partitioner.graph); its compute_dtype picks each device's speed
    cluster: Cluster  # the devices, in pipeline order, and their links
    num_microbatches: int = 1  # M, the micro-batches per step
    optimizer_slots: int = 2  # optimizer state per trainable weight: 2 for Adam, 1 for momentum, 0 for SGD
    cost: str = "flops"  # "flops" (portable) or "time" (measured time_s rescaled by speed)
    schedule: str = "gpipe"  # "gpipe" or "1f1b": how many micro-batches a stage holds, and the step's order
    recompute: str = "never"  # "never", "always" or "auto": which stages recompute their forward
    num_replicas: int = 1  # D, the data-parallel copies of the pipeline whose gradients each stage all-reduces
    reductions: Reductions | None = None  # how each stage's R with the other replicas is priced; None: not priced

    def __post_init__(self) -> None:
        validate_graph(self.graph)
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InputError(f"num_microbatches must be an integer >= 1. Received: {m!r}.")
        slots = self.optimizer_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise InputError(f"optimizer_slots must be an integer >= 0 (2 for Adam, 0 for SGD). Received: {slots!r}.")
        d = self.num_replicas
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise InputError(f"num_replicas must be an integer >= 1. Received: {d!r}.")
        if self.reductions is not None and self.reductions.num_replicas != d:
            raise InputError(
                f"reductions price a ring of {self.reductions.num_replicas} replicas, but num_replicas is {d}. "
                "Expected the two to count the same replicas."
            )
        if self.cost not in COST_SOURCES:
            raise InputError(f"cost must be one of {COST_SOURCES}. Received: {self.cost!r}.")
        check_schedule_name(self.schedule)
        check_recompute(self.recompute)


def check_recompute(recompute: object) -> None:
    """Raises InputError unless ``recompute`` is one of RECOMPUTE."""
    if recompute not in RECOMPUTE:
        raise InputError(
            f"recompute must be one of {RECOMPUTE} ('auto' recomputes a stage only where its activations "
            f"would not fit otherwise). Received: {recompute!r}."
        )
