"""The cost model: how long each stage takes and how much memory each device needs for a placement.

One :class:`CostModel` is shared by every planner (CP-SAT, the exact chain DP, the baselines) and the
simulator, so all plans are scored by the same formulas; docs/cost-model.md writes them down. The
one place node costs combine into a stage's is :func:`mode_cost`: a stage runs in a *mode*,

    mode          forward   backward              held per micro-batch in flight   held once (in a backward)
    kept          F         B                     A (every activation)             G
    recomputed    F         B + F (forward again) I (the stage's inputs)           A (one micro-batch's) + G

with F, B, A summed over the stage's nodes, I the bytes of the tensors it receives, and G, with M > 1
(the runtime's loop), the gradients a backward makes of its nodes' outputs and of I (0 at M = 1), so a
stage's figures are a node's, a coarsened unit's or a stage's alike (every term is a sum)::

    compute(s)    = forward + backward of the stage's mode, on its device, each pass (a forward, a backward,
                    a recomputed forward) plus the device's fixed action_overhead_s
    receive(d)    = sum over nodes u on another device with a successor on d of
                    out_bytes(u) / bw(dev(u), d) + out_bytes(u) / bw(d, dev(u))   (activation, then its gradient)
    stage_time(d) = compute(d) + receive(d)           bottleneck = max over used devices
    weights(v)    = param_bytes(v) + trainable_param_bytes(v) * (gradient_copies + optimizer_slots)
    step(v)       = M * model_input_bytes(v) + (M + 1) * model_output_bytes(v)
                    (the batch split into micro-batches, the outputs collected, held all step, and one
                    micro-batch's more: the loss's gradient of them, the metrics' temporaries)
    memory(s)     = weights + step + received(s) + in_flight(s) * held + held once
    received(s)   = sum over the tensors s receives of bytes x in_flight(sender): the copies on s of the
                    inputs of every micro-batch its sender holds, those s's forwards keep for its backward
                    and those the sender ran ahead that wait for s's forwards (GPipe's last stage M - 1 of
                    them); a recomputed stage's held bytes count in_flight(s) of them, received(s) the rest
    in_flight(s)  = the most micro-batches stage s holds under the schedule: M for GPipe (1 on its last stage),
                    min(K - s, M) for 1F1B
    step_time     = (M + K - 1) * bottleneck          for K stages and M micro-batches (either schedule)

The last stage is never recomputed (its backward follows its forward at once in the runtime, which
keeps the tape). ``recompute`` picks the modes: "never", "always" (every stage but the last) or
"auto" (a stage is recomputed only when its kept activations do not fit and recomputing holds less;
recomputation never shortens a step in this model, it only saves memory).

What the planners budget (docs/cost-model.md, "Memory budgets"): the chain DP each stage's own
in_flight (it knows K - s); CP-SAT and the start heuristics, which place a node before they know its
stage, the most the device at position k can hold in any plan, ``device_in_flight[k]`` (M for GPipe but
1 on the last device, min(number of devices - k, M) for 1F1B), and CP-SAT the last stage's
``last_in_flight`` on a device no unit follows; :meth:`CostModel.evaluate` counts each stage's own figure.
For the copies of a received tensor (``received_copies``: one per micro-batch its sender holds) the chain DP
budgets the stage right before's count (``ScheduleFamily.window_before``), CP-SAT the most any stage holds
(``max_in_flight``), and ``evaluate`` each received tensor's own sender's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from partitioner.cluster import Cluster
from partitioner.errors import InputError, PlanError
from partitioner.graph import gradient_bytes, topological_order, trainable_param_bytes
from partitioner.problem import Problem, Reductions, check_recompute
from partitioner.schedule import schedule_family

MODES = ("kept", "recomputed")
# Backward FLOPs per forward FLOP: gradients for the inputs and the trainable weights (2x), or for the
# inputs only (1x). The profiler writes flops = forward * (1 + this); the simulator splits by it.
BACKWARD_PER_FORWARD = {True: 2.0, False: 1.0}
# Gradient copies of a trainable weight beyond its gradient, with M > 1: the runtime sums each stage's
# weight gradients over the micro-batches in the loop (runtime/train_step.py), with adds inlined into the loop
# (``stage<s>_accumulate``), which write the new sums into the buffer of the sums so far: while it adds a
# micro-batch's gradients the stage holds the sums and the gradients. Measured (stop 35,
# benchmarks/memory_model/gradient_sums.py): one stage of 8 Dense(1024) (32.1 MiB of weights), SGD, M = 4 and 8,
# the step's allocations 66.7 and 65.5 MiB; with the add a function the loop called (stop 34) 98.5 and 97.9, a
# third copy (the call's result cannot take a buffer its caller holds). docs/cost-model.md, "the gradient sums".
ACCUMULATING_COPIES = 1
# Gradient copies of a trainable weight beyond its gradient, with D > 1 replicas: each stage's R action packs its
# gradient sums into one flat tensor for the all-reduce (runtime/replicas.py), so it holds the sums and the packed
# copy at once (the collective's output takes the packed tensor's buffer). Measured: 4 gradients of 16 MiB on 2
# replicas, peak 112-128 MiB above resting per replica against 32 MiB without the all-reduce
# (benchmarks/memory_model/allreduce.py). With M > 1 the loop's copies already cover it.
REDUCING_COPIES = 1


def gradient_copies(num_microbatches: int, num_replicas: int) -> int:
    """Copies of a trainable weight's gradient a stage holds at once: the gradient, and with M > 1 the sums
    it is added to (ACCUMULATING_COPIES), with D > 1 replicas the packed copy the all-reduce takes beside the
    sums (REDUCING_COPIES): the larger of the two.

    Example:
        >>> gradient_copies(1, 1), gradient_copies(8, 1), gradient_copies(1, 4), gradient_copies(8, 4)
        (1, 2, 2, 2)
    """
    return 1 + max(ACCUMULATING_COPIES * (num_microbatches > 1), REDUCING_COPIES * (num_replicas > 1))


@dataclass(frozen=True)
class ModeCost:
    """What a node, a unit or a stage costs in one mode, per micro-batch (see :func:`mode_cost`)."""

    forward_s: float  # seconds of the forward pass
    backward_s: float  # seconds of the backward pass (with the forward again when recomputed)
    weight_bytes: int  # weights, and gradients (and their sums) and optimizer slots of the trainable ones
    held_bytes: int  # bytes held per micro-batch in flight
    once_bytes: int  # bytes held once, while a backward runs
    step_bytes: int = 0  # bytes held all step whatever is in flight: the split inputs, the collected outputs
    received_bytes: int = 0  # received inputs held beside in_flight x held: kept, all; recomputed, those waiting

    @property
    def compute_s(self) -> float:
        """Forward + backward seconds."""
        return self.forward_s + self.backward_s

    def memory_bytes(self, in_flight: int) -> int:
        """Peak bytes with ``in_flight`` micro-batches held: weights + step + received + in_flight * held + held
        once. Every term is a sum over nodes, so a stage's figure is the sum of its nodes'.

        Example:
            >>> ModeCost(0.0, 0.0, weight_bytes=100, held_bytes=10, once_bytes=0, step_bytes=8).memory_bytes(2)
            128
        """
        return (
            self.weight_bytes
            + self.step_bytes
            + self.received_bytes
            + in_flight * self.held_bytes
            + (self.once_bytes if in_flight > 0 else 0)
        )


def mode_cost(
    mode: str,
    *,
    forward_s: float = 0.0,
    backward_s: float = 0.0,
    weight_bytes: int = 0,
    activation_bytes: int = 0,
    input_bytes: int = 0,
    step_bytes: int = 0,
    gradient_bytes: int = 0,
    looped: bool = False,
    received_bytes: int = 0,
) -> ModeCost:
    """The costs of work in ``mode``: the one place the planners and the simulator take them from.

    Every argument is a sum over the nodes of a stage (or one node, or a unit): ``input_bytes`` are
    the tensors the stage receives from other stages, which a recomputed stage saves per micro-batch.
    ``step_bytes``, the same in either mode, is what the runtime holds all step long beside the layers
    (:meth:`CostModel.step_bytes`); ``received_bytes`` the copies of received inputs held beside those
    (:meth:`CostModel.evaluate`: in kept mode every one, recomputed the ones beyond its micro-batches in
    flight, whose inputs ``held_bytes`` counts).

    With ``looped`` (M > 1: the runtime's loop calls each stage's backward as a function it does not
    inline, so the activations the call reads stay alive until it returns) a running backward also holds
    the gradients it makes of one micro-batch's outputs of the nodes (``gradient_bytes`` more,
    :func:`partitioner.graph.gradient_bytes`) and of the inputs it received (``input_bytes`` more, sent
    back), in either mode: the backward's working set (docs/cost-model.md, "Stage modes").

    Example:
        >>> cost = mode_cost("recomputed", forward_s=1.0, backward_s=2.0, activation_bytes=80, input_bytes=8)
        >>> cost.backward_s, cost.held_bytes, cost.once_bytes  # one micro-batch's recomputed activations
        (3.0, 8, 80)
        >>> cost = mode_cost("recomputed", activation_bytes=80, input_bytes=8, gradient_bytes=30, looped=True)
        >>> cost.once_bytes  # + the gradients the backward makes, of the outputs and of the inputs
        118
        >>> mode_cost("kept", activation_bytes=80, input_bytes=8, gradient_bytes=30, looped=True).once_bytes
        38
    """
    # a backward in the loop makes the gradients of its nodes' outputs and of the inputs it received
    working = gradient_bytes + input_bytes if looped else 0
    if mode == "kept":
        return ModeCost(forward_s, backward_s, weight_bytes, activation_bytes, working, step_bytes, received_bytes)
    if mode == "recomputed":
        return ModeCost(
            forward_s,
            backward_s + forward_s,
            weight_bytes,
            input_bytes,
            activation_bytes + working,
            step_bytes,
            received_bytes,
        )
    raise InputError(f"mode must be one of {MODES}. Received: {mode!r}.")


def forward_share(data: Mapping[str, object]) -> float:
    """The forward pass's share of a node's forward + backward work: the one split rule.

    ``forward_flops / flops`` when the node says, else 1 / (1 + BACKWARD_PER_FORWARD[trainable]):
    1/3 for a node with trainable weights, 1/2 without (frozen weights count as none).

    Example:
        >>> forward_share({"flops": 3.0, "param_bytes": 4}), forward_share({"flops": 2.0, "param_bytes": 0})
        (0.3333333333333333, 0.5)
    """
    flops = data.get("flops")
    forward = data.get("forward_flops")
    if isinstance(forward, (int, float)) and isinstance(flops, (int, float)) and flops > 0:
        return min(1.0, max(0.0, float(forward) / float(flops)))
    return 1 / (1 + BACKWARD_PER_FORWARD[trainable_param_bytes(data) > 0])


def training_flops(forward_flops: float, has_trainable_weights: bool) -> float:
    """Forward + backward FLOPs of a node from its forward FLOPs (what the profiler writes as ``flops``).

    Example:
        >>> training_flops(10.0, True), training_flops(10.0, False)
        (30.0, 20.0)
    """
    return forward_flops * (1 + BACKWARD_PER_FORWARD[bool(has_trainable_weights)])


@dataclass(frozen=True)
class Evaluation:
    """Every figure of one placement under the cost model, keyed by device name."""

    compute_times: dict[str, float]  # seconds of forward + backward per micro-batch, in the stage's mode
    receive_times: dict[str, float]  # seconds per micro-batch receiving activations and sending their gradients
    stage_times: dict[str, float]  # compute + receive
    memory_bytes: dict[str, int]  # weights, gradients, optimizer slots and in-flight activations
    in_flight: dict[str, int]  # micro-batches whose activations each device holds at most (0 when unused)
    bottleneck_s: float  # the slowest used stage
    step_time_s: float  # (M + K - 1) * bottleneck
    transfer_bytes: int  # bytes received by all stages per micro-batch
    stages: tuple[str, ...]  # used devices in pipeline order
    recompute: tuple[bool, ...] = ()  # per stage: recomputed (True) or kept
    stage_costs: tuple[ModeCost, ...] = ()  # per stage, in its mode
    sent_bytes: dict[tuple[int, int], int] | None = None  # (sending stage, receiving stage) -> bytes per micro-batch
    # per stage: one micro-batch's model outputs collected there (step_bytes holds M + 1 of them all step; the
    # simulator's peak_total_bytes adds each as its micro-batch's forward starts)
    model_output_bytes: tuple[int, ...] = ()
    # per stage: seconds per micro-batch of adding its weight gradients into the step's sums beside its next pass
    # (a pooled CPU device: CostModel.sums_s; 0 where the backward's time includes them)
    sums_s: tuple[float, ...] = ()


class CostModel:
    """Precomputes per-node costs of a layer graph on a cluster and scores placements.

    The keywords make a :class:`partitioner.Problem`, which checks them; ``CostModel.from_problem(problem)``
    takes one already made, and ``costs.problem`` is the problem priced.

    Args:
        graph: a layer graph (see partitioner.graph); its ``compute_dtype`` picks each device's speed
            (``Device.flops_per_s_for``).
        cluster: the devices, in pipeline order.
        num_microbatches: M, the number of micro-batches per step.
        optimizer_slots: optimizer state per trainable weight: 2 for Adam, 1 for momentum SGD, 0 for SGD.
        cost: "flops" (portable, the default) or "time" (measured ``time_s`` rescaled by speed).
        schedule: "gpipe" or "1f1b": how many micro-batches' activations a stage holds (in_flight).
        recompute: "never", "always" or "auto": which stages recompute their forward in the backward.
        num_replicas: D, the data-parallel copies of the pipeline: with D > 1 each stage holds a packed copy of
            its gradients for the all-reduce (``REDUCING_COPIES``).

    Raises:
        InputError: for a nonsensical number of micro-batches or slots, or an unknown cost source,
            schedule or recompute policy.
        ClusterError: when a device has no peak FLOP/s for the graph's compute dtype.
        GraphError: when the graph breaks the layer-graph contract.

    Example:
        >>> costs = CostModel(chain_graph([3e9, 3e9]), Cluster.uniform(2, memory="1GiB"), recompute="always")
        ...                                                                               # doctest: +SKIP
        >>> costs.evaluate({"layer_0": "/GPU:0", "layer_1": "/GPU:1"}).recompute         # doctest: +SKIP
        (True, False)
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
        recompute: str = "never",
        num_replicas: int = 1,
        reductions: Reductions | None = None,
    ) -> None:
        problem = Problem(
            graph,
            cluster,
            num_microbatches=num_microbatches,
            optimizer_slots=optimizer_slots,
            cost=cost,
            schedule=schedule,
            recompute=recompute,
            num_replicas=num_replicas,
            reductions=reductions,
        )
        self._price(problem)

    @classmethod
    def from_problem(cls, problem: Problem) -> CostModel:
        """The cost model of ``problem``, validated when it was built (``costs.problem`` is ``problem``).

        Example:
            >>> import partitioner as pt
            >>> problem = pt.Problem(pt.chain_graph([1e12] * 2), pt.Cluster.uniform(2, memory="1GiB"))
            >>> CostModel.from_problem(problem).problem is problem
            True
        """
        if not isinstance(problem, Problem):
            raise InputError(f"Expected a partitioner.Problem. Received: {type(problem).__name__}.")
        costs = cls.__new__(cls)
        costs._price(problem)
        return costs

    def _price(self, problem: Problem) -> None:
        """Precomputes every node's costs for ``problem`` (the constructor's work, once its arguments are checked)."""
        self.problem = problem  # what is planned: graph, cluster, M, slots, cost source, schedule, recompute
        graph, cluster, schedule = problem.graph, problem.cluster, problem.schedule
        num_microbatches, optimizer_slots = problem.num_microbatches, problem.optimizer_slots
        cost, recompute = problem.cost, problem.recompute
        self.graph = graph
        self.cluster = cluster
        self.num_microbatches = num_microbatches
        self.optimizer_slots = optimizer_slots
        self.cost = cost
        self.schedule = schedule
        self.recompute = recompute
        self.num_replicas = problem.num_replicas
        self.reductions = problem.reductions  # how each stage's R is priced in the step; None: not priced
        self.order = topological_order(graph)
        self.devices = cluster.names
        # FLOP/s of each device for the model's compute dtype: the one place device speed enters.
        self.compute_dtype: str | None = graph.graph.get("compute_dtype")
        self.flops_per_s = [d.flops_per_s_for(self.compute_dtype) for d in cluster.devices]
        # Fixed seconds per forward or backward of a stage on each device: what makes micro-batches not free.
        self.action_overhead_s = [d.action_overhead_s for d in cluster.devices]
        # [k]: the micro-batches budgeted on the device at position k of the cluster's order by the planners
        # that place a node before they know its stage: in_flight of stage k of a pipeline of every device,
        # M before the last device and 1 on it for GPipe, min(D - k, M) for 1F1B (D devices). It never
        # under-budgets: a plan of K stages that runs stage s on device k runs its K - s - 1 later stages on
        # distinct devices after k, of which there are D - k - 1, so K - s <= D - k and the stage holds
        # min(K - s, M) <= min(D - k, M) (GPipe: M before the last stage, which is the only one on the last
        # device), whichever devices the plan leaves idle. A stage with no stage after it holds
        # ``last_in_flight`` (1 under either schedule): CP-SAT budgets that where no unit follows the device.
        num_devices = len(self.devices)
        self.device_in_flight = [in_flight(schedule, num_devices, num_microbatches, k) for k in range(num_devices)]
        self.last_in_flight = in_flight(schedule, 1, num_microbatches, 0)
        self.max_in_flight = max(self.device_in_flight)  # the fullest stage's: the first device's
        # M > 1: the runtime runs the micro-batches in a loop whose stage calls it does not inline (mode_cost)
        self.looped = num_microbatches > 1
        layers_s = {v: self._compute_row(v) for v in self.order}  # [node][device index]
        # with M > 1 every backward adds its weight gradients into the stage's sums (measured, cost="time"): on a
        # device of its own in the backward's time; on a pooled CPU device (Cluster.pooled_cpus) the sums run
        # beside the stage's next pass, a job of the pool of their own (``sums_s``, which the simulator runs)
        summing_s = {v: self._accumulate_row(v) for v in self.order}
        beside = set(cluster.pooled_cpus())
        in_backward = {v: [0.0 if k in beside else a for k, a in enumerate(summing_s[v])] for v in self.order}
        self.sums_s = {v: [a if k in beside else 0.0 for k, a in enumerate(summing_s[v])] for v in self.order}
        shares = {v: forward_share(graph.nodes[v]) for v in self.order}
        self.forward_s = {v: [t * shares[v] for t in layers_s[v]] for v in self.order}
        self.backward_s = {
            v: [t * (1 - shares[v]) + a for t, a in zip(layers_s[v], in_backward[v], strict=True)] for v in self.order
        }
        self.compute_s = {  # [node][device index], kept mode: forward + backward
            v: [t + a for t, a in zip(layers_s[v], in_backward[v], strict=True)] for v in self.order
        }
        self.activation_bytes = {v: int(graph.nodes[v]["activation_bytes"]) for v in self.order}
        self.gradient_bytes = {v: gradient_bytes(graph.nodes[v]) for v in self.order}  # a backward's working set
        self.gradient_copies = gradient_copies(num_microbatches, problem.num_replicas)
        self._weights = {
            v: int(graph.nodes[v]["param_bytes"])
            + trainable_param_bytes(graph.nodes[v]) * (self.gradient_copies + optimizer_slots)
            for v in self.order
        }
        # what the runtime holds all step beside the layers, per node (0 where a profile predates the attributes)
        self._output = {v: int(graph.nodes[v].get("model_output_bytes") or 0) for v in self.order}  # one micro-batch's
        self._collected = {v: (num_microbatches + 1) * self._output[v] for v in self.order}
        self._step = {
            v: num_microbatches * int(graph.nodes[v].get("model_input_bytes") or 0) + self._collected[v]
            for v in self.order
        }
        self.out_bytes = {
            u: max((int(b) for _, _, b in graph.out_edges(u, data="bytes")), default=0) for u in self.order
        }
        # The modes a stage may take under ``recompute``, and each node's seconds per device in them for the
        # planners (bytes: node_memory_bytes and input_memory_bytes, for a stage's micro-batches in flight).
        self.modes = ("kept",) if recompute == "never" else MODES
        self.mode_compute_s: dict[str, dict[str, list[float]]] = {}
        self._node_memory: dict[tuple[str, int], dict[str, int]] = {}
        self._input_memory: dict[tuple[str, int, int], dict[str, int]] = {}
        for mode in self.modes:
            self.mode_compute_s[mode] = (
                self.compute_s  # forward + backward, as measured
                if mode == "kept"
                else {
                    v: [f + b for f, b in zip(self.forward_s[v], self._mode_backward(v, mode), strict=True)]
                    for v in self.order
                }
            )
        # bytes per node with its activations kept, on the fullest stage (a node's share of the memory for coarsening)
        self.memory = self.node_memory_bytes("kept", self.max_in_flight)
        self._step_bound: float | None = None  # step_lower_bound_s, once computed

    def _compute_row(self, node: str) -> list[float]:
        data = self.graph.nodes[node]
        if self.cost == "time":
            time_s = data.get("time_s")
            if time_s is None:
                raise InputError(
                    f"cost='time' needs a measured time_s on every node; node '{node}' has none. "
                    "Profile with measure_time=True, or use cost='flops'."
                )
            return self._measured_row(float(time_s))
        return [float(data["flops"]) / speed for speed in self.flops_per_s]

    def _measured_row(self, seconds: float) -> list[float]:
        """[device index]: ``seconds`` measured on the profiled device, rescaled by each device's speed."""
        reference = self.graph.graph.get("profiled_flops_per_s") or max(self.flops_per_s)
        return [seconds * reference / speed for speed in self.flops_per_s]

    def _accumulate_row(self, node: str) -> list[float]:
        """[device index]: seconds a backward of ``node`` spends adding its weight gradients into the step's
        sums, which the runtime does for every micro-batch when M > 1: the profile's measured
        ``accumulate_time_s`` rescaled by speed as ``time_s`` is; 0 at M = 1, with cost="flops" or unmeasured."""
        measured = self.graph.nodes[node].get("accumulate_time_s")
        if not self.looped or self.cost != "time" or not measured:
            return [0.0] * len(self.flops_per_s)
        return self._measured_row(float(measured))

    def _mode_backward(self, node: str, mode: str) -> list[float]:
        return [
            mode_cost(mode, forward_s=f, backward_s=b).backward_s
            for f, b in zip(self.forward_s[node], self.backward_s[node], strict=True)
        ]

    def node_cost(self, node: str, mode: str, device: int = 0) -> ModeCost:
        """``node``'s costs in ``mode`` on the device of index ``device`` (as one node of a stage)."""
        return mode_cost(
            mode,
            forward_s=self.forward_s[node][device],
            backward_s=self.backward_s[node][device],
            weight_bytes=self.weight_bytes(node),
            activation_bytes=self.activation_bytes[node],
            step_bytes=self._step[node],
            gradient_bytes=self.gradient_bytes[node],
            looped=self.looped,
        )

    def node_memory_bytes(self, mode: str, num_in_flight: int) -> dict[str, int]:
        """{node: bytes} in ``mode`` on a stage that holds ``num_in_flight`` micro-batches: each node's
        ``node_cost(v, mode).memory_bytes(num_in_flight)``, whose sum over a stage's nodes is the stage's
        figure without its received tensors (:meth:`input_memory_bytes`).

        Example:
            >>> import partitioner as pt
            >>> graph = pt.chain_graph([1e9, 1e9], param_bytes=[100, 100], activation_bytes=[10, 10])
            >>> costs = pt.CostModel(graph, pt.Cluster.uniform(2, memory="1GiB"), optimizer_slots=0)
            >>> costs.node_memory_bytes("kept", 2)["layer_0"]  # weights and their gradients + 2 x activations
            220
        """
        key = (mode, num_in_flight)
        if key not in self._node_memory:
            self._node_memory[key] = {v: self.node_cost(v, mode).memory_bytes(num_in_flight) for v in self.order}
        return self._node_memory[key]

    def input_memory_bytes(self, mode: str, num_in_flight: int, sender_in_flight: int | None = None) -> dict[str, int]:
        """{node: bytes} that a stage in ``mode`` holding ``num_in_flight`` micro-batches needs for receiving
        the node's output from a stage holding ``sender_in_flight``: a copy of it for each of the sender's
        micro-batches (the receiver's forwards keep those in flight, the rest wait for them; a recomputed
        stage's saved inputs among them), and with M > 1 its gradient, which the receiver's backward makes
        (mode_cost). The sender's count defaults to the most any stage holds (``max_in_flight``: M for GPipe,
        min(D, M) for 1F1B), a bound wherever the sender is; the chain DP gives the stage right before's
        (``ScheduleFamily.window_before``).

        Example:
            >>> from partitioner.graph import chain_graph
            >>> graph, cluster = chain_graph([1e9] * 2, edge_bytes=[100]), Cluster.uniform(2, memory="1GiB")
            >>> costs = CostModel(graph, cluster, num_microbatches=4)
            >>> costs.input_memory_bytes("kept", 1)["layer_0"]  # GPipe's last stage: 4 copies, 1 gradient
            500
        """
        sender = self.max_in_flight if sender_in_flight is None else sender_in_flight
        key = (mode, num_in_flight, sender)
        if key not in self._input_memory:
            copies = received_copies(mode, sender, num_in_flight)
            self._input_memory[key] = {
                u: mode_cost(
                    mode, input_bytes=self.out_bytes[u], looped=self.looped, received_bytes=copies * self.out_bytes[u]
                ).memory_bytes(num_in_flight)
                for u in self.order
            }
        return self._input_memory[key]

    def weight_bytes(self, node: str) -> int:
        """Bytes of ``node``'s weights, and the gradients and optimizer slots of its trainable ones:
        param_bytes + trainable_param_bytes * (gradient_copies + optimizer_slots), with gradient_copies
        (:func:`gradient_copies`) 1 at M = 1 on one replica, 2 at M > 1 (the sums and the micro-batch's
        gradients being added to them) or with D > 1 replicas (the sums and the packed copy their all-reduce
        takes)."""
        return self._weights[node]

    def step_bytes(self, node: str) -> int:
        """Bytes the runtime holds for ``node`` all step long beside the layers, whatever the micro-batches
        in flight (docs/cost-model.md, "What the step holds beside the layers"): M x its
        ``model_input_bytes`` (the batch split into M micro-batches where the plan puts its InputLayer) and
        M x its ``model_output_bytes`` (every micro-batch's outputs collected for the loss and the metrics),
        and one micro-batch's more: what the loss's gradient and the metrics make of one micro-batch's
        outputs, in the loop and after it (``runtime.metrics`` updates Keras' metrics micro-batch by
        micro-batch; an accuracy over logits makes a tensor of their size).

        Example:
            >>> import partitioner as pt
            >>> graph = pt.chain_graph([1e9, 1e9])
            >>> graph.nodes["layer_0"]["model_input_bytes"] = 40
            >>> graph.nodes["layer_1"]["model_output_bytes"] = 8
            >>> costs = pt.CostModel(graph, pt.Cluster.uniform(2, memory="1GiB"), num_microbatches=4)
            >>> costs.step_bytes("layer_0"), costs.step_bytes("layer_1")  # 4 x 40; 4 x 8 collected, 8 for one's work
            (160, 40)
        """
        return self._step[node]

    def receive_s(self, node: str, sender: int, receiver: int) -> float:
        """Seconds per micro-batch that ``node``'s output costs the link between ``sender`` and ``receiver``.

        The activation goes forward (sender to receiver) and its gradient comes back (receiver to sender);
        GPipe runs every forward before any backward, so the two transfers do not overlap and both count.
        """
        if sender == receiver:
            return 0.0
        size = self.out_bytes[node]
        return size / self.cluster.bandwidth(sender, receiver) + size / self.cluster.bandwidth(receiver, sender)

    def reduce_times(self, assignment: Mapping[str, str]) -> dict[str, float]:
        """Seconds of each used device's ``R`` under ``assignment`` ({node: device}): the stage's weight gradients
        all-reduced with the other replicas as ``reductions`` prices it; empty where it prices none."""
        return {} if self.reductions is None else reduce_times(self.reductions, self.graph, assignment)

    def on(self, cluster: Cluster) -> CostModel:
        """The same graph and settings (M, optimizer slots, cost source, schedule, recompute) on
        ``cluster``: the devices in another order, or a prefix of them."""
        return self._with(self.graph, cluster, self.recompute)

    def of(self, graph: nx.DiGraph) -> CostModel:
        """The same cluster and settings for another graph, such as the chain of a coarsening's units."""
        return self._with(graph, self.cluster, self.recompute)

    def with_recompute(self, recompute: str) -> CostModel:
        """The same graph, cluster and settings under another recompute policy."""
        return self._with(self.graph, self.cluster, recompute)

    def _with(self, graph: nx.DiGraph, cluster: Cluster, recompute: str) -> CostModel:
        problem = dataclasses.replace(self.problem, graph=graph, cluster=cluster, recompute=recompute)
        return CostModel.from_problem(problem)

    def serial_step_s(self) -> float:
        """Seconds for one step of M micro-batches on the fastest device alone, ignoring its memory, its gradient
        sums in turn with its passes (on a pooled CPU device they run beside them: there at least the step)."""
        fastest = max(range(len(self.devices)), key=self.flops_per_s.__getitem__)
        one = mode_cost(
            "kept",
            forward_s=sum(self.forward_s[v][fastest] for v in self.order) + self.action_overhead_s[fastest],
            backward_s=sum(self.backward_s[v][fastest] + self.sums_s[v][fastest] for v in self.order)
            + self.action_overhead_s[fastest],
        )
        return self.num_microbatches * one.compute_s

    def lower_bound_s(self) -> float:
        """A bottleneck no placement can beat: the work spread perfectly, or the costliest node (kept),
        plus the least fixed cost of a stage's forward and backward (2 x action_overhead_s)."""
        speed = self.flops_per_s
        fastest = max(range(len(speed)), key=speed.__getitem__)
        total = sum(self.compute_s[v][fastest] for v in self.order) * speed[fastest] / sum(speed)
        single = max(min(row) for row in self.compute_s.values())
        return max(total, single) + 2 * min(self.action_overhead_s)

    def step_lower_bound_s(self) -> float:
        """A step no legal plan can beat on this graph, cluster, M and schedule: whatever its stages,
        devices, device order and recomputation. The largest of :meth:`step_bound_terms`, whose
        proofs docs/cost-model.md ("A lower bound on the step") writes out; cached (a CostModel does not change).

        Example:
            >>> import partitioner as pt
            >>> cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12)
            >>> costs = CostModel(pt.chain_graph([1e12] * 4), cluster, num_microbatches=4)
            >>> round(costs.step_lower_bound_s(), 4)  # the best plan: two stages of 2 s, (4 + 2 - 1) x 2 s = 10 s
            9.1429
        """
        if self._step_bound is None:
            self._step_bound = max(self.step_bound_terms().values())
        return self._step_bound

    def step_bound_terms(self) -> dict[str, float]:
        """Each proven lower bound on the step of every legal plan, by name (docs/cost-model.md has the proofs).

        With W a node's kept forward + backward work in FLOPs (its seconds times the device's FLOP/s: the
        same on every device), S the devices' FLOP/s together, s the fastest one's, o the least
        ``action_overhead_s``, and P the path of the most work from a first node to a last one:

        - ``"spread"``: M x (W / S + 2 o). Every stage runs M forwards and M backwards on its own device,
          each paying o or more: the busiest device computes at least the weighted mean.
        - ``"node"``: M x the least over devices of a node's forward + backward + 2 o there: its stage
          runs it M times. Per node, also what its stage does beyond the pipeline's path through it
          (:func:`pipeline_path_bound` with that path, its stage holding at least the node).
        - ``"path"``: :func:`path_step_bound` on P, whatever the schedule.
        - ``"pipeline"``: :func:`pipeline_path_bound` on P, for this schedule.

        Recomputing a stage only adds work (a second forward and its overhead), so the kept figures
        bound recomputed stages too; a transfer counts only where P crosses between stages.

        Example:
            >>> import partitioner as pt
            >>> costs = CostModel(pt.chain_graph([1e12] * 4), pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12))
            >>> costs.step_bound_terms()  # M = 1: the chain on one device
            {'spread': 2.0, 'node': 4.0, 'path': 4.0, 'pipeline': 4.0}
        """
        m = self.num_microbatches
        speed = self.flops_per_s
        fastest = max(range(len(speed)), key=speed.__getitem__)
        top = speed[fastest]
        overhead = min(self.action_overhead_s)
        work = {v: self.compute_s[v][fastest] * top for v in self.order}  # FLOPs: seconds x FLOP/s
        # the most forward work a stage can have per unit of its work: its nodes' largest forward share
        share = max(
            (self.forward_s[v][fastest] / self.compute_s[v][fastest] for v in self.order if self.compute_s[v][fastest]),
            default=0.0,
        )
        early = [early_forwards(self.schedule, len(self.devices), m, t) for t in range(1, len(self.devices) + 1)]
        links = [self.cluster.bandwidth(a, b) for a in range(len(speed)) for b in range(len(speed)) if a != b]
        fastest_link = max(links, default=math.inf)
        # the heaviest path ending at (into) and starting from (out of) each node
        into: dict[str, float] = {}
        parent: dict[str, str | None] = {}
        for v in self.order:
            u = max(self.graph.predecessors(v), key=into.__getitem__, default=None)
            into[v] = work[v] + (into[u] if u is not None else 0.0)
            parent[v] = u
        out_of: dict[str, float] = {}
        for v in reversed(self.order):
            out_of[v] = work[v] + max((out_of[x] for x in self.graph.successors(v)), default=0.0)
        # the costliest node on its best device, with that device's fixed costs: [node, device] -> min -> max
        passes = np.array([self.compute_s[v] for v in self.order]) + 2 * np.array(self.action_overhead_s)
        node = m * float(passes.min(axis=1).max())
        for v in self.order:
            through = into[v] + out_of[v] - work[v]
            node = max(
                node,
                through / top + (m - 1 - early[0] * share) * work[v] / top + (2 * m - early[0]) * overhead,
            )
        last = max(self.order, key=into.__getitem__)
        path = [last]
        while (u := parent[path[-1]]) is not None:
            path.append(u)
        path.reverse()
        hops = sorted(2 * self.out_bytes[u] / fastest_link for u in path[:-1])  # a cut's activation and gradient
        speeds = sorted(speed, reverse=True)[: len(path)]
        return {
            "spread": m * (sum(work.values()) / sum(speed) + 2 * overhead),
            "node": node,
            "path": path_step_bound(into[last], speeds, num_microbatches=m, fixed_s=2 * overhead, hops_s=hops),
            "pipeline": pipeline_path_bound(
                [work[v] for v in path],
                speed,
                num_microbatches=m,
                total_work=sum(work.values()),
                early_forwards=early,
                forward_share=share,
                overhead_s=overhead,
                hops_s=hops,
            ),
        }

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

    def evaluate(self, assignment: Mapping[str, str], recompute: str | Sequence[bool] | None = None) -> Evaluation:
        """Scores a placement {node: device name} with the formulas in the module docstring.

        Args:
            assignment: {node: device name}.
            recompute: the stages' modes: a policy ("never", "always", "auto") or one bool per stage
                (True: recomputed); the cost model's own policy when None.

        Raises:
            PlanError: when the placement does not match the graph or cluster, or ``recompute`` is a
                sequence of the wrong length or recomputes the last stage.
        """
        where = self.check_assignment(assignment)
        k_total = len(self.devices)
        forward = [0.0] * k_total
        backward = [0.0] * k_total
        sums = [0.0] * k_total
        receive = [0.0] * k_total
        weights = [0] * k_total
        activations = [0] * k_total
        gradients = [0] * k_total
        inputs = [0] * k_total
        steps = [0] * k_total
        sent: dict[tuple[int, int], int] = {}
        received: list[tuple[int, int, int]] = []  # (sender device, receiver device, bytes per micro-batch)
        successors = self.graph.succ
        for v in self.order:
            k = where[v]
            forward[k] += self.forward_s[v][k]
            backward[k] += self.backward_s[v][k]
            sums[k] += self.sums_s[v][k]
            weights[k] += self._weights[v]
            activations[k] += self.activation_bytes[v]
            gradients[k] += self.gradient_bytes[v]
            steps[k] += self._step[v]
            receivers = {where[s] for s in successors[v]}
            receivers.discard(k)
            for receiver in sorted(receivers):
                receive[receiver] += self.receive_s(v, k, receiver)
                inputs[receiver] += self.out_bytes[v]
                sent[(k, receiver)] = sent.get((k, receiver), 0) + self.out_bytes[v]
                received.append((k, receiver, self.out_bytes[v]))
        used = sorted(set(where.values()))
        num_stages = len(used)
        position = {k: s for s, k in enumerate(used)}
        # the runtime collects every model output on the last stage, where the loss is: one produced on an
        # earlier stage is charged there too (its node's charge, which the planners see, stays on its stage)
        elsewhere = sum(self._output[v] for v in self.order if where[v] != used[-1])  # one micro-batch's
        steps[used[-1]] += (self.num_microbatches + 1) * elsewhere  # as _collected counts them
        outputs = [0] * k_total  # per device, as steps: an output made before the last stage counts on both
        for v in self.order:
            outputs[where[v]] += self._output[v]
        outputs[used[-1]] += elsewhere
        held = [0] * k_total
        for s, k in enumerate(used):
            held[k] = in_flight(self.schedule, num_stages, self.num_microbatches, s)
        # the copies of received tensors each device holds beside its held bytes, per mode (received_copies)
        copies = {mode: [0] * k_total for mode in MODES}
        for sender, receiver, size in received:
            for mode in MODES:
                copies[mode][receiver] += received_copies(mode, held[sender], held[receiver]) * size

        def cost_of(k: int, mode: str) -> ModeCost:
            # Each pass a stage runs per micro-batch (forward, backward) pays the device's fixed overhead once;
            # a recomputed stage's backward runs the forward again, overhead included (mode_cost adds it).
            return mode_cost(
                mode,
                forward_s=forward[k] + self.action_overhead_s[k],
                backward_s=backward[k] + self.action_overhead_s[k],
                weight_bytes=weights[k],
                activation_bytes=activations[k],
                input_bytes=inputs[k],
                step_bytes=steps[k],
                gradient_bytes=gradients[k],
                looped=self.looped,
                received_bytes=copies[mode][k],
            )

        recomputed = self._stage_modes(
            recompute, [(cost_of(k, "kept"), cost_of(k, "recomputed"), k) for k in used], held
        )
        stage_costs = tuple(cost_of(k, MODES[r]) for k, r in zip(used, recomputed, strict=True))
        compute = [0.0] * k_total
        memory = list(weights)  # an unused device holds nothing but what it is given (nothing)
        for k, c in zip(used, stage_costs, strict=True):
            compute[k] = c.compute_s
            memory[k] = c.memory_bytes(held[k])
        stage = [compute[k] + receive[k] for k in range(k_total)]
        bottleneck = max(stage[k] for k in used)
        return Evaluation(
            compute_times=dict(zip(self.devices, compute, strict=False)),
            receive_times=dict(zip(self.devices, receive, strict=False)),
            stage_times=dict(zip(self.devices, stage, strict=False)),
            memory_bytes=dict(zip(self.devices, memory, strict=False)),
            in_flight=dict(zip(self.devices, held, strict=False)),
            bottleneck_s=bottleneck,
            step_time_s=(self.num_microbatches + num_stages - 1) * bottleneck,
            transfer_bytes=sum(inputs),
            stages=tuple(self.devices[k] for k in used),
            recompute=recomputed,
            stage_costs=stage_costs,
            sent_bytes={(position[a], position[b]): n for (a, b), n in sorted(sent.items())},
            model_output_bytes=tuple(outputs[k] for k in used),
            sums_s=tuple(sums[k] for k in used),
        )

    def _stage_modes(
        self,
        recompute: str | Sequence[bool] | None,
        stages: Sequence[tuple[ModeCost, ModeCost, int]],
        held: Sequence[int],
    ) -> tuple[bool, ...]:
        """One bool per stage (True: recomputed) from a policy or a given sequence; never the last stage."""
        if recompute is None:
            recompute = self.recompute
        last = len(stages) - 1
        if isinstance(recompute, str):
            check_recompute(recompute)
            if recompute == "never":
                return (False,) * len(stages)
            if recompute == "always":
                return tuple(s < last for s in range(len(stages)))
            auto = []
            for s, (kept, recomputed, k) in enumerate(stages):
                need = kept.memory_bytes(held[k])
                auto.append(
                    s < last and need > self.cluster.devices[k].memory_bytes and recomputed.memory_bytes(held[k]) < need
                )
            return tuple(auto)
        chosen = tuple(bool(r) for r in recompute)
        if len(chosen) != len(stages):
            raise PlanError(
                f"recompute has {len(chosen)} entries but the placement has {len(stages)} stages; give one "
                "bool per stage (True: recomputed), or a policy: 'never', 'always' or 'auto'."
            )
        if chosen and chosen[-1]:
            raise PlanError(
                "recompute marks the last stage as recomputed; the last stage is never recomputed (its backward "
                "follows its forward at once, so its activations are kept). Set its entry to False."
            )
        return chosen

    def fits(self, evaluation: Evaluation) -> bool:
        """True iff every device's memory holds what the placement puts on it."""
        return all(evaluation.memory_bytes[d.name] <= d.memory_bytes for d in self.cluster.devices)


