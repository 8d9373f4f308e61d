"""Models the pipeline would not run as written are refused at wrap time; the rest still wrap.

Steps of the model's own class (issue 18, item 5) and ops that mix a batch's rows (item 7): before,
``fit`` of the wrapped model silently ran Keras' step instead of the user's, and a model that
concatenates along the batch axis predicted 8 rows where the original predicts 16.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_transparency import assert_close
from zoo import ZOO

from partitioner.errors import InputError, ProfileError
from runtime import plan_and_wrap, wrap
from runtime.supported import FRONT_DOORS, STEPS, check_rows, check_steps

BATCH = 8


def _dense_model(name: str = "model", cls: type = keras.Model) -> keras.Model:
    inputs = keras.Input((4,), name="features")
    x = keras.layers.Dense(4, name="first")(inputs)
    return cls(inputs, keras.layers.Dense(3, name="last")(x), name=name)


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, 4)).astype("float32"), rng.normal(size=(BATCH, 3)).astype("float32")


def _two_stages(model: keras.Model, devices: list[str], num_microbatches: int):
    """plan_and_wrap with 'first' and 'last' pinned to two devices, so the model is really cut."""
    wrapped = plan_and_wrap(
        model, devices[:2], batch_size=BATCH, num_microbatches=num_microbatches, memory="1GiB",
        pins={"first": devices[0], "last": devices[1]},
    )  # fmt: skip
    assert wrapped.plan.num_stages == 2
    return wrapped


# ----- steps of the model's own class --------------------------------------------------------------


def _overriding(step: str) -> type:
    """A functional keras.Model subclass that overrides ``step`` (and calls Keras' own in it)."""

    def override(self, *args, **kwargs):
        result = getattr(keras.Model, step)(self, *args, **kwargs) if step != "call" else super(cls, self).call(*args)
        if step == "train_step":
            result["custom_flag"] = 1.0
        return result

    cls = type("Custom", (keras.Model,), {step: override})
    return cls


def test_custom_train_step_runs_in_the_original(virtual_devices) -> None:
    """The original's fit runs its own train_step (the custom_flag log the wrapped model used to drop)."""
    model = _dense_model(cls=_overriding("train_step"))
    model.compile(optimizer="sgd", loss="mse")
    x, y = _batch()
    assert set(model.fit(x, y, batch_size=BATCH, verbose=0).history) == {"custom_flag", "loss"}
    with pytest.raises(InputError, match=r"'model' is a Custom whose class overrides Custom\.train_step: "):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_overridden_step_is_refused(step: str, num_microbatches: int, virtual_devices) -> None:
    model = _dense_model(cls=_overriding(step))
    expected = rf"overrides Custom\.{step}: the pipelined model runs Keras' own steps.*train this model without"
    with pytest.raises(InputError, match=expected):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=num_microbatches, memory="1GiB")
    plan = plan_and_wrap(_dense_model(), virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB").plan
    with pytest.raises(InputError, match=expected):
        wrap(model, plan, validate=False)


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_overridden_front_door_is_refused(door: str) -> None:
    """A user's class whose fit (evaluate, predict, ...) does work of its own: the wrapped model never calls it
    (found by probing, stop 37: a fit that scaled the inputs by 0.1 was skipped, weights 0.11 apart)."""
    expected = rf"^Model 'model' is a Custom whose class overrides Custom\.{door}: the wrapped model is a model of"
    with pytest.raises(InputError, match=expected):
        check_steps(_dense_model(cls=_overriding(door)))


def test_overrides_of_a_parent_class_are_named() -> None:
    parent = _overriding("compute_loss")
    child = type("Child", (parent,), {"compute_metrics": lambda self, *a, **k: {}})
    with pytest.raises(InputError, match=r"Child whose class overrides Child\.compute_metrics, Custom\.compute_loss"):
        check_steps(_dense_model(cls=child))


def test_a_class_of_its_own_without_steps_of_its_own_wraps(virtual_devices) -> None:
    """A functional model of a class of its own that overrides none of the steps (as keras-hub's) runs."""

    class OwnClass(keras.Model):
        def describe(self) -> str:
            return "mine"

    model = _dense_model(cls=OwnClass)
    wrapped = _two_stages(model, virtual_devices, 2)
    x, _ = _batch()
    assert_close(wrapped.predict(x, batch_size=BATCH, verbose=0), model.predict(x, batch_size=BATCH, verbose=0))


def test_a_subclassed_model_is_still_refused_as_subclassed(virtual_devices) -> None:
    class Subclassed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.zeros((2, 4), "float32"))
    with pytest.raises(ProfileError, match=r"is a subclassed keras\.Model"):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")


