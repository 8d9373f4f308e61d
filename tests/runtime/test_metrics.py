"""Compiled metrics updated micro-batch by micro-batch (runtime/metrics.py) log what Keras logs.

Each case trains the original and the wrapped model (2 stages, M = 4) by ``fit`` the same way, with
batches M does not divide (10 rows: micro-batches of 3, 3, 3 and 1 rows; the epoch's last, 5 rows: 2, 2, 1 and none),
and compares every logged value, the validation's too (batches of 10 and 3 rows). Where every metric
sums over rows the runtime updates them, and in evaluation takes the loss, from each micro-batch's own rows
and never stacks the outputs; a metric of the user's takes the stacked batch.
"""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import plan_and_wrap
from runtime.metrics import ByMicrobatch, sums_over_rows
from runtime.microbatches import Microbatches

BATCH, ROWS, CLASSES = 10, 25, 3


def _model() -> keras.Model:
    inputs = keras.Input((6,), name="features")
    x = keras.layers.Dense(12, activation="tanh", name="first")(inputs)
    x = keras.layers.Dense(12, activation="relu", name="second")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax", name="head")(x))


class BatchMaximum(keras.metrics.Metric):
    """The largest prediction of the last batch: a state that is not a sum over rows."""

    def __init__(self, name: str = "batch_maximum") -> None:
        super().__init__(name=name)
        self.value = self.add_variable(shape=(), initializer="zeros", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        self.value.assign(keras.ops.max(y_pred))

    def result(self):
        return self.value


def _sparse_metrics() -> dict:
    return {
        "metrics": [
            "accuracy",
            keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
            keras.metrics.SparseCategoricalCrossentropy(name="xent"),
            keras.metrics.MeanMetricWrapper(keras.metrics.sparse_categorical_accuracy, name="wrapped"),
        ],
        "weighted_metrics": ["accuracy"],
    }


def _one_hot_metrics() -> dict:
    return {
        "metrics": [
            keras.metrics.CategoricalAccuracy(name="accuracy"),
            keras.metrics.AUC(name="auc"),
            keras.metrics.Precision(name="precision"),
            keras.metrics.Recall(name="recall"),
            keras.metrics.F1Score(average="macro", name="f1"),
            keras.metrics.MeanSquaredError(name="mse"),
        ],
    }


def _compiled(case: str) -> dict:
    """compile's metrics for ``case``, new objects each call (a metric belongs to one model)."""
    if case == "one_hot":
        return _one_hot_metrics()
    compiled = _sparse_metrics()
    if case == "user_metric":
        compiled["metrics"].append(BatchMaximum())
    return compiled


def _fit(model: keras.Model, compiled: dict, loss: str, one_hot: bool, weighted: bool) -> dict:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.integers(0, CLASSES, ROWS)
    if one_hot:
        y = np.eye(CLASSES, dtype="float32")[y]
    options: dict = {"epochs": 2, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    validation = (x[:13], y[:13])  # evaluated in batches of 10 and 3 (micro-batches of 1 row, one empty)
    if weighted:
        options["sample_weight"] = rng.uniform(0.2, 2.0, ROWS).astype("float32")
        validation += (options["sample_weight"][:13] ** 2,)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, **compiled)
    return model.fit(x, y, validation_data=validation, **options).history


def _pair(model: keras.Model, devices: list[str], first: str, last: str) -> tuple[keras.Model, keras.Model]:
    """The original (a copy with its weights) and the model wrapped on 2 stages, ``first`` and ``last`` pinned
    to one device each, M = 4."""
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    pins = {first: devices[0], last: devices[1]}
    wrapped = plan_and_wrap(model, devices=devices[:2], batch_size=BATCH, num_microbatches=4, pins=pins)
    assert wrapped.plan.num_stages == 2
    return reference, wrapped


def _runs(monkeypatch) -> list[int]:
    """Grows by one each time a step takes the micro-batch path (``ByMicrobatch.run``, once per trace)."""
    runs: list[int] = []
    run = ByMicrobatch.run
    monkeypatch.setattr(ByMicrobatch, "run", lambda *a: runs.append(1) or run(*a))
    return runs


def _assert_same_logs(logged: dict, expected: dict, atol: float = 0.0) -> None:
    assert sorted(logged) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(logged[key], value, rtol=1e-5, atol=atol, err_msg=key)


@pytest.mark.parametrize(
    ("case", "by_microbatch"),
    [("sparse", True), ("sparse_weighted", True), ("one_hot", True), ("user_metric", False)],
)
def test_logged_metrics_match_the_original(case: str, by_microbatch: bool, virtual_devices, monkeypatch) -> None:
    keras.utils.set_random_seed(0)
    reference, wrapped = _pair(_model(), virtual_devices, "first", "head")
    updates = _runs(monkeypatch)
    one_hot = case == "one_hot"
    loss = "categorical_crossentropy" if one_hot else "sparse_categorical_crossentropy"
    weighted = case == "sparse_weighted"
    expected = _fit(reference, _compiled(case), loss, one_hot, weighted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(wrapped, _compiled(case), loss, one_hot, weighted)
    assert bool(updates) == by_microbatch  # traced once per function: the path the step took
    # the stacked path says what it holds that the plan does not count, naming the metric
    stacked = [str(w.message) for w in caught if "stacks the model's outputs" in str(w.message)]
    assert bool(stacked) != by_microbatch
    if stacked:
        assert re.match(
            r"Metric 'batch_maximum' \(\S*test_metrics\.BatchMaximum\) is not one of Keras' own.* the last stage "
            r"\(/device:CPU:\d\) stacks the model's outputs of all 4 micro-batches \(12 B a row of the batch\)",
            stacked[0],
        ), stacked[0]
    _assert_same_logs(history, expected, atol=1e-6)


def test_which_metrics_sum_over_rows() -> None:
    assert sums_over_rows(keras.metrics.SparseCategoricalAccuracy())
    assert sums_over_rows(keras.metrics.AUC())
    assert sums_over_rows(keras.metrics.MeanMetricWrapper(keras.losses.mean_squared_error))
    assert not sums_over_rows(keras.metrics.MeanMetricWrapper(lambda y, p: keras.ops.max(p)))  # a batch's value
    assert not sums_over_rows(BatchMaximum())


class _Collected:
    """What ``ByMicrobatch`` asks of an executor: M, and micro-batch m's own rows of the collected outputs."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches

    def microbatch_outputs(self, collected, m, rows):
        return collected.read(m)[:rows]


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 23), num=st.integers(1, 8), weighted=st.booleans())
def test_microbatch_rows_give_the_batchs_metrics_and_loss(batch: int, num: int, weighted: bool) -> None:
    """Micro-batch by micro-batch, each its own rows (the padded ones past B left out, micro-batches with
    no row skipped), the metrics' state and the loss's parts are the whole batch's, for every B and M."""
    num = min(num, batch)
    rng = np.random.default_rng(batch * 10 + num)
    y_pred = tf.constant(rng.uniform(size=(batch, CLASSES)), tf.float32)
    y = tf.constant(rng.integers(0, CLASSES, batch))
    weights = tf.constant(rng.uniform(0.2, 2.0, batch), tf.float32) if weighted else None
    parts = Microbatches(num, [y_pred])
    stacked = parts.stack(y_pred)  # [M, ceil(B/M), ...], the rows past B repeating real ones
    collected = tf.TensorArray(tf.float32, size=num).unstack(stacked)
    by_microbatch = ByMicrobatch(_Collected(num), collected, y, weights, tf.constant(batch))
    whole, split = (keras.metrics.SparseTopKCategoricalAccuracy(k=2) for _ in range(2))
    whole.update_state(y, y_pred, weights)

    def step(m, total):
        y_m, y_pred_m, weights_m = by_microbatch(m)
        split.update_state(y_m, y_pred_m, weights_m)
        return total + tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y_m, y_pred_m))

    loss = by_microbatch.run(step, tf.zeros([]))
    np.testing.assert_allclose(split.result(), whole.result(), rtol=1e-6)
    expected = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, y_pred))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    shares = [float(by_microbatch.share(m)) for m in range(num)]
    assert sum(shares) == pytest.approx(1.0)


