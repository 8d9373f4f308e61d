"""The pipeline simulator: replays one training step of a plan, action by action, on its devices and links.

Every forward and every backward of every micro-batch on every stage is an action on its device; every
activation sent forward and every gradient sent back is an action on its link (one directed link per
pair of stages, one transfer at a time). A device runs one action at a time, in the order its
schedule gives, each as soon as the device is free and its inputs have arrived. Transfers run on the
links while the devices compute (copy engines), so a stage waits for its inputs but does not pay for
sending them. Durations come from the cost model (docs/cost-model.md): a stage's compute time per
micro-batch in the stage's mode, split into forward and backward by ``partitioner.cost.forward_share``
(one third forward for layers with trainable weights, one half otherwise, unless a node says
``forward_flops``), and bytes / bandwidth per transfer. A recomputed stage's backward runs its forward
again, and it holds its inputs per micro-batch in flight plus one micro-batch's activations during a
backward (``Plan.recompute``).

The order on each device is a :class:`partitioner.schedule.Schedule`, the one object the runtime follows
too; ``schedule=`` takes one, or its name:

- ``"gpipe"``: every stage but the last runs all M forwards, then all M backwards (fill-drain); the last
  runs each backward right after its forward. Every micro-batch's activations stay until its backward:
  M in flight, 1 on the last stage.
- ``"1f1b"``: PipeDream-flush: stage s runs min(K - s - 1, M) forwards to fill the pipe, then
  alternates one forward and one backward, then drains. The same bubble as GPipe with at most K - s
  micro-batches in flight on stage s.

Devices that share one processor (``Device.pool``: logical devices split from one CPU or GPU) slow each
other: while k of a pool of capacity C compute at once, each runs at min(1, C / k) of its speed, so the
replay goes event by event there (``Cluster.pools``; docs/cost-model.md, "Devices that share a processor").
On logical CPU devices of a pool (``Cluster.pooled_cpus``) a stage's gradient sums of each micro-batch (M > 1,
measured costs) are a job of the pool beside the stage's next pass, an ``"accumulate"`` span on its device;
elsewhere they are part of the backward.

On a uniform pipeline without transfer time (devices of their own) both give (M + K - 1) / M times the ideal step and a
bubble of (K - 1) / (M + K - 1), the closed form (tests hold the simulator to it exactly).

Example:
    >>> sim = pt.simulate(plan, graph, cluster, num_microbatches=8)           # doctest: +SKIP
    >>> sim.step_time_s, sim.bubble_fraction, sim.peak_memory_bytes["/GPU:0"]  # doctest: +SKIP
    (0.0412, 0.27, 12884901888)
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np

from partitioner.cluster import Cluster, same_devices
from partitioner.cost import CostModel, forward_share
from partitioner.errors import InputError, PlanError
from partitioner.schedule import SCHEDULES, Schedule, check_schedule_name, schedule_for

if TYPE_CHECKING:
    from partitioner.plan import Plan

__all__ = [
    "SCHEDULES",
    "SPAN_KINDS",
    "Simulation",
    "Span",
    "chain_step",
    "forward_share",
    "simulate",
    "simulate_assignment",
]

# "allreduce": a stage's R with the same stage of the other replicas (plans with replicas), after its last action
# "accumulate": a stage's gradient sums of one micro-batch beside its next pass, on a pooled CPU device (on the
# device's row, overlapping its passes; Cluster.pooled_cpus)
SPAN_KINDS = ("forward", "backward", "send_activation", "send_gradient", "allreduce", "accumulate")
_PASSES = {"F": "forward", "B": "backward"}  # a schedule action's kind -> its span's kind


@dataclass(frozen=True)
class Span:
    """One resource busy from start to end: a schedule's action on its device, or a transfer on a link ("a -> b")."""

    kind: str  # one of SPAN_KINDS
    resource: str  # a device name, or "sender -> receiver" for a transfer
    stage: int  # the stage computing, or the sending stage of a transfer
    microbatch: int  # -1 for an all-reduce: the whole step's gradients
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Simulation:
    """The outcome of one simulated training step. Device-keyed mappings cover the used stages."""

    schedule: str  # the schedule's name: "gpipe", "1f1b" or "custom"
    num_microbatches: int
    stages: tuple[str, ...]  # used devices in pipeline order
    step_time_s: float  # from the first action's start to the last action's end
    busy_s: dict[str, float]  # seconds each device computes (on a shared processor: the slowed seconds)
    idle_s: dict[str, float]  # step_time_s - busy_s
    bubble_fraction: float  # idle share of the used devices over the step
    peak_memory_bytes: dict[str, int]  # weights, gradients, optimizer slots and the most activations held
    peak_in_flight: dict[str, int]  # most micro-batches whose activations a device holds at once
    # the most bytes the used devices hold together at one moment: what one memory they share (logical CPU
    # devices, one allocator) must hold; at most the sum of peak_memory_bytes plus the sent tensors waiting
    # for their readers, less where the peaks of the devices do not coincide (_peak_total_bytes)
    peak_total_bytes: int
    timeline: tuple[Span, ...] = field(repr=False)  # sorted by start time

    @property
    def links(self) -> tuple[str, ...]:
        """The links that carried a transfer, in order of first use."""
        return tuple(dict.fromkeys(a.resource for a in self.timeline if a.kind.startswith("send")))

    def actions_on(self, resource: str) -> list[Span]:
        """The spans of one device or link, in start order."""
        return [a for a in self.timeline if a.resource == resource]


