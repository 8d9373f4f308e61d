"""keras-hub models through plan_and_wrap: a backbone and two task models built with preprocessor=None.

Each is planned for 16 tokens on 2 virtual devices and compared with the original: outputs at 16
and 8 tokens, predict, the loss and every weight after one SGD step, then fit at both lengths,
save to .keras, load, and unwrap into the user's own class. Dropout is 0 so that one step is
deterministic across micro-batches.
"""

from __future__ import annotations

import keras
import keras_hub  # make test installs it: a missing import fails here, never skips silently
import numpy as np
import pytest
import tensorflow as tf
from test_transparency import _assert_step_matches, assert_close

from partitioner.errors import InfeasiblePlanError, ProfileError
from runtime import placement_report, plan_and_wrap
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


MODELS = {"gpt2_backbone": gpt2_backbone, "gpt2_causal_lm": gpt2_causal_lm, "bert_classifier": bert_classifier}
# Pins that make the plan use both devices (the models are too small for the planner to want two).
PINS = {
    "gpt2_backbone": {"token_embedding": 0, "layer_norm": 1},
    "gpt2_causal_lm": {},  # the tied embedding computes the first and the last layer: one stage (see below)
    "bert_classifier": {"token_embedding": 0, "logits": 1},
}


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
    if name == "gpt2_causal_lm":  # logits reuse the token embedding: both calls on one device, so one stage
        assert plan.assignment["token_embedding"] == plan.assignment["token_embedding:1"]
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


def test_keras_hub_layers_that_cannot_rebuild_are_refused_in_one_line(virtual_devices) -> None:
    """keras-hub 0.32's Llama decoder block names an attribute its __init__ never sets in get_config
    (clone_model fails too): refused before any weight moves, saying whose bug and what to do."""
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=8, intermediate_dim=16
    )
    before = [w.copy() for w in backbone.get_weights()]
    with pytest.raises(
        ProfileError, match=r"Cannot copy 'transformer_layer_0' .* is keras_hub's own, .* train it unwrapped"
    ):
        plan_and_wrap(backbone, devices=virtual_devices[:2], batch_size=4, num_microbatches=2, sequence_length=8)
    assert all(np.array_equal(a, b) for a, b in zip(before, backbone.get_weights(), strict=True))
