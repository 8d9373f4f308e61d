"""The user's own Python code in a model (a plain-function loss or metric, a Lambda layer): the wrapped
model wraps, trains, unwraps and saves it as plain Keras does, and loading asks what Keras' loading asks."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from partitioner.errors import ProfileError
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
    # a function of the user's may not return a value per row: the metric is updated on the stacked outputs
    with pytest.warns(UserWarning, match=r"Metric 'my_metric' \(a MeanMetricWrapper of \S*test_user_code\.my_metric\)"):
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
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match=r"Metric 'my_metric'"):  # evaluate's step, traced anew
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


def double(t):
    return t * 2.0


def scaled_tanh(t):
    return keras.ops.tanh(t) * 2.0


def _lambda_in_wrapper() -> keras.Model:
    inputs = keras.Input((3, 4))
    h = keras.layers.TimeDistributed(keras.layers.Lambda(lambda t: t * 2.0), name="twice")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="fc")(keras.layers.Flatten(name="flat")(h)))


def _named_function() -> keras.Model:
    inputs = keras.Input((4,))
    h = keras.layers.Lambda(double, name="twice")(keras.layers.Dense(8, name="fc1")(inputs))
    return keras.Model(inputs, keras.layers.Dense(2, name="fc")(h))


def _named_function_in_nested_model() -> keras.Model:
    inner_inputs = keras.Input((8,))
    inner = keras.Model(inner_inputs, keras.layers.Lambda(double, name="twice")(inner_inputs), name="inner")
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2, name="fc")(inner(keras.layers.Dense(8, name="fc1")(inputs))))


def _function_activation() -> keras.Model:
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation=scaled_tanh, name="twice")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="fc")(h))


def test_a_metric_wrapping_a_function_of_the_users_unwraps(virtual_devices) -> None:
    """``MeanMetricWrapper(fn=...)`` around a lambda or an unregistered function cannot be made from its config:
    unwrap (which compiles the plain model the same way) refused it (found by probing, stop 36); it is made anew
    around the same function."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="fc2")(keras.layers.Dense(8, "relu", name="fc1")(inputs)))
    wrapped = _two_stages(model, virtual_devices, "fc1", "fc2")
    for fn in (my_metric, lambda t, p: keras.ops.mean(p, axis=-1)):
        metric = keras.metrics.MeanMetricWrapper(fn=fn, name="wrapped_fn")
        wrapped.compile(optimizer="sgd", loss="mse", metrics=[metric])
        x, y = _data(model)
        with pytest.warns(UserWarning, match=r"Metric 'wrapped_fn'"):  # a function of the user's: stacked
            wrapped.train_on_batch(x, y)
            expected = wrapped.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        evaluated = wrapped.unwrap().evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        assert sorted(evaluated) == sorted(expected) == ["loss", "wrapped_fn"]
        for key, value in expected.items():
            np.testing.assert_allclose(evaluated[key], value, rtol=1e-5)


@pytest.mark.parametrize(
    ("build", "refusal", "load_arguments"),
    [
        (_lambda_in_wrapper, "safe_mode=False", {"safe_mode": False}),
        (_named_function, "Could not locate function 'double'", {"custom_objects": {"double": double}}),
        (_named_function_in_nested_model, "could not be deserialized", {"custom_objects": {"double": double}}),
        (_function_activation, "could not be deserialized", {"custom_objects": {"scaled_tanh": scaled_tanh}}),
    ],
)
def test_user_functions_in_layers_wrap_train_unwrap_and_save(
    build, refusal: str, load_arguments: dict, tmp_path, virtual_devices
) -> None:
    """A Lambda of a Python lambda inside a wrapper layer, a Lambda of a named function (at the top, in a nested
    model), an activation given as a function: wrap, one step as the original's, unwrap, save; loading the
    file asks what loading the original's file asks (safe_mode=False, custom_objects), as Keras' rule is."""
    keras.utils.set_random_seed(0)
    model = build()
    wrapped = _two_stages(model, virtual_devices, "twice", "fc")
    x, y = _data(model)
    for m in (model, wrapped):  # the original trains as the reference: wrapping copied its weights
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    np.testing.assert_allclose(wrapped.train_on_batch(x, y), model.train_on_batch(x, y), rtol=1e-5)
    got, want = wrapped.unwrap().get_weights(), model.get_weights()
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    for source in (model, wrapped):
        path = str(tmp_path / f"{source.name}.keras")
        source.save(path)
        with pytest.raises((TypeError, ValueError), match=refusal):
            keras.models.load_model(path)
        loaded = keras.models.load_model(path, **load_arguments)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def _scale(factor: float):
    def scale(t):
        return keras.ops.tanh(t) * factor

    return scale


def test_two_functions_of_one_name_in_a_layer_are_refused(virtual_devices) -> None:
    """Two different functions named 'scale' in one layer: its config names both 'scale', and a copy with
    either one in both places would compute something else than the original, so wrapping refuses."""
    inputs = keras.Input((3, 4))
    rnn = keras.layers.LSTM(4, activation=_scale(1.0), recurrent_activation=_scale(0.5), name="rnn")
    model = keras.Model(inputs, keras.layers.Dense(2, name="fc")(rnn(inputs)))
    with pytest.raises(ProfileError, match=r"Cannot copy 'rnn' \(LSTM\): it holds 2 different functions named 'scale'"):
        _two_stages(model, virtual_devices, "rnn", "fc")
