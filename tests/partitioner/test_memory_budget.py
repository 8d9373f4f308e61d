"""The planners' memory budgets against the memory ``CostModel.evaluate`` charges each stage.

Under 1F1B stage s of K holds min(K - s, M) micro-batches. The chain DP budgets each block exactly that
(partitioner.search.bottleneck_dp, "Memory"), so on chains it finds the same optimum as brute force over every split
scored by ``CostModel.evaluate``, also where memory is tight enough that budgeting every stage for the
fullest one, min(number of devices, M), misses it. CP-SAT budgets the device at position k of D for
min(D - k, M) (``CostModel.device_in_flight``): never less than its stage holds, tighter than the fullest.
"""

from __future__ import annotations

from unittest import mock

import networkx as nx
import numpy as np
import pytest
from graphs import KIB, add_layer, brute_force, chain, draw_cluster
from hypothesis import event, given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cost import CostModel, in_flight
from partitioner.search.bottleneck_dp import _dynamic_program, _tables
from partitioner.search.threshold_search import _least_bottleneck, _step_program


def fullest_budget_bottleneck(graph: nx.DiGraph, cluster: pt.Cluster, num_microbatches: int, **kwargs: object):
    """The least bottleneck when every stage is budgeted for the fullest one's min(D, M) micro-batches,
    the planners' budget before: every stage's memory at that many micro-batches, M = that many (the
    bottleneck does not depend on M)."""
    fullest = min(cluster.num_devices, num_microbatches)
    with mock.patch("partitioner.cost.in_flight", lambda schedule, num_stages, m, stage: m):  # every stage: M
        return brute_force(graph, cluster, num_microbatches=fullest, **kwargs)


@st.composite
def tight_1f1b_chains(draw: st.DrawFn):
    """(chain of 2-7 layers, cluster of 1-3 devices, M in 1..6, recompute policy), memory about what a
    1F1B plan needs: activations dominate, so the stage's in-flight count decides what fits."""
    k = draw(st.integers(1, 3))
    n = draw(st.integers(max(2, k), 7))
    activations = [draw(st.integers(0, 8)) * KIB for _ in range(n)]
    graph = chain(
        [draw(st.integers(1, 100)) * 1e9 for _ in range(n)],
        param_bytes=[draw(st.integers(0, 2)) * KIB for _ in range(n)],
        activation_bytes=activations,
        edge_bytes=[draw(st.integers(0, 4)) * KIB for _ in range(n - 1)],
    )
    m = draw(st.integers(1, 6))
    # What the whole chain needs on one stage holding 1..min(k, m) micro-batches: the range where the
    # per-stage count matters.
    need = sum(4 * int(d["param_bytes"]) for _, d in graph.nodes(data=True)) + sum(activations) * min(k, m)
    cluster = draw_cluster(draw, k, max(need, KIB), headroom=1.5)
    return graph, cluster, m, draw(st.sampled_from(["never", "auto"]))


@settings(max_examples=150, deadline=None)
@given(problem=tight_1f1b_chains())
def test_exact_chain_1f1b_tight_memory_equals_brute_force(problem):
    graph, cluster, m, recompute = problem
    kwargs = {"num_microbatches": m, "schedule": "1f1b", "recompute": recompute}
    best = brute_force(graph, cluster, **kwargs)
    if best is None:
        event("infeasible")
        with pytest.raises(pt.InfeasiblePlanError):
            pt.exact_chain(graph, cluster, device_order="given", objective="bottleneck", **kwargs)
        return
    before = fullest_budget_bottleneck(graph, cluster, m, recompute=recompute)
    if before is None or before > best * (1 + 1e-9):
        event("only the per-stage budget finds the optimum")
    plan = pt.exact_chain(graph, cluster, device_order="given", objective="bottleneck", **kwargs)
    assert plan.bottleneck_s == pytest.approx(best, rel=1e-12)
    assert plan.fits_memory and plan.status == "optimal"
    pt.validate_plan(plan, graph, cluster)
    stepped = pt.exact_chain(graph, cluster, device_order="given", **kwargs)  # the step objective fits too
    assert stepped.fits_memory
    pt.validate_plan(stepped, graph, cluster)
    assert stepped.step_time_s <= plan.step_time_s * (1 + 1e-12)


