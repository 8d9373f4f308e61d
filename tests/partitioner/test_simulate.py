"""The pipeline simulator: the closed form on uniform pipelines, schedules' memory, and what any timeline must obey."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from types import SimpleNamespace

import networkx as nx
import pytest
from graphs import KIB, add_layer, chain, random_dag
from hypothesis import given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.errors import InputError, PlanError
from partitioner.simulate import forward_share, simulate_assignment

FLOPS_PER_S = 1e12


def uniform_pipeline(num_stages: int, num_microbatches: int, *, edge_bytes: int = 0, bandwidth: float = 1e9):
    """K layers of 3 TFLOPs with weights (forward 1 s, backward 2 s on 1 TFLOP/s), one per device."""
    graph = chain(
        [3e12] * num_stages,
        param_bytes=[KIB] * num_stages,
        activation_bytes=[4 * KIB] * num_stages,
        edge_bytes=[edge_bytes] * (num_stages - 1),
    )
    cluster = pt.Cluster.uniform(num_stages, memory="1GiB", flops_per_s=FLOPS_PER_S, bandwidth=bandwidth)
    plan = pt.score_assignment(
        {f"l{i}": f"/GPU:{i}" for i in range(num_stages)},
        CostModel(graph, cluster, num_microbatches=num_microbatches),
        method="manual",
    )
    return plan, graph, cluster


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@given(k=st.integers(1, 8), m=st.integers(1, 32))
@settings(max_examples=40, deadline=None)
def test_uniform_pipeline_matches_the_closed_form(schedule, k, m):
    plan, graph, cluster = uniform_pipeline(k, m)
    sim = pt.simulate(plan, graph, cluster, schedule=schedule)
    ideal = m * 3.0  # M micro-batches of 1 s forward + 2 s backward per device
    assert sim.step_time_s == pytest.approx((m + k - 1) / m * ideal, rel=1e-12)
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1), rel=1e-12)
    assert sim.busy_s == pytest.approx({f"/GPU:{i}": ideal for i in range(k)})
    assert sim.idle_s == pytest.approx({f"/GPU:{i}": (k - 1) * 3.0 for i in range(k)})
    if schedule == "gpipe":  # what the plan reports is this very simulation
        assert plan.step_time_s == pytest.approx(sim.step_time_s)
        assert plan.fill_drain_step_s == pytest.approx(sim.step_time_s)


@given(k=st.integers(2, 6), m=st.integers(1, 16), transfer=st.just(0.0) | st.floats(1e-3, 1.0))
@settings(max_examples=40, deadline=None)
def test_gpipe_with_transfers_adds_one_hop_per_stage_each_way(k, m, transfer):
    """With links no slower than the stages, each of the K - 1 hops delays the step twice (forward, back)."""
    plan, graph, cluster = uniform_pipeline(k, m, edge_bytes=10**6, bandwidth=10**6 / transfer if transfer else 1e30)
    sim = pt.simulate(plan, graph, cluster)
    hop = 10**6 / cluster.bandwidth(0, 1)
    assert sim.step_time_s == pytest.approx((m + k - 1) * 3.0 + 2 * (k - 1) * hop, rel=1e-9)
    sends = [a for a in sim.timeline if a.kind.startswith("send")]
    assert len(sends) == 2 * (k - 1) * m  # every activation forward and every gradient back, once


@given(k=st.integers(1, 6), m=st.integers(1, 12))
@settings(max_examples=30, deadline=None)
def test_schedules_hold_the_expected_micro_batches_in_flight(k, m):
    plan, graph, cluster = uniform_pipeline(k, m)
    gpipe = pt.simulate(plan, graph, cluster, schedule="gpipe")
    one_f_one_b = pt.simulate(plan, graph, cluster, schedule="1f1b")
    for s, device in enumerate(gpipe.stages):
        held = m if s < k - 1 else 1  # GPipe's last stage runs each backward right after its forward
        assert gpipe.peak_in_flight[device] == held
        assert one_f_one_b.peak_in_flight[device] == min(m, k - s)
        gradients = 2 if m > 1 else 1  # with micro-batches, the sum and the micro-batch's being added
        weights = KIB * (1 + gradients + plan.optimizer_slots)
        working = 1 if m > 1 else 0  # in the runtime's loop a backward holds one micro-batch's activation gradients
        assert gpipe.peak_memory_bytes[device] == weights + (held + working) * 4 * KIB
        assert one_f_one_b.peak_memory_bytes[device] == weights + (min(m, k - s) + working) * 4 * KIB
    assert gpipe.peak_memory_bytes == {d: plan.memory_bytes[d] for d in gpipe.stages}  # the cost model's GPipe memory


def _check_timeline(sim: pt.Simulation, graph, plan) -> None:
    """Invariants of any simulated step: one action at a time per resource, and data before use."""
    by_resource = defaultdict(list)  # a device's gradient sums beside its passes: a lane of their own
    for action in sim.timeline:
        assert action.end_s >= action.start_s >= 0
        by_resource[(action.resource, action.kind == "accumulate")].append(action)
    for actions in by_resource.values():
        actions.sort(key=lambda a: a.start_s)
        for before, after in itertools.pairwise(actions):
            assert after.start_s >= before.end_s - 1e-12
    end = {(a.kind, a.stage, a.microbatch, a.resource): a.end_s for a in sim.timeline}
    start = {(a.kind, a.stage, a.microbatch): a.start_s for a in sim.timeline if not a.kind.startswith("send")}
    forward_end = {(a.stage, a.microbatch): a.end_s for a in sim.timeline if a.kind == "forward"}
    backward_end = {(a.stage, a.microbatch): a.end_s for a in sim.timeline if a.kind == "backward"}
    for a in sim.timeline:
        if a.kind == "backward":
            assert a.start_s >= forward_end[(a.stage, a.microbatch)] - 1e-12
        if a.kind == "accumulate":  # a micro-batch's gradients are summed once its backward made them
            assert a.start_s >= backward_end[(a.stage, a.microbatch)] - 1e-12
        if a.kind == "send_activation":
            assert a.start_s >= forward_end[(a.stage, a.microbatch)] - 1e-12
            receiver = sim.stages.index(a.resource.split(" -> ")[1])
            assert start[("forward", receiver, a.microbatch)] >= a.end_s - 1e-12
    stage_of = {device: s for s, device in enumerate(sim.stages)}
    for u, v in graph.edges:  # every crossing edge has a transfer for every micro-batch
        su, sv = stage_of[plan.assignment[u]], stage_of[plan.assignment[v]]
        if su != sv:
            link = f"{sim.stages[su]} -> {sim.stages[sv]}"
            for m in range(sim.num_microbatches):
                assert ("send_activation", su, m, link) in end
    assert sim.step_time_s == pytest.approx(max(a.end_s for a in sim.timeline))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@given(seed=st.integers(0, 10**6), k=st.integers(1, 4), m=st.integers(1, 6))
@settings(max_examples=25, deadline=None)
def test_random_dag_timelines_obey_resources_and_data(schedule, seed, k, m):
    graph = random_dag(random.Random(seed), 15)
    cluster = pt.Cluster.uniform(k, memory="1GiB", flops_per_s=FLOPS_PER_S, bandwidth=1e10)
    plan = pt.baselines.by_time(graph, cluster, num_microbatches=m)
    sim = pt.simulate(plan, graph, cluster, schedule=schedule)
    _check_timeline(sim, graph, plan)
    compute = {d: plan.compute_times[d] for d in sim.stages}
    # A step is at least M micro-batches on the busiest stage (a DAG's stages need not all be on one path).
    assert sim.step_time_s >= m * max(compute.values()) * (1 - 1e-9)
    assert sum(sim.busy_s.values()) == pytest.approx(m * sum(compute.values()))


@given(seed=st.integers(0, 10**6), k=st.integers(1, 4), m=st.integers(1, 8))
@settings(max_examples=25, deadline=None)
def test_without_transfer_time_the_step_is_within_the_fill_drain_bound(seed, k, m):
    """GPipe runs a forward pipeline, then a backward one: each ends within (M + K - 1) times its slowest
    action. (M + K - 1) x the slowest stage's forward + backward is not a bound when stages split their
    time differently between forward and backward: seed=191, k=3, m=5 steps 1.503 s against 1.498 s.)"""
    graph = random_dag(random.Random(seed), 12)
    for u, v in graph.edges:
        graph.edges[u, v]["bytes"] = 0
    cluster = pt.Cluster.uniform(k, memory="1GiB", flops_per_s=FLOPS_PER_S)
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=m)
    sim = pt.simulate(plan, graph, cluster)
    slowest = {kind: max(a.duration_s for a in sim.timeline if a.kind == kind) for kind in ("forward", "backward")}
    assert plan.step_time_s <= (m + len(sim.stages) - 1) * (slowest["forward"] + slowest["backward"]) * (1 + 1e-9)


def test_forward_share_rules():
    assert forward_share({"flops": 3.0, "param_bytes": 4}) == pytest.approx(1 / 3)
    assert forward_share({"flops": 2.0, "param_bytes": 0}) == pytest.approx(1 / 2)
    assert forward_share({"flops": 10.0, "forward_flops": 4.0, "param_bytes": 0}) == pytest.approx(0.4)


def test_actions_on_and_links():
    plan, graph, cluster = uniform_pipeline(3, 2, edge_bytes=1000)
    sim = pt.simulate(plan, graph, cluster)
    assert [(a.kind, a.microbatch) for a in sim.actions_on("/GPU:0")] == [
        ("forward", 0),
        ("forward", 1),
        ("backward", 0),
        ("backward", 1),
    ]
    assert [(a.kind, a.microbatch) for a in sim.actions_on("/GPU:2")] == [
        ("forward", 0),
        ("backward", 0),
        ("forward", 1),
        ("backward", 1),
    ]
    assert sim.links == ("/GPU:0 -> /GPU:1", "/GPU:1 -> /GPU:2", "/GPU:2 -> /GPU:1", "/GPU:1 -> /GPU:0")


def test_simulating_with_more_microbatches_than_planned():
    plan, graph, cluster = uniform_pipeline(2, 2)
    sim = pt.simulate(plan, graph, cluster, num_microbatches=8)
    assert sim.num_microbatches == 8
    assert sim.step_time_s == pytest.approx((8 + 2 - 1) * 3.0)


def test_unknown_schedule_is_refused():
    plan, graph, cluster = uniform_pipeline(2, 2)
    with pytest.raises(InputError, match=r"schedule must be one of \('gpipe', '1f1b'\)\. Received: 'zero-bubble'"):
        pt.simulate(plan, graph, cluster, schedule="zero-bubble")


def test_bad_microbatch_count_is_refused():
    plan, graph, cluster = uniform_pipeline(2, 2)
    with pytest.raises(InputError, match=r"num_microbatches must be an integer >= 1\. Received: 0"):
        pt.simulate(plan, graph, cluster, num_microbatches=0)


def test_other_cluster_is_refused():
    plan, graph, _ = uniform_pipeline(2, 2)
    other = pt.Cluster.uniform(3, memory="1GiB")
    with pytest.raises(PlanError, match=r"made for devices \['/GPU:0', '/GPU:1'\] but the cluster has .*Simulate with"):
        pt.simulate(plan, graph, other)


def test_backward_edge_is_refused():
    graph = chain([1e9, 1e9], edge_bytes=[10])
    cluster = pt.Cluster.uniform(2, memory="1GiB")
    costs = CostModel(graph, cluster)
    with pytest.raises(PlanError, match=r"Edge 'l0' -> 'l1' goes backward .*every edge to go forward in device order"):
        simulate_assignment(costs, {"l0": "/GPU:1", "l1": "/GPU:0"})


def test_peak_total_is_the_most_the_stages_hold_together_not_the_sum_of_their_peaks():
    """GPipe, 2 stages of 2 layers (100 bytes of activations each), M = 4, the model's output (1000 bytes per
    micro-batch) collected on the last stage; a stage's once bytes (200: its backward's working set) count
    while it holds a micro-batch. Stage 0 peaks at 4 x 200 held + 200 (1000), stage 1 at its last micro-batch:
    5 x 1000 outputs + 200 held + 200 (5400); the sum is 6400. Together they hold at most 6000, while stage 1's
    last forward runs (4 forwards started: 5400) beside stage 0's backward of micro-batch 2 (2 x 200 + 200)."""
    graph = chain([1e9] * 4, activation_bytes=[100] * 4)
    graph.nodes["l3"]["model_output_bytes"] = 1000
    cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=FLOPS_PER_S)
    costs = CostModel(graph, cluster, num_microbatches=4, schedule="gpipe")
    sim = simulate_assignment(costs, {"l0": "/GPU:0", "l1": "/GPU:0", "l2": "/GPU:1", "l3": "/GPU:1"})
    assert sim.peak_memory_bytes == {"/GPU:0": 1000, "/GPU:1": 5400}
    assert sim.peak_total_bytes == 6000


