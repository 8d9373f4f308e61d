"""The layer graph: the contract between the profiler and the planner, and its JSON form.

A layer graph is a ``networkx.DiGraph`` with one node per layer call of a Keras model::

    node attribute      type    meaning
    ------------------  ------  -----------------------------------------------------------
    flops               float   forward + backward FLOPs for one micro-batch
    param_bytes         int     bytes of the layer's weights (dtype-aware), trainable or not
    trainable_param_bytes int   bytes of its trainable weights, which get gradients and optimizer
                                slots (optional; param_bytes when absent: every weight trainable)
    forward_flops       float   the forward pass's FLOPs (optional; else the split rule of
                                partitioner.cost.forward_share)
    activation_bytes    int     bytes kept alive for the backward pass, per micro-batch
    time_s              float   measured forward + backward seconds per micro-batch (optional)
    fixed_time_s        float   the part of time_s that does not shrink with the micro-batch, in
                                [0, time_s] (optional; 0 when absent: time_s scales with the samples)
    time_by_samples     list    [[samples, seconds], ...]: the forward + backward timed at other
                                micro-batch sizes (optional): rescale_graph reads the time at a size
                                between them off the line through its two nearest measured neighbours
    accumulate_time_s   float   measured seconds to add the node's weight gradients of one micro-batch
                                into the step's sums, which every micro-batch pays when M > 1
                                (optional; not priced when absent; cost="time" only, partitioner.cost)
    layer_type          str     the Keras class name (optional)
    config_digest       str     a digest of the layer's config without names (optional; structure)
    colocation_group    str     nodes sharing a group share weights: one device (optional)
    model_input_bytes   int     bytes of the model inputs the node holds, per micro-batch: an InputLayer's
                                output (optional; 0). The runtime splits each input into micro-batches
                                on its InputLayer's device and holds them all step (partitioner.cost)
    model_output_bytes  int     bytes of the node's outputs that are model outputs, per micro-batch
                                (optional; 0): the runtime collects every micro-batch's (partitioner.cost)
    output_bytes        int     bytes of the node's outputs that get gradients, per micro-batch: what its
                                backward makes (optional; activation_bytes when absent, gradient_bytes)
    edge bytes          int     bytes of the tensor sent from u to v per micro-batch

Graph-level attributes (``graph.graph``) are optional: ``model_name``, ``batch_size`` (samples per
step), ``num_microbatches``, ``micro_batch_size`` (the samples the node costs are for:
ceil(batch_size / num_microbatches)), ``compute_dtype`` (the dtype the layers compute in, e.g.
"float32", "bfloat16"; it picks each device's peak FLOP/s), ``profiled_device``,
``profiled_flops_per_s`` (the measured matmul rate of the device ``time_s`` was measured on, used to
rescale times to other devices), ``step_overhead_s`` (seconds a training step of the model spends beyond
its layers' forward and backward, once per step whatever the plan: the framework's step, the loss, the
optimizer's update; ``profiles.profile_model(measure_fixed_time=True)`` measures it on
``profiled_device``, and ``Plan.predicted_step_s`` adds it for a cluster that has that device),
``model_time_by_samples`` ([[samples, seconds, layers' seconds], ...]: the whole model's forward and backward
timed at each size its layers were timed at, and what its layers timed one call at a time added up to there;
``profiles.profile_model`` scales the layers' ``time_s``, ``time_by_samples`` and ``fixed_time_s`` to the
model's, so that a size's times add up to the model's; a record, the costs read only the node times). Profiles
written before the node attributes ``model_input_bytes`` and ``model_output_bytes`` lack them (priced as
0), those before ``output_bytes`` lack it (the backward's gradients priced as the node's activations,
:func:`gradient_bytes`); graph-level ones of the same names, from a development version, are dropped on
loading. :func:`rescale_graph` turns costs measured at one batch size into those of another.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import networkx as nx

from partitioner.errors import GraphError, InputError

GRAPH_SCHEMA_VERSION = 1
_KIND = "layer_graph"
_NODE_NUMBERS = ("flops", "param_bytes", "activation_bytes")
_GRAPH_KEYS = (
    "model_name",
    "batch_size",
    "num_microbatches",
    "micro_batch_size",
    "compute_dtype",
    "profiled_device",
    "profiled_flops_per_s",
    "step_overhead_s",
    "model_time_by_samples",
)
# optional, per micro-batch: they scale with its samples
_NODE_BYTES = ("model_input_bytes", "model_output_bytes", "output_bytes")


def validate_graph(graph: nx.DiGraph) -> None:
    """Checks that ``graph`` is a layer graph the planner can use.

    Raises:
        GraphError: naming the first node or edge that breaks the contract, and how to fix it.
    """
    if not isinstance(graph, nx.DiGraph):
        raise GraphError(
            f"Expected a networkx.DiGraph layer graph. Received: {type(graph).__name__}. "
            "Build one with profiles.profile_model(model) or partitioner.load_graph(path)."
        )
    if graph.number_of_nodes() == 0:
        raise GraphError("The layer graph has no nodes. Profile a model with at least one layer.")
    for key in ("batch_size", "num_microbatches", "micro_batch_size"):
        value = graph.graph.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise GraphError(f"The layer graph has {key}={value!r}; expected an integer >= 1, or no value.")
    overhead = graph.graph.get("step_overhead_s")
    if overhead is not None and (
        isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0 <= overhead < math.inf
    ):
        raise GraphError(
            f"The layer graph has step_overhead_s={overhead!r}; expected the seconds a step spends beyond its "
            "layers, a finite number >= 0, or no value."
        )
    dtype = graph.graph.get("compute_dtype")
    if dtype is not None and (not isinstance(dtype, str) or not dtype):
        raise GraphError(
            f"The layer graph has compute_dtype={dtype!r}; expected a dtype name such as 'float32' or 'bfloat16', "
            "or no value."
        )
    for node, data in graph.nodes(data=True):
        if not isinstance(node, str):
            raise GraphError(f"Node names must be strings. Received: {node!r}.")
        for key in _NODE_NUMBERS:
            value = data.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GraphError(
                    f"Node '{node}' has no numeric '{key}' attribute (got {value!r}). Every node needs "
                    f"{', '.join(_NODE_NUMBERS)}; profiles.profile_model sets them."
                )
            if not math.isfinite(value) or value < 0:
                raise GraphError(f"Node '{node}' has {key}={value!r}; expected a finite value >= 0.")
        trainable = data.get("trainable_param_bytes")
        if trainable is not None and (
            isinstance(trainable, bool)
            or not isinstance(trainable, (int, float))
            or not 0 <= trainable <= data["param_bytes"]
        ):
            raise GraphError(
                f"Node '{node}' has trainable_param_bytes={trainable!r}; expected bytes between 0 and its "
                f"param_bytes ({data['param_bytes']!r}), or no value (all weights trainable)."
            )
        forward = data.get("forward_flops")
        if forward is not None and (
            isinstance(forward, bool) or not isinstance(forward, (int, float)) or not 0 <= forward <= data["flops"]
        ):
            raise GraphError(
                f"Node '{node}' has forward_flops={forward!r}; expected FLOPs between 0 and its flops "
                f"({data['flops']!r}), or no value."
            )
        for key in _NODE_BYTES:
            value = data.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise GraphError(
                    f"Node '{node}' has {key}={value!r}; expected bytes per micro-batch (an integer >= 0), or no "
                    "value. Profile the model again with profiles.profile_model."
                )
        time_s = data.get("time_s")
        if time_s is not None and not _is_seconds(time_s):
            raise GraphError(f"Node '{node}' has time_s={time_s!r}; expected seconds >= 0 or no value.")
        fixed = data.get("fixed_time_s")
        if fixed is not None and (
            isinstance(fixed, bool) or not isinstance(fixed, (int, float)) or time_s is None or not 0 <= fixed <= time_s
        ):
            raise GraphError(
                f"Node '{node}' has fixed_time_s={fixed!r}; expected seconds between 0 and its time_s ({time_s!r}), "
                "or no value."
            )
        _check_time_by_samples(node, data.get("time_by_samples"))
        accumulate = data.get("accumulate_time_s")
        if accumulate is not None and (not _is_seconds(accumulate)):
            raise GraphError(f"Node '{node}' has accumulate_time_s={accumulate!r}; expected seconds >= 0 or no value.")
    for u, v, data in graph.edges(data=True):
        value = data.get("bytes")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise GraphError(f"Edge '{u}' -> '{v}' needs a 'bytes' attribute >= 0. Received: {value!r}.")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise GraphError(
            f"The layer graph has a cycle through {[u for u, _ in cycle]}; a pipeline needs a DAG. "
            "Recurrent loops must stay inside one layer."
        )


def trainable_param_bytes(data: Any) -> int:
    """Bytes of a node's trainable weights: ``trainable_param_bytes``, or ``param_bytes`` where the
    profile does not say (every weight trainable, the conservative choice for memory).

    Example:
        >>> trainable_param_bytes({"param_bytes": 64})
        64
        >>> trainable_param_bytes({"param_bytes": 64, "trainable_param_bytes": 0})
        0
    """
    value = data.get("trainable_param_bytes")
    return int(data.get("param_bytes", 0) if value is None else value)


def gradient_bytes(data: Any) -> int:
    """Bytes of the gradients a node's backward makes per micro-batch, those of its outputs:
    ``output_bytes``, or ``activation_bytes`` where the profile predates it (the old charge).

    Example:
        >>> gradient_bytes({"activation_bytes": 80, "output_bytes": 30}), gradient_bytes({"activation_bytes": 80})
        (30, 80)
    """
    value = data.get("output_bytes")
    return int(data.get("activation_bytes", 0) if value is None else value)


def micro_batch_size(graph: nx.DiGraph) -> int | None:
    """Samples per micro-batch that the graph's node costs are for, or None when the graph does not say.

    ``micro_batch_size`` where recorded, else ceil(batch_size / num_microbatches) (profiles written
    before micro_batch_size existed), else ``batch_size`` alone (costs for the whole batch).

    Example:
        >>> micro_batch_size(nx.DiGraph(batch_size=32, num_microbatches=8))
        4
    """
    recorded = graph.graph.get("micro_batch_size")
    if recorded is not None:
        return int(recorded)
    batch = graph.graph.get("batch_size")
    if batch is None:
        return None
    return math.ceil(int(batch) / int(graph.graph.get("num_microbatches") or 1))


def check_batch(batch_size: Any, num_microbatches: Any) -> None:
    """Raises InputError unless ``batch_size`` and ``num_microbatches`` are integers >= 1 and every
    micro-batch gets at least one sample (the profiler and ``rescale_graph`` take these two).

    Example:
        >>> check_batch(32, 8)
    """
    for name, value in (("batch_size", batch_size), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an integer >= 1. Received: {name}={value!r}.")
    if num_microbatches > batch_size:
        raise InputError(
            f"num_microbatches must not exceed batch_size: each micro-batch needs at least one sample. "
            f"Received: batch_size={batch_size}, num_microbatches={num_microbatches}. "
            "Lower num_microbatches or raise batch_size."
        )


def rescale_graph(graph: nx.DiGraph, batch_size: int, num_microbatches: int = 1) -> nx.DiGraph:
    """A copy of ``graph`` with costs per micro-batch of ceil(batch_size / num_microbatches) samples.

    Per-sample costs scale linearly with the samples: ``flops``, ``forward_flops``,
    ``activation_bytes``, ``model_input_bytes``, ``model_output_bytes``, ``output_bytes``, ``time_s`` and
    edge ``bytes`` are multiplied by new / measured samples per micro-batch; weights (``param_bytes``,
    ``trainable_param_bytes``) and ``accumulate_time_s`` stay. Where a node records ``fixed_time_s``
    (``profiles.profile_model(measure_fixed_time=True)``), only ``time_s - fixed_time_s`` scales and the
    fixed part stays: a micro-batch of one sample costs about what it cost when measured; where it records
    ``time_by_samples`` (``profile_model(time_samples=...)``), a size between two measured ones is read off
    the line through them (:func:`time_at`), so the sizes measured are priced as measured. Without either,
    measured times do not scale exactly (small batches use a device less well), so rescale them over
    small factors only.

    Args:
        graph: a layer graph that records the batch its costs were measured at (``micro_batch_size``,
            or ``batch_size`` and ``num_microbatches``, as ``profiles.profile_model`` writes them).
        batch_size: samples per step.
        num_microbatches: M; the costs become those of one of M micro-batches.

    Raises:
        GraphError: when the graph does not say what batch its costs were measured at.
        InputError: for batch_size or num_microbatches < 1, or more micro-batches than samples.

    Example:
        >>> g = chain_graph([4e9], activation_bytes=[4096])
        >>> g.graph.update(batch_size=32, num_microbatches=8)
        >>> rescale_graph(g, batch_size=64, num_microbatches=4).nodes["layer_0"]["activation_bytes"]
        16384
    """
    check_batch(batch_size, num_microbatches)
    validate_graph(graph)
    measured = micro_batch_size(graph)
    if measured is None:
        name = graph.graph.get("model_name", "the layer graph")
        raise GraphError(
            f"Cannot rescale {name} to batch_size={batch_size}: it does not record the batch size its costs were "
            "measured at (no micro_batch_size or batch_size). Profile the model again with 'partitioner profile', "
            "or set graph.graph['micro_batch_size'] to the samples its costs are for."
        )
    samples = math.ceil(batch_size / num_microbatches)
    factor = samples / measured
    scaled = graph.copy()
    for _, data in scaled.nodes(data=True):
        for key in ("flops", "forward_flops"):
            if data.get(key) is not None:
                data[key] = float(data[key]) * factor
        if data.get("time_s") is not None:
            timed = _timed_sizes(data, measured)
            data["time_s"] = time_at(data, measured, samples)
            if data.get("time_by_samples"):  # the time at the profile's own size stays one of the measured points
                data["time_by_samples"] = [[n, timed[n]] for n in sorted(timed) if n != samples]
        for key in ("activation_bytes", *_NODE_BYTES):
            if data.get(key) is not None:
                data[key] = round(data[key] * factor)
    for _, _, data in scaled.edges(data=True):
        data["bytes"] = round(data["bytes"] * factor)
    scaled.graph.update(batch_size=batch_size, num_microbatches=num_microbatches, micro_batch_size=samples)
    return scaled


def time_at(data: dict[str, Any], measured: int, samples: int) -> float:
    """A node's forward + backward seconds at ``samples`` per micro-batch, from its ``time_s`` at ``measured``.

    The measured points are (``measured``, ``time_s``), every (samples, seconds) of ``time_by_samples``,
    and (0, ``fixed_time_s``) (0 seconds at 0 samples where it is absent). The time at ``samples`` is read
    off the line through the two nearest measured points around it; beyond the largest, off the line
    through (0, ``fixed_time_s``) and the largest (the largest size's cost per sample: two noisy points
    close together could make a line that falls); it is at least ``fixed_time_s``. With ``time_s`` and
    ``fixed_time_s`` alone this is fixed + (time_s - fixed) x samples / measured; with ``time_s`` alone,
    time_s x samples / measured.

    Example:
        >>> data = {"time_s": 8.0, "fixed_time_s": 1.0, "time_by_samples": [[4, 4.0]]}
        >>> [time_at(data, 8, s) for s in (2, 4, 6, 8, 16)]
        [2.5, 4.0, 6.0, 8.0, 15.0]
    """
    fixed = float(data.get("fixed_time_s") or 0.0)
    points = {0: fixed, **_timed_sizes(data, measured)}
    sizes = sorted(points)
    if samples in points:
        return max(points[samples], fixed)
    above = next((i for i, n in enumerate(sizes) if n > samples), None)
    left, right = (sizes[above - 1], sizes[above]) if above is not None else (0, sizes[-1])
    slope = (points[right] - points[left]) / (right - left)
    return max(points[left] + slope * (samples - left), fixed)


def _timed_sizes(data: dict[str, Any], measured: int) -> dict[int, float]:
    """{samples: seconds} a node was timed at: ``time_by_samples`` and its ``time_s`` at ``measured``."""
    return {int(n): float(t) for n, t in data.get("time_by_samples") or ()} | {measured: float(data["time_s"])}


def _is_seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)


def _check_time_by_samples(node: str, value: Any) -> None:
    """``time_by_samples`` is absent or a list of [samples >= 1, seconds >= 0] pairs."""
    if value is None:
        return
    pairs = value if isinstance(value, (list, tuple)) else None
    if pairs is None or not all(
        isinstance(p, (list, tuple))
        and len(p) == 2
        and not isinstance(p[0], bool)
        and isinstance(p[0], int)
        and p[0] >= 1
        and _is_seconds(p[1])
        for p in pairs
    ):
        raise GraphError(
            f"Node '{node}' has time_by_samples={value!r}; expected a list of [samples, seconds] pairs "
            "(samples an integer >= 1, seconds >= 0), or no value. Profile the model again with profiles.profile_model."
        )


def topological_order(graph: nx.DiGraph) -> list[str]:
    """Returns the nodes in a deterministic topological order that keeps insertion order where it can."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    return list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))


