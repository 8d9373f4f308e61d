"""Builds and solves the CP-SAT placement model: minimise the pipeline bottleneck, then bytes sent.

The formulation is the pipeline-partitioning MIP of Tarnawski et al., "Efficient algorithms for
device placement of DNN graph operators" (NeurIPS 2020), restricted to stages in a fixed device
order, with the contiguity of stages expressed by "prefix" variables so that CP-SAT propagates
the order of every edge directly. It places *units* (see partitioner.search.coarsen): one node each for
the layer graph itself, runs of nodes on a coarsened graph. Unit U may take the devices of its
domain lo(U)..hi(U) (all devices, or its pinned one); outside it x is 0 and y is 0 below, 1 above:

    x[U, k] == 1  iff unit U runs on device k
    y[U, k] == 1  iff unit U runs on device k or earlier          (y[U, k] = sum_{t <= k} x[U, t])
    r[u, k] == 1  iff node u's output is received by device k      (u elsewhere, a reader on k)
    z[u, j, k] == 1 iff device k receives u's output from device j (only where bandwidth depends on j)

    edge U -> V:     y[V, k] <= y[U, k]  for every k              (stage(U) <= stage(V))
    c[k] == 1      iff the stage on device k recomputes its forward  (only when recompute != "never")

    memory:          sum_U mem(U, k) x[U, k] <= capacity(k)   (activations counted device_in_flight[k] times
                     where a unit runs after k, last_in_flight times where none does: the last stage's)
                     in the mode c[k] gives: kept, or recomputed, which adds in(u) r[u, k] for received tensors
    stage time:      T >= sum_U compute(U, k) x[U, k] + sum_u recv(u, k) r[u, k]   (compute in c[k]'s mode)
    last stage:      c[k] => some unit on a device after k    ("always": <=>)
    objective:       minimise T * W + sum_{u, k} bytes(u) r[u, k]   (W > any byte term: lexicographic)

The modes' compute and memory per unit come from the cost model (partitioner.cost.mode_cost). The
device at position k of the order budgets CostModel.device_in_flight[k] micro-batches: M for GPipe
(1 on the last device), min(D - k, M) for 1F1B on D devices, the most the stage on it holds whichever
devices stay idle (the proof is at CostModel.device_in_flight), so the budget never refuses a plan that
fits for being short; and a device no unit follows holds the last stage: CostModel.last_in_flight (1),
exact for GPipe's every stage.

Times and bytes are scaled to integers (``time_resolution`` steps for the slowest device running
everything; ``byte_resolution`` steps for all possible transfers), so "optimal" is exact up to that
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partitioner.cost import CostModel
from partitioner.search.coarsen import Coarsening, UnitCosts, identity, unit_costs

if TYPE_CHECKING:
    from partitioner.search.options import SolverOptions

# TensorFlow loads its runtime with RTLD_GLOBAL. Imported before OR-Tools, its abseil and protobuf
# symbols win over OR-Tools' own and CP-SAT crashes in Solve (google/or-tools#3230; here with
# tensorflow-cpu 2.21 and ortools 9.15). RTLD_DEEPBIND (Linux) makes OR-Tools bind to its own.
_DLOPEN_FLAGS = sys.getdlopenflags() if hasattr(os, "RTLD_DEEPBIND") else None
if _DLOPEN_FLAGS is not None:
    sys.setdlopenflags(_DLOPEN_FLAGS | os.RTLD_DEEPBIND)
try:
    from ortools.sat.python import cp_model as cp_model  # re-exported: the other modules import CP-SAT from here
finally:
    if _DLOPEN_FLAGS is not None:
        sys.setdlopenflags(_DLOPEN_FLAGS)

# Deterministic time (CP-SAT's count of work) per second of a time limit, with SolverOptions.deterministic.
# Measured on the 2-core development machine under load: InceptionV3 on 8 devices, one worker, about 0.5
# deterministic units per wall-clock second; with 0.4 the wall-clock limit rarely ends the search first.
DETERMINISTIC_TIME_PER_S = 0.4


@dataclass
class PlacementModel:
    """The CP-SAT model and the handles decode() needs."""

    model: cp_model.CpModel
    units: Coarsening  # what x places: one node per unit for the layer graph itself
    unit_costs: UnitCosts
    x: dict[tuple[int, int], cp_model.IntVar]  # only inside each unit's domain
    y: dict[tuple[int, int], cp_model.IntVar]  # only for lo(U) <= k < hi(U)
    r: dict[tuple[str, int], cp_model.IntVar]
    z: dict[tuple[str, int, int], cp_model.IntVar]
    c: dict[int, cp_model.IntVar]  # only when stages may recompute
    bottleneck: cp_model.IntVar
    weight: int  # W: objective = bottleneck * W + byte term
    time_unit_s: float  # seconds per integer time step
    sender_matters: set[int]  # receiving devices whose receive time depends on the sender's device


def build_model(
    costs: CostModel, pins: Mapping[str, str], options: SolverOptions, *, units: Coarsening | None = None
) -> PlacementModel:
    """Returns the CP-SAT model of placing ``units`` (default: every node alone) on ``costs.cluster``.

    ``pins`` apply to the default units; a coarsening carries its pins in its domains.
    See the module docstring for the formulation.
    """
    cluster, order = costs.cluster, costs.order
    num_devices = len(costs.devices)
    devices = range(num_devices)
    if units is None:
        units = identity(costs, {v: cluster.index(d) for v, d in pins.items()})
    uc = unit_costs(costs, units)
    domains = units.domains
    model = cp_model.CpModel()

    # Scaling: integer time steps and byte steps.
    # The costliest transfer per byte (receive_s is linear in the tensor's size).
    widest = max(order, key=costs.out_bytes.__getitem__)
    per_byte_s = (
        max(costs.receive_s(widest, j, k) for j in devices for k in devices if j != k) / costs.out_bytes[widest]
        if num_devices > 1 and costs.out_bytes[widest] > 0
        else 0.0
    )
    max_receive_s = sum(costs.out_bytes[u] * per_byte_s for u in order)
    slowest_mode = costs.modes[-1]  # recomputed when stages may recompute: never faster than kept
    horizon_s = max(sum(costs.mode_compute_s[slowest_mode][v][k] for v in order) for k in devices) + max_receive_s
    time_unit_s = horizon_s / options.time_resolution if horizon_s > 0 else 1.0
    total_bytes = sum(costs.out_bytes[u] for u in order) * max(num_devices - 1, 1)
    byte_unit = max(total_bytes / options.byte_resolution, 1.0)

    def steps(seconds: float) -> int:
        return round(seconds / time_unit_s)

    # ----- variables -----------------------------------------------------------------------------
    # x[U, k] == 1 iff unit U runs on device k (k in U's domain; a unit with one device has no variable)
    x = {
        (i, k): model.new_bool_var(f"x_{_name(units, i)}_{k}")
        for i, (lo, hi) in enumerate(domains)
        if lo < hi
        for k in range(lo, hi + 1)
    }
    # y[U, k] == 1 iff unit U runs on device k or earlier (lo(U) <= k < hi(U); 0 below, 1 from hi(U) on)
    y = {
        (i, k): model.new_bool_var(f"y_{_name(units, i)}_{k}")
        for i, (lo, hi) in enumerate(domains)
        for k in range(lo, hi)
    }

    def on(i: int, k: int) -> cp_model.IntVar | int:
        lo, hi = domains[i]
        return x[i, k] if lo < hi and lo <= k <= hi else int(lo == hi == k)

    def by(i: int, k: int) -> cp_model.IntVar | int:
        lo, hi = domains[i]
        return y[i, k] if lo <= k < hi else int(k >= hi)

    # r[u, k] == 1 iff device k receives u's output (u elsewhere, some reading unit on k)
    r = {}
    for u, home, readers in uc.senders:
        reach = {k for reader in readers for k in range(max(1, domains[reader][0]), domains[reader][1] + 1)}
        for k in sorted(reach):
            if not domains[home][0] == domains[home][1] == k:
                r[u, k] = model.new_bool_var(f"r_{u}_{k}")
    # z[u, j, k] == 1 iff device k receives u's output from device j (only where the sender matters)
    sender_matters = {
        k
        for k in range(1, num_devices)
        if len({(cluster.bandwidth(j, k), cluster.bandwidth(k, j)) for j in range(k)}) > 1
    }
    home_of = {u: home for u, home, _ in uc.senders}
    z = {
        (u, j, k): model.new_bool_var(f"z_{u}_{j}_{k}")
        for (u, k) in r
        if k in sender_matters
        for j in range(domains[home_of[u]][0], min(k, domains[home_of[u]][1] + 1))
    }
    # c[k] == 1 iff the stage on device k recomputes its forward in the backward (stages may recompute)
    recomputing = "recomputed" in costs.modes
    c = {k: model.new_bool_var(f"c_{k}") for k in devices} if recomputing else {}
    horizon_steps = steps(horizon_s) + len(order) + 1
    bottleneck = model.new_int_var(0, horizon_steps, "bottleneck")

    # ----- constraints ---------------------------------------------------------------------------
    for i, (lo, hi) in enumerate(domains):
        if lo < hi:
            model.add_exactly_one(x[i, k] for k in range(lo, hi + 1))
        for k in range(lo, hi):
            model.add(y[i, k] == sum(x[i, t] for t in range(lo, k + 1)))
            if k > lo:
                model.add_implication(y[i, k - 1], y[i, k])
    # Every edge goes forward: stage(U) <= stage(V), i.e. y[V, k] <= y[U, k].
    for a, b in uc.edges:
        for k in range(domains[b][0], min(domains[a][1], num_devices - 1)):
            _at_most(model, by(b, k), by(a, k))
    # Received tensors.
    for u, home, readers in uc.senders:
        for reader in readers:
            for k in range(max(1, domains[reader][0]), domains[reader][1] + 1):
                if (u, k) in r:
                    model.add(r[u, k] >= on(reader, k) - on(home, k))
    for u, j, k in z:
        model.add(z[u, j, k] >= on(home_of[u], j) + r[u, k] - 1)
    # later[k]: literals "unit i runs after device k" (True: always)
    later_of: dict[int, list[Any]] = {
        k: [True if lo > k else y[i, k].Not() for i, (lo, hi) in enumerate(domains) if k < hi] for k in devices
    }
    # The last stage is never recomputed: c[k] needs a unit on a later device ("always": c[k] iff there is one).
    for k, c_k in c.items():
        later = later_of[k]
        if any(lit is True for lit in later):
            if costs.recompute == "always":
                model.add(c_k == 1)
        elif not later:
            model.add(c_k == 0)
        else:
            model.add_bool_or(later).only_enforce_if(c_k)
            if costs.recompute == "always":
                for lit in later:
                    model.add_implication(lit, c_k)
    # Memory, in KiB rounded conservatively, in the stage's mode.
    received_on: dict[int, list[str]] = {k: [] for k in devices}
    for u, k in r:
        received_on[k].append(u)
    for k, device in enumerate(cluster.devices):
        capacity = device.memory_bytes // 1024
        # the device's own budget where a unit runs after it; the last stage's count where none does (kept:
        # the last stage is never recomputed)
        followed: Any = True
        if costs.last_in_flight < costs.device_in_flight[k] and not any(lit is True for lit in later_of[k]):
            followed = model.new_bool_var(f"followed_{k}") if later_of[k] else False
            for lit in later_of[k]:
                model.add_implication(lit, followed)
        budgets: list[tuple[bool, int, Any]] = [(False, costs.device_in_flight[k], followed)]  # (last?, count, when)
        if followed is not True:
            budgets.append((True, costs.last_in_flight, True))
        for mode in costs.modes:
            for last, count, when in budgets:
                if when is False or (last and mode != "kept"):
                    continue
                memory = uc.mode_memory_last[mode] if last else uc.mode_memory[mode][k]
                received = costs.input_memory_bytes(mode, count)
                held = [
                    math.ceil(memory[i] / 1024) * on(i, k)
                    for i, (lo, hi) in enumerate(domains)
                    if memory[i] > 0 and lo <= k <= hi
                ]
                held += [math.ceil(received[u] / 1024) * r[u, k] for u in received_on[k] if received[u] > 0]
                constraint = model.add(sum(held) <= capacity)
                enforce = [] if when is True else [when]
                if c:
                    enforce.append(c[k] if mode == "recomputed" else c[k].Not())
                if enforce:
                    constraint.only_enforce_if(enforce)
    # Shared layers stay together (pins are in the domains).
    for group in uc.colocated:
        for i in group[1:]:
            for k in range(min(domains[j][0] for j in group), max(domains[j][1] for j in group) + 1):
                _equal(model, on(i, k), on(group[0], k))
    # The bottleneck bounds every stage's compute (in its mode) + receive time.
    for k in devices:
        receive = []
        for u in received_on[k]:
            if k in sender_matters:
                lo, hi = domains[home_of[u]]
                receive += [steps(costs.receive_s(u, j, k)) * z[u, j, k] for j in range(lo, min(k, hi + 1))]
            else:
                receive.append(steps(costs.receive_s(u, 0, k)) * r[u, k])
        for mode in costs.modes:
            rows = uc.mode_compute_s[mode]
            compute = [steps(rows[i][k]) * on(i, k) for i, (lo, hi) in enumerate(domains) if lo <= k <= hi]
            constraint = model.add(bottleneck >= sum(compute) + sum(receive))
            if c and mode == "recomputed":
                constraint.only_enforce_if(c[k])

    # ----- objective: the bottleneck first, then the bytes sent ----------------------------------
    byte_terms = [round(costs.out_bytes[u] / byte_unit) * r[u, k] for (u, k) in r]
    weight = options.byte_resolution + len(r) + 1
    model.minimize(bottleneck * weight + sum(byte_terms))
    return PlacementModel(model, units, uc, x, y, r, z, c, bottleneck, weight, time_unit_s, sender_matters)


def _name(units: Coarsening, i: int) -> str:
    """A unit's name in variable names: its node, or its first node and how many follow."""
    unit = units.units[i]
    return unit[0] if len(unit) == 1 else f"{unit[0]}+{len(unit) - 1}"