def test_peak_total_counts_activations_waiting_for_a_slower_stage():
    """GPipe, M = 4, stage 0 recomputed (it keeps its inputs, none here, and not the 1000 bytes it sends
    per micro-batch): its forwards end at 1.5, 3, 4.5 and 6 s; stage 1 runs each forward (4.5 s) and
    backward (4.5 s) in turn, so micro-batches 1, 2 and 3 wait from 3, 4.5 and 6 s until its forwards at
    10.5, 19.5 and 28.5 s. From 6 s the stages hold 200 (stage 0: one micro-batch's activations and
    gradients, while it holds any) + 1200 (stage 1: one micro-batch's 100 and its backward's working set,
    the received 1000 and 100) + 3 x 1000 waiting: 4400. On devices of their own, stage 1 holds a copy of the
    received 1000 for each of stage 0's 4 micro-batches besides (5200; the peaks summed 5400); in one memory
    they share, a received tensor is the sender's buffer. A kept stage 0 holds what it sends among its
    activations: nothing waits beside them, and the stages' peaks but the copies (500 and 1200) coincide from
    6 s: 1700. (The link is free: each gradient is read as it is made.)"""
    graph = chain([3e12, 9e12], activation_bytes=[100, 100], edge_bytes=[1000])
    cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=FLOPS_PER_S, bandwidth=1e30)
    costs = CostModel(graph, cluster, num_microbatches=4, schedule="gpipe")
    assignment = {"l0": "/GPU:0", "l1": "/GPU:1"}
    sim = simulate_assignment(costs, assignment, recompute=[True, False])
    assert sim.peak_memory_bytes == {"/GPU:0": 200, "/GPU:1": 1200 + 4 * 1000}
    assert sim.peak_total_bytes == 4400
    kept = simulate_assignment(costs, assignment, recompute=[False, False])
    assert kept.peak_memory_bytes == {"/GPU:0": 500, "/GPU:1": 1200 + 4 * 1000}
    assert kept.peak_total_bytes == 1700