def structure(graph: nx.DiGraph) -> tuple[str, ...]:
    """Per node, in topological order: its layer type, config digest and the positions of the nodes it
    reads, e.g. ``"Dense 3fa2c19b77d0 <- 0"``; the same for the same architecture built again under other
    names. Empty where a node has no ``config_digest`` (a graph from before digests, a synthetic one).

    Example:
        >>> structure(graph)[:2]                                     # doctest: +SKIP
        ('InputLayer 5d1e8a03b2c4 <- ', 'Dense 3fa2c19b77d0 <- 0')
    """
    order = topological_order(graph)
    if any("config_digest" not in graph.nodes[v] for v in order):
        return ()
    position = {v: i for i, v in enumerate(order)}
    return tuple(
        f"{graph.nodes[v].get('layer_type', '')} {graph.nodes[v]['config_digest']} <- "
        + ",".join(str(i) for i in sorted(position[u] for u in graph.predecessors(v)))
        for v in order
    )


def is_chain(graph: nx.DiGraph) -> bool:
    """True iff the graph is a single path: every node has at most one predecessor and one successor."""
    if not nx.is_weakly_connected(graph):
        return False
    return all(graph.in_degree(n) <= 1 and graph.out_degree(n) <= 1 for n in graph.nodes)


def colocation_groups(graph: nx.DiGraph) -> dict[str, list[str]]:
    """Returns {group: nodes} for every colocation group with at least two nodes."""
    groups: dict[str, list[str]] = {}
    for node, group in graph.nodes(data="colocation_group"):
        if group is not None:
            groups.setdefault(str(group), []).append(node)
    return {g: nodes for g, nodes in groups.items() if len(nodes) > 1}