def received_copies(mode: str, sender_in_flight: int, in_flight: int) -> int:
    """Copies of a received tensor a stage holds beside its held bytes: one for each micro-batch its sender
    holds (those the stage's forwards keep for its backward, and those the sender ran ahead, waiting for its
    forwards); in recomputed mode less its own micro-batches', whose saved inputs its held bytes count.

    Example:
        >>> received_copies("kept", 8, 1), received_copies("recomputed", 8, 8), received_copies("recomputed", 3, 2)
        (8, 0, 1)
    """
    return sender_in_flight if mode == "kept" else max(0, sender_in_flight - in_flight)


def in_flight(schedule: str, num_stages: int, num_microbatches: int, stage: int) -> int:
    """Micro-batches whose activations ``stage`` holds at most under ``schedule``: M for GPipe (1 on its last
    stage), min(K - s, M) for 1F1B.

    The one place the planners, the cost model and the validator take this figure from; it is the
    schedule's own count (``ScheduleFamily.in_flight``, ``Schedule.max_in_flight``), not a second formula.

    Example:
        >>> [in_flight("1f1b", 4, 8, s) for s in range(4)], in_flight("gpipe", 4, 8, 0)
        ([4, 3, 2, 1], 8)
    """
    return schedule_family(schedule).in_flight(num_stages, num_microbatches, stage)


