"""The CP-SAT planner: the exact optimum on chains, valid plans on DAGs, and every constraint it promises."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
from graphs import (
    KIB,
    brute_force,
    chain,
    chain_problems,
    dag_problems,
    diamond,
    legal_baselines,
    random_dag,
    shared_layer_graph,
)
from hypothesis import HealthCheck, event, given, settings

import partitioner as pt
from partitioner.errors import (
    ClusterError,
    InfeasiblePlanError,
    InputError,
    PartitionerError,
    SolverTimeoutError,
)
from partitioner.graph import colocation_groups, load_graph
from partitioner.search import solve as solver_module
from partitioner.search.exhaustive import against_every_plan

G0, G1, G2, G3 = "/GPU:0", "/GPU:1", "/GPU:2", "/GPU:3"

# The model counts time in steps of (slowest device running everything + every transfer) / 1e6, and each
# stage sums up to ~15 rounded terms here, so CP-SAT's optimum is exact to about 1e-5 of the bottleneck.
RESOLUTION = 1e-4
# the bottleneck-optimal plan, stages in the cluster's order
CP_SAT_ONLY = pt.SolverOptions(exact_chains=False, hint=False, shortest_step=False, device_order="given")
GIVEN = pt.SolverOptions(device_order="given")  # the default search, stages in the cluster's order
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cluster(num_devices: int, memory: str | int = "1GiB", bandwidth: object = 1e30, **kwargs) -> pt.Cluster:
    return pt.Cluster.uniform(num_devices, memory=memory, flops_per_s=1e12, bandwidth=bandwidth, **kwargs)


def _devices_of(plan: pt.Plan, nodes) -> list[str]:
    return [plan.assignment[v] for v in nodes]


# ----- properties --------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(problem=chain_problems(min_nodes=2, max_nodes=14, max_devices=4))
def test_solve_matches_exact_chain_on_random_chains(problem):
    graph, cluster, num_microbatches = problem
    try:
        expected = pt.exact_chain(
            graph, cluster, num_microbatches=num_microbatches, device_order="given", objective="bottleneck"
        )
    except InfeasiblePlanError:
        event("infeasible")
        with pytest.raises(InfeasiblePlanError) as raised:
            pt.solve(graph, cluster, num_microbatches=num_microbatches, options=CP_SAT_ONLY, time_limit_s=10)
        assert not isinstance(raised.value, SolverTimeoutError)
        return
    with mock.patch.object(solver_module, "against_every_plan", wraps=against_every_plan) as judged:
        plan = pt.solve(graph, cluster, num_microbatches=num_microbatches, options=CP_SAT_ONLY, time_limit_s=10)
    event(f"{plan.num_stages} of {cluster.num_devices} devices used")
    # CP-SAT's own plan, before the enumeration judged it: optimal up to its integer scaling (RESOLUTION), so
    # the enumeration may return a plan a rounding better (method "... (better than cp-sat)"), never a worse one
    searched = judged.call_args.args[0]
    assert searched.method == "cp-sat"
    assert searched.status == "optimal"
    assert searched.bottleneck_s == pytest.approx(expected.bottleneck_s, rel=RESOLUTION)
    assert plan.method in ("cp-sat", "every legal plan enumerated (better than cp-sat)")
    assert plan.status == "optimal"
    assert plan.bottleneck_s <= searched.bottleneck_s
    assert plan.bottleneck_s == pytest.approx(expected.bottleneck_s, rel=RESOLUTION)
    assert plan.lower_bound_s <= plan.bottleneck_s
    assert plan.lower_bound_s <= expected.bottleneck_s * (1 + RESOLUTION)
    pt.validate_plan(plan, graph, cluster)


def test_solve_returns_the_enumerated_plan_where_cp_sat_rounds_a_near_tie():
    """A chain (found by the property test above) where two splits' bottlenecks differ by 9e-9 relative,
    below CP-SAT's integer resolution: CP-SAT's "optimal" plan is the worse one, and solve returns the
    enumeration's (the exact chain's optimum), not CP-SAT's."""
    graph = chain(
        [96e9, 51e9, 75e9, 34e9, 94e9, 53e9, 80e9, 29e9],
        param_bytes=[k * KIB for k in (4, 8, 11, 6, 8, 11, 12, 4)],
        activation_bytes=[k * KIB for k in (3, 2, 3, 2, 1, 3, 4, 2)],
        edge_bytes=[15778, 2870, 56, 1338, 11046, 169, 31722],
    )
    memories, speeds = (207, 180, 104, 138), (2e12, 1e12, 1e12, 1e12)
    cluster = pt.Cluster(
        [
            pt.Device(f"/GPU:{i}", memory=m * KIB, flops_per_s=f)
            for i, (m, f) in enumerate(zip(memories, speeds, strict=True))
        ],
        bandwidth=1e11,
    )
    expected = pt.exact_chain(graph, cluster, num_microbatches=1, device_order="given", objective="bottleneck")
    plan = pt.solve(graph, cluster, num_microbatches=1, options=CP_SAT_ONLY, time_limit_s=10)
    assert plan.status == "optimal"
    assert plan.bottleneck_s <= expected.bottleneck_s * (1 + 1e-12)