# ----- ops that mix the rows of a batch ---------------------------------------------------------------


class _OnTheBatch(keras.layers.Layer):
    """A branch, a loop or a clip decided by a batch-wide value of its inputs (their mean, their largest magnitude)."""

    def __init__(self, kind: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def call(self, v):
        ops = keras.ops
        if self.kind == "branch":
            return ops.cond(ops.mean(v) > 0, lambda: v * 2.0, lambda: v - 1.0)
        if self.kind == "loop":
            return ops.while_loop(lambda i, w: ops.max(ops.abs(w)) > 0.5, lambda i, w: (i + 1, w * 0.5), (0, v))[1]
        return v / ops.maximum(ops.max(ops.abs(v)), 6.0)

    def get_config(self) -> dict:
        return {**super().get_config(), "kind": self.kind}


class _BatchGradient(keras.layers.Layer):
    """x * w in its forward, row by row; its backward scales a gradient by the batch's gradient norm (a custom
    gradient): the inputs' ("inputs") or the weight's ("weight")."""

    def __init__(self, kind: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def build(self, shape) -> None:
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, v):
        ops = keras.ops

        @ops.custom_gradient
        def scaled(x, w):
            def grad(*args, upstream=None, variables=None):
                upstream = args[0] if upstream is None else upstream
                dx, dw = upstream * w, ops.sum(upstream * x, axis=0)
                if self.kind == "inputs":
                    return dx / ops.sqrt(ops.sum(ops.square(dx))), dw
                return dx, dw / ops.sqrt(ops.sum(ops.square(dw)))

            return x * w, grad

        return scaled(v, ops.multiply(self.w, 1.0))  # a tensor: a variable read inside would be a "variable"

    def get_config(self) -> dict:
        return {**super().get_config(), "kind": self.kind}


@keras.saving.register_keras_serializable(package="tests")
def _scaled_by_the_batch(x):
    """The identity, whose gradient is divided by the batch's mean |gradient|: an activation of the user's."""

    @keras.ops.custom_gradient
    def identity(v):
        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            return upstream / (keras.ops.mean(keras.ops.abs(upstream)) + 1e-6)

        return v, grad

    return identity(x)


def _time_distributed(x):
    steps = keras.layers.Reshape((2, 2), name="steps")(x)
    return keras.layers.Flatten(name="flat")(keras.layers.TimeDistributed(_CentredInTraining(), name="td")(steps))


# name -> (what the model does between 'first' and 'last', the op named in the error, M = 1 exact)
MIXING = {
    "concatenate_rows": (lambda x: keras.ops.concatenate([x, x * 2.0], axis=0), "concatenate", False),
    "reshape_across_rows": (lambda x: keras.ops.reshape(x, (-1, 8)), "reshape", False),
    "transpose_rows": (lambda x: keras.ops.matmul(x, keras.ops.matmul(keras.ops.transpose(x), x)), "transpose", False),
    "mean_over_rows": (lambda x: x - keras.ops.mean(x, axis=0), "mean", None),  # M = 1: the profiler refuses
    "mean_over_rows_kept": (lambda x: x - keras.ops.mean(x, axis=0, keepdims=True), "mean", True),
    "sum_broadcast": (lambda x: x + keras.ops.sum(x), "sum", True),
    "cumulative_sum_rows": (lambda x: keras.ops.cumsum(x, axis=0), "cumsum", True),  # row i reads rows < i
    "flip_rows": (lambda x: keras.ops.flip(x, axis=0), "flip", True),
    # a branch, a loop or a clip on a batch-wide value (found by probing, stop 36: trained silently at M = 2, loss
    # 1.440 against the original's 1.397 for the branch): on standard normal rows the halves take the batch's
    # branch, so the probe also runs halves apart in sign and scale
    "branch_on_the_batch_mean": (lambda x: _OnTheBatch("branch", name="branch")(x), "branch", True),
    "loop_on_the_batch_maximum": (lambda x: _OnTheBatch("loop", name="halving")(x), "halving", True),
    "clip_by_the_batch_maximum": (lambda x: _OnTheBatch("clip", name="clip")(x), "clip", True),
    # rows mixed in the backward only (found by probing, stop 38: the forward probe saw nothing)
    "input_gradient_normalised_by_the_batch": (lambda x: _BatchGradient("inputs", name="norm_x")(x), "norm_x", True),
    "weight_gradient_normalised_by_the_batch": (lambda x: _BatchGradient("weight", name="norm_w")(x), "norm_w", True),
    # a Keras layer running a function of the user's, a Keras wrapper around a layer of the user's (found by
    # probing, stop 39: 0.11 and 0.012 apart at M = 2)
    "activation_of_the_users": (
        lambda x: keras.layers.Dense(4, activation=_scaled_by_the_batch, name="act")(x),
        "act",
        True,
    ),
    "wrapped_centring_in_training": (_time_distributed, "td", True),
}


def _mixing_model(name: str) -> keras.Model:
    mix, _, _ = MIXING[name]
    inputs = keras.Input((4,), name="features")
    x = mix(keras.layers.Dense(4, name="first")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="last")(x), name=name)


