"""Transparency: the partitioned, micro-batched model computes what the original computes.

For every model of the zoo, on 2 and 4 virtual devices and M = 1 and 4 micro-batches (GPipe), and on
4 devices with M = 4 for every other way to run the step (1F1B, recomputation, XLA per stage):
outputs, loss, every gradient and every weight after one optimizer step match the original within
1e-5, and every variable lives on the device the plan names.

The reference is the original Keras model on the whole batch. For models with BatchNormalization
and M > 1 it is the original model run micro-batch by micro-batch with the gradients of the
weighted losses summed: batch statistics are per micro-batch in any pipeline (GPipe, torchgpipe),
so that is the computation a pipeline promises to reproduce.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from zoo import ZOO, has_batch_norm

import partitioner as pt
from partitioner.errors import InputError, ProfileError
from profiles import profile_model
from runtime import placement_report, plan_and_wrap, wrap
from runtime.rebuild import seed_states

BATCH = 8


def assert_close(actual: object, expected: object) -> None:
    """Equal within 1e-5 of the larger of 1 and the largest magnitude in ``expected``.

    Float32 sums over a batch, done in another order (other threads, other devices), differ by a
    few ulps of the largest terms; a gradient entry of -3 from terms of 1e4 differs by 1e-4.
    """
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    worst = float(np.max(np.abs(actual - expected), initial=0.0))
    assert worst <= 1e-5 * scale, f"max difference {worst:.3g} > 1e-5 x {scale:.3g}"


def _plan(model: keras.Model, devices: list[str], num_devices: int, num_microbatches: int) -> pt.Plan:
    """A plan that uses every one of the first num_devices devices (the uniform split)."""
    graph = profile_model(model, batch_size=BATCH, num_microbatches=num_microbatches, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in devices[:num_devices]])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=num_microbatches)
    pt.validate_plan(plan, graph, cluster)
    assert plan.num_stages == num_devices
    return plan


def _copy(model: keras.Model, build: object = None) -> keras.Model:
    """A copy with the same weights: cloned, or made again by ``build`` (a zoo builder), which keeps a weight
    tied between two layers tied (``keras.models.clone_model`` gives the second layer a copy of its own)."""
    copy = build()[0] if build is not None else keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def _slice(structure: object, start: int, stop: int) -> object:
    return keras.tree.map_structure(lambda a: a[start:stop], structure)


def _reference_loss(
    model: keras.Model, x: object, y: object, num_microbatches: int, sizes: list[int] | None = None
) -> tf.Tensor:
    """The original model's loss on the batch (micro-batch by micro-batch when it has BatchNorm).

    With BatchNorm and M > 1, each micro-batch is normalised by its own statistics, and each layer's
    moving statistics move once, towards the mean and variance over the whole batch of the inputs
    that layer saw (deferred batch normalization, the runtime's default).
    """
    if num_microbatches == 1 or not has_batch_norm(model):
        return model.compute_loss(x=x, y=y, y_pred=model(x, training=True), training=True)
    batch = len(keras.tree.flatten(x)[0])
    before = [v.numpy() for v in model.non_trainable_weights]
    norms = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
    probe = keras.Model(model.inputs, [layer.input for layer in norms])  # what each batch norm reads
    sizes = sizes or [batch // num_microbatches] * num_microbatches
    total, start, seen = 0.0, 0, []
    for size in sizes:
        x_m, y_m = _slice(x, start, start + size), _slice(y, start, start + size)
        with tf.GradientTape() as probe_tape:
            probe_tape.stop_recording()
            # flattened: a probe of one batch norm returns its one tensor, not a list
            seen.append([np.asarray(t, dtype=np.float64) for t in keras.tree.flatten(probe(x_m, training=True))])
        loss = model.compute_loss(x=x_m, y=y_m, y_pred=model(x_m, training=True), training=True)
        total += loss * size / batch
        start += size
    for variable, value in zip(model.non_trainable_weights, before, strict=True):
        variable.assign(value)
    for i, layer in enumerate(norms):
        inputs = np.concatenate([parts[i] for parts in seen], axis=0)
        axes = tuple(a for a in range(inputs.ndim) if a != layer.axis % inputs.ndim)  # all but the layer's axis
        for variable, value in ((layer.moving_mean, inputs.mean(axes)), (layer.moving_variance, inputs.var(axes))):
            variable.assign(variable.numpy() * layer.momentum + value * (1 - layer.momentum))
    return total


def _variable_pairs(wrapped: object) -> list[tuple[tf.Variable, tf.Variable]]:
    """(original variable, clone variable) for every weight of the model."""
    pairs = []
    for original, clone in wrapped._state.rebuilt.origin:
        pairs += list(zip(original.weights, clone.weights, strict=True))
    return pairs


def _assert_gradients_match(model, wrapped, reference, tape, ref_loss, x, y) -> None:
    """The reference's taped loss and its gradients against the wrapped model's ``loss_and_gradients``:
    the same loss, and the same gradient for every trainable weight of ``model`` (dense)."""
    ref_grads = tape.gradient(ref_loss, reference.trainable_weights)
    pipe_loss, pipe_grads = wrapped.loss_and_gradients(x, y)
    assert_close(float(pipe_loss), float(ref_loss))
    clone_grad = {id(v): g for v, g in zip(wrapped.executor.trainable_variables, pipe_grads, strict=True)}
    index = {id(v): i for i, v in enumerate(model.trainable_weights)}
    pairs = [(o, c) for o, c in _variable_pairs(wrapped) if id(o) in index]
    assert len(pairs) == len(model.trainable_weights)
    for original, clone in pairs:
        expected = ref_grads[index[id(original)]]  # None for a weight the loss does not read, as in the pipeline
        if expected is None:
            assert clone_grad[id(clone)] is None, f"'{original.path}': Keras gives no gradient, the pipeline one"
            continue
        assert_close(clone_grad[id(clone)], tf.convert_to_tensor(expected))


def _assert_step_matches(wrapped, reference, tape, ref_loss, x, y) -> None:
    """One SGD step of the reference from its taped loss, one train_on_batch of the wrapped model: the same
    loss and the same weights after (moving statistics included)."""
    grads = tape.gradient(ref_loss, reference.trainable_weights)
    reference.optimizer.apply_gradients(zip(grads, reference.trainable_weights, strict=True))
    logs = wrapped.train_on_batch(x, y, return_dict=True)
    assert_close(logs["loss"], float(ref_loss))
    for after, expected in zip(wrapped.unwrap().get_weights(), reference.get_weights(), strict=True):
        assert_close(after, expected)


# MobileNetV2 (keras.applications) takes 40-85 s a case on 2 cores, half of the runtime suite: its cases
# run in the slow suite (`make test-slow`, which CI runs after `make test`)
_SLOW = {"mobilenet_v2": [pytest.mark.slow]}
# the cases of a model that `make test` runs (the others in the slow suite, to keep `make test` under 15 minutes):
# a pipeline at M = 4, 1F1B with recomputation on 4 devices, and for the small models M = 1 (the step inlined) and
# XLA's stage functions; tied_head's tie is one stage's, so its two cases hold it there
_PIPELINE, _RECOMPUTING = (2, 4, "gpipe", "never", False), (4, 4, "1f1b", "always", False)
_SMALL = {_PIPELINE, _RECOMPUTING, (2, 1, "gpipe", "never", False), (4, 4, "1f1b", "never", True)}
_FAST = {
    **{name: _SMALL for name in ("mlp", "two_in_two_out", "returned_and_read", "shared_layer", "nested_sequential")},
    **{name: {_PIPELINE, _RECOMPUTING} for name in ("cifar_cnn", "resnet_style", "tagger", "tied_head")},
}


def _marks(name: str, *case: object) -> list[pytest.MarkDecorator]:
    if name in _FAST:
        return [] if case in _FAST[name] else [pytest.mark.slow]
    return _SLOW.get(name, [])


CASES = [
    pytest.param(name, k, m, "gpipe", "never", False, marks=_marks(name, k, m, "gpipe", "never", False))
    for name in ZOO
    for k in (2, 4)
    for m in (1, 4)
] + [
    pytest.param(name, 4, 4, schedule, recompute, jit, marks=_marks(name, 4, 4, schedule, recompute, jit))
    for name in ZOO
    for schedule, recompute, jit in (
        ("1f1b", "never", False),
        ("gpipe", "always", False),
        ("1f1b", "always", False),
        ("1f1b", "never", True),
    )
]


@pytest.mark.parametrize(("name", "num_devices", "num_microbatches", "schedule", "recompute", "jit_compile"), CASES)
def test_transparency_matches_original(
    name: str,
    num_devices: int,
    num_microbatches: int,
    schedule: str,
    recompute: str,
    jit_compile: bool,
    virtual_devices,
) -> None:
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO[name]()
    x, y = make_batch(BATCH, 1)
    plan = _plan(model, virtual_devices, num_devices, num_microbatches)
    options = {"schedule": schedule, "recompute": recompute}

    wrapped = wrap(model, plan, validate=False, **options)
    # Every variable lives on the device its plan names, and the plan's stages are all used.
    report = placement_report(wrapped)
    assert report.ok, report.misplaced
    assert {d for devs in report.variable_devices.values() for d in devs} <= set(report.planned.values())
    inputs = {layer.name for layer in model.layers if isinstance(layer, keras.layers.InputLayer)}
    computing = {d for node, d in report.planned.items() if node not in inputs}
    assert computing <= {d for d, n in report.op_devices.items() if n > 0}

    # Outputs in inference mode.
    keras.tree.map_structure(
        assert_close,
        keras.tree.map_structure(np.asarray, model(x, training=False)),
        keras.tree.map_structure(np.asarray, wrapped(x, training=False)),
    )
    keras.tree.map_structure(  # predict runs the stage functions micro-batch by micro-batch
        assert_close,
        keras.tree.map_structure(np.asarray, model(x, training=False)),
        wrapped.predict(x, batch_size=BATCH, verbose=0),
    )

    # Loss and every gradient of one micro-batched training pass.
    reference = _copy(model, ZOO[name])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=jit_compile)
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, num_microbatches)
    ref_grads = {  # an embedding's gradient comes as IndexedSlices: made dense to compare
        id(v): tf.convert_to_tensor(g)
        for v, g in zip(reference.trainable_weights, tape.gradient(ref_loss, reference.trainable_weights), strict=True)
    }
    pipe_loss, pipe_grads = wrapped.loss_and_gradients(x, y)
    assert_close(float(pipe_loss), float(ref_loss))
    original_index = {id(v): i for i, v in enumerate(model.trainable_weights)}
    clone_grad = {id(v): g for v, g in zip(wrapped.executor.trainable_variables, pipe_grads, strict=True)}
    compared = set()  # a weight tied between two layers is in both layers' pairs
    for original, clone in _variable_pairs(wrapped):
        if id(original) not in original_index:
            continue
        ref_var = reference.trainable_weights[original_index[id(original)]]
        assert_close(clone_grad[id(clone)], ref_grads[id(ref_var)])
        compared.add(id(original))
    assert len(compared) == len(model.trainable_weights)

    # Weights after one optimizer step through fit's own train_step.
    wrapped = wrap(model, plan, validate=False, **options)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=jit_compile)
    assert wrapped.stage_jit_compile is jit_compile
    # XLA compiles every stage but one with a recurrent layer (its loop state cannot leave an XLA cluster)
    recurrent = [
        any(isinstance(layer, keras.layers.RNN) for op in stage.operations for layer in op._flatten_layers())
        for stage in wrapped.executor.stages
    ]
    assert wrapped.xla_stages == tuple(jit_compile and not r for r in recurrent)
    reference = _copy(model, ZOO[name])
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, num_microbatches)
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)


@pytest.mark.parametrize(
    ("schedule", "recompute", "num_devices"), [("gpipe", "never", 2), ("1f1b", "always", 3), ("gpipe", "always", 3)]
)
def test_output_read_by_a_later_stage_trains_as_the_original(schedule, recompute, num_devices, virtual_devices) -> None:
    """A model output that a layer of a later stage reads too: the producer's weights take the gradient
    of both (the loss of the output, and the loss through the reader), as in the original, with Adam.
    Before the fix the last stage took its gradient for the copy of the output it returned, and the
    producer lost everything that came through the reader."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["returned_and_read"]()
    x, y = make_batch(BATCH, 1)
    devices = virtual_devices[:num_devices]
    pins = {"embedding": devices[0], "reader": devices[1], "label": devices[-1]}
    wrapped = plan_and_wrap(
        model, devices=devices, batch_size=BATCH, num_microbatches=4, pins=pins, schedule=schedule, recompute=recompute
    )
    assert wrapped.plan.num_stages == num_devices
    assert wrapped.plan.assignment["embedding"] != wrapped.plan.assignment["reader"]
    reference = _copy(model)
    for each in (reference, wrapped):
        each.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, loss_weights=[0.5, 1.0])
    for _ in range(2):
        expected = reference.train_on_batch(x, y, return_dict=True)
        logs = wrapped.train_on_batch(x, y, return_dict=True)
        assert_close(logs["loss"], expected["loss"])
    after, weights = wrapped.unwrap().get_weights(), reference.get_weights()
    assert len(after) == len(weights) == len(model.get_weights())
    for actual, value in zip(after, weights, strict=True):
        assert_close(actual, value)


