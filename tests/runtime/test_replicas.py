"""The R action's primitive in one process: the same stage of 4 replicas on 4 logical devices."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from partitioner.errors import InputError
from runtime import executed
from runtime.devices import canonical
from runtime.replicas import Replicas, StageCollectives, _action_counts, agree, in_step, out_of_step_raised

NUM = 4


def _values(dtype: str) -> list[list[np.ndarray]]:
    """Per replica: a matrix, a vector and a scalar (shapes as gradients have them), distinct per replica,
    of values whose sums are exact in any order (multiples of 1/8 below 2^10)."""
    rng = np.random.default_rng(0)
    return [
        [(rng.integers(-999, 999, size=shape) / 8).astype(dtype) for shape in ((3, 5), (7,))]
        + [np.asarray(r + 0.5, dtype)]
        for r in range(NUM)
    ]


def _sum_on_each_device(groups: list[StageCollectives], values: list[list[np.ndarray]], purpose: str) -> list:
    @tf.function(autograph=False)
    def run() -> list:
        return [group.sum([tf.constant(v) for v in mine], purpose) for group, mine in zip(groups, values, strict=True)]

    return run


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_stage_sum_over_replicas_equals_the_sum_and_runs_on_each_device(dtype, virtual_devices) -> None:
    groups = [StageCollectives(0, device, NUM) for device in virtual_devices[:NUM]]
    values = _values(dtype)
    run = _sum_on_each_device(groups, values, "gradients")
    results, nodes = executed.collect_executed(run)
    expected = [sum(v[i].astype(np.float64) for v in values) for i in range(3)]
    assert len(results) == NUM
    for result in results:
        assert [r.shape for r in result] == [e.shape for e in expected]
        for r, e in zip(result, expected, strict=True):
            np.testing.assert_array_equal(r.numpy(), e)
    reductions = [n for n in nodes if n.op == "CollectiveReduceV2"]
    assert sorted(canonical(n.device) for n in reductions) == sorted(virtual_devices[:NUM])  # one per replica


def test_stage_sum_packs_each_dtype_into_one_collective(virtual_devices) -> None:
    groups = [StageCollectives(1, device, NUM) for device in virtual_devices[:NUM]]
    values = [
        [np.full((2, 2), r, "float32"), np.full((3,), r, "float64"), np.full((4,), r, "float32")] for r in range(NUM)
    ]
    run = _sum_on_each_device(groups, values, "gradients")
    results, nodes = executed.collect_executed(run)
    total = sum(range(NUM))
    for result in results:
        assert [r.dtype for r in result] == [tf.float32, tf.float64, tf.float32]
        for r in result:
            np.testing.assert_array_equal(r.numpy(), np.full(r.shape, total))
    assert len([n for n in nodes if n.op == "CollectiveReduceV2"]) == 2 * NUM  # two dtypes, four replicas


def test_replicas_agree_or_say_what_differs(virtual_devices) -> None:
    groups = [StageCollectives(2, device, 2) for device in virtual_devices[:2]]

    @tf.function(autograph=False)
    def both() -> list:
        return [g.sum([tf.ones([4])], "agree") for g in groups]

    same = both()
    assert all(np.array_equal(s[0].numpy(), 2 * np.ones(4)) for s in same)
    one = [StageCollectives(3, virtual_devices[0], 1)]
    agree(one, "anything", "the plan")  # one replica agrees with itself


def test_a_replica_out_of_step_raises_and_the_replicas_go_on_in_step(virtual_devices) -> None:
    """Replica 0 is at a training step, replica 1 at the end of an epoch: replica 0's step raises the out-of-step
    error with the replicas' counts (its gradient sum, left waiting for a partner that never comes, is cancelled
    with the step). Then both sum again, in step."""
    groups = [StageCollectives(7, device, 2) for device in virtual_devices[:2]]

    @tf.function(autograph=False)
    def out_of_step() -> list:
        in_step(groups[:1], "a training step", [])
        summed = groups[0].sum([tf.ones([3])])
        with tf.device(groups[1].device):
            return [summed, _action_counts(groups[1], "the end of an epoch")]

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        out_of_step()
    assert out_of_step_raised(str(raised.value.message)) == (
        "The replicas are out of step: this worker is at a training step and another is not (1 at a training "
        "step, 1 at the end of an epoch). Expected every worker to run the same number of training and validation "
        "steps and to call fit and evaluate alike (evaluate on every worker, not only on worker 0); give each "
        "worker shards of equal size, or steps_per_epoch and validation_steps (and steps for evaluate) that the "
        "data of every worker can fill."
    )
    assert out_of_step_raised("assertion failed: [another assertion]") is None

    @tf.function(autograph=False)
    def in_step_together() -> list:
        results = []
        for group in groups:
            in_step([group], "a training step", [])
            results.append(group.sum([tf.ones([3])])[0])
        return results

    for result in in_step_together():
        np.testing.assert_array_equal(result.numpy(), [2.0, 2.0, 2.0])


def test_replicas_are_checked() -> None:
    with pytest.raises(InputError, match=r"replicas must be an integer >= 1. Received: 0"):
        Replicas(0)
    with pytest.raises(InputError, match=r"rank must be in \[0, 2\). Received: rank=2"):
        Replicas(2, rank=2)


@pytest.mark.parametrize(
    ("planned", "run", "more"),
    [
        ((1, 1), (1, 2), 1),  # one pipeline at M = 1 run as one of 2: the packed copy is not counted
        ((1, 2), (1, 2), 0),  # priced for 2 (partitioner plan --workers 2)
        ((1, 2), (1, 4), 0),  # priced for replicas: the same copy, however many
        ((4, 1), (4, 2), 0),  # M > 1: the sums' copies cover it
        ((4, 1), (1, 2), 0),  # planned at M = 4: the sums' copies it counted cover the packed one at M = 1
        ((1, 1), (4, 2), 1),  # the sums: one more than priced at M = 1 on one pipeline
        ((1, 2), (4, 2), 0),  # priced for the replicas at M = 1, run at M = 4: the packed copy covers the sums
        ((1, 1), (4, 1), 1),  # one pipeline run at a larger M than planned
    ],
)
def test_a_plan_run_by_more_replicas_or_micro_batches_than_priced_says_what_it_does_not_count(planned, run, more):
    import partitioner as pt
    from partitioner.cost import CostModel
    from runtime.wrap import unpriced_replicas_note

    graph = pt.chain_graph([1e9] * 2, param_bytes=[1024] * 2, activation_bytes=[1024] * 2, edge_bytes=[1024])
    cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12)
    m, d = planned
    costs = CostModel(graph, cluster, num_microbatches=m, num_replicas=d)
    plan = pt.score_assignment({"layer_0": "/GPU:0", "layer_1": "/GPU:1"}, costs, method="manual")
    note = unpriced_replicas_note(plan, *run)
    if not more:
        assert note is None
    else:
        assert note is not None
        assert f"priced at M = {m} on {d} pipeline(s) and runs at M = {run[0]} as one of {run[1]}" in note
        assert f"each stage holds {more} more cop{'y' if more == 1 else 'ies'} of its weight gradients" in note
        assert f"partitioner plan --workers {run[1]} --micro-batches {run[0]}" in note