def test_peak_total_holds_a_tensor_read_by_two_stages_once_until_its_last_reader():
    """GPipe, M = 2, three stages a | b | c, a recomputed (it keeps nothing), its output (1000 bytes) read by
    b and c; b keeps 100 per micro-batch and, in a backward, 1100 (the gradients of its output, 100, and
    of its input, 1000); c keeps nothing and 1000 in a backward. Micro-batch 0's output waits from 0.5 s
    until c's forward at 2.5 s, micro-batch 1's from 1 s until c's forward at 4.5 s (b reads it at 2.5 s,
    one buffer). From 2.5 s: b 2 x 100 + 1100, c 1000, micro-batch 1's output 1000 = 3300 (the same from
    3.5 s, when c's gradient for a waits for a's backward at 4.5 s in place of c's 1000). Counting the
    output once per reading stage gave 4200; only until its first reader, 2300. On devices of their own b and c
    each hold a copy of a's output for both of a's micro-batches besides (2 x 1000 each)."""
    graph = nx.DiGraph()
    add_layer(graph, "a", flops=1e12)
    add_layer(graph, "b", flops=2e12, activation_bytes=100, forward_flops=2e12)  # its backward takes no time
    add_layer(graph, "c", flops=1e12)
    graph.add_edge("a", "b", bytes=1000)
    graph.add_edge("a", "c", bytes=1000)
    graph.add_edge("b", "c", bytes=0)
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=FLOPS_PER_S, bandwidth=1e30)
    costs = CostModel(graph, cluster, num_microbatches=2, schedule="gpipe")
    sim = simulate_assignment(costs, {"a": "/GPU:0", "b": "/GPU:1", "c": "/GPU:2"}, recompute=[True, False, False])
    assert sim.peak_memory_bytes == {"/GPU:0": 0, "/GPU:1": 1300 + 2000, "/GPU:2": 1000 + 2000}
    assert sim.peak_total_bytes == 3300


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@given(seed=st.integers(0, 10**6), k=st.integers(1, 4), m=st.integers(1, 8))
@settings(max_examples=25, deadline=None)
def test_without_transfers_the_peak_total_is_at_most_the_sum_of_the_stages_peaks(schedule, seed, k, m):
    graph = random_dag(random.Random(seed), 12)
    for u, v in graph.edges:
        graph.edges[u, v]["bytes"] = 0
    cluster = pt.Cluster.uniform(k, memory="1GiB", flops_per_s=FLOPS_PER_S)
    costs = CostModel(graph, cluster, num_microbatches=m, schedule=schedule)
    assignment = pt.baselines.uniform(graph, cluster, num_microbatches=m).assignment
    sim = simulate_assignment(costs, assignment)
    assert sim.peak_total_bytes <= sum(sim.peak_memory_bytes.values())
    # at least what every stage holds all step, and the most one stage's forward adds to it
    ev = costs.evaluate(assignment)
    stages = list(zip(ev.stage_costs, ev.model_output_bytes, strict=True))
    fixed = sum(c.weight_bytes + c.step_bytes - m * out for c, out in stages)
    assert sim.peak_total_bytes >= fixed + max(c.held_bytes + out for c, out in stages)


