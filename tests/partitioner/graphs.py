"""Small layer graphs shared by the planner's tests: chains, a diamond, a shared layer, random DAGs.

Built with networkx directly (not with ``partitioner.chain_graph``) so the tests do not trust the code
they check. Every graph obeys the layer-graph contract of partitioner/graph.py: string node names,
``flops`` (float), ``param_bytes`` and ``activation_bytes`` (int) on nodes, ``bytes`` (int) on edges.
Random graphs take a ``random.Random`` so a test (or hypothesis) picks the seed; ``chain_problems``
and ``dag_problems`` are hypothesis strategies for a graph, a cluster and a number of micro-batches.

Memory figures are whole KiB (weights, activations and device capacities) because the CP-SAT model
counts memory in KiB, rounded up per node: with whole KiB it is exact, so the solver, the exact DP
and brute force all see the same feasible set.
"""

from __future__ import annotations

import itertools
import random
import statistics

import networkx as nx
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.graph import colocation_groups

KIB = 1024
SPEEDS = (1e12, 2e12, 4e12)  # FLOP/s: heterogeneous clusters differ by at most 4x
BANDWIDTHS = (1e9, 1e10, 1e11)  # bytes/s: a network, PCIe, NVLink


def add_layer(
    graph: nx.DiGraph,
    name: str,
    *,
    flops: float = 1e9,
    param_bytes: int = 0,
    activation_bytes: int = 0,
    **attrs: object,
) -> None:
    """Adds one node with the required attributes (and any optional ones, e.g. time_s)."""
    graph.add_node(
        name,
        flops=float(flops),
        param_bytes=int(param_bytes),
        activation_bytes=int(activation_bytes),
        layer_type="Dense",
        **attrs,
    )


def chain(
    flops: list[float],
    *,
    param_bytes: list[int] | None = None,
    activation_bytes: list[int] | None = None,
    edge_bytes: list[int] | None = None,
) -> nx.DiGraph:
    """A chain l0 -> l1 -> ... with the given per-layer numbers (zeros where not given)."""
    n = len(flops)
    params = param_bytes if param_bytes is not None else [0] * n
    acts = activation_bytes if activation_bytes is not None else [0] * n
    sends = edge_bytes if edge_bytes is not None else [0] * (n - 1)
    graph = nx.DiGraph()
    for i in range(n):
        add_layer(graph, f"l{i}", flops=flops[i], param_bytes=params[i], activation_bytes=acts[i])
    for i in range(n - 1):
        graph.add_edge(f"l{i}", f"l{i + 1}", bytes=int(sends[i]))
    return graph


def random_chain(rng: random.Random, num_nodes: int, *, max_param_kib: int = 64) -> nx.DiGraph:
    """A chain with random compute, weights (whole KiB), activations (whole KiB) and edge bytes."""
    return chain(
        [rng.randint(1, 100) * 1e9 for _ in range(num_nodes)],
        param_bytes=[rng.randint(0, max_param_kib) * KIB for _ in range(num_nodes)],
        activation_bytes=[rng.randint(0, 8) * KIB for _ in range(num_nodes)],
        edge_bytes=[rng.randint(0, 10**7) for _ in range(num_nodes - 1)],
    )


def diamond(*, edge_bytes: int = 1000) -> nx.DiGraph:
    """a -> b, a -> c, b -> d, c -> d: one tensor (a's output) with two consumers."""
    graph = nx.DiGraph()
    for name in "abcd":
        add_layer(graph, name, flops=1e9, param_bytes=KIB, activation_bytes=KIB)
    for u, v in (("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")):
        graph.add_edge(u, v, bytes=edge_bytes)
    return graph


