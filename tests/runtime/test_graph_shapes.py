"""Graph shapes users bring: nested models called twice, Keras ops, masks, repeated names, wrappers, Lambda.

Each shape is rebuilt and compared with the original in two ways: the flat rebuilt model alone
(fast, every shape, on the shapes' own plans) and the pipelined model through one training step on
2 devices with 2 micro-batches (outputs, predict, loss, every gradient, weights after the step, and
every variable, seed states included, on the device its plan names).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_transparency import _assert_step_matches, _copy, _plan, _reference_loss, _variable_pairs, assert_close

import partitioner as pt
from partitioner.errors import ProfileError
from profiles import profile_model
from runtime import plan_and_wrap, wrap
from runtime.devices import canonical
from runtime.rebuild import rebuild

layers = keras.layers
BATCH = 4
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _floats(*shape: int):
    def make(batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.normal(size=(batch_size, *shape)).astype("float32"), rng.integers(0, 3, batch_size)

    return make


def _pair(shape: tuple[int, ...]):
    def make(batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        x = [rng.normal(size=(batch_size, *shape)).astype("float32") for _ in range(2)]
        return x, rng.normal(size=(batch_size, 3)).astype("float32")

    return make


def _tokens(length: int, vocabulary: int):
    def make(batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        x = rng.integers(1, vocabulary, (batch_size, length))
        for row in range(batch_size):  # padding at the end, a different length per row
            x[row, length - row % length :] = 0
        return x, rng.integers(0, 3, batch_size)

    return make


# --- the shapes ------------------------------------------------------------------------------------


def siamese():
    """A nested Sequential called on two inputs (the Siamese towers of issue 10)."""
    tower = keras.Sequential([keras.Input((4,)), layers.Dense(3)], name="tower")
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    return keras.Model([a, b], layers.Subtract()([tower(a), tower(b)])), _pair((4,)), "mse"


def siamese_lazy():
    """A Sequential without keras.Input, built by its first call, then called again."""
    tower = keras.Sequential([layers.Dense(5, activation="tanh"), layers.Dense(3)], name="tower")
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    joined = layers.Concatenate()([tower(a), tower(b)])
    return keras.Model([a, b], layers.Dense(3)(joined)), _pair((4,)), "mse"


def nested_in_nested():
    """A tower called twice inside a block, the block called twice: four calls of each inner layer."""
    tower = keras.Sequential([keras.Input((4,)), layers.Dense(4, activation="tanh")], name="tower")
    x = keras.Input((4,))
    block = keras.Model(x, layers.Add()([tower(x), tower(layers.Dense(4)(x))]), name="block")
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    outputs = layers.Dense(3)(layers.Concatenate()([block(a), block(b)]))
    return keras.Model([a, b], outputs), _pair((4,)), "mse"


def nested_two_consumers():
    """A nested model's output read by two layers and also returned."""
    inner = keras.Sequential([keras.Input((6,)), layers.Dense(4, activation="relu")], name="inner")
    x = keras.Input((6,))
    h = inner(x)
    joined = layers.Concatenate()([layers.Dense(3)(h), layers.Dense(3, activation="tanh")(h)])
    model = keras.Model(x, [layers.Dense(3)(joined), layers.Dense(2)(h)])

    def make(batch_size: int, seed: int):
        rng = np.random.default_rng(seed)
        return rng.normal(size=(batch_size, 6)).astype("float32"), [
            rng.integers(0, 3, batch_size),
            rng.normal(size=(batch_size, 2)).astype("float32"),
        ]

    return model, make, [SCCE, "mse"]


def multi_output_nested():
    """A nested model with two inputs and two outputs, called twice, its outputs crossed."""
    p, q = keras.Input((4,)), keras.Input((4,))
    h = layers.Dense(4, activation="tanh")(layers.Concatenate()([p, q]))
    inner = keras.Model([p, q], [layers.Dense(3)(h), layers.Dense(2)(h)], name="two_heads")
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    first, second = inner([a, b]), inner([b, a])
    joined = layers.Concatenate()([first[0], second[1], second[0], first[1]])
    return keras.Model([a, b], layers.Dense(3)(joined)), _pair((4,)), "mse"


def shared_across_levels():
    """One Dense called at the top level and inside a nested model called twice."""
    shared = layers.Dense(4, activation="tanh", name="shared")
    inner = keras.Sequential([keras.Input((4,)), shared, layers.Dense(4)], name="inner")
    x = keras.Input((4,))
    h = inner(shared(x))
    return keras.Model(x, layers.Dense(3)(inner(h))), _floats(4), SCCE