@PROPERTY_SETTINGS
@given(problem=dag_problems(max_nodes=25, max_devices=4, max_shared=2))
def test_solve_gives_a_valid_plan_or_says_why_not_on_random_dags(problem):
    graph, cluster, num_microbatches = problem
    try:
        plan = pt.solve(graph, cluster, num_microbatches=num_microbatches, time_limit_s=10)
    except SolverTimeoutError:
        raise  # tiny graphs must never time out: that is a failure, not an infeasibility
    except InfeasiblePlanError as err:
        reasons = [phrase for phrase in ("alone needs", "in total", "no split into stages") if phrase in str(err)]
        assert reasons, str(err)
        event(f"infeasible: {reasons[0]}")
        return
    event(f"{plan.num_stages} of {cluster.num_devices} devices used")
    pt.validate_plan(plan, graph, cluster)
    assert plan.status in ("optimal", "feasible")
    assert plan.lower_bound_s is not None
    assert plan.lower_bound_s <= plan.bottleneck_s
    # No baseline that fits, keeps shared layers together, and is simulated shorter than solve's answer.
    for other in legal_baselines(graph, cluster, num_microbatches=num_microbatches):
        assert plan.step_time_s <= other.step_time_s * (1 + 1e-9)


def test_solve_prefers_a_baseline_whose_simulated_step_is_shorter():
    # On this DAG the bottleneck-optimal plan steps slower than the parameter-balanced split.
    graph = random_dag(random.Random(1), 20)
    cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12, bandwidth="10GB/s")
    optimal = pt.solve(graph, cluster, time_limit_s=10, options=pt.SolverOptions(shortest_step=False))
    picked = pt.solve(graph, cluster, time_limit_s=10)
    assert optimal.method == "cp-sat" and optimal.status == "optimal"
    # the parameter-balanced split, found by the baseline or the exact DP on the DAG's runs
    assert picked.assignment == pt.baselines.BASELINES["by_params"](graph, cluster).assignment
    assert picked.method in ("by_params (shorter step than cp-sat)", "exact_chain on runs (shorter step than cp-sat)")
    assert picked.step_time_s < optimal.step_time_s
    assert picked.bottleneck_s > optimal.bottleneck_s
    # the solver's proven bound, kept (the bottleneck-optimal plan's is the least bottleneck of every legal
    # plan, enumerated: CP-SAT's bound is that rounded down to its time unit)
    assert picked.lower_bound_s == pytest.approx(optimal.lower_bound_s, rel=1e-5)
    # every legal plan of 20 nodes on 2 devices is scored (partitioner.search.exhaustive): the baseline is the best
    assert picked.status == "optimal" and picked.gap == 0.0
    pt.validate_plan(picked, graph, cluster)


@PROPERTY_SETTINGS
@given(problem=dag_problems(max_nodes=7, max_devices=3, max_shared=1))
def test_solve_matches_brute_force_on_small_dags(problem):
    graph, cluster, num_microbatches = problem
    best = brute_force(graph, cluster, num_microbatches=num_microbatches)
    if best is None:
        event("infeasible")
        with pytest.raises(InfeasiblePlanError) as raised:
            pt.solve(graph, cluster, num_microbatches=num_microbatches, options=CP_SAT_ONLY, time_limit_s=10)
        assert not isinstance(raised.value, SolverTimeoutError)
        return
    plan = pt.solve(graph, cluster, num_microbatches=num_microbatches, options=CP_SAT_ONLY, time_limit_s=10)
    event(f"{plan.num_stages} of {cluster.num_devices} devices used")
    assert plan.status == "optimal"
    assert plan.bottleneck_s == pytest.approx(best, rel=RESOLUTION)
    pt.validate_plan(plan, graph, cluster)


