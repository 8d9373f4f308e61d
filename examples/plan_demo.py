"""The demo (`make demo`): profile, plan and train a CNN across 4 virtual devices, then check the prediction.

What it shows, step by step:
  1. four logical CPU devices, made before TensorFlow initialises;
  2. a CIFAR-style CNN (three conv blocks, then a dense head), defined below;
  3. the profiler: every layer call's FLOPs, bytes and measured forward + backward time;
  4. the planner (``partitioner.solve``) on the local devices, whose FLOP/s it measures with a
     matmul, printed with the placement, per-device, transfer and prediction tables, beside the
     splits other tools would make (``partitioner.search.baselines``);
  5. the runtime (``runtime.wrap``): the model rebuilt on the planned devices and trained a few
     steps with GPipe micro-batches;
  6. the measured step time against the planner's predicted ``plan.step_time_s`` (the GPipe step
     simulated action by action, ``partitioner.simulate``, drawn as a text timeline), and where
     the variables and ops really ended up (``runtime.placement_report``).

Data: SYNTHETIC. Random 32x32x3 images and random labels of the model's input and output shapes;
only the step time is of interest here, not what the model learns.

Run:
    make demo                                     # or: .venv/bin/python examples/plan_demo.py
    .venv/bin/python examples/plan_demo.py --quick   # fewer timed steps (the smoke test)

The four logical devices share this machine's cores, so they cannot all compute at once as
four real accelerators would: expect the measured step to be slower than the prediction, which
assumes each device runs alone at the FLOP/s measured for it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
from rich.console import Console

import partitioner as pt
from partitioner.show.report import render
from partitioner.show.timeline import text_timeline
from partitioner.units import format_flops, format_seconds
from profiles import profile_model
from profiles.local import local_cluster
from runtime import make_virtual_devices, placement_report, wrap

NUM_DEVICES = 4
BATCH_SIZE = 64
NUM_MICROBATCHES = 8
# per device (CPU devices report no capacity of their own): the model needs 19.3 MiB on one device at M = 8 (its
# weights, their gradients and sums, Adam's slots, a micro-batch's activations), so the planner splits it whatever
# speeds the devices measure on a loaded machine (with 2 GiB a loaded run planned one stage); a first stage holds
# up to 8 micro-batches' activations of the first convolutions (18.9 MiB with the first block alone)
MEMORY = "19MiB"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="fewer timed steps, for the smoke test")
args = parser.parse_args()
num_warmup, num_timed = (1, 3) if args.quick else (2, 5)
console = Console(width=None if sys.stdout.isatty() else 120)  # wide tables when piped
started = time.perf_counter()

# 1. Four logical CPU devices. Importing TensorFlow is fine; this must run before any TensorFlow op.
devices = make_virtual_devices(NUM_DEVICES)
console.rule("[bold]1. Devices")
console.print(f"{NUM_DEVICES} logical CPU devices on {os.cpu_count()} cores: {devices}")

keras.utils.set_random_seed(0)


# 2. The bundled model: a CIFAR-style CNN. Only its shapes matter to the planner.
def conv_block(x: keras.KerasTensor, filters: int, block: int) -> keras.KerasTensor:
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"block{block}_conv1")(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"block{block}_conv2")(x)
    return keras.layers.MaxPooling2D(name=f"block{block}_pool")(x)


inputs = keras.Input((32, 32, 3), name="image")
x = conv_block(inputs, 32, block=1)
x = conv_block(x, 64, block=2)
x = conv_block(x, 128, block=3)
x = keras.layers.Flatten(name="flatten")(x)
x = keras.layers.Dense(128, activation="relu", name="head_dense")(x)
outputs = keras.layers.Dense(10, activation="softmax", name="classes")(x)
model = keras.Model(inputs, outputs, name="cifar_cnn")
console.rule("[bold]2. Model")
console.print(f"{model.name}: {len(model.layers)} layers, {model.count_params():,} parameters")

# 3. Profile: per layer call, FLOPs and bytes from the traced graph, and the measured time.
console.rule("[bold]3. Profile")
tick = time.perf_counter()
graph = profile_model(model, batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, measure_time=True)
console.print(
    f"{graph.number_of_nodes()} nodes, micro-batch of {BATCH_SIZE // NUM_MICROBATCHES} samples, "
    f"timed on {graph.graph['profiled_device']} ({format_flops(graph.graph['profiled_flops_per_s'])}FLOP/s matmul) "
    f"in {time.perf_counter() - tick:.1f} s",
    highlight=False,
)

# 4. Plan on the local devices (their FLOP/s measured with a matmul), and score the baselines too.
console.rule("[bold]4. Plan")
cluster = local_cluster(NUM_DEVICES, memory=MEMORY)
for device in cluster.devices:
    console.print(f"  {device.name}: {format_flops(device.flops_per_s)}FLOP/s measured, {MEMORY}", highlight=False)
if cluster.devices[0].pool is not None:
    console.print(
        f"  the {NUM_DEVICES} devices share one processor ({cluster.devices[0].pool}): "
        f"{cluster.devices[0].pool_capacity:.2f} devices' worth of work at once, measured",
        highlight=False,
    )
plan = pt.solve(graph, cluster, num_microbatches=NUM_MICROBATCHES, time_limit_s=10)
pt.validate_plan(plan, graph, cluster)
baselines = [split(graph, cluster, num_microbatches=NUM_MICROBATCHES) for split in pt.baselines.BASELINES.values()]
console.print(render(plan, graph, baselines))

# 5. Rebuild the model on the planned devices and train a few steps on synthetic data.
console.rule("[bold]5. Train (synthetic data)")
rng = np.random.default_rng(0)
images = rng.normal(size=(BATCH_SIZE, 32, 32, 3)).astype("float32")
labels = rng.integers(0, 10, size=BATCH_SIZE).astype("int32")
console.print(
    f"SYNTHETIC batch of {BATCH_SIZE} random images and labels; {num_warmup} warm-up step(s) "
    f"(the first one traces the step function), then {num_timed} timed steps",
    highlight=False,
)


def median_step_time(trainable: keras.Model, label: str) -> float:
    """Median seconds of ``train_on_batch`` after warm-up; it returns numbers, so each step has finished."""
    tick = time.perf_counter()
    for _ in range(num_warmup):
        trainable.train_on_batch(images, labels)
    console.print(f"{label}: warm-up {time.perf_counter() - tick:.1f} s", highlight=False)
    seconds = []
    for step in range(1, num_timed + 1):
        tick = time.perf_counter()
        loss = trainable.train_on_batch(images, labels)
        seconds.append(time.perf_counter() - tick)
        console.print(f"  step {step}: {format_seconds(seconds[-1])}, loss {float(loss):.4f}", highlight=False)
    return statistics.median(seconds)


wrapped = wrap(model, plan)  # validates the plan against the model, then rebuilds it on the devices
wrapped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
measured = median_step_time(wrapped, f"pipelined over {plan.num_stages} devices, M = {NUM_MICROBATCHES}")

reference = keras.models.clone_model(model)  # the same model, unpartitioned, for comparison
reference.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
measured_plain = median_step_time(reference, "plain Keras model, one device, whole batch")

# 6. Measured against predicted, and where things really are.
console.rule("[bold]6. Measured against predicted")
# The same placement scored from the profiler's measured layer times instead of FLOPs.
by_time = pt.score_assignment(
    plan.assignment, pt.CostModel(graph, cluster, num_microbatches=NUM_MICROBATCHES, cost="time"), method="by time"
)
rows = [
    ("measured step, pipelined (median)", measured),
    ("predicted step, plan.step_time_s (FLOPs at matmul FLOP/s)", plan.step_time_s),
    ("predicted step from measured layer times (cost='time')", by_time.step_time_s),
    ("measured step, plain Keras model on one device", measured_plain),
    ("predicted serial step, plan.serial_step_s", plan.serial_step_s),
]
for what, seconds in rows:
    console.print(f"  {what:<60} {format_seconds(seconds):>10}", highlight=False)
console.print(f"measured / predicted: {measured / plan.step_time_s:.2f}x", highlight=False)
console.print(text_timeline(pt.simulate(plan, graph, cluster), width=80), highlight=False, markup=False, soft_wrap=True)
console.print(
    "plan.step_time_s is the GPipe schedule simulated action by action (above; the closed-form bound "
    f"(M + K - 1) x bottleneck is {format_seconds(plan.fill_drain_step_s or 0.0)}), each layer's FLOPs counted at "
    f"the matmul FLOP/s measured on its device, and these {NUM_DEVICES} logical devices sharing "
    f"{os.cpu_count()} cores as measured (their pool: each of k devices computing at once runs at "
    "min(1, capacity / k) of its speed). Convolutions and small ops run below matmul speed: a slower measured "
    "step is expected here. The profiler's measured layer times (cost='time') include that effect.",
    highlight=False,
)
report = placement_report(wrapped)
console.print(report.table())
console.print(f"every variable on its planned device: {report.ok}")
console.print(f"done in {time.perf_counter() - started:.1f} s")
sys.exit(0 if report.ok else 1)