@pytest.mark.parametrize("batch_norm", ["deferred", "per_microbatch"])
def test_batch_norm_remainder_batch_matches_microbatched_original(batch_norm: str, virtual_devices) -> None:
    """13 rows in M = 4 micro-batches of ceil(13/4) = 4 rows: 4 + 4 + 4 + 1, the last padded with 3
    repeated rows that must count neither in the loss nor in batch normalization's statistics."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = ZOO["resnet_style"]()
    x, y = make_batch(13, 2)
    plan = _plan(model, virtual_devices, 2, 4)
    wrapped = wrap(model, plan, validate=False, batch_norm=batch_norm)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    reference = _copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    sizes = [4, 4, 4, 1]
    if batch_norm == "deferred":
        with tf.GradientTape() as tape:
            ref_loss = _reference_loss(reference, x, y, 4, sizes)
    else:  # Keras' own layers, micro-batch after micro-batch: M moving updates
        with tf.GradientTape() as tape:
            ref_loss, start = 0.0, 0
            for size in sizes:
                x_m, y_m = x[start : start + size], y[start : start + size]
                y_pred = reference(x_m, training=True)
                ref_loss += reference.compute_loss(x=x_m, y=y_m, y_pred=y_pred, training=True) * size / 13
                start += size
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)


def _channels_first(axis: int, synchronized: bool) -> keras.Model:
    """(batch, 4 channels, 6 steps) through Dense layers (on the last axis), normalised over ``axis``:
    1 for the channels, -1 for the steps; [input, dense, bn | relu, flatten, head] on 2 stages."""
    inputs = keras.Input((4, 6))
    h = keras.layers.Dense(6, name="mix")(inputs)
    h = keras.layers.BatchNormalization(axis=axis, synchronized=synchronized, momentum=0.5, name="bn")(h)
    h = keras.layers.Flatten(name="flat")(keras.layers.ReLU(name="relu")(h))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize("synchronized", [False, True])
@pytest.mark.parametrize("axis", [1, -1])
def test_batch_norm_on_any_axis_is_deferred(axis: int, synchronized: bool, virtual_devices) -> None:
    """M = 4: a BatchNormalization over the channels (axis=1) or the last axis, synchronized or not, moves
    its moving statistics once per step towards the whole batch's statistics over every other axis, and
    the loss, gradients and weights after a step are the micro-batched original's."""
    keras.utils.set_random_seed(0)
    model = _channels_first(axis, synchronized)
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(BATCH, 4, 6)) * np.arange(1, 5)[None, :, None] + 3).astype("float32")
    y = rng.normal(size=(BATCH, 3)).astype("float32")
    plan = _plan(model, virtual_devices, 2, 4)
    assert plan.assignment["bn"] == plan.stages[0]
    wrapped = wrap(model, plan, validate=False)
    reference = _copy(model)
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, 4)
    _assert_gradients_match(model, wrapped, reference, tape, ref_loss, x, y)

    wrapped = wrap(model, plan, validate=False)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference = _copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, 4)
    moved = reference.get_layer("bn").moving_variance.numpy()
    assert np.max(np.abs(moved - 1.0)) > 0.1  # the reference moved its statistics, far from their start
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)


