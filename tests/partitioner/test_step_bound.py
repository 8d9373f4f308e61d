"""``CostModel.step_lower_bound_s`` against brute force: no legal plan's simulated step is below it.

Brute force: every assignment of the nodes of a small random chain or DAG to 1..K stages with every
edge forward (``test_dag_step.stage_labelings``), on every sequence of distinct devices, each stage
kept or recomputed at random, simulated by partitioner.simulate, memory ignored (the bound holds for
every plan, fitting or not). Clusters mix speeds, link speeds and fixed costs per pass. The bound is
also met exactly where the best plan is known (one device; equal stages of a chain), so a bound
inflated by any margin fails those tests.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
from graphs import BANDWIDTHS, SPEEDS, chain
from graphs import random_dag as random_test_dag
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_dag_step import every_plan

import partitioner as pt
from partitioner.cost import CostModel, path_step_bound, pipeline_path_bound
from partitioner.search.threshold_search import STEP_TOLERANCE
from partitioner.simulate import simulate_assignment

SLACK = 1 + 1e-9  # floating-point rounding between the bound's sums and the simulator's


def every_step(graph: nx.DiGraph, cluster: pt.Cluster, rng: random.Random, **kwargs: object):
    """The simulated step of every legal plan (memory ignored), each stage kept or recomputed at random."""
    for costs, assignment, num_stages in every_plan(graph, cluster, **kwargs):
        recompute = [rng.random() < 0.3 for _ in range(num_stages - 1)] + [False]
        yield simulate_assignment(costs, assignment, recompute=recompute).step_time_s


@st.composite
def bound_problems(draw: st.DrawFn):
    """(chain or DAG of 1-5 nodes, some with a forward_flops of their own; 1-3 devices of mixed speeds,
    links and fixed costs per pass; M in 1..8; schedule; a seed for the recompute choices)."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 5))
    if draw(st.booleans()):
        graph = chain(
            [rng.randint(1, 100) * 1e9 for _ in range(n)],
            param_bytes=[rng.choice([0, 4096]) for _ in range(n)],
            edge_bytes=[rng.choice([0, rng.randint(1, 10**8)]) for _ in range(n - 1)],
        )
    else:
        graph = random_test_dag(rng, n, skip_prob=0.5)
    for v in graph.nodes:
        if rng.random() < 0.3:  # a forward share of the node's own, up to all of its work
            graph.nodes[v]["forward_flops"] = graph.nodes[v]["flops"] * rng.choice([0.1, 0.5, 0.9, 1.0])
    k = draw(st.integers(1, 3))
    devices = [
        pt.Device(
            f"/GPU:{i}",
            memory="1GiB",
            flops_per_s=draw(st.sampled_from(SPEEDS)),
            action_overhead_s=draw(st.sampled_from([0.0, 1e-3, 2e-2])),
        )
        for i in range(k)
    ]
    bandwidth = [[draw(st.sampled_from(BANDWIDTHS)) for _ in range(k)] for _ in range(k)]
    m = draw(st.integers(1, 8))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    return graph, pt.Cluster(devices, bandwidth=bandwidth), m, schedule, rng.randrange(2**32)


@settings(max_examples=60, deadline=None)
@given(bound_problems())
def test_step_lower_bound_never_exceeds_a_plans_step(problem):
    graph, cluster, m, schedule, seed = problem
    costs = CostModel(graph, cluster, num_microbatches=m, schedule=schedule)
    bound = costs.step_lower_bound_s()
    shortest = min(every_step(graph, cluster, random.Random(seed), num_microbatches=m, schedule=schedule))
    assert bound <= shortest * SLACK, costs.step_bound_terms()


@settings(max_examples=15, deadline=None)
@given(bound_problems())
def test_solve_claims_optimal_only_for_the_shortest_step(problem):
    # Every plan fits (1 GiB devices), so brute force over all plans is the optimum solve is judged against.
    graph, cluster, m, schedule, _ = problem
    assume(graph.number_of_nodes() >= cluster.num_devices)  # every device could hold a stage
    best = min(every_step(graph, cluster, random.Random(0), num_microbatches=m, schedule=schedule))
    plan = pt.solve(graph, cluster, num_microbatches=m, schedule=schedule, time_limit_s=5)
    assert plan.objective == "step"
    assert plan.step_lower_bound_s <= best * SLACK
    if plan.status == "optimal":
        assert plan.step_time_s <= best * (1 + STEP_TOLERANCE)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("overhead", [0.0, 1e-3])
