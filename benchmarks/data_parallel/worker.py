"""One worker of the data-parallel benchmark: times training steps and the R action alone; prints one JSON line.

python worker.py GLOBAL_BATCH NUM_MICROBATCHES STEPS          (alone: 1 worker x 2 devices)
partitioner launch --workers 2 --devices-per-worker 2 -- python worker.py ...   (2 workers x 2 devices)
"""

from __future__ import annotations

import json
import sys
import time

from runtime import start_worker

worker = start_worker(num_devices=2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from runtime import plan_and_wrap  # noqa: E402

WIDTH, DEPTH, FEATURES, CLASSES = 512, 6, 256, 10


def build() -> keras.Model:
    inputs = keras.Input((FEATURES,))
    x = inputs
    for i in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))


global_batch, num_microbatches, steps = (int(a) for a in sys.argv[1:4])
local = global_batch // worker.num_workers
keras.utils.set_random_seed(0)
model = build()
devices = list(worker.devices)
half = DEPTH // 2
pins = {f"dense_{i}": devices[0] if i < half else devices[1] for i in range(DEPTH)} | {"head": devices[1]}
wrapped = plan_and_wrap(model, devices=devices, batch_size=local, num_microbatches=num_microbatches, pins=pins)
wrapped.compile(
    optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
)
rng = np.random.default_rng(worker.rank)
x = rng.normal(size=(local, FEATURES)).astype("float32")
y = rng.integers(0, CLASSES, local)
for _ in range(3):  # warm-up: traces and first steps
    wrapped.train_on_batch(x, y)
times = []
for _ in range(steps):
    start = time.perf_counter()
    wrapped.train_on_batch(x, y)
    times.append(time.perf_counter() - start)

reduce_s = None
executor = wrapped.executor
if executor.collectives:  # the R action alone: every stage's gradient-sized pack summed, as the step does

    @tf.function(autograph=False)
    def r_action() -> list:
        out = []
        for stage, group in zip(executor.stages, executor.collectives):
            with tf.device(stage.device):
                out += group.sum([tf.ones(v.shape, v.dtype) for v in stage.trainable_variables], "measure")
        return out

    for _ in range(3):
        r_action()
    reduce_times = []
    for _ in range(steps):
        start = time.perf_counter()
        r_action()
        reduce_times.append(time.perf_counter() - start)
    reduce_s = float(np.median(reduce_times))

parameters = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
print(
    "RESULT "
    + json.dumps(
        {
            "rank": worker.rank,
            "num_workers": worker.num_workers,
            "local_batch": local,
            "step_s": float(np.median(times)),
            "step_quartiles_s": [float(q) for q in np.quantile(times, [0.25, 0.75])],
            "r_action_s": reduce_s,
            # what the plan predicts: each stage's R as plan_and_wrap timed it at wrap (each stage alone), and the
            # step with them (the pipeline priced by FLOPs: a worker of several does not time its layers)
            "plan_reduce_s": [wrapped.plan.reduce_times.get(d, 0.0) for d in wrapped.plan.stages],
            "predicted_step_s": wrapped.plan.predicted_step_s,
            "gradient_bytes": parameters * 4,
        }
    ),
    flush=True,
)