def early_forwards(schedule: str, num_devices: int, num_microbatches: int, position: int = 1) -> int:
    """The most forwards a stage runs, beyond micro-batch 0's, before its first backward can start under
    ``schedule``, for a stage at ``position`` (1 or more) of a chain of stages on at most ``num_devices``
    devices: for GPipe M - 1 where a stage may follow (all M forwards, then the backwards), 0 on the last
    of num_devices (each backward right after its forward); for 1F1B min(num_devices - position, M - 1)
    (the warm-up of a stage with at most that many stages after it). The schedule's own figure
    (``ScheduleFamily.early_forwards``).

    Example:
        >>> early_forwards("gpipe", 8, 8), early_forwards("1f1b", 8, 8), early_forwards("1f1b", 8, 3)
        (7, 7, 2)
        >>> early_forwards("1f1b", 8, 8, position=8)  # the last of 8: no warm-up
        0
    """
    return schedule_family(schedule).early_forwards(num_devices, num_microbatches, position)


def path_step_bound(
    work: float,
    speeds: Sequence[float],
    *,
    num_microbatches: int,
    fixed_s: float = 0.0,
    hops_s: Sequence[float] = (),
) -> float:
    """The least step of any plan, under any schedule, for a path of ``work`` FLOPs (one micro-batch's
    forward and backward): a lower bound, proven in docs/cost-model.md ("A lower bound on the step").

    The stages holding the path's nodes are positions t = 1..j in pipeline order, on distinct devices,
    with compute c_t per micro-batch. Stage t's first forward waits for micro-batch 0's forwards at
    positions 1..t-1, it runs M forwards and M backwards, and its last backward's gradient still goes
    back through positions t-1..1; each cut of the path between two stages takes a hop there and back::

        step >= (M - 1) c_t + c_1 + ... + c_t + (the t - 1 cheapest hops)    for every t
        c_t  >= (the path's work on t) / (t's FLOP/s) + fixed_s

    For each j, the most work a step T holds on positions 1..j is linear in T (every inequality tight,
    the fastest devices first: c*_1 = T / M - fixed_s, then about (M - 1) / M of the one before), so
    the least T that holds ``work`` has a closed form; the bound is the least over j.

    Args:
        work: FLOPs of one micro-batch's forward and backward over the path's nodes.
        speeds: FLOP/s of the devices the path's stages may use, at most one per node of the path.
        num_microbatches: M.
        fixed_s: the least fixed seconds of a stage's forward and backward together (2 x action_overhead_s).
        hops_s: the seconds an activation and its gradient take at least across each edge of the path.

    Example:
        >>> path_step_bound(8.0, [1.0, 1.0], num_microbatches=1)  # one micro-batch: the path on one device
        8.0
        >>> round(path_step_bound(8.0, [1.0, 1.0], num_microbatches=4), 4)  # two stages of 4: (4 + 1) x 4 = 20
        18.2857
    """
    m = num_microbatches
    shrink = (m - 1) / m  # each position's tight compute is (M - 1) / M times the one before, fixed costs aside
    cheapest = [0.0, *itertools.accumulate(sorted(hops_s))]  # [k]: the k cheapest hops together
    best = math.inf
    slope = offset = 0.0  # work held by positions 1..j: slope * T - offset
    reach = lost = 0.0  # compute of positions 1..t together, tight: reach * T - lost
    for t, speed in enumerate(sorted(speeds, reverse=True), start=1):
        # position t's inequality, tight: M c_t = T - fixed_s (M - 1 + t) - cheapest[t - 1] - (c_1 + ... + c_(t-1))
        hops = cheapest[min(t - 1, len(cheapest) - 1)]
        reach_t = 1 / m + shrink * reach
        lost_t = (fixed_s * (m - 1 + t) + hops) / m + shrink * lost
        slope += speed * (reach_t - reach)
        offset += speed * (lost_t - lost)
        reach, lost = reach_t, lost_t
        best = min(best, (work + offset) / slope)
    return best


