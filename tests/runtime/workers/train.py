"""One worker of a data x pipeline test: 2 stages on 2 logical devices, trained on its shard, weights saved.

Run by ``partitioner launch --workers D --devices-per-worker 2 -- python train.py OUT SCHEDULE M RECOMPUTE``
from tests/runtime/test_workers.py. Each worker builds the model with a seed of its own: the wrapped
model must take worker 0's initial weights (the broadcast) for the workers to end equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runtime import start_worker

# "--data-parallel": one device per worker, K = 1 (pure data parallel); else a 2-stage pipeline per worker
worker = start_worker(num_devices=1 if "--data-parallel" in sys.argv else 2)

import keras  # noqa: E402  (after start_worker: TensorFlow must not initialise first)
import numpy as np  # noqa: E402

from runtime import plan_and_wrap  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from shards import GLOBAL_BATCH, NUM_STEPS, build, shard  # noqa: E402

out, schedule, num_microbatches, recompute = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
disagree = "--disagree" in sys.argv  # the last worker plans another split: every worker must refuse to start
# "--bn": batch normalization, contiguous even shards; "--masked": a masked tagger, trained with SGD momentum;
# "--penalty": the MLP with a layer's add_loss
kind = next((k for k in ("bn", "masked", "penalty") if f"--{k}" in sys.argv), "mlp")
keras.utils.set_random_seed(100 + worker.rank)  # a different initial model on each worker
model = build(kind)
if "--other-activation" in sys.argv and worker.rank == 1:  # the same shapes, another function
    model.get_layer("middle").activation = keras.activations.get("tanh")
devices = worker.devices
wrapped = plan_and_wrap(
    model,
    devices=list(devices),
    batch_size=-(-GLOBAL_BATCH // worker.num_workers),  # the same plan on every worker: the larger share
    num_microbatches=num_microbatches,
    pins=None
    if len(devices) == 1
    else {"hidden": devices[0], "middle": devices[int(disagree and worker.rank == 1)], "head": devices[1]},
    schedule=schedule,
    recompute=recompute,
)
assert wrapped.plan.num_stages == len(devices), wrapped.plan.assignment
(out / f"plan-{worker.rank}.json").write_text(wrapped.plan.to_json())  # with the all-reduce timed at wrap
# an embedding's sparse rows with Adam across replicas are refused (Keras' row-by-row update): SGD momentum
optimizer = keras.optimizers.SGD(0.1, momentum=0.9) if kind == "masked" else keras.optimizers.Adam(0.01)
# the MLP logs accuracy: each worker logs the global batch's (its metric states summed over the workers)
metrics = ["accuracy"] if kind == "mlp" else []
wrapped.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=metrics)
losses = []
for step in range(NUM_STEPS):
    # "--even": contiguous even shards for the MLP too (MirroredStrategy needs a batch the replicas divide)
    x, y = shard(worker.rank, worker.num_workers, step, contiguous=kind == "bn" or "--even" in sys.argv, kind=kind)
    losses.append(wrapped.train_on_batch(x, y))
evaluated = wrapped.evaluate(x, y, batch_size=len(x), verbose=0)  # the last step's shard
# in steps of 4 rows (8 + 7 rows: 2 steps on each worker): Keras' tracker weights each step by the global rows
evaluated_steps = wrapped.evaluate(x, y, batch_size=4, verbose=0)
weights = wrapped.unwrap().get_weights()
np.savez(
    out / f"worker-{worker.rank}.npz",
    *weights,
    losses=np.asarray(losses),
    evaluated=np.asarray(evaluated),
    evaluated_steps=np.asarray(evaluated_steps),
)
print(f"worker {worker.rank} of {worker.num_workers} done: losses {losses}")