# ----- the answer moves the way it should --------------------------------------------------------


def test_solve_returns_the_documented_fields():
    graph = diamond()
    cluster = _cluster(2, bandwidth="10GB/s")
    plan = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=10)
    assert plan.method == "cp-sat"
    assert set(plan.assignment) == set(graph.nodes)
    assert set(plan.stage_times) == set(plan.memory_bytes) == {G0, G1}
    # chosen by its step, so judged on it: the bound on the step of any plan leaves out the second tensor
    # crossing the cut (a's output to c, 0.2 µs of 10 ms), but the diamond's legal plans are few and all
    # scored (partitioner.search.exhaustive): the plan is the best of them, proven
    assert plan.objective == "step" and plan.status == "optimal"
    assert plan.step_lower_bound_s == plan.step_time_s
    assert plan.gap == 0.0
    assert pt.CostModel(graph, cluster, num_microbatches=4).step_lower_bound_s() < plan.step_time_s * (1 - 1e-6)
    assert plan.lower_bound_s <= plan.bottleneck_s  # the bound on the bottleneck stays
    assert plan.solve_time_s > 0
    pt.validate_plan(plan, graph, cluster)


def test_solve_uses_the_exact_dp_on_chains():
    graph = chain([2e12, 2e12, 1e12, 1e12, 2e12, 4e12])
    plan = pt.solve(graph, _cluster(3), time_limit_s=10)
    assert plan.method == "exact_chain"
    assert plan.bottleneck_s == pytest.approx(4.0)
    cp_sat = pt.solve(graph, _cluster(3), time_limit_s=10, options=CP_SAT_ONLY)
    assert cp_sat.method == "cp-sat"
    assert cp_sat.bottleneck_s == pytest.approx(4.0)


def test_solve_pins_are_honoured():
    graph = chain([1e12] * 6)
    free = pt.solve(graph, _cluster(3), time_limit_s=10)
    assert _devices_of(free, graph.nodes) == [G0, G0, G1, G1, G2, G2]
    pinned = pt.solve(graph, _cluster(3), pins={"l0": G1}, time_limit_s=10)
    assert pinned.method == "cp-sat"  # pins leave the exact DP aside
    assert pinned.assignment["l0"] == G1
    assert G0 not in pinned.assignment.values()  # everything after l0 follows it
    assert pinned.bottleneck_s == pytest.approx(3.0)
    pt.validate_plan(pinned, graph, _cluster(3))


def test_solve_pin_on_the_last_layer_pulls_everything_before_it():
    graph = diamond()
    plan = pt.solve(graph, _cluster(3), pins={"d": G0}, time_limit_s=10)
    assert set(plan.assignment.values()) == {G0}


def test_solve_pins_in_the_middle_of_a_dag():
    graph = random_dag(random.Random(11), 16)
    cluster = _cluster(4, bandwidth="10GB/s")
    free = pt.solve(graph, cluster, time_limit_s=10)
    node = sorted(graph.nodes)[5]
    target = G3 if free.assignment[node] != G3 else G2
    pinned = pt.solve(graph, cluster, pins={node: target}, time_limit_s=10)
    assert pinned.assignment[node] == target
    pt.validate_plan(pinned, graph, cluster)


def test_solve_colocation_groups_stay_together():
    graph = shared_layer_graph()  # input -> dense_call0 -> mid_0 -> mid_1 -> dense_call1 -> head
    cluster = _cluster(3)
    plan = pt.solve(graph, cluster, time_limit_s=10)
    assert plan.assignment["dense_call0"] == plan.assignment["dense_call1"]
    # Stages follow the graph, so everything between the two calls shares their device too.
    assert len({plan.assignment[v] for v in ("dense_call0", "mid_0", "mid_1", "dense_call1")}) == 1
    pt.validate_plan(plan, graph, cluster)
    # Without the group, the best plan splits the calls: the constraint is what keeps them together.
    for v in ("dense_call0", "dense_call1"):
        del graph.nodes[v]["colocation_group"]
    free = pt.solve(graph, cluster, time_limit_s=10, options=CP_SAT_ONLY)
    assert free.assignment["dense_call0"] != free.assignment["dense_call1"]
    assert free.bottleneck_s < plan.bottleneck_s


