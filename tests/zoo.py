"""The shared zoo of small Keras models every runtime and profiler test can reuse.

Each builder returns (model, make_batch, loss): ``make_batch(batch_size, seed)`` gives (x, y) as
numpy arrays in the model's structure, and ``loss`` is what to pass to ``compile``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

Batch = tuple[Any, Any]
Entry = tuple[keras.Model, Callable[[int, int], Batch], Any]

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _images(shape: tuple[int, ...], classes: int) -> Callable[[int, int], Batch]:
    def make(batch_size: int, seed: int) -> Batch:
        rng = np.random.default_rng(seed)
        return rng.normal(size=(batch_size, *shape)).astype("float32"), rng.integers(0, classes, batch_size)

    return make


def mlp() -> Entry:
    inputs = keras.Input((20,), name="features")
    x = keras.layers.Dense(32, activation="relu")(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.Dense(16, activation="tanh")(x)
    outputs = keras.layers.Dense(5)(x)
    return keras.Model(inputs, outputs, name="mlp"), _images((20,), 5), SCCE


def cifar_cnn() -> Entry:
    """Three conv blocks -> pooling -> dense head, as the CIFAR-10 example (smaller channels)."""
    inputs = keras.Input((32, 32, 3))
    x = inputs
    for filters in (8, 16, 32):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name="cifar_cnn"), _images((32, 32, 3), 10), SCCE


def resnet_style() -> Entry:
    """Residual blocks with BatchNormalization; on 2 or 4 stages the skips cross stage boundaries."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    for _ in range(3):
        skip = x
        x = keras.layers.Conv2D(8, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.Conv2D(8, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Add()([x, skip])
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(4)(x)
    return keras.Model(inputs, outputs, name="resnet_style"), _images((16, 16, 3), 4), SCCE


def two_in_two_out() -> Entry:
    """Two inputs, two outputs (a classifier and a regressor), two losses."""
    a = keras.Input((10,), name="a")
    b = keras.Input((6,), name="b")
    xa = keras.layers.Dense(16, activation="relu")(a)
    xb = keras.layers.Dense(16, activation="relu")(b)
    x = keras.layers.Concatenate()([xa, xb])
    x = keras.layers.Dense(16, activation="relu")(x)
    label = keras.layers.Dense(3, name="label")(x)
    value = keras.layers.Dense(1, name="value")(x)
    model = keras.Model([a, b], [label, value], name="two_in_two_out")

    def make(batch_size: int, seed: int) -> Batch:
        rng = np.random.default_rng(seed)
        x = [rng.normal(size=(batch_size, 10)).astype("float32"), rng.normal(size=(batch_size, 6)).astype("float32")]
        y = [rng.integers(0, 3, batch_size), rng.normal(size=(batch_size, 1)).astype("float32")]
        return x, y

    return model, make, [SCCE, keras.losses.MeanSquaredError()]


def returned_and_read() -> Entry:
    """A tensor that is a model output and is read by later layers too (an encoder's output returned
    beside the decoder's): its producer's gradient comes from both."""
    inputs = keras.Input((12,), name="features")
    embedding = keras.layers.Dense(8, activation="tanh", name="embedding")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="reader")(embedding)
    x = keras.layers.Dense(16, activation="relu")(x)
    label = keras.layers.Dense(3, name="label")(x)
    model = keras.Model(inputs, [embedding, label], name="returned_and_read")

    def make(batch_size: int, seed: int) -> Batch:
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(batch_size, 12)).astype("float32")
        return x, [rng.normal(size=(batch_size, 8)).astype("float32"), rng.integers(0, 3, batch_size)]

    return model, make, [keras.losses.MeanSquaredError(), SCCE]


