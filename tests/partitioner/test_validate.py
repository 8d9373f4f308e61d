"""The plan validator: solver plans pass; every way a plan can be wrong is caught, by message."""

from __future__ import annotations

import dataclasses
import random

import networkx as nx
import pytest
from graphs import KIB, chain, diamond, random_dag, shared_layer_graph

import partitioner as pt
from partitioner.errors import PlanError
from partitioner.validate import match_names

G0, G1, G2 = "/GPU:0", "/GPU:1", "/GPU:2"


def _cluster(num_devices: int = 3, memory: str | int = "1GiB") -> pt.Cluster:
    return pt.Cluster.uniform(num_devices, memory=memory, flops_per_s=1e12, bandwidth="10GB/s")


def _with_assignment(plan: pt.Plan, **changes: str) -> pt.Plan:
    # Moving nodes changes the stages: no stage recomputed, one entry per stage.
    return dataclasses.replace(plan, assignment={**plan.assignment, **changes}, recompute=())


@pytest.mark.parametrize(
    "graph",
    [chain([1e9, 5e9, 2e9, 2e9, 3e9]), diamond(), shared_layer_graph(), random_dag(random.Random(5), 20, num_shared=2)],
)
def test_validate_plan_passes_on_solver_plans(graph):
    cluster = _cluster()
    plan = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=10)
    pt.validate_plan(plan, graph, cluster)
    pt.validate_plan(pt.Plan.from_json(plan.to_json()), graph, cluster)


def test_validate_plan_node_missing():
    graph = diamond()
    plan = pt.solve(graph, _cluster(), time_limit_s=10)
    broken = dataclasses.replace(plan, assignment={v: d for v, d in plan.assignment.items() if v != "c"})
    with pytest.raises(PlanError, match=r"does not match the layer graph: 1 node\(s\) have no device \(e.g. \['c'\]\)"):
        pt.validate_plan(broken, graph, _cluster())


def test_validate_plan_extra_node():
    graph = diamond()
    plan = pt.solve(graph, _cluster(), time_limit_s=10)
    with pytest.raises(PlanError, match=r"1 node\(s\) are not in the graph \(e.g. \['ghost'\]\)"):
        pt.validate_plan(_with_assignment(plan, ghost=G0), graph, _cluster())


def test_validate_plan_plan_for_another_model():
    cluster = _cluster()
    plan = pt.solve(chain([1e9, 2e9, 3e9]), cluster, time_limit_s=10)
    with pytest.raises(PlanError, match=r"does not match the layer graph: 4 node.*3 node.*Plan again for this model"):
        pt.validate_plan(plan, diamond(), cluster)


def test_validate_plan_unknown_device():
    graph = diamond()
    plan = pt.solve(graph, _cluster(), time_limit_s=10)
    with pytest.raises(PlanError, match=r"uses device\(s\) \['/GPU:7'\] that the cluster lacks"):
        pt.validate_plan(_with_assignment(plan, d="/GPU:7"), graph, _cluster())


@pytest.mark.parametrize(
    "other",
    [
        _cluster(2),
        _cluster(4),
        pt.Cluster([pt.Device(f"/CPU:{i}", memory="1GiB") for i in range(3)]),
    ],
)
def test_validate_plan_made_for_another_cluster(other):
    graph = diamond()
    plan = pt.solve(graph, _cluster(), time_limit_s=10)
    with pytest.raises(PlanError, match=r"made for devices \['/GPU:0', '/GPU:1', '/GPU:2'\] but the cluster has"):
        pt.validate_plan(plan, graph, other)


def test_validate_plan_takes_the_cluster_listed_in_another_order():
    # A plan lists its devices in the pipeline order it chose; the same devices listed otherwise are its cluster.
    graph = diamond()
    plan = pt.solve(graph, pt.Cluster([pt.Device(name, memory="1GiB") for name in (G1, G0, G2)]), time_limit_s=10)
    assert plan.devices == (G1, G0, G2)
    pt.validate_plan(plan, graph, _cluster())
    # G1 runs stage 0 in this plan: a on G0 (stage 1) would feed b on G1 backward.
    backward = dataclasses.replace(plan, assignment={"a": G0, "b": G1, "c": G1, "d": G1}, recompute=(False, False))
    with pytest.raises(PlanError, match="goes backward"):
        pt.validate_plan(backward, graph, _cluster())


