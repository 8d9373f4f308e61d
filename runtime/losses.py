"""A micro-batch's part of the batch's compiled Keras loss, for each reduction Keras offers.

The pipelined step adds up its micro-batches' parts, so the parts must sum to the loss Keras
computes on the whole batch of B rows. Each entry of the compiled loss (one per output's loss) is
Keras' own loss of the micro-batch's rows, times a factor that depends on the entry's reduction::

    reduction                                   factor of micro-batch m (its B(m) rows, weights w(m))
    "sum_over_batch_size", "mean"               share = B(m) / B         (of valid steps, masked: executor)
    "sum"                                       1
    "mean_with_sample_weight", weights given    sum w(m) / sum w         (Keras divides by the weights' sum)
    "mean_with_sample_weight", no weights       share                    (Keras takes the mean)
    None, "none"                                refused: fit trains on the sum of the unreduced losses
                                                and reports their mean

The entry's loss weight (``compile(loss_weights=...)``) multiplies it as Keras does. A masked output's
loss is matched for the mean reductions only (the executor's correction to the batch's valid steps
scales the whole loss). Keras' CompileLoss is read and, while a part is traced, its entries' weights
changed (``profiles.internals.loss_entries`` and ``scaled_loss_weights``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from partitioner.errors import InputError
from profiles.internals import (
    compute_output_spec,
    get_keras_mask,
    loss_entries,
    regularization_losses,
    scaled_loss_weights,
)

if TYPE_CHECKING:
    from runtime.stages import Stage

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
REDUCTIONS = (*MEAN_REDUCTIONS, "sum", "mean_with_sample_weight")


def build_loss(compile_loss: Any, y: Any, y_pred: Any, sample_weight: Any) -> None:
    """Builds Keras' CompileLoss for these tensors' structure (its entries, and with several outputs its
    per-output loss trackers), as Keras' trainer builds it: on symbolic tensors, leaving no ops behind."""
    if not compile_loss.built:
        symbolic = keras.tree.map_structure(
            lambda t: None if t is None else keras.KerasTensor(t.shape, t.dtype), (y, y_pred, sample_weight)
        )
        compute_output_spec(compile_loss, *symbolic)


CHECK_ROWS = 7  # the batch axis of a check's symbolic tensors where the targets' is unknown (any size would do)


def check_loss_fits(compile_loss: Any, y: Any, outputs: Any, sample_weight: Any) -> None:
    """Raises one clear line where the compiled loss cannot take these targets with the model's outputs
    (``outputs``: the model's output KerasTensors in its output structure), found on symbolic tensors of the
    batch's rows (``CHECK_ROWS`` where the targets' batch axis is unknown): targets of shape (B,) under a
    loss that needs (B, 5). Keras fails such a step while tracing it, or with a clear runtime error; a
    pipelined step fails where the loss runs, on the last stage's device inside the micro-batch loop, and
    TensorFlow then reports the other devices' cancelled receives ("RecvAsync is cancelled") instead.

    Raises:
        InputError: naming the loss's own error and the shapes it was given.
    """
    leaves = [t for t in keras.tree.flatten((y, sample_weight)) if t is not None]
    if compile_loss is None or y is None or not all(isinstance(t, tf.Tensor) for t in leaves):
        return  # no loss to check, or sparse or ragged targets: dense symbolic tensors would not stand for them
    known = [t.shape[0] for t in leaves if t.shape.rank and t.shape[0] is not None]
    rows = int(known[0]) if known else CHECK_ROWS

    def symbolic(tensor: Any) -> Any:
        if tensor is None:
            return None
        shape = list(tensor.shape)
        return keras.KerasTensor([rows, *shape[1:]] if shape else [], tensor.dtype)

    args = keras.tree.map_structure(symbolic, (y, outputs, sample_weight))
    try:
        compute_output_spec(compile_loss, *args)
    except ValueError as error:  # shapes that cannot meet: inside the loop this fails at run time
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise InputError(
            f"The compiled loss cannot take these targets with the model's outputs: {type(error).__name__}: "
            f"{lines[0] if lines else ''} (targets {_shapes(args[0])}, outputs {_shapes(args[1])}). Expected "
            "targets the loss takes with these outputs; the unwrapped model fails the same way: fix the "
            "targets' shape or the loss (e.g. class indices of shape (batch,) go with "
            "sparse_categorical_crossentropy, one-hot rows with categorical_crossentropy)."
        ) from error
    except Exception:  # a loss written for the traced step (autograph, a custom op): the step itself decides
        return


