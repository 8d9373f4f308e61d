"""Profiles a Keras model into a layer graph: one node per layer call, with FLOPs, bytes and times.

How each number is obtained, per micro-batch (``ceil(batch_size / num_microbatches)`` samples)::

    attribute          how
    -----------------  ---------------------------------------------------------------------------
    forward_flops      FLOPs of the call's traced TF graph (profiles.flops; a multiply-add is 2 FLOPs)
    flops              forward + backward: partitioner.cost.training_flops, 3 * forward for calls of
                       layers with trainable weights (gradients for inputs and weights), 2 * forward
                       otherwise (frozen layers: gradients for the inputs only)
    param_bytes        size * itemsize of every weight of the layer (trainable and not), on the
                       layer's first call only; a weight is counted once even if layers share it.
                       Variables keep their own dtype (float32 under mixed_float16).
    trainable_param_bytes  the part of param_bytes in the layer's trainable weights (0 for a frozen
                       layer, ``trainable=False``; a batch normalization's moving statistics are
                       never trainable): only these get gradients and optimizer slots.
    activation_bytes   bytes kept for the backward pass, as TensorFlow keeps them in a function
                       (the runtime's stages are functions): a forward tensor lives on if any
                       gradient op TensorFlow builds reads it, one whose result no gradient
                       uses too (a product's gradient for a constant factor). Each call (a layer with
                       or without sublayers, a Keras op) is traced with its gradient, which
                       gives the call's internal tensors the gradient reads (a view such as a
                       reshape counted as the tensor it views; weights and constants hold no
                       activation), which of its outputs its own gradient reads, and which of
                       its inputs it reads. A node is charged those internal tensors plus each
                       of its outputs that its own gradient reads, that the gradient of any
                       consumer reads as an input, or that is a model output (the loss reads
                       it). A BatchNormalization output feeding a ReLU is charged nothing (the
                       ReLU's gradient reads its own output); the Conv2D output before it is (the
                       normalization's gradient reads its input). A call that cannot be analysed
                       (no gradient, a variant tensor, a loop) is charged its outputs, or for a
                       layer with sublayers the output bytes of every op of its traced forward
                       graph, loop bodies times their trip count (an RNN's per-step values live
                       in TensorLists of no static size), an upper bound; it is taken to read
                       all its inputs. InputLayer: 0.
    time_s             measured forward + backward seconds (profiles.timing: the call's ops, without the
                       dispatch of a function from Python), measure_time only
    fixed_time_s       the part of time_s that does not shrink with the micro-batch (measure_fixed_time
                       only): the call is timed again on one sample, and the line through the two
                       times (seconds = fixed + per sample x samples) gives it, within [0, time_s].
                       Small micro-batches pay it whole (kernel launches, dispatch, matmuls too small
                       to use the device); partitioner.rescale_graph keeps it when it scales time_s.
    time_by_samples    [[samples, seconds], ...]: the call timed again at each micro-batch size of
                       time_samples (measure_time only): a device's speed changes with the rows of its
                       kernels (a matmul of 32 rows runs each row slower than one of 256), and
                       partitioner.rescale_graph prices each size measured as measured, those between
                       on the line through the nearest two
    accumulate_time_s  seconds to add the call's weight gradients of one micro-batch into sums of their
                       shapes (profiles.timing.accumulate_seconds; measure_fixed_time, calls with
                       trainable weights, a shared layer's first call only, as param_bytes): what the
                       runtime's stage pays per micro-batch when M > 1; timed with the sums out of the
                       caches where the model's weights, gradients and sums outgrow them (_cold_sums)
    config_digest      the layer's config without names, hashed (config_digest): a plan's record of
                       the architecture it was made for (partitioner.graph.structure)
    model_input_bytes  an InputLayer's output bytes: the model input the runtime splits into
                       micro-batches on that node's device (other nodes: absent)
    model_output_bytes bytes of the node's distinct outputs that are model outputs, which the runtime
                       collects for the loss and the metrics (other nodes: absent)
    output_bytes       bytes of the node's floating-point outputs (0 for an InputLayer): the gradients
                       its backward makes of them, the working set of a running backward
                       (partitioner.cost.mode_cost)
    edge bytes         bytes of the distinct tensors the consumer reads from the producer

Every time above (time_s, fixed_time_s, time_by_samples) is then scaled, size by size, so that the calls'
times at each size they were timed at add up to the whole model's forward + backward timed the same way at
that size (``model_time_by_samples`` records both sums): timed one call at a time, a model's calls add up to
more than the model at small micro-batches (each call's ops run alone, where in one function independent ops
overlap), and a pipeline stage runs its calls in one function. Where the model cannot be timed whole (it
does not fit on the device), a warning says so and the calls' own times stay.

The graph records ``batch_size``, ``num_microbatches`` and ``micro_batch_size`` (the samples the
costs are for, so ``partitioner.rescale_graph`` can scale them to another batch), and
``compute_dtype``: the compute dtype of the layers that do most of the forward FLOPs, from their
Keras dtype policy (``mixed_float16`` computes in float16, ``mixed_bfloat16`` in bfloat16). With
``measure_fixed_time`` it also records ``step_overhead_s``: what a Keras training step of a copy of the
model on one sample takes beyond its layers (the step's dispatch, the loss, the optimizer's update),
once per step whatever the plan (``partitioner.Plan.predicted_step_s`` adds it to the simulated step).

Shapes come from the Keras graph with the batch dimension (axis 0) replaced by the micro-batch
size. Where an input leaves other dimensions open (a sequence length), ``input_shapes=`` or
``sequence_length=`` fix them and every tensor's shape is computed for those inputs
(``profiles.shapes``). Each layer call is traced once with ``tf.function``
on ``tf.TensorSpec`` inputs of those shapes, in training mode; no per-layer models are built and
the model's weights and layers come back unchanged.

The graph follows the contract of ``partitioner.graph``: nested Functional and Sequential models
are flattened into their layers, a layer called k times gives nodes "name", "name:1", ... that
share ``colocation_group=name``, and Keras ops used in a functional model (``keras.ops.add``)
become nodes too.

Example:
    >>> import keras                                                              # doctest: +SKIP
    >>> from profiles import profile_model                                        # doctest: +SKIP
    >>> inputs = keras.Input((784,))                                              # doctest: +SKIP
    >>> outputs = keras.layers.Dense(10)(keras.layers.Dense(128)(inputs))        # doctest: +SKIP
    >>> graph = profile_model(keras.Model(inputs, outputs), batch_size=32, num_microbatches=4,
    ...                       measure_time=False)                                 # doctest: +SKIP
    >>> list(graph.nodes), graph.nodes["dense"]["param_bytes"]                   # doctest: +SKIP
    (['input_layer', 'dense', 'dense_1'], 401920)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import networkx as nx

from partitioner.cost import training_flops
from partitioner.errors import InputError, ProfileError, TimingError
from partitioner.graph import check_batch, load_graph, save_graph, validate_graph
from profiles.internals import flatten_layers
from profiles.shapes import InputShapes, Shape, call_shapes, needs_shapes
from profiles.shapes import input_shapes as resolve_input_shapes
from profiles.walk import LayerCall, Source, flatten_calls, functional_graph

ProgressCallback = Callable[[int, int, str], None]  # (done, total, layer name)

# Ops whose outputs hold no new activation memory: inputs, weights, constants, aliases.
_NO_ACTIVATION_OPS = frozenset(
    ["Const", "Identity", "IdentityN", "NoOp", "Placeholder", "ReadVariableOp", "VarHandleOp", "StopGradient"]
)


def profile_model(
    model: Any,
    batch_size: int = 32,
    num_microbatches: int = 8,
    *,
    measure_time: bool = True,
    device: str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    progress: ProgressCallback | None = None,
    input_shapes: InputShapes | None = None,
    sequence_length: int | None = None,
    measure_fixed_time: bool = False,
    time_samples: Sequence[int] = (),
) -> nx.DiGraph:
    """Profiles a Functional or Sequential Keras model into a layer graph (see the module docstring).

    Args:
        model: a built ``keras.Model`` made with the functional API or ``keras.Sequential``.
        batch_size: samples per training step.
        num_microbatches: micro-batches per step; costs are per micro-batch of
            ``ceil(batch_size / num_microbatches)`` samples.
        measure_time: also run each layer call forward + backward on ``device`` and record
            ``time_s``; also records ``profiled_device`` and ``profiled_flops_per_s``.
        device: where to time, e.g. "/GPU:0"; the first logical GPU, else the first CPU, when None.
        repeats: timed runs per layer call (the median is kept).
        warmup: untimed runs per layer call before timing.
        progress: called as ``progress(done, total, node_name)`` after each node.
        input_shapes: the shapes to plan for, without the batch axis, where the model leaves
            dimensions open: ``{"token_ids": (128,)}`` or a list in the order of ``model.inputs``
            (``profiles.shapes``).
        sequence_length: the size for every unknown non-batch dimension of every input.
        measure_fixed_time: with ``measure_time``, also time each call on one sample and record
            ``fixed_time_s`` (module docstring), so that ``partitioner.rescale_graph`` prices smaller
            micro-batches by what they really cost: what ``num_microbatches="auto"`` needs to weigh M;
            also time adding each call's weight gradients into sums (``accumulate_time_s``).
        time_samples: with ``measure_time``, micro-batch sizes (samples) to time each call at as well,
            recorded in ``time_by_samples``: the sizes the planner will weigh (``runtime.plan_and_wrap``
            passes those of the M that ``num_microbatches="auto"`` tries).

    Returns:
        A ``networkx.DiGraph`` that passes ``partitioner.graph.validate_graph``, nodes in
        topological (Keras graph) order.

    Raises:
        ProfileError: when the model is not a Keras model, has no functional graph (subclassed),
            is not built, or has unknown non-batch dimensions that input_shapes and
            sequence_length leave open.
        InputError: for input_shapes that do not fit the model's inputs, batch_size < 1,
            num_microbatches < 1 or > batch_size, repeats < 1,
            warmup < 0, time_samples that are not sizes >= 1, or an unknown device.

    Example:
        >>> graph = profile_model(model, batch_size=64, num_microbatches=8)       # doctest: +SKIP
        >>> graph.nodes["conv2d"]["time_s"] > 0                                  # doctest: +SKIP
        True
    """
    _check_numbers(batch_size, num_microbatches, repeats, warmup)
    calls, sources = flatten_calls(model)
    planned = resolve_input_shapes(model, input_shapes, sequence_length)
    if needs_shapes(model, planned):
        shapes = call_shapes(calls, planned)
    else:  # the Keras graph's own shapes: no layer is asked again
        shapes = [[tuple(t.shape) for t in call.node.output_tensors] for call in calls]
    micro_batch = math.ceil(batch_size / num_microbatches)
    sizes = _sizes(time_samples, micro_batch)

    import tensorflow as tf  # lazy: the planner side stays free of TensorFlow

    graph = nx.DiGraph(
        model_name=model.name, batch_size=batch_size, num_microbatches=num_microbatches, micro_batch_size=micro_batch
    )
    timing_device = None
    if measure_time:
        from profiles.local import measure_flops_per_s

        timing_device = _resolve_device(tf, device)
        graph.graph["profiled_device"] = timing_device
        graph.graph["profiled_flops_per_s"] = measure_flops_per_s(timing_device)
    profiler = _CallProfiler(
        tf, micro_batch, shapes, timing_device, repeats, warmup, measure_fixed_time, sizes, _cold_sums(model)
    )
    counted: set[int] = set()  # ids of weights already given to a node
    dtype_flops: dict[str, float] = {}  # compute dtype -> forward FLOPs of the calls computing in it
    for done, call in enumerate(calls, start=1):
        graph.add_node(call.name, **profiler.attributes(done - 1, call, counted))
        dtype = _compute_dtype(call.operation)
        if dtype is not None:
            dtype_flops[dtype] = dtype_flops.get(dtype, 0.0) + graph.nodes[call.name].get("forward_flops", 0.0)
        for source, num_bytes in _input_edges(call, shapes, micro_batch).items():
            graph.add_edge(calls[source].name, call.name, bytes=num_bytes)
        if progress is not None:
            progress(done, len(calls), call.name)
    functional = functional_graph(model)
    outputs = [sources[id(t)] for t in functional.outputs]
    for call, num_bytes in zip(calls, profiler.activation_bytes(calls, outputs), strict=True):
        graph.nodes[call.name]["activation_bytes"] = num_bytes
    for call, shape in zip(calls, shapes, strict=True):
        graph.nodes[call.name]["output_bytes"] = _gradient_output_bytes(call, shape, micro_batch)
    # what the runtime holds per micro-batch beside the layers, on the node that makes it: the batch's
    # inputs and the collected outputs
    for key, tensors in (("model_input_bytes", functional.inputs), ("model_output_bytes", functional.outputs)):
        for index, num_bytes in _boundary_bytes(tensors, sources, shapes, micro_batch).items():
            graph.nodes[calls[index].name][key] = num_bytes
    graph.graph["compute_dtype"] = _model_compute_dtype(model, dtype_flops)
    if timing_device is not None:
        _scale_to_model(model, calls, sources, functional, shapes, graph, profiler, timing_device, repeats, warmup)
    if measure_fixed_time and timing_device is not None:
        overhead = _step_overhead(model, functional, sources, shapes, timing_device, repeats, warmup)
        if overhead is not None:
            graph.graph["step_overhead_s"] = overhead
    validate_graph(graph)
    return graph


STEP_REPEATS, STEP_WARMUP = 20, 10  # the least runs of the copy's training step (_step_overhead)
# a stage's weights, their gradients and their sums pass through the caches between two adds of the same sums
SUMMED_COPIES = 3


def _cold_sums(model: Any) -> bool:
    """Whether a step meets the sums of ``model``'s weight gradients out of the caches (``accumulate_time_s`` is
    then timed cold): where its trainable weights, their gradients and their sums (SUMMED_COPIES) take more than
    the host's largest cache (``profiles.timing.cache_bytes``). Timed cold, the adds of a model that fits the
    caches would be priced at up to three times what its step pays."""
    from profiles.timing import cache_bytes

    return SUMMED_COPIES * sum(weight_bytes(w) for w in model.trainable_weights) > cache_bytes()


MODEL_REPEATS = 10  # the least timed runs of the whole model's forward + backward (_scale_to_model)


def _scale_to_model(
    model: Any,
    calls: list[LayerCall],
    sources: dict[int, Source],
    functional: Any,
    shapes: list[list[Shape]],
    graph: nx.DiGraph,
    profiler: _CallProfiler,
    device: str,
    repeats: int,
    warmup: int,
) -> None:
    """Scales the layers' times so that, at each size they were timed at, they add up to the whole model's
    forward + backward timed the same way (``profiles.timing.forward_backward_seconds_by_size`` on the model, its
    trainable weights and float inputs, the sizes taking turns). Timed one call at a time, a model's calls add
    up to more than the model at small micro-batches (each call's ops run alone; in one function independent ops
    overlap and kernels follow each other without a return to Python): Transformer-4 on 4 sequences, 1 intra-op /
    2 inter-op threads, 53-57 ms against 40.6 ms; a stage runs its calls in one function, as the model does. Records
    ``model_time_by_samples`` ([[samples, the model's seconds, its calls' seconds before scaling], ...]).
    Where the model cannot be timed whole (it does not fit on the device, or its call fails), warns and
    keeps the calls' own times."""
    import tensorflow as tf

    from profiles.timing import forward_backward_seconds_by_size, training_call, variables_kept

    sizes = profiler.timed_sizes()
    specs_of = [sources[id(t)] for t in functional.inputs]
    specs_by_size = [
        [
            tf.TensorSpec(_micro_shape(shapes[s.call][s.output], n, model.name), t.dtype)
            for s, t in zip(specs_of, functional.inputs, strict=True)
        ]
        for n in sizes
    ]
    try:
        with variables_kept(model.variables):  # the model runs: BN statistics and seeds move
            seconds = forward_backward_seconds_by_size(  # the sizes take turns: a drift moves them alike
                training_call(model),
                specs_by_size,
                model.trainable_weights,
                device=device,
                repeats=max(repeats, MODEL_REPEATS),
                warmup=warmup,
            )
        measured = dict(zip(sizes, seconds, strict=True))
    except (tf.errors.OpError, MemoryError, ValueError, TypeError) as error:  # planned on the calls' own times
        warnings.warn(
            f"Could not time the forward and backward of '{model.name}' as a whole on {device} "
            f"({_summary(error)}); its layers' times are kept as timed one call at a time, which add up to "
            "more than the model at small micro-batches.",
            stacklevel=3,
        )
        return
    layers = {n: sum(profiler.layer_seconds(i, n) for i in range(len(calls))) for n in sizes}
    factors = {n: measured[n] / layers[n] if measured[n] > 0 and layers[n] > 0 else 1.0 for n in sizes}
    for index, call in enumerate(calls):
        profiler.scale_times(index, graph.nodes[call.name], factors)
    graph.graph["model_time_by_samples"] = [[n, float(measured[n]), float(layers[n])] for n in sizes]