def simulate(
    plan: Plan,
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    schedule: str | Schedule | None = None,
    num_microbatches: int | None = None,
    recompute: str | Sequence[bool] | None = None,
) -> Simulation:
    """Simulates one training step of ``plan`` (see the module docstring).

    Args:
        plan: a plan for ``graph`` on ``cluster``.
        graph: the layer graph the plan was made for.
        cluster: the cluster the plan was made for (its devices listed in any order: the plan has its own).
        schedule: "gpipe", "1f1b", or a Schedule for the plan's K stages and M micro-batches; the
            schedule the plan was made for when None.
        num_microbatches: M; the plan's own M when None. Costs are per micro-batch as profiled.
        recompute: one bool per stage (True: recomputed) or a policy ("never", "always", "auto");
            the plan's own ``recompute`` when None.

    Raises:
        InputError: for an unknown schedule name or recompute policy, a Schedule for another K or M, or a bad M.
        PlanError: when the plan does not match the graph or cluster, an edge goes backward, or
            ``recompute`` does not give one bool per stage or recomputes the last stage.
    """
    cluster = same_devices(cluster, plan.devices)  # a plan lists the devices in the pipeline order it chose
    if tuple(cluster.names) != tuple(plan.devices):
        raise PlanError(
            f"The plan was made for devices {list(plan.devices)} but the cluster has {cluster.names}. "
            "Simulate with the cluster the plan was made for."
        )
    costs = plan.cost_model(graph, cluster, num_microbatches=num_microbatches)
    simulation = simulate_assignment(
        costs, plan.assignment, schedule=schedule, recompute=plan.recompute if recompute is None else recompute
    )
    return _with_reductions(simulation, plan.reduce_times)  # replicas' or workers' R, where priced


def _with_reductions(simulation: Simulation, reduce_times: Mapping[str, float]) -> Simulation:
    """``simulation`` with each stage's ``R`` (``Plan.reduce_times``: its gradients all-reduced with the same
    stage of the other replicas) from the end of its device's last action; the step ends with the last."""
    spans = []
    for s, device in enumerate(simulation.stages):
        seconds = reduce_times.get(device, 0.0)
        if seconds > 0:
            start = max((a.end_s for a in simulation.actions_on(device)), default=0.0)
            spans.append(Span("allreduce", device, s, -1, start, start + seconds))
    if not spans:
        return simulation
    timeline = sorted([*simulation.timeline, *spans], key=lambda a: (a.start_s, a.end_s, a.resource))
    step = max(a.end_s for a in timeline)
    idle = {name: step - busy for name, busy in simulation.busy_s.items()}
    return replace(
        simulation,
        step_time_s=step,
        idle_s=idle,
        bubble_fraction=sum(idle.values()) / (len(idle) * step) if step > 0 else 0.0,
        timeline=tuple(timeline),
    )