def frozen_nested():
    """A frozen nested model (transfer learning) called twice, a trainable head after it."""
    base = keras.Sequential([keras.Input((4,)), layers.Dense(4, activation="tanh")], name="base")
    base.trainable = False
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    return keras.Model([a, b], layers.Dense(3)(layers.Concatenate()([base(a), base(b)]))), _pair((4,)), "mse"


def keras_ops():
    """Tensor arithmetic and keras.ops calls between layers (each one an op node of the graph)."""
    x = keras.Input((6,))
    h = layers.Dense(8)(x) * 2.0
    h = keras.ops.add(h, keras.ops.ones_like(h))
    left, right = keras.ops.split(h, 2, axis=-1)  # one op node, two outputs
    h = keras.ops.concatenate([h[:, :2] + right[:, 2:], keras.ops.tanh(left), h[:, 6:]], axis=-1)
    h = keras.ops.reshape(h, (-1, 2, 4))
    h = keras.ops.sum(keras.ops.transpose(h, (0, 2, 1)), axis=-1)
    return keras.Model(x, layers.Dense(3)(h - keras.ops.mean(h, axis=-1, keepdims=True))), _floats(6), SCCE


def position_embedding():
    """Token plus position embeddings, added as ``tok + pos`` (positions computed from the input)."""
    tokens = keras.Input((6,), dtype="int32")
    positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1
    h = layers.Embedding(10, 4)(tokens) + layers.Embedding(6, 4)(positions)
    h = layers.GlobalAveragePooling1D()(layers.Dense(4, activation="relu")(h))
    return keras.Model(tokens, layers.Dense(3)(h)), _tokens(6, 10), SCCE


def embedding_mask():
    """Embedding(mask_zero=True): the mask (a NotEqual op node) is read by a pooling two layers later."""
    tokens = keras.Input((5,), dtype="int32")
    h = layers.Embedding(10, 4, mask_zero=True)(tokens)
    h = layers.Dense(4, activation="tanh")(h)
    h = layers.Dense(4)(h)
    h = layers.GlobalAveragePooling1D(name="reader")(h)
    return keras.Model(tokens, layers.Dense(3)(h)), _tokens(5, 10), SCCE


def embedding_mask_lstm():
    """Embedding(mask_zero=True) and an LSTM that reads the mask."""
    tokens = keras.Input((5,), dtype="int32")
    h = layers.Dense(4)(layers.Embedding(10, 4, mask_zero=True)(tokens))
    return keras.Model(tokens, layers.Dense(3)(layers.LSTM(3, name="reader")(h))), _tokens(5, 10), SCCE


def nested_mask():
    """A nested encoder's output carries its Embedding's mask only at run time (not symbolically);
    the pooling after it must still skip the padding."""
    t = keras.Input((5,), dtype="int32")
    encoder = keras.Model(t, layers.Dense(4)(layers.Embedding(10, 4, mask_zero=True)(t)), name="encoder")
    tokens = keras.Input((5,), dtype="int32")
    h = layers.GlobalAveragePooling1D(name="reader")(layers.Dense(4)(encoder(tokens)))
    return keras.Model(tokens, layers.Dense(3)(h)), _tokens(5, 10), SCCE


def attention_mask():
    """MultiHeadAttention reads its query's mask from the tensor itself, not from an argument."""
    tokens = keras.Input((5,), dtype="int32")
    h = layers.Dense(4)(layers.Embedding(10, 4, mask_zero=True)(tokens))
    h = layers.MultiHeadAttention(2, 2, name="reader")(h, h)
    return keras.Model(tokens, layers.Dense(3)(layers.GlobalAveragePooling1D()(h))), _tokens(5, 10), SCCE


def merge_mask():
    """Merge layers (Multiply, Add) read their inputs' masks from the tensors and change values by them."""
    tokens = keras.Input((5,), dtype="int32")
    e = layers.Embedding(10, 4, mask_zero=True)(tokens)
    h = layers.Multiply(name="reader")([layers.Dense(4)(e), layers.Dense(4, activation="tanh")(e)])
    h = layers.Add()([h, e])
    return keras.Model(tokens, layers.Dense(3)(keras.ops.mean(h, axis=1))), _tokens(5, 10), SCCE  # padding counts


