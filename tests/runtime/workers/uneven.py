"""One worker of the out-of-step tests: worker 1 runs a step more than worker 0 somewhere, or worker 0 alone
evaluates. Run by ``partitioner launch --workers 2 --devices-per-worker 2 -- python uneven.py OUT CASE`` from
tests/runtime/test_faults.py. CASE is one of:

- ``training``: worker 1's shard has a batch more (4 training steps an epoch against 3);
- ``validation``: worker 1's validation data has a batch more;
- ``evaluate``: both fit alike, then worker 0 alone calls ``evaluate`` and worker 1 ends;
- ``unknown-size``: no step more anywhere, the data as datasets of unknown size (a filter): their end is found by
  one more call of the step, which must issue no collective; fit with validation, then evaluate twice.

Each worker writes OUT/done-<rank> when its part ended without an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime import start_worker

worker = start_worker(num_devices=2)

import keras  # noqa: E402  (after start_worker: TensorFlow must not initialise first)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from shards import NUM_STEPS, build, shard, wrap_two_stages  # noqa: E402

out, case = Path(sys.argv[1]), sys.argv[2]
model = build()
wrapped = wrap_two_stages(model, worker)
wrapped.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
shards = [shard(worker.rank, worker.num_workers, step) for step in range(NUM_STEPS)]
rows = len(shards[0][0])
x, y = np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])
extra = worker.rank == 1
train = (np.concatenate([x, x[:rows]]), np.concatenate([y, y[:rows]])) if extra and case == "training" else (x, y)
validation = (x[: 2 * rows], y[: 2 * rows]) if extra and case == "validation" else (x[:rows], y[:rows])
if case == "unknown-size":

    def unknown(a: np.ndarray, b: np.ndarray) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((a, b)).filter(lambda *_: True).batch(rows)

    wrapped.fit(unknown(x, y), epochs=2, validation_data=unknown(x[:rows], y[:rows]), verbose=0)
    for _ in range(2):
        wrapped.evaluate(unknown(x, y), verbose=0)
else:
    wrapped.fit(*train, batch_size=rows, epochs=2, validation_data=validation, shuffle=False, verbose=0)
if case == "evaluate" and worker.rank == 0:
    wrapped.evaluate(x, y, batch_size=rows, verbose=0)
(out / f"done-{worker.rank}").write_text("")
print(f"worker {worker.rank} done")
