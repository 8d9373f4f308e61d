"""Deferred batch normalization: each micro-batch normalised by its own statistics, one moving update per step.

With M micro-batches a BatchNormalization layer would move its moving mean and variance M times per
step, each time towards the statistics of a few samples: unlike the original model, which moves
them once, towards the statistics of the whole batch. torchgpipe's answer, used here by default
(``batch_norm="deferred"``): a micro-batch is still normalised by its own statistics (as in any
pipeline), but the layer does not update its moving statistics; the step gathers each micro-batch's
mean, variance and row count and, after the last micro-batch, moves the statistics once, towards the
whole batch's mean and (biased) variance:

    mean = sum_m n_m mean_m / N        variance = sum_m n_m (variance_m + (mean_m - mean)^2) / N

which is exactly the moving update of the original model on the whole batch. ``"per_microbatch"``
moves them after each micro-batch, M times a step, towards that micro-batch's statistics, as Keras'
layer would. Either way the repeated rows that pad a remainder batch (``runtime.executor``) are left
out of the statistics. Any axis works (``axis=1`` of a channels-first tensor: statistics over every
other axis). A batch normalization the runtime cannot normalize itself (renorm, a Keras mask, one inside
another layer) is refused under ``"deferred"`` with M > 1 (``check_deferrable``): Keras' layer would move
its statistics M times a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from partitioner.errors import InputError
from profiles.internals import flatten_layers, reduction_axes

BATCH_NORM = ("deferred", "per_microbatch")


def is_plain_batch_norm(operation: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """A trainable BatchNormalization without renorm or a mask of its own, over any axis: its training
    forward is ``normalize``'s. ``synchronized=True`` is one too: it syncs the statistics across the
    replicas of a tf.distribute strategy, and a pipeline's batch is one replica's (Keras' synchronized
    moments over one replica are the plain moments)."""
    if not isinstance(operation, keras.layers.BatchNormalization) or not operation.trainable:
        return False
    if getattr(operation, "renorm", False):
        return False
    if kwargs.get("mask") is not None or not args or not hasattr(args[0], "shape"):
        return False
    return len(args[0].shape) >= 2


def check_deferrable(nodes: Sequence[Any], num_microbatches: int, num_replicas: int = 1) -> None:
    """Raises InputError for a batch normalization the deferred update cannot move once per step (M > 1), or
    towards the global batch's statistics (D > 1 replicas).

    The runtime normalizes the BatchNormalization calls of the flat graph itself; one with renorm,
    one called with a Keras mask, or one inside another layer would be left to Keras' layer, which
    moves its moving statistics in every forward: M times a step, towards each micro-batch's, and on each
    replica towards its own shard's (the replicas' statistics drift apart: found by probing, stop 38).
    """
    if num_microbatches == 1 and num_replicas == 1:
        return
    how = f"{num_microbatches} times a step, towards each micro-batch's" if num_microbatches > 1 else "each step"
    if num_replicas > 1:
        how += f", on each of {num_replicas} workers apart (their statistics would drift apart)"
    for node in nodes:
        operation = node.operation
        found: list[tuple[Any, str]] = []
        if isinstance(operation, keras.layers.BatchNormalization) and operation.trainable:
            if getattr(operation, "renorm", False):
                found.append((operation, "uses renorm=True (its renormalization statistics move in every forward)"))
            elif node.arguments.kwargs.get("mask") is not None:
                found.append((operation, "is called with a Keras mask"))
        inner = flatten_layers(operation, include_self=False)
        inside = f"is inside layer '{operation.name}' ({type(operation).__name__})"
        found += [(layer, inside) for layer in inner if isinstance(layer, keras.layers.BatchNormalization)]
        for layer, reason in found:
            if not layer.trainable:
                continue
            raise InputError(
                f"BatchNormalization '{layer.name}' {reason}: the runtime cannot defer its moving statistics "
                "(batch_norm='deferred' moves them once per step, towards the whole batch's), and Keras' layer "
                f"moves them {how}. Expected a trainable BatchNormalization without renorm, called in the model's "
                "graph without a Keras mask; or wrap with batch_norm='per_microbatch' to ask for those updates "
                "(on one worker), or num_microbatches=1 on one worker."
            )


def check_per_microbatch(nodes: Sequence[Any], num_replicas: int) -> None:
    """Raises InputError for ``batch_norm="per_microbatch"`` with replicas and a trainable batch normalization:
    Keras' layer moves its statistics on each worker towards that worker's micro-batches, and nothing brings the
    workers' statistics together (found by probing, stop 38: 0.018 apart after 3 steps, predict then differs
    between the workers)."""
    if num_replicas == 1:
        return
    for node in nodes:
        for layer in flatten_layers(node.operation):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise InputError(
                    f"BatchNormalization '{layer.name}' with batch_norm='per_microbatch' on {num_replicas} workers: "
                    "each worker's layer moves its moving statistics towards its own micro-batches', and the "
                    "workers' statistics would drift apart. Expected batch_norm='deferred' (the statistics move "
                    "once a step towards the global batch's), or one worker."
                )


def normalize(layer: Any, inputs: tf.Tensor, valid: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """What ``layer(inputs, training=True)`` computes over the rows where ``valid`` holds, without moving
    the layer's statistics.

    The mean and variance are exact over those rows (Keras' masked moments add an epsilon to the row
    count, a bias that micro-batches of a few rows turn into visible error); with every row valid they
    are ``tf.nn.moments``', the original layer's, up to rounding.

    Returns:
        (the normalised outputs, [mean, variance, number of values counted per channel]).
    """
    # the statistics take no gradient of their own here: ``_normalized``'s closed form carries theirs
    x = tf.stop_gradient(tf.cast(inputs, keras.backend.result_type(inputs.dtype, "float32")))
    axes = reduction_axes(layer)  # every axis but the layer's
    rank = len(x.shape)
    row_weights = tf.cast(tf.reshape(valid, tf.concat([tf.shape(valid), tf.ones([rank - 1], tf.int32)], 0)), x.dtype)
    if 0 in axes:
        # each row summed over the other axes first, then the rows weighted: no tensor of x's size is made
        # for the weights, and the work on x is what tf.nn.moments does (a sum, a squared difference, a sum)
        within = [a for a in axes if a != 0]
        per_row = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), within)), x.dtype) if within else tf.ones([], x.dtype)

        def row_sum(t: tf.Tensor) -> tf.Tensor:
            inner = tf.reduce_sum(t, axis=within, keepdims=True) if within else t
            return tf.reduce_sum(row_weights * inner, axis=0, keepdims=True)

        total = row_sum(x)
        count = tf.broadcast_to(tf.reduce_sum(row_weights) * per_row, tf.shape(total))  # one per channel
    else:  # a layer that does not average over the batch axis: weights of x's size
        weights = tf.broadcast_to(row_weights, tf.shape(x))

        def row_sum(t: tf.Tensor) -> tf.Tensor:
            return tf.reduce_sum(weights * t, axis=axes, keepdims=True)

        total, count = row_sum(x), row_sum(tf.ones_like(x))
    n = tf.maximum(count, 1.0)  # a micro-batch of repeated rows only: zeros, not NaN
    mean = total / n  # kept dims: broadcasts over x on any axis
    variance = row_sum(tf.square(x - mean)) / n
    gamma = tf.reshape(tf.cast(layer.gamma, x.dtype), tf.shape(mean)) if layer.scale else None
    beta = tf.reshape(tf.cast(layer.beta, x.dtype), tf.shape(mean)) if layer.center else None
    outputs = _normalized(inputs, gamma, beta, mean, variance, n, row_weights, axes, layer)
    # one value per channel; a stop at the outputs too, else the function's gradient would read the
    # moments' intermediates (x - mean, of x's size) and the forward would keep them for it
    count, mean, variance = (tf.stop_gradient(tf.reshape(t, [-1])) for t in (count, mean, variance))
    return outputs, [mean, variance, count]


def _normalized(
    inputs: tf.Tensor,
    gamma: tf.Tensor | None,
    beta: tf.Tensor | None,
    mean: tf.Tensor,
    variance: tf.Tensor,
    n: tf.Tensor,
    row_weights: tf.Tensor,
    axes: list[int],
    layer: Any,
) -> tf.Tensor:
    """``gamma * (x - mean) / sqrt(variance + epsilon) + beta`` of ``inputs`` (in float32 at least), with
    the gradient of batch normalization in closed form: the gradient keeps only ``inputs`` and the
    per-channel statistics, as Keras' layer does (the profiler's price for it), where TensorFlow's
    autodiff of the same ops kept x - mean, the normalized tensor and the broadcasts (two to three
    tensors of the input's size per micro-batch, traced in benchmarks/runtime's CNN).

    ``mean`` and ``variance`` (kept dims) are the ``row_weights``-weighted moments of x over ``axes``,
    ``n`` the weighted count, made from the stopped input (``normalize``), so no gradient of theirs is
    built; the closed form takes their dependence on x into account:

        dx = gamma inv (dy - w sum(dy) / n - w (x - mean) inv^2 sum(dy (x - mean)) / n),

    the sums over the layer's reduction axes, inv = 1 / sqrt(variance + epsilon), and w the row weights (0
    on the repeated rows that pad a remainder batch, which the statistics leave out).
    """
    dtype = mean.dtype
    inv = tf.math.rsqrt(variance + layer.epsilon)
    params = [p for p in (gamma, beta) if p is not None]

    @tf.custom_gradient  # type: ignore[untyped-decorator]  # TensorFlow ships no type hints
    def forward(x_in: tf.Tensor, *weights: tf.Tensor) -> Any:
        scale = inv * gamma_of(weights)
        shift = beta_of(weights) - mean * scale
        y = tf.cast(x_in, dtype) * scale + shift

        def backward(dy: tf.Tensor) -> list[tf.Tensor]:
            # per-channel sums first, then two passes of x's size: few temporaries of x's size at once
            dy = tf.cast(dy, dtype)
            centered = tf.cast(x_in, dtype) - mean
            sum_dy = tf.reduce_sum(dy, axis=axes, keepdims=True)
            sum_dy_centered = tf.reduce_sum(dy * centered, axis=axes, keepdims=True)
            per_row_shift = row_weights * (scale * sum_dy / n)
            per_row_slope = row_weights * (scale * inv * inv * sum_dy_centered / n)
            dx = scale * dy - (centered * per_row_slope + per_row_shift)
            grads = [tf.cast(dx, x_in.dtype)]
            if gamma is not None:  # sum(dy * xhat) = inv * sum(dy * (x - mean))
                grads.append(tf.reshape(inv * sum_dy_centered, tf.shape(gamma)))
            if beta is not None:
                grads.append(tf.reshape(sum_dy, tf.shape(beta)))
            return grads

        return tf.cast(y, layer.compute_dtype), backward

    def gamma_of(weights: Sequence[tf.Tensor]) -> Any:
        return weights[0] if gamma is not None else 1.0

    def beta_of(weights: Sequence[tf.Tensor]) -> Any:
        return weights[-1] if beta is not None else 0.0

    return forward(inputs, *params)


def combine(stats: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
    """[mean, variance, count] of the union of parts, each given as [mean, variance, count]."""
    counts = [s[2] for s in stats]
    total = tf.add_n(counts)
    mean = tf.add_n([n * s[0] for n, s in zip(counts, stats)]) / total
    variance = tf.add_n([n * (s[1] + tf.square(s[0] - mean)) for n, s in zip(counts, stats)]) / total
    return [mean, variance, total]


def update_moving_statistics(layer: Any, stats: Sequence[Sequence[tf.Tensor]]) -> None:
    """Moves ``layer``'s statistics once, towards the whole batch's: ``stats`` is [mean, variance, count] per part."""
    mean, variance, _ = combine(stats)
    momentum = layer.momentum
    for variable, value in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
        old = tf.cast(variable.value, value.dtype)
        variable.assign(tf.cast(old * momentum + value * (1.0 - momentum), variable.dtype))
