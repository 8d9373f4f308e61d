"""Trains an MLP on scikit-learn's handwritten digits, pipelined across 4 virtual devices.

What it shows: ``runtime.plan_and_wrap`` profiles a plain Keras model, plans its split over four
logical CPU devices, rebuilds each layer on the device the plan chose and trains it with GPipe
micro-batches; ``fit`` and ``evaluate`` work as on any Keras model.

Data: REAL. ``sklearn.datasets.load_digits`` (1,797 8x8 greyscale digits, shipped with
scikit-learn, no download), split 75% train / 25% held-out test.

Run:
    .venv/bin/python examples/digits_pipeline.py            # 20 epochs, about 30 s on 2 cores
    .venv/bin/python examples/digits_pipeline.py --quick    # 10 epochs (the smoke test)

Exits with status 1 when the test accuracy is below 90%.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
from rich.console import Console
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from partitioner.show.report import device_table, summary_table
from runtime import make_virtual_devices, placement_report, plan_and_wrap

NUM_DEVICES = 4
BATCH_SIZE = 64
NUM_MICROBATCHES = 8
TARGET_ACCURACY = 0.90

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="fewer epochs, for the smoke test")
parser.add_argument("--epochs", type=int, default=None, help="training epochs (default 20, 10 with --quick)")
args = parser.parse_args()
epochs = args.epochs or (10 if args.quick else 20)
console = Console(width=None if sys.stdout.isatty() else 120)  # wide tables when piped
started = time.perf_counter()

# 1. Four logical CPU devices. Importing TensorFlow is fine; this must run before any TensorFlow op.
devices = make_virtual_devices(NUM_DEVICES)
console.print(f"[bold]Devices:[/] {devices}")

keras.utils.set_random_seed(0)

# 2. Real data: 8x8 digits, pixel values 0..16 scaled to 0..1.
digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
console.print(f"[bold]Data:[/] load_digits (real): {len(x_train)} training and {len(x_test)} test images of 8x8")

# 3. An ordinary Keras MLP: nothing in it knows about devices.
inputs = keras.Input((64,), name="pixels")
h = inputs
for i in range(1, 5):
    h = keras.layers.Dense(256, activation="relu", name=f"dense_{i}")(h)
outputs = keras.layers.Dense(10, activation="softmax", name="classes")(h)
model = keras.Model(inputs, outputs, name="digits_mlp")

# 4. Profile, plan, validate and rebuild in one call. CPU devices report no memory: give them 2 GiB each.
wrapped = plan_and_wrap(
    model, devices=NUM_DEVICES, batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, memory="2GiB"
)
plan = wrapped.plan
console.print()
for stage, device in enumerate(plan.stages):
    console.print(f"stage {stage} on {device}: {', '.join(plan.nodes_on(device))}")
console.print(device_table(plan))
console.print(summary_table(plan))

# 5. Train with micro-batches, exactly as a plain Keras model would be trained.
wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
console.print(f"[bold]Training[/] {epochs} epochs, batch {BATCH_SIZE} = {NUM_MICROBATCHES} micro-batches per step")
history = wrapped.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=epochs, verbose=0)
for epoch in sorted({0, epochs // 2, epochs - 1}):
    loss, accuracy = history.history["loss"][epoch], history.history["accuracy"][epoch]
    console.print(f"  epoch {epoch + 1:>3}: loss {loss:.4f}, train accuracy {accuracy:.3f}")

# 6. Check where the weights really live, then score the held-out split.
report = placement_report(wrapped)
console.print(report.table())
console.print(f"every variable on its planned device: {report.ok}")

test_loss, test_accuracy = wrapped.evaluate(x_test, y_test, batch_size=BATCH_SIZE, verbose=0)
predictions = np.argmax(wrapped.predict(x_test, batch_size=BATCH_SIZE, verbose=0), axis=1)
console.print(f"predict() agrees with evaluate(): {np.mean(predictions == y_test):.4f} vs {test_accuracy:.4f}")
console.print(f"test accuracy: {test_accuracy:.4f} (target >= {TARGET_ACCURACY:.2f})", highlight=False)
console.print(f"done in {time.perf_counter() - started:.1f} s")

if test_accuracy < TARGET_ACCURACY or not report.ok:
    console.print("[bold red]FAILED:[/] accuracy below target or a variable off its planned device")
    sys.exit(1)