def pipeline_path_bound(
    works: Sequence[float],
    speeds: Sequence[float],
    *,
    num_microbatches: int,
    total_work: float | None = None,
    early_forwards: Sequence[int] = (),
    forward_share: float = 1.0,
    overhead_s: float = 0.0,
    hops_s: Sequence[float] = (),
) -> float:
    """The least step of any plan, under a schedule whose stage at position t of a chain runs at most
    ``early_forwards[t - 1]`` forwards beyond micro-batch 0's before its first backward
    (:func:`early_forwards`), for a graph of ``total_work`` FLOPs with a path of nodes of ``works`` FLOPs
    each, in path order, on devices of ``speeds`` FLOP/s: a lower bound, proven in docs/cost-model.md
    ("A lower bound on the step").

    With the path's stages at positions 1..j (x_t: t's work over its device's FLOP/s; f_t, b_t: t's
    forward and backward seconds per micro-batch, each with its overhead), stage t runs its first
    forwards, then waits for a micro-batch's forward and backward through the later positions, then
    runs the rest of its passes; with the earlier positions' forward before it and backward after it::

        step >= sum over t' != t of (f + b)_t'  +  (M - w_t) f_t + M b_t  +  the path's hops
             >= sum_t x_t + (j - 1) 2 o + hops + max_t (a_t x_t + b_t)
        a_t = M - 1 - w_t share,  b_t = (2 M - w_t) o

    (share = ``forward_share``, the most forward work per unit of a stage's work; o = ``overhead_s``).
    For GPipe (w = 0) and equal stages this is (M + j - 1) (x + 2 o), the step. The path's stages hold
    the path's work, and whatever of the rest the other devices cannot: each other stage runs M times
    its work, so it holds at most (step / M - 2 o) x its FLOP/s. So sum_t x_t is at least that work on
    the fastest device; the hops at least the j - 1 cheapest; and max_t (a_t x_t + b_t) at least the Z
    at which x_t = (Z - b_t) / a_t on the j fastest devices (fastest first: a_t and b_t grow with t) hold
    that work, and at least a_1 x + b_1 for the least largest piece of any cut of the path into j runs
    (on the fastest device). For each j the least step that meets this is found by bisection (the right
    side falls as the step grows); the bound is the least over j.

    Args:
        works: FLOPs of each node of the path (forward and backward of one micro-batch), in path order.
        speeds: FLOP/s of every device.
        num_microbatches: M.
        total_work: FLOPs of the whole graph (forward and backward of one micro-batch); the path's when None.
        early_forwards: w_t for positions t = 1, 2, ... (non-increasing); none (GPipe) when empty.
        forward_share: the largest share of a stage's work its forward can be (the nodes' largest).
        overhead_s: the least action_overhead_s of a device (paid per forward and per backward).
        hops_s: the seconds an activation and its gradient take at least across each edge of the path.

    Example:
        >>> pipeline_path_bound([4.0, 4.0], [1.0, 1.0], num_microbatches=4)  # two stages of 4: (4 + 1) x 4
        20.0
        >>> round(pipeline_path_bound([4.0, 4.0], [1.0, 1.0], num_microbatches=4, total_work=12.0), 6)  # 4 off the path
        30.0
    """
    m = num_microbatches
    path_work = float(sum(works))
    graph_work = max(path_work, float(total_work) if total_work is not None else path_work)
    ranked = sorted(speeds, reverse=True)
    fastest = ranked[0]
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(works, dtype=float))))
    cheapest = [0.0, *itertools.accumulate(sorted(hops_s))]
    num_positions = min(len(ranked), len(works))
    early = [early_forwards[t] if t < len(early_forwards) else 0 for t in range(num_positions)]
    weight = [m - 1 - w * forward_share for w in early]  # a_t: the weight of position t's work
    fixed = [(2 * m - w) * overhead_s for w in early]  # b_t: its fixed costs
    best = math.inf
    for j in range(1, num_positions + 1):
        others = sum(ranked[: len(ranked) - j])  # the most FLOP/s the devices off the path can have
        piece = weight[0] * _least_largest_piece(prefix, j) / fastest + fixed[0]
        floor = max(fixed[:j])  # every position's b_t, at x_t = 0
        # at Z >= floor, positions 1..j hold sum_t speed_(t) (Z - b_t) / a_t: per: sum speed / a, less: sum speed b / a
        if min(weight[:j]) > 0:
            per = sum(ranked[t] / weight[t] for t in range(j))
            less = sum(ranked[t] * fixed[t] / weight[t] for t in range(j))
        else:
            per, less = math.inf, 0.0  # a position of weight 0 holds any work at Z = its b_t
        constant = (j - 1) * 2 * overhead_s + cheapest[min(j - 1, len(cheapest) - 1)]

        def right(
            step: float,
            others: float = others,
            piece: float = piece,
            floor: float = floor,
            per: float = per,
            less: float = less,
            constant: float = constant,
        ) -> float:
            """What a step must be at least, if it is ``step``: the path's stages hold what the others cannot."""
            spare = max(0.0, step / m - 2 * overhead_s) * others if others else 0.0  # (inf x 0 is nan)
            held = max(path_work, graph_work - spare)
            busiest = max(floor, piece, (held + less) / per if math.isfinite(per) else floor)
            return held / fastest + busiest + constant

        best = min(best, _least_fixed_point(right))
    return best