def _step_overhead(
    model: Any,
    functional: Any,
    sources: dict[int, Source],
    shapes: list[list[Shape]],
    device: str,
    repeats: int,
    warmup: int,
) -> float | None:
    """Seconds a training step of ``model`` spends beyond its layers, once per step whatever the plan: a
    Keras step of a copy of the model on one sample less the copy's forward and backward there, taking
    turns (``profiles.timing.step_overhead_seconds``; what the layers' times at one sample add up to once
    scaled to the whole model, ``_scale_to_model``), at least 0. None, with a warning, where the copy cannot
    train."""
    import tensorflow as tf

    from profiles.timing import step_overhead_seconds

    def specs(tensors: Any) -> list[Any]:
        found = [sources[id(t)] for t in tensors]
        return [
            tf.TensorSpec(_micro_shape(shapes[s.call][s.output], 1, "the model"), t.dtype)
            for s, t in zip(found, tensors, strict=True)
        ]

    try:
        # a step is milliseconds, its Python side noisy: more runs than a layer's (medians moved by half with 5)
        return step_overhead_seconds(
            model,
            specs(functional.inputs),
            specs(functional.outputs),
            device=device,
            repeats=max(repeats, STEP_REPEATS),
            warmup=max(warmup, STEP_WARMUP),
        )
    except Exception as error:  # the plan is still made, its prediction without the step's own work
        warnings.warn(
            f"Could not time a training step of a copy of '{model.name}' ({type(error).__name__}: {error}); "
            "its predicted steps leave out the step's own work (Plan.step_overhead_s = 0).",
            stacklevel=3,
        )
        return None


