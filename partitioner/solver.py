"""Builds and solves the CP-SAT placement model: minimise the pipeline bottleneck, then bytes sent.

The formulation is the pipeline-partitioning MIP of Tarnawski et al., "Efficient algorithms for
device placement of DNN graph operators" (NeurIPS 2020), restricted to stages in a fixed device
order, with the contiguity of stages expressed by "prefix" variables so that CP-SAT propagates
the order of every edge directly:

    x[v, k] == 1  iff node v runs on device k
    y[v, k] == 1  iff node v runs on device k or earlier          (y[v, k] = sum_{t <= k} x[v, t])
    r[u, k] == 1  iff node u's output is received by device k      (u elsewhere, a successor on k)
    z[u, j, k] == 1 iff device k receives u's output from device j (only where bandwidth depends on j)

    edge u -> v:     y[v, k] <= y[u, k]  for every k              (stage(u) <= stage(v))
    memory:          sum_v mem(v) x[v, k] <= capacity(k)
    stage time:      T >= sum_v compute(v, k) x[v, k] + sum_u recv(u, k) r[u, k]
    objective:       minimise T * W + sum_{u, k} bytes(u) r[u, k]   (W > any byte term: lexicographic)

Times and bytes are scaled to integers (``time_resolution`` steps for the slowest device running
everything; ``byte_resolution`` steps for all possible transfers), so "optimal" is exact up to that
resolution; the plan's figures are then recomputed in floating point by the cost model.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx

from partitioner import baselines
from partitioner.baselines import check_stage_count
from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.errors import InputError, PartitionerError, SolverTimeoutError
from partitioner.graph import colocation_groups, is_chain
from partitioner.infeasibility import explain_infeasible
from partitioner.plan import Plan

# TensorFlow loads its runtime with RTLD_GLOBAL. Imported before OR-Tools, its abseil and protobuf
# symbols win over OR-Tools' own and CP-SAT crashes in Solve (google/or-tools#3230; here with
# tensorflow-cpu 2.21 and ortools 9.15). RTLD_DEEPBIND (Linux) makes OR-Tools bind to its own.
_DLOPEN_FLAGS = sys.getdlopenflags() if hasattr(os, "RTLD_DEEPBIND") else None
if _DLOPEN_FLAGS is not None:
    sys.setdlopenflags(_DLOPEN_FLAGS | os.RTLD_DEEPBIND)
try:
    from ortools.sat.python import cp_model
finally:
    if _DLOPEN_FLAGS is not None:
        sys.setdlopenflags(_DLOPEN_FLAGS)


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the CP-SAT search that most users leave alone."""

    num_workers: int = 0  # parallel search workers; 0 = CP-SAT's default for this machine
    seed: int = 0  # random seed, for reproducible runs
    hint: bool = True  # start from the best baseline (or the exact DP on chains) that fits
    exact_chains: bool = True  # solve chains without pins by the exact DP (partitioner.exact) instead
    log: bool = False  # print CP-SAT's search log
    time_resolution: int = 1_000_000  # integer steps for the slowest device running the whole graph
    byte_resolution: int = 10_000  # integer steps for all transfers the graph could make
    relative_gap: float = 0.0  # stop once (bottleneck - bound) / bottleneck is below this


@dataclass
class _Model:
    """The CP-SAT model and the handles decode() needs."""

    model: cp_model.CpModel
    x: dict[tuple[str, int], cp_model.IntVar]
    y: dict[tuple[str, int], cp_model.IntVar]
    r: dict[tuple[str, int], cp_model.IntVar]
    z: dict[tuple[str, int, int], cp_model.IntVar]
    bottleneck: cp_model.IntVar
    weight: int  # W: objective = bottleneck * W + byte term
    time_unit_s: float  # seconds per integer time step