def shared_layer() -> Entry:
    """One Dense layer called twice: two nodes, one colocation group, one set of weights."""
    inputs = keras.Input((12,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    shared = keras.layers.Dense(16, activation="tanh", name="shared")
    x = shared(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    x = shared(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model(inputs, outputs, name="shared_layer"), _images((12,), 3), SCCE


@keras.saving.register_keras_serializable(package="zoo")
class TiedHead(keras.layers.Layer):
    """Scores over the vocabulary from the token embedding's own table (a weight tied between two layers, as
    keras-hub's MaskedLMHead holds its backbone's token embedding): holds the embedding layer itself."""

    def __init__(self, embedding: keras.layers.Embedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x: Any) -> Any:
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "embedding": keras.layers.serialize(self.embedding)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TiedHead:
        return cls(keras.layers.deserialize(config.pop("embedding")), **config)


def tied_head() -> Entry:
    """Token ids -> embedding -> mean -> Dense -> scores from the embedding's table (``TiedHead``) -> Dense
    layers: the embedding and the head are one colocation group, the Dense layers after them can go apart."""
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    embedding = keras.layers.Embedding(12, 8, embeddings_initializer="normal", name="embed")
    x = keras.layers.Dense(8, activation="tanh", name="first")(keras.ops.mean(embedding(tokens), axis=1))
    x = TiedHead(embedding, name="tied")(x)
    for number in range(3):
        x = keras.layers.Dense(16, activation="relu", name=f"wide_{number}")(x)
    outputs = keras.layers.Dense(3, name="scores")(x)

    def make(batch_size: int, seed: int) -> Batch:
        rng = np.random.default_rng(seed)
        return rng.integers(0, 12, (batch_size, 5)), rng.integers(0, 3, batch_size)

    return keras.Model(tokens, outputs, name="tied_head"), make, SCCE


def nested_sequential() -> Entry:
    """A Sequential model used as a layer inside a functional model: flattened into its layers."""
    inner = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="relu")],
        name="inner",
    )
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = inner(x)
    outputs = keras.layers.Dense(4)(x)
    return keras.Model(inputs, outputs, name="nested_sequential"), _images((8,), 4), SCCE


def mobilenet_v2() -> Entry:
    """keras.applications.MobileNetV2 at a small input size, weights=None (no download), in float64.

    Float64 because at 32x32 its last BatchNormalization layers normalise 1x1 maps over micro-batches
    of two samples: that turns float32 rounding (1e-7) into differences of 1e-4 between any two
    orders of summation. In float64 the comparison holds to 1e-5 with room to spare, so a real
    difference (a wrong micro-batch weight, a missed update) still fails the test.
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float64")
    try:
        model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=5)
    finally:
        keras.config.set_dtype_policy(previous)
    return model, _images((32, 32, 3), 5), keras.losses.SparseCategoricalCrossentropy()


def tagger() -> Entry:
    """A sequence tagger whose output carries a Keras mask (Embedding(mask_zero=True) -> LSTM -> Dense):
    Keras' loss is the mean over the valid steps, and micro-batches hold different numbers of them."""
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(12, 8, mask_zero=True, embeddings_initializer="normal")(tokens)
    h = keras.layers.LSTM(8, return_sequences=True)(h)
    outputs = keras.layers.Dense(5)(h)

    def make(batch_size: int, seed: int) -> Batch:
        rng = np.random.default_rng(seed)
        x = rng.integers(1, 12, (batch_size, 6))
        for row in range(batch_size):  # 1 to 6 tokens, then padding (0)
            x[row, 1 + (row * 5) % 6 :] = 0
        return x, rng.integers(0, 5, (batch_size, 6))

    return keras.Model(tokens, outputs, name="tagger"), make, SCCE


ZOO: dict[str, Callable[[], Entry]] = {
    "mlp": mlp,
    "cifar_cnn": cifar_cnn,
    "resnet_style": resnet_style,
    "two_in_two_out": two_in_two_out,
    "returned_and_read": returned_and_read,
    "shared_layer": shared_layer,
    "nested_sequential": nested_sequential,
    "mobilenet_v2": mobilenet_v2,
    "tagger": tagger,
    "tied_head": tied_head,
}


def has_batch_norm(model: keras.Model) -> bool:
    """True iff a BatchNormalization layer sits anywhere in the model (micro-batch statistics differ)."""
    return any(isinstance(layer, keras.layers.BatchNormalization) for layer in model._flatten_layers())
