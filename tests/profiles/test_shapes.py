"""Shapes to plan for: input_shapes= and sequence_length= fix a model's open dimensions for profiling only."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from partitioner.errors import InputError, ProfileError
from profiles import profile_model
from profiles.shapes import input_shapes, parse_input_shape

layers = keras.layers


def _tokens_model() -> keras.Model:
    """Token ids of any length and a (length, 3) feature input: a sequence model of open length."""
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    features = keras.Input((None, 3), name="features")
    hidden = layers.Embedding(50, 8, name="embed")(tokens)
    hidden = layers.Concatenate(name="join")([hidden, layers.Dense(8, name="project")(features)])
    hidden = layers.Dense(8, activation="relu", name="mix")(hidden)
    outputs = layers.Dense(3, name="head")(layers.GlobalAveragePooling1D(name="pool")(hidden))
    return keras.Model([tokens, features], outputs, name="tokens")


def test_input_shapes_sequence_length_fills_every_open_dimension() -> None:
    assert input_shapes(_tokens_model(), sequence_length=16) == {"token_ids": (16,), "features": (16, 3)}


def test_input_shapes_by_name_by_position_and_bare_int() -> None:
    model = _tokens_model()
    expected = {"token_ids": (16,), "features": (16, 3)}
    assert input_shapes(model, {"token_ids": 16, "features": (16, 3)}) == expected
    assert input_shapes(model, [(16,), [16, 3]]) == expected
    assert input_shapes(model, {"token_ids": 12}, sequence_length=16) == {"token_ids": (12,), "features": (16, 3)}


def test_input_shapes_static_model_needs_no_argument() -> None:
    inputs = keras.Input((4,), name="x")
    assert input_shapes(keras.Model(inputs, layers.Dense(2)(inputs))) == {"x": (4,)}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ProfileError, r"Input 'token_ids' of model 'tokens' has shape \(None, None\).*sequence_length=128.*"
         r"input_shapes=\{'token_ids': \(128,\), 'features': \(128, 3\)\}.*--sequence-length 128 or "
         r"--input-shape token_ids=128 --input-shape features=128x3"),
        ({"input_shapes": {"token_ids": 16}}, ProfileError, r"Input 'features' .* \(None, None, 3\)"),
        ({"input_shapes": {"tokens": 16}}, InputError, r"names \['tokens'\], which are not inputs of model 'tokens'"),
        ({"input_shapes": [(16,)]}, InputError, r"1 shape\(s\) but model 'tokens' has 2 input\(s\)"),
        ({"input_shapes": {"features": (16, 4)}, "sequence_length": 8}, InputError,
         r"gives input 'features' .* the shape \(16, 4\), but the model takes \(None, None, 3\)"),
        ({"input_shapes": {"features": (16,)}, "sequence_length": 8}, InputError, r"keeps the known sizes"),
        ({"sequence_length": 0}, InputError, r"sequence_length must be a positive integer. Received: 0"),
        ({"input_shapes": {"token_ids": -1}}, InputError, r"input_shapes\['token_ids'\] must be a positive"),
        ({"input_shapes": "token_ids=16"}, InputError, r"must be a dict \{input name: shape\} or a list"),
    ],
)  # fmt: skip
def test_input_shapes_errors_say_what_to_pass(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        input_shapes(_tokens_model(), **kwargs)


def test_parse_input_shape_reads_the_cli_flag() -> None:
    assert parse_input_shape("token_ids=128") == ("token_ids", (128,))
    assert parse_input_shape("features=128x3") == ("features", (128, 3))
    for text in ("token_ids", "=128", "token_ids=0", "token_ids=a"):
        with pytest.raises(InputError, match="--input-shape takes NAME=SIZE"):
            parse_input_shape(text)


def test_profile_model_open_length_costs_follow_the_planned_length() -> None:
    model = _tokens_model()
    with pytest.raises(ProfileError, match="sequence_length="):
        profile_model(model, batch_size=4, num_microbatches=2, measure_time=False)
    short = profile_model(model, batch_size=4, num_microbatches=2, measure_time=False, sequence_length=8)
    long = profile_model(model, batch_size=4, num_microbatches=2, measure_time=False, sequence_length=16)
    for node in ("embed", "project", "join", "mix"):  # per-token layers: twice the tokens, twice the cost
        assert long.nodes[node]["flops"] == pytest.approx(2 * short.nodes[node]["flops"])
    # What gradients read: embed's the token indices of its gather (its output is read only by the
    # concatenation, whose gradient reads neither input), join's output (mix's weight gradient), mix's
    # relu output. project's output is read by no gradient.
    for node in ("embed", "join", "mix"):
        assert long.nodes[node]["activation_bytes"] == 2 * short.nodes[node]["activation_bytes"] > 0
    assert long.nodes["embed"]["activation_bytes"] == 2 * 16 * 4  # int32 indices, not 8 floats a token
    assert long.nodes["project"]["activation_bytes"] == short.nodes["project"]["activation_bytes"] == 0
    # embed's output, (2 rows, 16 tokens, 8 floats): the edge carries it; pool's output has no length
    assert long.edges["embed", "join"]["bytes"] == 2 * 16 * 8 * 4
    assert long.edges["pool", "head"]["bytes"] == short.edges["pool", "head"]["bytes"] == 2 * 8 * 4
    assert model.inputs[0].shape == (None, None)  # the model keeps its open length


def test_profile_model_static_model_unchanged_by_matching_shapes() -> None:
    inputs = keras.Input((6, 4), name="x")
    model = keras.Model(inputs, layers.Dense(2, name="fc")(layers.Dense(3, name="hidden")(inputs)))
    plain = profile_model(model, batch_size=4, num_microbatches=2, measure_time=False)
    given = profile_model(model, batch_size=4, num_microbatches=2, measure_time=False, input_shapes={"x": (6, 4)})
    assert dict(plain.nodes(data=True)) == dict(given.nodes(data=True))


def test_plan_and_wrap_planned_at_one_length_runs_any_length(virtual_devices) -> None:
    """Planned for 16 tokens; the wrapped model equals the original at 16 and at 8, and fits at both."""
    from runtime import plan_and_wrap, synthetic_batch

    keras.utils.set_random_seed(0)
    model = _tokens_model()
    pins = {"embed": virtual_devices[0], "head": virtual_devices[1]}
    wrapped = plan_and_wrap(
        model, virtual_devices[:2], batch_size=4, num_microbatches=2, memory="1GiB", pins=pins, sequence_length=16
    )
    assert wrapped.plan.num_stages == 2
    wrapped.compile(optimizer="sgd", loss="mse")
    batches = [synthetic_batch(model, 4, input_shapes={"token_ids": n}, sequence_length=n) for n in (16, 8)]
    for length, (x, y) in zip((16, 8), batches, strict=True):
        assert x[0].shape == (4, length) and x[1].shape == (4, length, 3) and y.shape == (4, 3)
        np.testing.assert_allclose(wrapped(x), model(x), atol=1e-6)
    for x, y in batches:
        assert np.isfinite(wrapped.fit(x, y, batch_size=4, verbose=0).history["loss"][0])
    wrapped.sync_original()
    np.testing.assert_allclose(wrapped(batches[1][0]), model(batches[1][0]), atol=1e-6)


def test_wrap_validates_at_the_shapes_given(virtual_devices) -> None:
    from runtime import plan_and_wrap, wrap

    model = _tokens_model()
    pins = {"embed": virtual_devices[0], "head": virtual_devices[1]}
    wrapped = plan_and_wrap(model, virtual_devices[:2], batch_size=4, num_microbatches=2, pins=pins, sequence_length=8)
    plan = wrapped.plan
    assert wrap(model, plan, input_shapes={"token_ids": 8, "features": (8, 3)}).plan == plan
    with pytest.raises(ProfileError, match="sequence_length=128"):
        wrap(model, plan)
    assert wrap(model, plan, validate=False).plan == plan  # nothing to size without validation


def test_unwrap_of_a_functional_subclass(virtual_devices) -> None:
    """A functional model of a class of its own comes back as that class; one without get_config as a
    functional model of the same layers (Keras cannot make it from a config either)."""
    from runtime import plan_and_wrap

    class Classifier(keras.Model):
        def __init__(self, units: int, **kwargs) -> None:
            inputs = keras.Input((None,), dtype="int32", name="token_ids")
            pooled = layers.GlobalAveragePooling1D(name="pool")(layers.Embedding(20, units, name="embed")(inputs))
            super().__init__(inputs, layers.Dense(2, name="head")(pooled), **kwargs)
            self.units = units

        def get_config(self) -> dict:
            return {"units": self.units, "name": self.name}

    class NoConfig(Classifier):
        get_config = keras.Model.get_config

    x = np.arange(12).reshape(3, 4) % 20
    for cls, same_class in ((Classifier, True), (NoConfig, False)):
        model = cls(units=4)
        plain = plan_and_wrap(model, virtual_devices[:2], batch_size=4, num_microbatches=2, sequence_length=4).unwrap()
        assert (type(plain) is cls) is same_class and isinstance(plain, keras.Model)
        np.testing.assert_allclose(plain(x), model(x), atol=1e-6)