def test_solve_colocation_groups_on_random_dags():
    for seed in range(4):
        graph = random_dag(random.Random(seed), 18, num_shared=3)
        cluster = _cluster(4, bandwidth="10GB/s")
        plan = pt.solve(graph, cluster, time_limit_s=10)
        for nodes in colocation_groups(graph).values():
            assert len({plan.assignment[v] for v in nodes}) == 1
        pt.validate_plan(plan, graph, cluster)


@pytest.mark.parametrize("graph", [chain([1e12] * 8), random_dag(random.Random(2), 12)], ids=["chain", "dag"])
def test_solve_moves_work_to_the_faster_device(graph):
    devices = [pt.Device(G0, memory="1GiB", flops_per_s=1e12), pt.Device(G1, memory="1GiB", flops_per_s=3e12)]
    cluster = pt.Cluster(devices, bandwidth=1e30)
    plan = pt.solve(graph, cluster, time_limit_s=10, options=CP_SAT_ONLY)
    flops_on = {d: sum(graph.nodes[v]["flops"] for v in plan.nodes_on(d)) for d in (G0, G1)}
    assert flops_on[G1] > 2 * flops_on[G0]
    uniform = pt.solve(graph, _cluster(2), time_limit_s=10, options=CP_SAT_ONLY)
    assert len(plan.nodes_on(G1)) > len(uniform.nodes_on(G1))


def _two_nodes_of_two(inter_node: float) -> pt.Cluster:
    """Four devices, two per machine: 100 GB/s inside a machine, ``inter_node`` bytes/s between machines; 16 GiB
    each, room for the 1 GB tensors of the tests below waiting on GPipe's last stage (M - 1 of them)."""
    devices = [pt.Device(f"/GPU:{i}", memory="16GiB", flops_per_s=1e12) for i in range(4)]
    matrix = [[100e9 if i // 2 == j // 2 else inter_node for j in range(4)] for i in range(4)]
    return pt.Cluster(devices, bandwidth=matrix)


@pytest.mark.parametrize("options", [CP_SAT_ONLY, GIVEN], ids=["cp-sat", "default"])
def test_solve_avoids_cutting_across_a_slow_link(options):
    # Eight 1-second layers, 1 GB between layers: 10 ms inside a machine, 10 s across machines. M = 8, so
    # that pipelining pays under the exact DP's step objective (at M = 1 one device has the shortest step).
    graph = chain([1e12] * 8, edge_bytes=[10**9] * 7)
    fast = pt.solve(graph, _two_nodes_of_two(100e9), num_microbatches=8, time_limit_s=10, options=options)
    assert fast.num_stages == 4
    assert fast.bottleneck_s == pytest.approx(2.02)  # 10 ms each way

    cluster = _two_nodes_of_two(0.1e9)
    plan = pt.solve(graph, cluster, num_microbatches=8, time_limit_s=10, options=options)
    machine = {G0: 0, G1: 0, G2: 1, G3: 1}
    assert len({machine[d] for d in plan.assignment.values()}) == 1
    assert plan.num_stages == 2
    assert plan.bottleneck_s == pytest.approx(4.02)
    pt.validate_plan(plan, graph, cluster)


def test_solve_skip_tensor_takes_the_fast_link():
    # a feeds b and, by a skip edge, d. 0 -> 2 is slow, every other link fast: a on G0 and d on G2 costs
    # 10 s. The best plan keeps a's consumers off G2 or sends a from G1.
    graph = diamond(edge_bytes=10**9)
    for v in graph.nodes:
        graph.nodes[v]["flops"] = 1e12
    devices = [pt.Device(f"/GPU:{i}", memory="1GiB", flops_per_s=1e12) for i in range(3)]
    slow = [[0, 100e9, 0.1e9], [100e9, 0, 100e9], [100e9, 100e9, 0]]
    cluster = pt.Cluster(devices, bandwidth=slow)
    plan = pt.solve(graph, cluster, time_limit_s=10, options=CP_SAT_ONLY)
    sends = {(plan.assignment[u], plan.assignment[v]) for u, v in graph.edges}
    assert (G0, G2) not in sends
    assert plan.bottleneck_s == pytest.approx(brute_force(graph, cluster), rel=RESOLUTION)
    assert plan.bottleneck_s < 10


def test_solve_breaks_ties_by_bytes_sent():
    # l0 takes 4 s alone; the 3 s left fit anywhere. Spreading them costs more transfers for no gain
    # (M = 8: under the exact DP's step objective one device would win at M = 1).
    graph = chain([4e12, 1e12, 1e12, 1e12], edge_bytes=[10**6] * 3)
    cluster = _cluster(3, bandwidth=1e9)
    for options in (CP_SAT_ONLY, GIVEN):
        plan = pt.solve(graph, cluster, num_microbatches=8, time_limit_s=10, options=options)
        assert plan.bottleneck_s == pytest.approx(4.0)
        assert plan.transfer_bytes == 10**6
        assert plan.num_stages == 2


def test_solve_respects_memory():
    # Unconstrained, 1 1 1 | 3 is best; with room for two layers per device the plan is 1 1 | 1 3.
    graph = chain([1e12, 1e12, 1e12, 3e12], param_bytes=[KIB] * 4)
    cluster = _cluster(2, memory=8 * KIB)
    plan = pt.solve(graph, cluster, time_limit_s=10, options=CP_SAT_ONLY)
    assert _devices_of(plan, graph.nodes) == [G0, G0, G1, G1]
    assert plan.fits_memory
    pt.validate_plan(plan, graph, cluster)


def test_solve_cost_time():
    graph = diamond()
    for v, seconds in zip("abcd", [1.0, 2.0, 2.0, 1.0], strict=True):
        graph.nodes[v]["time_s"] = seconds
    graph.graph["profiled_flops_per_s"] = 1e12
    plan = pt.solve(graph, _cluster(2), cost="time", time_limit_s=10, options=CP_SAT_ONLY)
    assert plan.cost == "time"
    assert plan.bottleneck_s == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(6))
def test_solve_never_worse_than_a_baseline_that_fits(seed):
    rng = random.Random(seed)
    graph = random_dag(rng, 20) if seed % 2 else chain([rng.randint(1, 100) * 1e9 for _ in range(20)])
    devices = [pt.Device(f"/GPU:{i}", memory="1GiB", flops_per_s=rng.choice([1e12, 2e12])) for i in range(2 + seed % 3)]
    cluster = pt.Cluster(devices, bandwidth="10GB/s")
    plan = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=10)
    for name, baseline in pt.baselines.BASELINES.items():
        other = baseline(graph, cluster, num_microbatches=4)
        assert other.fits_memory, name
        assert plan.bottleneck_s <= other.bottleneck_s * (1 + RESOLUTION), name


