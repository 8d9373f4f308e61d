"""The planner's data x pipeline search (partitioner/search/replicas.py): D x K on one cost model."""

from __future__ import annotations

import dataclasses
import json

import pytest

import partitioner as pt
from partitioner.cost import allreduce_s
from partitioner.errors import InputError, PlanError
from partitioner.search.choose import choose
from partitioner.search.replicas import plan_replicas
from partitioner.simulate import simulate

GIB = 2**30


def _graph(param_bytes: int, batch: int = 64) -> object:
    graph = pt.chain_graph([4e11] * 4, param_bytes=[param_bytes] * 4, activation_bytes=[2**20] * 4)
    graph.graph.update(batch_size=batch, num_microbatches=1)
    return graph


def _two_nodes(intra: float = 400e9, inter: float = 10e9) -> pt.Cluster:
    """2 nodes of 2 devices: fast links inside a node, slow between."""
    devices = [pt.Device(f"/GPU:{i}", memory="80GiB", flops_per_s=100e12) for i in range(4)]
    rows = [[intra if i // 2 == j // 2 else inter for j in range(4)] for i in range(4)]
    return pt.Cluster(devices, bandwidth=rows, name="2x2")


def test_allreduce_is_a_ring_paced_by_its_slowest_link() -> None:
    cluster = _two_nodes()
    inside, across = ["/GPU:0", "/GPU:1"], ["/GPU:0", "/GPU:2"]
    assert allreduce_s(4e9, cluster, inside) == pytest.approx(4e9 / 400e9)
    assert allreduce_s(4e9, cluster, across) == pytest.approx(4e9 / 10e9)
    assert allreduce_s(4e9, cluster, cluster.names) == pytest.approx(2 * 3 / 4 * 4e9 / 10e9)


def test_one_replica_is_the_pipeline_planner_s_own_plan() -> None:
    graph, cluster = _graph(2**30), _two_nodes()
    choice = plan_replicas(graph, cluster, batch_size=64, replicas=1, num_microbatches=4, schedule="gpipe")
    alone = choose(graph, cluster, batch_size=64, num_microbatches=4, schedule="gpipe").plan
    assert choice.plan.num_replicas == 1 and choice.plan.replica_devices == ()
    assert choice.plan.assignment == alone.assignment
    assert choice.plan.step_time_s == pytest.approx(alone.step_time_s)


def test_small_weights_train_data_parallel_and_each_stage_pays_its_all_reduce() -> None:
    graph, cluster = _graph(2**20), _two_nodes(intra=100e9, inter=100e9)
    choice = plan_replicas(graph, cluster, batch_size=64, time_limit_s=5)
    plan = choice.plan
    assert (plan.num_replicas, plan.num_stages) == (4, 1)
    assert [group for group in plan.replica_devices] == [("/GPU:0",), ("/GPU:1",), ("/GPU:2",), ("/GPU:3",)]
    assert plan.reduce_times["/GPU:0"] == pytest.approx(allreduce_s(4 * 2**20, cluster, cluster.names))
    alone = dataclasses.replace(plan, replica_devices=(), reduce_times={})
    pipeline = simulate(alone, choice.graph, pt.Cluster([cluster.devices[0]])).step_time_s
    assert plan.step_time_s == pytest.approx(pipeline + plan.reduce_times["/GPU:0"])
    simulation = simulate(plan, choice.graph, pt.Cluster([cluster.devices[0]]))  # R is the simulator's action
    (reduce,) = [span for span in simulation.timeline if span.kind == "allreduce"]
    assert reduce.end_s == pytest.approx(simulation.step_time_s) == pytest.approx(plan.step_time_s)
    assert plan.status == "heuristic"  # M and the schedule chosen: no bound over every D


def test_replicas_on_one_shared_processor_are_priced_with_their_share_of_it() -> None:
    """The small-weights model of the test above on 4 logical devices of one processor: with room for all
    four (capacity 4) it trains data parallel as on separate GPUs; with one device's work at a time
    (capacity 1) each of 4 replicas computes at a quarter of its speed, so data parallelism gains nothing
    and 4 replicas step no faster than the model on one device."""

    def pooled(capacity: float) -> pt.Cluster:
        devices = [
            pt.Device(f"/CPU:{i}", memory="80GiB", flops_per_s=100e12, pool="host", pool_capacity=capacity)
            for i in range(4)
        ]
        return pt.Cluster(devices, bandwidth=100e9)

    graph = _graph(2**20)
    roomy = plan_replicas(graph, pooled(4.0), batch_size=64, time_limit_s=5)
    assert (roomy.plan.num_replicas, roomy.plan.num_stages) == (4, 1)
    shared = plan_replicas(graph, pooled(1.0), batch_size=64, time_limit_s=5)
    steps = {(c.num_replicas, c.layout): c.step_time_s for c in shared.candidates}
    assert steps[(4, "blocks")] >= steps[(1, "blocks")] * (1 - 1e-9)
    assert steps[(4, "blocks")] == pytest.approx(4 * roomy.plan.step_time_s - 3 * roomy.plan.reduce_times["/CPU:0"])
    assert shared.plan.step_time_s == pytest.approx(steps[(1, "blocks")])


def test_heavy_weights_across_a_slow_network_keep_the_all_reduce_inside_a_node() -> None:
    """2 replicas of 2 stages: "strided" puts each stage's group inside a node (its all-reduce on the fast
    links) and the pipeline's activations across; "blocks" the other way round. Weights of 1 GiB per layer
    and activations of 1 MiB: strided's step is shorter, and chosen."""
    graph, cluster = _graph(2**30), _two_nodes()
    choice = plan_replicas(graph, cluster, batch_size=64, replicas=2, time_limit_s=5)
    steps = {c.layout: c.step_time_s for c in choice.candidates}
    assert steps["strided"] < steps["blocks"]
    plan = choice.plan
    assert plan.num_replicas == 2 and plan.num_stages == 2
    stage_groups = {frozenset(group) for group in zip(*plan.replica_devices, strict=True)}
    assert stage_groups == {frozenset({"/GPU:0", "/GPU:1"}), frozenset({"/GPU:2", "/GPU:3"})}  # inside a node
    assert max(plan.reduce_times.values()) == pytest.approx(allreduce_s(2 * 2**30, cluster, ["/GPU:0", "/GPU:1"]))


def test_data_parallel_that_does_not_fit_says_why() -> None:
    choice = plan_replicas(_graph(2**33), _two_nodes(), batch_size=64, time_limit_s=5)
    (data_parallel,) = [c for c in choice.candidates if c.devices_per_replica == 1]
    assert data_parallel.plan is None and "No plan for batch 16" in data_parallel.reason
    assert choice.best(devices_per_replica=1) is None
    assert choice.plan.num_replicas < 4


def test_fixed_m_and_schedule_give_a_bound_over_every_number_of_replicas() -> None:
    choice = plan_replicas(_graph(2**20), _two_nodes(), batch_size=64, num_microbatches=2, schedule="1f1b")
    plan = choice.plan
    assert plan.step_lower_bound_s is not None and plan.step_lower_bound_s <= plan.step_time_s
    assert all(c.plan is None or c.plan.step_time_s >= plan.step_lower_bound_s for c in choice.candidates)
    assert plan.status in ("optimal", "feasible")


def test_replicas_must_divide_the_batch_and_fit_the_devices() -> None:
    with pytest.raises(InputError, match=r"replicas=3 needs at least 3 devices and a batch it divides.*Expected"):
        plan_replicas(_graph(2**20), _two_nodes(), batch_size=64, replicas=3)
    with pytest.raises(InputError, match=r"replicas=8 needs at least 8 devices"):
        plan_replicas(_graph(2**20), _two_nodes(), batch_size=64, replicas=8)


def test_a_plan_with_replicas_round_trips_and_old_files_load_as_one_replica() -> None:
    plan = plan_replicas(_graph(2**20), _two_nodes(), batch_size=64, time_limit_s=5).plan
    assert pt.Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    for key in ("replica_devices", "reduce_times"):
        del data[key]
    data["schema_version"] = 3
    old = pt.Plan.from_dict(data)
    assert old.num_replicas == 1 and old.reduce_times == {}
    data = json.loads(plan.to_json())
    data["replica_devices"][1] = data["replica_devices"][0]
    with pytest.raises(PlanError, match="replica_devices must list, per replica, as many distinct devices"):
        pt.Plan.from_dict(data)


def test_a_search_out_of_time_is_not_called_a_misfit(monkeypatch) -> None:
    """A candidate whose search ran out of time proves nothing: it says so, and the plan claims no bound."""
    from partitioner.errors import SolverTimeoutError
    from partitioner.search import replicas as module

    real = module.choose

    def choose(graph, cluster, **kwargs):
        if cluster.num_devices == 4:  # the one pipeline on every device
            raise SolverTimeoutError("CP-SAT found no feasible plan within time_limit_s=0.1 for 4 nodes on 4 devices.")
        return real(graph, cluster, **kwargs)

    monkeypatch.setattr(module, "choose", choose)
    choice = plan_replicas(_graph(2**20), _two_nodes(), batch_size=64, num_microbatches=2, schedule="gpipe")
    (pipeline,) = [c for c in choice.candidates if c.num_replicas == 1]
    assert pipeline.plan is None and pipeline.timed_out
    assert choice.plan.step_lower_bound_s is None and choice.plan.status == "heuristic"