def pooled_pair(capacity: float | None, num_microbatches: int, schedule: str) -> pt.Simulation:
    """Two stages of forward 1 s and backward 2 s on two devices that share a processor of ``capacity``."""
    graph = chain([3e12, 3e12], param_bytes=[KIB, KIB], activation_bytes=[KIB, KIB], edge_bytes=[0])
    devices = [
        pt.Device(
            f"/CPU:{i}", memory="1GiB", flops_per_s=FLOPS_PER_S, pool=capacity and "cpu", pool_capacity=capacity or 1
        )
        for i in range(2)
    ]
    costs = CostModel(graph, pt.Cluster(devices, bandwidth=1e30), num_microbatches=num_microbatches, schedule=schedule)
    return simulate_assignment(costs, {"l0": "/CPU:0", "l1": "/CPU:1"}, schedule=schedule)


def test_devices_sharing_a_processor_slow_each_other_while_both_compute():
    # GPipe, M = 2, capacity 1.5 (two busy devices each at 0.75): F0 on stage 0 alone [0, 1]; F1 | stage 1's F0
    # together, 4/3 s; stage 1's B0 alone [7/3, 13/3]; stage 0's B0 | stage 1's F1 and then its B1: F1 ends at
    # 17/3, B0 (1 s of work left) at 7; stage 1's B1 alone to 8; stage 0's B1 alone to 10 (9 s unshared)
    shared = pooled_pair(1.5, 2, "gpipe")
    assert shared.step_time_s == pytest.approx(10.0, rel=1e-12)
    assert pooled_pair(None, 2, "gpipe").step_time_s == pytest.approx(9.0, rel=1e-12)
    spans = {(a.resource, a.kind, a.microbatch): (a.start_s, a.end_s) for a in shared.timeline}
    assert spans[("/CPU:1", "forward", 0)] == pytest.approx((1.0, 7 / 3))
    assert spans[("/CPU:0", "backward", 0)] == pytest.approx((13 / 3, 7.0))
    assert shared.busy_s == pytest.approx({"/CPU:0": 1 + 4 / 3 + 8 / 3 + 2, "/CPU:1": 4 / 3 + 2 + 4 / 3 + 7 / 3})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_a_pool_of_one_device_capacity_runs_the_work_one_at_a_time_and_of_two_as_if_unshared(schedule, m):
    assert pooled_pair(1.0, m, schedule).step_time_s == pytest.approx(m * 6.0, rel=1e-12)  # the pool never idles
    assert pooled_pair(2.0, m, schedule).step_time_s == pooled_pair(None, m, schedule).step_time_s
    between = pooled_pair(1.5, m, schedule).step_time_s
    assert pooled_pair(None, m, schedule).step_time_s <= between <= m * 6.0
    if m == 1:  # nothing overlaps: nothing is shared
        assert between == pytest.approx(6.0)


