"""The exact chain DP of the least bottleneck (objective="bottleneck") against brute force, and on hand-made cases.

tests/partitioner/test_exact_step.py holds the default objective, the step, to brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from graphs import KIB, chain, chain_problems, diamond, shared_layer_graph
from hypothesis import event, given, settings

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.errors import InfeasiblePlanError, InputError

G0, G1, G2 = "/GPU:0", "/GPU:1", "/GPU:2"


def brute_force_chain(graph, cluster, **kwargs) -> tuple[float, int] | None:
    """(min bottleneck, min bytes sent at that bottleneck) over every split that fits, or None.

    Every contiguous split of a chain onto devices in pipeline order is a non-decreasing sequence
    of device indices (devices may stay empty); each is scored by the shared cost model.
    """
    costs = CostModel(graph, cluster, **kwargs)
    scored = []
    for labels in itertools.combinations_with_replacement(range(cluster.num_devices), len(costs.order)):
        ev = costs.evaluate({v: cluster.names[k] for v, k in zip(costs.order, labels, strict=True)})
        if costs.fits(ev):
            scored.append((ev.bottleneck_s, ev.transfer_bytes))
    if not scored:
        return None
    best = min(b for b, _ in scored)
    return best, min(t for b, t in scored if b <= best * (1 + 1e-9))


@settings(max_examples=200, deadline=None)
@given(problem=chain_problems())
def test_exact_chain_equals_brute_force(problem):
    """In the given order (tests/partitioner/test_order.py holds the search over orders to brute force)."""
    graph, cluster, num_microbatches = problem
    expected = brute_force_chain(graph, cluster, num_microbatches=num_microbatches)
    if expected is None:
        event("infeasible")
        with pytest.raises(InfeasiblePlanError):
            pt.exact_chain(
                graph, cluster, num_microbatches=num_microbatches, device_order="given", objective="bottleneck"
            )
        return
    plan = pt.exact_chain(
        graph, cluster, num_microbatches=num_microbatches, device_order="given", objective="bottleneck"
    )
    event(f"{plan.num_stages} of {cluster.num_devices} devices used")
    best, fewest_bytes = expected
    assert plan.bottleneck_s == pytest.approx(best, rel=1e-12)
    assert plan.transfer_bytes == fewest_bytes  # ties on the bottleneck go to the fewest bytes sent
    assert plan.fits_memory
    assert plan.status == "optimal"
    assert plan.lower_bound_s == pytest.approx(best, rel=1e-9)
    pt.validate_plan(plan, graph, cluster)


def test_exact_chain_by_hand():
    # 1 TFLOP/s devices, free links: 2 + 2 | 1 + 1 + 2 | 4 is the best 3-way split of 2,2,1,1,2,4.
    graph = chain([2e12, 2e12, 1e12, 1e12, 2e12, 4e12])
    plan = pt.exact_chain(
        graph, pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12, bandwidth=1e30), objective="bottleneck"
    )
    assert plan.bottleneck_s == pytest.approx(4.0)
    assert [plan.assignment[f"l{i}"] for i in range(6)] == [G0, G0, G1, G1, G1, G2]
    assert plan.method == "exact_chain"
    assert plan.gap == 0.0


def test_exact_chain_memory_constrained():
    # Unconstrained, 1 1 1 | 3 is best (bottleneck 3). Each device holds only two layers.
    graph = chain([1e12, 1e12, 1e12, 3e12], param_bytes=[KIB] * 4)  # 4 KiB per layer with Adam
    free = pt.exact_chain(graph, pt.Cluster.uniform(2, memory="1MiB", flops_per_s=1e12), objective="bottleneck")
    assert free.bottleneck_s == pytest.approx(3.0)
    tight_cluster = pt.Cluster.uniform(2, memory=8 * KIB, flops_per_s=1e12)
    tight = pt.exact_chain(graph, tight_cluster, objective="bottleneck")
    assert [tight.assignment[f"l{i}"] for i in range(4)] == [G0, G0, G1, G1]
    assert tight.bottleneck_s == pytest.approx(4.0)
    assert tight.memory_bytes == {G0: 8 * KIB, G1: 8 * KIB}
    pt.validate_plan(tight, graph, tight_cluster)


def test_exact_chain_memory_infeasible_in_total():
    graph = chain([1e12] * 4, param_bytes=[KIB] * 4)
    with pytest.raises(InfeasiblePlanError, match=r"needs 16.0 KiB in total.*the 2 devices hold 14.0 KiB"):
        pt.exact_chain(graph, pt.Cluster.uniform(2, memory=7 * KIB), objective="bottleneck")


def test_exact_chain_memory_infeasible_one_layer():
    graph = chain([1e12] * 3, param_bytes=[KIB, 4 * KIB, KIB])
    with pytest.raises(InfeasiblePlanError, match=r"layer 'l1' alone needs 16.0 KiB.*largest device holds 8.0 KiB"):
        pt.exact_chain(graph, pt.Cluster.uniform(3, memory=8 * KIB), objective="bottleneck")


def test_exact_chain_faster_device_gets_more_layers():
    graph = chain([1e12] * 8)
    devices = [pt.Device(G0, memory="1GiB", flops_per_s=1e12), pt.Device(G1, memory="1GiB", flops_per_s=3e12)]
    plan = pt.exact_chain(graph, pt.Cluster(devices, bandwidth=1e30), device_order="given", objective="bottleneck")
    assert len(plan.nodes_on(G0)) == 2
    assert len(plan.nodes_on(G1)) == 6
    assert plan.bottleneck_s == pytest.approx(2.0)
    # The other way round, the fast device comes first and still takes six.
    plan = pt.exact_chain(
        graph, pt.Cluster(devices[::-1], bandwidth=1e30), device_order="given", objective="bottleneck"
    )
    assert len(plan.nodes_on(G1)) == 6


def test_exact_chain_avoids_a_slow_link():
    # Six 1-second layers, 1 GB sent between layers. With fast links (100 GB/s, 10 ms each way per cut) three
    # stages of two layers are best; with a slow 0 -> 1 link (0.1 GB/s, 10 s) the plan must not cut across it.
    graph = chain([1e12] * 6, edge_bytes=[10**9] * 5)
    devices = [pt.Device(f"/GPU:{i}", memory="1GiB", flops_per_s=1e12) for i in range(3)]
    fast = pt.exact_chain(graph, pt.Cluster(devices, bandwidth=100e9), device_order="given", objective="bottleneck")
    assert [len(fast.nodes_on(d)) for d in (G0, G1, G2)] == [2, 2, 2]
    assert fast.bottleneck_s == pytest.approx(2.02)  # the activation in, its gradient back

    slow = [[0, 0.1e9, 100e9], [100e9, 0, 100e9], [100e9, 100e9, 0]]  # row = sender
    plan = pt.exact_chain(graph, pt.Cluster(devices, bandwidth=slow), device_order="given", objective="bottleneck")
    sends = {(plan.assignment[u], plan.assignment[v]) for u, v in graph.edges}
    assert (G0, G1) not in sends
    assert plan.num_stages == 2
    assert plan.bottleneck_s == pytest.approx(3.02)


def test_exact_chain_slow_link_as_a_mapping():
    graph = chain([1e12] * 6, edge_bytes=[10**9] * 5)
    devices = [pt.Device(f"/GPU:{i}", memory="1GiB", flops_per_s=1e12) for i in range(3)]
    links = {(a.name, b.name): 100e9 for a in devices for b in devices if a != b}
    links[G1, G2] = 0.1e9
    plan = pt.exact_chain(graph, pt.Cluster(devices, bandwidth=links), device_order="given", objective="bottleneck")
    sends = {(plan.assignment[u], plan.assignment[v]) for u, v in graph.edges}
    assert (G1, G2) not in sends
    assert plan.bottleneck_s == pytest.approx(3.02)


def test_exact_chain_cost_time():
    graph = chain([1e9] * 4)
    for node, seconds in zip(graph.nodes, [1.0, 1.0, 1.0, 3.0], strict=True):
        graph.nodes[node]["time_s"] = seconds
    graph.graph["profiled_flops_per_s"] = 1e12
    plan = pt.exact_chain(
        graph, pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12), cost="time", objective="bottleneck"
    )
    assert plan.bottleneck_s == pytest.approx(3.0)
    assert plan.cost == "time"


def test_exact_chain_single_layer_single_device():
    plan = pt.exact_chain(chain([5e12]), pt.Cluster.uniform(1, memory="1GiB", flops_per_s=1e12), objective="bottleneck")
    assert plan.assignment == {"l0": G0}
    assert plan.bottleneck_s == pytest.approx(5.0)
    assert not math.isnan(plan.speedup)


def test_exact_chain_rejects_a_dag():
    with pytest.raises(InputError, match=r"exact_chain needs a chain.*this graph branches.*partitioner.solve"):
        pt.exact_chain(diamond(), pt.Cluster.uniform(2, memory="1GiB"), objective="bottleneck")


def test_exact_chain_rejects_shared_layers():
    with pytest.raises(InputError, match=r"does not handle shared layers"):
        pt.exact_chain(shared_layer_graph(), pt.Cluster.uniform(2, memory="1GiB"), objective="bottleneck")


def test_exact_chain_more_devices_than_layers():
    with pytest.raises(InputError, match=r"4 devices but the graph has only 2 nodes"):
        pt.exact_chain(chain([1e9, 1e9]), pt.Cluster.uniform(4, memory="1GiB"), objective="bottleneck")


def test_the_dp_counts_the_fixed_cost_of_each_stage() -> None:
    # Each stage pays its device's action_overhead_s for its forward and backward (3 times recomputed):
    # the DP's stage times include it, so the least bottleneck it proves is the plan's own.
    graph = pt.chain_graph([1e9, 3e9, 2e9, 1e9, 2e9, 1e9])
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12, action_overhead_s=1e-3)
    plan = pt.exact_chain(graph, cluster, num_microbatches=4, objective="bottleneck")
    assert plan.status == "optimal" and plan.gap < 1e-9
    assert plan.lower_bound_s == pytest.approx(plan.bottleneck_s)