@pytest.mark.parametrize("name", list(MIXING))
def test_op_mixing_rows_is_refused_with_microbatches(name: str, virtual_devices) -> None:
    model = _mixing_model(name)
    before = [w.copy() for w in model.get_weights()]
    op = MIXING[name][1]
    expected = rf"^'{op}(_\d+)?' \(\w+\) of model '{name}' (mixes the rows of a batch|changes the batch's row count)"
    with pytest.raises(InputError, match=expected):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")
    after = model.get_weights()
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_op_mixing_rows_is_refused_with_workers_at_one_microbatch() -> None:
    """With workers each trains on its shard of the global batch: a shard is a part of the batch as a micro-batch
    is, so M = 1 on 2 workers is checked as M > 1 (before, only M was: mixing rows trained each worker's shard)."""
    model = _mixing_model("mean_over_rows_kept")
    with pytest.raises(InputError, match=r"mixes the rows of a batch: .* with num_microbatches=1 on each of 2 workers"):
        check_rows(model, 1, num_replicas=2)
    check_rows(model, 1)


@pytest.mark.parametrize("name", [n for n, (_, _, exact) in MIXING.items() if exact is False])
def test_op_changing_the_row_count_is_refused_at_one_microbatch(name: str, virtual_devices) -> None:
    """At M = 1 too: the runtime returns and scores the batch's rows (8 of the original's 16 before)."""
    with pytest.raises(InputError, match=r"changes the batch's row count: it returns shape"):
        plan_and_wrap(_mixing_model(name), virtual_devices[:2], batch_size=BATCH, num_microbatches=1, memory="1GiB")


@pytest.mark.parametrize("name", [n for n, (_, _, exact) in MIXING.items() if exact])
def test_op_mixing_values_runs_exactly_at_one_microbatch(name: str, virtual_devices) -> None:
    """With M = 1 the micro-batch is the batch: outputs, loss and weights after one step are the original's."""
    keras.utils.set_random_seed(0)
    model = _mixing_model(name)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    wrapped = _two_stages(model, virtual_devices, 1)
    x, y = _batch()
    assert_close(wrapped.predict(x, batch_size=BATCH, verbose=0), model.predict(x, batch_size=BATCH, verbose=0))

    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with tf.GradientTape() as tape:
        ref_loss = reference.compute_loss(x=x, y=y, y_pred=reference(x, training=True), training=True)
    grads = tape.gradient(ref_loss, reference.trainable_weights)
    reference.optimizer.apply_gradients(zip(grads, reference.trainable_weights, strict=True))
    logs = wrapped.train_on_batch(x, y, return_dict=True)
    assert_close(logs["loss"], float(ref_loss))
    after, expected = wrapped.unwrap().get_weights(), reference.get_weights()
    assert len(after) == len(expected) == len(model.weights)
    for a, b in zip(after, expected, strict=True):
        assert_close(a, b)