def _work_done(sim: pt.Simulation, action: pt.Span, pools: dict[str, tuple[float, set[str]]]) -> float:
    """The seconds of work ``action`` received: its span integrated at min(1, C / k(t)), k(t) the jobs of
    its pool computing at t (passes and gradient sums), read from the timeline alone (an independent check
    of the processor sharing)."""
    pool = next(((c, members) for c, members in pools.values() if action.resource in members), None)
    if pool is None:
        return action.duration_s
    capacity, members = pool
    busy = [a for a in sim.timeline if a.kind in ("forward", "backward", "accumulate") and a.resource in members]
    cuts = sorted({action.start_s, action.end_s, *(t for a in busy for t in (a.start_s, a.end_s))})
    done = 0.0
    for lo, hi in itertools.pairwise(cuts):
        if lo < action.start_s or hi > action.end_s or hi <= lo:
            continue
        middle = (lo + hi) / 2
        k = sum(a.start_s <= middle < a.end_s for a in busy)
        done += (hi - lo) * min(1.0, capacity / k)
    return done


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@given(
    seed=st.integers(0, 10**6),
    k=st.integers(2, 4),
    m=st.integers(1, 5),
    capacity=st.floats(0.5, 4.0),
    bandwidth=st.sampled_from([1e30, 1e7]),
)
@settings(max_examples=25, deadline=None)
def test_a_pool_gives_each_action_its_work_at_the_shared_speed(schedule, seed, k, m, capacity, bandwidth):
    """Random DAGs on k devices, the first two or all of them in one pool, links free or slow: the timeline
    obeys resources and data; every action, integrated at min(1, C / k(t)) over its span, received exactly
    its work; the step is at least the unshared one."""
    rng = random.Random(seed)
    graph = random_dag(rng, 12)
    pooled = k if rng.random() < 0.5 else 2
    devices = [
        pt.Device(
            f"/CPU:{i}",
            memory="1GiB",
            flops_per_s=FLOPS_PER_S,
            pool="cpu" if i < pooled else None,
            pool_capacity=capacity if i < pooled else 1.0,
        )
        for i in range(k)
    ]
    cluster = pt.Cluster(devices, bandwidth=bandwidth)
    alone = pt.Cluster.uniform(k, memory="1GiB", flops_per_s=FLOPS_PER_S, bandwidth=bandwidth, prefix="/CPU:")
    plan = pt.baselines.by_time(graph, alone, num_microbatches=m)
    shared = pt.simulate(plan, graph, cluster, schedule=schedule)
    unshared = pt.simulate(plan, graph, alone, schedule=schedule)
    _check_timeline(shared, graph, plan)
    work = {(a.kind, a.stage, a.microbatch): a.duration_s for a in unshared.timeline}
    pools = {"cpu": (capacity, {d.name for d in devices[:pooled]})}
    for a in shared.timeline:
        if a.kind in ("forward", "backward"):
            assert _work_done(shared, a, pools) == pytest.approx(work[(a.kind, a.stage, a.microbatch)], rel=1e-9)
    assert shared.step_time_s >= unshared.step_time_s * (1 - 1e-12)
    if capacity >= pooled:  # room for every pooled device: nothing is shared
        assert shared.step_time_s == unshared.step_time_s


