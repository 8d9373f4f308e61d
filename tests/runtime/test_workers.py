"""Data x pipeline across worker processes: 2 workers x 2 stages, started by ``partitioner launch``,
against one Keras model trained on the whole batch (slow suite: each case starts 2 TensorFlow processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from partitioner.plan import Plan

HERE = Path(__file__).parent / "workers"
sys.path.insert(0, str(HERE))
from shards import GLOBAL_BATCH, NUM_STEPS, batch, build, output_compile_arguments, output_data, two_outputs  # noqa: E402
from test_transparency import _reference_loss  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 240


def _launch(out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "partitioner.cli", "launch", "--workers", "2", "--devices-per-worker", "2"]
    command += ["--timeout", str(TIMEOUT_S), "--log-dir", str(out / "logs"), "--"]
    command += [sys.executable, str(HERE / "train.py"), str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}  # the workers import this checkout
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S + 30, check=False, env=env)


def _reference(kind: str = "mlp") -> keras.Model:
    """The original model with worker 0's initial weights, compiled as the workers compile theirs."""
    keras.utils.set_random_seed(100)  # worker 0's seed
    reference = build(kind)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9) if kind == "masked" else keras.optimizers.Adam(0.01)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"] if kind == "mlp" else [])
    return reference


def _assert_workers_match(out: Path, expected: list, losses: list, evaluated: float | None = None) -> None:
    """Every worker's saved weights and per-step losses (and evaluate's loss) equal the reference's; the
    workers' weights bitwise equal to each other."""
    workers = [np.load(out / f"worker-{rank}.npz") for rank in range(2)]
    for saved in workers:
        weights = [saved[f"arr_{i}"] for i in range(len(expected))]
        assert len(saved.files) == len(expected) + 3
        for actual, value in zip(weights, expected, strict=True):
            np.testing.assert_allclose(actual, value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(saved["losses"], losses, rtol=1e-5)
        if evaluated is not None:
            np.testing.assert_allclose(saved["evaluated"], evaluated, rtol=1e-5)
            # two steps of 8 and 7 global rows, weighted by them: the mean over the 15 rows (each worker weighted
            # the steps by its own rows, 4 + 4 and 4 + 3, before: found by probing, stop 36)
            np.testing.assert_allclose(saved["evaluated_steps"], evaluated, rtol=1e-5)
    for key in workers[0].files:
        if key not in ("losses", "evaluated", "evaluated_steps"):
            np.testing.assert_array_equal(workers[0][key], workers[1][key])


@pytest.mark.parametrize(
    ("schedule", "num_microbatches", "recompute", "flags"),
    [
        ("gpipe", 1, "never", ()),
        ("gpipe", 2, "never", ()),
        ("1f1b", 4, "always", ()),
        ("gpipe", 2, "never", ("--data-parallel",)),  # K = 1: pure data parallel, one device per worker
    ],
)
def test_two_workers_train_as_one_model_on_the_whole_batch(
    schedule, num_microbatches, recompute, flags, tmp_path
) -> None:
    """Uneven shards (8 and 7 rows of 15), an L2 penalty, Adam, 3 steps, each worker seeded differently:
    the workers end bitwise equal (worker 0's initial weights were broadcast) and equal, within 1e-5, to
    the original model trained on the whole batch with worker 0's initial weights (what MirroredStrategy
    computes for K = 1). Each step's loss and accuracy, and evaluate's, are the global batch's on both
    workers (the accuracy was each worker's shard's until stop 37)."""
    result = _launch(tmp_path, schedule, str(num_microbatches), recompute, *flags)
    assert result.returncode == 0, result.stdout[-3000:]
    reference = _reference()
    losses = [reference.train_on_batch(*batch(step)) for step in range(NUM_STEPS)]
    evaluated = reference.evaluate(*batch(NUM_STEPS - 1), verbose=0)  # evaluate: the global batch's loss too
    _assert_workers_match(tmp_path, reference.get_weights(), losses, evaluated)
    assert (tmp_path / "logs" / "worker-1.log").read_text().count("worker 1 of 2 done") == 1
    for rank in range(2):  # each stage's all-reduce, timed at wrap, is in the plan's predicted step
        plan = Plan.from_json((tmp_path / f"plan-{rank}.json").read_text())
        assert plan.priced_replicas == 2
        assert all(plan.reduce_times[d] > 0 for d in plan.stages), plan.reduce_times
        assert plan.step_time_s > max(plan.reduce_times.values())


def test_data_parallel_workers_train_as_mirrored_strategy(tmp_path, virtual_devices) -> None:
    """D = 2, K = 1 (one device per worker, pure data parallel) against TensorFlow's MirroredStrategy in one
    process on 2 logical devices, on the same global batches (even: 14 rows, 7 per replica; on the uneven
    15 MirroredStrategy itself fails, "Inputs to operation AddN ... must have the same size", where the
    workers train as the original). The same weights and losses, within 1e-5."""
    result = _launch(tmp_path, "gpipe", "1", "never", "--data-parallel", "--even")
    assert result.returncode == 0, result.stdout[-3000:]
    strategy = tf.distribute.MirroredStrategy(virtual_devices[:2])
    with strategy.scope():
        mirrored = _reference()
    losses = []
    for step in range(NUM_STEPS):
        x, y = batch(step)
        even = GLOBAL_BATCH // 2 * 2
        history = mirrored.fit(x[:even], y[:even], batch_size=even, epochs=1, shuffle=False, verbose=0)
        losses.append([history.history["loss"][0], history.history["accuracy"][0]])
    _assert_workers_match(tmp_path, mirrored.get_weights(), losses)


def test_two_workers_with_batch_normalization_train_as_the_microbatched_original(tmp_path) -> None:
    """Batch normalization on the first stage, 2 workers with M = 2 each on contiguous shards of 7 rows (14 of
    15): each micro-batch normalised by its own statistics, the moving statistics moved once per step towards
    the whole global batch's (the R action sums the moments): the original model run on the same 4
    micro-batches, its moving statistics moved once (``_reference_loss``), 3 Adam steps."""
    result = _launch(tmp_path, "gpipe", "2", "never", "--bn")
    assert result.returncode == 0, result.stdout[-3000:]
    reference = _reference("bn")
    rows = GLOBAL_BATCH // 2 * 2
    losses = []
    for step in range(NUM_STEPS):
        x, y = (part[:rows] for part in batch(step))
        with tf.GradientTape() as tape:
            loss = _reference_loss(reference, x, y, 4, sizes=[rows // 4] * 4 if rows % 4 == 0 else [4, 3, 4, 3])
        grads = tape.gradient(loss, reference.trainable_weights)
        reference.optimizer.apply_gradients(zip(grads, reference.trainable_weights, strict=True))
        losses.append(float(loss))
    expected = reference.get_weights()
    assert len(expected) == 10  # moving mean and variance included
    _assert_workers_match(tmp_path, expected, losses)


def test_two_workers_with_a_masked_output_train_as_one_model_on_the_whole_batch(tmp_path) -> None:
    """A tagger whose output carries the padding mask, uneven shards (8 and 7 rows) holding different
    numbers of valid steps, M = 2: the loss is the mean over the global batch's valid steps (each replica's
    mean times its valid steps, summed, over the summed valid steps), in training and in evaluate; SGD
    with momentum, 3 steps, against the original on the whole batch."""
    result = _launch(tmp_path, "gpipe", "2", "never", "--masked")
    assert result.returncode == 0, result.stdout[-3000:]
    reference = _reference("masked")
    losses = [reference.train_on_batch(*batch(step, "masked")) for step in range(NUM_STEPS)]
    evaluated = reference.evaluate(*batch(NUM_STEPS - 1, "masked"), verbose=0)
    _assert_workers_match(tmp_path, reference.get_weights(), losses, evaluated)


def test_two_workers_with_a_layer_loss_train_as_one_model_on_the_whole_batch(tmp_path) -> None:
    """A layer's add_loss that is a mean over the rows, on uneven shards (8 and 7 rows), M = 1 on each worker:
    each replica's part weighted by its rows is the global batch's mean (refused with replicas until stop 38)."""
    result = _launch(tmp_path, "gpipe", "1", "never", "--penalty")
    assert result.returncode == 0, result.stdout[-3000:]
    reference = _reference("penalty")
    losses = [reference.train_on_batch(*batch(step)) for step in range(NUM_STEPS)]
    evaluated = reference.evaluate(*batch(NUM_STEPS - 1), verbose=0)
    _assert_workers_match(tmp_path, reference.get_weights(), losses, evaluated)


def test_two_workers_log_each_outputs_loss_of_the_global_batch(tmp_path) -> None:
    """Two outputs, shards of 10 and 6 rows fed as tf.data (the traced batch size unknown): each output's loss in
    fit's and evaluate's logs is the global batch's, as Keras logs it on the whole batch (found by probing, stop 38:
    Keras weights an output's loss by the static batch size, 1 here, so the workers logged the plain mean of their
    shards' losses, 0.945 against 0.865)."""
    command = [sys.executable, "-m", "partitioner.cli", "launch", "--workers", "2", "--devices-per-worker", "2"]
    command += ["--timeout", str(TIMEOUT_S), "--", sys.executable, str(HERE / "outputs.py"), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S + 30, check=False, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    keras.utils.set_random_seed(1)
    reference = two_outputs()
    reference.compile(**output_compile_arguments())
    dataset = tf.data.Dataset.from_tensor_slices(output_data()).batch(16)
    expected = {key: values[0] for key, values in reference.fit(dataset, epochs=1, verbose=0).history.items()}
    evaluated = reference.evaluate(dataset, verbose=0, return_dict=True)
    expected.update({f"evaluate_{key}": value for key, value in evaluated.items()})
    assert sorted(expected) == ["a_loss", "b_loss", "evaluate_a_loss", "evaluate_b_loss", "evaluate_loss", "loss"]
    for rank in range(2):
        logs = json.loads((tmp_path / f"logs-{rank}.json").read_text())
        assert logs == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("flag", ["--disagree", "--other-activation"])
def test_workers_with_different_plans_or_layers_refuse_to_start(flag: str, tmp_path) -> None:
    """Another placement on worker 1, or another activation in one of its layers (the same shapes: two workers
    trained a silent mix of the two models, found by probing, stop 38)."""
    result = _launch(tmp_path, "gpipe", "2", "never", flag)
    assert result.returncode != 0
    message = "The 2 replicas do not agree on the plan, its stages' variables and their layers' configs"
    assert message in result.stdout
    assert not list(tmp_path.glob("worker-*.npz"))
