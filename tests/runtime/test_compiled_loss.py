"""The compiled loss: the pipelined step gives the original model's loss, each output's loss and
weights after a step."""

from __future__ import annotations

import keras
from test_transparency import _copy, _plan, assert_close
from zoo import ZOO

from runtime import wrap


def _sce(reduction: str | None) -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


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
    for got, value in zip(after, want):
        assert_close(got, value)


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
