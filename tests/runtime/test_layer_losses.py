"""Losses layers add while they run (activity regularizers, add_loss): the wrapped model's loss,
evaluation and weights after training steps equal the original's."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from partitioner.errors import InputError
from runtime import plan_and_wrap


@keras.saving.register_keras_serializable(package="tests")
class MeanPenalty(keras.layers.Layer):  # type: ignore[misc]  # keras ships no type hints
    """Adds half the mean of its input to the loss (a loss made with add_loss), returns the input."""

    def call(self, x):
        self.add_loss(keras.ops.mean(x) * 0.5)
        return x


@keras.saving.register_keras_serializable(package="tests")
class LargestPenalty(keras.layers.Layer):  # type: ignore[misc]
    """Adds half the largest value of its input: a batch-wide loss, as a mixture of experts' router loss is."""

    def call(self, x):
        self.add_loss(keras.ops.max(x) * 0.5)
        return x


@keras.saving.register_keras_serializable(package="tests")
class ScaleWithPenalty(keras.layers.Layer):  # type: ignore[misc]
    """Scales its input by a weight and, in training only, adds a penalty on that weight (the same on any rows)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x, training=None):
        if training:
            self.add_loss(keras.ops.sum(keras.ops.square(self.scale - 0.5)) * 0.1)
        return x * self.scale


def _model(add_loss: bool | type) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L1L2(0.1, 0.2), name="first")(inputs)
    if add_loss:
        h = (MeanPenalty if add_loss is True else add_loss)(name="penalty")(h)
    h = keras.layers.Dense(6, activity_regularizer="l2", name="second")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


def _data(batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(batch)
    return rng.random((batch, 4), dtype=np.float32), rng.random((batch, 2), dtype=np.float32)


def _assert_wrapped_matches(model, devices, batch, num_microbatches, **wrap_options) -> None:
    x, y = _data(batch)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile("sgd", "mse")
    expected_eval = reference.evaluate(x, y, verbose=0)
    expected = [reference.train_on_batch(x, y) for _ in range(2)]
    pins = {"first": devices[0], "head": devices[1]}  # a cut the layer losses must cross
    wrapped = plan_and_wrap(
        model, devices=devices[:2], batch_size=batch, num_microbatches=num_microbatches, pins=pins, **wrap_options
    )
    assert wrapped.plan.num_stages == 2
    if wrap_options.get("recompute") == "always":
        assert wrapped.options.recompute == (True, False)
    wrapped.compile("sgd", "mse")
    assert wrapped.evaluate(x, y, verbose=0) == pytest.approx(expected_eval, rel=1e-5)
    assert [wrapped.train_on_batch(x, y) for _ in range(2)] == pytest.approx(expected, rel=1e-5)
    weights, after = reference.get_weights(), wrapped.unwrap().get_weights()
    assert len(weights) == len(after) == len(model.get_weights())
    for want, got in zip(weights, after, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_add_loss_and_activity_regularizers_count_at_one_microbatch(virtual_devices) -> None:
    _assert_wrapped_matches(_model(add_loss=True), virtual_devices, batch=8, num_microbatches=1)


@pytest.mark.parametrize(
    ("batch", "num_microbatches", "options"),
    [
        (8, 2, {}),
        (7, 3, {}),  # a remainder: the last micro-batch repeats a row, left out of its regularizer
        (8, 4, {"schedule": "1f1b"}),
        (7, 2, {"recompute": "always"}),
    ],
)
def test_activity_regularizers_split_exactly_over_microbatches(
    batch: int, num_microbatches: int, options: dict, virtual_devices
) -> None:
    _assert_wrapped_matches(_model(add_loss=False), virtual_devices, batch, num_microbatches, **options)


@pytest.mark.parametrize(
    ("layer", "batch", "num_microbatches", "options"),
    [
        (MeanPenalty, 8, 2, {}),
        (MeanPenalty, 8, 4, {"schedule": "1f1b", "recompute": "always"}),
        (ScaleWithPenalty, 7, 3, {}),  # the same on any rows: a remainder batch splits it exactly too
    ],
)
def test_add_loss_of_a_mean_or_a_constant_splits_exactly_over_microbatches(
    layer: type, batch: int, num_microbatches: int, options: dict, virtual_devices
) -> None:
    """Refused at M > 1 before stop 38; the wrap's probe measures what each added loss is (``check_rows``)."""
    _assert_wrapped_matches(_model(add_loss=layer), virtual_devices, batch, num_microbatches, **options)


