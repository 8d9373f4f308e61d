"""Plans how to split a Keras model's layer graph across devices as a pipeline.

Pure planning: importing ``partitioner`` imports networkx and OR-Tools, never TensorFlow.

Example:
    >>> import partitioner as pt
    >>> graph = pt.chain_graph([4e9, 4e9, 8e9, 4e9], edge_bytes=[2**20] * 3)
    >>> cluster = pt.Cluster.uniform(2, memory="16GiB", flops_per_s=100e12, bandwidth="50GB/s")
    >>> plan = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=5)
    >>> plan.num_stages, plan.assignment["layer_2"]
    (2, '/GPU:1')
    >>> plan.lower_bound_s <= plan.bottleneck_s <= plan.step_time_s
    True
"""

from __future__ import annotations

from typing import Any

from partitioner.cluster import Cluster, Device
from partitioner.cost import CostModel
from partitioner.errors import (
    ClusterError,
    GraphError,
    InfeasiblePlanError,
    InputError,
    PartitionerError,
    PlanError,
    ProfileError,
    ScheduleError,
    SolverTimeoutError,
    TimingError,
)
from partitioner.graph import chain_graph, load_graph, rescale_graph, save_graph, validate_graph
from partitioner.plan import Plan
from partitioner.problem import Problem, Reductions
from partitioner.schedule import Action, Schedule, ScheduleFamily, schedule_family
from partitioner.score import score_assignment
from partitioner.search import baselines
from partitioner.search.chain import exact_chain
from partitioner.search.choose import plan_for_batch
from partitioner.search.options import SolverOptions
from partitioner.search.solve import solve, solve_problem
from partitioner.simulate import Simulation, Span, simulate
from partitioner.validate import validate_plan

__all__ = [
    "Action",
    "Cluster",
    "ClusterError",
    "CostModel",
    "Device",
    "GraphError",
    "InfeasiblePlanError",
    "InputError",
    "PartitionerError",
    "Plan",
    "PlanError",
    "Problem",
    "ProfileError",
    "Reductions",
    "Schedule",
    "ScheduleError",
    "ScheduleFamily",
    "Simulation",
    "SolverOptions",
    "SolverTimeoutError",
    "Span",
    "TimingError",
    "baselines",
    "chain_graph",
    "exact_chain",
    "load_graph",
    "plan_and_wrap",
    "plan_for_batch",
    "rescale_graph",
    "save_graph",
    "schedule_family",
    "score_assignment",
    "simulate",
    "solve",
    "solve_problem",
    "validate_graph",
    "validate_plan",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "plan_and_wrap":  # the runtime imports TensorFlow: load it only when asked for
        from runtime import plan_and_wrap

        return plan_and_wrap
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