def _least_fixed_point(right: Callable[[float], float]) -> float:
    """A lower bound on the least T with T >= right(T), for a ``right`` that does not grow with T: bisected
    between right(inf) and right(right(inf)) to 1e-12, rounded down to a T that fails (or is the answer)."""
    lo = right(math.inf)
    hi = right(lo)
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if mid >= right(mid):
            hi = mid
        else:
            lo = mid
    return lo


def _least_largest_piece(prefix: np.ndarray, pieces: int) -> float:
    """A lower bound on the largest piece's work when a path whose prefix sums of work are ``prefix`` is
    cut into at most ``pieces`` runs: a capacity that the greedy cut (optimal for this question) fails,
    bisected to 1e-9 of the least largest piece and rounded down."""
    total = float(prefix[-1])
    lo = max(total / pieces, float(np.max(np.diff(prefix), initial=0.0))) * (1 - 1e-12)
    hi = total  # one run holds the whole path
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        if _cuts_needed(prefix, mid) <= pieces:
            hi = mid
        else:
            lo = mid
    return lo * (1 - 1e-9)


def _cuts_needed(prefix: np.ndarray, capacity: float) -> int:
    """How many runs a greedy cut of the path makes with at most ``capacity`` work in each (a piece is
    never emptier than the greedy's, so no cut makes fewer)."""
    n = len(prefix) - 1
    at, runs = 0, 0
    while at < n:
        end = int(np.searchsorted(prefix, prefix[at] + capacity, side="right")) - 1
        if end <= at:
            return n + 1  # one node alone exceeds the capacity
        at, runs = end, runs + 1
    return runs