class _NormalizedDense(keras.layers.Layer):
    """Dense then BatchNormalization inside one layer: the runtime sees the outer layer only."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.norm = keras.layers.BatchNormalization()

    def call(self, inputs, training=None):
        return self.norm(self.dense(inputs), training=training)


def _undeferrable(case: str) -> keras.Model:
    """A batch normalization whose moving statistics the runtime cannot move once per step."""
    if case == "masked":
        tokens = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(9, 4, mask_zero=True, name="embed")(tokens)
        h = keras.layers.BatchNormalization(name="bn")(h)  # Keras passes it the embedding's mask
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        return keras.Model(tokens, keras.layers.Dense(2, name="head")(h))
    inputs = keras.Input((6,))
    h = keras.layers.Dense(4, name="d0")(inputs)
    if case == "renorm":
        h = keras.layers.BatchNormalization(renorm=True, name="bn")(h)
    else:
        h = _NormalizedDense(name="block")(h)
    h = keras.layers.Dense(4, name="d1")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("renorm", r"BatchNormalization 'bn' uses renorm=True"),
        ("masked", r"BatchNormalization 'bn' is called with a Keras mask"),
        ("nested", r"BatchNormalization '\w+' is inside layer 'block' \(_NormalizedDense\)"),
    ],
)
def test_batch_norm_that_cannot_be_deferred_is_refused(case: str, message: str, virtual_devices) -> None:
    """Keras' own layer would move its moving statistics M times a step: refused unless asked for."""
    model = _undeferrable(case)
    plan = _plan(model, virtual_devices, 2, 4)
    with pytest.raises(pt.InputError, match=message + r".*moves them 4 times a step.*batch_norm='per_microbatch'"):
        wrap(model, plan, validate=False)
    wrap(model, plan, validate=False, batch_norm="per_microbatch")  # the M updates, asked for
    wrap(model, _plan(model, virtual_devices, 2, 1), validate=False)  # one micro-batch: Keras' own update