def simulate_assignment(
    costs: CostModel,
    assignment: Mapping[str, str],
    *,
    schedule: str | Schedule | None = None,
    recompute: str | Sequence[bool] | None = None,
) -> Simulation:
    """Simulates a placement {node: device} scored by ``costs`` (its M, optimizer slots and cost source).

    ``schedule`` is a name or a Schedule for the placement's stages and ``costs.num_microbatches``;
    ``costs.schedule`` when None. ``recompute`` is one bool per stage or a policy; ``costs.recompute``
    when None.
    """
    if schedule is None:
        schedule = costs.schedule
    if isinstance(schedule, str):
        check_schedule_name(schedule)  # before the placement's own checks
    stages = _Stages(costs, assignment, recompute)
    simulation = _run(stages, schedule_for(schedule, len(stages.names), costs.num_microbatches))
    return _with_reductions(simulation, costs.reduce_times(assignment))  # each stage's R, where priced


class _Stages:
    """Per-stage forward/backward seconds and memory (in each stage's mode), and the seconds between stages."""

    def __init__(self, costs: CostModel, assignment: Mapping[str, str], recompute: str | Sequence[bool] | None) -> None:
        where = costs.check_assignment(assignment)
        for u, v in costs.graph.edges:
            if where[u] > where[v]:
                raise PlanError(
                    f"Edge '{u}' -> '{v}' goes backward ('{u}' on {assignment[u]}, '{v}' on {assignment[v]}); "
                    "a pipeline schedule needs every edge to go forward in device order. Plan again."
                )
        ev = costs.evaluate(assignment, recompute)
        used = [costs.devices.index(name) for name in ev.stages]
        self.names = ev.stages
        self.costs = ev.stage_costs
        self.forward_s = [c.forward_s for c in ev.stage_costs]
        self.backward_s = [c.backward_s for c in ev.stage_costs]
        sent = ev.sent_bytes or {}
        # seconds per micro-batch for each (sender, receiver) pair of stages; gradients go back over (receiver, sender)
        self.activation_s = {(a, b): n / costs.cluster.bandwidth(used[a], used[b]) for (a, b), n in sent.items()}
        self.gradient_s = {(b, a): n / costs.cluster.bandwidth(used[b], used[a]) for (a, b), n in sent.items()}
        self.sent_bytes = dict(sent)
        self.recompute = ev.recompute
        self.output_bytes = ev.model_output_bytes
        # per stage: its gradient sums per micro-batch run beside its next pass (a pooled CPU device), 0 if none
        self.sums_s = list(ev.sums_s)
        # (capacity, stages) of each pool of devices sharing one processor whose work can outgrow it: more stages
        # than its capacity, or a stage's sums beside its passes
        self.pools = [
            (capacity, shared)
            for capacity, members in costs.cluster.pools(every=True).values()
            if (shared := tuple(used.index(i) for i in members if i in used))
            and (len(shared) > capacity or any(self.sums_s[s] > 0 for s in shared))
        ]
        # per stage: each of its nodes' outputs that later stages read, as (bytes, those stages): one buffer
        # however many read it (peak_total_bytes)
        stage_of = {v: used.index(k) for v, k in where.items()}
        self.outputs_sent: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in used]
        for u in costs.order:
            readers = sorted({stage_of[v] for v in costs.graph.succ[u]} - {stage_of[u]})
            if readers:
                self.outputs_sent[stage_of[u]].append((costs.out_bytes[u], tuple(readers)))


def _run(stages: _Stages, schedule: Schedule) -> Simulation:
    """Replays ``schedule`` on the stages: every compute and transfer span, each resource running its queue in
    order; devices that share a processor (``Cluster.pools``) share it while they compute at once."""
    queues = _Queues(stages, schedule)
    replay = _replay_shared if stages.pools else _replay
    timeline, done, arrived = replay(stages, queues, schedule)
    timeline.sort(key=lambda a: (a.start_s, a.end_s, a.resource))
    count = len(stages.names)
    step = max((a.end_s for a in timeline), default=0.0)
    busy = {name: 0.0 for name in stages.names}
    for a in timeline:
        if a.kind in ("forward", "backward"):
            busy[a.resource] += a.duration_s
    idle = {name: step - busy[name] for name in stages.names}
    in_flight = _peak_in_flight(timeline, stages.names)
    return Simulation(
        schedule=schedule.name,
        num_microbatches=schedule.num_microbatches,
        stages=stages.names,
        step_time_s=step,
        busy_s=busy,
        idle_s=idle,
        bubble_fraction=sum(idle.values()) / (count * step) if step > 0 else 0.0,
        peak_memory_bytes={name: stages.costs[s].memory_bytes(in_flight[name]) for s, name in enumerate(stages.names)},
        peak_in_flight=in_flight,
        peak_total_bytes=_peak_total_bytes(stages, timeline, arrived, done, schedule.num_microbatches),
        timeline=tuple(timeline),
    )


