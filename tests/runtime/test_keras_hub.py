"""keras-hub models through plan_and_wrap: a backbone and two task models built with preprocessor=None.

Each is planned for 16 tokens on 2 virtual devices and compared with the original: outputs at 16
and 8 tokens, predict, the loss and every weight after one SGD step, then fit at both lengths,
save to .keras, load, and unwrap into the user's own class. Dropout is 0 so that one step is
deterministic across micro-batches. Llama, Qwen3 and GPT-NeoX backbones and a ViT classifier, whose blocks
do not rebuild from their own config, are rebuilt from their backbone's config and compared the same way
(outputs, loss, gradients, one SGD step, two Adam steps), pinned to cut between two such blocks.
"""

from __future__ import annotations

import keras
import keras_hub  # make test installs it: a missing import fails here, never skips silently
import numpy as np
import pytest
import tensorflow as tf
from test_transparency import _assert_gradients_match, _assert_step_matches, assert_close

from partitioner.errors import InfeasiblePlanError, InputError, ProfileError
from runtime import placement_report, plan_and_wrap
from runtime.devices import canonical
from runtime.rebuild import seed_states
from runtime.supported import check_rows, check_steps

BATCH = 8
LENGTH = 16  # the length planned for
VOCABULARY = 500
SIZES = {"vocabulary_size": VOCABULARY, "num_layers": 2, "num_heads": 2, "hidden_dim": 32, "intermediate_dim": 64}


def gpt2_backbone():
    backbone = keras_hub.models.GPT2Backbone(**SIZES, max_sequence_length=32, dropout=0.0)
    return backbone, "mse", lambda x, rng: rng.normal(size=(*x["token_ids"].shape, 32)).astype("float32")


def gpt2_causal_lm():
    backbone, _, _ = gpt2_backbone()
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, lambda x, rng: np.roll(x["token_ids"], -1, axis=1)  # the next token


