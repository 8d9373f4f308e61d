"""Loss reductions other than the mean over rows: the pipelined step at M = 4 on 2 stages gives the
original model's loss, gradients and weights after an SGD and an Adam step, or refuses before any
weight moves."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_transparency import _copy, _plan, _variable_pairs, assert_close
from zoo import ZOO

from partitioner.errors import InputError
from runtime import wrap

BATCH = 10  # M = 4 micro-batches of 3, 3, 3 and 1 rows: uneven, so a share-weighted sum would show
M = 4


def _sce(reduction: str | None) -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _mse(reduction: str | None) -> keras.losses.Loss:
    return keras.losses.MeanSquaredError(reduction=reduction)


# (zoo model, compile's loss, loss_weights, sample weights given)
CASES = {
    "sum": ("mlp", _sce("sum"), None, False),
    "sum_with_sample_weight": ("mlp", _sce("sum"), None, True),
    "mean_with_sample_weight": ("mlp", _sce("mean_with_sample_weight"), None, True),
    "mean_with_sample_weight_without_weights": ("mlp", _sce("mean_with_sample_weight"), None, False),
    "mixed_list_with_loss_weights": ("two_in_two_out", [_sce("sum"), _mse("sum_over_batch_size")], [0.5, 2.0], False),
    "mixed_dict_with_sample_weight": (
        "two_in_two_out",
        {"label": _sce("mean_with_sample_weight"), "value": _mse("sum")},
        {"label": 1.5, "value": 0.25},
        True,
    ),
}


def _setup(case: str, virtual_devices: list[str]) -> tuple[keras.Model, object, object, object, object, object]:
    name, loss, loss_weights, weighted = CASES[case]
    keras.utils.set_random_seed(0)
    model, make_batch, _ = ZOO[name]()
    x, y = make_batch(BATCH, 3)
    weights = np.linspace(0.2, 3.0, BATCH).astype("float32")[::-1].copy() if weighted else None
    plan = _plan(model, virtual_devices, 2, M)
    assert plan.num_stages == 2
    return model, plan, {"loss": loss, "loss_weights": loss_weights}, x, y, weights


@pytest.mark.parametrize("case", list(CASES))
def test_loss_reduction_loss_and_gradients_match_original(case: str, virtual_devices) -> None:
    model, plan, losses, x, y, weights = _setup(case, virtual_devices)
    reference = _copy(model)
    reference.compile(optimizer="sgd", **losses)
    with tf.GradientTape() as tape:
        ref_loss = reference.compute_loss(x=x, y=y, y_pred=reference(x, training=True), sample_weight=weights)
    ref_grads = tape.gradient(ref_loss, reference.trainable_weights)

    wrapped = wrap(model, plan, validate=False)
    wrapped.compile(optimizer="sgd", **losses)
    loss, grads = wrapped.loss_and_gradients(x, y, weights)
    assert_close(float(loss), float(ref_loss))
    clone_grad = {id(v): g for v, g in zip(wrapped.executor.trainable_variables, grads, strict=True)}
    index = {id(v): i for i, v in enumerate(model.trainable_weights)}
    pairs = [(o, c) for o, c in _variable_pairs(wrapped) if id(o) in index]
    assert len(pairs) == len(model.trainable_weights) == len(ref_grads)
    for original, clone in pairs:
        assert_close(clone_grad[id(clone)], tf.convert_to_tensor(ref_grads[index[id(original)]]))
    evaluated = [m.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0) for m in (wrapped, reference)]
    assert_close(*evaluated)  # the loss and each output's, on the whole batch


def _assert_step_matches_original(model, plan, losses, x, y, weights, optimizer: type) -> None:
    """One train_on_batch of the original and of the wrapped model: the same logs (the loss and each
    output's loss) and the same weights after."""
    reference = _copy(model)
    reference.compile(optimizer=optimizer(0.05), **losses)
    wrapped = wrap(model, plan, validate=False)
    wrapped.compile(optimizer=optimizer(0.05), **losses)
    expected = reference.train_on_batch(x, y, sample_weight=weights, return_dict=True)
    logs = wrapped.train_on_batch(x, y, sample_weight=weights, return_dict=True)
    assert sorted(logs) == sorted(expected)
    for key, value in expected.items():
        assert_close(logs[key], value)
    after, want = wrapped.unwrap().get_weights(), reference.get_weights()
    assert len(after) == len(want) == len(model.get_weights())
    for got, value in zip(after, want, strict=True):
        assert_close(got, value)


@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD, keras.optimizers.Adam])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_reduction_step_matches_original(case: str, optimizer: type, virtual_devices) -> None:
    model, plan, losses, x, y, weights = _setup(case, virtual_devices)
    _assert_step_matches_original(model, plan, losses, x, y, weights, optimizer)


def test_loss_dict_by_output_name_matches_original(virtual_devices) -> None:
    """compile(loss={output name: loss}) reads the model's output names, which Keras' Functional keeps."""
    keras.utils.set_random_seed(0)
    model, make_batch, _ = ZOO["two_in_two_out"]()
    x, y = make_batch(8, 3)
    plan = _plan(model, virtual_devices, 2, 2)
    assert wrap(model, plan, validate=False).output_names == model.output_names == ["label", "value"]
    losses = {
        "loss": {"label": _sce("sum_over_batch_size"), "value": "mse"},
        "loss_weights": {"label": 0.5, "value": 2.0},
    }
    _assert_step_matches_original(model, plan, losses, x, y, None, keras.optimizers.SGD)


@pytest.mark.parametrize("reduction", [None, "none"])
def test_loss_reduction_none_is_refused_before_any_weight_moves(reduction: str | None, virtual_devices) -> None:
    """Keras' fit trains an unreduced loss on its sum and reports its mean; the step refuses it."""
    model, make_batch, _ = ZOO["mlp"]()
    x, y = make_batch(BATCH, 3)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, M), validate=False)
    wrapped.compile(optimizer="sgd", loss=_sce(reduction))
    before = wrapped.unwrap().get_weights()
    with pytest.raises(InputError, match=rf"reduction={reduction!r}:.*Expected one of .*'sum'"):
        wrapped.train_on_batch(x, y)
    for got, want in zip(wrapped.unwrap().get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("call", ["train_on_batch", "fit", "evaluate"])
def test_targets_the_loss_cannot_take_are_refused_in_one_line_before_any_weight_moves(
    call: str, virtual_devices
) -> None:
    """Class indices under mean squared error against 5 logits: Keras fails while tracing its step; the
    pipelined step failed on the last stage inside the loop, and TensorFlow reported the first stage's
    cancelled receive ("CancelledError: RecvAsync is cancelled"), not why."""
    model, make_batch, _ = ZOO["mlp"]()
    x, y = make_batch(BATCH, 3)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, M), validate=False)
    wrapped.compile(optimizer="sgd", loss="mse")
    before = wrapped.unwrap().get_weights()
    run = {
        "train_on_batch": lambda: wrapped.train_on_batch(x, y),
        "fit": lambda: wrapped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0),
        "evaluate": lambda: wrapped.evaluate(x, y, batch_size=BATCH, verbose=0),
    }[call]
    with pytest.raises(
        InputError,
        match=r"The compiled loss cannot take these targets with the model's outputs: ValueError: .*"
        r"\(targets \(\d+,\), outputs \(\d+, 5\)\)\. Expected targets the loss takes",
    ):
        run()
    for got, want in zip(wrapped.unwrap().get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
