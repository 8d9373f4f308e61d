"""Models the pipeline would not run as written are refused at wrap time; the rest still wrap.

Steps of the model's own class (issue 18, item 5): before, ``fit`` of the wrapped model silently ran
Keras' step instead of the user's.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from test_transparency import assert_close

from partitioner.errors import InputError, ProfileError
from runtime import plan_and_wrap, wrap
from runtime.supported import STEPS, check_steps

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
