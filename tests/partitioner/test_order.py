"""Device order as a planner decision: classes of interchangeable devices, candidate orders, and the
chain DP's search over orders and subsets held to brute force."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from graphs import KIB, chain, diamond, draw_cluster, memory_need
from hypothesis import event, given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cluster import reorder
from partitioner.cost import CostModel
from partitioner.errors import ClusterError, InputError
from partitioner.search.order import (
    by_speed,
    candidate_orders,
    device_classes,
    every_order_searched,
    fastest_on_heaviest,
)


def one_fast_three_slow(fast_first: bool) -> pt.Cluster:
    """The issue's example: 1 fast device (200 TFLOP/s, 2x memory) and 3 slow ones (50 TFLOP/s), uniform links."""
    fast = pt.Device("/GPU:fast", memory=64 * KIB, flops_per_s=200e12)
    slow = [pt.Device(f"/GPU:slow{i}", memory=32 * KIB, flops_per_s=50e12) for i in range(3)]
    return pt.Cluster([fast, *slow] if fast_first else [*slow, fast], bandwidth="10GB/s")


def two_nodes(per_node: int, fast: float = 400e12, slow: float = 100e12) -> pt.Cluster:
    """Two nodes of unequal GPUs: fast links inside a node, a slow network between them."""
    devices = [pt.Device(f"/GPU:{i}", memory="16GiB", flops_per_s=fast) for i in range(per_node)]
    devices += [pt.Device(f"/GPU:{per_node + i}", memory="16GiB", flops_per_s=slow) for i in range(per_node)]
    k = 2 * per_node
    bandwidth = [[300e9 if i // per_node == j // per_node else 10e9 for j in range(k)] for i in range(k)]
    return pt.Cluster(devices, bandwidth=bandwidth, name="2 unequal nodes")


def crossings(cluster: pt.Cluster, order: tuple[int, ...], per_node: int) -> int:
    """How many times the chain ``order`` goes from one node to the other."""
    return sum(a // per_node != b // per_node for a, b in itertools.pairwise(order))


# ----- classes and candidate orders ------------------------------------------------------------------


def test_device_classes_group_interchangeable_devices():
    assert device_classes(one_fast_three_slow(True)) == ((0,), (1, 2, 3))
    assert device_classes(pt.Cluster.uniform(4, memory="1GiB")) == ((0, 1, 2, 3),)
    assert device_classes(pt.Cluster.from_json("2x8xH100-ib")) == (tuple(range(8)), tuple(range(8, 16)))
    # Equal speed and memory but unequal links to a third device: not interchangeable.
    bandwidth = [[0, 1e9, 1e9], [1e9, 0, 5e9], [1e9, 5e9, 0]]
    assert device_classes(pt.Cluster.uniform(3, memory="1GiB", bandwidth=bandwidth)) == ((0,), (1, 2))


def test_candidate_orders_put_the_fast_device_anywhere():
    orders = candidate_orders(one_fast_three_slow(True))
    assert orders == [(0, 1, 2, 3), (1, 0, 2, 3), (1, 2, 0, 3), (1, 2, 3, 0)]
    assert every_order_searched(one_fast_three_slow(True))


def test_candidate_orders_cross_between_nodes_once():
    cluster = two_nodes(8)
    orders = candidate_orders(cluster)
    assert not every_order_searched(cluster)  # C(16, 8) arrangements: the classes go in contiguous runs
    assert orders[0] == tuple(range(16))  # the cluster's own order first
    assert sorted(orders) == [tuple(range(16)), tuple(range(8, 16)) + tuple(range(8))]
    assert all(crossings(cluster, order, 8) == 1 for order in orders)


def test_candidate_orders_of_alike_nodes_are_one():
    assert candidate_orders(pt.Cluster.from_json("2x8xH100-ib")) == [tuple(range(16))]
    assert candidate_orders(pt.Cluster.uniform(3, memory="1GiB")) == [(0, 1, 2)]


def test_candidate_orders_rejects_a_bad_limit():
    with pytest.raises(InputError, match="max_orders must be an integer >= 1"):
        candidate_orders(pt.Cluster.uniform(2, memory="1GiB"), max_orders=0)


def test_by_speed_and_fastest_on_heaviest():
    cluster = one_fast_three_slow(False)  # slow0, slow1, slow2, fast
    assert by_speed(cluster) == (3, 0, 1, 2)
    # Stage 1 has the most work: it gets the fast device; the others keep the slow ones in order.
    assert fastest_on_heaviest(cluster, [1.0, 5.0, 2.0]) == (1, 3, 0, 2)
    with pytest.raises(InputError, match="5 stages for 4 devices"):
        fastest_on_heaviest(cluster, [1.0] * 5)


def test_reorder_keeps_every_link():
    cluster = two_nodes(2)
    permuted = reorder(cluster, [3, 2, 1, 0])
    assert permuted.names == ["/GPU:3", "/GPU:2", "/GPU:1", "/GPU:0"]
    for a, b in itertools.permutations(range(4), 2):
        assert permuted.bandwidth(a, b) == cluster.bandwidth(3 - a, 3 - b)
    assert reorder(cluster, permuted.names).names == permuted.names
    with pytest.raises(ClusterError, match="must list each of the cluster's 4 devices once"):
        reorder(cluster, [0, 0, 1, 2])


# ----- the chain DP's search against brute force -----------------------------------------------------


def brute_force_orders(graph, cluster, num_microbatches):
    """(least bottleneck, shortest step) over every injective placement of contiguous blocks.

    Every device order (permutation) and every non-decreasing sequence of positions in it (devices
    may stay idle) is scored with the cost model: the least bottleneck. The shortest step is the
    least simulated step of the given-order DP (least bottleneck, then fewest bytes) on every prefix
    of every permutation: the plans the search chooses among, found without the search.
    """
    least = None
    shortest = None
    for perm in itertools.permutations(range(cluster.num_devices)):
        permuted = reorder(cluster, perm)
        costs = CostModel(graph, permuted, num_microbatches=num_microbatches)
        for labels in itertools.combinations_with_replacement(range(cluster.num_devices), len(costs.order)):
            ev = costs.evaluate({v: permuted.names[k] for v, k in zip(costs.order, labels, strict=True)})
            if costs.fits(ev) and (least is None or ev.bottleneck_s < least):
                least = ev.bottleneck_s
        for size in range(1, cluster.num_devices + 1):
            try:
                plan = pt.exact_chain(
                    graph, permuted.take(size), num_microbatches=num_microbatches, device_order="given"
                )
            except pt.InfeasiblePlanError:
                continue
            if shortest is None or plan.step_time_s < shortest:
                shortest = plan.step_time_s
    return least, shortest


@st.composite
def heterogeneous_chains(draw: st.DrawFn):
    """(chain, cluster of 2-4 devices of at most two kinds, M): small enough to try every order."""
    k = draw(st.integers(2, 4))
    n = draw(st.integers(k, 7))
    graph = chain(
        [draw(st.integers(1, 100)) * 1e9 for _ in range(n)],
        param_bytes=[draw(st.integers(0, 16)) * KIB for _ in range(n)],
        activation_bytes=[draw(st.integers(0, 4)) * KIB for _ in range(n)],
        edge_bytes=[draw(st.integers(0, 10**7)) for _ in range(n - 1)],
    )
    num_microbatches = draw(st.integers(1, 8))
    cluster = draw_cluster(draw, k, memory_need(graph, num_microbatches, num_devices=k))
    if draw(st.booleans()):  # two kinds of device: the classes the search enumerates
        kinds = [draw(st.sampled_from(cluster.devices)) for _ in range(2)]
        devices = [dataclasses.replace(draw(st.sampled_from(kinds)), name=f"/GPU:{i}") for i in range(k)]
        cluster = pt.Cluster(devices, bandwidth=draw(st.sampled_from([1e9, 1e11])))
    return graph, cluster, num_microbatches


@settings(max_examples=60, deadline=None)
@given(problem=heterogeneous_chains())
def test_exact_chain_search_equals_brute_force_over_orders(problem):
    graph, cluster, num_microbatches = problem
    least, shortest = brute_force_orders(graph, cluster, num_microbatches)
    if least is None:
        event("infeasible")
        with pytest.raises(pt.InfeasiblePlanError):
            pt.exact_chain(graph, cluster, num_microbatches=num_microbatches)
        return
    plan = pt.exact_chain(graph, cluster, num_microbatches=num_microbatches)
    event(f"{len(candidate_orders(cluster))} orders, {plan.num_stages} of {cluster.num_devices} devices used")
    assert plan.step_time_s == pytest.approx(shortest, rel=1e-9)
    if every_order_searched(cluster):
        assert plan.lower_bound_s == pytest.approx(min(least, plan.bottleneck_s), rel=1e-9)
        assert least <= plan.bottleneck_s * (1 + 1e-9)
    assert sorted(plan.devices) == sorted(cluster.names)
    assert plan.fits_memory
    pt.validate_plan(plan, graph, cluster)  # the user's cluster, listed in its own order


def test_fast_device_first_or_last_gives_the_same_plan():
    """The issue's example: the order the user lists the devices in no longer decides the plan."""
    # Light layers, then a heavy tail with large weights: the fast device (twice the memory) takes the tail.
    graph = chain(
        [1e12] * 8 + [12e12, 12e12],
        param_bytes=[KIB] * 8 + [4 * KIB, 4 * KIB],
        activation_bytes=[KIB] * 10,
        edge_bytes=[1000] * 9,  # a stage makes the gradient of what it receives: small beside the layers
    )
    given = {
        fast_first: pt.exact_chain(graph, one_fast_three_slow(fast_first), num_microbatches=4, device_order="given")
        for fast_first in (True, False)
    }
    assert given[True].step_time_s > 1.2 * given[False].step_time_s  # listed first, the fast device is wasted
    searched = [
        pt.exact_chain(graph, one_fast_three_slow(fast_first), num_microbatches=4) for fast_first in (True, False)
    ]
    for plan in searched:
        assert plan.step_time_s == pytest.approx(min(p.step_time_s for p in given.values()), rel=1e-12)
        assert plan.stages[-1] == "/GPU:fast"
        assert plan.status == "optimal"
    assert searched[0].assignment == searched[1].assignment
    assert searched[0].stages == searched[1].stages  # the idle device may be listed elsewhere
    # solve (chains go to the DP) searches too, and "given" keeps the listed order.
    assert pt.solve(graph, one_fast_three_slow(True), num_microbatches=4).step_time_s == searched[0].step_time_s
    kept = pt.solve(
        graph,
        one_fast_three_slow(True),
        num_microbatches=4,
        options=pt.SolverOptions(device_order="given"),
    )
    assert kept.devices == tuple(one_fast_three_slow(True).names)
    assert kept.step_time_s == pytest.approx(given[True].step_time_s, rel=1e-9)


def test_more_devices_never_give_a_longer_step():
    """16 GPUs on two unequal nodes against each node alone (the 8-device subsets the search considers)."""
    graph = chain(
        [float(1e12 * (1 + i % 5)) for i in range(40)],
        param_bytes=[64 * KIB] * 40,
        activation_bytes=[16 * KIB] * 40,
        edge_bytes=[4 * 10**6] * 39,
    )
    cluster = two_nodes(8)
    for num_microbatches in (1, 4, 32):
        whole = pt.exact_chain(graph, cluster, num_microbatches=num_microbatches)
        for node in (range(8), range(8, 16)):
            alone = reorder(cluster, [*node, *(k for k in range(16) if k not in node)]).take(8)
            subset = pt.exact_chain(graph, alone, num_microbatches=num_microbatches)
            assert whole.step_time_s <= subset.step_time_s * (1 + 1e-12)
        # The pipeline crosses the network at most once.
        used = [cluster.index(d) for d in whole.stages]
        assert crossings(cluster, tuple(used), 8) <= 1
        pt.validate_plan(whole, graph, cluster)
    assert pt.exact_chain(graph, cluster, num_microbatches=1).num_stages == 1  # M = 1: nothing overlaps


def test_device_order_is_checked():
    graph = chain([1e9, 1e9])
    cluster = pt.Cluster.uniform(2, memory="1GiB")
    with pytest.raises(InputError, match="device_order must be one of"):
        pt.exact_chain(graph, cluster, device_order="fastest")
    with pytest.raises(InputError, match="device_order must be one of"):
        pt.solve(graph, cluster, options=pt.SolverOptions(device_order="fastest"))


# ----- CP-SAT: candidate orders and repeatable runs --------------------------------------------------


def test_solve_searches_orders_for_a_dag():
    graph = diamond(edge_bytes=10**6)
    for v in graph.nodes:
        graph.nodes[v]["flops"] = 4e12 if v == "d" else 1e12
    cluster = one_fast_three_slow(True)
    options = pt.SolverOptions(exact_chains=False)
    given = pt.solve(graph, cluster, num_microbatches=4, options=dataclasses.replace(options, device_order="given"))
    searched = pt.solve(graph, cluster, num_microbatches=4, options=options)
    assert given.devices == tuple(cluster.names)
    assert searched.step_time_s <= given.step_time_s * (1 + 1e-9)
    assert searched.assignment["d"] == "/GPU:fast"
    pt.validate_plan(searched, graph, cluster)
    simulated = pt.simulate(searched, graph, cluster)  # the user's cluster, listed in its own order
    assert simulated.step_time_s == pytest.approx(searched.step_time_s)


def test_solve_gives_the_same_plan_twice():
    graph = chain([float(1e12 * (1 + i % 3)) for i in range(30)], edge_bytes=[10**6] * 29)
    graph.add_edge("l3", "l9", bytes=10**6)  # a skip connection: CP-SAT, not the chain DP
    cluster = two_nodes(2)
    plans = [
        dataclasses.replace(pt.solve(graph, cluster, num_microbatches=8, time_limit_s=5), solve_time_s=0.0)
        for _ in range(2)
    ]
    assert plans[0] == plans[1]
    pt.validate_plan(plans[0], graph, cluster)


def test_candidate_orders_of_many_classes_stay_few():
    # 12 devices, each its own class (all speeds differ): the runs as listed and fastest first, no more.
    devices = [pt.Device(f"/GPU:{i}", memory="1GiB", flops_per_s=(i + 1) * 1e12) for i in range(12)]
    cluster = pt.Cluster(devices)
    assert len(device_classes(cluster)) == 12
    assert candidate_orders(cluster) == [tuple(range(12)), tuple(range(11, -1, -1))]
    assert not every_order_searched(cluster)


VGG16 = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_quality" / "graphs" / "VGG16-b32-m8.json"


@pytest.mark.parametrize("name", ["2xT4+2xA100", "4xT4+4xV100", "2x4xV100+A100-ib"])
def test_search_on_a_bundled_mixed_cluster_does_not_depend_on_the_listed_order(name):
    graph = pt.load_graph(VGG16)  # a chain: the exact DP plans it in well under a second
    cluster = pt.Cluster.from_json(name)  # slow devices listed first
    searched = pt.solve(graph, cluster, num_microbatches=8)
    given = pt.solve(graph, cluster, num_microbatches=8, options=pt.SolverOptions(device_order="given"))
    pt.validate_plan(searched, graph, cluster)
    assert searched.step_time_s <= given.step_time_s * (1 + 1e-9)
    fast_first = pt.solve(graph, reorder(cluster, by_speed(cluster)), num_microbatches=8)
    reversed_ = pt.solve(graph, reorder(cluster, list(range(cluster.num_devices))[::-1]), num_microbatches=8)
    assert fast_first.step_time_s == pytest.approx(searched.step_time_s, rel=1e-9)
    assert reversed_.step_time_s == pytest.approx(searched.step_time_s, rel=1e-9)
    speeds = {d.name: d.flops_per_s_for("float32") for d in cluster.devices}
    heaviest = max(searched.stages, key=lambda d: sum(graph.nodes[v]["flops"] for v in searched.nodes_on(d)))
    assert speeds[heaviest] == max(speeds.values())  # the most work runs on a fastest device
