"""runtime.batchnorm's normalization: its closed-form gradient against TensorFlow's autodiff of the same
formula, and what its gradient keeps of the forward (the profiler's reading of what a backward reads)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tf_split import kept_for_backward

from profiles.profiler import _saved
from runtime.batchnorm import normalize


def _layer(axis: int, shape: tuple[int, ...], scale: bool = True, center: bool = True) -> keras.layers.Layer:
    layer = keras.layers.BatchNormalization(axis=axis, scale=scale, center=center, epsilon=1e-3)
    layer.build(shape)
    rng = np.random.default_rng(1)
    if scale:
        layer.gamma.assign(rng.normal(1.0, 0.3, layer.gamma.shape).astype("float32"))
    if center:
        layer.beta.assign(rng.normal(0.0, 0.3, layer.beta.shape).astype("float32"))
    return layer


def _by_autodiff(layer: keras.layers.Layer, x: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """The same normalization written plainly, over the valid rows, differentiated by TensorFlow."""
    axes = [a for a in range(len(x.shape)) if a != layer.axis % len(x.shape)]
    weights = tf.reshape(tf.cast(valid, x.dtype), [-1] + [1] * (len(x.shape) - 1)) * tf.ones_like(x)
    n = tf.reduce_sum(weights, axis=axes, keepdims=True)
    mean = tf.reduce_sum(weights * x, axis=axes, keepdims=True) / n
    variance = tf.reduce_sum(weights * tf.square(x - mean), axis=axes, keepdims=True) / n
    shape = [1] * len(x.shape)
    shape[layer.axis] = x.shape[layer.axis]
    y = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
    if layer.scale:
        y = y * tf.reshape(layer.gamma, shape)
    if layer.center:
        y = y + tf.reshape(layer.beta, shape)
    return y


@pytest.mark.parametrize(
    ("axis", "shape", "scale", "center", "padded"),
    [
        (-1, (6, 5, 4, 3), True, True, 0),
        (-1, (6, 5, 4, 3), True, True, 2),  # a remainder batch's repeated rows, left out of the statistics
        (1, (6, 3, 4, 5), True, False, 1),  # channels first
        (-1, (7, 8), False, True, 3),
        (-1, (7, 8), False, False, 1),  # no weights: the input's gradient alone
        (0, (5, 4, 3), True, True, 0),  # statistics over every axis but the batch's
    ],
)
def test_closed_form_gradient_matches_autodiff(
    axis: int, shape: tuple[int, ...], scale: bool, center: bool, padded: int
) -> None:
    layer = _layer(axis, shape, scale, center)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(2.0, 1.5, shape).astype("float32"))  # a mean far from 0
    valid = tf.constant([True] * (shape[0] - padded) + [False] * padded)
    seed = tf.constant(rng.normal(size=shape).astype("float32"))
    results = []
    for function in (lambda: normalize(layer, x, valid)[0], lambda: _by_autodiff(layer, x, valid)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = function()
        results.append((y, tape.gradient(y, [x, *layer.trainable_weights], output_gradients=seed)))
    (y, grads), (y_ref, grads_ref) = results
    np.testing.assert_allclose(y.numpy(), y_ref.numpy(), rtol=1e-5, atol=1e-5)
    assert len(grads) == len(grads_ref) == 1 + scale + center
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), g_ref.numpy(), rtol=1e-4, atol=1e-5)


def test_mixed_precision_input_keeps_its_dtype() -> None:
    """A float16 input is normalized in float32; the output is the layer's compute dtype, the input's
    gradient the input's dtype."""
    layer = keras.layers.BatchNormalization(dtype="mixed_float16")
    layer.build((8, 4))
    x = tf.random.normal([8, 4], dtype=tf.float16)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = normalize(layer, x, tf.ones([8], tf.bool))[0]
    assert y.dtype == tf.float16
    assert tape.gradient(y, x).dtype == tf.float16


def test_gradient_keeps_only_the_input_and_per_channel_statistics() -> None:
    """The backward reads the input (which the profiler charges to the layer before) and tensors of one
    value per channel or per row: no tensor of the input's size of its own, as Keras' layer."""
    shape = (16, 8, 8, 4)
    layer = _layer(-1, shape)
    spec = tf.TensorSpec(shape, tf.float32)
    valid = tf.ones([shape[0]], tf.bool)

    def forward(x: tf.Tensor) -> tf.Tensor:
        outputs, moments = normalize(layer, x, valid)
        return outputs + 0.0 * tf.add_n([tf.reduce_sum(m) for m in moments])  # returned, as a stage does

    traced = tf.function(forward).get_concrete_function(spec).graph
    saved = _saved(tf, forward, [spec], traced, list(layer.trainable_weights), 1)
    assert saved is not None
    assert saved.inputs_read == (True,)
    vector_bytes = (shape[-1] + shape[0]) * 4  # one value per channel, or per row (the valid rows' weights)
    assert saved.internal_bytes <= 8 * vector_bytes < np.prod(shape) * 4


def test_stage_function_keeps_no_tensor_of_the_inputs_size_for_the_moments() -> None:
    """A stage function returns the moments beside its outputs, and TensorFlow keeps for the function's
    backward whatever the gradient of any of its outputs reads: the moments' own gradient would read
    x - mean (of the input's size) unless they are returned behind a stop. What the function's forward
    hands to its backward (TensorFlow's split of a function into the two, a private API, read on
    TensorFlow 2.21): of the input's size only the input, its views and the ReLU's output."""
    shape = (16, 8, 8, 4)
    layer = _layer(-1, shape)
    valid = tf.ones([shape[0]], tf.bool)

    @tf.function
    def stage(x: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        outputs, moments = normalize(layer, x, valid)
        return tf.nn.relu(outputs), moments

    handed = kept_for_backward(stage.get_concrete_function(tf.TensorSpec(shape, tf.float32)))
    kept = {t.op.type for t in handed if t.shape == shape}
    assert kept <= {"Placeholder", "Identity", "IdentityN", "Relu"}, kept