def test_add_loss_of_a_mean_on_a_batch_m_does_not_divide_is_refused_before_the_step_moves_a_weight(
    virtual_devices,
) -> None:
    model = _model(add_loss=True)
    x, y = _data(15)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile("sgd", "mse")
    reference.train_on_batch(x[:8], y[:8])
    wrapped = plan_and_wrap(model, devices=virtual_devices[:2], batch_size=8, num_microbatches=2)
    wrapped.compile("sgd", "mse")
    message = r"a mean over the batch's rows .* a batch of 7 rows does not split into 2"
    with pytest.raises(InputError, match=message):  # a batch of static size: at the trace
        wrapped.train_on_batch(x[8:], y[8:])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # batches of unknown size: 8, then 7 rows
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"a batch of B rows does not split into 2.*B =.*7"):
        wrapped.fit(dataset, epochs=1, verbose=0)
    for want, got in zip(reference.get_weights(), wrapped.unwrap().get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # the first batch's step, not the second's


def test_batch_wide_add_loss_is_refused_at_wrap_or_taken_per_microbatch(virtual_devices) -> None:
    model = _model(add_loss=LargestPenalty)
    x, y = _data(8)
    message = r"'penalty' \(LargestPenalty\) .* adds a loss \(add_loss\) that is a batch-wide value: .*"
    message += r"added_losses=\"per_microbatch\""
    with pytest.raises(InputError, match=message):
        plan_and_wrap(model, devices=virtual_devices[:2], batch_size=8, num_microbatches=2)
    wrapped = plan_and_wrap(
        model, devices=virtual_devices[:2], batch_size=8, num_microbatches=2, added_losses="per_microbatch"
    )
    assert wrapped.options.loss_kinds == {"penalty": "batch"}
    wrapped.compile("sgd", "mse")
    model.compile("sgd", "mse")
    halves = [model.evaluate(x[a : a + 4], y[a : a + 4], verbose=0) for a in (0, 4)]  # each half's own penalty
    assert wrapped.evaluate(x, y, verbose=0) == pytest.approx(np.mean(halves), rel=1e-5)
    assert abs(wrapped.evaluate(x, y, verbose=0) - model.evaluate(x, y, verbose=0)) > 1e-3  # by design
    with pytest.raises(InputError, match=r"added_losses must be one of \('exact', 'per_microbatch'\)"):
        plan_and_wrap(model, devices=virtual_devices[:2], batch_size=8, num_microbatches=2, added_losses="sum")


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_evaluate_counts_layer_losses_once_after_recompile_and_an_eager_call(
    num_microbatches: int, virtual_devices
) -> None:
    """An eager call leaves its added losses on the layers (Keras drops them at the model's next call,
    which the pipelined steps never make): evaluate and val_loss count the step's own, once."""
    model = _model(add_loss=True)
    x, y = _data(8)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    wrapped = plan_and_wrap(
        model,
        devices=virtual_devices[:2],
        batch_size=8,
        num_microbatches=num_microbatches,
        pins={"first": virtual_devices[0], "head": virtual_devices[1]},
    )
    assert wrapped.plan.num_stages == 2
    for m in (reference, wrapped):
        m.compile("sgd", "mse")
        m.evaluate(x, y, verbose=0)
        m.compile("sgd", "mse")
        m(x)
    assert wrapped.evaluate(x, y, verbose=0) == pytest.approx(reference.evaluate(x, y, verbose=0), rel=1e-5)
    expected = reference.fit(x, y, validation_data=(x, y), epochs=1, verbose=0).history
    logs = wrapped.fit(x, y, validation_data=(x, y), epochs=1, verbose=0).history
    assert sorted(logs) == sorted(expected) == ["loss", "val_loss"]
    for key in expected:
        assert logs[key] == pytest.approx(expected[key], rel=1e-5)


def test_evaluate_without_any_loss_is_refused(virtual_devices) -> None:
    model = _model(add_loss=False)
    for layer in model.layers:  # no activity regularizer: no loss a layer adds
        layer.activity_regularizer = None
    x, y = _data(8)
    wrapped = plan_and_wrap(model, devices=virtual_devices[:2], batch_size=8, num_microbatches=2)
    wrapped.compile("sgd")
    with pytest.raises(InputError, match=r"No loss to evaluate: compile\(loss=\.\.\.\) first"):
        wrapped.evaluate(x, y, verbose=0)