def save_profile(graph: nx.DiGraph, path: str | Path) -> None:
    """Writes a layer graph to a JSON file (``partitioner.graph.save_graph``).

    Example:
        >>> save_profile(profile_model(model), "model.json")                     # doctest: +SKIP
    """
    save_graph(graph, path)


def load_profile(path: str | Path) -> nx.DiGraph:
    """Reads a layer graph written by :func:`save_profile` (``partitioner.graph.load_graph``).

    Example:
        >>> graph = load_profile("model.json")                                    # doctest: +SKIP
    """
    return load_graph(path)


# --- the Keras graph, flattened ----------------------------------------------------------------


# --- sizes -----------------------------------------------------------------------------------


def _micro_shape(shape: Shape, micro_batch: int, owner: str) -> list[int]:
    """The shape with axis 0 set to the micro-batch size; raises for other unknown dims."""
    dims = list(shape)
    if dims:
        dims[0] = micro_batch
    if any(dim is None for dim in dims):
        raise ProfileError(
            f"A tensor of '{owner}' has shape {tuple(shape)} with unknown dimensions beyond the batch axis "
            "for the planned input shapes; profiling needs static shapes. Expected every size to follow from "
            "the inputs' sizes: pass them as input_shapes= or sequence_length= (CLI: --input-shape, "
            "--sequence-length), or build the model with fixed sizes, e.g. keras.Input(shape=(128, 64))."
        )
    return [int(dim) for dim in dims if dim is not None]  # unknown sizes raised above


