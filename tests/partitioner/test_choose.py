"""partitioner.search.choose: the planner picks M and the schedule for a global batch; a user may fix either."""

from __future__ import annotations

import pytest

import partitioner as pt
from partitioner.search.choose import (
    MARGIN,
    MAX_MICROBATCHES,
    SOLVED_DAG_CANDIDATES,
    candidate_microbatches,
    choose,
    plan_for_batch,
    timed_sizes,
)
from partitioner.synthetic import random_dag

MiB = 2**20


def _chain(flops: float, activation_bytes: int, *, layers: int = 4, batch_size: int = 32) -> object:
    """A chain whose costs are for the whole batch of ``batch_size`` samples (as profiled with M = 1)."""
    graph = pt.chain_graph(
        [flops] * layers, activation_bytes=[activation_bytes] * layers, edge_bytes=[activation_bytes] * (layers - 1)
    )
    graph.graph.update(batch_size=batch_size, num_microbatches=1)
    return graph


def _cluster(num_devices: int = 2, *, memory: str = "16GiB", overhead_s: float = 20e-6) -> pt.Cluster:
    return pt.Cluster.uniform(num_devices, memory=memory, flops_per_s=100e12, action_overhead_s=overhead_s)


def test_candidate_microbatches_are_the_divisors_up_to_the_cap() -> None:
    assert candidate_microbatches(12) == [1, 2, 3, 4, 6, 12]
    assert candidate_microbatches(7) == [1, 7]
    assert max(candidate_microbatches(256)) == MAX_MICROBATCHES
    assert candidate_microbatches(12, 5) == [5]  # a fixed M need not divide the batch (the runtime pads)


def test_choose_one_microbatch_when_pipelining_does_not_pay() -> None:
    """A small model: each micro-batch's fixed cost outweighs any bubble saved, so M = 1 on one device."""
    choice = choose(_chain(4e9, MiB), _cluster(4, overhead_s=1e-3), batch_size=32, time_limit_s=5)
    assert (choice.plan.num_microbatches, choice.plan.schedule, choice.plan.num_stages) == (1, "gpipe", 1)
    assert all(c.step_time_s is not None for c in choice.candidates)
    assert min(c.step_time_s for c in choice.candidates) == choice.plan.step_time_s


def test_choose_pipelines_a_large_model_with_more_microbatches() -> None:
    """A large model: the bubble costs more than the overhead, so M > 1 on every device, and the
    step is shorter than with one micro-batch (the trade-off has an interior optimum)."""
    choice = choose(_chain(4e11, MiB, layers=8, batch_size=64), _cluster(4), batch_size=64, time_limit_s=5)
    steps = {c.num_microbatches: c.step_time_s for c in choice.candidates if c.schedule == "gpipe"}
    assert choice.plan.num_stages == 4
    assert 1 < choice.plan.num_microbatches < 64
    assert choice.plan.step_time_s < steps[1] and choice.plan.step_time_s < steps[64]


def test_choose_takes_the_fewest_microbatches_within_the_margin_of_the_shortest_step() -> None:
    """The large model's steps fall with M then level off; the shortest is not what auto picks when a plan of
    fewer micro-batches is within MARGIN of it: the fewest such, and that M's shorter schedule (ties: GPipe).
    margin=0 keeps the shortest."""
    graph, cluster = _chain(4e11, MiB, layers=8, batch_size=64), _cluster(4)
    choice = choose(graph, cluster, batch_size=64, time_limit_s=5)
    steps = [(c.num_microbatches, c.schedule, c.step_time_s) for c in choice.candidates if c.step_time_s]
    shortest = min(step for _, _, step in steps)
    fewest = min(m for m, _, step in steps if step <= shortest * (1 + MARGIN))
    assert choice.plan.num_microbatches == fewest and choice.margin == MARGIN
    assert choice.plan.step_time_s == min(step for m, _, step in steps if m == fewest)  # that M's shorter schedule
    assert choice.plan.step_time_s > shortest  # this model's shortest step has more micro-batches
    exact = choose(graph, cluster, batch_size=64, time_limit_s=5, margin=0)
    assert exact.plan.step_time_s == shortest and exact.plan.num_microbatches > choice.plan.num_microbatches
    wide = choose(graph, cluster, batch_size=64, time_limit_s=5, margin=10.0)
    assert (wide.plan.num_microbatches, wide.plan.schedule) == (1, "gpipe")


