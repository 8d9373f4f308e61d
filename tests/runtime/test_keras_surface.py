"""What a Keras user passes to fit, held to the original model: class weights, a tf.data pipeline, a
top-level Sequential, mixed precision, several epochs, a plan the solver made (pins make it cut).

Each case: the original and the wrapped model (2 stages, asserted) trained by ``fit`` the same way;
history keys and values, and every weight after, equal within float32 rounding (float16 compute: 2e-3).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from runtime import plan_and_wrap

BATCH = 8


def _functional(dtype: str | None = None) -> keras.Model:
    inputs = keras.Input((6,), name="features")
    x = keras.layers.Dense(12, activation="tanh", name="first", dtype=dtype)(inputs)
    x = keras.layers.Dense(12, activation="relu", name="second", dtype=dtype)(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head", dtype="float32")(x))


def _sequential() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(12, activation="tanh", name="first"),
            keras.layers.Dense(12, activation="relu", name="second"),
            keras.layers.Dense(3, name="head"),
        ]
    )


def _data(rows: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(rows, 6)).astype("float32"), rng.integers(0, 3, rows)


def _pair(model: keras.Model, devices: list[str], num_microbatches: int = 2):
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    pins = {"first": devices[0], "head": devices[1]}
    wrapped = plan_and_wrap(model, devices=devices[:2], batch_size=BATCH, num_microbatches=num_microbatches, pins=pins)
    assert wrapped.plan.num_stages == 2
    for each in (reference, wrapped):
        each.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return reference, wrapped


def _assert_same_training(reference, wrapped, expected: dict, history: dict, tolerance: float = 1e-5) -> None:
    assert sorted(history) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_allclose(history[key], values, rtol=tolerance, atol=tolerance, err_msg=key)
    after, weights = wrapped.unwrap().get_weights(), reference.get_weights()
    assert len(after) == len(weights) == 6
    for actual, value in zip(after, weights, strict=True):
        np.testing.assert_allclose(actual, value, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", ["class_weight", "tf_data", "sequential", "validation"])
def test_fit_matches_the_original(kind: str, virtual_devices) -> None:
    keras.utils.set_random_seed(0)
    model = _sequential() if kind == "sequential" else _functional()
    reference, wrapped = _pair(model, virtual_devices)
    x, y = _data()
    options: dict = {"epochs": 2, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    if kind == "class_weight":
        options["class_weight"] = {0: 0.5, 1: 2.0, 2: 1.0}
    if kind == "validation":
        options["validation_data"] = _data(16)
    if kind == "tf_data":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        expected = reference.fit(dataset, epochs=2, verbose=0).history
        history = wrapped.fit(dataset, epochs=2, verbose=0).history
    else:
        expected = reference.fit(x, y, **options).history
        history = wrapped.fit(x, y, **options).history
    _assert_same_training(reference, wrapped, expected, history)


def test_mixed_precision_layers_match_the_original(virtual_devices) -> None:
    """Layers computing in float16 with float32 weights (dtype="mixed_float16"), a float32 head: the same
    casts in the same places, so the same steps within float16 rounding."""
    keras.utils.set_random_seed(0)
    reference, wrapped = _pair(_functional("mixed_float16"), virtual_devices)
    x, y = _data()
    options = {"epochs": 2, "batch_size": BATCH, "shuffle": False, "verbose": 0}
    expected = reference.fit(x, y, **options).history
    history = wrapped.fit(x, y, **options).history
    _assert_same_training(reference, wrapped, expected, history, tolerance=2e-3)
