"""Trains a keras-hub GPT-2 backbone, built from a config, as a pipeline over 4 virtual devices.

What it shows: a keras-hub model, which takes token ids of any length (``(None, None)``), planned for
one sequence length (``sequence_length=``) and trained through ``runtime.plan_and_wrap``. The model is
``keras_hub.models.GPT2Backbone`` (small: 4 layers, width 64, no preset, nothing downloaded) with a
``Dense`` language-model head on its sequence output, so every transformer layer can go to another device
(``GPT2CausalLM`` reuses its token embedding for the logits, which keeps it on one device). After
training, the wrapped model is saved to a plain ``.keras`` file that loads without this library.

Data: REAL text that ships with Python, no download: the source of a few standard-library modules
(``textwrap``, ``string``, ``heapq``, ``bisect``, ``fnmatch``, ``shlex``), read with ``inspect.getsource``,
one byte per token (vocabulary 256); ``colorsys`` is held out.

Needs keras-hub (``make install`` brings it). Run:
    .venv/bin/python examples/keras_hub_gpt2.py               # 200 steps
    .venv/bin/python examples/keras_hub_gpt2.py --steps 3     # the smoke test
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np

from runtime import make_virtual_devices, placement_report, plan_and_wrap

NUM_DEVICES = 4
SEQUENCE_LENGTH = 64  # the length planned for; the backbone accepts any up to MAX_SEQUENCE_LENGTH
MAX_SEQUENCE_LENGTH = 128
BATCH_SIZE = 32
NUM_MICROBATCHES = 4
VOCABULARY = 256  # bytes
TRAIN_MODULES = ("textwrap", "string", "heapq", "bisect", "fnmatch", "shlex")
HELD_OUT_MODULE = "colorsys"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
args = parser.parse_args()
if args.steps < 1:
    parser.error(f"--steps must be at least 1. Received: --steps {args.steps}.")
try:
    import keras_hub
except ImportError:
    sys.exit("This example needs keras-hub: pip install --no-deps keras-hub==0.32.0 && pip install regex tokenizers")
started = time.perf_counter()

# 1. Four logical CPU devices. This must run before any TensorFlow op.
devices = make_virtual_devices(NUM_DEVICES)
print(f"Devices: {devices}")
keras.utils.set_random_seed(0)


# 2. The text: standard-library source code, one byte per token.
def source_bytes(names: tuple[str, ...]) -> np.ndarray:
    text = "\n".join(inspect.getsource(__import__(name)) for name in names)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("int32")


train_ids, held_out_ids = source_bytes(TRAIN_MODULES), source_bytes((HELD_OUT_MODULE,))
print(
    f"Data: REAL text, the source of the standard-library modules {', '.join(TRAIN_MODULES)} "
    f"({len(train_ids):,} bytes) via inspect.getsource; held out: {HELD_OUT_MODULE} ({len(held_out_ids):,} bytes)"
)


def windows(ids: np.ndarray, count: int, rng: np.random.Generator, length: int = SEQUENCE_LENGTH) -> tuple:
    """``count`` random windows as the backbone's inputs; the targets are the ids shifted by one byte."""
    starts = rng.integers(0, len(ids) - length - 1, size=count)
    chunks = np.stack([ids[s : s + length + 1] for s in starts])
    inputs = {"token_ids": chunks[:, :-1], "padding_mask": np.ones((count, length), dtype="int32")}
    return inputs, chunks[:, 1:]


# 3. The model: a GPT-2 backbone from a config (no preset) and a language-model head.
backbone = keras_hub.models.GPT2Backbone(
    vocabulary_size=VOCABULARY,
    num_layers=4,
    num_heads=4,
    hidden_dim=64,
    intermediate_dim=256,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
)
token_ids = keras.Input((None,), dtype="int32", name="token_ids")
padding_mask = keras.Input((None,), dtype="int32", name="padding_mask")
hidden = backbone({"token_ids": token_ids, "padding_mask": padding_mask})
logits = keras.layers.Dense(VOCABULARY, name="lm_head")(hidden)
model = keras.Model({"token_ids": token_ids, "padding_mask": padding_mask}, logits, name="gpt2_bytes")
print(f"Model: keras_hub GPT2Backbone (4 layers, width 64) + Dense head; {model.count_params():,} parameters")

# 4. Plan for sequences of SEQUENCE_LENGTH tokens and rebuild the model on the devices.
wrapped = plan_and_wrap(
    model,
    devices=NUM_DEVICES,
    batch_size=BATCH_SIZE,
    num_microbatches=NUM_MICROBATCHES,
    memory="2GiB",
    sequence_length=SEQUENCE_LENGTH,
)
for stage, device in enumerate(wrapped.plan.stages):
    print(f"stage {stage} on {device}: {', '.join(wrapped.plan.nodes_on(device))}")
report = placement_report(wrapped)
print(f"every variable on its planned device: {report.ok}")

# 5. Train; print the loss curve.
wrapped.compile(
    optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
)
rng = np.random.default_rng(0)
held_out = windows(held_out_ids, 64, np.random.default_rng(1))
held_out_before = wrapped.evaluate(*held_out, batch_size=BATCH_SIZE, verbose=0)
print(f"Training {args.steps} steps (a uniform guess costs ln({VOCABULARY}) = {math.log(VOCABULARY):.2f})")
losses = []
report_every = max(1, args.steps // 10)
for step in range(1, args.steps + 1):
    losses.append(float(wrapped.train_on_batch(*windows(train_ids, BATCH_SIZE, rng))))
    if step == 1 or step % report_every == 0 or step == args.steps:
        print(f"  step {step:>4}: loss {losses[-1]:.4f}")
held_out_after = wrapped.evaluate(*held_out, batch_size=BATCH_SIZE, verbose=0)
print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
print(f"held-out loss ({HELD_OUT_MODULE}): {held_out_before:.4f} before training, {held_out_after:.4f} after")

# 6. Another length than planned: the wrapped model runs it as the original does.
short, _ = windows(held_out_ids, 4, rng, length=SEQUENCE_LENGTH // 2)
short_logits = np.asarray(wrapped.predict(short, verbose=0))
short_difference = float(np.max(np.abs(short_logits - np.asarray(wrapped.unwrap()(short)))))
print(f"{SEQUENCE_LENGTH // 2}-token sequences: wrapped vs unwrapped, largest logit difference {short_difference:.2e}")

# 7. Save a plain .keras file and load it without this library.
path = Path(tempfile.mkdtemp()) / "gpt2_bytes.keras"
wrapped.save(path)
reloaded = keras.models.load_model(path, compile=False)
inputs, _ = windows(held_out_ids, 4, rng)
difference = float(np.max(np.abs(np.asarray(reloaded(inputs)) - np.asarray(wrapped.predict(inputs, verbose=0)))))
print(f"saved to {path.name}, reloaded as {type(reloaded).__name__}: largest logit difference {difference:.2e}")
print(f"done in {time.perf_counter() - started:.1f} s")

if not (losses[-1] < losses[0] and report.ok and difference < 1e-4 and short_difference < 1e-4):
    print("FAILED: the loss did not fall, a variable is off its device, or the saved model differs")
    sys.exit(1)
