"""The model and the data of the data x pipeline tests, shared by the workers and the reference."""

from __future__ import annotations

import keras
import numpy as np

GLOBAL_BATCH = 15  # uneven shards over 2 workers: 8 and 7 rows
NUM_STEPS = 3


def build(kind: str = "mlp") -> keras.Model:
    """ "mlp": an L2 penalty on the first layer; "bn": batch normalization on the first stage."""
    inputs = keras.Input((6,), name="features")
    x = keras.layers.Dense(12, activation="tanh", name="hidden", kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
    if kind == "bn":
        x = keras.layers.BatchNormalization(name="norm")(x)
    x = keras.layers.Dense(12, activation="relu", name="middle")(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of a step."""
    rng = np.random.default_rng(step)
    return rng.normal(size=(GLOBAL_BATCH, 6)).astype("float32"), rng.integers(0, 3, GLOBAL_BATCH)


def shard(rank: int, num_workers: int, step: int, contiguous: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``rank``'s rows of a step's global batch: rows rank, rank + D, ... (uneven where D does not
    divide); ``contiguous``: the rank-th of D equal slices of the first GLOBAL_BATCH // D * D rows, so that
    the workers' micro-batches are the global batch's, in order."""
    x, y = batch(step)
    if contiguous:
        size = GLOBAL_BATCH // num_workers
        return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]
    return x[rank::num_workers], y[rank::num_workers]