ROW_CHECK = 4  # rows of the random batch a loss or metric function is checked on: two halves of two rows


def check_loss_splits(
    compile_loss: Any,
    y: Any,
    outputs: Any,
    sample_weight: Any,
    num_microbatches: int,
    num_replicas: int,
    output_names: Sequence[str] = (),
) -> str | None:
    """Why an entry of the compiled loss is not a mean or sum of values that each depend on one row, as one clear
    line, or None: the pipelined step adds up the parts of M micro-batches (and D replicas), weighted by their
    rows, which is Keras' loss of the batch only for such a loss. Checked on random values (``not_per_row``)
    where M x D > 1: a loss that returns one value for the batch other than the mean of its rows' (a root mean
    square written as a function, Keras' Dice and Tversky with their default ``axis=None``), one whose rows
    depend on each other (Keras' Circle loss), or one that masks its own values (``ignore_class``: a mean over
    the batch's valid entries). One mean value for the batch (MSE of outputs of shape (batch,): Keras' mean over
    the last axis) splits exactly, but not with sample weights (Keras weighs the batch's one value by each row's
    weight). ``output_names``: the model's, where the loss is a dict over a list of outputs.
    """
    parts = num_microbatches * num_replicas
    if compile_loss is None or y is None or parts == 1:
        return None
    build_loss(compile_loss, y, outputs, None)
    for entry in loss_entries(compile_loss):
        y_true, y_pred = _entry_part(entry, y, output_names), _entry_part(entry, outputs, output_names)
        if not hasattr(entry.loss, "call"):
            continue
        reduction = getattr(entry.loss, "reduction", None)
        scalar = None if sample_weight is not None else ("sum" if reduction == "sum" else "mean")
        dtype = getattr(entry.loss, "dtype", None)
        problem = not_per_row(entry.loss.call, y_true, y_pred, scalar=scalar, dtype=dtype)
        if problem is None:
            continue
        name = getattr(entry.loss, "name", entry.loss)
        split = f"{num_microbatches} micro-batches" + (f" on {num_replicas} replicas" if num_replicas > 1 else "")
        return (
            f"The loss {name!r} {problem}: the pipelined step adds up the losses of its {split}, which is Keras' "
            "loss of the batch only for a mean or sum of values that each depend on one row. Expected such a loss "
            "(Keras' crossentropies, MSE, ...; a loss reduced over the axes of one sample, e.g. Dice(axis=(1, 2, 3)) "
            "for images; sample_weight zeros instead of ignore_class), or train with num_microbatches=1 on one "
            "replica."
        )
    return None


def not_per_row(
    fn: Callable[..., Any], y_true: Any, y_pred: Any, *, scalar: str | None = None, dtype: Any = None
) -> str | None:
    """Why ``fn(y_true, y_pred)`` (a loss's unreduced values, a metric's function) is not one value per row that
    depends on that row alone, found on random values of these tensors' dtypes and shapes (ROW_CHECK rows,
    computed eagerly, outside any function being traced), or None: where it is, or where it cannot be told (a
    shape unknown, the function failing on random values; the step then runs it as Keras would). ``scalar``
    ("mean" or "sum"): one value for the batch passes where it is that of the two halves' values (a mean over
    rows, weighted by rows, splits exactly); ``dtype``: both tensors converted to it first, as ``Loss.__call__``
    converts them."""
    if not all(isinstance(t, (tf.Tensor, keras.KerasTensor)) for t in (y_true, y_pred)):
        return None
    with tf.init_scope():
        try:
            y_true, y_pred = _random_rows(y_true, y_pred)
            if dtype is not None:
                y_true, y_pred = tf.cast(y_true, dtype), tf.cast(y_pred, dtype)
            half = ROW_CHECK // 2
            values = fn(y_true, y_pred)
            whole = np.asarray(values)
            parts = [np.asarray(fn(y_true[:half], y_pred[:half])), np.asarray(fn(y_true[half:], y_pred[half:]))]
            if whole.ndim == 0:
                combined = {"mean": np.mean(parts, axis=0), "sum": np.sum(parts, axis=0)}.get(scalar or "")
                if combined is None or any(p.ndim for p in parts) or not _close(combined, whole):
                    return "gives one value for the whole batch, not one per row"
                return None
            rows = [(half, *whole.shape[1:])] * 2
            if whole.shape[0] != ROW_CHECK or [p.shape for p in parts] != rows:
                return "gives one value for the whole batch, not one per row"
            if not _close(np.concatenate(parts), whole):
                return "mixes the rows of a batch (a row's value depends on the other rows)"
            if get_keras_mask(values) is not None:
                return "masks its own values (as ignore_class does: Keras averages over the batch's valid entries)"
        except Exception:  # a function for the traced step only, or for other values: the step decides
            return None
    return None