_Done = dict[tuple[str, int, int], float]  # (kind, stage, m) -> end of a compute action
_Arrived = dict[tuple[str, int, int, int], float]  # (kind, sender, receiver, m) -> end of a transfer


class _Queues:
    """Each device's queue (its stage's row of the schedule: (kind, microbatch)) and each link's (in the order its
    sender produces), with the replay's progress through them and the transfers it has placed."""

    def __init__(self, stages: _Stages, schedule: Schedule) -> None:
        count = len(stages.names)
        self.compute = [[(_PASSES[a.kind], a.microbatch) for a in row] for row in schedule.actions]
        self.link_s: dict[tuple[int, int], float] = {**stages.activation_s, **stages.gradient_s}
        self.link: dict[tuple[int, int], list[tuple[str, int]]] = {pair: [] for pair in self.link_s}
        for s in range(count):
            for kind, m in self.compute[s]:
                wanted = "send_activation" if kind == "forward" else "send_gradient"
                table = stages.activation_s if kind == "forward" else stages.gradient_s
                for pair in table:
                    if pair[0] == s:
                        self.link[pair].append((wanted, m))
        self.inputs_forward = {b: [a for (a, bb) in stages.activation_s if bb == b] for b in range(count)}
        self.inputs_backward = {a: [b for (b, aa) in stages.gradient_s if aa == a] for a in range(count)}
        self.compute_next = [0] * count
        self.link_next = dict.fromkeys(self.link_s, 0)
        self.link_free = dict.fromkeys(self.link_s, 0.0)
        self.pending = sum(len(q) for q in self.compute) + sum(len(q) for q in self.link.values())

    def ready(self, s: int, done: _Done, arrived: _Arrived) -> tuple[str, int, float] | None:
        """Device s's next action and when its inputs are all there, or None (queue done, or an input unknown)."""
        if self.compute_next[s] >= len(self.compute[s]):
            return None
        kind, m = self.compute[s][self.compute_next[s]]
        at = _compute_ready(kind, s, m, done, arrived, self.inputs_forward, self.inputs_backward)
        return None if at is None else (kind, m, at)

    def send(self, stages: _Stages, done: _Done, arrived: _Arrived, timeline: list[Span]) -> bool:
        """Places every transfer whose data is made (a link sends one at a time, in its queue's order)."""
        progressed = False
        for pair, queue in self.link.items():
            while self.link_next[pair] < len(queue):
                kind, m = queue[self.link_next[pair]]
                source = ("forward" if kind == "send_activation" else "backward", pair[0], m)
                if source not in done:
                    break
                start = max(self.link_free[pair], done[source])
                end = start + self.link_s[pair]
                arrived[(kind, pair[0], pair[1], m)] = end
                self.link_free[pair] = end
                resource = f"{stages.names[pair[0]]} -> {stages.names[pair[1]]}"
                timeline.append(Span(kind, resource, pair[0], m, start, end))
                self.link_next[pair] += 1
                self.pending -= 1
                progressed = True
        return progressed


def _deadlock(schedule: Schedule) -> PlanError:
    # cannot happen: a Schedule validates against these dependencies where it is built
    return PlanError(
        f"The {schedule.name} schedule deadlocked in the simulator; this is a bug, please report it.\n"
        + schedule.grid()
    )


