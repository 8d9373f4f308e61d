"""Coarsening: runs of nodes that keep every total, pins and shared layers, and plans that stay legal and honest."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from graphs import KIB, brute_force, chain, dag_problems, diamond, legal_baselines, random_chain, random_dag
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.errors import InfeasiblePlanError, InputError, SolverTimeoutError
from partitioner.graph import colocation_groups, is_chain
from partitioner.search import coarsen, multilevel
from partitioner.search import solve as solver_module

G0, G1, G2, G3 = "/GPU:0", "/GPU:1", "/GPU:2", "/GPU:3"
# The coarsened search in the cluster's order (test_order holds the search over orders).
COARSE = pt.SolverOptions(coarsen=True, device_order="given")
PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cluster(num_devices: int, memory: str | int = "1GiB", bandwidth: object = "10GB/s") -> pt.Cluster:
    return pt.Cluster.uniform(num_devices, memory=memory, flops_per_s=1e12, bandwidth=bandwidth)


def _best_legal_baseline(graph, cluster, pins=None, **kwargs) -> float | None:
    return min((p.bottleneck_s for p in legal_baselines(graph, cluster, pins, **kwargs)), default=None)


# ----- segments: the coarse units ----------------------------------------------------------------


@PROPERTY_SETTINGS
@given(problem=dag_problems(max_nodes=40, max_devices=4, max_shared=3), num_units=st.integers(1, 50), data=st.data())
def test_segments_keep_every_total(problem, num_units, data):
    graph, cluster, num_microbatches = problem
    costs = CostModel(graph, cluster, num_microbatches=num_microbatches)
    pinned = data.draw(st.lists(st.sampled_from(costs.order), max_size=3, unique=True))
    pins = {v: data.draw(st.integers(0, cluster.num_devices - 1)) for v in pinned}
    c = coarsen.segments(costs, num_units, pins)

    # Every node in exactly one unit, units are runs of the topological order, in that order.
    assert [v for unit in c.units for v in unit] == costs.order
    assert len(c.domains) == c.num_units
    # Work and memory add up to the graph's, on every device.
    uc = coarsen.unit_costs(costs, c)
    for k in range(cluster.num_devices):
        assert sum(row[k] for row in uc.compute_s) == pytest.approx(sum(costs.compute_s[v][k] for v in costs.order))
    assert sum(uc.memory) == sum(costs.memory.values())
    # Edges between units point forward, so a placement of units that follows them follows the graph.
    assert all(a < b for a, b in uc.edges)
    # Pinned nodes are units of their own, pinned; a unit holds the calls of at most one shared layer.
    for unit, domain in zip(c.units, c.domains, strict=True):
        pinned_here = [v for v in unit if v in pins]
        if pinned_here:
            assert unit == (pinned_here[0],)
            assert domain == (pins[unit[0]], pins[unit[0]])
        else:
            assert domain == (0, cluster.num_devices - 1)
        assert len({graph.nodes[v].get("colocation_group") for v in unit} - {None}) <= 1


def test_segments_cut_where_few_bytes_cross():
    # Eight equal layers in two units: the cut may fall after l1 ... l5; after l4 only 1 byte crosses.
    graph = chain([1e12] * 8, edge_bytes=[10**6, 10**6, 10**6, 10**6, 1, 10**6, 10**6])
    c = coarsen.segments(CostModel(graph, _cluster(2)), 2)
    assert c.units == (("l0", "l1", "l2", "l3", "l4"), ("l5", "l6", "l7"))


def test_segments_keep_the_given_cuts():
    graph = chain([1e12] * 8)
    c = coarsen.segments(CostModel(graph, _cluster(2)), 2, cuts=[3])
    assert c.units[0] == ("l0", "l1", "l2")


def test_segments_one_unit_holds_everything():
    graph = random_dag(random.Random(0), 12)
    costs = CostModel(graph, _cluster(3))
    c = coarsen.segments(costs, 1)
    assert c.units == (tuple(costs.order),)
    assert coarsen.unit_costs(costs, c).senders == []  # nothing leaves the only unit


@pytest.mark.parametrize("num_units", [0, -3, 2.5, True, "4"])
def test_segments_num_units_must_be_positive(num_units):
    with pytest.raises(InputError, match=r"num_units must be an integer >= 1. Received:"):
        coarsen.segments(CostModel(diamond(), _cluster(2)), num_units)


@pytest.mark.parametrize("pins", [{"zz": 0}, {"a": 2}, {"a": -1}])
def test_coarsen_pins_must_name_nodes_and_device_indices(pins):
    with pytest.raises(InputError, match=r"pins must map nodes of the layer graph to device indices 0..1"):
        coarsen.segments(CostModel(diamond(), _cluster(2)), 2, pins)


def test_expand_and_project_are_inverse_on_whole_units():
    c = coarsen.Coarsening((("a", "b"), ("c",), ("d",)), ((0, 1), (0, 1), (0, 1)))
    assignment = c.expand([0, 1, 1], [G0, G1])
    assert assignment == {"a": G0, "b": G0, "c": G1, "d": G1}
    assert c.project(assignment, [G0, G1]) == [0, 1, 1]
    # A unit split by a placement goes where most of its nodes are.
    assert c.project({"a": G1, "b": G1, "c": G0, "d": G1}, [G0, G1]) == [1, 0, 1]


# ----- around_boundaries: the refinement units ---------------------------------------------------


def test_around_boundaries_frees_the_nodes_near_a_cut():
    graph = chain([1e12] * 12)
    costs = CostModel(graph, _cluster(2))
    assignment = {f"l{i}": G0 if i < 6 else G1 for i in range(12)}  # the cut is between l5 and l6
    c = coarsen.around_boundaries(costs, assignment, 2)
    # l4 ... l7 see both devices within 2 places: they move alone; the others stay in runs.
    assert c.units == (("l0", "l1", "l2", "l3"), ("l4",), ("l5",), ("l6",), ("l7",), ("l8", "l9", "l10", "l11"))
    assert c.domains == ((0, 0), (0, 1), (0, 1), (0, 1), (0, 1), (1, 1))
    # Radius 0: only the two nodes on the cut move.
    c = coarsen.around_boundaries(costs, assignment, 0)
    assert [d for u, d in zip(c.units, c.domains, strict=True) if d[0] < d[1]] == [(0, 1), (0, 1)]


def test_around_boundaries_keeps_pins_and_shared_layers():
    graph = random_dag(random.Random(3), 30, num_shared=3)
    cluster = _cluster(3, memory="1GiB")
    plan = pt.baselines.by_time(graph, cluster)
    costs = CostModel(graph, cluster)
    node = costs.order[10]
    pins = {node: cluster.index(plan.assignment[node])}
    c = coarsen.around_boundaries(costs, plan.assignment, 3, pins)
    assert [v for unit in c.units for v in unit] == costs.order
    unit_of = c.unit_of()
    assert c.units[unit_of[node]] == (node,)
    assert c.domains[unit_of[node]] == (pins[node], pins[node])
    for unit in c.units:
        assert len({graph.nodes[v].get("colocation_group") for v in unit} - {None}) <= 1
    # The plan itself is a placement of these units, inside their domains.
    for unit, (lo, hi) in zip(c.units, c.domains, strict=True):
        assert len({plan.assignment[v] for v in unit}) == 1
        assert lo <= cluster.index(plan.assignment[unit[0]]) <= hi


@pytest.mark.parametrize("radius", [-1, 1.5, None])
def test_around_boundaries_radius_must_be_a_count(radius):
    graph = diamond()
    with pytest.raises(InputError, match=r"radius must be an integer >= 0. Received:"):
        coarsen.around_boundaries(CostModel(graph, _cluster(2)), dict.fromkeys(graph, G0), radius)


# ----- chain_quotient ----------------------------------------------------------------------------


def test_chain_quotient_sums_each_run():
    graph = chain([1e9, 2e9, 3e9, 4e9], param_bytes=[KIB] * 4, activation_bytes=[0, KIB, 0, KIB], edge_bytes=[7, 8, 9])
    c = coarsen.Coarsening((("l0", "l1"), ("l2", "l3")), ((0, 1), (0, 1)))
    q = coarsen.chain_quotient(graph, c)
    assert list(q.nodes) == ["l0", "l2"]
    assert q.nodes["l0"]["flops"] == 3e9 and q.nodes["l2"]["flops"] == 7e9
    assert q.nodes["l0"]["param_bytes"] == 2 * KIB and q.nodes["l0"]["activation_bytes"] == KIB
    assert q.edges["l0", "l2"]["bytes"] == 8  # l1's output: the only tensor that leaves the first run


def test_chain_quotient_keeps_the_models_inputs_and_outputs():
    # a unit holds what its nodes hold all step (CostModel.step_bytes): the planners of its units budget it
    graph = chain([1e9] * 4)
    graph.nodes["l0"]["model_input_bytes"] = 100
    graph.nodes["l3"]["model_output_bytes"] = 10
    q = coarsen.chain_quotient(graph, coarsen.Coarsening((("l0", "l1"), ("l2", "l3")), ((0, 1), (0, 1))))
    assert (q.nodes["l0"]["model_input_bytes"], q.nodes["l2"]["model_output_bytes"]) == (100, 10)


def test_chain_quotient_sums_the_gradients_each_unit_makes():
    # a unit's output_bytes: its nodes' (a node that does not say: its activations, as CostModel prices it)
    graph = chain([1e9] * 4, activation_bytes=[40, 50, 60, 70])
    graph.nodes["l0"]["output_bytes"] = 4
    graph.nodes["l2"]["output_bytes"] = 6
    graph.nodes["l3"]["output_bytes"] = 7
    q = coarsen.chain_quotient(graph, coarsen.Coarsening((("l0", "l1"), ("l2", "l3")), ((0, 1), (0, 1))))
    assert (q.nodes["l0"]["output_bytes"], q.nodes["l2"]["output_bytes"]) == (4 + 50, 6 + 7)
    cluster = _cluster(2)
    nodes = CostModel(graph, cluster, num_microbatches=4)
    units = CostModel(q, cluster, num_microbatches=4)
    assert units.node_cost("l0", "kept").once_bytes == sum(nodes.node_cost(v, "kept").once_bytes for v in ("l0", "l1"))


def test_chain_quotient_needs_runs_of_a_chain():
    c = coarsen.Coarsening((("a", "b"), ("c", "d")), ((0, 1), (0, 1)))  # diamond: b does not feed c
    with pytest.raises(InputError, match=r"chain_quotient needs units that follow a chain; 'b' does not feed 'c'"):
        coarsen.chain_quotient(diamond(), c)


# ----- solve with coarsening ---------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(problem=dag_problems(max_nodes=7, max_devices=3, max_shared=1))
def test_coarsened_solve_is_legal_and_its_bound_holds_for_the_nodes(problem):
    graph, cluster, num_microbatches = problem
    best = brute_force(graph, cluster, num_microbatches=num_microbatches)
    try:
        plan = pt.solve(graph, cluster, num_microbatches=num_microbatches, time_limit_s=10, options=COARSE)
    except InfeasiblePlanError:
        assert best is None
        event("infeasible")
        return
    assert best is not None
    event(plan.method)
    pt.validate_plan(plan, graph, cluster)
    assert plan.lower_bound_s is not None
    assert plan.lower_bound_s <= best * (1 + 1e-9) <= plan.bottleneck_s * (1 + 1e-9)
    legal = legal_baselines(graph, cluster, num_microbatches=num_microbatches)
    if legal:
        # solve returns the shorter simulated step of its own plan and the legal baselines; only its own
        # plan (not a baseline picked for its step), made for the bottleneck, holds a bottleneck no worse
        # than every baseline's: a plan made for the step may trade bottleneck for step (at M = 1, one
        # device rather than a split whose transfers lengthen the step).
        assert plan.step_time_s <= min(p.step_time_s for p in legal) * (1 + 1e-9)
        if plan.objective == "bottleneck" and "shorter step than" not in plan.method:
            assert plan.bottleneck_s <= min(p.bottleneck_s for p in legal) * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_coarsened_solve_on_a_larger_dag_with_pins_and_shared_layers(seed):
    rng = random.Random(seed)
    graph = random_dag(rng, 120, num_shared=4, skip_prob=0.2)
    cluster = _cluster(4, memory="4GiB")
    start = pt.baselines.by_time(graph, cluster, num_microbatches=4)
    pins = {v: start.assignment[v] for v in rng.sample(sorted(graph.nodes), 3)}
    plan = pt.solve(graph, cluster, num_microbatches=4, pins=pins, time_limit_s=3, options=COARSE)
    assert plan.method == "cp-sat+coarsen"
    pt.validate_plan(plan, graph, cluster)
    assert all(plan.assignment[v] == d for v, d in pins.items())
    for nodes in colocation_groups(graph).values():
        assert len({plan.assignment[v] for v in nodes}) == 1
    baseline = _best_legal_baseline(graph, cluster, pins, num_microbatches=4)
    assert baseline is not None and plan.bottleneck_s <= baseline * (1 + 1e-9)
    # The bound is the cost model's, valid for the nodes (a bound on runs would not be).
    assert plan.lower_bound_s == pytest.approx(CostModel(graph, cluster, num_microbatches=4).lower_bound_s())


def test_coarsened_chain_matches_the_exact_dp_bound():
    graph = random_chain(random.Random(5), 300)
    cluster = _cluster(4, bandwidth="1GB/s")
    exact = pt.exact_chain(graph, cluster, num_microbatches=2, objective="bottleneck")
    plan = pt.solve(graph, cluster, num_microbatches=2, time_limit_s=10, options=COARSE)
    assert plan.method == "exact_chain+coarsen"
    pt.validate_plan(plan, graph, cluster)
    assert plan.lower_bound_s <= exact.bottleneck_s * (1 + 1e-9) <= plan.bottleneck_s * (1 + 1e-9)
    assert plan.bottleneck_s <= _best_legal_baseline(graph, cluster, num_microbatches=2) * (1 + 1e-9)


def test_coarsened_solve_proves_optimality_when_it_meets_the_bound():
    # Sixteen 1 s layers on four devices: 4 s is the total-work bound, so a 4 s plan is proven optimal.
    graph = chain([1e12] * 16)
    plan = pt.solve(graph, _cluster(4, bandwidth=1e30), time_limit_s=10, options=COARSE)
    assert plan.bottleneck_s == pytest.approx(4.0)
    assert plan.status == "optimal"  # the total-work bound is met, which proves it
    assert plan.gap == 0.0


def test_coarsen_auto_keeps_small_graphs_fine_and_coarsens_large_ones():
    keep = pt.SolverOptions(shortest_step=False)  # the solver's own plan, whatever the baselines simulate to
    small = pt.solve(random_dag(random.Random(1), 20), _cluster(2), time_limit_s=10, options=keep)
    assert small.method == "cp-sat"
    nodes = solver_module.AUTO_COARSEN_DAG // 2 + 1  # nodes x devices just above the threshold on 2 devices
    large = pt.solve(random_dag(random.Random(1), nodes, skip_prob=0.05), _cluster(2), time_limit_s=3, options=keep)
    assert large.method == "cp-sat+coarsen"
    forced_fine = pt.solve(
        random_dag(random.Random(1), 20),
        _cluster(2),
        time_limit_s=10,
        options=pt.SolverOptions(coarsen=False, shortest_step=False),
    )
    assert forced_fine.method == "cp-sat"


def test_coarsened_solve_falls_back_to_the_fine_model(monkeypatch):
    # Nothing found on the units and no baseline to start from: the fine model still answers.
    monkeypatch.setattr(multilevel, "_place_units", lambda *args, **kwargs: None)
    graph = random_dag(random.Random(4), 14, skip_prob=0.5)
    assert not is_chain(graph)
    plan = pt.solve(graph, _cluster(3), time_limit_s=10, options=dataclasses.replace(COARSE, hint=False))
    # the fine model's plan, which the enumeration of every legal plan (14 nodes) then improves on
    assert plan.method == "every legal plan enumerated (better than cp-sat)"
    pt.validate_plan(plan, graph, _cluster(3))


def test_coarsened_solve_starts_from_a_memory_fill_when_no_baseline_fits(monkeypatch):
    # Eight equal layers of 4 KiB (1 KiB of weights with Adam) on devices of 8 and 25 KiB (24 and the copy of
    # the 10 B skip tensor it receives, a KiB as CP-SAT rounds it): every baseline splits 4 | 4 and overflows
    # /GPU:0. Filling the devices in order (2 | 6) fits, and is the only start.
    graph = chain([1e12] * 8, param_bytes=[KIB] * 8)
    graph.add_edge("l0", "l3", bytes=10)  # not a chain: the CP-SAT path
    cluster = pt.Cluster([pt.Device(G0, memory=8 * KIB), pt.Device(G1, memory=25 * KIB)], bandwidth=1e30)
    assert not any(b(graph, cluster).fits_memory for b in pt.baselines.BASELINES.values())
    monkeypatch.setattr(multilevel, "_place_units", lambda *args, **kwargs: None)  # the units find nothing
    given = dataclasses.replace(COARSE, device_order="given")  # the fill runs in the cluster's order
    plan = pt.solve(graph, cluster, time_limit_s=10, options=given)
    assert plan.method == "cp-sat+coarsen"
    assert plan.nodes_on(G0) == ["l0", "l1"]
    pt.validate_plan(plan, graph, cluster)


def test_coarsened_solve_times_out_when_nothing_is_found_in_time(monkeypatch):
    monkeypatch.setattr(solver_module, "solve_coarsened", lambda *args, **kwargs: time.sleep(0.2))
    graph = random_dag(random.Random(4), 14, skip_prob=0.5)
    with pytest.raises(SolverTimeoutError, match=r"found no feasible plan within time_limit_s=0.1 for 14 nodes on 3"):
        pt.solve(graph, _cluster(3), time_limit_s=0.1, options=COARSE)


def test_coarsened_solve_explains_infeasibility():
    graph = chain([1e12] * 3, param_bytes=[KIB, 4 * KIB, KIB])  # l1 needs 16 KiB with Adam
    with pytest.raises(InfeasiblePlanError, match=r"layer 'l1' alone needs 16.0 KiB"):
        pt.solve(graph, _cluster(3, memory=8 * KIB), time_limit_s=10, options=COARSE)


@pytest.mark.parametrize("value", ["auto", 1, 0.5])
def test_coarsen_option_must_be_a_bool_or_none(value):
    with pytest.raises(InputError, match=r"SolverOptions.coarsen must be True, False or None \(auto\). Received:"):
        pt.solve(diamond(), _cluster(2), time_limit_s=10, options=pt.SolverOptions(coarsen=value))