# ----- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [CP_SAT_ONLY, pt.SolverOptions()], ids=["cp-sat", "default"])
def test_solve_one_layer_too_big(options):
    graph = chain([1e12] * 3, param_bytes=[KIB, 4 * KIB, KIB])  # l1 needs 16 KiB with Adam
    with pytest.raises(InfeasiblePlanError, match=r"layer 'l1' alone needs 16.0 KiB .*largest device holds 8.0 KiB"):
        pt.solve(graph, _cluster(3, memory=8 * KIB), time_limit_s=10, options=options)


def test_solve_shared_layer_group_too_big():
    graph = shared_layer_graph()  # every node 1 KiB of weights: 4 KiB with Adam, 5 KiB with one micro-batch
    with pytest.raises(InfeasiblePlanError, match=r"shared layer group \['dense_call0', 'dense_call1'\] alone needs"):
        pt.solve(graph, _cluster(3, memory=9 * KIB), time_limit_s=10)


def test_solve_too_big_in_total():
    graph = diamond()  # 4 nodes of 5 KiB each (1 KiB weights x 4 + 1 KiB activations)
    with pytest.raises(
        InfeasiblePlanError, match=r"needs 20.0 KiB in total .*the 2 devices hold 12.0 KiB \(8.0 KiB short\)"
    ):
        pt.solve(graph, _cluster(2, memory=6 * KIB), time_limit_s=10)


def test_solve_too_big_in_total_counts_microbatches():
    # Every layer holds at least one micro-batch's activations (1 KiB, on the last stage) and, with M > 1, their
    # gradients while a backward runs: 8 KiB in all at M = 5, more than 2 x 3 KiB; at M = 1, 1 | 3 fits
    graph = chain([1e12] * 4, activation_bytes=[KIB] * 4)
    pt.solve(graph, _cluster(2, memory=3 * KIB), num_microbatches=1, time_limit_s=10)
    with pytest.raises(
        InfeasiblePlanError,
        match=r"needs 8.0 KiB in total \(.*activations of 1 micro-batch\(es\) in flight under gpipe .*the gradients",
    ):
        pt.solve(graph, _cluster(2, memory=3 * KIB), num_microbatches=5, time_limit_s=10)