def graph_to_dict(graph: nx.DiGraph) -> dict[str, Any]:
    """Returns the JSON-ready form of a layer graph, with its schema version."""
    validate_graph(graph)
    return {
        "schema_version": GRAPH_SCHEMA_VERSION,
        "kind": _KIND,
        **{key: graph.graph[key] for key in _GRAPH_KEYS if graph.graph.get(key) is not None},
        "nodes": [{"name": node, **data} for node, data in graph.nodes(data=True)],
        "edges": [{"source": u, "target": v, **data} for u, v, data in graph.edges(data=True)],
    }


def graph_from_dict(data: Any, *, source: str = "layer graph") -> nx.DiGraph:
    """Rebuilds a layer graph from :func:`graph_to_dict` output.

    Raises:
        GraphError: for a corrupt document or one written by a newer version of this project.
    """
    if not isinstance(data, dict) or data.get("kind") != _KIND:
        raise GraphError(f"{source} is not a layer graph (expected an object with kind='{_KIND}').")
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise GraphError(f"{source} has no valid schema_version (got {version!r}); the file is corrupt.")
    if version > GRAPH_SCHEMA_VERSION:
        raise GraphError(
            f"{source} has schema_version {version}, newer than the {GRAPH_SCHEMA_VERSION} this version "
            "reads. Upgrade keras-partitioner or profile the model again."
        )
    graph = nx.DiGraph(**{key: data[key] for key in _GRAPH_KEYS if key in data})
    try:
        for node in data["nodes"]:
            attrs = dict(node)
            graph.add_node(attrs.pop("name"), **attrs)
        for edge in data["edges"]:
            attrs = dict(edge)
            u, v = attrs.pop("source"), attrs.pop("target")
            if u not in graph or v not in graph:
                raise GraphError(f"{source}: edge '{u}' -> '{v}' names a node that is not in the graph.")
            graph.add_edge(u, v, **attrs)
    except GraphError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise GraphError(f"{source} is corrupt: missing or malformed field {err}.") from err
    validate_graph(graph)
    return graph