def test_wrap_refuses_a_plan_run_with_more_microbatches(virtual_devices) -> None:
    """A plan made for M = 1 and run with M = 2 by wrap: the check follows the M that runs."""
    model = _mixing_model("sum_broadcast")
    plan = _two_stages(model, virtual_devices, 1).plan
    with pytest.raises(InputError, match=r"'sum(_\d+)?' \(Sum\) .* with num_microbatches=2 it would compute"):
        wrap(model, plan, num_microbatches=2)


def test_auto_microbatches_are_checked_as_several(virtual_devices) -> None:
    with pytest.raises(InputError, match=r"num_microbatches='auto'.*use num_microbatches=1"):
        plan_and_wrap(
            _mixing_model("sum_broadcast"), virtual_devices[:2], batch_size=BATCH, num_microbatches="auto",
            memory="1GiB",
        )  # fmt: skip


def test_output_without_rows_is_refused() -> None:
    inputs = keras.Input((4,))
    total = keras.ops.sum(keras.layers.Dense(4)(inputs), axis=0)  # one value per feature, not per row
    with pytest.raises(InputError, match=r"returns the output of 'sum(_\d+)?' with shape \(4,\) for a batch of 4"):
        check_rows(keras.Model(inputs, total), 1)


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_pass_the_row_check(name: str) -> None:
    check_rows(ZOO[name]()[0], 4)


class _NoisyCounter(keras.layers.Layer):
    """Adds noise and counts its calls whether training or not: it moves its state in inference."""

    def build(self, input_shape) -> None:
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")
        self.seed = keras.random.SeedGenerator(1)

    def call(self, x):
        self.calls.assign_add(1.0)
        return x + keras.random.normal(keras.ops.shape(x), seed=self.seed)


def test_row_check_leaves_variables_seed_states_and_losses_as_they_were() -> None:
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, activity_regularizer="l2")(inputs)
    x = keras.layers.BatchNormalization()(keras.layers.Dropout(0.5)(x))
    model = keras.Model(inputs, _NoisyCounter()(x))
    before = [v.numpy().copy() for v in model.variables]
    check_rows(model, 1)  # M = 1: the noise, which differs between the batch and its halves, is allowed
    after = [v.numpy() for v in model.variables]
    assert len(after) == len(before) == 9  # kernel, bias, seed, 4 of the batch norm, calls, noise seed
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert model.losses == []


class _Noisy(keras.layers.Layer):
    """Adds noise whether training or not."""

    def build(self, input_shape) -> None:
        self.seed = keras.random.SeedGenerator(1)

    def call(self, x):
        return x + keras.random.normal(keras.ops.shape(x), seed=self.seed)


def test_random_values_in_inference_are_refused_with_microbatches() -> None:
    inputs = keras.Input((4,))
    model = keras.Model(inputs, _Noisy(name="noisy")(keras.layers.Dense(4)(inputs)))
    with pytest.raises(InputError, match=r"^'noisy' \(_Noisy\) .* draws random values when it is not training"):
        check_rows(model, 2)
    check_rows(model, 1)  # the one micro-batch is the batch: its draws are the original's


def _regularized(regularizer) -> keras.Model:
    inputs = keras.Input((4,), name="features")
    x = keras.layers.Dense(4, activity_regularizer=regularizer, name="first")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="last")(x), name="regularized")


def test_an_activity_regularizer_over_the_batch_is_refused_with_microbatches(virtual_devices) -> None:
    """Each micro-batch's stage applies the regularizer to its own rows and adds the parts: exact for a sum over
    rows, and M times too large for a mean (found by probing, stop 36: loss 1.4647 against 1.4411 at M = 2)."""
    mean_square = lambda x: 0.5 * keras.ops.mean(keras.ops.square(x))  # noqa: E731
    expected = (
        r"^The activity regularizer of 'first' \(Dense\) of model 'regularized' is not a sum over the batch's rows"
    )
    with pytest.raises(InputError, match=expected):
        _two_stages(_regularized(mean_square), virtual_devices, 2)
    check_rows(_regularized(mean_square), 1)
    check_rows(_regularized(keras.regularizers.L1L2(0.01, 0.02)), 4)  # Keras' own sum over rows