def test_exact_chain_1f1b_last_stage_holds_one_microbatch():
    # l1's activations (10 KiB, and 10 KiB of their gradients in a backward) fit a 20 KiB device only on
    # the last stage, which holds 1 micro-batch under 1F1B; l0 holds 2 x 5 + 5 KiB on the first; one stage
    # would hold 30 KiB. Budgeting both stages for the fullest (2 micro-batches) fits nothing.
    graph = chain([1e12, 1e12], activation_bytes=[5 * KIB, 10 * KIB])
    cluster = pt.Cluster.uniform(2, memory=20 * KIB, flops_per_s=1e12)
    assert fullest_budget_bottleneck(graph, cluster, 2) is None
    plan = pt.exact_chain(graph, cluster, num_microbatches=2, schedule="1f1b")
    assert plan.assignment == {"l0": "/GPU:0", "l1": "/GPU:1"}
    assert plan.memory_bytes == {"/GPU:0": 15 * KIB, "/GPU:1": 20 * KIB}
    pt.validate_plan(plan, graph, cluster)
    gpipe = pt.exact_chain(graph, cluster, num_microbatches=2)  # GPipe's last stage holds one too
    assert (gpipe.assignment, gpipe.memory_bytes) == (plan.assignment, plan.memory_bytes)


def test_exact_chain_1f1b_counts_stages_to_the_end_not_devices():
    # Three devices, two used: the first used stage holds min(2, M) = 2, not min(3, M) = 3. Devices 0 and
    # 2 hold 19 KiB, device 1 only 1 KiB; l0 needs (3 + 1) x 6 KiB = 24 KiB at 3 in flight (one more for
    # the gradients in a backward), 18 KiB at 2, and l2's 8 + 8 KiB fit only on device 2 (one stage of all
    # three layers would hold 28 KiB).
    graph = chain([1e12] * 3, activation_bytes=[6 * KIB, 0, 8 * KIB])
    cluster = pt.Cluster(
        [pt.Device(f"/GPU:{i}", memory=kib * KIB, flops_per_s=1e12) for i, kib in enumerate([19, 1, 19])]
    )
    plan = pt.exact_chain(graph, cluster, num_microbatches=4, schedule="1f1b", device_order="given")
    assert plan.stages == ("/GPU:0", "/GPU:2")
    assert plan.memory_bytes["/GPU:0"] == 18 * KIB and plan.memory_bytes["/GPU:2"] == 16 * KIB
    assert fullest_budget_bottleneck(graph, cluster, 4) is None  # (4 + 1) x 6 KiB > 19 KiB


def test_device_in_flight_never_below_what_a_stage_holds():
    """min(D - k, M) on the device at position k bounds stage s's min(K - s, M) in every plan using it
    (1F1B); M before the last device and 1 on it bound M before the last stage and 1 on it (GPipe)."""
    graph = chain([1e12] * 6)
    for num_devices in range(1, 6):
        cluster = pt.Cluster.uniform(num_devices, memory="1GiB")
        for m in range(1, 7):
            budget = CostModel(graph, cluster, num_microbatches=m, schedule="1f1b").device_in_flight
            assert budget == [min(num_devices - k, m) for k in range(num_devices)]
            gpipe = CostModel(graph, cluster, num_microbatches=m).device_in_flight
            assert gpipe == [m] * (num_devices - 1) + [1]
            for num_stages in range(1, num_devices + 1):
                for s in range(num_stages):
                    # stage s runs on device k >= s with num_stages - s - 1 later devices after k
                    for k in range(s, num_devices - (num_stages - s - 1)):
                        assert in_flight("1f1b", num_stages, m, s) <= budget[k]
                        assert in_flight("gpipe", num_stages, m, s) <= gpipe[k]
                    for name in ("1f1b", "gpipe"):
                        assert in_flight(name, num_stages, m, s) == in_flight(name, num_stages - s, m, 0)