def test_batch_norm_left_to_keras_is_refused_with_workers() -> None:
    """Each worker's layer would move its statistics towards its own shard's (found by probing, stop 38: the two
    workers' moving statistics 0.014 to 0.018 apart after 3 steps, renorm at M = 1 or batch_norm='per_microbatch')."""
    from runtime.batchnorm import check_deferrable, check_per_microbatch

    model = _undeferrable("renorm")
    nodes = [node for layer in model.layers for node in layer._inbound_nodes]
    check_deferrable(nodes, 1)  # one worker, one micro-batch: Keras' own update is the original's
    with pytest.raises(pt.InputError, match=r"renorm=True.* moves them each step, on each of 2 workers apart"):
        check_deferrable(nodes, 1, num_replicas=2)
    check_per_microbatch(nodes, 1)
    with pytest.raises(pt.InputError, match=r"'bn' with batch_norm='per_microbatch' on 2 workers: .* drift apart"):
        check_per_microbatch(nodes, 2)


def _dropout_model() -> keras.Model:
    """Dropout on both sides of a 2-stage split: [input, d0, drop0 | d1, drop1, head]."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="d0")(inputs)
    h = keras.layers.Dropout(0.5, name="drop0")(h)
    h = keras.layers.Dense(16, activation="relu", name="d1")(h)
    h = keras.layers.Dropout(0.3, name="drop1")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def _seed_values(layers_of: object) -> list[np.ndarray]:
    return [np.asarray(state.value) for state in seed_states(layers_of)]


def _dropout_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(BATCH, 6)).astype("float32"), rng.normal(size=(BATCH, 3)).astype("float32")


def test_dropout_single_microbatch_matches_original(virtual_devices) -> None:
    """M = 1: each dropout draws its mask once per step, as in the original, from the seed state the
    copy took from the original: the same loss, weights and seed states after a step."""
    keras.utils.set_random_seed(0)
    model = _dropout_model()
    x, y = _dropout_batch()
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 1), validate=False)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference = _copy(model)
    for state, copy in zip(seed_states(model), seed_states(reference), strict=True):
        copy.assign(state.value)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with tf.GradientTape() as tape:
        ref_loss = reference.compute_loss(x=x, y=y, y_pred=reference(x, training=True), training=True)
    assert abs(float(ref_loss) - float(reference.compute_loss(x=x, y=y, y_pred=reference(x)))) > 1e-3  # masks drawn
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)
    clones = [clone for _, clone in wrapped._state.rebuilt.origin]
    for after, expected in zip([v for c in clones for v in _seed_values(c)], _seed_values(reference), strict=True):
        np.testing.assert_array_equal(after, expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_draws_the_same_dropout_masks(schedule: str, virtual_devices) -> None:
    """M = 4: a recomputed stage's backward re-draws the masks its forward drew (same loss and
    gradients as keeping the activations), and leaves every seed state where the kept run leaves
    it, so the next step draws the same masks too."""
    keras.utils.set_random_seed(0)
    model = _dropout_model()
    x, y = _dropout_batch()
    plan = _plan(model, virtual_devices, 2, 4)
    runs = {r: wrap(model, plan, validate=False, schedule=schedule, recompute=r) for r in ("never", "always")}
    losses, gradients, seeds = {}, {}, {}
    for recompute, wrapped in runs.items():
        wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses[recompute], gradients[recompute] = wrapped.loss_and_gradients(x, y)
        losses[recompute] = [float(losses[recompute])] + [float(wrapped.train_on_batch(x, y)) for _ in range(2)]
        seeds[recompute] = [v for _, clone in wrapped._state.rebuilt.origin for v in _seed_values(clone)]
    assert_close(losses["always"], losses["never"])
    for recomputed, kept in zip(gradients["always"], gradients["never"], strict=True):
        assert_close(recomputed, kept)
    for recomputed, kept in zip(seeds["always"], seeds["never"], strict=True):
        np.testing.assert_array_equal(recomputed, kept)


@pytest.mark.parametrize(("schedule", "recompute"), [("gpipe", "never"), ("1f1b", "always")])
def test_dropout_at_four_microbatches_matches_the_original_run_microbatch_by_microbatch(
    schedule: str, recompute: str, virtual_devices
) -> None:
    """M = 4 against the ORIGINAL (not wrapped against wrapped): each dropout layer draws one mask per
    micro-batch, in micro-batch order, from the seed state the copy took from the original, so the
    original run micro-batch by micro-batch from the same seed states draws the same masks; its
    share-weighted losses' gradients give the same step. Would fail if dropout were off (asserted: the
    masks change the loss) or drew in another order."""
    keras.utils.set_random_seed(0)
    model = _dropout_model()
    x, y = _dropout_batch()
    plan = _plan(model, virtual_devices, 2, 4)
    wrapped = wrap(model, plan, validate=False, schedule=schedule, recompute=recompute)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference = _copy(model)
    for state, copy in zip(seed_states(model), seed_states(reference), strict=True):
        copy.assign(state.value)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    size = BATCH // 4
    with tf.GradientTape() as tape:
        ref_loss = 0.0
        for m in range(4):
            x_m, y_m = x[m * size : (m + 1) * size], y[m * size : (m + 1) * size]
            y_pred = reference(x_m, training=True)
            ref_loss += reference.compute_loss(x=x_m, y=y_m, y_pred=y_pred, training=True) * size / BATCH
    plain = reference.compute_loss(x=x, y=y, y_pred=reference(x))
    assert abs(float(ref_loss) - float(plain)) > 1e-3  # the masks were drawn
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)
    clones = [clone for _, clone in wrapped._state.rebuilt.origin]
    after, expected = [v for c in clones for v in _seed_values(c)], _seed_values(reference)
    assert len(after) == len(expected) == 2
    for a, e in zip(after, expected, strict=True):
        np.testing.assert_array_equal(a, e)  # four draws each, as the original's


def test_recompute_draws_from_seed_states_of_its_own(virtual_devices) -> None:
    """A recomputing stage draws from variables of its own, not the layers' seed states: given a
    tf.Variable, keras.Variable wraps it, and the recompute of micro-batch m then rewound the state
    the forward of micro-batch m + 2 draws from while it ran (1F1B: a mask drawn twice and a lost
    increment, 8 runs in 25 of the test above, 1 in 25 under GPipe)."""
    model = _dropout_model()
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 4), validate=False, schedule="1f1b", recompute="always")
    program = wrapped._state.executor.programs[0]
    assert program.seed_generators and len(program.shadow_seeds) == len(program.seed_generators)
    for generator, shadow in zip(program.seed_generators, program.shadow_seeds, strict=True):
        assert shadow.value is not generator.state.value
        np.testing.assert_array_equal(shadow.numpy(), generator.state.numpy())


# ----- masked outputs: Keras' loss is the mean over the valid steps ---------------------------------


def _tagger(nested: bool = False) -> keras.Model:
    """Embedding(mask_zero=True) -> LSTM(return_sequences=True) -> Dense: the output carries the mask.
    Nested, the output carries it only at run time (and no layer of the outer graph reads it)."""
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 8, mask_zero=True, embeddings_initializer="normal", name="embed")(tokens)
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(h)
    logits = keras.layers.Dense(5, kernel_initializer=keras.initializers.RandomNormal(stddev=2.0), name="tagger")(h)
    model = keras.Model(tokens, logits, name="tagger_model")
    if nested:
        outer = keras.Input((6,), dtype="int32")
        model = keras.Model(outer, model(outer))
    return model


def _padded_tokens(batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 1 to 6 tokens then padding (0): micro-batches hold different numbers of valid steps."""
    rng = np.random.default_rng(3)
    x = rng.integers(1, 12, (batch, 6))
    for row, length in enumerate([1, 6, 2, 5, 3, 4, 6, 1, 2][:batch]):
        x[row, length:] = 0
    return x, rng.integers(0, 5, (batch, 6))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_masked_output_matches_original(nested: bool, num_microbatches: int, schedule: str, virtual_devices) -> None:
    """8 rows in M = 3 micro-batches of 3 + 3 + 2 rows holding 9, 12 and 7 valid steps: the loss is the
    mean over the batch's 28 valid steps (not the mean of the micro-batches' means), and the gradients,
    the weights after a step, evaluate and the outputs' masks are the original's."""
    keras.utils.set_random_seed(0)
    model = _tagger(nested)
    x, y = _padded_tokens(BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plan = _plan(model, virtual_devices, 2, num_microbatches)
    wrapped = wrap(model, plan, validate=False, schedule=schedule)
    expected_mask = np.asarray(model(x)._keras_mask)
    np.testing.assert_array_equal(np.asarray(wrapped(x)._keras_mask), expected_mask)

    reference = _copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, num_microbatches)
    # what the loss would be without the mask, or as the mean of the micro-batches' means
    wrong = [keras.ops.mean(loss.call(y, reference(x)))]
    if num_microbatches > 1:
        wrong.append(
            sum(
                reference.compute_loss(y=y[a:b], y_pred=reference(x[a:b])) * (b - a) / BATCH
                for a, b in ((0, 3), (3, 6), (6, 8))
            )
        )
    assert all(abs(float(ref_loss) - float(w)) > 1e-4 for w in wrong)  # far above the tolerance of 1e-5
    _assert_gradients_match(model, wrapped, reference, tape, ref_loss, x, y)
    assert_close(wrapped.evaluate(x, y, batch_size=BATCH, verbose=0), float(ref_loss))

    wrapped = wrap(model, plan, validate=False, schedule=schedule)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    reference = _copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, num_microbatches)
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)


