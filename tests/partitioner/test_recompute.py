"""Stage modes (kept, recomputed) and frozen weights in the cost model, the simulator, the plan and the planners."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
from graphs import KIB, brute_force, chain, diamond, draw_cluster, random_dag
from hypothesis import event, given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cost import CostModel, ModeCost, forward_share, mode_cost, training_flops
from partitioner.errors import GraphError, InfeasiblePlanError, InputError, PlanError
from partitioner.graph import graph_from_dict, graph_to_dict
from partitioner.plan import PLAN_SCHEMA_VERSION, Plan
from partitioner.score import score_assignment
from partitioner.search.coarsen import Coarsening, chain_quotient

G0, G1, G2 = "/GPU:0", "/GPU:1", "/GPU:2"


def _slow_cluster(num_devices: int = 3, memory: object = "1GiB") -> pt.Cluster:
    """1 GFLOP/s devices and 1 MB/s links: the times below are whole seconds."""
    return pt.Cluster.uniform(num_devices, memory=memory, flops_per_s=1e9, bandwidth=1e6)


def _abcd():
    """l0 -> l1 -> l2 -> l3: 3, 6, 3, 3 GFLOP with weights (forward a third); l0's output 1000 B, l1's 2000 B."""
    return chain(
        [3e9, 6e9, 3e9, 3e9],
        param_bytes=[100, 200, 300, 400],
        activation_bytes=[10_000, 20_000, 30_000, 40_000],
        edge_bytes=[1000, 2000, 3000],
    )


SPLIT = {"l0": G0, "l1": G1, "l2": G1, "l3": G2}  # stage 1 (G1) receives l0's 1000 B


# ----- the modes ---------------------------------------------------------------------------------


def test_mode_cost_by_hand():
    kept = mode_cost("kept", forward_s=1.0, backward_s=2.0, weight_bytes=7, activation_bytes=80, input_bytes=8)
    assert kept == ModeCost(forward_s=1.0, backward_s=2.0, weight_bytes=7, held_bytes=80, once_bytes=0)
    assert kept.memory_bytes(4) == 7 + 4 * 80
    again = mode_cost("recomputed", forward_s=1.0, backward_s=2.0, weight_bytes=7, activation_bytes=80, input_bytes=8)
    assert again == ModeCost(forward_s=1.0, backward_s=3.0, weight_bytes=7, held_bytes=8, once_bytes=80)
    assert again.compute_s == 4.0
    assert again.memory_bytes(4) == 7 + 4 * 8 + 80  # inputs x in flight + one micro-batch's activations
    # in the runtime's loop (M > 1) a backward also holds the gradients it makes of one micro-batch's outputs
    # (30) and of the inputs it received (8), in either mode
    looped = mode_cost("kept", weight_bytes=7, activation_bytes=80, input_bytes=8, gradient_bytes=30, looped=True)
    assert (looped.held_bytes, looped.once_bytes, looped.memory_bytes(4)) == (80, 38, 7 + 4 * 80 + 38)
    looped = mode_cost("recomputed", weight_bytes=7, activation_bytes=80, input_bytes=8, gradient_bytes=30, looped=True)
    assert (looped.held_bytes, looped.once_bytes, looped.memory_bytes(4)) == (8, 118, 7 + 4 * 8 + 80 + 38)
    unlooped = mode_cost("kept", activation_bytes=80, gradient_bytes=30)  # M = 1: inlined, freed as it goes
    assert unlooped.once_bytes == 0
    with pytest.raises(InputError, match=r"mode must be one of \('kept', 'recomputed'\). Received: 'offloaded'"):
        mode_cost("offloaded")


def test_costmodel_recomputed_stages_by_hand():
    costs = CostModel(_abcd(), _slow_cluster(), num_microbatches=4, recompute="always")
    ev = costs.evaluate(SPLIT)
    assert ev.recompute == (True, True, False)  # the last stage is never recomputed
    # G1: forward 2 + 1 s, backward 4 + 2 s, plus the forward again; receives 1000 B each way at 1 MB/s.
    assert ev.compute_times[G1] == pytest.approx(3.0 + 6.0 + 3.0)
    assert ev.stage_times[G1] == pytest.approx(12.0 + 0.002)
    assert ev.compute_times[G0] == pytest.approx(1.0 + 2.0 + 1.0)
    assert ev.compute_times[G2] == pytest.approx(3.0)  # kept
    # weights * 5 (weights, gradient, the micro-batch's beside the sum, 2 Adam slots) + M * received bytes
    # + one micro-batch's activations and, in the loop (M > 1), their gradients and the received input's
    assert ev.memory_bytes[G1] == (200 + 300) * 5 + 4 * 1000 + 2 * (20_000 + 30_000) + 1000
    assert ev.memory_bytes[G0] == 100 * 5 + 4 * 0 + 2 * 10_000  # the first stage receives nothing
    # kept, GPipe's last stage: one micro-batch in flight (its backward follows its forward) + the gradients,
    # and a copy of the 3000 B it receives for each of G1's 4 micro-batches (3 waiting for its forwards)
    assert ev.memory_bytes[G2] == 400 * 5 + (1 + 1) * 40_000 + 3000 + 4 * 3000
    kept = CostModel(_abcd(), _slow_cluster(), num_microbatches=4).evaluate(SPLIT)
    assert kept.recompute == (False, False, False)
    # kept: a copy of the 1000 B it receives for each of G0's 4 micro-batches (its forwards keep them)
    assert kept.memory_bytes[G1] == (200 + 300) * 5 + (4 + 1) * (20_000 + 30_000) + 1000 + 4 * 1000
    assert kept.compute_times[G1] == pytest.approx(9.0)


def test_costmodel_recompute_under_1f1b_counts_each_stages_in_flight():
    costs = CostModel(_abcd(), _slow_cluster(), num_microbatches=8, schedule="1f1b", recompute="always")
    ev = costs.evaluate(SPLIT)
    assert ev.in_flight == {G0: 3, G1: 2, G2: 1}
    # + the 1000 B input of the one micro-batch G0 (window 3) runs ahead of G1 (window 2): its held bytes
    # count the inputs of its own 2
    assert ev.memory_bytes[G1] == (200 + 300) * 5 + 2 * 1000 + 2 * (20_000 + 30_000) + 1000 + 1000


def test_costmodel_recompute_given_per_stage():
    costs = CostModel(_abcd(), _slow_cluster(), num_microbatches=4)
    ev = costs.evaluate(SPLIT, recompute=(False, True, False))
    assert ev.recompute == (False, True, False)
    assert ev.memory_bytes[G0] == 100 * 5 + (4 + 1) * 10_000
    with pytest.raises(PlanError, match=r"recompute has 2 entries but the placement has 3 stages"):
        costs.evaluate(SPLIT, recompute=(True, False))
    with pytest.raises(PlanError, match=r"the last stage is never recomputed"):
        costs.evaluate(SPLIT, recompute=(False, False, True))
    with pytest.raises(InputError, match=r"recompute must be one of \('never', 'always', 'auto'\)"):
        CostModel(_abcd(), _slow_cluster(), recompute="sometimes")


def test_costmodel_auto_recomputes_exactly_the_stages_that_do_not_fit():
    # Kept, G1 needs 2500 + (4 + 1) * 50,000 + 1000 = 253,500 B; recomputed 2500 + 4000 + 2 * 50,000 + 1000
    # = 107,500 B (the received 1000 B's gradient in a backward, either mode).
    devices = [pt.Device(G0, memory=10**6), pt.Device(G1, memory=150_000), pt.Device(G2, memory=10**6)]
    costs = CostModel(_abcd(), pt.Cluster(devices, bandwidth=1e6), num_microbatches=4, recompute="auto")
    ev = costs.evaluate(SPLIT)
    assert ev.recompute == (False, True, False)
    assert ev.memory_bytes[G1] == 107_500 and costs.fits(ev)
    # The last stage stays kept even when it does not fit.
    tight_last = [pt.Device(G0, memory=10**6), pt.Device(G1, memory=10**6), pt.Device(G2, memory=1000)]
    costs = CostModel(_abcd(), pt.Cluster(tight_last, bandwidth=1e6), num_microbatches=4, recompute="auto")
    assert costs.evaluate(SPLIT).recompute == (False, False, False)


# ----- the simulator -----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_recomputed_stage_by_hand(schedule):
    graph, cluster = _abcd(), pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e9, bandwidth=1e30)
    costs = CostModel(graph, cluster, num_microbatches=4, schedule=schedule, recompute="always")
    plan = score_assignment(SPLIT, costs, method="manual")
    assert plan.recompute == (True, True, False)
    sim = pt.simulate(plan, graph, cluster)
    durations = {(a.resource, a.kind) for a in sim.timeline if a.kind in ("forward", "backward")}
    for resource, kind in durations:
        spans = [a.duration_s for a in sim.actions_on(resource) if a.kind == kind]
        expected = {
            (G0, "forward"): 1.0,
            (G0, "backward"): 2.0 + 1.0,  # the forward again
            (G1, "forward"): 3.0,
            (G1, "backward"): 6.0 + 3.0,
            (G2, "forward"): 1.0,
            (G2, "backward"): 2.0,  # the last stage keeps its activations
        }[(resource, kind)]
        assert spans == pytest.approx([expected] * 4)
    held = sim.peak_in_flight[G1]
    assert held == (4 if schedule == "gpipe" else 2)
    # copies of a received input: a recomputed stage's held bytes count its own micro-batches', and those the
    # sender runs ahead wait beside them (its window less this one's); a kept stage holds one for each of the
    # sender's micro-batches (windows GPipe 4, 4, 1; 1F1B 3, 2, 1)
    ahead = {"gpipe": 0, "1f1b": 1}[schedule]
    before = {"gpipe": {G1: 4, G2: 4}, "1f1b": {G1: 3, G2: 2}}[schedule]
    assert sim.peak_memory_bytes[G1] == (200 + 300) * 5 + held * 1000 + 2 * (20_000 + 30_000) + 1000 + ahead * 1000
    assert sim.peak_memory_bytes[G2] == 400 * 5 + (sim.peak_in_flight[G2] + 1) * 40_000 + 3000 + before[G2] * 3000
    # The same plan without recomputation: shorter, and it holds every activation.
    kept = pt.simulate(plan, graph, cluster, recompute="never")
    assert kept.step_time_s < sim.step_time_s
    assert kept.peak_memory_bytes[G1] == (200 + 300) * 5 + (held + 1) * (20_000 + 30_000) + 1000 + before[G1] * 1000


def test_plan_step_time_is_the_recomputed_simulation():
    graph, cluster = _abcd(), _slow_cluster()
    always = score_assignment(SPLIT, CostModel(graph, cluster, num_microbatches=4, recompute="always"), method="m")
    never = score_assignment(SPLIT, CostModel(graph, cluster, num_microbatches=4), method="m")
    assert always.step_time_s == pytest.approx(pt.simulate(always, graph, cluster).step_time_s)
    assert always.step_time_s > never.step_time_s
    assert always.bottleneck_s == pytest.approx(never.bottleneck_s + 3.0)  # G1's forward again
    assert always.memory_bytes[G1] < never.memory_bytes[G1]


# ----- the plan ----------------------------------------------------------------------------------


def test_plan_recompute_json_round_trip():
    costs = CostModel(_abcd(), _slow_cluster(), num_microbatches=4, recompute="always")
    plan = score_assignment(SPLIT, costs, method="manual")
    data = plan.to_dict()
    assert data["schema_version"] == PLAN_SCHEMA_VERSION == 4
    assert data["recompute"] == (True, True, False)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.recompute == (True, True, False)


def test_plan_json_of_schema_version_1_loads_without_recompute():
    plan = score_assignment(SPLIT, CostModel(_abcd(), _slow_cluster(), num_microbatches=4), method="manual")
    data = plan.to_dict()
    data["schema_version"] = 1
    del data["recompute"]  # what version 1 wrote
    old = Plan.from_json(json.dumps(data))
    assert old.recompute == (False, False, False)
    assert old == plan
    pt.validate_plan(old, _abcd(), _slow_cluster())


@pytest.mark.parametrize("recompute", [[True, False], [False, False, True], [1, 0, 0]])
def test_plan_json_with_bad_recompute_is_corrupt(recompute):
    data = score_assignment(SPLIT, CostModel(_abcd(), _slow_cluster()), method="manual").to_dict()
    data["recompute"] = recompute
    with pytest.raises(PlanError, match=r"is corrupt: recompute"):
        Plan.from_json(json.dumps(data))


def test_validate_plan_checks_recompute_and_memory_in_its_mode():
    graph = _abcd()
    devices = [pt.Device(G0, memory=10**6), pt.Device(G1, memory=150_000), pt.Device(G2, memory=10**6)]
    cluster = pt.Cluster(devices, bandwidth=1e6)
    kept = score_assignment(SPLIT, CostModel(graph, cluster, num_microbatches=4), method="manual")
    with pytest.raises(PlanError, match=r"Device /GPU:1 needs .* or recompute='auto'"):
        pt.validate_plan(kept, graph, cluster)
    recomputed = score_assignment(
        SPLIT, CostModel(graph, cluster, num_microbatches=4, recompute="auto"), method="manual"
    )
    assert recomputed.recompute == (False, True, False)
    pt.validate_plan(recomputed, graph, cluster)
    with pytest.raises(PlanError, match=r"keep the last stage"):
        pt.validate_plan(dataclasses.replace(recomputed, recompute=(False, True, True)), graph, cluster)


# ----- the planners ------------------------------------------------------------------------------


def _tight(memory_g1: int) -> pt.Cluster:
    devices = [pt.Device(f"/GPU:{i}", memory=m, flops_per_s=1e9) for i, m in enumerate([10**6, memory_g1, 10**6])]
    return pt.Cluster(devices, bandwidth=1e6)


@pytest.mark.parametrize("exact_chains", [True, False])
def test_solve_auto_recomputes_only_when_memory_needs_it(exact_chains):
    # Four equal layers; each holds 100 KB per micro-batch kept, M = 4. Every device must hold one
    # layer at least to balance the stages.
    graph = chain([3e9] * 4, param_bytes=[0] * 4, activation_bytes=[100_000] * 4, edge_bytes=[1000] * 3)
    options = pt.SolverOptions(exact_chains=exact_chains)
    roomy = _slow_cluster(3, memory=10**7)
    never = pt.solve(graph, roomy, num_microbatches=4, options=options)
    auto = pt.solve(graph, roomy, num_microbatches=4, options=options, recompute="auto")
    assert auto.recompute == (False,) * auto.num_stages  # it fits: nothing recomputed
    assert auto.bottleneck_s == pytest.approx(never.bottleneck_s)
    # Kept, a layer needs 500 KB before the last stage (4 in flight and the gradients a backward makes): none
    # fits the first two devices (250 KB), and all four need 800 KB of the last (500 KB; the last stage holds
    # one micro-batch, 200 KB a layer). Recomputed, a layer needs 200 KB + 4 KB of inputs + 1 KB of their
    # gradient; the last stage stays kept (two layers: 400 KB + 1 KB).
    devices = [pt.Device(f"/GPU:{i}", memory=m, flops_per_s=1e9) for i, m in enumerate([250_000, 250_000, 500_000])]
    tight = pt.Cluster(devices, bandwidth=1e6)
    with pytest.raises(InfeasiblePlanError, match=r"Plan with recompute='auto'"):
        pt.solve(graph, tight, num_microbatches=4, options=options)
    plan = pt.solve(graph, tight, num_microbatches=4, options=options, recompute="auto")
    pt.validate_plan(plan, graph, tight)
    assert plan.fits_memory
    assert plan.recompute[:-1] == (True,) * (plan.num_stages - 1) and plan.recompute[-1] is False
    ev = CostModel(graph, tight, num_microbatches=4).evaluate(plan.assignment, plan.recompute)
    assert ev.memory_bytes == plan.memory_bytes


@pytest.mark.parametrize("recompute", ["always", "auto"])
def test_baselines_take_the_recompute_policy(recompute):
    graph = _abcd()
    cluster = _tight(100_000)
    plan = pt.baselines.uniform(graph, _slow_cluster(4), num_microbatches=4, recompute=recompute)
    assert plan.recompute == ((True, True, True, False) if recompute == "always" else (False,) * 4)
    # by_time: [l0], [l1], [l2, l3]. With M = 8, l1 kept needs 1000 + (8 + 1) * 20,000 B > 100,000 B on G1;
    # recomputed 1000 + 8 * 1000 + 2 * 20,000 + 1000 B (weights 200 B x 5: with its gradient, the sum's
    # second copy, Adam; one micro-batch's activations and, in the loop, their gradients and the received
    # input's).
    plan = pt.baselines.by_time(graph, cluster, num_microbatches=8, recompute=recompute)
    assert plan.assignment == {"l0": G0, "l1": G1, "l2": G2, "l3": G2}
    assert plan.recompute == ((True, True, False) if recompute == "always" else (False, True, False))
    assert plan.memory_bytes[G1] == 1000 + 8 * 1000 + 2 * 20_000 + 1000


def _recompute_problem(draw: st.DrawFn, *, dag: bool):
    """Small graphs where activations dominate and tensors between layers are small (whole KiB), on a
    cluster whose memory lies between what recomputation needs and what keeping needs: recomputing pays."""
    m = draw(st.integers(1, 4))
    if dag:
        k = draw(st.integers(1, 3))
        graph = random_dag(random.Random(draw(st.integers(0, 2**32 - 1))), draw(st.integers(max(2, k), 6)))
        for u, v in graph.edges:
            graph.edges[u, v]["bytes"] = draw(st.integers(0, 2)) * KIB
        outputs = {u: max((b for _, _, b in graph.out_edges(u, data="bytes")), default=0) for u in graph}
        for u, v in graph.edges:  # one tensor per node, as in Keras
            graph.edges[u, v]["bytes"] = outputs[u]
    else:
        k = draw(st.integers(1, 3))
        n = draw(st.integers(k, 7))
        graph = chain(
            [draw(st.integers(1, 100)) * 1e9 for _ in range(n)],
            param_bytes=[draw(st.integers(0, 4)) * KIB for _ in range(n)],
            activation_bytes=[draw(st.integers(0, 16)) * KIB for _ in range(n)],
            edge_bytes=[draw(st.integers(0, 2)) * KIB for _ in range(n - 1)],
        )
    kept = sum(d["param_bytes"] * 4 + m * d["activation_bytes"] for _, d in graph.nodes(data=True))
    return graph, draw_cluster(draw, k, kept, headroom=1.5), m


@st.composite
def chain_recompute_problems(draw: st.DrawFn):
    return _recompute_problem(draw, dag=False)


@st.composite
def dag_recompute_problems(draw: st.DrawFn):
    return _recompute_problem(draw, dag=True)


def _brute_force_chain(graph, cluster, **kwargs) -> float | None:
    costs = CostModel(graph, cluster, **kwargs)
    best = None
    for labels in itertools.combinations_with_replacement(range(cluster.num_devices), len(costs.order)):
        ev = costs.evaluate({v: cluster.names[k] for v, k in zip(costs.order, labels, strict=True)})
        if costs.fits(ev) and (best is None or ev.bottleneck_s < best):
            best = ev.bottleneck_s
    return best


@settings(max_examples=120, deadline=None)
@given(problem=chain_recompute_problems(), recompute=st.sampled_from(["always", "auto"]))
def test_exact_chain_with_recompute_equals_brute_force(problem, recompute):
    graph, cluster, m = problem
    expected = _brute_force_chain(graph, cluster, num_microbatches=m, recompute=recompute)
    try:
        plan = pt.exact_chain(
            graph, cluster, num_microbatches=m, recompute=recompute, device_order="given", objective="bottleneck"
        )
    except InfeasiblePlanError:
        assert expected is None
        event("infeasible")
        return
    assert expected is not None
    assert plan.fits_memory
    pt.validate_plan(plan, graph, cluster)
    assert plan.bottleneck_s == pytest.approx(expected, rel=1e-9)
    event(f"recomputed stages: {sum(plan.recompute)}")


@settings(max_examples=40, deadline=None)
@given(problem=dag_recompute_problems(), recompute=st.sampled_from(["always", "auto"]))
def test_cp_sat_with_recompute_matches_brute_force(problem, recompute):
    graph, cluster, m = problem
    expected = brute_force(graph, cluster, num_microbatches=m, recompute=recompute)
    options = pt.SolverOptions(exact_chains=False, num_workers=1, shortest_step=False, device_order="given")
    try:
        plan = pt.solve(graph, cluster, num_microbatches=m, recompute=recompute, options=options, time_limit_s=20)
    except InfeasiblePlanError:
        assert expected is None
        event("infeasible")
        return
    assert expected is not None
    pt.validate_plan(plan, graph, cluster)
    assert plan.status == "optimal"
    assert plan.bottleneck_s == pytest.approx(expected, rel=1e-5)
    event(f"recomputed stages: {sum(plan.recompute)}")


def test_cp_sat_always_recomputes_every_stage_but_the_last():
    graph = diamond(edge_bytes=KIB)
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12, bandwidth="10GB/s")
    options = pt.SolverOptions(exact_chains=False)
    plan = pt.solve(graph, cluster, num_microbatches=4, recompute="always", options=options)
    assert plan.recompute == (True,) * (plan.num_stages - 1) + (False,)
    never = pt.solve(graph, cluster, num_microbatches=4, options=options)
    assert plan.bottleneck_s >= never.bottleneck_s


# ----- frozen weights and the forward/backward split ---------------------------------------------


def test_frozen_layer_memory_is_its_weights_only():
    graph = chain([2e9, 3e9], param_bytes=[1000, 1000], activation_bytes=[0, 0])
    graph.nodes["l0"]["trainable_param_bytes"] = 0  # frozen: no gradients, no optimizer slots
    graph.nodes["l1"]["trainable_param_bytes"] = 500  # e.g. batch norm: gamma/beta trainable, statistics not
    costs = CostModel(graph, _slow_cluster(2), optimizer_slots=2)
    assert costs.weight_bytes("l0") == 1000
    assert costs.weight_bytes("l1") == 1000 + 500 * 3
    ev = costs.evaluate({"l0": G0, "l1": G1})
    assert ev.memory_bytes == {G0: 1000, G1: 2500}
    # Without the attribute every weight is trainable (older profiles): 4x with Adam.
    del graph.nodes["l0"]["trainable_param_bytes"]
    assert CostModel(graph, _slow_cluster(2)).weight_bytes("l0") == 4000


def test_frozen_layer_splits_its_work_as_the_profiler_counts_it():
    # The profiler writes flops = training_flops(forward, trainable); the simulator splits by the same rule.
    frozen = {"flops": training_flops(10.0, False), "param_bytes": 64, "trainable_param_bytes": 0}
    trained = {"flops": training_flops(10.0, True), "param_bytes": 64}
    assert forward_share(frozen) * frozen["flops"] == pytest.approx(10.0)
    assert forward_share(trained) * trained["flops"] == pytest.approx(10.0)
    assert forward_share({"flops": 3.0, "param_bytes": 0, "forward_flops": 2.0}) == pytest.approx(2 / 3)


def test_frozen_layer_forward_and_backward_in_the_simulator():
    graph = chain([2e9, 3e9], param_bytes=[1000, 1000])
    graph.nodes["l0"]["trainable_param_bytes"] = 0
    cluster = _slow_cluster(2)
    plan = score_assignment({"l0": G0, "l1": G1}, CostModel(graph, cluster), method="manual")
    sim = pt.simulate(plan, graph, cluster)
    assert [a.duration_s for a in sim.actions_on(G0)] == pytest.approx([1.0, 1.0])  # half forward, half backward
    assert [a.duration_s for a in sim.actions_on(G1)] == pytest.approx([1.0, 2.0])  # a third forward


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("trainable_param_bytes", 2000, r"trainable_param_bytes=2000; expected bytes between 0 and its param_bytes"),
        ("trainable_param_bytes", -1, r"trainable_param_bytes=-1"),
        ("forward_flops", 1e12, r"forward_flops=1000000000000.0; expected FLOPs between 0 and its flops"),
    ],
)
def test_graph_rejects_bad_frozen_or_forward_figures(key, value, message):
    graph = chain([2e9], param_bytes=[1000])
    graph.nodes["l0"][key] = value
    with pytest.raises(GraphError, match=message):
        pt.validate_graph(graph)


def test_graph_json_keeps_trainable_param_bytes():
    graph = chain([2e9], param_bytes=[1000])
    graph.nodes["l0"]["trainable_param_bytes"] = 0
    assert graph_from_dict(graph_to_dict(graph)).nodes["l0"]["trainable_param_bytes"] == 0


def test_chain_quotient_keeps_the_forward_split_and_frozen_weights():
    graph = chain([3e9, 2e9], param_bytes=[1000, 1000])
    graph.nodes["l1"]["trainable_param_bytes"] = 0  # frozen: forward 1 of 2 GFLOP
    q = chain_quotient(graph, Coarsening((("l0", "l1"),), ((0, 0),)))
    node = q.nodes["l0"]
    assert node["trainable_param_bytes"] == 1000
    assert node["forward_flops"] == pytest.approx(1e9 + 1e9)  # a third of 3 GFLOP, half of 2 GFLOP
    costs, merged = CostModel(graph, _slow_cluster(1)), CostModel(q, _slow_cluster(1))
    assert merged.forward_s["l0"][0] == pytest.approx(costs.forward_s["l0"][0] + costs.forward_s["l1"][0])
    assert merged.weight_bytes("l0") == costs.weight_bytes("l0") + costs.weight_bytes("l1")


def test_plan_module_imports_neither_the_simulator_nor_the_scorer():
    """Plan is a plain record: plan.py builds nothing by simulating (score.py makes plans from placements)."""
    import ast
    from pathlib import Path

    import partitioner.plan

    tree = ast.parse(Path(partitioner.plan.__file__).read_text())
    imported = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert "partitioner.simulate" not in imported
    assert "partitioner.score" not in imported
    assert imported >= {"partitioner.errors"}  # the check reads real imports


def test_score_assignment_records_recompute_and_checks_status():
    costs = CostModel(_abcd(), _slow_cluster(), num_microbatches=4, recompute="always")
    plan = score_assignment(SPLIT, costs, method="manual")
    assert plan.recompute == (True, True, False)
    with pytest.raises(PlanError, match=r"status must be one of"):
        score_assignment(SPLIT, costs, method="manual", status="perfect")


def test_solver_timeout_suggests_recompute_when_a_split_fits_with_it():
    from partitioner.search import solve as solver

    graph = chain([3e9] * 4, param_bytes=[0] * 4, activation_bytes=[100_000] * 4, edge_bytes=[1000] * 3)
    devices = [pt.Device(f"/GPU:{i}", memory=m, flops_per_s=1e9) for i, m in enumerate([250_000, 250_000, 1_100_000])]
    costs = CostModel(graph, pt.Cluster(devices, bandwidth=1e6), num_microbatches=4)
    assert "recompute='auto'" in str(solver._timeout_error(costs, 1.0, {}))
    tiny = CostModel(graph, _slow_cluster(3, memory=10**3), num_microbatches=4)  # fits neither way
    assert "recompute" not in str(solver._timeout_error(tiny, 1.0, {}))