def _skip_dag() -> nx.DiGraph:
    """a -> b -> c with a skip edge a -> c; c has the most work and the largest activations."""
    graph = nx.DiGraph()
    add_layer(graph, "a", flops=1e12, activation_bytes=3 * KIB)
    add_layer(graph, "b", flops=1e12, activation_bytes=3 * KIB)
    add_layer(graph, "c", flops=2e12, activation_bytes=10 * KIB)
    graph.add_edge("a", "b", bytes=KIB)
    graph.add_edge("b", "c", bytes=KIB)
    graph.add_edge("a", "c", bytes=KIB)
    return graph


def test_solve_dag_1f1b_fits_only_with_the_per_position_budget():
    # c (10 KiB, and 10 KiB of gradients in a backward, 2 KiB of the gradients of what it receives and a copy
    # of the 2 KiB it receives for each of the first stage's 2 micro-batches) fits a 26 KiB device only on
    # the last stage (1 micro-batch in flight), a and b (3 + 3 KiB) twice over and once more on the first:
    # the fullest stage's budget, 2 micro-batches everywhere, fits nothing.
    graph = _skip_dag()
    cluster = pt.Cluster.uniform(2, memory=26 * KIB, flops_per_s=1e12)
    assert fullest_budget_bottleneck(graph, cluster, 2) is None
    assert CostModel(graph, cluster, num_microbatches=2, schedule="1f1b").device_in_flight == [2, 1]
    for options in (pt.SolverOptions(), pt.SolverOptions(shortest_step=False, device_order="given")):
        plan = pt.solve(graph, cluster, num_microbatches=2, schedule="1f1b", time_limit_s=10, options=options)
        assert plan.method.startswith("cp-sat"), plan.method  # not a baseline the search's budget refused
        assert plan.assignment == {"a": "/GPU:0", "b": "/GPU:0", "c": "/GPU:1"}
        assert plan.status != "heuristic"  # the search's own plan, with a proven bound
        pt.validate_plan(plan, graph, cluster)
        assert plan.bottleneck_s == pytest.approx(brute_force(graph, cluster, num_microbatches=2, schedule="1f1b"))


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 4),
    memory_kib=st.integers(8, 24),
    num_devices=st.integers(1, 3),
    recompute=st.sampled_from(["never", "auto"]),
)
def test_solve_dag_1f1b_plans_fit_as_evaluate_charges(m, memory_kib, num_devices, recompute):
    """Every plan CP-SAT returns under the per-position budget passes validate_plan; it fails only where
    brute force finds no plan that fits its budget's order."""
    graph = _skip_dag()
    cluster = pt.Cluster.uniform(num_devices, memory=memory_kib * KIB, flops_per_s=1e12)
    kwargs = {"num_microbatches": m, "schedule": "1f1b", "recompute": recompute}
    best = brute_force(graph, cluster, **kwargs)
    options = pt.SolverOptions(exact_chains=False, shortest_step=False, device_order="given")
    if best is None:
        with pytest.raises(pt.InfeasiblePlanError):
            pt.solve(graph, cluster, time_limit_s=10, options=options, **kwargs)
        return
    plan = pt.solve(graph, cluster, time_limit_s=10, options=options, **kwargs)
    pt.validate_plan(plan, graph, cluster)
    # On identical devices any plan's stages can move to the last devices, where the budget is exact.
    assert plan.bottleneck_s == pytest.approx(best, rel=1e-5)


def test_infeasible_1f1b_message_states_the_per_stage_rule():
    # One layer of 10 KiB activations on 8 KiB devices: too large even on the last stage (1 in flight, and
    # its gradients in a backward).
    graph = chain([1e12, 1e12], activation_bytes=[KIB, 10 * KIB])
    cluster = pt.Cluster.uniform(2, memory=8 * KIB, flops_per_s=1e12)
    with pytest.raises(
        pt.InfeasiblePlanError,
        match=r"layer 'l1' alone needs 20.0 KiB .*activations of 1 micro-batch\(es\) in flight under 1f1b "
        r"\(the fewest a stage holds: stage s of K holds min\(K - s, M\), M = 4, so 1 on the last stage\)",
    ):
        pt.exact_chain(graph, cluster, num_microbatches=4, schedule="1f1b")


