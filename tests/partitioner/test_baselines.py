"""The baselines users have today: uniform layer counts, balanced parameters, balanced time."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from graphs import KIB, chain, random_dag, shared_layer_graph
from hypothesis import given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.errors import InputError
from partitioner.graph import colocation_groups
from partitioner.search.baselines import split_balanced, split_even


def _cluster(num_devices: int) -> pt.Cluster:
    return pt.Cluster.uniform(num_devices, memory="1GiB", flops_per_s=1e12, bandwidth="10GB/s")


def _layers_per_device(plan: pt.Plan) -> list[int]:
    counts = Counter(plan.assignment.values())
    return [counts[d] for d in plan.devices]


def _brute_force_max_block(weights: list[int], num_parts: int) -> int:
    """The smallest largest-block sum over every cut of ``weights`` into at most ``num_parts`` blocks."""
    n = len(weights)
    best = sum(weights)
    for num_cuts in range(min(num_parts, n)):
        for cuts in itertools.combinations(range(1, n), num_cuts):
            bounds = [0, *cuts, n]
            best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


# ----- split_balanced ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "num_parts", "labels"),
    [
        ([1, 1, 1, 3], 2, [0, 0, 0, 1]),
        ([1, 2, 3, 4, 5], 3, [0, 0, 0, 1, 2]),
        ([5], 1, [0]),
        ([5, 5], 1, [0, 0]),
        ([9, 1, 1, 1], 2, [0, 1, 1, 1]),
        ([0, 0, 0], 5, [0, 1, 2]),  # more parts than items: one item each
        ([], 3, []),
    ],
)
def test_split_balanced_examples(weights, num_parts, labels):
    assert split_balanced(weights, num_parts) == labels


def test_split_balanced_zero_weights_still_use_every_part():
    labels = split_balanced([0.0] * 6, 3)
    assert sorted(set(labels)) == [0, 1, 2]
    assert labels == sorted(labels)


@settings(max_examples=150, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=9), num_parts=st.integers(1, 4))
def test_split_balanced_is_optimal_contiguous_and_uses_every_part(weights, num_parts):
    labels = split_balanced([float(w) for w in weights], num_parts)
    assert len(labels) == len(weights)
    assert labels[0] == 0
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(labels))  # contiguous blocks in order
    assert labels[-1] + 1 == min(num_parts, len(weights))
    sums = Counter()
    for w, b in zip(weights, labels, strict=True):
        sums[b] += w
    assert max(sums.values()) == _brute_force_max_block(weights, num_parts)


@pytest.mark.parametrize(
    ("num_items", "num_parts", "labels"),
    [(10, 4, [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]), (3, 3, [0, 1, 2]), (4, 1, [0, 0, 0, 0]), (7, 3, [0, 0, 0, 1, 1, 2, 2])],
)
def test_split_even_examples(num_items, num_parts, labels):
    assert split_even(num_items, num_parts) == labels


@given(num_items=st.integers(1, 60), num_parts=st.integers(1, 8))
def test_split_even_sizes_differ_by_at_most_one(num_items, num_parts):
    num_parts = min(num_parts, num_items)
    labels = split_even(num_items, num_parts)
    sizes = Counter(labels)
    assert labels == sorted(labels)
    assert sorted(sizes) == list(range(num_parts))
    assert max(sizes.values()) - min(sizes.values()) <= 1


# ----- the baselines -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_nodes", "num_devices", "counts"),
    [(6, 3, [2, 2, 2]), (8, 4, [2, 2, 2, 2]), (7, 3, [3, 2, 2]), (10, 4, [3, 3, 2, 2]), (5, 5, [1] * 5), (3, 1, [3])],
)
def test_uniform_splits_layer_counts_evenly(num_nodes, num_devices, counts):
    graph = chain([1e9 * (i + 1) for i in range(num_nodes)], param_bytes=[KIB * i for i in range(num_nodes)])
    plan = pt.baselines.uniform(graph, _cluster(num_devices))
    assert _layers_per_device(plan) == counts
    assert plan.method == "uniform"
    assert plan.status == "heuristic"


def test_by_params_balances_param_bytes():
    graph = chain([1e9] * 5, param_bytes=[600 * KIB, 100 * KIB, 100 * KIB, 100 * KIB, 100 * KIB])
    plan = pt.baselines.by_params(graph, _cluster(2))
    assert plan.assignment == {"l0": "/GPU:0", "l1": "/GPU:1", "l2": "/GPU:1", "l3": "/GPU:1", "l4": "/GPU:1"}
    assert plan.method == "by_params"
    # Weights, gradients and two Adam slots: 600 KiB * 4 against 400 KiB * 4.
    assert plan.memory_bytes == {"/GPU:0": 2400 * KIB, "/GPU:1": 1600 * KIB}
    assert _layers_per_device(pt.baselines.uniform(graph, _cluster(2))) == [3, 2]  # a different answer


def test_by_time_balances_compute():
    graph = chain([1e12, 1e12, 1e12, 1e12, 4e12], param_bytes=[0, 0, 0, 0, 0])
    plan = pt.baselines.by_time(graph, _cluster(2))
    assert plan.assignment == {"l0": "/GPU:0", "l1": "/GPU:0", "l2": "/GPU:0", "l3": "/GPU:0", "l4": "/GPU:1"}
    assert plan.compute_times == {"/GPU:0": 4.0, "/GPU:1": 4.0}
    assert plan.bottleneck_s == 4.0
    assert plan.method == "by_time"


def test_by_time_uses_measured_time_with_cost_time():
    graph = chain([1e9] * 4)
    for node, seconds in zip(graph.nodes, [3.0, 1.0, 1.0, 1.0], strict=True):
        graph.nodes[node]["time_s"] = seconds
    graph.graph["profiled_flops_per_s"] = 1e12
    plan = pt.baselines.by_time(graph, _cluster(2), cost="time")
    assert [plan.assignment[v] for v in graph.nodes] == ["/GPU:0", "/GPU:1", "/GPU:1", "/GPU:1"]
    assert plan.cost == "time"
    assert plan.bottleneck_s == 3.0


def test_baselines_ignore_memory_and_report_it():
    graph = chain([1e9] * 2, param_bytes=[1024 * KIB, 0])
    cluster = pt.Cluster.uniform(2, memory="1MiB")
    plan = pt.baselines.uniform(graph, cluster)
    assert not plan.fits_memory


@pytest.mark.parametrize("name", sorted(pt.baselines.BASELINES))
@pytest.mark.parametrize(("seed", "num_devices"), [(s, 2 + s % 3) for s in range(12)])
def test_baselines_never_send_backward_on_random_dags(name, seed, num_devices):
    graph = random_dag(random.Random(seed), 8 + seed * 3)
    cluster = _cluster(num_devices)
    plan = pt.baselines.BASELINES[name](graph, cluster, num_microbatches=2)
    position = {d: k for k, d in enumerate(cluster.names)}
    assert all(position[plan.assignment[u]] <= position[plan.assignment[v]] for u, v in graph.edges)
    assert set(plan.assignment) == set(graph.nodes)
    assert plan.num_stages == num_devices  # every device gets work
    pt.validate_plan(plan, graph, cluster)  # ample memory and no shared layers: a legal plan


@pytest.mark.parametrize("name", sorted(pt.baselines.BASELINES))
def test_baselines_keep_a_shared_layer_on_one_device(name):
    graph = shared_layer_graph()  # input -> dense_call0 -> mid_0 -> mid_1 -> dense_call1 -> head
    cluster = _cluster(3)
    plan = pt.baselines.BASELINES[name](graph, cluster)
    # No cut may fall between the two calls, so the calls and all between them form one block.
    assert plan.assignment == {
        "input": "/GPU:0",
        "dense_call0": "/GPU:1",
        "mid_0": "/GPU:1",
        "mid_1": "/GPU:1",
        "dense_call1": "/GPU:1",
        "head": "/GPU:2",
    }
    pt.validate_plan(plan, graph, cluster)


@pytest.mark.parametrize("name", sorted(pt.baselines.BASELINES))
@pytest.mark.parametrize("seed", range(6))
def test_baselines_keep_shared_layers_together_on_random_dags(name, seed):
    graph = random_dag(random.Random(seed), 20, num_shared=2)
    assert colocation_groups(graph)
    cluster = _cluster(3)
    plan = pt.baselines.BASELINES[name](graph, cluster)
    for nodes in colocation_groups(graph).values():
        assert len({plan.assignment[v] for v in nodes}) == 1
    pt.validate_plan(plan, graph, cluster)


@pytest.mark.parametrize("name", sorted(pt.baselines.BASELINES))
def test_baselines_more_devices_than_nodes(name):
    with pytest.raises(InputError, match=r"The cluster has 4 devices but the graph has only 3 nodes.*at most 3"):
        pt.baselines.BASELINES[name](chain([1e9] * 3), _cluster(4))


@pytest.mark.parametrize("name", sorted(pt.baselines.BASELINES))
def test_baselines_check_their_arguments(name):
    with pytest.raises(InputError, match=r"num_microbatches must be an integer >= 1"):
        pt.baselines.BASELINES[name](chain([1e9] * 3), _cluster(2), num_microbatches=0)
