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


def _root_mean_square(y_true, y_pred):  # one value for the batch, not one per row
    return keras.ops.sqrt(keras.ops.mean(keras.ops.square(keras.ops.one_hot(y_true, 5) - y_pred)))


# compile's loss, whether the targets are one-hot, what the refusal says the loss does
NOT_PER_ROW = {
    "function_of_the_batch": (_root_mean_square, False, "gives one value for the whole batch, not one per row"),
    "dice_default_axis": (keras.losses.Dice(), True, "gives one value for the whole batch, not one per row"),
    "circle": (keras.losses.Circle(), False, r"mixes the rows of a batch \(a row's value depends on the other rows\)"),
    "ignore_class": (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=4),
        False,
        r"masks its own values \(as ignore_class does: Keras averages over the batch.s valid entries\)",
    ),
}


@pytest.mark.parametrize("case", list(NOT_PER_ROW))
def test_a_loss_that_is_not_a_sum_of_per_row_values_is_refused_with_micro_batches(case: str, virtual_devices) -> None:
    """Found by probing (stop 35): each of these trained silently to other numbers than the original at M = 2
    (Circle's loss 190.1 against 114.5), as the step adds up its micro-batches' losses weighted by their rows.
    At M = 1 on one replica the step takes the whole batch, as Keras does, and runs them."""
    loss, one_hot, says = NOT_PER_ROW[case]
    keras.utils.set_random_seed(0)
    model, make_batch, _ = ZOO["mlp"]()
    x, y = make_batch(BATCH, 3)
    y = np.eye(5, dtype="float32")[y] if one_hot else y
    wrapped = wrap(model, _plan(model, virtual_devices, 2, M), validate=False)
    wrapped.compile(optimizer="sgd", loss=loss)
    before = wrapped.unwrap().get_weights()
    with pytest.raises(
        InputError,
        match=rf"The loss '.*' {says}: the pipelined step adds up the losses of its "
        rf"{M} micro-batches, .*or train with num_microbatches=1 on one replica\.",
    ):
        wrapped.train_on_batch(x, y)
    for got, want in zip(wrapped.unwrap().get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    original = _copy(model)
    original.compile(optimizer="sgd", loss=loss)
    want = original.evaluate(x, y, batch_size=BATCH, verbose=0)  # evaluate takes it on the whole batch, as Keras
    np.testing.assert_allclose(wrapped.evaluate(x, y, batch_size=BATCH, verbose=0), want, rtol=1e-5)
    whole = wrap(model, _plan(model, virtual_devices, 2, 1), validate=False)
    whole.compile(optimizer="sgd", loss=loss)
    np.testing.assert_allclose(whole.train_on_batch(x, y), original.train_on_batch(x, y), rtol=1e-5)


def test_a_loss_of_one_mean_value_for_the_batch_still_trains_as_the_original(virtual_devices) -> None:
    """MSE of outputs of shape (batch,) is one value for the batch (Keras' mean over the last axis): the mean of
    the rows' values, which micro-batches weighted by their rows split exactly (the review of stop 35 found the
    first version of the check refusing it)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.ops.squeeze(keras.layers.Dense(1)(keras.layers.Dense(4)(inputs)), axis=-1))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH, 6)).astype("float32"), rng.normal(size=(BATCH,)).astype("float32")
    original = _copy(model)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, M), validate=False)
    for m in (original, wrapped):
        m.compile(optimizer="sgd", loss=lambda t, p: keras.ops.mean(keras.ops.square(t - p)))
    np.testing.assert_allclose(wrapped.train_on_batch(x, y), original.train_on_batch(x, y), rtol=1e-5)
    for got, want in zip(wrapped.unwrap().get_weights(), original.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(InputError, match=r"gives one value for the whole batch, not one per row"):
        wrapped.train_on_batch(x, y, sample_weight=np.linspace(0.5, 2.0, BATCH).astype("float32"))


def test_a_batch_shorter_than_planned_logs_the_loss_of_its_rows(virtual_devices) -> None:
    """6 rows in M = 4 micro-batches of 2 leave the last without rows; its loss of no rows ("mae" of outputs of
    shape (batch,) reduces over the batch axis) was NaN, and so was the logged loss (the weights were right;
    found by probing, stop 36)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.ops.squeeze(keras.layers.Dense(1)(keras.layers.Dense(4)(inputs)), axis=-1))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(6, 6)).astype("float32"), rng.normal(size=(6,)).astype("float32")
    original = _copy(model)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 4), validate=False)
    for m in (original, wrapped):
        m.compile(optimizer="sgd", loss="mae")
    for _ in range(2):
        np.testing.assert_allclose(wrapped.train_on_batch(x, y), original.train_on_batch(x, y), rtol=1e-5)
    for got, want in zip(wrapped.unwrap().get_weights(), original.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("metric", "name"),
    [
        (lambda: keras.losses.dice, "dice"),
        (lambda: keras.metrics.PearsonCorrelation(axis=0), "pearson_correlation"),
        (lambda: keras.metrics.CosineSimilarity(axis=0), "cosine_similarity"),
    ],
)
def test_a_metric_of_one_value_for_the_batch_is_updated_on_the_whole_batch(metric, name, virtual_devices) -> None:
    """Metrics whose values are not one per row (found by probing, stop 35): keras.losses.dice as a metric (default
    axis=None: 0.548 against the original's 0.704), Keras' PearsonCorrelation (-0.178 against -0.022),
    ConcordanceCorrelation and CosineSimilarity with axis=0 were averaged over the micro-batches' values; they are
    updated on the stacked outputs of the whole batch."""
    keras.utils.set_random_seed(0)
    model, make_batch, _ = ZOO["mlp"]()
    x, labels = make_batch(BATCH, 3)
    y = np.eye(5, dtype="float32")[labels]
    original = _copy(model)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, M), validate=False)
    for m in (original, wrapped):
        loss = keras.losses.CategoricalCrossentropy(from_logits=True)
        m.compile(optimizer="sgd", loss=loss, metrics=[metric()])
    want = original.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    with pytest.warns(UserWarning, match=rf"Metric '{name}' \(.*\) is not one of Keras' own over per-row values"):
        got = wrapped.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
