"""The model and the data of the data x pipeline tests, shared by the workers and the reference."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

GLOBAL_BATCH = 15  # uneven shards over 2 workers: 8 and 7 rows
NUM_STEPS = 3


STEPS, VOCABULARY = 5, 12  # the "masked" kind: token sequences padded with 0


class MeanPenalty(keras.layers.Layer):  # type: ignore[misc]  # keras ships no type hints
    """Adds a tenth of the mean square of its input to the loss (add_loss: a mean over the rows)."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def build(kind: str = "mlp") -> keras.Model:
    """ "mlp": an L2 penalty on the first layer; "penalty": the MLP with a loss added by a layer (a mean over the
    rows); "bn": batch normalization on the first stage; "masked": a tagger whose per-step output carries the
    padding mask (its loss is the mean over valid steps)."""
    if kind == "masked":
        tokens = keras.Input((STEPS,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(VOCABULARY, 8, mask_zero=True, name="hidden")(tokens)
        x = keras.layers.Dense(12, activation="relu", name="middle")(x)
        return keras.Model(tokens, keras.layers.Dense(3, name="head")(x))
    inputs = keras.Input((6,), name="features")
    x = keras.layers.Dense(12, activation="tanh", name="hidden", kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    if kind == "bn":
        x = keras.layers.BatchNormalization(name="norm")(x)
    if kind == "penalty":
        x = MeanPenalty(name="penalty")(x)
    x = keras.layers.Dense(12, activation="relu", name="middle")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def batch(step: int, kind: str = "mlp") -> tuple[np.ndarray, np.ndarray]:
    """The global batch of a step (for "masked": rows of 1 to STEPS tokens, then padding)."""
    rng = np.random.default_rng(step)
    if kind == "masked":
        tokens = rng.integers(1, VOCABULARY, (GLOBAL_BATCH, STEPS))
        lengths = rng.integers(1, STEPS + 1, GLOBAL_BATCH)
        tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
        return tokens.astype("int32"), rng.integers(0, 3, (GLOBAL_BATCH, STEPS))
    return rng.normal(size=(GLOBAL_BATCH, 6)).astype("float32"), rng.integers(0, 3, GLOBAL_BATCH)


def shard(
    rank: int, num_workers: int, step: int, contiguous: bool = False, kind: str = "mlp"
) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``rank``'s rows of a step's global batch: rows rank, rank + D, ... (uneven where D does not
    divide); ``contiguous``: the rank-th of D equal slices of the first GLOBAL_BATCH // D * D rows, so that
    the workers' micro-batches are the global batch's, in order."""
    x, y = batch(step, kind)
    if contiguous:
        size = GLOBAL_BATCH // num_workers
        return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]
    return x[rank::num_workers], y[rank::num_workers]


OUTPUT_SHARDS = (slice(0, 10), slice(10, 16))  # the two-output test's shards, uneven: 10 and 6 rows of 16


def two_outputs() -> keras.Model:
    """The per-output losses test's model (workers/outputs.py)."""
    inputs = keras.Input((6,), name="features")
    x = keras.layers.Dense(8, activation="tanh", name="first")(inputs)
    x = keras.layers.Dense(8, activation="relu", name="second")(x)
    return keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(x), "b": keras.layers.Dense(1, name="b")(x)})


def output_data() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    return x, {key: rng.normal(size=(16, 1)).astype("float32") for key in ("a", "b")}


def output_compile_arguments() -> dict:
    return {"optimizer": keras.optimizers.SGD(0.1), "loss": {"a": "mse", "b": "mse"}}


def wrap_two_stages(model: keras.Model, worker: Any) -> Any:
    """``model`` wrapped for ``worker`` (``runtime.start_worker()``'s) as 2 stages on its 2 devices, 2 micro-batches
    of its share of the global batch: 'hidden' and 'middle' on the first, 'head' on the second."""
    from runtime import plan_and_wrap

    devices = worker.devices
    return plan_and_wrap(
        model,
        devices=list(devices),
        batch_size=-(-GLOBAL_BATCH // worker.num_workers),
        num_microbatches=2,
        pins={"hidden": devices[0], "middle": devices[0], "head": devices[1]},
    )
