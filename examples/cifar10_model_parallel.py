"""Trains a three-block CNN for CIFAR-10, split automatically across 3 virtual devices.

What it shows: a conv net (three blocks of two 3x3 convolutions and a max-pool, then a dense
head) handed to ``runtime.plan_and_wrap``, which profiles it, lets the planner choose which
layers go on which of three logical CPU devices, rebuilds it there and trains it with GPipe
micro-batches. Each device is given 16 MiB, too little for the whole model, so it must be split.
The per-device plan and the observed placement of the weights are printed.

Data: REAL CIFAR-10 through ``keras.datasets.cifar10.load_data()`` when it can be downloaded
(or is cached in ~/.keras/datasets), a small subset of it to stay quick. When the machine is
offline, or with ``--synthetic``, a SYNTHETIC stand-in is used and announced with a banner:
random 32x32x3 images plus a faint class-dependent pattern, so a model can learn it and the
accuracy rises above chance (10%). Synthetic accuracy says nothing about CIFAR-10. The script
exits with status 1 if, on synthetic data, test accuracy stays below twice the chance level.

Run:
    .venv/bin/python examples/cifar10_model_parallel.py                        # 2 epochs on 1,024 images
    .venv/bin/python examples/cifar10_model_parallel.py --quick --synthetic    # the smoke test
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
from rich.console import Console
from rich.panel import Panel

from partitioner.show.report import device_table, summary_table
from runtime import make_virtual_devices, placement_report, plan_and_wrap

NUM_DEVICES = 3
BATCH_SIZE = 32
NUM_MICROBATCHES = 4
NUM_CLASSES = 10

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="fewer images and one epoch, for the smoke test")
parser.add_argument("--synthetic", action="store_true", help="skip the download and use the synthetic stand-in")
args = parser.parse_args()
num_train, num_test, epochs = (512, 128, 1) if args.quick else (1024, 256, 2)
console = Console(width=None if sys.stdout.isatty() else 120)  # wide tables when piped
started = time.perf_counter()

# 1. Three logical CPU devices. Importing TensorFlow is fine; this must run before any TensorFlow op.
devices = make_virtual_devices(NUM_DEVICES)
console.print(f"[bold]Devices:[/] {devices}")

keras.utils.set_random_seed(0)


# 2. Data: the real CIFAR-10 if it can be had, else a clearly announced synthetic stand-in.
def synthetic_cifar(num_images: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform noise images plus a faint, smooth pattern that depends on the class."""
    patterns = np.random.default_rng(1234).normal(size=(NUM_CLASSES, 4, 4, 3))  # one per class, shared
    patterns = patterns.repeat(8, axis=1).repeat(8, axis=2)  # 4x4 blocks -> 32x32
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=num_images)
    images = rng.uniform(size=(num_images, 32, 32, 3)) + 0.25 * patterns[labels]
    return images.astype("float32"), labels.astype("int32")


real = False
if not args.synthetic:
    console.print("Loading CIFAR-10 with keras.datasets.cifar10.load_data() ...")
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # fail fast behind a firewall rather than hang
    try:
        (x_train, y_train), (x_test, y_test) = keras.datasets.cifar10.load_data()
        real = True
    except Exception as err:  # offline, DNS failure, proxy, partial download ...
        console.print(f"could not load CIFAR-10: {type(err).__name__}: {str(err)[:160]}", highlight=False)
    finally:
        socket.setdefaulttimeout(previous_timeout)

if real:
    x_train, y_train = (x_train[:num_train] / 255.0).astype("float32"), y_train[:num_train, 0].astype("int32")
    x_test, y_test = (x_test[:num_test] / 255.0).astype("float32"), y_test[:num_test, 0].astype("int32")
    console.print(f"[bold]Data:[/] REAL CIFAR-10, the first {num_train} training and {num_test} test images")
else:
    x_train, y_train = synthetic_cifar(num_train, seed=0)
    x_test, y_test = synthetic_cifar(num_test, seed=1)
    console.print(
        Panel(
            f"SYNTHETIC DATA: CIFAR-10 is not available here, so {num_train} training and {num_test} test images\n"
            "of random noise plus a faint class-dependent pattern stand in for it (same shapes: 32x32x3,\n"
            "10 classes). Accuracy above 10% shows the pipeline learns; it says nothing about CIFAR-10.",
            style="bold yellow",
        )
    )


# 3. The model: three conv blocks (conv -> conv -> pool), then a dense head. No device code in it.
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
outputs = keras.layers.Dense(NUM_CLASSES, activation="softmax", name="classes")(x)
model = keras.Model(inputs, outputs, name="cifar_cnn")
console.print(f"[bold]Model:[/] {model.name}, {model.count_params():,} parameters, {len(model.layers)} layers")

# 4. Plan and rebuild across the three devices. Each is given 16 MiB, less than the 19 MiB the
#    planner counts for the whole model on one device at M = 4 (weights, Adam's slots, gradients,
#    activations): the model must be split to fit, as on accelerators too small for it, whatever
#    this machine's cores make of the speed.
wrapped = plan_and_wrap(
    model, devices=NUM_DEVICES, batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, memory="16MiB"
)
plan = wrapped.plan
for stage, device in enumerate(plan.stages):
    console.print(f"stage {stage} on {device}: {', '.join(plan.nodes_on(device))}")
console.print(device_table(plan))
console.print(summary_table(plan))
report = placement_report(wrapped)
console.print(report.table())
console.print(f"every variable on its planned device: {report.ok}")

# 5. Train and evaluate like any Keras model.
wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
console.print(f"[bold]Training[/] {epochs} epoch(s), batch {BATCH_SIZE} = {NUM_MICROBATCHES} micro-batches per step")
history = wrapped.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, verbose=0)
for epoch, (loss, accuracy) in enumerate(zip(history.history["loss"], history.history["accuracy"]), start=1):
    console.print(f"  epoch {epoch}: loss {loss:.4f}, train accuracy {accuracy:.3f}")
test_loss, test_accuracy = wrapped.evaluate(x_test, y_test, batch_size=BATCH_SIZE, verbose=0)
data = "real CIFAR-10" if real else "SYNTHETIC stand-in"
console.print(f"test accuracy ({data}): {test_accuracy:.4f} (chance: {1 / NUM_CLASSES:.2f})", highlight=False)
console.print(f"done in {time.perf_counter() - started:.1f} s")

# The synthetic pattern is easy: failing to beat twice the chance level means the pipeline did not learn.
learned = real or test_accuracy > 2 / NUM_CLASSES
if not (learned and report.ok):
    console.print("[bold red]FAILED:[/] no learning on the synthetic data, or a variable off its planned device")
    sys.exit(1)