def _itemsize(dtype: Any) -> int:
    import tensorflow as tf

    try:
        return int(tf.as_dtype(dtype).size)
    except TypeError:
        return 0


def weight_bytes(weight: Any) -> int:
    """Bytes of one Keras weight: size * itemsize (0 for a dtype without a fixed size)."""
    return math.prod(int(d) for d in weight.shape) * _itemsize(weight.dtype)


def _tensor_bytes(shape: Shape, dtype: Any, micro_batch: int, owner: str) -> int:
    return math.prod(_micro_shape(shape, micro_batch, owner)) * _itemsize(dtype)


def _boundary_bytes(
    tensors: Any, sources: dict[int, Source], shapes: list[list[Shape]], micro_batch: int
) -> dict[int, int]:
    """{producing call index: bytes per micro-batch} of the model's distinct input (or output) tensors."""
    seen = {(sources[id(t)].call, sources[id(t)].output): t for t in tensors}
    by_call: dict[int, int] = {}
    for (call, output), t in seen.items():
        by_call[call] = by_call.get(call, 0) + _tensor_bytes(shapes[call][output], t.dtype, micro_batch, "model")
    return by_call


def _gradient_output_bytes(call: LayerCall, shapes: list[Shape], micro_batch: int) -> int:
    """Bytes of the call's floating-point outputs, ``shapes`` theirs: the gradients its backward
    makes of them (an InputLayer's: none, a model input gets no gradient)."""
    if call.is_input:
        return 0
    import tensorflow as tf

    return sum(
        _tensor_bytes(shape, t.dtype, micro_batch, call.operation.name)
        for t, shape in zip(call.node.output_tensors, shapes, strict=True)
        if tf.as_dtype(t.dtype).is_floating
    )