def test_timed_sizes_are_the_candidates_sizes_spread() -> None:
    assert timed_sizes(256) == [4, 16, 64, 256]  # of 4, 8, ..., 256
    assert timed_sizes(12) == [1, 3, 4, 12]  # of 1, 2, 3, 4, 6, 12
    assert timed_sizes(12, most=10) == [1, 2, 3, 4, 6, 12] and timed_sizes(12, 5) == [3]


def test_choose_1f1b_when_gpipe_does_not_fit() -> None:
    """GPipe's first stage holds the whole batch's activations whatever M; 1F1B's min(K - s, M) micro-batches,
    so only 1F1B with enough micro-batches fits 36 MiB per device. The weights (2 MiB a layer: 10 MiB with
    their gradients, the micro-batch's and 2 slots) keep the four layers off one device."""
    graph = pt.chain_graph(
        [4e9] * 4, param_bytes=[2 * MiB] * 4, activation_bytes=[32 * MiB] * 4, edge_bytes=[32 * MiB] * 3
    )
    graph.graph.update(batch_size=32, num_microbatches=1)  # 32 MiB per layer for the batch of 32
    choice = choose(graph, _cluster(2, memory="36MiB", overhead_s=0.0), batch_size=32, time_limit_s=5)
    assert choice.plan.schedule == "1f1b" and choice.plan.num_stages == 2
    assert all(c.error is not None for c in choice.candidates if c.schedule == "gpipe")
    fitting = [c.num_microbatches for c in choice.candidates if c.step_time_s is not None]
    # M = 16 on stage 0 (2 | 2): 20 MiB of weights, 2 in flight x 2 layers x 2 MiB + one micro-batch's activation
    # gradients in a backward (4 MiB) = 32 MiB; M = 8: 20 + 16 + 8 MiB, over
    assert min(fitting) == 16
    assert choice.plan.fits_memory


def test_choose_respects_a_fixed_microbatch_count_and_schedule() -> None:
    graph, cluster = _chain(4e11, MiB), _cluster(2)
    fixed_m = choose(graph, cluster, batch_size=32, num_microbatches=4, time_limit_s=5)
    assert fixed_m.plan.num_microbatches == 4
    assert {c.num_microbatches for c in fixed_m.candidates} == {4}
    assert {c.schedule for c in fixed_m.candidates} == {"gpipe", "1f1b"}
    fixed_schedule = choose(graph, cluster, batch_size=32, schedule="1f1b", time_limit_s=5)
    assert fixed_schedule.plan.schedule == "1f1b"
    assert {c.schedule for c in fixed_schedule.candidates} == {"1f1b"}
    both = plan_for_batch(graph, cluster, batch_size=32, num_microbatches=8, schedule="1f1b", time_limit_s=5)
    assert (both.num_microbatches, both.schedule) == (8, "1f1b")


def test_choose_plan_is_for_the_rescaled_graph_and_repeats() -> None:
    graph, cluster = _chain(4e11, MiB), _cluster(2)
    choice = choose(graph, cluster, batch_size=32, time_limit_s=5)
    m = choice.plan.num_microbatches
    assert choice.graph.graph["micro_batch_size"] == 32 // m
    assert choice.graph.nodes["layer_0"]["flops"] == pytest.approx(4e11 / m)
    pt.validate_plan(choice.plan, choice.graph, cluster)
    assert pt.simulate(choice.plan, choice.graph, cluster).step_time_s == pytest.approx(choice.plan.step_time_s)
    again = choose(graph, cluster, batch_size=32, time_limit_s=5)
    assert again.plan.assignment == choice.plan.assignment and again.candidates == choice.candidates