def solve(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    num_microbatches: int = 1,
    optimizer_slots: int = 2,
    time_limit_s: float = 10.0,
    pins: Mapping[str, str] | None = None,
    cost: str = "flops",
    options: SolverOptions | None = None,
) -> Plan:
    """Places every node of ``graph`` on a device of ``cluster`` with CP-SAT.

    Args:
        graph: a layer graph (see partitioner.graph), e.g. from profiles.profile_model.
        cluster: the devices in pipeline order, their memory, speed and links.
        num_microbatches: M; GPipe keeps M micro-batches of activations in flight.
        optimizer_slots: state per weight: 2 for Adam, 1 for momentum, 0 for SGD.
        time_limit_s: wall-clock budget of the search; the best plan so far is returned.
        pins: {node: device name} placements that must hold.
        cost: "flops" or "time" (measured time_s); see docs/cost-model.md.
        options: search knobs (workers, seed, hints, resolution).

    Returns:
        A Plan with status "optimal" (proven) or "feasible" and the proven ``lower_bound_s``.

    Raises:
        InfeasiblePlanError: no placement fits; the message says what does not fit and by how much.
        SolverTimeoutError: the time limit passed before any feasible plan was found.
        InputError, GraphError, ClusterError: malformed arguments.

    Example:
        >>> cluster = pt.Cluster.uniform(4, memory="16GiB")            # doctest: +SKIP
        >>> plan = pt.solve(graph, cluster, num_microbatches=8)        # doctest: +SKIP
        >>> plan.status, plan.gap                                      # doctest: +SKIP
        ('optimal', 0.0)
    """
    started = time.perf_counter()
    options = options or SolverOptions()
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise InputError(f"time_limit_s must be a positive number of seconds. Received: {time_limit_s!r}.")
    costs = CostModel(graph, cluster, num_microbatches=num_microbatches, optimizer_slots=optimizer_slots, cost=cost)
    check_stage_count(costs)
    pins = _check_pins(pins, costs)
    if options.exact_chains and not pins and is_chain(graph) and not colocation_groups(graph):
        from partitioner.exact import exact_chain

        return exact_chain(
            graph, cluster, num_microbatches=num_microbatches, optimizer_slots=optimizer_slots, cost=cost
        )
    m = build_model(costs, pins, options)
    if options.hint:
        hint = _best_start(costs, pins)
        if hint is not None:
            _add_hint(m, costs, hint)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = options.num_workers or min(8, max(1, os.cpu_count() or 1) * 4)
    solver.parameters.random_seed = options.seed
    solver.parameters.log_search_progress = options.log
    solver.parameters.relative_gap_limit = options.relative_gap
    # Measured on random DAGs of 200-1000 nodes: symmetry detection and probing in presolve cost
    # seconds and never paid back (benchmarks/planner).
    solver.parameters.symmetry_level = 0
    solver.parameters.cp_model_probing_level = 0
    status = solver.solve(m.model)

    if status == cp_model.INFEASIBLE:
        raise explain_infeasible(costs, pins)
    if status == cp_model.MODEL_INVALID:
        raise PartitionerError(f"Internal error: the CP-SAT model is invalid ({m.model.validate()}). Please report it.")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverTimeoutError(
            f"CP-SAT found no feasible plan within time_limit_s={time_limit_s} for {len(costs.order)} nodes on "
            f"{len(costs.devices)} devices. Raise time_limit_s, or loosen memory so a plan is easier to find."
        )
    assignment = decode(m, solver, costs)
    bound_steps = math.floor(solver.best_objective_bound / m.weight + 1e-9)
    lower_bound = max(bound_steps * m.time_unit_s, costs.lower_bound_s())
    return Plan.from_assignment(
        assignment,
        costs,
        method="cp-sat",
        status="optimal" if status == cp_model.OPTIMAL else "feasible",
        lower_bound_s=lower_bound,
        solve_time_s=time.perf_counter() - started,
    )


def _check_pins(pins: Mapping[str, str] | None, costs: CostModel) -> dict[str, str]:
    pins = dict(pins or {})
    unknown_nodes = sorted(v for v in pins if v not in costs.compute_s)
    if unknown_nodes:
        raise InputError(f"Pinned node(s) {unknown_nodes[:5]} are not in the layer graph.")
    for _v, device in pins.items():
        costs.cluster.index(device)  # raises ClusterError listing the devices that exist
    return pins