def allreduce_s(num_bytes: float, cluster: Cluster, group: Sequence[str]) -> float:
    """Seconds of the ``R`` action: a ring all-reduce (SUM) of ``num_bytes`` over the devices of ``group``
    (the same stage of every replica), 0 for a group of one.

    Each of the D devices sends 2 (D - 1) / D x ``num_bytes`` to the next one of the ring (``group``'s
    order, the last to the first: a reduce-scatter and an all-gather), all at once, so the ring's slowest
    link sets the time; plus the slowest device's fixed cost of one action (``action_overhead_s``). The
    all-reduce of NCCL and of TensorFlow's collectives on GPUs is a ring; the latency per hop (microseconds)
    is left out.

    Example:
        >>> cluster = Cluster.uniform(4, memory="16GiB", bandwidth=1e9)
        >>> allreduce_s(3e9, cluster, cluster.names[:2])  # 2 x 1/2 x 3 GB at 1 GB/s
        3.0
        >>> allreduce_s(3e9, cluster, cluster.names[:1])
        0.0
    """
    if len(group) < 2 or num_bytes <= 0:
        return 0.0
    return reduce_s(Reductions.over_groups(cluster, [[name] for name in group]), group[0], num_bytes)


def ring_allreduce_s(
    num_bytes: float, num_members: int, bandwidth_bytes_per_s: float, *, overhead_s: float = 0.0
) -> float:
    """Seconds of a ring all-reduce (SUM) of ``num_bytes`` over ``num_members`` whose slowest link carries
    ``bandwidth_bytes_per_s``: each member sends 2 (D - 1) / D x ``num_bytes`` to the next, all at once, plus
    ``overhead_s`` (one action's fixed cost); 0 for one member. :func:`allreduce_s` reads the link and the
    fixed cost from a cluster; ``partitioner plan --workers D --worker-bandwidth BW`` gives them between
    workers whose devices are in no one cluster file.

    Example:
        >>> ring_allreduce_s(3e9, 4, 1e9)  # 2 x 3/4 x 3 GB at 1 GB/s
        4.5
    """
    if num_members < 2 or num_bytes <= 0:
        return 0.0
    return 2 * (num_members - 1) / num_members * num_bytes / bandwidth_bytes_per_s + overhead_s