def test_solve_layers_that_cannot_be_packed():
    # Three 6 KiB layers, two 9 KiB devices: 18 KiB fit in total, but some device must take two layers.
    graph = chain([1e12] * 3, param_bytes=[1536] * 3)
    with pytest.raises(InfeasiblePlanError, match=r"no split into stages that follow the graph's order fits"):
        pt.solve(graph, _cluster(2, memory=9 * KIB), time_limit_s=10, options=CP_SAT_ONLY)


def test_solve_pins_contradicting_the_order():
    graph = chain([1e12] * 3)
    with pytest.raises(
        InfeasiblePlanError,
        match=r"Pins contradict the pipeline order: 'l0' is pinned to /GPU:1 but .*'l1' to the earlier",
    ):
        pt.solve(graph, _cluster(2), pins={"l0": G1, "l1": G0}, time_limit_s=10)


def test_solve_pins_splitting_a_shared_layer_group():
    graph = shared_layer_graph()  # input -> dense_call0 -> mid_0 -> mid_1 -> dense_call1 -> head
    message = (
        r"Pins split shared layer 'dense': its calls \['dense_call0', 'dense_call1'\] share weights, .* the 4 "
        r"layers from its first call to its last run there too; but 'dense_call0' is pinned to /GPU:0 and "
        r"'mid_1' to /GPU:1"
    )
    with pytest.raises(InfeasiblePlanError, match=message):
        pt.solve(graph, _cluster(2), pins={"dense_call0": G0, "mid_1": G1}, time_limit_s=10)
    pt.solve(graph, _cluster(2), pins={"dense_call0": G0, "head": G1}, time_limit_s=10)  # after the group: fine


def test_solve_pinned_layer_too_big_for_its_device():
    graph = chain([1e12] * 2, param_bytes=[2 * KIB, KIB])  # l0 needs 8 KiB
    cluster = pt.Cluster([pt.Device(G0, memory=4 * KIB), pt.Device(G1, memory=16 * KIB)])
    pt.solve(graph, cluster, time_limit_s=10)  # fits on G1
    with pytest.raises(InfeasiblePlanError, match=r"layer 'l0' alone needs 8.0 KiB .*its pinned device /GPU:0 holds"):
        pt.solve(graph, cluster, pins={"l0": G0}, time_limit_s=10)


def test_solve_timeout_without_a_plan(monkeypatch):
    # Whether CP-SAT finds a first solution before a tiny time limit depends on the machine's speed and
    # load, so no real run can hit this branch deterministically. Instead CpSolver.solve reports what it
    # reports at a time limit with no solution: UNKNOWN. The solver must turn that into SolverTimeoutError.
    cp_model = solver_module.cp_model
    monkeypatch.setattr(cp_model.CpSolver, "solve", lambda self, model, *args, **kwargs: cp_model.UNKNOWN)
    graph = random_dag(random.Random(0), 10)
    with pytest.raises(SolverTimeoutError, match=r"found no feasible plan within time_limit_s=0.5 for 10 nodes on 2"):
        pt.solve(graph, _cluster(2), time_limit_s=0.5)


def test_solve_timeout_is_an_infeasible_plan_error():
    assert issubclass(SolverTimeoutError, InfeasiblePlanError)


def test_solve_invalid_model_is_an_internal_error(monkeypatch):
    cp_model = solver_module.cp_model
    monkeypatch.setattr(cp_model.CpSolver, "solve", lambda self, model, *args, **kwargs: cp_model.MODEL_INVALID)
    with pytest.raises(PartitionerError, match="Internal error: the CP-SAT model is invalid"):
        pt.solve(diamond(), _cluster(2), time_limit_s=1)


@pytest.mark.parametrize("limit", [0, -1, 0.0, float("nan"), True, "10"])
def test_solve_time_limit_must_be_positive(limit):
    with pytest.raises(InputError, match=r"time_limit_s must be a positive number of seconds. Received:"):
        pt.solve(diamond(), _cluster(2), time_limit_s=limit)


