"""Random layer graphs with realistic magnitudes, for benchmarks, property tests and examples."""

from __future__ import annotations

import random

import networkx as nx


def random_chain(num_nodes: int, *, seed: int = 0) -> nx.DiGraph:
    """A chain of ``num_nodes`` layers with 1-10 GFLOPs, 0.1-10 MB of weights and of activations each.

    Example:
        >>> random_chain(3).number_of_edges()
        2
    """
    return random_dag(num_nodes, seed=seed, skip_probability=0.0)


def random_dag(num_nodes: int, *, seed: int = 0, skip_probability: float = 0.15, max_skip: int = 6) -> nx.DiGraph:
    """A chain of layers plus random skip connections (like residual and inception blocks).

    Node i always feeds node i + 1; with ``skip_probability`` node i also reads the output of a node
    2 to ``max_skip`` places before it. Costs are drawn uniformly: flops 1e9-1e10, param_bytes and
    activation_bytes 1e5-1e7, edge bytes 1e5-1e7 (the same output size on every edge leaving a node).

    Example:
        >>> g = random_dag(50, seed=1)
        >>> nx.is_directed_acyclic_graph(g)
        True
    """
    rng = random.Random(seed)
    graph = nx.DiGraph(model_name=f"random_dag_{num_nodes}_{seed}")
    names = [f"n{i}" for i in range(num_nodes)]
    for name in names:
        graph.add_node(name, **_random_layer(rng))
    out_bytes = [rng.randint(10**5, 10**7) for _ in names]
    for i in range(1, num_nodes):
        graph.add_edge(names[i - 1], names[i], bytes=out_bytes[i - 1])
        if i >= 2 and rng.random() < skip_probability:
            j = rng.randint(max(0, i - max_skip), i - 2)
            graph.add_edge(names[j], names[i], bytes=out_bytes[j])
    return graph


def random_block_dag(num_nodes: int, *, seed: int = 0) -> nx.DiGraph:
    """A small CNN-like DAG of ``num_nodes`` layers built from blocks, with the costs of :func:`random_dag`.

    After a stem layer, blocks follow one another, each reading the previous block's output:

    - a plain layer;
    - a residual block, x -> a -> b with x -> b (the skip joins at b);
    - an inception block, x fanning out to 2 or 3 parallel branches of 1 or 2 layers that one
      concatenation layer joins.

    The parallel branches give the graph many topological orders, so a stage need not be a contiguous
    run of any one of them. Costs are drawn as in :func:`random_dag` (every edge leaving a node
    carries its output).

    Example:
        >>> g = random_block_dag(10, seed=3)
        >>> g.number_of_nodes(), nx.is_directed_acyclic_graph(g)
        (10, True)
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be at least 1. Received: {num_nodes}.")
    rng = random.Random(seed)
    graph = nx.DiGraph(model_name=f"random_block_dag_{num_nodes}_{seed}")
    out_bytes: dict[str, int] = {}

    def layer(*inputs: str) -> str:
        name = f"n{graph.number_of_nodes()}"
        graph.add_node(name, **_random_layer(rng))
        out_bytes[name] = rng.randint(10**5, 10**7)
        for u in inputs:
            graph.add_edge(u, name, bytes=out_bytes[u])
        return name

    tail = layer()
    while graph.number_of_nodes() < num_nodes:
        left = num_nodes - graph.number_of_nodes()
        kinds = ["plain"] + ["residual"] * (left >= 2) + ["inception"] * (left >= 3)
        kind = rng.choice(kinds)
        if kind == "plain":
            tail = layer(tail)
        elif kind == "residual":
            tail = layer(layer(tail), tail)
        else:
            num_branches = rng.randint(2, min(3, left - 1))
            lengths = [1] * num_branches
            for b in range(num_branches):  # lengthen branches while the join still fits
                if sum(lengths) + 1 < left and rng.random() < 0.5:
                    lengths[b] = 2
            ends = []
            for length in lengths:
                end = tail
                for _ in range(length):
                    end = layer(end)
                ends.append(end)
            tail = layer(*ends)
    return graph


def _random_layer(rng: random.Random) -> dict[str, object]:
    """A random Dense node's costs: 1-10 GFLOP, 0.1-10 MB of weights and of activations."""
    return {
        "flops": rng.uniform(1e9, 1e10),
        "param_bytes": rng.randint(10**5, 10**7),
        "activation_bytes": rng.randint(10**5, 10**7),
        "layer_type": "Dense",
    }