def test_masked_output_with_sample_weights_matches_original(virtual_devices) -> None:
    """Keras multiplies the sample weights by the mask and still divides by the valid steps: so does the step."""
    keras.utils.set_random_seed(0)
    model = _tagger()
    x, y = _padded_tokens(BATCH)
    weights = np.linspace(0.5, 2.0, BATCH * 6).reshape(BATCH, 6).astype("float32")  # one per step, as Keras takes
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 3), validate=False, schedule="1f1b")
    reference = _copy(model)
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(True))
    expected = reference.train_on_batch(x, y, sample_weight=weights)
    assert_close(wrapped.train_on_batch(x, y, sample_weight=weights), expected)
    for after, want in zip(wrapped.unwrap().get_weights(), reference.get_weights(), strict=True):
        assert_close(after, want)


def test_masked_output_with_a_sum_reduction_is_refused(virtual_devices) -> None:
    model = _tagger()
    x, y = _padded_tokens(BATCH)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 3), validate=False)
    wrapped.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True, reduction="sum"))
    with pytest.raises(pt.InputError, match=r"reduction='sum'.*Expected one of \('sum_over_batch_size', 'mean'\)"):
        wrapped.train_on_batch(x, y)


def test_masked_output_beside_an_unmasked_one_is_refused(virtual_devices) -> None:
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(keras.layers.Embedding(12, 8, mask_zero=True)(tokens))
    pooled = keras.layers.GlobalAveragePooling1D(name="pooled")(h)  # reads the mask, returns none
    model = keras.Model(tokens, [keras.layers.Dense(5, name="tags")(h), keras.layers.Dense(2, name="label")(pooled)])
    with pytest.raises(ProfileError, match=r"masked output\(s\) \['tags'\] among the outputs \['tags', 'label'\]"):
        wrap(model, _plan(model, virtual_devices, 2, 1), validate=False)