def _at_most(model: cp_model.CpModel, a: cp_model.IntVar | int, b: cp_model.IntVar | int) -> None:
    """a <= b for Boolean variables or the constants 0 and 1."""
    if isinstance(a, int) and isinstance(b, int):
        if a > b:
            model.add(False)
    elif isinstance(a, int):
        if a:
            model.add(b == 1)
    elif isinstance(b, int):
        if not b:
            model.add(a == 0)
    else:
        model.add_implication(a, b)


def _equal(model: cp_model.CpModel, a: cp_model.IntVar | int, b: cp_model.IntVar | int) -> None:
    """a == b for Boolean variables or the constants 0 and 1."""
    if isinstance(a, int) and isinstance(b, int):
        if a != b:
            model.add(False)
    else:
        model.add(a == b)


def add_hint(m: PlacementModel, costs: CostModel, assignment: Mapping[str, str]) -> None:
    """Hints every variable of ``m`` with ``assignment`` (projected on the units where it splits one)."""
    where = m.units.project(assignment, costs.devices)
    for (i, k), var in m.x.items():
        m.model.add_hint(var, where[i] == k)
    for (i, k), var in m.y.items():
        m.model.add_hint(var, where[i] <= k)
    received = {
        (u, where[reader])
        for u, home, readers in m.unit_costs.senders
        for reader in readers
        if where[reader] != where[home]
    }
    home_of = {u: home for u, home, _ in m.unit_costs.senders}
    for (u, k), var in m.r.items():
        m.model.add_hint(var, (u, k) in received)
    for (u, j, k), var in m.z.items():
        m.model.add_hint(var, (u, k) in received and where[home_of[u]] == j)
    # Each stage's mode as the plan would take it, and the bottleneck as the model counts it: the costliest
    # stage in integer steps.
    used = sorted(set(where))
    recomputed = costs.evaluate(m.units.expand(where, costs.devices)).recompute if m.c else (False,) * len(used)
    modes = dict(zip(used, recomputed, strict=True))
    for k, var in m.c.items():
        later = any(k2 > k for k2 in used)
        m.model.add_hint(var, modes.get(k, False) or (costs.recompute == "always" and later and k not in modes))
    stage = [0] * len(costs.devices)
    for i, k in enumerate(where):
        rows = m.unit_costs.mode_compute_s["recomputed" if modes.get(k, False) else "kept"]
        stage[k] += round(rows[i][k] / m.time_unit_s)
    for u, k in received:
        sender = where[home_of[u]] if k in m.sender_matters else 0
        stage[k] += round(costs.receive_s(u, sender, k) / m.time_unit_s)
    m.model.add_hint(m.bottleneck, max(stage))