def test_an_open_image_size_too_small_for_a_convolution_says_to_pass_the_sizes() -> None:
    """An open size is probed as 1: TensorFlow's oneDNN convolution took a 1 x 1 image, returned other channels
    of uninitialised memory, and the probe called the model random (found by a sweep of keras.applications with
    input_shape=(None, None, 3), stop 36)."""
    inputs = keras.Input((None, None, 3))
    x = keras.layers.Conv2D(4, 3, strides=2, use_bias=False, name="conv")(inputs)
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(x), name="open")
    # oneDNN's returns a (4, 1, 1, 3) tensor; a build that checks the size fails the call: one message either way
    expected = r"^Cannot check that 'conv' \(Conv2D\) of model 'open' .*(returns shape \(4, 1, 1, 3\)|fails on 4 rows)"
    with pytest.raises(InputError, match=expected):
        check_rows(model, 4)
    check_rows(model, 4, input_shapes=[(16, 16, 3)])


class _TwoStreams(keras.layers.Layer):
    """Returns (x, None), as keras-hub's XLNetEncoder does."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x), None

    def compute_output_shape(self, shape):
        return [(*shape[:-1], 4), (*shape[:-1], 4)]


def test_an_output_a_layer_leaves_out_is_no_value_to_check() -> None:
    inputs = keras.Input((3,))
    x, _ = _TwoStreams(name="streams")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    for num_microbatches in (1, 4):
        check_rows(model, num_microbatches)  # crashed on None's shape


def test_a_layer_holding_another_trains_tied_and_unwraps_tied(virtual_devices, tmp_path) -> None:
    """A layer that holds another layer of the graph (``zoo.TiedHead`` holds the embedding, as keras-hub's
    MaskedLMHead does) keeps one table: the plan keeps the two on one device, the rebuild gives the head the
    embedding's clone, and the table trains by both uses, as the original's (before stop 37: refused; before
    stop 36: a copy of its own, trained apart). ``unwrap()`` and ``save`` keep the tie too."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["tied_head"]()
    reference, _, _ = ZOO["tied_head"]()
    reference.set_weights(model.get_weights())
    wrapped = plan_and_wrap(
        model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB",
        pins={"embed": virtual_devices[0], "scores": virtual_devices[1]},
    )  # fmt: skip
    assert wrapped.plan.assignment["tied"] == virtual_devices[0] and wrapped.plan.num_stages == 2
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    for seed in (1, 2):
        x, y = make_batch(BATCH, seed)
        assert_close(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y))
    plain = wrapped.unwrap()
    for expected, actual in zip(reference.weights, plain.weights, strict=True):
        assert_close(np.asarray(actual), np.asarray(expected))
    assert plain.get_layer("tied").embedding is plain.get_layer("embed")
    x, y = make_batch(BATCH, 3)
    plain.fit(x, y, verbose=0)  # the unwrapped model trains its one table on
    reference.fit(x, y, verbose=0)
    assert_close(plain.predict(x, verbose=0), reference.predict(x, verbose=0))


def _time_distributed_and_alone() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4, 6))
    shared = keras.layers.Dense(6, name="shared")
    x = keras.layers.Flatten()(keras.layers.TimeDistributed(shared, name="td")(inputs))
    x = shared(keras.layers.Dense(6, name="mid")(x))
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(x))


def test_a_layer_inside_a_wrapper_and_called_alone_stays_one_layer(virtual_devices) -> None:
    """TimeDistributed holds the Dense that the graph also calls alone: one kernel, trained by both uses, and one
    in ``unwrap()`` (its copy's wrapper holds the copied Dense: clone_model copies the wrapper first)."""
    model, reference = _time_distributed_and_alone(), _time_distributed_and_alone()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH, 4, 6)).astype("float32"), rng.normal(size=(BATCH, 2)).astype("float32")
    wrapped = plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for _ in range(2):
        assert_close(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y))
    plain = wrapped.unwrap()
    assert plain.get_layer("td").layer is plain.get_layer("shared")
    assert_close(plain.predict(x, verbose=0), reference.predict(x, verbose=0))


class _HeldVariable(keras.layers.Layer):
    """Logits from another layer's embedding table, held as a variable of its own (not the layer)."""

    def __init__(self, table: keras.Variable, **kwargs) -> None:
        super().__init__(**kwargs)
        self.table = table

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.table))


