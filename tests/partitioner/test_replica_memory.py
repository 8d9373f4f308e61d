"""With D > 1 replicas each stage's R action holds a packed copy of its gradients beside their sums
(runtime/replicas.py; benchmarks/memory_model/allreduce.py measured it): the cost model counts two gradient
copies per trainable weight where one pipeline at M = 1 counts one."""

from __future__ import annotations

import pytest

import partitioner as pt
from partitioner.cost import ACCUMULATING_COPIES, REDUCING_COPIES
from partitioner.errors import InputError
from partitioner.search.replicas import plan_replicas
from partitioner.simulate import simulate


def _graph():
    graph = pt.chain_graph([1e12] * 4, param_bytes=[2**20] * 4, activation_bytes=[1024] * 4)
    graph.graph.update(batch_size=8, num_microbatches=1)
    return graph


@pytest.mark.parametrize(("m", "d", "copies"), [(1, 1, 1), (1, 2, 2), (4, 1, 2), (4, 2, 2)])
def test_gradient_copies_count_the_all_reduce_packed_copy(m, d, copies):
    costs = pt.CostModel(_graph(), pt.Cluster.uniform(2, memory="1GiB"), num_microbatches=m, num_replicas=d)
    assert costs.gradient_copies == copies == 1 + max(ACCUMULATING_COPIES * (m > 1), REDUCING_COPIES * (d > 1))
    # weights, their gradient copies and Adam's two slots
    assert costs.weight_bytes("layer_0") == 2**20 * (1 + copies + 2)


def test_a_replicas_plan_prices_its_stages_with_the_packed_copy():
    """plan_replicas plans replica 0 with D; its plan's cost model (simulate, validate_plan) says the same."""
    graph, cluster = _graph(), pt.Cluster.uniform(4, memory="1GiB")
    choice = plan_replicas(graph, cluster, batch_size=8, replicas=2, num_microbatches=1, time_limit_s=5)
    plan = choice.plan
    assert plan.num_replicas == 2
    costs = plan.cost_model(choice.graph, cluster)
    assert costs.num_replicas == 2 and costs.gradient_copies == 2
    alone = pt.solve(choice.graph, cluster.take(2), num_microbatches=1, time_limit_s=5)
    assert alone.cost_model(choice.graph, cluster.take(2)).gradient_copies == 1


def test_a_plan_that_fits_alone_can_miss_with_replicas():
    """Weights that fit one device beside one gradient copy and Adam's slots do not beside two."""
    graph = pt.chain_graph([1e12], param_bytes=[100 * 2**20], activation_bytes=[0])
    cluster = pt.Cluster.uniform(1, memory="450MiB")  # 100 MiB x (1 + 1 + 2) fits, x (1 + 2 + 2) does not
    pt.solve(graph, cluster, num_microbatches=1)
    with pytest.raises(pt.InfeasiblePlanError):
        pt.solve(graph, cluster, num_microbatches=1, num_replicas=2)


@pytest.mark.parametrize("d", [0, 1.5, True])
def test_num_replicas_must_be_a_count(d):
    with pytest.raises(InputError, match=r"num_replicas must be an integer >= 1. Received: "):
        pt.Problem(_graph(), pt.Cluster.uniform(2, memory="1GiB"), num_replicas=d)


def test_a_plan_records_the_replicas_its_memory_was_priced_for():
    """A worker's plan (solve with num_replicas, no replicas' devices): its cost model, simulation and JSON
    say D, so validate_plan and simulate price the packed copy as the plan did."""
    graph, cluster = _graph(), pt.Cluster.uniform(2, memory="1GiB")
    plan = pt.solve(graph, cluster, num_microbatches=1, num_replicas=2, time_limit_s=5)
    assert plan.priced_replicas == 2 and plan.num_replicas == 1  # its replicas' devices are other workers'
    assert plan.cost_model(graph, cluster).gradient_copies == 2
    again = pt.Plan.from_json(plan.to_json())
    assert again.priced_replicas == 2 and again.memory_bytes == plan.memory_bytes
    assert pt.simulate(again, graph, cluster).peak_memory_bytes == pt.simulate(plan, graph, cluster).peak_memory_bytes
    pt.validate_plan(again, graph, cluster)
    assert pt.solve(graph, cluster, num_microbatches=1, time_limit_s=5).priced_replicas == 1


def test_a_plan_file_without_priced_replicas_loads_as_one():
    import json

    plan = pt.solve(_graph(), pt.Cluster.uniform(2, memory="1GiB"), num_microbatches=1, time_limit_s=5)
    data = json.loads(plan.to_json())
    del data["priced_replicas"]
    assert pt.Plan.from_json(json.dumps(data)).priced_replicas == 1
    data["priced_replicas"] = 0
    with pytest.raises(pt.PlanError, match=r"is corrupt: priced_replicas 0 is not an integer >= 1"):
        pt.Plan.from_json(json.dumps(data))