def test_validate_plan_backward_edge():
    graph = chain([1e9, 1e9, 1e9])
    plan = pt.baselines.uniform(graph, _cluster())
    assert plan.assignment == {"l0": G0, "l1": G1, "l2": G2}
    backward = _with_assignment(plan, l0=G1, l1=G0)
    with pytest.raises(PlanError, match=r"Edge 'l0' -> 'l1' goes backward: 'l0' is on /GPU:1 .*'l1' is on /GPU:0"):
        pt.validate_plan(backward, graph, _cluster())


def test_validate_plan_backward_skip_edge():
    graph = diamond()
    cluster = _cluster()
    plan = pt.solve(graph, cluster, time_limit_s=10)
    # a -> c goes from /GPU:1 back to /GPU:0; every other edge is forward or local.
    broken = _with_assignment(plan, a=G1, b=G1, c=G0, d=G2)
    with pytest.raises(PlanError, match=r"Edge 'a' -> 'c' goes backward"):
        pt.validate_plan(broken, graph, cluster)


def test_validate_plan_split_colocation_group():
    graph = shared_layer_graph()  # input -> dense_call0 -> mid_0 -> mid_1 -> dense_call1 -> head
    cluster = _cluster()
    plan = pt.solve(graph, cluster, time_limit_s=10)
    # Every edge still goes forward; only the shared layer's two calls part.
    split = {"input": G0, "dense_call0": G0, "mid_0": G0, "mid_1": G1, "dense_call1": G1, "head": G2}
    with pytest.raises(
        PlanError, match=r"Colocation group 'dense' \(a shared layer\) is split across \['/GPU:0', '/GPU:1'\]"
    ):
        pt.validate_plan(dataclasses.replace(plan, assignment=split, recompute=()), graph, cluster)


def test_validate_plan_memory_over_capacity():
    graph = chain([1e9] * 4, param_bytes=[64 * KIB] * 4)  # 256 KiB each with Adam
    big = _cluster(2, memory="1MiB")
    plan = pt.baselines.uniform(graph, big)  # 512 KiB per device
    pt.validate_plan(plan, graph, big)
    small = _cluster(2, memory="500KiB")
    with pytest.raises(PlanError, match=r"Device /GPU:0 needs 512.0 KiB but holds 500.0 KiB \(with 1 micro-batches"):
        pt.validate_plan(plan, graph, small)


def test_validate_plan_check_memory_false_skips_only_memory():
    graph = chain([1e9] * 4, param_bytes=[64 * KIB] * 4)
    plan = pt.baselines.uniform(graph, _cluster(2, memory="1MiB"))
    small = _cluster(2, memory="500KiB")
    pt.validate_plan(plan, graph, small, check_memory=False)
    backward = _with_assignment(plan, l0=G1, l1=G0)
    with pytest.raises(PlanError, match=r"goes backward"):
        pt.validate_plan(backward, graph, small, check_memory=False)


def test_validate_plan_memory_counts_the_plans_microbatches():
    graph = chain([1e9] * 2, activation_bytes=[100 * KIB] * 2)
    cluster = _cluster(2, memory="1MiB")
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=8)  # 800 KiB per device + 100 in a backward
    pt.validate_plan(plan, graph, cluster)
    more = dataclasses.replace(plan, num_microbatches=11)  # 1100 + 100 KiB: over
    with pytest.raises(PlanError, match=r"needs 1.2 MiB but holds 1.0 MiB \(with 11 micro-batches in flight"):
        pt.validate_plan(more, graph, cluster)


def test_validate_plan_not_a_plan():
    with pytest.raises(PlanError, match=r"Expected a partitioner.Plan. Received: dict"):
        pt.validate_plan({"l0": G0}, chain([1e9]), _cluster(1))  # type: ignore[arg-type]


def test_match_names_maps_a_plan_onto_the_same_structure_under_other_names():
    graph = diamond()
    for node in graph:
        graph.nodes[node]["config_digest"] = "0" * 12
    plan = pt.Plan.from_json(pt.solve(graph, _cluster(), time_limit_s=10).to_json())
    assert len(plan.structure) == len(plan.assignment) == graph.number_of_nodes()
    renamed = nx.relabel_nodes(graph, {v: f"{v}_2" for v in graph})
    matched = match_names(plan, renamed)
    assert matched.assignment == {f"{v}_2": d for v, d in plan.assignment.items()}
    pt.validate_plan(matched, renamed, _cluster())
    assert match_names(plan, graph) is plan

    node = list(renamed)[2]
    renamed.nodes[node]["config_digest"] = "1" * 12
    with pytest.raises(PlanError, match=rf"node 2 in topological order is '{node}' \(Dense 1{{12}} <- "):
        match_names(plan, renamed)
