"""What TensorFlow holds when the forward ends, against the profiler's activation_bytes.

For each small model (one 56x56x64 feature map per block, batch 8) and ResNet50 at batch 16, one
child process sets ``TF_CPU_ALLOCATOR_USE_BFC=true``, profiles the model (``profile_model``, M = 1),
and runs a training step of its own (forward under a tape, mean squared error, gradients, Adam)
whose model output passes through an identity that reads ``get_memory_info("CPU:0")["current"]``
when the forward has ended. *alive* is that reading less the reading before the step (weights,
slots, the batch): what the allocator holds for the forward tensors kept for the backward.
*counted* is the sum of the profile's activation_bytes. Both are given in feature maps
(8 x 56 x 56 x 64 float32 = 6.42 MB; ResNet50: in MB).

    .venv/bin/python benchmarks/memory_model/alive.py     # about 3 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
BLOCKS = ("conv", "conv-bn", "conv-relu", "conv-bn-relu", "add")
MAP_BYTES = 8 * 56 * 56 * 64 * 4


def build(name: str) -> tuple[Any, int]:
    """The model and its batch size."""
    import keras

    layers = keras.layers
    if name == "ResNet50":
        return keras.applications.ResNet50(weights=None), 16
    inputs = keras.Input((56, 56, 64))
    h = layers.Conv2D(64, 1)(inputs)
    if name == "add":
        h = layers.Add()([h, layers.Conv2D(64, 1)(inputs)])
    if "bn" in name:
        h = layers.BatchNormalization()(h)
    if "relu" in name:
        h = layers.Activation("relu")(h)
    return keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(h))), 8


def child(name: str) -> dict[str, Any]:
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(ROOT))
    import keras
    import numpy as np
    import tensorflow as tf

    from profiles import profile_model

    model, batch = build(name)
    graph = profile_model(model, batch_size=batch, num_microbatches=1, measure_time=False)
    counted = sum(data["activation_bytes"] for _, data in graph.nodes(data=True))
    optimizer = keras.optimizers.Adam(1e-4)
    readings: list[int] = []

    def read(x: Any) -> Any:
        readings.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
        return x

    @tf.custom_gradient
    def end_of_forward(x: Any) -> Any:
        y = tf.py_function(read, [x], x.dtype)
        y.set_shape(x.shape)
        return y, lambda upstream: upstream

    @tf.function
    def step(x: Any, target: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(end_of_forward(model(x, training=True)) - target))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    shape = (batch, *model.inputs[0].shape[1:])
    x = tf.constant(np.random.default_rng(0).random(shape, dtype=np.float32))
    target = tf.zeros((batch, *model.outputs[0].shape[1:]))
    for _ in range(2):
        step(x, target)
    readings.clear()
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(x, target)
    return {"model": name, "counted_bytes": int(counted), "alive_bytes": int(readings[0] - before)}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    print("| model | counted | alive | alive / counted |\n|---|---|---|---|")
    for name in (*BLOCKS, "ResNet50"):
        out = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        unit, scale = ("MB", 1e6) if name == "ResNet50" else ("maps", MAP_BYTES)
        counted, alive = row["counted_bytes"] / scale, row["alive_bytes"] / scale
        ratio = f"{alive / counted:.2f}" if counted else "-"
        print(f"| {name} | {counted:.3f} {unit} | {alive:.3f} {unit} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