def summing_stage(
    capacity: float, num_microbatches: int, *, devices: int = 2, prefix: str = "/CPU:", sums_s: float = 1.0
) -> pt.Simulation:
    """One stage of forward 1 s, backward 2 s and gradient sums ``sums_s`` per micro-batch (measured:
    cost="time") on the first of ``devices`` devices that share a processor of ``capacity``."""
    graph = chain([3e12], param_bytes=[KIB], activation_bytes=[KIB])
    graph.nodes["l0"].update(time_s=3.0, accumulate_time_s=sums_s)
    graph.graph["profiled_flops_per_s"] = FLOPS_PER_S
    cluster = pt.Cluster(
        [
            pt.Device(f"{prefix}{i}", memory="1GiB", flops_per_s=FLOPS_PER_S, pool="host", pool_capacity=capacity)
            for i in range(devices)
        ]
    )
    costs = CostModel(graph, cluster, num_microbatches=num_microbatches, cost="time")
    return simulate_assignment(costs, {"l0": f"{prefix}0"})


@pytest.mark.parametrize("m", [2, 5])
def test_a_pooled_cpu_stage_sums_its_gradients_beside_its_next_pass(m):
    # capacity 2 of 3 devices: the sums and the passes each at full speed, side by side; every micro-batch's
    # sums start as its backward ends (the previous ones are done by then), the last ones after the passes
    room = summing_stage(2.0, m, devices=3)
    assert room.step_time_s == pytest.approx(3.0 * m + 1.0, rel=1e-12)
    sums = [a for a in room.timeline if a.kind == "accumulate"]
    assert [(a.resource, a.microbatch) for a in sums] == [("/CPU:0", i) for i in range(m)]
    ends = {a.microbatch: a.end_s for a in room.timeline if a.kind == "backward"}
    assert [a.start_s for a in sums] == pytest.approx([ends[i] for i in range(m)])
    assert room.busy_s["/CPU:0"] == pytest.approx(3.0 * m)  # the device's passes; the sums are the pool's
    _check_timeline(room, chain([3e12]), SimpleNamespace(assignment={"l0": "/CPU:0"}))
    # capacity 1: the pool never idles, the sums cost what they would in the backward
    assert summing_stage(1.0, m).step_time_s == pytest.approx(4.0 * m, rel=1e-12)
    between = summing_stage(1.5, m).step_time_s
    assert 3.0 * m + 1.0 < between < 4.0 * m