def _replay(stages: _Stages, queues: _Queues, schedule: Schedule) -> tuple[list[Span], _Done, _Arrived]:
    """List scheduling: each action starts when its device is free and its inputs are there, and runs at its
    device's full speed, so its end is known when it starts."""
    done: _Done = {}
    arrived: _Arrived = {}
    device_free = [0.0] * len(stages.names)
    timeline: list[Span] = []
    while queues.pending:
        progressed = False
        for s in range(len(stages.names)):
            while (next_action := queues.ready(s, done, arrived)) is not None:
                kind, m, ready = next_action
                start = max(device_free[s], ready)
                end = start + (stages.forward_s[s] if kind == "forward" else stages.backward_s[s])
                done[(kind, s, m)] = end
                device_free[s] = end
                timeline.append(Span(kind, stages.names[s], s, m, start, end))
                queues.compute_next[s] += 1
                queues.pending -= 1
                progressed = True
        progressed = queues.send(stages, done, arrived, timeline) or progressed
        if not progressed:
            raise _deadlock(schedule)
    return timeline, done, arrived


def _replay_shared(stages: _Stages, queues: _Queues, schedule: Schedule) -> tuple[list[Span], _Done, _Arrived]:
    """Event by event, for devices that share a processor: while k jobs of a pool of capacity C compute at
    once, each runs at min(1, C / k) of its own speed (processor sharing), so an action's end is known only as
    the others start and end. A job is a device's action, or a stage's gradient sums of one micro-batch
    (``_Stages.sums_s``), which start when the stage's backward of the micro-batch and its previous sums are
    done (the loop adds every micro-batch's gradients into sums that start at zero) and run beside the
    stage's next actions, which do not wait for them (the runtime's loop runs two iterations at once:
    runtime/train_step.py); the step ends when the last are added. The loop runs at most P = max(2, the
    schedule's windows) micro-batches at once (``parallel_iterations``), so no action of micro-batch m starts
    before every stage's sums of m - P are added. Devices outside a pool run at full speed; transfers take
    their own time."""
    count = len(stages.names)
    pool_of = [-1] * count  # the index of each stage's pool in stages.pools, -1 for none
    for p, (_, members) in enumerate(stages.pools):
        for s in members:
            pool_of[s] = p
    done: _Done = {}
    arrived: _Arrived = {}
    timeline: list[Span] = []
    # (stage, lane) -> (kind, m, start, work, work left); lane 0: the device's actions, 1: the stage's sums
    running: dict[tuple[int, int], tuple[str, int, float, float, float]] = {}
    summing: list[list[int]] = [[] for _ in range(count)]  # per stage: micro-batches whose sums wait, in order
    summed: set[tuple[int, int]] = set()  # (stage, micro-batch) whose sums are added
    try:
        ahead = max(2, *schedule.windows())  # the loop's iterations at once (runtime/train_step.py)
    except InputError:  # a custom order the runtime's loop cannot follow: no such bound
        ahead = schedule.num_microbatches
    summers = [t for t in range(count) if stages.sums_s[t] > 0]
    now = 0.0
    while queues.pending or any(summing) or running:
        queues.send(stages, done, arrived, timeline)
        waits = []
        for s in range(count):
            if (s, 1) not in running and summing[s]:
                work = stages.sums_s[s]
                running[(s, 1)] = ("accumulate", summing[s].pop(0), now, work, work)
            if (s, 0) in running or (next_action := queues.ready(s, done, arrived)) is None:
                continue
            kind, m, ready = next_action
            if m >= ahead and any((t, m - ahead) not in summed for t in summers):
                continue  # iteration m waits for iteration m - P, its sums included: a running sums' end moves on
            if ready <= now:
                work = stages.forward_s[s] if kind == "forward" else stages.backward_s[s]
                running[(s, 0)] = (kind, m, now, work, work)
                queues.compute_next[s] += 1
            else:
                waits.append(ready)
        busy = [0] * len(stages.pools)
        for s, _ in running:
            if pool_of[s] >= 0:
                busy[pool_of[s]] += 1
        rate = {
            key: 1.0 if pool_of[key[0]] < 0 else min(1.0, stages.pools[pool_of[key[0]]][0] / busy[pool_of[key[0]]])
            for key in running
        }
        ends = {key: now + left / rate[key] for key, (_, _, _, _, left) in running.items()}
        if not ends and not waits:
            raise _deadlock(schedule)
        later = min([*ends.values(), *waits])
        for key in sorted(running):
            kind, m, start, work, left = running[key]
            left -= rate[key] * (later - now)
            if ends[key] != later and left > 1e-12 * work:  # not done (what rounding leaves is no work)
                running[key] = (kind, m, start, work, left)
                continue
            s = key[0]
            del running[key]
            timeline.append(Span(kind, stages.names[s], s, m, start, later))
            if kind == "accumulate":
                summed.add((s, m))
                continue
            done[(kind, s, m)] = later
            queues.pending -= 1
            if kind == "backward" and stages.sums_s[s] > 0:
                summing[s].append(m)
        now = later
    return timeline, done, arrived