def masking():
    """Masking: all-zero time steps skipped by a GRU on a later stage."""
    x = keras.Input((5, 3))
    h = layers.Dense(3, activation="tanh")(layers.Masking()(x))
    h = layers.Dense(3)(h)

    def make(batch_size: int, seed: int):
        features, labels = _floats(5, 3)(batch_size, seed)
        for row in range(batch_size):
            features[row, 5 - row % 5 :] = 0.0
        return features, labels

    return keras.Model(x, layers.Dense(3)(layers.GRU(3, name="reader")(h))), make, SCCE


def repeated_names():
    """An outer Dense "fc" and a nested Sequential holding its own Dense "fc" (Keras allows it)."""
    inner = keras.Sequential([keras.Input((4,)), layers.Dense(4, name="fc")], name="inner")
    x = keras.Input((4,))
    h = layers.Dense(4, activation="tanh", name="inner_fc")(inner(x))  # also takes the renamed clone's name
    return keras.Model(x, layers.Dense(3, name="fc")(h)), _floats(4), SCCE


class Scale(layers.Layer):
    """A custom layer that creates its weight in __init__, not in build."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.scale = self.add_weight(shape=(units,), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def wrappers():
    """Bidirectional(LSTM) and a layer with weights made in __init__, both planned on the second stage."""
    x = keras.Input((5, 3))
    h = layers.Dense(3)(x)
    h = layers.Bidirectional(layers.LSTM(2), name="bidi")(h)
    return keras.Model(x, layers.Dense(3)(Scale(4, name="scale")(h))), _floats(5, 3), SCCE


class _Apply(keras.Operation):
    """A user's own Keras op whose __init__ takes a function (Keras cannot put it in a config)."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def call(self, x):
        return self.function(x)

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype)


def custom_op():
    """A custom keras.Operation without a config between two layers: reused, not copied."""
    x = keras.Input((4,))
    h = _Apply(lambda t: t + 0.5)(layers.Dense(4)(x))
    return keras.Model(x, layers.Dense(3)(h)), _floats(4), SCCE


def lambda_layer():
    """A Lambda of a Python lambda (its config holds bytecode, which safe mode will not load)."""
    x = keras.Input((4,))
    h = layers.Lambda(lambda t: t * 2.0)(layers.Dense(4)(x))
    return keras.Model(x, layers.Dense(3)(h)), _floats(4), SCCE


SHAPES = {
    f.__name__: f
    for f in (
        siamese,
        siamese_lazy,
        nested_in_nested,
        nested_two_consumers,
        multi_output_nested,
        shared_across_levels,
        frozen_nested,
        keras_ops,
        position_embedding,
        embedding_mask,
        embedding_mask_lstm,
        nested_mask,
        attention_mask,
        merge_mask,
        masking,
        repeated_names,
        wrappers,
        custom_op,
        lambda_layer,
    )
}
STEP = [
    "siamese",
    "nested_in_nested",
    "multi_output_nested",
    "frozen_nested",
    "keras_ops",
    "embedding_mask",
    "nested_mask",
    "merge_mask",
    "masking",
    "wrappers",
]


MASKED = ["embedding_mask", "embedding_mask_lstm", "nested_mask", "attention_mask", "merge_mask", "masking"]


def _assert_mask_crosses(wrapped) -> None:
    """The mask is computed on stage 0 and read on stage 1: a bool boundary tensor."""
    boundary = wrapped.executor.stages[1].inputs
    assert any(t.dtype == "bool" for t in boundary), [t.dtype for t in boundary]


def _split_before_reader(model: keras.Model, devices: list[str], reader: str = "reader") -> pt.Plan:
    """A plan with every node before ``reader`` (a nested model's too: "inner/reader") on the first device
    and the rest on the second, so the mask, computed next to the embedding or masking layer, crosses the
    stage boundary."""
    graph = profile_model(model, batch_size=BATCH, num_microbatches=2, measure_time=False)
    order = list(graph.nodes)
    cut = next(i for i, node in enumerate(order) if node.split("/")[-1] == reader)
    pins = {node: devices[0] if i < cut else devices[1] for i, node in enumerate(order)}
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in devices[:2]])
    plan = pt.solve(graph, cluster, num_microbatches=2, pins=pins)
    pt.validate_plan(plan, graph, cluster)
    return plan


