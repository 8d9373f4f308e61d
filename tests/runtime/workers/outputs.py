"""One worker of the per-output losses test: a two-output model, 2 stages, fed its shard of the global batch as a
tf.data dataset (the traced batch size unknown), fit for one epoch and evaluated; the logs written as JSON.

Run by ``partitioner launch --workers 2 --devices-per-worker 2 -- python outputs.py OUT`` from
tests/runtime/test_workers.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runtime import start_worker

worker = start_worker(num_devices=2)

import keras  # noqa: E402  (after start_worker: TensorFlow must not initialise first)
import tensorflow as tf  # noqa: E402

from runtime import plan_and_wrap  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from shards import OUTPUT_SHARDS, output_compile_arguments, output_data, two_outputs  # noqa: E402

if __name__ == "__main__":
    keras.utils.set_random_seed(1)
    devices = list(worker.devices)
    pins = {"first": devices[0], "second": devices[1], "a": devices[1], "b": devices[1]}
    wrapped = plan_and_wrap(two_outputs(), devices=devices, batch_size=10, num_microbatches=1, pins=pins)
    wrapped.compile(**output_compile_arguments())
    x, y = output_data()
    rows = OUTPUT_SHARDS[worker.rank]
    shard = tf.data.Dataset.from_tensor_slices((x[rows], {k: v[rows] for k, v in y.items()})).batch(10)
    logs = {key: float(values[0]) for key, values in wrapped.fit(shard, epochs=1, verbose=0).history.items()}
    logs.update({f"evaluate_{k}": float(v) for k, v in wrapped.evaluate(shard, verbose=0, return_dict=True).items()})
    (Path(sys.argv[1]) / f"logs-{worker.rank}.json").write_text(json.dumps(logs))