def chain_step(
    schedule: str,
    num_microbatches: int,
    forward: np.ndarray,
    backward: np.ndarray,
    activation: np.ndarray,
    gradient: np.ndarray,
) -> np.ndarray:
    """The simulated step of pipelines of stages in a line, from each stage's figures: the replay of
    :func:`simulate_assignment`, without spans, for many pipelines of K stages at once.

    Each array is [K, P] (P pipelines, or [K] for one): stage s's forward and backward seconds per
    micro-batch, the seconds its activation takes to arrive from stage s - 1 and its gradient to go back
    (0 for stage 0). Every action of the schedule runs as the simulator runs it: when its device is free
    and its inputs have arrived, each link one transfer at a time in the order its sender produces. Each
    device computes at its own speed: devices that share a processor (``Cluster.pools``) are the
    simulator's alone, so there this is a bound from below.
    Returns the step of each pipeline ([P], or a 0-d array).

    Example:
        >>> float(chain_step("1f1b", 4, np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.zeros(2), np.zeros(2)))
        15.0
    """
    f, b = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
    a, g = np.asarray(activation, dtype=np.float64), np.asarray(gradient, dtype=np.float64)
    count = f.shape[0]
    device = np.zeros_like(f)  # [s]: when stage s's device is free
    sending = np.zeros_like(f)  # [s]: when the link into stage s is free (activations)
    returning = np.zeros_like(f)  # [s]: when the link from stage s back to s - 1 is free (gradients)
    arrived = np.zeros((count, num_microbatches, *f.shape[1:]))  # [s, m]: m's activation at stage s
    returned = np.zeros_like(arrived)  # [s, m]: m's gradient at stage s
    forwarded = np.zeros_like(arrived)  # [s, m]: the end of stage s's forward of m
    for s, is_forward, m in _replay_order(schedule, count, num_microbatches):
        if is_forward:
            end = np.maximum(device[s], arrived[s, m]) + f[s]
            forwarded[s, m] = end
            if s + 1 < count:
                sending[s + 1] = np.maximum(sending[s + 1], end) + a[s + 1]
                arrived[s + 1, m] = sending[s + 1]
        else:
            end = np.maximum(device[s], np.maximum(forwarded[s, m], returned[s, m])) + b[s]
            if s > 0:
                returning[s] = np.maximum(returning[s], end) + g[s]
                returned[s - 1, m] = returning[s]
        device[s] = end
    result: np.ndarray = device.max(axis=0)
    return result


@functools.lru_cache(maxsize=256)
def _replay_order(schedule: str, num_stages: int, num_microbatches: int) -> tuple[tuple[int, bool, int], ...]:
    """(stage, forward?, micro-batch) of every action of a named schedule, in an order its data allows."""
    actions = Schedule.make(schedule, num_stages, num_microbatches).global_order()
    return tuple((a.stage, a.kind == "F", a.microbatch) for a in actions)


def _compute_ready(
    kind: str,
    s: int,
    m: int,
    done: Mapping[tuple[str, int, int], float],
    arrived: Mapping[tuple[str, int, int, int], float],
    inputs_forward: Mapping[int, Sequence[int]],
    inputs_backward: Mapping[int, Sequence[int]],
) -> float | None:
    """When the inputs of a compute action are all there, or None if one is still missing."""
    if kind == "forward":
        needed = [("send_activation", a, s, m) for a in inputs_forward[s]]
        own: list[float] = []
    else:
        if ("forward", s, m) not in done:
            return None
        needed = [("send_gradient", b, s, m) for b in inputs_backward[s]]
        own = [done[("forward", s, m)]]
    times = []
    for key in needed:
        if key not in arrived:
            return None
        times.append(arrived[key])
    return max([0.0, *own, *times])