def _assert_same_outputs(model: keras.Model, other, x) -> None:
    keras.tree.map_structure(
        assert_close,
        keras.tree.map_structure(np.asarray, model(x, training=False)),
        keras.tree.map_structure(np.asarray, other(x, training=False)),
    )


# --- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SHAPES))
def test_rebuild_computes_what_the_original_computes(name: str, virtual_devices) -> None:
    """The flat rebuilt model alone, on a plan that cuts it in 4 (the uniform split)."""
    keras.utils.set_random_seed(0)
    model, make_batch, _ = SHAPES[name]()
    x, _ = make_batch(BATCH, 1)
    graph = profile_model(model, batch_size=BATCH, num_microbatches=1, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in virtual_devices])
    plan = pt.baselines.uniform(graph, cluster, num_microbatches=1)
    rebuilt = rebuild(model, {n: canonical(d) for n, d in plan.assignment.items()})
    _assert_same_outputs(model, rebuilt.model, x)
    num_weights = sum(len(clone.weights) for _, clone in rebuilt.origin)
    assert num_weights == len(model.weights)


@pytest.mark.parametrize("name", STEP)
def test_graph_shape_step_matches_original(name: str, virtual_devices) -> None:
    """Outputs, predict, loss, every gradient and the weights after one step on 2 devices, M = 2."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = SHAPES[name]()
    x, y = make_batch(BATCH, 1)
    masked = name in MASKED
    plan = _split_before_reader(model, virtual_devices) if masked else _plan(model, virtual_devices, 2, 2)
    wrapped = wrap(model, plan, validate=False)

    _assert_same_outputs(model, wrapped, x)
    keras.tree.map_structure(
        assert_close,
        keras.tree.map_structure(np.asarray, model(x, training=False)),
        wrapped.predict(x, batch_size=BATCH, verbose=0),
    )
    if masked:
        _assert_mask_crosses(wrapped)

    reference = _copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, 2)
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(ref_loss, reference.trainable_weights)]  # dense
    ref_grads = dict(zip([id(v) for v in reference.trainable_weights], grads, strict=True))
    pipe_loss, pipe_grads = wrapped.loss_and_gradients(x, y)
    assert_close(float(pipe_loss), float(ref_loss))
    index = {id(v): i for i, v in enumerate(model.trainable_weights)}
    clone_grad = {id(v): g for v, g in zip(wrapped.executor.trainable_variables, pipe_grads, strict=True)}
    pairs = [(o, c) for o, c in _variable_pairs(wrapped) if id(o) in index]
    assert len(pairs) == len(model.trainable_weights)
    for original, clone in pairs:
        assert_close(clone_grad[id(clone)], ref_grads[id(reference.trainable_weights[index[id(original)]])])

    wrapped = wrap(model, plan, validate=False)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    reference = _copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape() as tape:
        ref_loss = _reference_loss(reference, x, y, 2)
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)


@pytest.mark.parametrize("name", MASKED)
def test_masks_cross_stages_in_predict(name: str, virtual_devices) -> None:
    """predict runs each stage's function on its own: a mask made on stage 0 reaches stage 1's
    readers, whether they take it as an argument (LSTM, GRU, pooling) or read it from the tensor
    (MultiHeadAttention's query, Multiply, Add)."""
    keras.utils.set_random_seed(0)
    model, make_batch, _ = SHAPES[name]()
    x, _ = make_batch(BATCH, 1)
    wrapped = wrap(model, _split_before_reader(model, virtual_devices), validate=False)
    _assert_mask_crosses(wrapped)
    assert_close(wrapped.predict(x, batch_size=BATCH, verbose=0), np.asarray(model(x, training=False)))


def test_every_variable_lives_on_its_planned_device(virtual_devices) -> None:
    """Bidirectional's inner LSTMs and a layer's __init__ weight, pinned off the default device:
    every variable of every clone (seed generator states included) is on its operation's device."""
    model, _, _ = wrappers()
    default, other = virtual_devices[0], virtual_devices[2]
    pins = {"bidi": other, "scale": other}
    wrapped = plan_and_wrap(model, devices=[default, other], batch_size=BATCH, pins=pins)
    assert wrapped.plan.assignment["bidi"] == wrapped.plan.assignment["scale"] == canonical(other)
    for operation in wrapped.staged._operations:
        for variable in getattr(operation, "variables", []):
            assert canonical(variable.value.device) == canonical(wrapped.device_of(operation)), variable.path
    moved = [v for op in wrapped.staged._operations if op.name in pins for v in op.variables]
    assert len(moved) >= 3 * 2 + 1  # kernel, recurrent kernel and bias per direction, scale (+ seed states)
    assert all(canonical(v.value.device) != canonical(default) for v in moved)


def test_op_without_config_is_reused(virtual_devices) -> None:
    model, make_batch, _ = custom_op()
    (op,) = [op for op in model._operations if isinstance(op, _Apply)]
    with pytest.raises(NotImplementedError):
        op.get_config()
    wrapped = plan_and_wrap(model, devices=virtual_devices[:2], batch_size=BATCH)
    assert op in wrapped.staged._operations
    _assert_same_outputs(model, wrapped, make_batch(BATCH, 1)[0])


def test_lambda_is_wrapped_without_deserializing_it(virtual_devices) -> None:
    model, make_batch, _ = lambda_layer()
    x, _ = make_batch(BATCH, 1)
    wrapped = plan_and_wrap(model, devices=virtual_devices[:2], batch_size=BATCH)
    (clone,) = [op for op in wrapped.staged._operations if isinstance(op, layers.Lambda)]
    (original,) = [op for op in model.layers if isinstance(op, layers.Lambda)]
    assert clone is not original and clone.function is original.function
    _assert_same_outputs(model, wrapped, x)


@pytest.mark.parametrize("nested", [False, True])
def test_masked_output_trains_as_the_original(nested: bool, virtual_devices) -> None:
    """Keras' loss skips the masked steps of an output, and so does the pipelined loss (it was refused:
    1.1117 against 1.1055). No layer reads the mask here, and a nested model's output has no mask
    symbolically but has one at run time: the flat model returns it all the same."""
    tokens = keras.Input((5,), dtype="int32")
    outputs = layers.Dense(3, name="tagger")(layers.Embedding(10, 4, mask_zero=True)(tokens))
    model = keras.Model(tokens, outputs, name="inner")
    if nested:
        outer = keras.Input((5,), dtype="int32")
        model = keras.Model(outer, model(outer))
    x, _ = _tokens(5, 10)(BATCH, 1)
    y = np.random.default_rng(2).integers(0, 3, (BATCH, 5))
    plan = _split_before_reader(model, virtual_devices, reader="tagger")  # the mask crosses to the loss's stage
    assert plan.num_stages == 2
    wrapped = wrap(model, plan)
    _assert_same_outputs(model, wrapped, x)
    reference = _copy(model)
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
    assert_close(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y))
    after, expected = wrapped.unwrap().get_weights(), reference.get_weights()
    assert len(after) == len(expected) == len(model.get_weights())
    for a, e in zip(after, expected, strict=True):
        assert_close(a, e)