def test_masked_output_with_layer_losses_is_refused(virtual_devices) -> None:
    """The valid-steps correction scales the summed gradients; a layer loss's gradients are in the same sums."""
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 8, mask_zero=True)(tokens)
    h = keras.layers.LSTM(8, return_sequences=True, activity_regularizer="l2", name="lstm")(h)
    model = keras.Model(tokens, keras.layers.Dense(5, name="tags")(h))
    x, y = _padded_tokens(BATCH)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 2), validate=False)
    wrapped.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    with pytest.raises(pt.InputError, match=r"carries a Keras mask and its layers add losses.*Expected one of the two"):
        wrapped.train_on_batch(x, y)


def _saturated_heads() -> keras.Model:
    """Three heads on one trunk: softmax, sigmoid and linear, fed large inputs, so probabilities saturate (Keras'
    cross-entropies take the logits behind a softmax or sigmoid, not the probabilities clipped to 1e-7)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="trunk")(inputs)
    h = keras.layers.Dense(16, activation="relu", name="middle")(h)
    outputs = {
        "classes": keras.layers.Dense(5, activation="softmax", name="classes")(h),
        "flags": keras.layers.Dense(2, activation="sigmoid", name="flags")(h),
        "value": keras.layers.Dense(1, name="value")(h),
    }
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize(
    ("num_microbatches", "schedule", "early"), [(1, "gpipe", False), (2, "1f1b", False), (4, "gpipe", True)]
)
def test_saturated_softmax_and_sigmoid_outputs_take_the_loss_from_their_logits(
    num_microbatches: int, schedule: str, early: bool, virtual_devices
) -> None:
    """Found by probing (stop 37): the last stage returned the probabilities without the logits Keras keeps on
    them, so the wrapped model's cross-entropy took clipped probabilities: 11.53 against Keras' 23.47, gradients
    off by 9.9 of 12.4, and evaluate likewise, at every M. The loss, evaluate and weights after two SGD steps;
    ``early``: the softmax head on the first stage (its activation moves to the last, ``rebuild``)."""
    model, reference = _saturated_heads(), _saturated_heads()
    rng = np.random.default_rng(0)
    x = 30 * rng.normal(size=(BATCH, 6)).astype("float32")
    y = {
        "classes": rng.integers(0, 5, BATCH),
        "flags": rng.integers(0, 2, (BATCH, 2)).astype("float32"),
        "value": rng.normal(size=(BATCH, 1)).astype("float32"),
    }
    wrapped = plan_and_wrap(
        model, virtual_devices[:2], batch_size=BATCH, num_microbatches=num_microbatches, memory="1GiB",
        pins={
            "trunk": virtual_devices[0],
            "classes": virtual_devices[0 if early else 1],
            **{head: virtual_devices[1] for head in ("flags", "value")},
        },
        schedule=schedule,
    )  # fmt: skip
    assert wrapped.plan.num_stages == 2
    assert early == ("classes_activation" in [layer.name for layer in wrapped.staged.layers])  # on the last stage
    losses = {"classes": "sparse_categorical_crossentropy", "flags": "binary_crossentropy", "value": "mse"}
    for m in (reference, wrapped):
        m.compile(
            optimizer=keras.optimizers.SGD(0.01), loss=losses, metrics={"classes": ["sparse_categorical_crossentropy"]}
        )
    expected = reference.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    probabilities = reference.predict(x, batch_size=BATCH, verbose=0)["classes"][np.arange(BATCH), y["classes"]]
    clipped = float(np.mean(-np.log(np.clip(probabilities, 1e-7, 1.0))))  # the loss from clipped probabilities
    assert expected["classes_loss"] > clipped + 1.0  # saturated: the logits' loss is far above it
    actual = wrapped.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    for key, value in expected.items():
        assert_close(np.float32(actual[key]), np.float32(value))
    for _ in range(2):
        assert_close(np.asarray(wrapped.train_on_batch(x, y)), np.asarray(reference.train_on_batch(x, y)))
    for expected_weight, actual_weight in zip(reference.get_weights(), wrapped.unwrap().get_weights(), strict=True):
        assert_close(actual_weight, expected_weight)


def test_a_softmax_output_computed_before_the_last_stage_is_refused_where_a_loss_is_taken(virtual_devices) -> None:
    """A softmax inside a layer (here a Lambda) on a stage before the last: its logits do not reach the last
    stage, which takes the loss (a layer's own softmax activation is moved there instead): fit and evaluate
    refuse it in one line that says to pin it to the last stage; predict, which takes no loss, runs."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, name="trunk")(inputs)
    scores = keras.layers.Lambda(lambda t: keras.ops.softmax(t), name="scores")(keras.layers.Dense(3, name="pre")(h))
    value = keras.layers.Dense(1, name="value")(keras.layers.Dense(8, name="more")(h))
    model = keras.Model(inputs, {"scores": scores, "value": value})
    wrapped = plan_and_wrap(
        model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB",
        pins={"trunk": virtual_devices[0], "scores": virtual_devices[0], "more": virtual_devices[1]},
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = {"scores": np.zeros(BATCH), "value": np.zeros((BATCH, 1))}
    wrapped.compile(optimizer="sgd", loss={"scores": "sparse_categorical_crossentropy", "value": "mse"})
    expected = (
        r"^Model output 'scores' is a softmax's or sigmoid's output computed on stage 0, before the last: .*pin it "
        r"there \(pins=\{'scores': <the last stage's device>\}\)"
    )
    for run in (wrapped.train_on_batch, wrapped.test_on_batch):
        with pytest.raises(InputError, match=expected):
            run(x, y)
    predicted = wrapped.predict(x, batch_size=BATCH, verbose=0)
    assert_close(predicted["scores"], np.asarray(model(x)["scores"]))
