"""The user's own Python code in a model (a plain-function loss or metric, a Lambda layer): the wrapped
model wraps, trains, unwraps and saves it as plain Keras does, and loading asks what Keras' loading asks."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from runtime import plan_and_wrap

BATCH = 8


def my_loss(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def my_metric(y_true, y_pred):
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


def _data(model: keras.Model) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, *model.inputs[0].shape[1:])).astype("float32")
    y = rng.normal(size=(BATCH, *model.outputs[0].shape[1:])).astype("float32")
    return x, y


def _two_stages(model: keras.Model, devices: list[str], first: str, second: str):
    """Wraps ``model`` with ``first`` on one device and ``second`` on another (two stages, M = 2)."""
    pins = {first: devices[0], second: devices[1]}
    wrapped = plan_and_wrap(model, devices=devices[:2], batch_size=BATCH, num_microbatches=2, pins=pins)
    assert wrapped.plan.num_stages == 2
    return wrapped


def _copy(model: keras.Model) -> keras.Model:
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def test_plain_function_loss_and_metric_train_unwrap_and_save(tmp_path, virtual_devices) -> None:
    """A loss and a metric given as plain functions (which Keras' serialization finds only when registered):
    plan_and_wrap compiles the wrapped model with them, unwrap and save as plain Keras, and loading the file
    needs custom_objects exactly as for the plain model."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="fc2")(keras.layers.Dense(8, "relu", name="fc1")(inputs)))
    reference = _copy(model)
    for m in (model, reference):
        m.compile(
            optimizer=keras.optimizers.Adam(0.01), loss=my_loss, metrics=[my_metric, keras.metrics.MeanSquaredError()]
        )
    wrapped = _two_stages(model, virtual_devices, "fc1", "fc2")
    assert wrapped.loss is my_loss
    x, y = _data(model)
    logs = wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    expected = reference.train_on_batch(x, y, return_dict=True)
    assert sorted(logs) == sorted(expected) == ["loss", "mean_squared_error", "my_metric"]
    for key in expected:
        np.testing.assert_allclose(logs[key][0], expected[key], rtol=1e-5)

    plain = wrapped.unwrap()
    assert plain.loss is my_loss
    assert plain.optimizer.iterations.numpy() == 1
    got, want = plain.get_weights(), reference.get_weights()
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    evaluated = wrapped.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert sorted(evaluated) == ["loss", "mean_squared_error", "my_metric"]
    for key, value in plain.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True).items():
        np.testing.assert_allclose(evaluated[key], value, rtol=1e-5)

    path = str(tmp_path / "trained.keras")
    wrapped.save(path)
    with pytest.raises(TypeError, match="Could not locate function 'my_loss'"):  # plain Keras' rule
        keras.models.load_model(path)
    loaded = keras.models.load_model(path, custom_objects={"my_loss": my_loss, "my_metric": my_metric})
    assert loaded.loss is my_loss
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