def _input_edges(call: LayerCall, shapes: list[list[Shape]], micro_batch: int) -> dict[int, int]:
    """{producer call index: bytes} of the distinct tensors this call reads."""
    edges: dict[int, int] = {}
    read: set[tuple[int, int]] = set()
    for source in call.sources:
        if (source.call, source.output) in read:  # the same tensor twice (a nested model's: twice, two calls)
            continue
        read.add((source.call, source.output))
        shape = shapes[source.call][source.output]
        num_bytes = _tensor_bytes(shape, source.tensor.dtype, micro_batch, call.operation.name)
        edges[source.call] = edges.get(source.call, 0) + num_bytes
    return edges


# --- costs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Saved:
    """What the gradient of one call reads of its forward (see ``_saved``)."""

    internal_bytes: int  # bytes of the call's own forward tensors it reads, neither inputs nor outputs
    outputs_read: tuple[bool, ...]  # per output of the call (flattened): read by the call's own gradient
    inputs_read: tuple[bool, ...]  # per input tensor of the call: read, or a view of it read


@dataclass(frozen=True)
class _Trace:
    """What tracing one call (a layer on given input specs) gives; shared by the calls it memoises."""

    forward_flops: float
    saved: _Saved | None  # None: the gradient could not be analysed (a loop, no gradient, a variant)
    traced_bytes: int  # the upper bound of a composite without analysis: every op's outputs
    time_s: float | None
    time_by_samples: tuple[tuple[int, float], ...] = ()  # (samples, seconds) at time_samples' sizes
    one_sample_s: float | None = None  # the call on one sample (measure_fixed_time): gives fixed_time_s
    accumulate_time_s: float | None = None  # adding the weight gradients into sums (measure_fixed_time)