class _Opaque(layers.Layer):
    """A layer whose __init__ takes an object its config cannot hold."""

    def __init__(self, table: dict, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, x):
        return x * self.table["factor"]


def test_layer_that_cannot_be_copied_is_named(virtual_devices) -> None:
    x = keras.Input((4,))
    model = keras.Model(x, _Opaque({"factor": np.float32(2.0)}, name="opaque")(layers.Dense(4)(x)))
    with pytest.raises(ProfileError, match=r"Cannot copy 'opaque' \(_Opaque\).*get_config"):
        plan_and_wrap(model, devices=virtual_devices[:2], batch_size=BATCH)


# Graph shapes a .keras file cannot hold: a keras.Operation without a config. A Lambda's bytecode loads
# with safe_mode=False only, as for the plain model.
UNSAVABLE = {"custom_op"}


@pytest.mark.parametrize("name", [n for n in SHAPES if n not in UNSAVABLE])
def test_graph_shape_saves_and_loads_as_the_original(name: str, tmp_path, virtual_devices) -> None:
    """The wrapped model after a training step saves a plain .keras file (the original architecture with
    the trained weights) that loads without this library and computes what the wrapped model does."""
    keras.utils.set_random_seed(0)
    model, make_batch, loss = SHAPES[name]()
    x, y = make_batch(BATCH, 1)
    wrapped = wrap(model, _plan(model, virtual_devices, 2, 2), validate=False)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    wrapped.train_on_batch(x, y)
    path = tmp_path / f"{name}.keras"
    wrapped.save(path)
    custom = {"Scale": Scale}
    loaded = keras.models.load_model(path, custom_objects=custom, safe_mode=name != "lambda_layer")
    assert type(loaded) is type(model)
    _assert_same_outputs(loaded, wrapped, x)
