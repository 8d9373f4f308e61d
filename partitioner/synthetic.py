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
        graph.add_node(
            name,
            flops=rng.uniform(1e9, 1e10),
            param_bytes=rng.randint(10**5, 10**7),
            activation_bytes=rng.randint(10**5, 10**7),
            layer_type="Dense",
        )
    out_bytes = [rng.randint(10**5, 10**7) for _ in names]
    for i in range(1, num_nodes):
        graph.add_edge(names[i - 1], names[i], bytes=out_bytes[i - 1])
        if i >= 2 and rng.random() < skip_probability:
            j = rng.randint(max(0, i - max_skip), i - 2)
            graph.add_edge(names[j], names[i], bytes=out_bytes[j])
    return graph