def test_a_variable_held_by_two_layers_is_refused(virtual_devices) -> None:
    inputs = keras.Input((3,), dtype="int32", name="ids")
    embedding = keras.layers.Embedding(10, 4, name="embed")
    x = keras.layers.Dense(4, name="first")(keras.ops.mean(embedding(inputs), axis=1))
    model = keras.Model(inputs, _HeldVariable(embedding.embeddings, name="last")(x), name="tied")
    expected = (
        r"^'last' \(_HeldVariable\) of model 'tied' holds the variable 'embed/embeddings' of 'embed' \(Embedding\): "
        r"a weight tied between two layers in a way the pipeline cannot keep"
    )
    for num_microbatches in (1, 2):
        with pytest.raises(InputError, match=expected):
            plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=num_microbatches)


def test_a_stateful_recurrent_layer_is_refused(virtual_devices) -> None:
    """At any M, in one line that says so (before: the probe's 4 rows failed it, and the message asked for input
    sizes)."""
    inputs = keras.Input((5, 3), batch_size=BATCH)
    x = keras.layers.LSTM(4, stateful=True, name="lstm")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="last")(keras.layers.Dense(4, name="first")(x)))
    for num_microbatches in (1, 2):
        with pytest.raises(InputError, match=r"^'lstm' \(LSTM\) of model '\w+' is stateful \(stateful=True\)"):
            plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=num_microbatches)


class _RunningMean(keras.layers.Layer):
    """Moves a running mean of its inputs in training, as batch normalization's statistics (found by probing,
    stop 35: at M = 2 its mean ended 0.034 away from the original's, whose size is 0.036)."""

    def build(self, input_shape) -> None:
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False, name="mean")

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=0))
        return x


class _Counter(keras.layers.Layer):
    """Counts its calls, training or not (no training argument)."""

    def build(self, input_shape) -> None:
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x):
        self.calls.assign_add(1.0)
        return x


def _spectral(name: str) -> keras.layers.Layer:
    return keras.layers.SpectralNormalization(keras.layers.Dense(4), name=name)  # its power iteration's vector


@pytest.mark.parametrize(("layer", "variable"), [(_RunningMean, "mean"), (_Counter, "calls"), (_spectral, "vector_u")])
def test_a_layer_that_moves_its_state_in_training_is_refused_with_microbatches(layer, variable, virtual_devices):
    """Every micro-batch's forward would move it, M times a step where Keras moves it once; batch normalization
    (deferred by the runtime), dropout's seed states and frozen weights pass (the zoo's models, above)."""
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="first")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(layer(name="state")(x)), name="stateful")
    before = [v.numpy().copy() for v in model.variables]
    with pytest.raises(
        InputError,
        match=rf"^'state' \(\w+\) of model 'stateful' changes its non-trainable variable 'state/{variable}' when it "
        r"runs in a training step: with num_microbatches=2 every micro-batch's forward changes it",
    ):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")
    for a, b in zip(model.variables, before, strict=True):
        np.testing.assert_array_equal(a.numpy(), b)
    check_rows(model, 1)  # one micro-batch: the step moves it once, as Keras does


@keras.saving.register_keras_serializable(package="tests")
class _CentredInTraining(keras.layers.Layer):
    """Centres its rows on the batch's mean in training only (found by probing, stop 35: the loss 0.08 off at
    M = 2 and 0.28 at M = 4, silently, while the probe ran it with training=False only)."""

    def call(self, x, training=None):
        return x - keras.ops.mean(x, axis=0) if training else x

    def compute_output_shape(self, shape):  # for TimeDistributed
        return shape


def test_a_layer_that_mixes_rows_only_in_training_is_refused_with_microbatches(virtual_devices) -> None:
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="first")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(_CentredInTraining(name="centred")(x)), name="m")
    with pytest.raises(
        InputError,
        match=r"^'centred' \(_CentredInTraining\) of model 'm' mixes the rows of a batch: in a training step "
        r"\(training=True\) its rows computed on half the batch differ by",
    ):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")
    check_rows(model, 1)  # one micro-batch is the batch


class _WrongRank(keras.layers.Layer):
    """Its compute_output_shape gives rank 2 where its call returns rank 3 (keras-hub 0.32's XLNet mask layer)."""

    def call(self, x):
        return x[:, :, None] * x[:, None, :]

    def compute_output_shape(self, shape):
        return shape