def test_step_lower_bound_is_the_step_on_one_device(schedule, overhead):
    # One device: every plan is the whole graph there, M times; the bound is that step.
    graph = chain([3e9, 5e9, 2e9], edge_bytes=[10**6, 10**6])
    device = pt.Device("/GPU:0", memory="1GiB", flops_per_s=1e12, action_overhead_s=overhead)
    costs = CostModel(graph, pt.Cluster([device]), num_microbatches=4, schedule=schedule)
    step = simulate_assignment(costs, dict.fromkeys(graph.nodes, "/GPU:0")).step_time_s
    assert step == pytest.approx(4 * (10e-3 + 2 * overhead))
    assert costs.step_lower_bound_s() == pytest.approx(step, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_step_lower_bound_of_equal_stages_is_below_the_best_and_meets_it_at_one_microbatch(schedule, m):
    # A chain of 4 equal layers on 4 equal devices, nothing sent, against the brute-force optimum. At M = 1
    # nothing overlaps and the bound is its step (every layer once, on one device); with more micro-batches
    # it is below (a stage's share of the work need not be whole layers in the proofs, and under GPipe a
    # stage before the last may take more work than the last).
    graph = chain([1e9] * 4, edge_bytes=[0] * 3)
    cluster = pt.Cluster.uniform(4, memory="1GiB", flops_per_s=1e12, action_overhead_s=1e-4)
    costs = CostModel(graph, cluster, num_microbatches=m, schedule=schedule)
    best = min(every_step(graph, cluster, random.Random(0), num_microbatches=m, schedule=schedule))
    assert costs.step_lower_bound_s() <= best * (1 + 1e-12)
    if m == 1:
        assert costs.step_lower_bound_s() == pytest.approx(best, rel=1e-9)


def test_step_bound_terms_name_each_proof():
    costs = CostModel(chain([1e12] * 4), pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12), num_microbatches=4)
    terms = costs.step_bound_terms()
    assert set(terms) == {"spread", "node", "path", "pipeline"}
    assert terms["spread"] == pytest.approx(4 * 4 / 2)  # M x W / S
    best = pt.exact_chain(chain([1e12] * 4), pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12), num_microbatches=4)
    assert best.step_time_s == pytest.approx(10.0)  # (M + K - 1) x 2 s
    assert costs.step_lower_bound_s() == max(terms.values()) <= best.step_time_s


def test_path_step_bound_counts_the_cheapest_hops():
    # Two positions on a path of 8 FLOPs at 1 FLOP/s, M = 2: with free hops the bound splits the work;
    # a hop of 1 s there and back raises the second position's inequality by 1 s.
    free = path_step_bound(8.0, [1.0, 1.0], num_microbatches=2)
    assert free == pytest.approx(32 / 3)  # c_1 = T / 2, c_2 = T / 4: 3 T / 4 = 8
    assert path_step_bound(8.0, [1.0, 1.0], num_microbatches=2, hops_s=[1.0, 5.0]) == pytest.approx((8 + 0.5) * 4 / 3)


def test_pipeline_path_bound_uses_the_least_largest_piece():
    # Pieces of 6, 1, 1 FLOPs on 2 devices: the largest piece of any cut is at least 6, not 8 / 2.
    assert pipeline_path_bound([6.0, 1.0, 1.0], [1.0, 1.0], num_microbatches=3) == pytest.approx(8 + 2 * 6, rel=1e-8)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_lower_bound_counts_the_transfer_of_a_cut(schedule):
    # Two layers of 1 s (half forward) and 0.1 s each way between them, M = 4: the best GPipe plan splits
    # them, 2 x 1 s + 0.2 s for one micro-batch there and back, and 3 more micro-batches of 1 s each: 5.2 s.
    # The bound counts the hop: with a link 10 times faster it is lower, by at most the 0.18 s saved.
    graph = chain([1e12, 1e12], edge_bytes=[10**9])
    bounds = []
    for bandwidth in (1e10, 1e11):
        cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12, bandwidth=bandwidth)
        costs = CostModel(graph, cluster, num_microbatches=4, schedule=schedule)
        best = min(every_step(graph, cluster, random.Random(0), num_microbatches=4, schedule=schedule))
        assert costs.step_lower_bound_s() <= best * (1 + 1e-12)
        bounds.append(costs.step_lower_bound_s())
        if schedule == "gpipe" and bandwidth == 1e10:
            assert best == pytest.approx(5.2)
    assert 0 < bounds[0] - bounds[1] <= 0.18 + 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("skip", [False, True])
def test_solve_reports_optimal_where_the_step_meets_its_bound(schedule, skip):
    # Three layers of 1 s, 1 GB tensors on 1 GB/s links, M = 1: nothing overlaps and a cut costs 2 s, so one
    # device is the best plan, and its step (every layer once, its fixed costs) is the bound on any plan's:
    # proven optimal under either schedule, on the chain (the exact DP) and with a skip edge (CP-SAT, then
    # the refinement on the step), where the bottleneck alone proved nothing about the step.
    graph = chain([1e12] * 3, edge_bytes=[10**9] * 2)
    if skip:
        graph.add_edge("l0", "l2", bytes=10**9)
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12, bandwidth="1GB/s", action_overhead_s=1e-3)
    plan = pt.solve(graph, cluster, num_microbatches=1, schedule=schedule, time_limit_s=10)
    assert plan.num_stages == 1 and plan.step_time_s == pytest.approx(3.002)
    assert plan.status == "optimal" and plan.objective == "step" and plan.gap == pytest.approx(0.0, abs=1e-9)