def reduce_times(reductions: Reductions, graph: nx.DiGraph, assignment: Mapping[str, str]) -> dict[str, float]:
    """Seconds of each used device's ``R`` under ``assignment`` ({node: device}): the stage's trainable weights'
    gradients all-reduced as ``reductions`` prices them (:func:`reduce_s`)."""
    gradients: dict[str, float] = {}
    for node, device in assignment.items():
        gradients[device] = gradients.get(device, 0.0) + trainable_param_bytes(graph.nodes[node])
    return {device: reduce_s(reductions, device, size) for device, size in gradients.items()}


def reduce_s(reductions: Reductions, device: str, num_bytes: float) -> float:
    """Seconds of the ``R`` of the stage on ``device`` whose weight gradients take ``num_bytes``, as ``reductions``
    prices each stage's ring (:func:`ring_allreduce_s`).

    Example:
        >>> cluster = Cluster.uniform(2, memory="16GiB", bandwidth=100e9)
        >>> workers = Reductions.between_workers(cluster, 4, 10e9)      # 4 workers on a 10 GB/s link
        >>> reduce_s(workers, cluster.names[0], 1e9)                     # 2 x 3/4 x 1 GB at 10 GB/s
        0.15
    """
    return ring_allreduce_s(
        num_bytes,
        reductions.num_replicas,
        reductions.bandwidth_bytes_per_s[device],
        overhead_s=reductions.overhead_s[device],
    )


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