@settings(max_examples=150, deadline=None)
@given(problem=tight_1f1b_chains())
def test_banded_programs_1f1b_tight_memory_keep_every_split_that_fits(problem):
    """The step search's banded programs prune cut positions the later devices cannot complete
    (threshold_search._viable_ends) with the most room a stage can have, the last stage's budget: they keep every
    split that fits its own stages' budgets, so the least bottleneck is the whole table's, and the step
    program at that limit finds a split (the threshold search's first incumbent)."""
    graph, cluster, m, recompute = problem
    tables = _tables(CostModel(graph, cluster, num_microbatches=m, schedule="1f1b", recompute=recompute))
    n = len(graph)
    whole, _ = _dynamic_program(tables)
    expected = float(whole[:, n].min())
    least, _ = _least_bottleneck(tables)
    if not np.isfinite(expected):
        event("infeasible")
        assert not np.isfinite(least)
        return
    assert least == pytest.approx(expected, rel=1e-12)
    table, _, _ = _step_program(tables, "1f1b", expected * (1 + 1e-9))
    assert np.isfinite(table[:, n].min())


def _boundary_chain(num_nodes: int, output_bytes: int) -> nx.DiGraph:
    """num_nodes layers of 80 MB of weights and 1 MB of activations, the model's input on the first
    (1000 B per micro-batch) and its output on the last (output_bytes per micro-batch)."""
    num = num_nodes
    graph = pt.chain_graph([1e9] * num, param_bytes=[80_000_000] * num, activation_bytes=[10**6] * num)
    graph.nodes["layer_0"]["model_input_bytes"] = 1000
    graph.nodes[f"layer_{num_nodes - 1}"]["model_output_bytes"] = output_bytes
    return graph


@pytest.mark.parametrize(("output_bytes", "cut"), [(0, 3), (30_000_000, 3), (75_000_000, 4), (100_000_000, 4)])
def test_solve_budgets_the_inputs_and_the_collected_outputs(output_bytes, cut):
    # issue 21: the planners budgeted per node without what the step holds beside the layers, so solve cut
    # 3 | 3 where the last stage then needed more than 1.0 GiB (M x outputs collected, and one micro-batch's
    # worked on by the loss and the metrics)
    graph = _boundary_chain(6, output_bytes)
    cluster = pt.Cluster.uniform(2, memory="1GiB")
    plan = pt.solve(graph, cluster, num_microbatches=4, optimizer_slots=0, time_limit_s=5)
    pt.validate_plan(plan, graph, cluster)
    assert plan.assignment == {f"layer_{i}": cluster.names[int(i >= cut)] for i in range(6)}
    # the last stage: weights and gradient sums 3 x 80 MB each, 1 in flight x 1 MB (GPipe's last stage) and
    # 1 MB of gradients in a backward, the outputs (4 + 1) x out
    assert plan.memory_bytes[cluster.names[1]] == (6 - cut) * (240_000_000 + 2 * 10**6) + 5 * output_bytes
    costs = CostModel(graph, cluster, num_microbatches=4, optimizer_slots=0)
    best = brute_force(graph, cluster, num_microbatches=4, optimizer_slots=0)
    assert costs.evaluate(plan.assignment).bottleneck_s == best


def test_solve_refuses_when_the_collected_outputs_leave_no_cut():
    # 4 | 4: the last stage needs 4 x 242 MB and (4 + 1) x 22 MB of outputs, 1,078 MB of 1,074; 5 | 3: the
    # first 5 x 245 MB; 3 | 5: the last 5 x 242 MB
    graph = _boundary_chain(8, 22_000_000)
    cluster = pt.Cluster.uniform(2, memory="1GiB")
    assert brute_force(graph, cluster, num_microbatches=4, optimizer_slots=0) is None
    with pytest.raises(pt.InfeasiblePlanError, match="fits every device"):
        pt.solve(graph, cluster, num_microbatches=4, optimizer_slots=0, time_limit_s=5)