def test_a_workers_all_reduce_is_priced_only_on_a_plan_of_one_of_several_workers():
    from partitioner.search.replicas import with_worker_reductions

    graph = pt.chain_graph([4e11] * 4, param_bytes=[2**28] * 4, activation_bytes=[2**20] * 4)
    cluster = pt.Cluster.uniform(2, memory="16GiB", flops_per_s=100e12, bandwidth=100e9)
    alone = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=5)
    with pytest.raises(InputError, match=r"The plan was priced for one worker: there is no all-reduce between workers"):
        with_worker_reductions(alone, graph, cluster, 10e9)
    one_of_four = pt.solve(graph, cluster, num_microbatches=4, num_replicas=4, time_limit_s=5)
    with pytest.raises(InputError, match=r"The workers' link needs a bandwidth > 0 in bytes per second\. Received: 0"):
        with_worker_reductions(one_of_four, graph, cluster, 0)
    priced = with_worker_reductions(one_of_four, graph, cluster, 10e9)
    for device in priced.stages:  # 2 x 3/4 of the stage's gradients (two layers of 256 MiB) at 10 GB/s
        assert priced.reduce_times[device] == pytest.approx(2 * 3 / 4 * 2 * 2**28 / 10e9)
    assert priced.step_lower_bound_s == one_of_four.step_lower_bound_s  # R only lengthens a step
    assert priced.gap > one_of_four.gap


def test_the_search_weighs_each_stages_all_reduce_between_workers():
    """A GPipe chain whose last layer holds 2 GiB of weights, planned for one of 4 workers on a 10 GB/s link: the
    search that prices no R balances compute (3 | 3 layers), and its step with R is 374 ms; with the workers'
    reductions in the cost model it moves layers off the last stage, whose R then starts sooner (5 | 1: 353 ms),
    and the plan's step, reduce_times and status agree with the simulator's (the search was blind to R before)."""
    from partitioner.search.replicas import with_worker_reductions

    graph = pt.chain_graph([4e11] * 6, param_bytes=[2**20] * 5 + [2**31], activation_bytes=[2**20] * 6)
    cluster = pt.Cluster.uniform(2, memory="64GiB", flops_per_s=100e12, bandwidth=100e9)
    blind = pt.solve(graph, cluster, num_microbatches=4, num_replicas=4, time_limit_s=5)
    reductions = pt.Reductions.between_workers(cluster, 4, 10e9)
    aware = pt.solve(graph, cluster, num_microbatches=4, num_replicas=4, time_limit_s=5, reductions=reductions)
    priced = with_worker_reductions(blind, graph, cluster, 10e9)
    assert [len(blind.nodes_on(d)) for d in blind.stages] == [3, 3]
    assert [len(aware.nodes_on(d)) for d in aware.stages] == [5, 1]
    assert aware.step_time_s == pytest.approx(0.3528, abs=1e-4) and priced.step_time_s == pytest.approx(
        0.3744, abs=1e-4
    )
    assert aware.reduce_times == with_worker_reductions(aware, graph, cluster, 10e9).reduce_times
    assert simulate(aware, graph, cluster).step_time_s == pytest.approx(aware.step_time_s)
    assert aware.step_lower_bound_s <= aware.step_time_s
    with pytest.raises(InputError, match=r"reductions price a ring of 4 replicas, but num_replicas is 2"):
        pt.solve(graph, cluster, num_microbatches=4, num_replicas=2, time_limit_s=5, reductions=reductions)


def test_measured_reduce_times_lengthen_the_step_where_they_end_it():
    """``with_reduce_times`` (the times plan_and_wrap measures on workers): stage 0's R ends the step after the
    last backward, all of it; the last stage's R hides behind stage 0's backwards where it is shorter."""
    from partitioner.search.replicas import with_reduce_times

    graph = pt.chain_graph([4e11] * 4, param_bytes=[2**28] * 4, activation_bytes=[2**20] * 4)
    cluster = pt.Cluster.uniform(2, memory="16GiB", flops_per_s=100e12, bandwidth=100e9)
    plan = pt.solve(graph, cluster, num_microbatches=4, num_replicas=2, time_limit_s=5)
    first, last = plan.stages
    assert with_reduce_times(plan, graph, cluster, {first: 0.05}).step_time_s == pytest.approx(plan.step_time_s + 0.05)
    hidden = with_reduce_times(plan, graph, cluster, {last: 0.001})
    assert hidden.step_time_s == pytest.approx(plan.step_time_s)
    assert hidden.reduce_times == {first: 0.0, last: 0.001}
    with pytest.raises(InputError, match=r"reduce_times names devices the plan does not have: \['/GPU:9'\]"):
        with_reduce_times(plan, graph, cluster, {"/GPU:9": 0.1})


def test_a_replicas_plan_keeps_its_own_all_reduce():
    from partitioner.search.replicas import with_worker_reductions

    graph = pt.chain_graph([4e11] * 4, param_bytes=[2**20] * 4, activation_bytes=[2**20] * 4)
    graph.graph.update(batch_size=64, num_microbatches=1)
    cluster = pt.Cluster.uniform(4, memory="96GiB", flops_per_s=100e12, bandwidth=100e9)
    plan = plan_replicas(graph, cluster, batch_size=64, replicas=4, time_limit_s=5).plan
    assert plan.num_replicas == 4
    with pytest.raises(InputError, match=r"The plan holds 4 replicas of this cluster's devices \(plan_replicas\)"):
        with_worker_reductions(plan, graph, cluster, 10e9)