def test_a_layer_whose_graph_shape_has_another_rank_is_refused_without_asking_for_sizes() -> None:
    """No input size changes a rank: the message asked for input sizes the user had passed (found by probing)."""
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(_WrongRank(name="pairs")(inputs))))
    expected = r"^'pairs' \(_WrongRank\) of model '\w+' returns values of shape \(4, 5, 5\) where the model's graph"
    with pytest.raises(InputError, match=expected):
        check_rows(model, 2)


class _ScaledWithoutConfig(keras.layers.Layer):  # type: ignore[misc]  # keras ships no type hints
    """Multiplies by ``factor``, which its get_config leaves out: made anew from its config, it multiplies by 1."""

    def __init__(self, factor: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self) -> dict:
        return super().get_config()  # without factor (Keras' own would have recorded it)


def test_a_layer_its_config_does_not_rebuild_is_refused_at_wrap(virtual_devices) -> None:
    """Found by probing (stop 38): trained from the first step with its argument lost, predict 5.09 off, at M = 1."""
    inputs = keras.Input((4,))
    h = _ScaledWithoutConfig(factor=5.0, name="scaled")(keras.layers.Dense(4, name="first")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(h))
    with pytest.raises(InputError, match=r"rebuilt for its devices computes other values .* output 0 differs by"):
        plan_and_wrap(model, devices=virtual_devices[:2], batch_size=4, num_microbatches=1)


class _UnseededNoise(keras.layers.Layer):  # type: ignore[misc]  # keras ships no type hints
    """Multiplicative noise in training drawn from Keras' global seed generator (no seed generator of its own)."""

    def call(self, x, training=None):
        return x * (1.0 + 0.5 * keras.random.normal(keras.ops.shape(x))) if training else x


def test_a_stage_that_recomputes_a_draw_from_the_global_seed_generator_is_refused(virtual_devices) -> None:
    """Found by probing (stop 38): the recompute drew other noise than the forward, weights 0.17 off after a step."""
    inputs = keras.Input((6,))
    h = _UnseededNoise(name="noise")(keras.layers.Dense(6, name="first")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Dense(6, name="mid")(h)))
    pins = {"first": virtual_devices[0], "noise": virtual_devices[0], "head": virtual_devices[1]}
    options = {"devices": virtual_devices[:2], "batch_size": 8, "num_microbatches": 1, "pins": pins}
    with pytest.raises(InputError, match=r"'noise' draws random values from Keras' global seed generator .* stage 0"):
        plan_and_wrap(model, recompute="always", **options)
    assert plan_and_wrap(model, recompute="never", **options).plan.num_stages == 2


class _RowCountBranch(keras.layers.Layer):
    """Doubles its input on batches of more than 8 rows: a branch on the row count above the probe batch's 4."""

    def call(self, x):
        return keras.ops.cond(keras.ops.shape(x)[0] > 8, lambda: x * 2.0, lambda: x)


@pytest.mark.parametrize(("batch", "num_microbatches", "refused"), [(16, 2, True), (16, 1, False), (8, 2, False)])
def test_a_branch_on_the_batchs_row_count_is_refused_where_a_microbatch_takes_the_other_branch(
    batch: int, num_microbatches: int, refused: bool, virtual_devices
) -> None:
    """Found by probing (stop 38, confirmed stop 39): predict 3.42 off at B = 16, M = 2, unrefused (the row check's
    probe batch has 4 rows, its halves 2: both take the same branch). plan_and_wrap knows B and M: the model on a
    micro-batch's rows against the same rows of the batch."""
    inputs = keras.Input((4,))
    x = _RowCountBranch(name="branch")(keras.layers.Dense(4, name="first")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, name="last")(x), name="rows")
    before = [w.copy() for w in model.get_weights()]
    pins = {"first": virtual_devices[0], "last": virtual_devices[1]}

    def wrapping() -> None:
        plan_and_wrap(model, virtual_devices[:2], batch_size=batch, num_microbatches=num_microbatches, pins=pins)

    if not refused:
        wrapping()
        return
    message = (
        r"^Model 'rows' computes other values for a micro-batch than for the same rows of its batch: its output 0 on "
        r"the first 8 rows of a 16-row batch differs by"
    )
    with pytest.raises(InputError, match=message):
        wrapping()
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
