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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.errors import InputError
from partitioner.graph import validate_graph
from partitioner.schedule import check_schedule_name

if TYPE_CHECKING:
    from partitioner.cost import Reductions

COST_SOURCES = ("flops", "time")
RECOMPUTE = ("never", "always", "auto")


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