class _CallProfiler:
    """Traces (and optionally times) each call, memoising calls of one layer on equal inputs."""

    def __init__(
        self,
        tf: Any,
        micro_batch: int,
        shapes: list[list[Shape]],
        device: str | None,
        repeats: int,
        warmup: int,
        fixed_time: bool = False,
        time_samples: Sequence[int] = (),
        cold_sums: bool = True,
    ) -> None:
        self._tf = tf
        self._micro_batch = micro_batch
        self._shapes = shapes  # per call: the shapes of its outputs, batch axis None
        self._device = device
        self._repeats = repeats
        self._warmup = warmup
        self._fixed_time = fixed_time and device is not None and micro_batch > 1
        self._accumulate = fixed_time and device is not None
        self._cold_sums = cold_sums  # accumulate_time_s timed with the caches emptied first (_cold_sums)
        self._evict: Any = None  # profiles.timing.evict_caches on the device, made at the first cold timing
        self._time_samples = tuple(time_samples) if device is not None else ()
        self._memo: dict[tuple[int, str], _Trace] = {}
        self._traces: dict[int, _Trace] = {}  # call index -> its trace (not for InputLayers)

    def attributes(self, index: int, call: LayerCall, counted: set[int]) -> dict[str, Any]:
        """The node attributes of call ``index``; ``counted`` holds ids of weights already counted.

        ``activation_bytes`` is 0 here: it depends on the calls that read the outputs
        (:meth:`activation_bytes`, once every call is traced).
        """
        attrs: dict[str, Any] = {"layer_type": type(call.operation).__name__, "config_digest": config_digest(call)}
        if call.colocation_group is not None:
            attrs["colocation_group"] = call.colocation_group
        if call.is_input:
            attrs.update(flops=0.0, param_bytes=0, activation_bytes=0)
            if self._device is not None:
                attrs["time_s"] = 0.0
            return attrs
        param_bytes = trainable_bytes = 0
        trainable_ids = {id(w) for w in _trainable_weights(call.operation)}
        for weight in getattr(call.operation, "weights", []):
            if id(weight) not in counted:
                counted.add(id(weight))
                size = weight_bytes(weight)
                param_bytes += size
                trainable_bytes += size if id(weight) in trainable_ids else 0
        specs = self._specs(call, self._micro_batch)
        key = (id(call.operation), repr(call.node.arguments.convert(lambda x: _spec_key(x, specs, call))))
        if key not in self._memo:
            trace = self._measure(call, specs)
            if self._time_samples and trace.time_s is not None:
                timed = tuple((n, self._time(call, self._specs(call, n))) for n in self._time_samples)
                trace = replace(trace, time_by_samples=timed)
            if self._fixed_time and trace.time_s is not None:
                one = dict(trace.time_by_samples).get(1)  # one sample, where time_samples had it
                trace = replace(trace, one_sample_s=self._time(call, self._specs(call, 1)) if one is None else one)
            if self._accumulate and trainable_ids:
                trace = replace(trace, accumulate_time_s=self._accumulate_seconds(call))
            self._memo[key] = trace
        trace = self._traces[index] = self._memo[key]
        attrs.update(
            flops=training_flops(trace.forward_flops, bool(trainable_ids)),
            forward_flops=trace.forward_flops,
            param_bytes=int(param_bytes),
            trainable_param_bytes=int(trainable_bytes),
            activation_bytes=0,
        )
        if trace.time_s is not None:
            attrs["time_s"] = float(trace.time_s)
        if trace.one_sample_s is not None and trace.time_s is not None:
            attrs["fixed_time_s"] = self._fixed_seconds(trace.one_sample_s, trace.time_s)
        if trace.time_by_samples:
            attrs["time_by_samples"] = [[n, float(t)] for n, t in trace.time_by_samples]
        if trace.accumulate_time_s is not None and trainable_bytes > 0:  # a shared layer's weights: its first call
            attrs["accumulate_time_s"] = float(trace.accumulate_time_s)
        return attrs

    def _specs(self, call: LayerCall, samples: int) -> list[Any]:
        """The call's input specs with the batch axis set to ``samples``."""
        return [
            self._tf.TensorSpec(_micro_shape(self._shapes[s.call][s.output], samples, call.operation.name), t.dtype)
            for t, s in zip(call.node.input_tensors, call.sources, strict=True)
        ]

    def _fixed_seconds(self, one: float, time_s: float) -> float:
        """The part of ``time_s`` (measured at the micro-batch) that one sample costs as well: the line through
        ``one`` (the time on one sample) and ``time_s`` at the micro-batch, at zero samples, within [0, time_s]."""
        per_sample = (time_s - one) / (self._micro_batch - 1)
        return min(max(one - per_sample, 0.0), time_s)

    def timed_sizes(self) -> tuple[int, ...]:
        """The micro-batch sizes each call was timed at: the profile's own, time_samples', and one sample's
        where the fixed part was measured; () when nothing was timed."""
        if self._device is None:
            return ()
        return tuple(sorted({self._micro_batch, *self._time_samples, *((1,) if self._fixed_time else ())}))

    def layer_seconds(self, index: int, samples: int) -> float:
        """Call ``index``'s forward + backward seconds at ``samples`` (one of :meth:`timed_sizes`); 0 for an input."""
        trace = self._traces.get(index)
        if trace is None or trace.time_s is None:
            return 0.0
        if samples == self._micro_batch:
            return trace.time_s
        if samples == 1 and trace.one_sample_s is not None:
            return trace.one_sample_s
        return dict(trace.time_by_samples)[samples]

    def scale_times(self, index: int, data: dict[str, Any], factors: dict[int, float]) -> None:
        """Multiplies node ``data``'s times at each timed size by that size's factor (``_scale_to_model``): ``time_s``,
        each ``time_by_samples`` entry, and ``fixed_time_s`` again from the scaled times on one sample and at the
        micro-batch."""
        trace = self._traces.get(index)
        if trace is None or trace.time_s is None:
            return
        data["time_s"] = trace.time_s * factors[self._micro_batch]
        if trace.time_by_samples:
            data["time_by_samples"] = [[n, float(t * factors[n])] for n, t in trace.time_by_samples]
        if trace.one_sample_s is not None:
            data["fixed_time_s"] = self._fixed_seconds(trace.one_sample_s * factors[1], data["time_s"])

    def _accumulate_seconds(self, call: LayerCall) -> float:
        """Seconds to add one micro-batch's gradients of the call's trainable weights into sums."""
        from profiles.timing import accumulate_seconds, evict_caches

        weights = _trainable_weights(call.operation)
        what = f"the sum of '{call.operation.name}' ({type(call.operation).__name__})'s weight gradients"
        with self._timing(
            what, "Expected weights that fit on the device; profile with measure_fixed_time=False to skip it."
        ):
            if self._cold_sums and self._evict is None:
                self._evict = evict_caches(str(self._device))
            return accumulate_seconds(
                weights, device=str(self._device), repeats=self._repeats, warmup=self._warmup, evict=self._evict
            )

    @contextlib.contextmanager
    def _timing(self, what: str, expected: str) -> Iterator[None]:
        """Turns what TensorFlow raises while timing ``what`` into one TimingError line."""
        tf = self._tf
        try:
            yield
        except (tf.errors.OpError, LookupError, ValueError, TypeError) as err:
            raise TimingError(f"Timing {what} on {self._device} failed: {_summary(err)}. {expected}") from err

    def activation_bytes(self, calls: list[LayerCall], model_outputs: list[Source]) -> list[int]:
        """Per call, the bytes kept for its backward: the internal tensors its gradient reads, and each
        output that its own gradient, a consumer's gradient (as an input) or the loss (a model output)
        reads. A call without analysis keeps its upper bound and is taken to read all its inputs."""
        kept = {(s.call, s.output) for s in model_outputs}
        for index, call in enumerate(calls):
            trace = self._traces.get(index)
            if trace is None:  # an InputLayer
                continue
            saved = trace.saved
            if saved is not None:
                kept.update((index, k) for k, read in enumerate(saved.outputs_read) if read)
            for position, source in enumerate(call.sources):
                if saved is None or saved.inputs_read[position]:
                    kept.add((source.call, source.output))
        activations = []
        for index, call in enumerate(calls):
            trace = self._traces.get(index)
            output_bytes = [
                _tensor_bytes(shape, t.dtype, self._micro_batch, call.operation.name)
                for t, shape in zip(call.node.output_tensors, self._shapes[index], strict=True)
            ]
            if trace is None:
                activations.append(0)
            elif trace.saved is None:  # the upper bound
                composite = _is_composite(call.operation)
                activations.append(trace.traced_bytes if composite else sum(output_bytes))
            else:
                read = sum(size for k, size in enumerate(output_bytes) if (index, k) in kept)
                activations.append(trace.saved.internal_bytes + read)
        return activations

    def _measure(self, call: LayerCall, specs: list[Any]) -> _Trace:
        """Traces one call: its forward FLOPs, what its gradient reads and, when timing, its seconds."""
        from profiles.flops import fold_graph, graph_flops

        tf = self._tf
        forward = _forward_fn(call)
        try:
            traced = tf.function(forward).get_concrete_function(*specs).graph
        except Exception as err:
            raise ProfileError(
                f"Tracing '{call.operation.name}' ({type(call.operation).__name__}) on inputs {specs} "
                f"failed: {_summary(err)}. Expected the layer to run on tensors of its "
                "Keras input shapes with the batch axis set to the micro-batch size."
            ) from err
        flops = graph_flops(traced)
        saved = _saved(tf, forward, specs, traced, _trainable_weights(call.operation), len(call.node.output_tensors))
        traced_bytes = 0
        if saved is None and _is_composite(call.operation):
            traced_bytes = int(fold_graph(traced, _op_output_bytes))
        time_s = None if self._device is None else self._time(call, specs)
        return _Trace(float(flops), saved, traced_bytes, time_s)

    def _time(self, call: LayerCall, specs: list[Any]) -> float:
        """Forward + backward seconds of the call on ``specs`` (profiles.timing); its variables restored."""
        from profiles.timing import forward_backward_seconds, variables_kept

        what = f"'{call.operation.name}' ({type(call.operation).__name__}) forward + backward"
        expected = (
            "Expected a differentiable layer that fits on the device; profile with measure_time=False to skip timing."
        )
        # running the layer moves its BN statistics and seeds: they come back
        with variables_kept(getattr(call.operation, "variables", [])), self._timing(what, expected):
            return forward_backward_seconds(
                _forward_fn(call),
                specs,
                _trainable_weights(call.operation),
                device=str(self._device),
                repeats=self._repeats,
                warmup=self._warmup,
            )