def solve_model(
    m: PlacementModel, time_limit_s: float, options: SolverOptions, *, relative_gap: float
) -> tuple[Any, cp_model.CpSolver]:
    """Solves ``m`` within ``time_limit_s``; returns CP-SAT's status and the solver holding the answer."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    if options.deterministic:
        solver.parameters.max_deterministic_time = float(time_limit_s) * DETERMINISTIC_TIME_PER_S
    solver.parameters.num_workers = (
        1 if options.deterministic else options.num_workers or min(8, (os.cpu_count() or 1) * 4)
    )
    solver.parameters.random_seed = options.seed
    solver.parameters.log_search_progress = options.log
    solver.parameters.relative_gap_limit = relative_gap
    # Measured on random DAGs of 200-1000 nodes: symmetry detection and probing in presolve cost
    # seconds and never paid back (benchmarks/planner_speed).
    solver.parameters.symmetry_level = 0
    solver.parameters.cp_model_probing_level = 0
    return solver.solve(m.model), solver


def decode(m: PlacementModel, solver: cp_model.CpSolver, costs: CostModel) -> dict[str, str]:
    """Reads {node: device name} from a solved model."""
    unit_devices = []
    for i, (lo, hi) in enumerate(m.units.domains):
        unit_devices.append(next((k for k in range(lo, hi + 1) if lo == hi or solver.boolean_value(m.x[i, k])), lo))
    return m.units.expand(unit_devices, costs.devices)