def bert_classifier():
    backbone = keras_hub.models.BertBackbone(**SIZES, max_sequence_length=32, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, lambda x, rng: rng.integers(0, 3, BATCH)


def bert_masked_lm():
    """The MaskedLMHead holds the backbone's token embedding (a weight tied between two layers)."""
    backbone = keras_hub.models.BertBackbone(**SIZES, max_sequence_length=32, dropout=0.0)
    model = keras_hub.models.BertMaskedLM(backbone=backbone, preprocessor=None)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, lambda x, rng: rng.integers(0, VOCABULARY, x["mask_positions"].shape)


MODELS = {
    "gpt2_backbone": gpt2_backbone,
    "gpt2_causal_lm": gpt2_causal_lm,
    "bert_classifier": bert_classifier,
    "bert_masked_lm": bert_masked_lm,
}
# Pins that make the plan use both devices (the models are too small for the planner to want two).
PINS = {
    "gpt2_backbone": {"token_embedding": 0, "layer_norm": 1},
    "gpt2_causal_lm": {},  # the tied embedding computes the first and the last layer: one stage (see below)
    "bert_classifier": {"token_embedding": 0, "logits": 1},
    "bert_masked_lm": {},  # likewise: the head holds the token embedding
}
# The calls that hold one weight, so one device (and so one stage: they are the first and last layers).
TIED = {"gpt2_causal_lm": ("token_embedding", "token_embedding:1"), "bert_masked_lm": ("token_embedding", "mlm_head")}


def _batch(model, make_targets, length: int, seed: int):
    """Token ids padded at the end (a different length per row) and the inputs' padding masks."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(1, VOCABULARY, (BATCH, length)).astype("int32")
    mask = np.ones((BATCH, length), "int32")
    for row in range(BATCH):
        mask[row, length - row % 4 :] = 0
    x = {"token_ids": token_ids * mask, "padding_mask": mask}
    if "segment_ids" in [t.name for t in model.inputs]:
        x["segment_ids"] = np.zeros((BATCH, length), "int32")
    if "mask_positions" in [t.name for t in model.inputs]:
        x["mask_positions"] = rng.integers(0, length, (BATCH, 3)).astype("int32")
    return x, make_targets(x, rng)


def _same_class_copy(model):
    copy = type(model).from_config(model.get_config())
    copy.set_weights(model.get_weights())
    return copy


# keras-hub task models override compile(), so load_model warns and leaves them uncompiled (the same
# for a plain GPT2CausalLM saved and loaded without this library).
@pytest.mark.filterwarnings("ignore:`compile\\(\\)` was not called as part of model loading:UserWarning")
@pytest.mark.slow  # 17-20 s each on 2 cores; make test-slow runs them
@pytest.mark.parametrize("name", list(MODELS))
def test_keras_hub_model_trains_like_the_original(name: str, virtual_devices, tmp_path) -> None:
    keras.utils.set_random_seed(0)
    model, loss, make_targets = MODELS[name]()
    pins = {node: virtual_devices[d] for node, d in PINS[name].items()}
    wrapped = plan_and_wrap(
        model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB", pins=pins,
        sequence_length=LENGTH,
    )  # fmt: skip
    plan = wrapped.plan
    if name in TIED:  # the logits use the token embedding's table: both calls on one device, so one stage
        first, last = TIED[name]
        assert plan.assignment[first] == plan.assignment[last]
        assert plan.num_stages == 1
    else:
        assert plan.num_stages == 2
    report = placement_report(wrapped)
    assert report.ok, report.misplaced

    # The same outputs at the planned length and at another one.
    batches = {n: _batch(model, make_targets, n, seed=n) for n in (LENGTH, 8)}
    for x, _ in batches.values():
        expected = np.asarray(model(x, training=False))
        assert_close(np.asarray(wrapped(x, training=False)), expected)
        assert_close(wrapped.predict(x, batch_size=BATCH, verbose=0), expected)

    # The loss and every weight after one step.
    x, y = batches[LENGTH]
    reference = _same_class_copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape() as tape:
        ref_loss = reference.compute_loss(x=x, y=y, y_pred=reference(x, training=True), training=True)
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)

    # fit at both lengths, then save, load and unwrap into the user's class.
    for x, y in batches.values():
        assert np.isfinite(wrapped.fit(x, y, batch_size=BATCH, verbose=0).history["loss"][0])
    x, _ = batches[8]
    trained = np.asarray(wrapped(x, training=False))
    plain = wrapped.unwrap()
    assert type(plain) is type(model)
    assert_close(np.asarray(plain(x, training=False)), trained)
    wrapped.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded) is type(model)
    assert_close(np.asarray(loaded(x, training=False)), trained)


@pytest.mark.parametrize("name", list(MODELS))
def test_keras_hub_models_pass_the_wrap_checks(name: str) -> None:
    """Their classes override compile and the front doors (fit, predict, ...), no step; their rows are
    independent (runtime.supported)."""
    model, _, _ = MODELS[name]()
    check_steps(model)
    check_rows(model, 2, sequence_length=LENGTH)


def test_keras_hub_backbone_without_a_length_says_how_to_give_one(virtual_devices) -> None:
    backbone, _, _ = gpt2_backbone()
    with pytest.raises(ProfileError, match=r"\(None, None\).*pass the shape to plan for: sequence_length=128"):
        plan_and_wrap(backbone, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB")


def test_keras_hub_task_with_a_preprocessor_is_refused(virtual_devices) -> None:
    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "Ġ": 3, "ab": 4}
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["a b"])
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=tokenizer, sequence_length=8)
    backbone, _, _ = gpt2_backbone()
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    message = (
        r"Model 'gpt2_causal_lm\w*' \(GPT2CausalLM\) has a preprocessor \(GPT2CausalLMPreprocessor\).*"
        r"Build it with preprocessor=None.*preprocess in the data pipeline"
    )
    with pytest.raises(ProfileError, match=message):
        plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, sequence_length=LENGTH)


def test_keras_hub_tied_embedding_cannot_be_split_by_pins(virtual_devices) -> None:
    """GPT2CausalLM's logits reuse the token embedding: pins that split it are refused with the reason."""
    model, _, _ = gpt2_causal_lm()
    pins = {"token_embedding": virtual_devices[0], "layer_norm": virtual_devices[1]}
    message = (
        r"Pins split shared layer 'token_embedding': its calls \['token_embedding', 'token_embedding:1'\] share "
        r"weights.*'token_embedding' is pinned to /device:CPU:0 and 'layer_norm' to /device:CPU:1"
    )
    with pytest.raises(InfeasiblePlanError, match=message):
        plan_and_wrap(
            model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB", pins=pins,
            sequence_length=LENGTH,
        )  # fmt: skip


def test_compile_of_a_wrapped_keras_hub_task_takes_the_tasks_defaults(virtual_devices) -> None:
    """``wrapped.compile()`` gets what the task's own compile gives Keras' (Adam(5e-5), its loss and accuracy);
    it took Keras' defaults before (RMSprop, no loss; found by probing, stop 36). The original's compile state
    stays its own (keras-hub compiles a task when it is made)."""
    model, _, _ = bert_classifier()
    model.compile(optimizer="sgd")
    optimizer = model.optimizer
    wrapped = plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, sequence_length=LENGTH)
    reference, _, _ = bert_classifier()
    reference.compile()
    wrapped.compile()
    assert model.optimizer is optimizer
    assert type(wrapped.optimizer) is type(reference.optimizer) is keras.optimizers.Adam
    assert float(wrapped.optimizer.learning_rate) == pytest.approx(5e-5)
    assert wrapped.get_compile_config()["loss"] == reference.get_compile_config()["loss"]
    assert wrapped.get_compile_config()["metrics"] == reference.get_compile_config()["metrics"]
    wrapped.compile(optimizer=keras.optimizers.SGD(0.5))  # the task fills in the rest
    assert type(wrapped.optimizer) is keras.optimizers.SGD
    assert wrapped.get_compile_config()["loss"] == reference.get_compile_config()["loss"]