def shared_layer_graph() -> nx.DiGraph:
    """A layer called twice (two nodes in colocation group 'dense'), with work between the calls::

    input -> dense_call0 -> mid_0 -> mid_1 -> dense_call1 -> head
    """
    graph = nx.DiGraph()
    names = ["input", "dense_call0", "mid_0", "mid_1", "dense_call1", "head"]
    for name in names:
        group = {"colocation_group": "dense"} if name.startswith("dense") else {}
        add_layer(graph, name, flops=4e9, param_bytes=KIB, activation_bytes=KIB, **group)
    for u, v in itertools.pairwise(names):
        graph.add_edge(u, v, bytes=1000)
    return graph


def random_dag(
    rng: random.Random,
    num_nodes: int,
    *,
    skip_prob: float = 0.3,
    num_shared: int = 0,
    max_param_kib: int = 64,
    shuffle: bool = True,
) -> nx.DiGraph:
    """A random connected DAG with skip edges, like a ResNet or Inception layer graph.

    Node i (in a hidden topological order) reads from node i - 1 or, sometimes, from an earlier
    node, and has extra skip edges from earlier nodes with probability ``skip_prob`` each (at most
    three). Every out-edge of a node carries the same tensor size, as in Keras. ``num_shared`` pairs
    of nodes get a colocation group each. With ``shuffle`` the nodes are inserted in a random order
    and named so that names and insertion order do not reveal the topological order.
    """
    perm = list(range(num_nodes))
    if shuffle:
        rng.shuffle(perm)
    names = [f"v{perm[i]}" for i in range(num_nodes)]
    out_bytes = [rng.choice([0, rng.randint(1, 10**7)]) for _ in range(num_nodes)]
    edges: set[tuple[int, int]] = set()
    for i in range(1, num_nodes):
        edges.add((i - 1 if rng.random() < 0.8 else rng.randrange(i), i))
        for _ in range(3):
            if i >= 2 and rng.random() < skip_prob:
                edges.add((rng.randrange(i - 1), i))
    graph = nx.DiGraph()
    insertion = list(range(num_nodes))
    if shuffle:
        rng.shuffle(insertion)
    for i in insertion:
        add_layer(
            graph,
            names[i],
            flops=rng.randint(1, 100) * 1e9,
            param_bytes=rng.randint(0, max_param_kib) * KIB,
            activation_bytes=rng.randint(0, 8) * KIB,
        )
    for u, v in sorted(edges):
        graph.add_edge(names[u], names[v], bytes=out_bytes[u])
    for group in range(min(num_shared, num_nodes // 2)):
        first, second = rng.sample(range(num_nodes), 2)
        if "colocation_group" in graph.nodes[names[first]] or "colocation_group" in graph.nodes[names[second]]:
            continue
        graph.nodes[names[first]]["colocation_group"] = f"shared_{group}"
        graph.nodes[names[second]]["colocation_group"] = f"shared_{group}"
    return graph


def memory_need(graph: nx.DiGraph, num_microbatches: int, optimizer_slots: int = 2, num_devices: int = 1) -> int:
    """Bytes the whole graph needs on one device under the cost model (weights, gradients and their sums,
    slots, activations of M micro-batches in flight, the step's own terms): ``CostModel.node_memory_bytes``;
    for ``num_devices`` stages, also a typical cut's tensor (the median of the nodes' outputs sent on) for
    each stage after the first: a copy of it for each of the M micro-batches a GPipe sender holds, and with
    M > 1 its gradient, which the receiver's backward makes (``CostModel.input_memory_bytes``)."""
    costs = pt.CostModel(
        graph,
        pt.Cluster.uniform(1, memory="1TiB"),
        num_microbatches=num_microbatches,
        optimizer_slots=optimizer_slots,
    )
    need = sum(costs.node_memory_bytes("kept", num_microbatches).values())
    sent = [costs.out_bytes[v] for v in costs.order if graph.out_degree(v) > 0]
    if sent and num_devices > 1:
        need += (num_devices - 1) * (num_microbatches + costs.looped) * int(statistics.median(sent))
    return need


def draw_cluster(draw: st.DrawFn, num_devices: int, need_bytes: int, headroom: float = 3.0) -> pt.Cluster:
    """A random cluster: speeds from SPEEDS, one link speed or a random matrix, and memory (whole KiB)
    such that the devices together hold between 0.6 and ``headroom`` times ``need_bytes``: some
    problems do not fit.
    """
    devices = [
        pt.Device(
            f"/GPU:{i}",
            memory=max(1, round(draw(st.floats(0.6, headroom)) * need_bytes / num_devices / KIB)) * KIB,
            flops_per_s=draw(st.sampled_from(SPEEDS)),
        )
        for i in range(num_devices)
    ]
    if draw(st.booleans()):
        bandwidth: object = draw(st.sampled_from(BANDWIDTHS))
    else:
        bandwidth = [[draw(st.sampled_from(BANDWIDTHS)) for _ in range(num_devices)] for _ in range(num_devices)]
    return pt.Cluster(devices, bandwidth=bandwidth)


@st.composite
def chain_problems(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 10, max_devices: int = 3):
    """(chain graph, cluster, num_microbatches) with at most as many devices as layers."""
    k = draw(st.integers(1, max_devices))
    n = draw(st.integers(max(min_nodes, k), max(max_nodes, k)))
    graph = chain(
        [draw(st.integers(1, 100)) * 1e9 for _ in range(n)],
        param_bytes=[draw(st.integers(0, 16)) * KIB for _ in range(n)],
        activation_bytes=[draw(st.integers(0, 4)) * KIB for _ in range(n)],
        edge_bytes=[draw(st.integers(0, 10**7)) for _ in range(n - 1)],
    )
    num_microbatches = draw(st.integers(1, 4))
    return graph, draw_cluster(draw, k, memory_need(graph, num_microbatches, num_devices=k)), num_microbatches


@st.composite
def dag_problems(draw: st.DrawFn, max_nodes: int = 25, max_devices: int = 4, max_shared: int = 2):
    """(random DAG with skip edges and maybe shared layers, cluster, num_microbatches)."""
    k = draw(st.integers(1, max_devices))
    n = draw(st.integers(max(2, k), max(max_nodes, k)))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    graph = random_dag(
        rng, n, skip_prob=draw(st.sampled_from([0.0, 0.2, 0.5])), num_shared=draw(st.integers(0, max_shared))
    )
    num_microbatches = draw(st.integers(1, 4))
    # Shared layers pull whole stretches of the graph onto one device: give DAGs more room.
    cluster = draw_cluster(draw, k, memory_need(graph, num_microbatches, num_devices=k), headroom=5.0)
    return graph, cluster, num_microbatches


def brute_force(graph: nx.DiGraph, cluster: pt.Cluster, **kwargs: object) -> float | None:
    """The smallest bottleneck over every legal placement (forward edges, shared layers together, memory)."""
    costs = CostModel(graph, cluster, **kwargs)
    groups = list(colocation_groups(graph).values())
    best = None
    for labels in itertools.product(range(cluster.num_devices), repeat=len(costs.order)):
        where = dict(zip(costs.order, labels, strict=True))
        if any(where[u] > where[v] for u, v in graph.edges):
            continue
        if any(len({where[v] for v in nodes}) > 1 for nodes in groups):
            continue
        ev = costs.evaluate({v: cluster.names[k] for v, k in where.items()})
        if costs.fits(ev) and (best is None or ev.bottleneck_s < best):
            best = ev.bottleneck_s
    return best


def legal_baselines(
    graph: nx.DiGraph, cluster: pt.Cluster, pins: dict[str, str] | None = None, **kwargs: object
) -> list[pt.Plan]:
    """The baselines' plans that fit, keep the pins and keep every shared layer's calls on one device."""
    groups = colocation_groups(graph).values()
    return [
        p
        for p in (b(graph, cluster, **kwargs) for b in pt.baselines.BASELINES.values())
        if p.fits_memory
        and all(p.assignment[v] == d for v, d in (pins or {}).items())
        and all(len({p.assignment[v] for v in g}) == 1 for g in groups)
    ]
