"""One worker of the fault tests: ``fit`` over EPOCHS epochs with a BackupAndRestore folder of its own;
worker 1 kills or stops itself once, in epoch 3, when the marker file OUT/faulted does not exist yet.

Run by ``partitioner launch --workers 2 --devices-per-worker 2 -- python faults.py OUT FAULT`` from
tests/runtime/test_faults.py. FAULT is one of:

- ``none``: no fault (the uninterrupted run);
- ``kill``: SIGKILL before the second step of epoch 3;
- ``stop``: SIGSTOP before the second step of epoch 3 (a hung worker);
- ``kill-unsaved``: SIGKILL at the end of epoch 3, after worker 0 wrote its backup of epoch 3 and before
  worker 1 wrote its own: on restart the two folders hold different epochs.

The fault's time (``time.time()``) goes to OUT/faulted; at the end each worker saves its weights, the
optimizer's iterations and the loss of every epoch it ran to OUT/worker-<rank>.npz.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from runtime import start_worker

worker = start_worker(num_devices=2)

import keras  # noqa: E402  (after start_worker: TensorFlow must not initialise first)
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from shards import NUM_STEPS, build, shard, wrap_two_stages  # noqa: E402

NUM_EPOCHS = 4
FAULT_EPOCH = 2  # epoch 3, counted from 0 as Keras does
out, fault = Path(sys.argv[1]), sys.argv[2]
marker = out / "faulted"


class Fault(keras.callbacks.Callback):
    """Worker 1's fault, on the first attempt only (the marker file says it happened)."""

    def _fault(self, number: int) -> None:
        marker.write_text(str(time.time()))
        os.kill(os.getpid(), number)

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == FAULT_EPOCH and batch == 1 and fault in ("kill", "stop"):
            self._fault(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):  # runs before BackupAndRestore's: worker 1 has not saved yet
        if epoch == FAULT_EPOCH and fault == "kill-unsaved":
            peer = out / "backup" / "worker-0" / "training_metadata.json"
            while not (peer.exists() and json.loads(peer.read_text() or "{}").get("epoch") == epoch + 1):
                time.sleep(0.01)
            self._fault(signal.SIGKILL)


keras.utils.set_random_seed(100 + worker.rank)  # a different initial model on each worker
model = build()
wrapped = wrap_two_stages(model, worker)
assert wrapped.plan.num_stages == 2, wrapped.plan.assignment
wrapped.compile(
    optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
)
shards = [shard(worker.rank, worker.num_workers, step) for step in range(NUM_STEPS)]  # one epoch: 3 steps
x, y = np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])
callbacks = [keras.callbacks.BackupAndRestore(str(out / "backup" / f"worker-{worker.rank}"))]
if worker.rank == 1 and not marker.exists():
    callbacks.insert(0, Fault())
history = wrapped.fit(
    x, y, batch_size=len(shards[0][0]), epochs=NUM_EPOCHS, shuffle=False, verbose=0, callbacks=callbacks
)
weights = wrapped.unwrap().get_weights()
iterations = int(wrapped.optimizer.iterations.numpy())
np.savez(out / f"worker-{worker.rank}.npz", *weights, iterations=iterations, losses=history.history["loss"])
print(f"worker {worker.rank} of {worker.num_workers} done: {iterations} steps, epoch losses {history.history['loss']}")