def _close(got: Any, want: Any) -> bool:
    return bool(np.allclose(got, want, rtol=1e-4, atol=1e-6, equal_nan=True))


def _random_rows(y_true: Any, y_pred: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """Random targets and outputs of ROW_CHECK rows with these tensors' dtypes and shapes (an axis unknown in one
    taken from the other where their ranks agree): outputs in (0.05, 0.95), valid as probabilities and logits;
    integer targets class indices below the outputs' last axis, float targets in [0, 1)."""
    rng = np.random.default_rng(0)
    true_shape, pred_shape = list(y_true.shape), list(y_pred.shape)
    if len(true_shape) == len(pred_shape):
        true_shape = [a if a is not None else b for a, b in zip(true_shape, pred_shape, strict=True)]
        pred_shape = [b if b is not None else a for a, b in zip(true_shape, pred_shape, strict=True)]
    if any(d is None for d in [*true_shape[1:], *pred_shape[1:]]) or not true_shape or not pred_shape:
        raise ValueError("a shape is unknown")
    true_shape[0] = pred_shape[0] = ROW_CHECK
    outputs = tf.constant(rng.uniform(0.05, 0.95, pred_shape), dtype=y_pred.dtype)
    if tf.as_dtype(y_true.dtype).is_integer:
        classes = pred_shape[-1] if len(true_shape) < len(pred_shape) else 2
        targets = tf.constant(rng.integers(0, max(classes, 1), true_shape), dtype=y_true.dtype)
    else:
        targets = tf.constant(rng.uniform(0.0, 1.0, true_shape), dtype=y_true.dtype)
    return targets, outputs


def _entry_part(entry: Any, structure: Any, output_names: Sequence[str] = ()) -> Any:
    """The leaf of ``structure`` (targets, outputs) an entry of the compiled loss takes: by its path when nested (a
    name of ``output_names`` indexes a list of outputs, as Keras' CompileLoss matches a dict of losses to them)."""
    if not keras.tree.is_nested(structure):
        return structure
    try:
        for key in entry.path:
            if isinstance(structure, (list, tuple)) and isinstance(key, str):
                key = list(output_names).index(key)
            structure = structure[key]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return structure if not keras.tree.is_nested(structure) else None


def _shapes(tree: Any) -> Any:
    """Each tensor of ``tree`` as its shape, for a message."""
    return keras.tree.map_structure(lambda t: tuple(t.shape), tree)


def weight_sums(sample_weight: Any) -> Any:
    """Each leaf of a batch's sample weights summed (float32), as ``microbatch_part`` takes them (None stays None)."""
    return keras.tree.map_structure(
        lambda w: None if w is None else tf.reduce_sum(tf.cast(w, tf.float32)), sample_weight
    )


def splits_exactly(compile_loss: Any) -> bool:
    """Whether every entry of a built CompileLoss reduces in a way ``microbatch_part`` splits exactly."""
    return all(getattr(entry.loss, "reduction", None) in REDUCTIONS for entry in loss_entries(compile_loss))


def microbatch_part(
    compile_loss: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
    share: tf.Tensor,
    weight_sums: Any,
    num_replicas: int = 1,
) -> tf.Tensor:
    """The micro-batch's part of the batch's compiled loss (the parts of all micro-batches sum to it).

    Args:
        compile_loss: the model's ``_compile_loss`` (Keras' CompileLoss), or None.
        y, y_pred, sample_weight: the micro-batch's own rows, in the structures Keras takes.
        share: the micro-batch's share of the batch's rows (of its valid steps, with a masked output).
        weight_sums: each leaf of the whole batch's ``sample_weight``, summed (None without weights).
        num_replicas: D, the data-parallel replicas the step's loss is averaged over (``runtime.replicas``:
            each replica's mean times its rows, summed, over the rows): only mean reductions split so.

    Raises:
        InputError: no loss is compiled, or an entry's reduction has no exact split.
    """
    if compile_loss is None:
        raise InputError(
            "PipelinedModel needs a loss to train: compile(loss=...). Losses that layers add (add_loss, "
            "activity regularizers) are added to it; they cannot stand in for it."
        )
    build_loss(compile_loss, y, y_pred, sample_weight)
    masked = any(get_keras_mask(t) is not None for t in keras.tree.flatten(y_pred))
    factors = [
        _factor(entry, masked, sample_weight, share, weight_sums, num_replicas)
        for entry in loss_entries(compile_loss)  # (path, loss, loss_weights, name) per output loss
    ]
    with scaled_loss_weights(compile_loss, factors):  # per-output loss metrics: train_step, once per batch
        return compile_loss(y, y_pred, sample_weight)


def _factor(
    entry: Any, masked: bool, sample_weight: Any, share: tf.Tensor, weight_sums: Any, num_replicas: int = 1
) -> tf.Tensor:
    """What one entry's loss of the micro-batch is multiplied by (the table in the module docstring)."""
    name = getattr(entry.loss, "name", entry.loss)
    reduction = getattr(entry.loss, "reduction", None)
    weighted_mean = reduction == "mean_with_sample_weight" and sample_weight is not None
    if num_replicas > 1 and (reduction == "sum" or weighted_mean):
        raise InputError(
            f"The loss {name!r} reduces with reduction={reduction!r}{' and sample weights' if weighted_mean else ''}: "
            f"across {num_replicas} replicas the step averages each replica's loss by its rows, which matches "
            f"Keras only for a mean over rows. Expected one of {MEAN_REDUCTIONS} with replicas: compile with "
            "such a loss (Keras' default), or train on one replica."
        )
    if masked and reduction not in MEAN_REDUCTIONS:
        raise InputError(
            f"The loss {name!r} of a masked output reduces with reduction={reduction!r}: the pipelined step "
            f"can match Keras' mean over the valid steps only. Expected one of {MEAN_REDUCTIONS}: compile "
            "with such a loss (Keras' default)."
        )
    if reduction not in REDUCTIONS:
        raise InputError(
            f"The loss {name!r} reduces with reduction={reduction!r}: Keras' fit trains on the sum of the "
            "unreduced losses and reports their mean, which the pipelined step does not reproduce. Expected "
            f"one of {REDUCTIONS}: compile with reduction='sum' (the same gradients) or the default."
        )
    if reduction == "sum":
        return tf.ones([])
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        # Keras divides the micro-batch's weighted sum by its own weights' sum: the batch's is wanted
        own, whole = (_entry_weights(entry, w) for w in (sample_weight, weight_sums))
        return tf.math.divide_no_nan(tf.reduce_sum(tf.cast(own, tf.float32)), tf.cast(whole, tf.float32))
    return share


def _entry_weights(entry: Any, structure: Any) -> Any:
    """The sample weights of one entry, as Keras' CompileLoss picks them: by its path when nested."""
    if not keras.tree.is_nested(structure):
        return structure
    for key in entry.path:
        structure = structure[key]
    return structure


def weight_penalty(stage: Stage) -> tf.Tensor | None:
    """The sum of the stage's weight regularizers' penalties (``kernel_regularizer`` ...), or None."""
    terms = [t for op in stage.operations for t in regularization_losses(op)]
    return tf.cast(tf.add_n(terms), tf.float32) if terms else None