@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("m", [2, 8])
def test_more_pool_capacity_never_lengthens_a_summing_stage(devices, m):
    # whether the pool has room for every device or not (capacity at or above the device count: Cluster.pools
    # leaves it out), the sums share it beside the passes: a step never grows with the capacity
    capacities = [0.5, 1.0, 1.5, 1.9, 2.0, 2.5, 3.0, 4.0]
    steps = [summing_stage(c, m, devices=devices).step_time_s for c in capacities]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in itertools.pairwise(steps)), steps
    assert steps[-1] == pytest.approx(3.0 * m + 1.0)  # room for both: the passes and, after the last, its sums


def test_a_micro_batch_waits_for_the_sums_of_the_one_two_before_it():
    # the loop runs two iterations at once (one stage: windows (1,), P = 2): with sums of 5 s after passes of
    # 3 s, micro-batch 2's forward waits for micro-batch 0's sums (3-8 s), 3's for 1's (8-13 s)
    sim = summing_stage(2.0, 4, devices=3, sums_s=5.0)
    forwards = [a.start_s for a in sim.timeline if a.kind == "forward"]
    sums = [t for a in sim.timeline if a.kind == "accumulate" for t in (a.start_s, a.end_s)]
    assert forwards == pytest.approx([0.0, 3.0, 8.0, 13.0])
    assert sums == pytest.approx([3.0, 8.0, 8.0, 13.0, 13.0, 18.0, 18.0, 23.0])
    assert sim.step_time_s == pytest.approx(23.0)


def test_a_gpu_stage_sums_its_gradients_in_its_backward_even_on_a_pool():
    # a GPU runs a device's kernels on one stream: the sums are the backward's, whatever the pool
    sim = summing_stage(1.5, 3, prefix="/GPU:")
    assert sim.step_time_s == pytest.approx(12.0, rel=1e-12)
    assert not [a for a in sim.timeline if a.kind == "accumulate"]
    assert [a.duration_s for a in sim.timeline if a.kind == "backward"] == pytest.approx([3.0] * 3)


def test_a_stages_all_reduce_starts_after_its_last_gradient_sums():
    from partitioner.simulate import _with_reductions

    sim = _with_reductions(summing_stage(2.0, 2, devices=3), {"/CPU:0": 0.5})
    (reduce,) = [a for a in sim.timeline if a.kind == "allreduce"]
    assert (reduce.start_s, reduce.end_s) == pytest.approx((7.0, 7.5))  # passes end at 6, the last sums at 7
    assert sim.step_time_s == pytest.approx(7.5)