def test_generate_on_the_wrapped_model_says_to_unwrap(virtual_devices) -> None:
    """It was a bare AttributeError (found by probing, stop 36); generation runs on ``unwrap()``."""
    model, _, _ = gpt2_causal_lm()
    wrapped = plan_and_wrap(model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, sequence_length=LENGTH)
    with pytest.raises(
        InputError, match=r"generation is not pipelined.*wrapped\.unwrap\(\)\.generate\(\.\.\.\) \(a GPT2CausalLM\)"
    ):
        wrapped.generate({"token_ids": np.ones((1, 4), "int32"), "padding_mask": np.ones((1, 4), bool)})


def test_mixture_of_experts_router_loss_is_refused_at_wrap_or_taken_per_microbatch(virtual_devices) -> None:
    """Mixtral's load-balancing loss (add_loss in training) is a batch-wide value: refused at the first step
    before stop 38, now at wrap; ``added_losses="per_microbatch"`` takes each micro-batch's, as pipelines do."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=50, num_layers=2, num_query_heads=2, hidden_dim=16, intermediate_dim=32,
        num_key_value_heads=1, num_experts=4, top_k=2,
    )  # fmt: skip
    model = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 50, (BATCH, 6)).astype("int32"), "padding_mask": np.ones((BATCH, 6), "int32")}
    y = rng.integers(1, 50, (BATCH, 6)).astype("int32")
    options = {"batch_size": BATCH, "num_microbatches": 2, "sequence_length": 6}
    with pytest.raises(InputError, match=r"'transformer_layer_0' \(MixtralTransformerDecoder\) .* in a training step"):
        plan_and_wrap(model, virtual_devices[:2], **options)
    wrapped = plan_and_wrap(model, virtual_devices[:2], added_losses="per_microbatch", **options)
    assert wrapped.options.loss_kinds == {"transformer_layer_0": "batch", "transformer_layer_1": "batch"}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = []  # each half's loss and router losses, as the original computes them on that half alone
    for rows in (slice(0, 4), slice(4, 8)):
        logits = model({k: v[rows] for k, v in x.items()}, training=True)
        expected.append(float(loss(y[rows], logits)) + sum(float(v) for v in model.losses))
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    assert wrapped.train_on_batch(x, y)[0] == pytest.approx(np.mean(expected), rel=1e-5)


@pytest.mark.slow  # 12 s on 2 cores; make test-slow runs it
def test_keras_hub_masked_lm_trains_its_tied_table_as_the_original(virtual_devices) -> None:
    """BertMaskedLM's MaskedLMHead holds the backbone's token embedding (a layer inside another, not a layer
    called twice): rebuilt from its config the head had a copy of its own, and the wrapped model trained the table
    to other numbers at every M, on one device too (probing, stop 36: 0.69 of the original's update; refused
    since, until stop 37). Now the head's clone holds the embedding's clone: two Adam steps at M = 2 match."""
    keras.utils.set_random_seed(0)
    model, loss, make_targets = bert_masked_lm()
    reference = _same_class_copy(model)
    wrapped = plan_and_wrap(
        model, virtual_devices[:2], batch_size=BATCH, num_microbatches=2, memory="1GiB", sequence_length=LENGTH
    )
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    for seed in (1, 2):
        x, y = _batch(model, make_targets, LENGTH, seed)
        assert_close(np.asarray(wrapped.train_on_batch(x, y)), np.asarray(reference.train_on_batch(x, y)))
    plain = wrapped.unwrap()
    for expected, actual in zip(reference.weights, plain.weights, strict=True):
        assert_close(np.asarray(actual), np.asarray(expected))
    assert plain.get_layer("mlm_head").token_embedding is plain.backbone.token_embedding


# keras-hub 0.32 models whose blocks do not rebuild from their own config: rebuilt from the backbone's config
# (runtime/backbones.py). Pins cut between two such blocks where there are two (ViT has one).
def llama_backbone():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32,
    )  # fmt: skip


def qwen3_backbone():
    return keras_hub.models.Qwen3Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=2, num_key_value_heads=1, head_dim=8,
        hidden_dim=16, intermediate_dim=32,
    )  # fmt: skip


def gpt_neox_backbone(dropout: float = 0.0):
    return keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=32, dropout=dropout,
    )  # fmt: skip


def vit_classifier():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    )
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)


DECODER_PINS = {"transformer_layer_0": 0, "transformer_layer_1": 1}
REBUILT = {  # name: (model, pins by device index, loss)
    "llama_backbone": (llama_backbone, DECODER_PINS, "mse"),
    "qwen3_backbone": (qwen3_backbone, DECODER_PINS, "mse"),
    "gpt_neox_backbone": (gpt_neox_backbone, DECODER_PINS, "mse"),
    "vit_classifier": (
        vit_classifier,
        {"vit_patching_and_embedding": 0, "vit_encoder": 1},
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ),
}


def _rebuilt_batch(model, seed: int):
    rng = np.random.default_rng(seed)
    if model.inputs[0].name == "images":
        return rng.normal(size=(BATCH, 16, 16, 3)).astype("float32"), rng.integers(0, 3, BATCH)
    x, _ = _batch(model, lambda x, rng: None, 8, seed)
    return x, rng.normal(size=(BATCH, 8, 16)).astype("float32")


def _cannot_rebuild(model) -> list[str]:
    """The layers of the model's backbone that from_config(get_config()) cannot copy."""
    backbone = model if isinstance(model, keras_hub.models.Backbone) else model.backbone
    failing = []
    for layer in backbone.layers:
        try:
            type(layer).from_config(layer.get_config())
        except Exception:
            failing.append(layer.name)
    return failing


