"""The exact chain DP's default objective, the simulated step, against brute force over every plan.

Brute force: every contiguous split of the chain into 1..K blocks, on distinct devices in every order
(permutations of every subset), each that fits memory simulated by partitioner.simulate. GPipe's step
is what the planner's formula computes (partitioner.search.threshold_search._split_step), so the plan must be within the
threshold search's tolerance, STEP_TOLERANCE. For 1F1B the step of a split is exact too (the schedule
replayed on the stage figures), but no search over splits is proven: a local search from several starts
finds the plan, so it can stop at a split a few moves from the best. The test holds it to 1.01 of the best,
the issue's goal for pt.solve (benchmarks/planner_quality, "Random chains against brute force", measures
worst and mean): hypothesis found 1.0033 (3 devices of two speeds, M = 3) where 1.001 was asked.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from graphs import KIB, chain, chain_problems, draw_cluster, memory_need
from hypothesis import event, given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cluster import reorder
from partitioner.cost import CostModel
from partitioner.graph import load_graph
from partitioner.search.baselines import BASELINES, split_with
from partitioner.search.bottleneck_dp import _dynamic_program, _least_bytes_split, _tables
from partitioner.search.local_search import _local_search
from partitioner.search.order import fastest_on_heaviest
from partitioner.search.threshold_search import (
    STEP_TOLERANCE,
    _figures,
    _Found,
    _least_bottleneck,
    _split_step,
    _step_program,
)
from partitioner.simulate import simulate_assignment
from partitioner.synthetic import random_chain

ONE_F_ONE_B_SLACK = 1.01  # 1F1B: the worst ratio allowed, the goal (module docstring)


def every_plan(graph, cluster, **kwargs):
    """(simulated step, plan figures) of every legal plan: blocks on distinct devices in any order."""
    order = CostModel(graph, cluster, **kwargs).order
    n = len(order)
    for blocks in range(1, min(n, cluster.num_devices) + 1):
        for devices in itertools.permutations(range(cluster.num_devices), blocks):
            rest = [d for d in range(cluster.num_devices) if d not in devices]
            listed = reorder(cluster, [*devices, *rest])
            costs = CostModel(graph, listed, **kwargs)
            for cuts in itertools.combinations(range(1, n), blocks - 1):
                bounds = [0, *cuts, n]
                assignment = {v: listed.names[b] for b in range(blocks) for v in order[bounds[b] : bounds[b + 1]]}
                if costs.fits(costs.evaluate(assignment)):
                    yield simulate_assignment(costs, assignment).step_time_s


@st.composite
def step_problems(draw: st.DrawFn):
    """(chain of 1-7 layers, cluster of 1-3 devices, maybe of two kinds, M in 1..8, schedule)."""
    k = draw(st.integers(1, 3))
    n = draw(st.integers(k, 7))  # check_stage_count: at least as many layers as devices
    graph = chain(
        [draw(st.integers(1, 100)) * 1e9 for _ in range(n)],
        param_bytes=[draw(st.integers(0, 16)) * KIB for _ in range(n)],
        activation_bytes=[draw(st.integers(0, 4)) * KIB for _ in range(n)],
        edge_bytes=[draw(st.integers(0, 10**7)) for _ in range(n - 1)],
    )
    m = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    # Memory around what a plan holds: M micro-batches on every stage for GPipe, at most min(K, M) for
    # 1F1B (the DP budgets each stage its own min(K - s, M), as brute force counts it).
    held = m if schedule == "gpipe" else min(k, m)
    cluster = draw_cluster(draw, k, memory_need(graph, held, num_devices=k))
    return graph, cluster, m, schedule


@settings(max_examples=100, deadline=None)
@given(problem=step_problems())
def test_exact_chain_step_equals_brute_force(problem):
    graph, cluster, m, schedule = problem
    steps = list(every_plan(graph, cluster, num_microbatches=m, schedule=schedule))
    if not steps:
        event("infeasible")
        with pytest.raises(pt.InfeasiblePlanError):
            pt.exact_chain(graph, cluster, num_microbatches=m, schedule=schedule)
        return
    plan = pt.exact_chain(graph, cluster, num_microbatches=m, schedule=schedule)
    best = min(steps)
    event(f"{schedule}: {plan.num_stages} of {cluster.num_devices} devices used")
    assert plan.step_time_s == pytest.approx(pt.simulate(plan, graph, cluster).step_time_s, rel=1e-12)
    assert plan.fits_memory
    pt.validate_plan(plan, graph, cluster)
    if schedule == "gpipe":
        assert plan.step_time_s <= best * (1 + STEP_TOLERANCE) + 1e-15
    else:  # never worse than the least-bottleneck plans (the objective before), and near the best
        before = pt.exact_chain(graph, cluster, num_microbatches=m, schedule=schedule, objective="bottleneck")
        assert plan.step_time_s <= before.step_time_s * (1 + 1e-12)
        assert plan.step_time_s <= best * ONE_F_ONE_B_SLACK


@settings(max_examples=40, deadline=None)
@given(problem=step_problems(), schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_step_formula_is_the_simulated_step(problem, schedule):
    """The step the DP ranks splits by (GPipe's closed form, 1F1B's replay) is the simulator's, for any split."""
    graph, cluster, m, _ = problem
    costs = CostModel(graph, cluster, num_microbatches=m, schedule=schedule)
    order, k = costs.order, cluster.num_devices
    labels = [min(k - 1, i * k // len(order)) for i in range(len(order))]
    assignment = {v: cluster.names[d] for v, d in zip(order, labels, strict=True)}
    ev = costs.evaluate(assignment)
    used = [cluster.index(d) for d in ev.stages]
    figures = []
    for s, c in enumerate(ev.stage_costs):
        size = ev.sent_bytes.get((s - 1, s), 0) if s else 0
        a = size / cluster.bandwidth(used[s - 1], used[s]) if s else 0.0
        g = size / cluster.bandwidth(used[s], used[s - 1]) if s else 0.0
        figures.append((c.forward_s, c.backward_s, a, g))
    simulated = simulate_assignment(costs, assignment).step_time_s
    assert _split_step(schedule, m, figures) == pytest.approx(simulated, rel=1e-9)


def test_exact_chain_one_device_when_nothing_overlaps():
    # M = 1: pipelining overlaps nothing, so a split only adds transfers: one device (the fastest).
    graph = chain([4e12] * 6, edge_bytes=[10**8] * 5)
    devices = [pt.Device(f"/GPU:{i}", memory="1GiB", flops_per_s=s) for i, s in enumerate((1e12, 2e12, 1e12))]
    plan = pt.exact_chain(graph, pt.Cluster(devices, bandwidth=1e10), num_microbatches=1)
    assert plan.num_stages == 1 and plan.stages == ("/GPU:1",)
    assert plan.step_time_s == pytest.approx(12.0)
    assert plan.status == "optimal"


def test_exact_chain_step_beats_the_least_bottleneck():
    # Six 1 s layers (half forward, half backward), 0.75 s to send a cut's tensor each way, M = 2, GPipe
    # (GPipe.closed_step: A = every stage and link + (M - 1) x the slowest machine, the last stage's forward
    # and backward one machine; B = the stages before the last there and back + (M - 1) x their slowest
    # forward and backward). Least bottleneck: 2 | 2 | 2 (2 s + 1.5 s receiving a stage), A = 6 + 3 + (M - 1)
    # x 2 = 11 s (B = 5.5 + 2). Shortest step: 4 | 2, A = 6 + 1.5 + (M - 1) x max(2, 2, 1 + 1) = 9.5 s
    # (B = 4 + 4); 3 | 3 gives A = 7.5 + 3 = 10.5 s, one device alone 12 s.
    graph = chain([1e12] * 6, edge_bytes=[75 * 10**8] * 5)
    # room for the 7.5 GB a stage receives: a copy for each of its sender's 2 micro-batches, and its gradient,
    # which its backward makes (M > 1)
    cluster = pt.Cluster.uniform(3, memory="32GiB", flops_per_s=1e12, bandwidth=1e10)
    step = pt.exact_chain(graph, cluster, num_microbatches=2, device_order="given")
    bottleneck = pt.exact_chain(graph, cluster, num_microbatches=2, device_order="given", objective="bottleneck")
    assert bottleneck.num_stages == 3 and bottleneck.step_time_s == pytest.approx(11.0)
    assert step.num_stages == 2 and step.step_time_s == pytest.approx(9.5)
    assert step.status == "optimal"
    assert step.step_time_s == pytest.approx(min(every_plan(graph, cluster, num_microbatches=2)), rel=1e-12)


def test_exact_chain_rejects_an_unknown_objective():
    with pytest.raises(pt.InputError, match="objective must be one of"):
        pt.exact_chain(chain([1e9, 1e9]), pt.Cluster.uniform(2, memory="1GiB"), objective="throughput")


def test_the_search_includes_metis_order_where_it_interleaves_device_kinds() -> None:
    # 4 T4s + 4 V100s: 70 arrangements of the two kinds, above MAX_ORDERS, so the candidate orders keep each
    # kind in one run; Metis' order (the best baseline's heaviest stage on the fastest device) interleaves
    # them, and for VGG16 it steps faster (231.9 ms against 248.0 ms before it was searched).
    graph = load_graph(Path(__file__).parents[2] / "benchmarks/planner_quality/graphs/VGG16-b32-m8.json")
    cluster = pt.Cluster.from_json("4xT4+4xV100")
    plan = pt.exact_chain(graph, cluster, num_microbatches=8)
    costs = CostModel(graph, cluster, num_microbatches=8)
    legal = [p for p in (split_with(costs, name) for name in BASELINES) if p.fits_memory]
    base = min(legal, key=lambda p: p.step_time_s)
    work = [sum(graph.nodes[v]["flops"] for v in base.nodes_on(d)) for d in base.stages]
    metis = reorder(cluster, fastest_on_heaviest(cluster, work))
    in_metis_order = pt.exact_chain(graph, metis, num_microbatches=8, device_order="given")
    assert plan.step_time_s <= in_metis_order.step_time_s * (1 + 1e-9)


def test_one_f_one_b_plan_is_the_best_split_of_a_random_chain():
    # Case 16 of benchmarks/planner_quality's random chains: an estimate of the 1F1B step ranked a 3-stage
    # split first, 1.125x the best of every plan (4 | 3 | 7 | 1 layers on all 4 devices) at M = 16.
    graph = random_chain(15, seed=335069990)
    cluster = pt.Cluster.uniform(4, memory=3430564944, flops_per_s=200e12, bandwidth=50e9)
    costs = CostModel(graph, cluster, num_microbatches=16, schedule="1f1b")
    sizes = (4, 3, 7, 1)
    bounds = list(itertools.accumulate(sizes, initial=0))
    best = {v: cluster.names[s] for s in range(4) for v in costs.order[bounds[s] : bounds[s + 1]]}
    plan = pt.exact_chain(graph, cluster, num_microbatches=16, schedule="1f1b")
    assert plan.step_time_s <= simulate_assignment(costs, best).step_time_s * (1 + 1e-9)


def every_split(num_nodes: int, num_devices: int):
    """Every split of a chain into blocks on increasing devices (any subset of them), as the DPs see them."""
    for count in range(1, min(num_nodes, num_devices) + 1):
        for devices in itertools.combinations(range(num_devices), count):
            for cuts in itertools.combinations(range(1, num_nodes), count - 1):
                bounds = [0, *cuts, num_nodes]
                yield tuple((d, bounds[s], bounds[s + 1]) for s, d in enumerate(devices))


@settings(max_examples=60, deadline=None)
@given(problem=step_problems(), recompute=st.sampled_from(["never", "auto", "always"]), share=st.floats(0.0, 1.0))
def test_step_program_is_the_least_sum_over_every_split_within_the_threshold(problem, recompute, share):
    """The banded step DP (cut positions pruned by what the later devices can cover) against every split,
    each block budgeted for its own stage's micro-batches (1F1B: memory drawn around what they hold)."""
    graph, cluster, m, schedule = problem
    tables = _tables(CostModel(graph, cluster, num_microbatches=m, schedule=schedule, recompute=recompute))
    n, k = len(graph), cluster.num_devices
    figures = {split: _figures(tables, split, schedule) for split in every_split(n, k)}
    periods = sorted(
        max(float(np.maximum(f, a) + np.maximum(b, g)) if schedule == "gpipe" else max(f + b, a, g) for f, b, a, g in x)
        for x in figures.values()
        if x is not None
    )
    limit = periods[int(share * (len(periods) - 1))] if periods else 1.0  # a split's own period: on the edge
    table, _, _ = _step_program(tables, schedule, limit)
    for last in range(k):
        sums = [
            sum(f + b + a + g for f, b, a, g in x)
            for split in figures
            if split[-1][0] == last and (x := _figures(tables, split, schedule, limit)) is not None
        ]
        assert table[last, n] == pytest.approx(min(sums, default=np.inf), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    # GPipe chains up to 12 layers on 4 devices, and step_problems: 1F1B with memory around what its stages hold
    problem=st.one_of(chain_problems(max_nodes=12, max_devices=4).map(lambda p: (*p, "gpipe")), step_problems()),
    recompute=st.sampled_from(["never", "auto", "always"]),
)
def test_least_bottleneck_of_banded_programs_is_the_whole_tables(problem, recompute):
    """_least_bottleneck (growing limits, banded min-max and fewest-bytes programs) against _dynamic_program."""
    graph, cluster, m, schedule = problem
    tables = _tables(CostModel(graph, cluster, num_microbatches=m, schedule=schedule, recompute=recompute))
    whole, _ = _dynamic_program(tables)
    expected = float(whole[:, len(graph)].min())
    least, blocks = _least_bottleneck(tables)
    if not np.isfinite(expected):
        assert (least, blocks) == (np.inf, ())
        return
    assert least == pytest.approx(expected, rel=1e-12)
    assert blocks == _least_bytes_split(tables, expected)


def test_exact_chain_proves_the_step_of_a_long_chain():
    # planner_speed's 1000-node chain on 8 devices: the threshold search used to stop at its cap of DPs
    # (four: it sized them as the whole K^2 N^2 table) with the plan "feasible"; banded DPs near the
    # least period are small, so the search finishes under the default caps.
    graph = random_chain(1000, seed=1000)
    need = sum(CostModel(graph, pt.Cluster.uniform(1, memory=1), num_microbatches=8).memory.values())
    cluster = pt.Cluster.uniform(8, memory=max(16 * 2**30, int(1.3 * need / 8)), flops_per_s=100e12, bandwidth=50e9)
    plan = pt.exact_chain(graph, cluster, num_microbatches=8)
    assert plan.status == "optimal"
    assert plan.num_stages == 8


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_local_searches_side_by_side_take_the_paths_they_take_alone(schedule):
    # The searches share their replays (one per round and stage count, each split once); each must still
    # end where it ends alone. Starts: every split of 40 layers into 1-4 equal blocks on devices 0..s-1.
    graph = random_chain(40, seed=7)
    cluster = pt.Cluster.uniform(4, memory="64GiB", flops_per_s=100e12, bandwidth=10e9)
    tables = _tables(CostModel(graph, cluster, num_microbatches=4, schedule=schedule))
    starts = []
    for count in range(1, 5):
        bounds = [len(graph) * s // count for s in range(count + 1)]
        split = tuple((s, bounds[s], bounds[s + 1]) for s in range(count))
        figures = _figures(tables, split, schedule)
        starts.append(_Found(_split_step(schedule, 4, figures), np.inf, 0, split))
    together = _local_search(tables, schedule, 4, starts)
    assert together == [_local_search(tables, schedule, 4, [start])[0] for start in starts]
    assert all(f.step < start.step for f, start in zip(together, starts, strict=True))  # every search moved


def test_exact_chain_1f1b_takes_the_best_legal_plan_of_a_small_chain():
    # Found by test_exact_chain_step_equals_brute_force: 1F1B's step search (threshold search and local
    # moves, not exact) stopped at 0.0145 s with two stages, where fast, slow, fast devices step in 0.013 s.
    # On a chain this small every legal plan is enumerated (partitioner.search.exhaustive), as solve does.
    graph = chain(
        [1e9, 1e9, 3e9, 1e9, 1e9, 2e9],
        param_bytes=[0, 0, 0, 2 * KIB, 0, KIB],
        activation_bytes=[0, KIB, 2 * KIB, 0, 0, 0],
        edge_bytes=[0] * 5,
    )
    devices = [pt.Device("/GPU:0", memory=18 * KIB, flops_per_s=1e12)]
    devices += [pt.Device(f"/GPU:{i}", memory=9 * KIB, flops_per_s=2e12) for i in (1, 2)]
    cluster = pt.Cluster(devices, bandwidth=1e9)
    plan = pt.exact_chain(graph, cluster, num_microbatches=3, schedule="1f1b")
    best = min(every_plan(graph, cluster, num_microbatches=3, schedule="1f1b"))
    assert plan.step_time_s == pytest.approx(best, rel=1e-12) and best == pytest.approx(0.013)
    assert plan.num_stages == 3 and plan.stages[1] == "/GPU:0"  # the slow device in the middle
    assert (plan.status, plan.method) == ("optimal", "every legal plan enumerated (better than exact_chain)")
    pt.validate_plan(plan, graph, cluster)