def _forward_fn(call: LayerCall) -> Callable[..., Any]:
    """A function of one tensor per Keras input tensor that repeats the call in training mode."""
    from keras import KerasTensor, layers

    operation, node = call.operation, call.node
    tensors = list(node.input_tensors)

    def forward(*values: Any) -> Any:
        by_id = {id(t): v for t, v in zip(tensors, values, strict=True)}
        args, kwargs = node.arguments.convert(lambda x: by_id[id(x)] if isinstance(x, KerasTensor) else x)
        if isinstance(operation, layers.Layer):
            kwargs["training"] = True  # as keras.Model(..., training=True) would pass it
        return operation(*args, **kwargs)

    return forward


def _spec_key(value: Any, specs: list[Any], call: LayerCall) -> Any:
    """Describes an argument for memoising: input tensors by spec, others as they are."""
    for tensor, spec in zip(call.node.input_tensors, specs, strict=True):
        if value is tensor:
            return (tuple(spec.shape.as_list()), spec.dtype.name)
    return value


def _summary(err: Exception) -> str:
    """The error's type and last message line (TensorFlow prepends a traceback of the traced code)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if last.startswith(type(err).__name__) else f"{type(err).__name__}: {last}"


def _trainable_weights(operation: Any) -> list[Any]:
    return list(getattr(operation, "trainable_weights", []))


def _compute_dtype(operation: Any) -> str | None:
    """The dtype ``operation`` computes in, from its Keras dtype policy (None for a Keras op without one)."""
    policy = getattr(operation, "dtype_policy", None)
    dtype = getattr(policy, "compute_dtype", None)
    return str(dtype) if dtype else None


def _model_compute_dtype(model: Any, dtype_flops: dict[str, float]) -> str:
    """The compute dtype of the layers doing most of the forward FLOPs; the model's own when none do any."""
    if dtype_flops and max(dtype_flops.values()) > 0:
        return max(sorted(dtype_flops), key=dtype_flops.__getitem__)
    return _compute_dtype(model) or "float32"


def _is_composite(operation: Any) -> bool:
    """True for a Layer that has sublayers (a block, an RNN and its cell)."""
    return bool(flatten_layers(operation, include_self=False, recursive=False))


# Ops whose output shares its input's buffer: a saved tensor made by one is its input, counted once.
_ALIAS_OPS = frozenset(["Identity", "IdentityN", "StopGradient", "Reshape", "ExpandDims", "Squeeze", "EnsureShape"])
# Ops whose presence makes the saved tensors unsizable (loops keep per-iteration values in TensorLists).
_LOOP_OPS = frozenset(["While", "StatelessWhile"])