def test_choose_screens_a_dag_and_solves_the_best_screened_candidates() -> None:
    graph = random_dag(30, seed=2)
    graph.graph.update(batch_size=16, num_microbatches=1)
    cluster = _cluster(4, overhead_s=50e-6)
    choice = choose(graph, cluster, batch_size=16, time_limit_s=6)
    solved = [c for c in choice.candidates if c.solved]
    assert len(choice.candidates) == 10 and len(solved) == SOLVED_DAG_CANDIDATES
    assert all(c.screened_step_s is not None for c in choice.candidates)  # 16 GiB: every baseline fits
    worst_solved = max(c.screened_step_s for c in solved)
    assert all(c.screened_step_s >= worst_solved for c in choice.candidates if c not in solved)
    assert (choice.plan.num_microbatches, choice.plan.schedule) in {(c.num_microbatches, c.schedule) for c in solved}
    assert choice.plan.step_time_s == min(c.step_time_s for c in solved if c.step_time_s is not None)
    pt.validate_plan(choice.plan, choice.graph, cluster)
    again = choose(graph, cluster, batch_size=16, time_limit_s=6)
    assert again.plan.assignment == choice.plan.assignment and again.candidates == choice.candidates


def test_choose_takes_the_batch_size_from_the_graph() -> None:
    plan = plan_for_batch(_chain(4e11, MiB, batch_size=16), _cluster(2), time_limit_s=5)
    assert 16 % plan.num_microbatches == 0


def test_choose_reports_the_closest_candidate_when_nothing_fits() -> None:
    graph = pt.chain_graph([4e9] * 2, param_bytes=[64 * MiB] * 2)  # weights alone: 256 MiB each with Adam
    graph.graph.update(batch_size=8, num_microbatches=1)
    with pytest.raises(
        pt.InfeasiblePlanError,
        match=r"No plan for batch 8 with M in \[1, 2, 4, 8\] and schedule\(s\) \['gpipe', '1f1b'\]\. "
        r"The one holding the fewest activations of those solved, M=8 with 1f1b: .*",
    ):
        choose(graph, _cluster(2, memory="100MiB"), batch_size=8, time_limit_s=5)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"num_microbatches": "many"}, pt.InputError, r"num_microbatches must be 'auto' .*Received: 'many'"),
        ({"num_microbatches": 64}, pt.InputError, "must not exceed batch_size"),
        ({"num_microbatches": 0}, pt.InputError, r"num_microbatches must be an integer >= 1"),
        ({"schedule": "zigzag"}, pt.InputError, r"schedule must be one of"),
        ({"time_limit_s": 0}, pt.InputError, "time_limit_s must be a positive number"),
        ({"margin": -0.1}, pt.InputError, r"margin must be a share >= 0 of the shortest simulated step .* -0.1"),
        ({"options": None, "schedule": "gpipe", "num_microbatches": 2, "pins": {"nope": "/GPU:0"}}, pt.PartitionerError,
         "nope"),
    ],
)  # fmt: skip
def test_choose_bad_input(arguments, error, message) -> None:
    with pytest.raises(error, match=message):
        choose(_chain(4e9, MiB), _cluster(2), batch_size=32, **arguments)


def test_choose_needs_a_batch_size() -> None:
    graph = pt.chain_graph([4e9] * 2)
    with pytest.raises(pt.InputError, match=r"batch_size is needed .*Pass batch_size="):
        choose(graph, _cluster(2))
    with pytest.raises(pt.GraphError, match="does not record the batch size"):
        choose(graph, _cluster(2), batch_size=8)


def test_devices_that_share_one_processor_are_planned_by_the_shared_step() -> None:
    """Four devices split from one processor that runs one device's work at a time (pool capacity 1): a
    pipeline's overlap gains nothing there, so the planner keeps the model on one device; given capacity for
    all four, the same model pipelines over them, as on separate devices."""

    def pooled(capacity: float) -> pt.Cluster:
        devices = [
            pt.Device(
                f"/CPU:{i}",
                memory="16GiB",
                flops_per_s=100e12,
                action_overhead_s=20e-6,
                pool="host",
                pool_capacity=capacity,
            )
            for i in range(4)
        ]
        return pt.Cluster(devices)

    graph = _chain(4e11, MiB, layers=8, batch_size=64)
    one_at_a_time = choose(graph, pooled(1.0), batch_size=64, time_limit_s=5)
    assert one_at_a_time.plan.num_stages == 1
    separate = choose(graph, pooled(4.0), batch_size=64, time_limit_s=5)
    assert separate.plan.num_stages == 4
    assert separate.plan.step_time_s == choose(graph, _cluster(4), batch_size=64, time_limit_s=5).plan.step_time_s
    # what the plan reports is the shared simulation
    shared = one_at_a_time.plan
    assert shared.step_time_s == pytest.approx(pt.simulate(shared, one_at_a_time.graph, pooled(1.0)).step_time_s)