def _peak_total_bytes(
    stages: _Stages,
    timeline: Sequence[Span],
    arrived: Mapping[tuple[str, int, int, int], float],
    done: Mapping[tuple[str, int, int], float],
    num_microbatches: int,
) -> int:
    """The most bytes all stages hold at one moment of the simulated step, in one memory they share (a
    tensor sent is one buffer, not a copy), each stage holding at time t:

    - its weights and its step's bytes (``ModeCost.step_bytes``) but the collected model outputs, all step;
    - of the collected outputs, one micro-batch's for the work on them from the start, and one more from
      each forward's start (M + 1 at the end, as step_bytes counts them);
    - with n micro-batches in flight (from a forward's start to the end of its backward), n times its held
      bytes and, while n > 0, its once bytes (``ModeCost.memory_bytes``'s terms at each moment);
    - each tensor it sends, from the end of the action that made it until the last action that reads
      it starts (one buffer however many stages read it), where the sender's figures do not hold it: every
      gradient, and a recomputed stage's outputs, as it keeps only its inputs. A kept stage is taken to
      hold its outputs among its activations (a layer that keeps its output for its backward, as ReLU's
      does; a linear layer keeps its input instead, and its output waiting is not counted). Made before
      the reader is ready, a tensor waits: GPipe's stages before the last run their forwards ahead of
      the last stage, which takes one micro-batch at a time.

    At equal times releases come before acquires. Each stage's share is at most its
    ``peak_memory_bytes`` but the tensors waiting, and the total at most their sum plus those: the peaks
    of two stages need not coincide (a GPipe stage holds M micro-batches before its backwards while the
    last stage's outputs are not yet collected).
    """
    fixed = sum(
        cost.weight_bytes + cost.step_bytes - num_microbatches * out
        for cost, out in zip(stages.costs, stages.output_bytes, strict=True)
    )
    # (time, in flight +1 / -1 or 0 for bytes alone, stage or -1, bytes): at equal times releases come first
    events: list[tuple[float, int, int, int]] = []
    begins: dict[tuple[str, int, int], float] = {}
    for a in timeline:
        change = _holding(a)
        if change is not None:
            begins[(a.kind, a.stage, a.microbatch)] = a.start_s
            time, step = change
            events.append((time, step, a.stage, stages.output_bytes[a.stage] if step > 0 else 0))
    waits: list[tuple[float, float, int]] = []  # (made, read, bytes)
    for s, sends in enumerate(stages.outputs_sent):
        if stages.recompute[s]:
            for m in range(num_microbatches):
                waits += [
                    (done[("forward", s, m)], max(begins[("forward", r, m)] for r in readers), size)
                    for size, readers in sends
                ]
    for kind, sender, receiver, m in arrived:
        if kind == "send_gradient":  # back over the pair its activation came by: one tensor per pair
            made, read = done[("backward", sender, m)], begins[("backward", receiver, m)]
            waits.append((made, read, stages.sent_bytes[(receiver, sender)]))
    for made, read, size in waits:
        if read > made:
            events += [(made, 0, -1, size), (read, -1, -1, -size)]  # -1: a release, ordered first
    in_flight = [0] * len(stages.costs)
    held = peak = 0
    for _, step, s, size in sorted(events, key=lambda e: (e[0], e[1] >= 0)):
        held += size
        if s >= 0 and step:
            cost, before = stages.costs[s], in_flight[s]
            in_flight[s] += step
            held += step * cost.held_bytes + cost.once_bytes * ((in_flight[s] > 0) - (before > 0))
        peak = max(peak, held)
    return fixed + peak


def _holding(a: Span) -> tuple[float, int] | None:
    """When ``a`` changes its stage's micro-batches in flight, held from a forward's start to its
    backward's end: (time, +1 or -1); None for a span that does not (a transfer, an all-reduce)."""
    if a.kind == "forward":
        return a.start_s, 1
    if a.kind == "backward":
        return a.end_s, -1
    return None


def _peak_in_flight(timeline: Sequence[Span], names: Sequence[str]) -> dict[str, int]:
    """Most micro-batches per device whose activations are held (:func:`_holding`)."""
    events: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
    for a in timeline:
        change = _holding(a)
        if change is not None:
            events[a.resource].append(change)
    peak = {}
    for name, items in events.items():
        heapq.heapify(items)  # at equal times a release (-1) comes before an acquire (+1)
        held = best = 0
        while items:
            _, delta = heapq.heappop(items)
            held += delta
            best = max(best, held)
        peak[name] = best
    return peak