def _saved(
    tf: Any, forward: Callable[..., Any], specs: list[Any], traced: Any, weights: list[Any], num_outputs: int
) -> _Saved | None:
    """What the gradient of one call reads of its forward, from the call traced with its gradient.

    The gradient is the inputs' and the trainable weights', or the inputs' alone where the weights
    cannot be differentiated (declared without being allocated, as in keras.StatelessScope; then every
    input counts as read, since the weights' gradient would read them). A tensor the gradient reads
    through views (a reshape, an identity) counts as the tensor it views: an input, an output, or one
    of the call's internal tensors (weights and constants hold no activation). The gradient is built
    as TensorFlow builds a function's (``tf.gradients``: the runtime's stages are functions, whose
    forward hands its backward every tensor a gradient op reads), and every gradient op counts, those
    whose result no gradient uses too (a product's gradient for its constant factor reads the other
    factor): TensorFlow decides what the forward keeps before it prunes them. An exact GELU keeps five
    tensors of its output's size so, where the gradients depend on three. None where the reads cannot
    be sized (a loop keeps its steps in TensorLists, a variant) or there is no gradient at all, and
    where the traced outputs do not match the call's ``num_outputs``: the caller keeps the upper bound.
    """
    from profiles.flops import num_elements

    if any(op.type in _LOOP_OPS for op in traced.get_operations()):
        return None
    outputs = [t for t in tf.nest.flatten(traced.structured_outputs) if t.dtype.is_floating]
    seeds = [tf.TensorSpec(t.shape, t.dtype) for t in outputs]
    forward_ops: set[str] = set()
    input_names: list[str] = []
    output_names: list[str] = []

    def forward_backward(weights: list[Any], *values: Any) -> Any:
        inputs, seed = values[: len(specs)], values[len(specs) :]
        sources = [v for v in inputs if v.dtype.is_floating]
        results = tf.nest.flatten(forward(*inputs))
        input_names.extend(v.name for v in inputs)
        output_names.extend(t.name for t in results)
        forward_ops.update(op.name for op in tf.compat.v1.get_default_graph().get_operations())
        ys = [t for t in results if t.dtype.is_floating]
        variables = [getattr(w, "value", w) for w in weights]  # a Keras variable's tf.Variable
        return tf.gradients(ys, sources + variables, grad_ys=list(seed), unconnected_gradients="zero")

    graph = None
    inputs_only = False  # True when the weights' gradient could not be traced
    for sources in (weights, []):  # a model declared without allocating its weights: the inputs' gradient
        inputs_only = sources is not weights
        forward_ops.clear()
        input_names.clear()
        output_names.clear()
        try:
            function = tf.function(partial(forward_backward, sources), autograph=False)
            graph = function.get_concrete_function(*specs, *seeds).graph
            break
        except Exception:
            graph = None
    if graph is None or len(output_names) != num_outputs:  # no gradient to read: keep the upper bound
        return None

    def base(tensor: Any) -> Any:
        """The tensor that ``tensor`` views (itself when it is no view)."""
        while tensor.op.type in _ALIAS_OPS and tensor.op.inputs:
            # IdentityN's k-th output is its k-th input (a custom gradient's outputs and inputs)
            tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN" else 0]
        return tensor

    inputs = {name: position for position, name in enumerate(input_names)}
    outputs_by_base: dict[str, list[int]] = {}
    for position, name in enumerate(output_names):
        outputs_by_base.setdefault(base(graph.get_tensor_by_name(name)).name, []).append(position)
    inputs_read = [inputs_only and bool(weights)] * len(input_names)  # the weights' gradient would read them
    outputs_read = [False] * num_outputs
    internal: dict[str, int] = {}
    for op in graph.get_operations():
        if op.name in forward_ops:
            continue
        for tensor in op.inputs:
            viewed = base(tensor)
            if viewed.name in inputs:
                inputs_read[inputs[viewed.name]] = True
            elif viewed.name in outputs_by_base:
                for position in outputs_by_base[viewed.name]:
                    outputs_read[position] = True
            elif viewed.op.name in forward_ops and viewed.op.type not in _NO_ACTIVATION_OPS:
                if not (viewed.dtype.is_numeric or viewed.dtype.is_bool):
                    return None  # a variant or resource
                internal[viewed.name] = num_elements(viewed.shape) * viewed.dtype.size
    return _Saved(int(sum(internal.values())), tuple(outputs_read), tuple(inputs_read))


def _op_output_bytes(op: Any) -> float:
    """Bytes of an op's outputs that hold activations (not inputs, weights, constants or aliases)."""
    if op.type in _NO_ACTIVATION_OPS:
        return 0.0
    from profiles.flops import num_elements

    total = 0
    for output in op.outputs:
        dtype = output.dtype
        if dtype.is_numeric or dtype.is_bool:
            total += num_elements(output.shape) * dtype.size
    return float(total)


# --- arguments -------------------------------------------------------------------------------


def _sizes(time_samples: Sequence[int], micro_batch: int) -> tuple[int, ...]:
    """The distinct sizes of ``time_samples`` other than the micro-batch's own, ascending.

    Raises:
        InputError: for a size that is not an integer >= 1.
    """
    for n in time_samples:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(
                f"time_samples must be micro-batch sizes (integers >= 1). Received: {list(time_samples)!r}."
            )
    return tuple(sorted(set(time_samples) - {micro_batch}))


def _check_numbers(batch_size: Any, num_microbatches: Any, repeats: Any, warmup: Any) -> None:
    check_batch(batch_size, num_microbatches)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"repeats must be an integer >= 1. Received: repeats={repeats!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InputError(f"warmup must be an integer >= 0. Received: warmup={warmup!r}.")


def config_digest(call: LayerCall) -> str:
    """12 hex digits of the called operation's config with every name left out: the same for the same
    layer built again (Keras numbers the names it makes up: ``dense_6`` against ``dense_2``), another
    where a setting differs. An operation without a config is known by its class alone."""

    def nameless(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: nameless(v) for k, v in value.items() if k != "name"}
        if isinstance(value, (list, tuple)):
            return [nameless(v) for v in value]
        return value

    try:
        config = call.operation.get_config()
    except Exception:  # an op made with arguments Keras cannot serialize
        config = {}
    text = json.dumps(nameless(config), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _resolve_device(tf: Any, device: str | None) -> str:
    """The full TF name of the timing device: ``device``, else the first logical GPU, else CPU."""
    available = [str(d.name) for d in tf.config.list_logical_devices()]
    if device is None:
        gpus = [str(d.name) for d in tf.config.list_logical_devices("GPU")]
        return gpus[0] if gpus else str(tf.config.list_logical_devices("CPU")[0].name)
    try:
        wanted = tf.DeviceSpec.from_string(device)
    except ValueError:
        wanted = None
    for name in available:
        spec = tf.DeviceSpec.from_string(name)
        if (
            wanted is not None
            and (wanted.device_type or "").upper() == spec.device_type
            and ((wanted.device_index or 0) == spec.device_index)
        ):
            return name
    raise InputError(
        f"Unknown device {device!r}. TensorFlow sees: {available}. Pass one of them, e.g. device='/GPU:0'."
    )