def save_graph(graph: nx.DiGraph, path: str | Path) -> None:
    """Writes a layer graph to a JSON file."""
    Path(path).write_text(json.dumps(graph_to_dict(graph), indent=1))


def load_graph(path: str | Path) -> nx.DiGraph:
    """Reads a layer graph written by :func:`save_graph` (or ``partitioner profile --out``).

    Raises:
        GraphError: when the file is missing, not JSON, corrupt, or from a newer version.
    """
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise GraphError(f"Cannot read layer graph '{path}': {err.strerror}.") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise GraphError(f"'{path}' is not valid JSON ({err.msg} at line {err.lineno}).") from err
    return graph_from_dict(data, source=f"'{path}'")


def chain_graph(
    flops: Iterable[float],
    *,
    param_bytes: Iterable[int] | None = None,
    activation_bytes: Iterable[int] | None = None,
    edge_bytes: Iterable[int] | None = None,
    prefix: str = "layer",
) -> nx.DiGraph:
    """Builds a chain layer graph from per-layer numbers; handy for tests, examples and benchmarks.

    Example:
        >>> g = chain_graph([1e9, 2e9, 1e9], edge_bytes=[4096, 4096])
        >>> list(g.edges)
        [('layer_0', 'layer_1'), ('layer_1', 'layer_2')]
    """
    flops = list(flops)
    params = list(param_bytes) if param_bytes is not None else [0] * len(flops)
    acts = list(activation_bytes) if activation_bytes is not None else [0] * len(flops)
    sends = list(edge_bytes) if edge_bytes is not None else [0] * max(len(flops) - 1, 0)
    if not (len(params) == len(acts) == len(flops)) or len(sends) != max(len(flops) - 1, 0):
        raise GraphError("chain_graph needs one flops/param/activation value per layer and one edge fewer.")
    graph = nx.DiGraph()
    names = [f"{prefix}_{i}" for i in range(len(flops))]
    for name, f, p, a in zip(names, flops, params, acts, strict=False):
        graph.add_node(name, flops=float(f), param_bytes=int(p), activation_bytes=int(a), layer_type="Dense")
    for (u, v), b in zip(itertools.pairwise(names), sends, strict=False):
        graph.add_edge(u, v, bytes=int(b))
    return graph