@given(
    seed=st.integers(0, 10**6),
    k=st.integers(1, 3),
    m=st.integers(1, 5),
    capacity=st.floats(0.5, 4.0),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
)
@settings(max_examples=25, deadline=None)
def test_gradient_sums_beside_the_passes_get_their_work_and_keep_the_bounds(seed, k, m, capacity, schedule):
    """Random DAGs with measured times and gradient sums on k pooled CPU devices (k + 1 in the pool, so one
    stage shares it too): every pass and every micro-batch's sums, integrated at min(1, C / k(t)), received
    its work; the step is at least the cost model's lower bound and the step with the sums left out."""
    rng = random.Random(seed)
    graph = random_dag(rng, 10)
    for v in graph.nodes:
        graph.nodes[v]["time_s"] = graph.nodes[v]["flops"] / FLOPS_PER_S
        graph.nodes[v]["accumulate_time_s"] = rng.choice([0.0, 0.1, 1.0]) * graph.nodes[v]["time_s"]
    graph.graph["profiled_flops_per_s"] = FLOPS_PER_S
    devices = [
        pt.Device(f"/CPU:{i}", memory="1GiB", flops_per_s=FLOPS_PER_S, pool="cpu", pool_capacity=capacity)
        for i in range(k + 1)
    ]
    cluster = pt.Cluster(devices, bandwidth=1e8)
    costs = CostModel(graph, cluster, num_microbatches=m, cost="time", schedule=schedule)
    plan = pt.baselines.by_time(graph, pt.Cluster(devices[:k], bandwidth=1e8), num_microbatches=m)
    shared = simulate_assignment(costs, plan.assignment)
    _check_timeline(shared, graph, plan)
    without = graph.copy()
    for v in without.nodes:
        without.nodes[v]["accumulate_time_s"] = 0.0
    left_out = simulate_assignment(
        CostModel(without, cluster, num_microbatches=m, cost="time", schedule=schedule), plan.assignment
    )
    assert shared.step_time_s >= left_out.step_time_s * (1 - 1e-12)
    assert shared.step_time_s >= costs.step_lower_bound_s() * (1 - 1e-9)
    ev = costs.evaluate(plan.assignment)
    work = {("accumulate", s): ev.sums_s[s] for s in range(len(ev.stages))}
    pools = {"cpu": (capacity, {d.name for d in devices})}
    for a in shared.timeline:
        if a.kind == "accumulate":
            assert _work_done(shared, a, pools) == pytest.approx(work[("accumulate", a.stage)], rel=1e-9)
        elif a.kind in ("forward", "backward"):
            cost = ev.stage_costs[a.stage]
            expected = cost.forward_s if a.kind == "forward" else cost.backward_s
            assert _work_done(shared, a, pools) == pytest.approx(expected, rel=1e-9)
    sums = [a for a in shared.timeline if a.kind == "accumulate"]
    assert len(sums) == (m if m > 1 else 0) * sum(x > 0 for x in ev.sums_s)


def test_the_event_replay_without_sharing_is_the_list_replay():
    """With a pool that has room for every stage forced through the event-by-event replay, every span is the
    list scheduler's (same order, same times): the two replays differ only in the shared speed."""
    from partitioner.schedule import schedule_for
    from partitioner.simulate import _Queues, _replay, _replay_shared, _Stages

    graph = random_dag(random.Random(7), 14)
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=FLOPS_PER_S, bandwidth=1e7)
    for schedule in ("gpipe", "1f1b"):
        costs = CostModel(graph, cluster, num_microbatches=4, schedule=schedule)
        plan = pt.baselines.by_time(graph, cluster, num_microbatches=4)
        stages = _Stages(costs, plan.assignment, None)
        stages.pools = [(3.0, (0, 1, 2))]
        order = schedule_for(schedule, len(stages.names), 4)
        listed, _, _ = _replay(stages, _Queues(stages, order), order)
        evented, _, _ = _replay_shared(stages, _Queues(stages, order), order)
        spans = [sorted((a.resource, a.kind, a.microbatch, a.start_s, a.end_s) for a in r) for r in (evented, listed)]
        assert [span[:3] for span in spans[0]] == [span[:3] for span in spans[1]]
        times = [[t for span in r for t in span[3:]] for r in spans]
        assert times[0] == pytest.approx(times[1], rel=1e-12)


def test_a_pooled_stage_of_no_work_ends_where_it_starts():
    """A stage with nothing to compute (0 FLOPs, no fixed cost) in a pool: its actions take no time, the
    replay moves on, and the step is the other stage's work."""
    graph = chain([0.0, 3e12], param_bytes=[KIB, KIB], activation_bytes=[KIB, KIB], edge_bytes=[0])
    devices = [
        pt.Device(f"/CPU:{i}", memory="1GiB", flops_per_s=FLOPS_PER_S, pool="cpu", pool_capacity=1.0) for i in range(2)
    ]
    costs = CostModel(graph, pt.Cluster(devices, bandwidth=1e30), num_microbatches=3)
    sim = simulate_assignment(costs, {"l0": "/CPU:0", "l1": "/CPU:1"})
    assert sim.step_time_s == pytest.approx(3 * 3.0)
    assert sim.busy_s["/CPU:0"] == 0.0