def test_solve_unknown_pinned_device_lists_the_devices():
    with pytest.raises(ClusterError, match=r"Unknown device '/GPU:5'. The cluster has: \['/GPU:0', '/GPU:1'\]"):
        pt.solve(diamond(), _cluster(2), pins={"a": "/GPU:5"}, time_limit_s=10)


def test_solve_unknown_pinned_node():
    with pytest.raises(InputError, match=r"Pinned node\(s\) \['zz'\] are not in the layer graph"):
        pt.solve(diamond(), _cluster(2), pins={"zz": G0}, time_limit_s=10)


def test_solve_more_devices_than_nodes():
    with pytest.raises(InputError, match=r"The cluster has 5 devices but the graph has only 4 nodes"):
        pt.solve(diamond(), _cluster(5), time_limit_s=10)


def test_solve_checks_the_graph():
    graph = diamond()
    del graph.nodes["c"]["activation_bytes"]
    with pytest.raises(pt.GraphError, match=r"Node 'c' has no numeric 'activation_bytes'"):
        pt.solve(graph, _cluster(2), time_limit_s=10)


@pytest.mark.parametrize("exact_chains", [True, False])
def test_solve_1f1b_search_budgets_each_stage_what_it_holds(exact_chains: bool) -> None:
    # 1F1B holds 2 micro-batches on stage 0 and 1 on stage 1, each one more while a backward runs (its
    # gradients). Neither device holds all 4 layers (2 x 3500 of 5500 bytes); split 1 + 3, stage 0 holds
    # 3 x 1000 and stage 1 2 x 2500: it fits. Budgeting every layer for the fullest stage (2) fitted nothing
    # and solve fell back to a baseline; the chain DP budgets each stage its own, CP-SAT device k of D
    # min(D - k, M) (docs/cost-model.md).
    graph = pt.chain_graph([3e9, 1e9, 1e9, 1e9], activation_bytes=[1000, 1000, 1000, 500])
    cluster = pt.Cluster([pt.Device(f"d{i}", memory=5500, flops_per_s=1e12) for i in range(2)])
    settings = dict(num_microbatches=2, optimizer_slots=0, options=pt.SolverOptions(exact_chains=exact_chains))
    plan = pt.solve(graph, cluster, schedule="1f1b", time_limit_s=5, **settings)
    assert plan.fits_memory
    assert plan.status != "heuristic" and "fits" not in plan.method, plan.method
    assert plan.method.startswith("exact_chain" if exact_chains else "cp-sat")
    assert plan.num_stages == 2 and plan.memory_bytes == {"d0": 3000, "d1": 5000}
    # GPipe holds 2 micro-batches on stage 0 and 1 on the last, as 1F1B does for K = 2 and M = 2
    gpipe = pt.solve(graph, cluster, schedule="gpipe", time_limit_s=5, **settings)
    assert (gpipe.assignment, gpipe.memory_bytes) == (plan.assignment, plan.memory_bytes)


def test_two_nodes_never_give_a_longer_step_than_one_node_alone() -> None:
    # ResNet50 (the planner_quality graph) on 2 nodes of 8 H100s: the bottleneck-optimal 16-device plans
    # step slower than the best plan on the first node (fill and drain cross the slow inter-node link).
    # solve plans one island of fast links with a third of its time and keeps the shorter step.
    graph = load_graph(Path(__file__).parents[2] / "benchmarks/planner_quality/graphs/ResNet50-b32-m8.json")
    cluster = pt.Cluster.from_json("2x8xH100-ib")
    whole = pt.solve(graph, cluster, num_microbatches=8, time_limit_s=6)
    node = pt.solve(graph, cluster.take(8), num_microbatches=8, time_limit_s=2)
    assert whole.step_time_s <= node.step_time_s * (1 + 1e-9)


def test_cp_sat_bound_counts_the_fixed_cost_of_each_stage() -> None:
    # Every stage pays its device's action_overhead_s for its forward and its backward; CP-SAT's model
    # leaves that constant out of its stage times, so its bound must add it back (else "optimal" plans
    # showed gaps of 2 x overhead / bottleneck).
    graph = random_dag(random.Random(0), 8)  # stages of about 0.1 s: the model's bound, not the cost model's, binds
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12, action_overhead_s=1e-2)
    plan = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=5, options=pt.SolverOptions(shortest_step=False))
    assert plan.method == "cp-sat" and plan.status == "optimal"
    assert plan.lower_bound_s <= plan.bottleneck_s and plan.gap < 1e-3