def _wrap_rebuilt(name: str, devices: list[str]):
    """(original, wrapped at M = 2 on ``devices`` with a pinned cut, loss); the model is of the case asked for."""
    keras.utils.set_random_seed(0)
    make, pin_indices, loss = REBUILT[name]
    model = make()
    assert _cannot_rebuild(model)  # the case this tests: keras-hub 0.32's blocks fail from_config
    pins = {node: devices[d] for node, d in pin_indices.items()}
    wrapped = plan_and_wrap(
        model, devices, batch_size=BATCH, num_microbatches=2, memory="1GiB", pins=pins, sequence_length=8
    )
    assert wrapped.plan.num_stages == 2
    return model, wrapped, loss


@pytest.mark.slow  # 15-25 s each on 2 cores
@pytest.mark.parametrize("name", list(REBUILT))
def test_keras_hub_model_whose_blocks_cannot_rebuild_trains_like_the_original(name: str, virtual_devices) -> None:
    """Rebuilt from its backbone's config, every variable on its planned device (devices 1 and 2, so that
    nothing lands on the default device unnoticed): the same outputs, loss and gradients, and the same
    weights after one SGD step, as the original at M = 2."""
    devices = virtual_devices[1:3]
    model, wrapped, loss = _wrap_rebuilt(name, devices)
    report = placement_report(wrapped)
    assert report.ok, report.misplaced
    assert {d for devs in report.variable_devices.values() for d in devs} == set(devices)
    x, y = _rebuilt_batch(model, seed=1)
    assert_close(np.asarray(wrapped(x, training=False)), np.asarray(model(x, training=False)))

    reference = _same_class_copy(model)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    with tf.GradientTape(persistent=True) as tape:
        ref_loss = reference.compute_loss(x=x, y=y, y_pred=reference(x, training=True), training=True)
    _assert_gradients_match(model, wrapped, reference, tape, ref_loss, x, y)
    _assert_step_matches(wrapped, reference, tape, ref_loss, x, y)


# ViT's position embedding looks up the same ids for every sample: its rows are summed over the micro-batches
# (runtime.train_step._batch_rows), as the original's batch gives them (before: off by ~7e-3 under Adam)
ADAM_CASES = list(REBUILT)


