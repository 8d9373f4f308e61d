"""Preprocessing layers that adapt to data keep their state through wrap, a step, unwrap, save and load_weights.

Normalization keeps its mean and variance as tensors derived from its variables, the lookups
(IntegerLookup, StringLookup, TextVectorization) their vocabulary in a lookup table, outside the
weights; Discretization keeps its bin boundaries in its config, and Hashing has no state at all.
Each model puts the preprocessing layer on stage 0 of two and is compared with the original Keras
model: predictions, one training step at M = 4 (loss and every weight), and the unwrapped and saved
models' predictions.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_transparency import BATCH, _plan, assert_close

from runtime import wrap

_RNG = np.random.default_rng(0)
_NUMBERS = (_RNG.normal(size=(64, 3)) * 5 + 10).astype("float32")  # mean 10: normalised with mean 0 is far off
_INTEGERS = _RNG.integers(100, 110, size=(64, 3))
_WORDS = np.array([["a", "b", "c"], ["b", "c", "d"], ["e", "a", "a"], ["d", "d", "b"]] * 16)
_TEXTS = np.array(["the cat sat", "a dog ran far", "the dog sat", "a cat ran"] * 16).reshape(-1, 1)


def _head(inputs: keras.KerasTensor, h: keras.KerasTensor, embed: int | None) -> keras.Model:
    """[inputs, preprocessing, (embedding, flatten)] -> dense -> head: the preprocessing output feeds trained layers."""
    if embed is not None:
        h = keras.layers.Flatten(name="flat")(keras.layers.Embedding(embed, 3, name="embed")(h))
    h = keras.layers.Dense(4, activation="tanh", name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


def _adapted(name: str) -> tuple[keras.Model, tf.Tensor]:
    """A model whose preprocessing layer, named "prep", was adapted to data, and a batch for it."""
    if name == "normalization":
        layer, data, dtype, embed = keras.layers.Normalization(name="prep"), _NUMBERS, "float32", None
    elif name == "discretization":
        layer, data, dtype, embed = keras.layers.Discretization(num_bins=4, name="prep"), _NUMBERS, "float32", 4
    elif name == "integer_lookup":
        layer, data, dtype, embed = keras.layers.IntegerLookup(name="prep"), _INTEGERS, "int64", 12
    elif name == "string_lookup":
        layer, data, dtype, embed = keras.layers.StringLookup(name="prep"), _WORDS, "string", 7
    elif name == "string_lookup_tf_idf":  # its idf weights are a variable outside the layer's weights
        layer = keras.layers.StringLookup(output_mode="tf_idf", name="prep")
        data, dtype, embed = _WORDS, "string", None
    elif name == "text_vectorization":
        layer = keras.layers.TextVectorization(max_tokens=12, output_sequence_length=4, name="prep")
        data, dtype, embed = _TEXTS, "string", 12
    else:  # hashing: no state to adapt or copy
        layer, data, dtype, embed = keras.layers.Hashing(num_bins=7, name="prep"), _INTEGERS, "int64", 7
    if hasattr(layer, "adapt"):
        layer.adapt(data)
    inputs = keras.Input(data.shape[1:], dtype=dtype)
    model = _head(inputs, layer(inputs), embed)
    return model, tf.constant(data[:BATCH])  # Keras' own fit and predict take strings as tensors, not NumPy


PREPROCESSING = [
    "normalization",
    "discretization",
    "integer_lookup",
    "string_lookup",
    "string_lookup_tf_idf",
    "text_vectorization",
    "hashing",
]


@pytest.mark.parametrize("name", PREPROCESSING)
def test_adapted_preprocessing_matches_original(name: str, virtual_devices, tmp_path) -> None:
    keras.utils.set_random_seed(0)
    model, x = _adapted(name)
    y = np.linspace(-1.0, 1.0, BATCH * 2).reshape(BATCH, 2).astype("float32")
    plan = _plan(model, virtual_devices, 2, 4)
    assert plan.assignment["prep"] == plan.stages[0]
    wrapped = wrap(model, plan, validate=False)
    expected = np.asarray(model(x))
    assert_close(np.asarray(wrapped(x)), expected)
    assert_close(wrapped.predict(x, batch_size=BATCH, verbose=0), expected)
    assert_close(np.asarray(wrapped.unwrap()(x)), expected)

    # One step of each (no batch normalization: the original's step on the whole batch is the reference).
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert_close(wrapped.train_on_batch(x, y), model.train_on_batch(x, y))
    plain = wrapped.unwrap()
    after, want = plain.get_weights(), model.get_weights()
    assert len(after) == len(want)
    for a, b in zip(after, want, strict=True):
        assert_close(a, b)
    expected = np.asarray(model(x))
    assert_close(np.asarray(plain(x)), expected)
    wrapped.save(tmp_path / "trained.keras")
    assert_close(np.asarray(keras.models.load_model(tmp_path / "trained.keras")(x)), expected)


@pytest.mark.parametrize("name", ["discretization", "integer_lookup", "string_lookup", "text_vectorization", "hashing"])
def test_ids_out_of_preprocessing_train_an_embedding_under_adam_at_four_microbatches(
    name: str, virtual_devices
) -> None:
    """Adam updates each sparse row of an embedding on its own, so the micro-batches' rows are joined as the batch
    gives them, which needs each lookup's ids known to be a row per sample. A TextVectorization's ids lose their
    static batch size in its string ops: the lookup was refused as "unclear" at M > 1 (stop 37's probe); the wrap's
    probe saw them with the batch's rows, so they are batched."""
    keras.utils.set_random_seed(0)
    model, x = _adapted(name)
    reference, _ = _adapted(name)
    reference.set_weights(model.get_weights())
    y = np.linspace(-1.0, 1.0, BATCH * 2).reshape(BATCH, 2).astype("float32")
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 4), validate=False)
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    for _ in range(2):
        assert_close(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y))
    for a, b in zip(wrapped.unwrap().get_weights(), reference.get_weights(), strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("name", ["normalization", "string_lookup"])
def test_adapted_preprocessing_survives_save_weights_and_load_weights(name: str, virtual_devices, tmp_path) -> None:
    """A weights file holds no assets (a lookup's vocabulary): loading one leaves the vocabulary as it is."""
    keras.utils.set_random_seed(0)
    model, x = _adapted(name)
    plan = _plan(model, virtual_devices, 2, 4)
    wrap(model, plan, validate=False).save_weights(tmp_path / "step.weights.h5")
    fresh = wrap(model, plan, validate=False)
    fresh.load_weights(tmp_path / "step.weights.h5")
    assert_close(fresh.predict(x, batch_size=BATCH, verbose=0), np.asarray(model(x)))


@pytest.mark.parametrize("name", ["normalization", "discretization", "string_lookup"])
def test_preprocessing_adapted_again_on_the_wrapped_model_is_unwrapped(name: str, virtual_devices) -> None:
    """``wrapped.get_layer("prep").adapt(other data)``: the wrapped model uses the new state, and so does what
    ``unwrap()`` gives (a Discretization's new bin boundaries were lost there, found by probing, stop 37)."""
    model, x = _adapted(name)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 4), validate=False)
    layer = wrapped.get_layer("prep")
    if name == "string_lookup":
        layer.adapt(np.array([["zeta"], ["eta"], ["eta"]]))
    else:
        layer.adapt(50.0 + 10.0 * _NUMBERS)
    wrapped.retrace()
    expected = np.asarray(wrapped(x))
    assert not np.allclose(expected, np.asarray(model(x)))  # the new state changed the outputs
    assert_close(np.asarray(wrapped.unwrap()(x)), expected)