@pytest.mark.parametrize("outputs", [1, 2])
def test_evaluate_first_matches_the_original(outputs: int, virtual_devices, monkeypatch) -> None:
    """``evaluate`` before any training step. With two outputs Keras logs each output's loss, from trackers
    that exist once the compiled loss is built (Keras builds it before the first step; the runtime builds
    it too before choosing the micro-batch path, which would leave them out): the stacked path. With one
    output, the micro-batch path."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="features")
    x = keras.layers.Dense(12, activation="tanh", name="first")(inputs)
    heads = [keras.layers.Dense(CLASSES, activation="softmax", name=f"head{i}")(x) for i in range(outputs)]
    model = keras.Model(inputs, heads if outputs > 1 else heads[0])
    reference, wrapped = _pair(model, virtual_devices, "features", "head0")
    rng = np.random.default_rng(5)
    data = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.integers(0, CLASSES, ROWS)
    targets = [y] * outputs if outputs > 1 else y
    updates = _runs(monkeypatch)
    results = []
    for each in (reference, wrapped):
        each.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"] * outputs)
        results.append(each.evaluate(data, targets, batch_size=BATCH, verbose=0, return_dict=True))
    expected, logged = results
    assert bool(updates) == (outputs == 1)
    assert outputs == 1 or "head1_loss" in logged
    _assert_same_logs(logged, expected)


def test_evaluate_with_an_unreduced_loss_matches_the_original(virtual_devices) -> None:
    """A loss with reduction=None has no exact split into micro-batches (training refuses it): ``evaluate``
    takes it on the stacked batch, as Keras does, instead of failing."""
    keras.utils.set_random_seed(0)
    reference, wrapped = _pair(_model(), virtual_devices, "first", "head")
    rng = np.random.default_rng(6)
    data, y = rng.normal(size=(ROWS, 6)).astype("float32"), rng.integers(0, CLASSES, ROWS)
    results = []
    for each in (reference, wrapped):
        loss = keras.losses.SparseCategoricalCrossentropy(reduction=None)
        each.compile(optimizer="sgd", loss=loss, metrics=["accuracy"])
        results.append(each.evaluate(data, y, batch_size=BATCH, verbose=0, return_dict=True))
    expected, logged = results
    _assert_same_logs(logged, expected)