@pytest.mark.slow  # 15-25 s each on 2 cores
@pytest.mark.parametrize("name", ADAM_CASES)
def test_keras_hub_model_whose_blocks_cannot_rebuild_trains_with_adam_like_the_original(
    name: str, virtual_devices
) -> None:
    """Two Adam steps of train_on_batch, against the original's: the same losses and every weight after.
    epsilon=1e-3 as in tests/runtime/test_fuzz.py: an attention key bias has a zero true gradient, and Adam with
    epsilon 1e-7 moves it by +-lr on float32 rounding noise (1e-4 apart after one step)."""
    model, wrapped, loss = _wrap_rebuilt(name, virtual_devices[1:3])
    reference = _same_class_copy(model)
    for m in (reference, wrapped):
        m.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-3), loss=loss)
    for seed in (2, 3):
        x, y = _rebuilt_batch(model, seed)
        assert_close(wrapped.train_on_batch(x, y), reference.train_on_batch(x, y))
    after, expected = wrapped.unwrap().get_weights(), reference.get_weights()
    assert len(after) == len(expected) == len(model.weights)
    for actual, value in zip(after, expected, strict=True):
        assert_close(actual, value)


def test_keras_hub_rebuilt_backbone_places_seed_states(virtual_devices) -> None:
    """GPT-NeoX's embeddings dropout makes its seed state in the backbone's __init__, where no layer builds:
    that layer is copied from its own config instead, so every seed state is on its planned device too."""
    model = gpt_neox_backbone(dropout=0.1)
    devices = virtual_devices[1:3]
    pins = {"embeddings_dropout": devices[0], "transformer_layer_1": devices[1]}
    wrapped = plan_and_wrap(
        model, devices, batch_size=BATCH, num_microbatches=2, memory="1GiB", pins=pins, sequence_length=8
    )
    assert wrapped.plan.num_stages == 2
    rebuilt = wrapped._state.rebuilt
    seeds = {
        original.name: (canonical(state.value.device), canonical(rebuilt.device_of[id(clone)]))
        for original, clone in rebuilt.origin
        for state in seed_states(clone)
    }
    assert {"embeddings_dropout", "transformer_layer_0", "transformer_layer_1"} <= set(seeds)
    assert all(device == planned for device, planned in seeds.values()), seeds


class _BrokenConfig(keras.layers.Layer):
    """Names in get_config an attribute __init__ never sets (as keras-hub 0.32's Llama block does), and makes
    a Dropout, so its seed state, in __init__: outside its build, where no device is known."""

    def __init__(self, units: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, x, training=None):
        return self.dropout(self.dense(x), training=training)

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units, "scale": self.scale}


class _TinyBackbone(keras_hub.models.Backbone):
    def __init__(self, units: int, **kwargs) -> None:
        inputs = keras.Input((4,), name="features")
        x = keras.layers.Dense(units, name="first")(inputs)
        super().__init__(inputs=inputs, outputs=_BrokenConfig(units, name="broken")(x), **kwargs)
        self.units = units

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units}


def test_keras_hub_backbone_that_cannot_place_a_block_is_refused(virtual_devices) -> None:
    model = _TinyBackbone(8)
    devices = virtual_devices[1:3]
    message = (
        r"Cannot place 'broken' \(_BrokenConfig\) on /device:CPU:2: it does not rebuild from its own config, "
        r"and rebuilding '\w+' from its config made its variable\(s\) \['seed_generator_\d+/seed_generator_state'\] "
        r"outside its build, on /device:CPU:\d\..*pin the layer where they were made "
        r"\(pins=\{'broken': '/device:CPU:\d'\}\), or train the model unwrapped"
    )
    with pytest.raises(ProfileError, match=message):
        plan_and_wrap(
            model, devices, batch_size=BATCH, num_microbatches=2, memory="1GiB",
            pins={"first": devices[0], "broken": devices[1]},
        )  # fmt: skip


def test_keras_hub_block_outside_a_backbone_is_refused_in_one_line(virtual_devices) -> None:
    """A keras-hub block that does not rebuild from its config, in a model that is no keras-hub Backbone
    (nor a task holding one): nothing to rebuild it from, so refused before any weight moves, saying why."""
    backbone = llama_backbone()
    inputs = keras.Input((8, 16), name="hidden")
    model = keras.Model(inputs, backbone.get_layer("transformer_layer_0")(inputs))
    before = [w.copy() for w in model.get_weights()]
    message = (
        r"Cannot copy 'transformer_layer_0' .* is keras_hub's own, .* wraps such a layer only inside a "
        r"keras-hub Backbone.* train it unwrapped"
    )
    with pytest.raises(ProfileError, match=message):
        plan_and_wrap(model, devices=virtual_devices[:2], batch_size=4, num_microbatches=2)
    weights = model.get_weights()
    assert len(weights) == len(before)
    assert all(np.array_equal(a, b) for a, b in zip(before, weights, strict=True))
