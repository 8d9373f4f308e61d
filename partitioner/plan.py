"""The plan: which device runs each node, and what the cost model predicts for it, as plain data.

Example:
    >>> plan = pt.solve(graph, cluster, num_microbatches=8)          # doctest: +SKIP
    >>> plan.assignment["conv1"], plan.bottleneck_s, plan.status      # doctest: +SKIP
    ('/GPU:0', 0.0123, 'optimal')
    >>> pt.Plan.from_json(plan.to_json()) == plan                     # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, bubble_fraction, relative_gap
from partitioner.errors import PlanError
from partitioner.schedule import SCHEDULES

# 2: recompute per stage (version 1 files load with no stage recomputed); step_lower_bound_s is optional
# 3: structure (older files load without it: their names must match the model's)
# 4: replica_devices and reduce_times, data x pipeline (older files load as one replica); later, optional:
#    step_overhead_s (older files load with 0), priced_replicas (older files load with 1)
PLAN_SCHEMA_VERSION = 4
STATUSES = ("optimal", "feasible", "heuristic")


@dataclass(frozen=True)
class Plan:
    """A placement of every node of a layer graph on a device, with its predicted costs.

    Device-keyed mappings cover every device of the cluster in pipeline order; unused devices
    show zeros. ``stages`` lists the used devices: stage k runs on ``stages[k]``.
    """

    assignment: dict[str, str]  # node -> device name
    devices: tuple[str, ...]  # every device of the cluster, in pipeline order
    method: str  # "cp-sat", "exact_chain" (+ "+coarsen"), a baseline, or "<baseline> (shorter step than cp-sat)"
    status: str  # "optimal" (proven on the plan's objective, see ``gap``), "feasible" (a bound exists) or "heuristic"
    num_microbatches: int  # M
    optimizer_slots: int  # 2 for Adam, 0 for SGD
    cost: str  # "flops" or "time": where compute times came from
    stage_times: dict[str, float]  # seconds per micro-batch: compute + receive
    compute_times: dict[str, float]  # seconds per micro-batch
    receive_times: dict[str, float]  # seconds per micro-batch
    memory_bytes: dict[str, int]  # predicted peak need per device, under the plan's schedule
    capacity_bytes: dict[str, int]  # each device's memory
    bottleneck_s: float  # the slowest stage's time per micro-batch
    lower_bound_s: float | None  # proven lower bound on the bottleneck of every legal plan, if the method gives one
    step_time_s: float  # predicted step: the plan's schedule simulated action by action (partitioner.simulate)
    serial_step_s: float  # the same M micro-batches on the fastest device alone
    transfer_bytes: int  # bytes received by all stages per micro-batch
    solve_time_s: float  # wall-clock seconds the method took
    model_name: str | None = None
    fill_drain_step_s: float | None = None  # (M + K - 1) * bottleneck: the closed-form bound on the step
    schedule: str = "gpipe"  # the schedule planned for (memory) and simulated (step): "gpipe" or "1f1b"
    # per stage (stage k runs on stages[k]): True iff its backward recomputes its forward from its saved
    # inputs; the last stage never is. Empty when given: no stage recomputed.
    recompute: tuple[bool, ...] = ()
    # proven lower bound on the step of every legal plan (CostModel.step_lower_bound_s, or the exact chain
    # search's), capped at the plan's step; set where the planner minimised the step, None elsewhere
    step_lower_bound_s: float | None = None
    # per node of ``assignment``, in its order: its layer type, config digest and the positions of the nodes
    # it reads (partitioner.graph.structure), so that wrap can map the plan onto the same architecture
    # built again under other names; empty where the graph had no digests
    structure: tuple[str, ...] = ()
    # data x pipeline (partitioner.search.replicas): the devices of each of D copies of this pipeline, stage
    # k of replica r on replica_devices[r][k]; replica 0's are ``devices``. Empty: one replica
    replica_devices: tuple[tuple[str, ...], ...] = ()
    # per device of ``devices``: seconds of the ``R`` action of its stage (its weight gradients all-reduced
    # with the same stage of the other replicas, after its last backward); ``step_time_s`` includes them
    reduce_times: dict[str, float] = field(default_factory=dict)
    # seconds a step spends beyond the pipeline, once per step whatever the plan (the framework's step, the
    # loss, the optimizer's update): the profile's ``step_overhead_s`` where it was measured on a device of the
    # plan's cluster, else 0 (partitioner.score.step_overhead_s). Not in
    # ``step_time_s``, by which planners compare plans and which their bounds are on; ``predicted_step_s`` adds it
    step_overhead_s: float = 0.0
    # D the memory was priced for: each stage's all-reduce holds a packed copy of its gradients when D > 1
    # (partitioner.cost.REDUCING_COPIES). plan_replicas' plans record their replicas' devices too; a worker's plan
    # (plan_and_wrap with workers: each plans its own pipeline) only this
    priced_replicas: int = 1

    def __post_init__(self) -> None:
        # Plans built without it (and files of schema version 1) recompute no stage; validate_plan checks the rest.
        recompute = tuple(self.recompute) if self.recompute else (False,) * self.num_stages
        object.__setattr__(self, "recompute", recompute)

    # ----- derived views -------------------------------------------------------------------------

    @property
    def stages(self) -> tuple[str, ...]:
        """The used devices in pipeline order: stage k runs on ``stages[k]``."""
        used = set(self.assignment.values())
        return tuple(d for d in self.devices if d in used)

    @property
    def num_replicas(self) -> int:
        """D: the copies of this pipeline whose stages sum their gradients (1 without replicas)."""
        return max(1, len(self.replica_devices))

    @property
    def num_stages(self) -> int:
        """K, the number of pipeline stages (used devices)."""
        return len(self.stages)

    def nodes_on(self, device: str) -> list[str]:
        """Nodes placed on ``device``, in the graph's topological order."""
        return [v for v, d in self.assignment.items() if d == device]

    @property
    def gap(self) -> float | None:
        """How far the plan may be from the best on its objective: (step - step bound) / step where the
        planner minimised the step (``step_lower_bound_s`` set), else (bottleneck - lower bound) /
        bottleneck; 0 means proven optimal, None means no bound."""
        if self.step_lower_bound_s is not None:
            return relative_gap(self.step_time_s, self.step_lower_bound_s)
        return relative_gap(self.bottleneck_s, self.lower_bound_s)

    @property
    def objective(self) -> str:
        """What the plan's ``status`` and ``gap`` are about: "step" where the planner minimised the
        simulated step (``step_lower_bound_s`` set), else "bottleneck"."""
        return "step" if self.step_lower_bound_s is not None else "bottleneck"

    @property
    def predicted_step_s(self) -> float:
        """The seconds one training step is predicted to take: the simulated step (``step_time_s``) and the
        step's own work beside the pipeline (``step_overhead_s``)."""
        return self.step_time_s + self.step_overhead_s

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a GPipe or 1F1B step for this plan's K and M, balanced stages: (K - 1) / (M + K - 1)."""
        return bubble_fraction(self.num_stages, self.num_microbatches)

    @property
    def speedup(self) -> float:
        """Predicted step-time speedup over running the whole model on the fastest device."""
        return self.serial_step_s / self.step_time_s if self.step_time_s > 0 else 1.0

    @property
    def fits_memory(self) -> bool:
        """True iff every device's predicted memory is within its capacity."""
        return all(self.memory_bytes[d] <= self.capacity_bytes[d] for d in self.devices)

    def cost_model(
        self, graph: nx.DiGraph, cluster: Cluster, *, num_microbatches: int | None = None, cost: str | None = None
    ) -> CostModel:
        """The cost model this plan was made with: its M (or ``num_microbatches``), optimizer slots, cost source
        (or ``cost``: "flops" prices a plan on a graph profiled without times), schedule and replicas, on
        ``cluster``.

        Example:
            >>> import partitioner as pt
            >>> graph, cluster = pt.chain_graph([1e12] * 4), pt.Cluster.uniform(2, memory="1GiB")
            >>> costs = pt.solve(graph, cluster, num_microbatches=4, schedule="1f1b").cost_model(graph, cluster)
            >>> costs.num_microbatches, costs.schedule
            (4, '1f1b')
        """
        return CostModel(
            graph,
            cluster,
            num_microbatches=self.num_microbatches if num_microbatches is None else num_microbatches,
            optimizer_slots=self.optimizer_slots,
            cost=self.cost if cost is None else cost,
            schedule=self.schedule,
            num_replicas=max(self.num_replicas, self.priced_replicas),
        )

    # ----- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-ready form, with a schema version."""
        data = asdict(self)
        data["devices"] = list(self.devices)
        return {"schema_version": PLAN_SCHEMA_VERSION, "kind": "plan", **data}

    def to_json(self) -> str:
        """Returns the plan as JSON text; :meth:`from_json` gives back an equal plan."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "plan") -> Plan:
        """Rebuilds a plan from :meth:`to_dict` output.

        Raises:
            PlanError: for a corrupt document or one written by a newer version.
        """
        if not isinstance(data, dict) or data.get("kind") != "plan":
            raise PlanError(f"{source} is not a plan (expected a JSON object with kind='plan').")
        version = data.get("schema_version")
        if not isinstance(version, int) or version < 1:
            raise PlanError(f"{source} has no valid schema_version (got {version!r}); the file is corrupt.")
        if version > PLAN_SCHEMA_VERSION:
            raise PlanError(
                f"{source} has schema_version {version}; this version reads up to {PLAN_SCHEMA_VERSION}. "
                "Upgrade keras-partitioner or plan again."
            )
        names = {f.name for f in fields(cls)}
        # Fields added after schema version 1 shipped: older files lack them and take the default.
        optional = (
            "model_name",
            "fill_drain_step_s",
            "schedule",
            "recompute",
            "step_lower_bound_s",
            "structure",
            "replica_devices",
            "reduce_times",
            "step_overhead_s",
            "priced_replicas",
        )
        required = {f.name for f in fields(cls) if f.name not in optional}
        missing = sorted(required - set(data))
        if missing:
            raise PlanError(f"{source} is corrupt: missing field(s) {missing}.")
        values = {k: v for k, v in data.items() if k in names}
        try:
            values["devices"] = tuple(values["devices"])
            for key in ("recompute", "structure"):
                if key in values:
                    values[key] = tuple(values[key])
            if "replica_devices" in values:
                values["replica_devices"] = tuple(tuple(group) for group in values["replica_devices"])
            plan = cls(**values)
        except (TypeError, AttributeError) as err:
            raise PlanError(f"{source} is corrupt: {err}.") from err
        if plan.status not in STATUSES or not isinstance(plan.assignment, dict):
            raise PlanError(f"{source} is corrupt: bad status {plan.status!r} or assignment.")
        if plan.structure and len(plan.structure) != len(plan.assignment):
            raise PlanError(
                f"{source} is corrupt: structure has {len(plan.structure)} entries for {len(plan.assignment)} nodes."
            )
        if plan.replica_devices and (
            plan.replica_devices[0] != plan.devices
            or any(len(group) != len(plan.devices) for group in plan.replica_devices)
            or len({d for group in plan.replica_devices for d in group}) != len(plan.devices) * plan.num_replicas
        ):
            raise PlanError(
                f"{source} is corrupt: replica_devices must list, per replica, as many distinct devices as "
                f"devices ({len(plan.devices)}), replica 0's being devices."
            )
        if (
            isinstance(plan.priced_replicas, bool)
            or not isinstance(plan.priced_replicas, int)
            or plan.priced_replicas < 1
        ):
            raise PlanError(f"{source} is corrupt: priced_replicas {plan.priced_replicas!r} is not an integer >= 1.")
        if plan.schedule not in SCHEDULES:
            raise PlanError(f"{source} is corrupt: schedule {plan.schedule!r} is not one of {SCHEDULES}.")
        if (
            len(plan.recompute) != plan.num_stages
            or not all(isinstance(r, bool) for r in plan.recompute)
            or plan.recompute[-1:] == (True,)
        ):
            raise PlanError(
                f"{source} is corrupt: recompute {list(plan.recompute)} is not one bool per stage "
                f"({plan.num_stages}) with the last stage kept."
            )
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parses JSON text written by :meth:`to_json`.

        Raises:
            PlanError: for text that is not JSON, not a plan, or from a newer version.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"The plan is not valid JSON ({err.msg} at line {err.lineno}).") from err
        return cls.from_dict(data)