def build_model(costs: CostModel, pins: Mapping[str, str], options: SolverOptions) -> _Model:
    """Returns the CP-SAT model of placing ``costs.graph`` on ``costs.cluster`` (see module docstring)."""
    graph, cluster, order = costs.graph, costs.cluster, costs.order
    num_devices = len(costs.devices)
    devices = range(num_devices)
    model = cp_model.CpModel()

    # Scaling: integer time steps and byte steps.
    max_receive_s = (
        sum(
            costs.out_bytes[u] / min(cluster.bandwidth(j, k) for j in devices for k in devices if j != k) for u in order
        )
        if num_devices > 1
        else 0.0
    )
    horizon_s = max(sum(costs.compute_s[v][k] for v in order) for k in devices) + max_receive_s
    time_unit_s = horizon_s / options.time_resolution if horizon_s > 0 else 1.0
    total_bytes = sum(costs.out_bytes[u] for u in order) * max(num_devices - 1, 1)
    byte_unit = max(total_bytes / options.byte_resolution, 1.0)

    def steps(seconds: float) -> int:
        return round(seconds / time_unit_s)

    # ----- variables -----------------------------------------------------------------------------
    # x[v, k] == 1 iff node v runs on device k
    x = {(v, k): model.new_bool_var(f"x_{v}_{k}") for v in order for k in devices}
    # y[v, k] == 1 iff node v runs on device k or earlier (k < K - 1; it is 1 for the last device)
    y = {(v, k): model.new_bool_var(f"y_{v}_{k}") for v in order for k in range(num_devices - 1)}
    # r[u, k] == 1 iff device k receives u's output (u elsewhere, some successor on k)
    senders = [u for u in order if costs.out_bytes[u] > 0 and graph.out_degree(u) > 0]
    r = {(u, k): model.new_bool_var(f"r_{u}_{k}") for u in senders for k in range(1, num_devices)}
    # z[u, j, k] == 1 iff device k receives u's output from device j (only where the sender matters)
    sender_matters = [k for k in range(1, num_devices) if len({cluster.bandwidth(j, k) for j in range(k)}) > 1]
    z = {(u, j, k): model.new_bool_var(f"z_{u}_{j}_{k}") for u in senders for k in sender_matters for j in range(k)}
    horizon_steps = steps(horizon_s) + len(order) + 1
    bottleneck = model.new_int_var(0, horizon_steps, "bottleneck")

    # ----- constraints ---------------------------------------------------------------------------
    for v in order:
        model.add_exactly_one(x[v, k] for k in devices)
        for k in range(num_devices - 1):
            model.add(y[v, k] == sum(x[v, t] for t in range(k + 1)))
            if k > 0:
                model.add_implication(y[v, k - 1], y[v, k])
    # Every edge goes forward: stage(u) <= stage(v).
    for u, v in graph.edges:
        for k in range(num_devices - 1):
            model.add_implication(y[v, k], y[u, k])
    # Received tensors.
    for u in senders:
        for k in range(1, num_devices):
            for s in graph.successors(u):
                model.add(r[u, k] >= x[s, k] - x[u, k])
        for k in sender_matters:
            for j in range(k):
                model.add(z[u, j, k] >= x[u, j] + r[u, k] - 1)
    # Memory, in KiB rounded conservatively.
    for k, device in enumerate(cluster.devices):
        model.add(
            sum(math.ceil(costs.memory[v] / 1024) * x[v, k] for v in order if costs.memory[v] > 0)
            <= device.memory_bytes // 1024
        )
    # Shared layers stay together; pins hold.
    for nodes in colocation_groups(graph).values():
        for v in nodes[1:]:
            for k in devices:
                model.add(x[v, k] == x[nodes[0], k])
    for v, pinned in pins.items():
        model.add(x[v, cluster.index(pinned)] == 1)
    # The bottleneck bounds every stage's compute + receive time.
    for k in devices:
        compute = [steps(costs.compute_s[v][k]) * x[v, k] for v in order]
        receive = []
        for u in senders:
            if k in sender_matters:
                receive += [steps(costs.receive_s(u, j, k)) * z[u, j, k] for j in range(k)]
            elif k > 0:
                receive.append(steps(costs.receive_s(u, 0, k)) * r[u, k])
        model.add(bottleneck >= sum(compute) + sum(receive))

    # ----- objective: the bottleneck first, then the bytes sent ----------------------------------
    byte_terms = [round(costs.out_bytes[u] / byte_unit) * r[u, k] for (u, k) in r]
    weight = options.byte_resolution + len(r) + 1
    model.minimize(bottleneck * weight + sum(byte_terms))
    return _Model(model, x, y, r, z, bottleneck, weight, time_unit_s)


def decode(m: _Model, solver: cp_model.CpSolver, costs: CostModel) -> dict[str, str]:
    """Reads {node: device name} from a solved model."""
    assignment = {}
    for v in costs.order:
        for k, name in enumerate(costs.devices):
            if solver.boolean_value(m.x[v, k]):
                assignment[v] = name
                break
    return assignment


def _best_start(costs: CostModel, pins: Mapping[str, str]) -> dict[str, str] | None:
    """The best legal plan among the exact DP (chains) and the baselines, as a search hint."""
    from partitioner.exact import exact_chain

    kwargs: dict[str, Any] = {
        "num_microbatches": costs.num_microbatches,
        "optimizer_slots": costs.optimizer_slots,
        "cost": costs.cost,
    }
    candidates: list[Plan] = []
    if is_chain(costs.graph) and not colocation_groups(costs.graph):
        with contextlib.suppress(PartitionerError):
            candidates.append(exact_chain(costs.graph, costs.cluster, **kwargs))
    for baseline in baselines.BASELINES.values():
        candidates.append(baseline(costs.graph, costs.cluster, **kwargs))
    groups = colocation_groups(costs.graph).values()
    legal = [
        p
        for p in candidates
        if p.fits_memory
        and all(p.assignment[v] == d for v, d in pins.items())
        and all(len({p.assignment[v] for v in nodes}) == 1 for nodes in groups)
    ]
    if not legal:
        return None
    return min(legal, key=lambda p: (p.bottleneck_s, p.transfer_bytes)).assignment


def _add_hint(m: _Model, costs: CostModel, assignment: Mapping[str, str]) -> None:
    """Hints every variable of ``m`` with the values of ``assignment``."""
    where = {v: costs.devices.index(d) for v, d in assignment.items()}
    for (v, k), var in m.x.items():
        m.model.add_hint(var, where[v] == k)
    for (v, k), var in m.y.items():
        m.model.add_hint(var, where[v] <= k)
    received = {(u, where[s]) for u, s in costs.graph.edges if where[s] != where[u]}
    for (u, k), var in m.r.items():
        m.model.add_hint(var, (u, k) in received)
    for (u, j, k), var in m.z.items():
        m.model.add_hint(var, (u, k) in received and where[u] == j)
