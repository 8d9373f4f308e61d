"""Trains a character-level GPT on Python's own standard library, split across up to 4 virtual devices.

What it shows: a decoder-only transformer written the ordinary functional way, with nothing custom:
token and position ``Embedding`` layers added with ``tok + pos`` (the positions come from the
tokens through ``keras.ops``: Keras ops in the graph), then pre-LayerNorm blocks of
``MultiHeadAttention(use_causal_mask=True)`` and an MLP with residual additions, then a
language-model head. ``runtime.plan_and_wrap`` profiles it, plans its split over 4 devices (it may
leave one idle: the 4 logical devices share this machine's cores, and a stage more would not shorten the
step; each device is given 16 MiB, too little for the whole model) and trains it as a pipeline; the loss
curve is printed, and the wrapped model writes a few characters by greedy decoding
(each next character is the most likely one under ``wrapped.predict``).

Data: REAL text that ships with Python, no download: the source code of a few standard-library
modules (``textwrap``, ``string``, ``heapq``, ``bisect``, ``fnmatch``, ``shlex``, ``colorsys``,
``calendar``), read with ``inspect.getsource``. Characters outside printable ASCII become "?". The
last module (``calendar``) is held out: the held-out loss is measured on it.

Run:
    .venv/bin/python examples/char_gpt.py               # 300 steps (47 s on a shared 2-core machine)
    .venv/bin/python examples/char_gpt.py --steps 3     # the smoke test
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import string
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np

from runtime import make_virtual_devices, placement_report, plan_and_wrap

NUM_DEVICES = 4
SEQUENCE_LENGTH = 64
MODEL_DIM = 64
NUM_HEADS = 4
NUM_BLOCKS = 2
BATCH_SIZE = 32
NUM_MICROBATCHES = 4
TRAIN_MODULES = ("textwrap", "string", "heapq", "bisect", "fnmatch", "shlex", "colorsys")
HELD_OUT_MODULE = "calendar"
NUM_SAMPLED = 60  # characters written by greedy decoding

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
args = parser.parse_args()
if args.steps < 1:
    parser.error(f"--steps must be at least 1. Received: --steps {args.steps}.")
started = time.perf_counter()

# 1. Four logical CPU devices. This must run before any TensorFlow op.
devices = make_virtual_devices(NUM_DEVICES)
print(f"Devices: {devices}")
keras.utils.set_random_seed(0)

# 2. The text: standard-library source code, one character per token.
VOCABULARY = sorted(set(string.printable) - set("\x0b\x0c\r"))  # printable ASCII; "?" stands for the rest
INDEX = {c: i for i, c in enumerate(VOCABULARY)}


def encode(text: str) -> np.ndarray:
    return np.array([INDEX.get(c, INDEX["?"]) for c in text], dtype="int32")


def decode(ids: np.ndarray) -> str:
    return "".join(VOCABULARY[int(i)] for i in ids)


def source_of(names: tuple[str, ...]) -> str:
    return "\n".join(inspect.getsource(__import__(name)) for name in names)


train_ids, held_out_ids = encode(source_of(TRAIN_MODULES)), encode(source_of((HELD_OUT_MODULE,)))
print(
    f"Data: REAL text, the source of the standard-library modules {', '.join(TRAIN_MODULES)} "
    f"({len(train_ids):,} characters) via inspect.getsource; held out: {HELD_OUT_MODULE} "
    f"({len(held_out_ids):,} characters); vocabulary {len(VOCABULARY)} characters"
)


def windows(ids: np.ndarray, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random windows of the text; the targets are the inputs shifted by one character."""
    starts = rng.integers(0, len(ids) - SEQUENCE_LENGTH - 1, size=count)
    chunks = np.stack([ids[s : s + SEQUENCE_LENGTH + 1] for s in starts])
    return chunks[:, :-1], chunks[:, 1:]


# 3. The model, functional: tok + pos, NUM_BLOCKS causal transformer blocks, a language-model head.
tokens = keras.Input((SEQUENCE_LENGTH,), dtype="int32", name="tokens")
positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1  # 0, 1, 2, ... for every row
tok = keras.layers.Embedding(len(VOCABULARY), MODEL_DIM, name="token_embedding")(tokens)
pos = keras.layers.Embedding(SEQUENCE_LENGTH, MODEL_DIM, name="position_embedding")(positions)
x = tok + pos
for block in range(NUM_BLOCKS):
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{block}_norm1")(x)
    attention = keras.layers.MultiHeadAttention(NUM_HEADS, MODEL_DIM // NUM_HEADS, name=f"block{block}_attention")
    x = x + attention(h, h, use_causal_mask=True)  # position i attends to positions <= i only
    h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{block}_norm2")(x)
    h = keras.layers.Dense(4 * MODEL_DIM, activation="gelu", name=f"block{block}_mlp_in")(h)
    x = x + keras.layers.Dense(MODEL_DIM, name=f"block{block}_mlp_out")(h)
x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
logits = keras.layers.Dense(len(VOCABULARY), name="lm_head")(x)
model = keras.Model(tokens, logits, name="char_gpt")
print(
    f"Model: {model.name}: {NUM_BLOCKS} blocks, width {MODEL_DIM}, {NUM_HEADS} heads, context "
    f"{SEQUENCE_LENGTH} characters; {model.count_params():,} parameters"
)

# 4. Plan the split over the devices and rebuild the model on them.
#    Each device is given 16 MiB, less than the 17.7 MiB the planner counts for the model (weights,
#    Adam's slots, gradients, activations): it must be split to fit, whatever this machine's cores
#    make of the speed.
wrapped = plan_and_wrap(
    model, devices=NUM_DEVICES, batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, memory="16MiB"
)
for stage, device in enumerate(wrapped.plan.stages):
    print(f"stage {stage} on {device}: {', '.join(wrapped.plan.nodes_on(device))}")
report = placement_report(wrapped)
print(f"every variable on its planned device: {report.ok}")

# 5. Train, one pipelined step (NUM_MICROBATCHES micro-batches) per batch; print the loss curve.
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
wrapped.compile(optimizer=keras.optimizers.Adam(3e-3), loss=loss)
rng = np.random.default_rng(0)
held_out = windows(held_out_ids, 64, np.random.default_rng(1))
held_out_before = wrapped.evaluate(*held_out, batch_size=BATCH_SIZE, verbose=0)
print(f"Training {args.steps} steps (a uniform guess costs ln({len(VOCABULARY)}) = {math.log(len(VOCABULARY)):.2f})")
losses = []
report_every = max(1, args.steps // 10)
for step in range(1, args.steps + 1):
    losses.append(float(wrapped.train_on_batch(*windows(train_ids, BATCH_SIZE, rng))))
    if step == 1 or step % report_every == 0 or step == args.steps:
        print(f"  step {step:>4}: loss {losses[-1]:.4f}")
held_out_after = wrapped.evaluate(*held_out, batch_size=BATCH_SIZE, verbose=0)
print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
print(f"held-out loss ({HELD_OUT_MODULE}): {held_out_before:.4f} before training, {held_out_after:.4f} after")

# 6. Greedy decoding with the wrapped model: the most likely next character, NUM_SAMPLED times.
context = list(held_out_ids[:SEQUENCE_LENGTH])
for _ in range(NUM_SAMPLED):
    window = np.array([context[-SEQUENCE_LENGTH:]], dtype="int32")
    next_logits = wrapped.predict(window, batch_size=1, verbose=0)[0, -1]
    context.append(int(np.argmax(next_logits)))
print(f"prompt (the start of {HELD_OUT_MODULE}.py): {decode(np.array(context[:SEQUENCE_LENGTH]))!r}")
print(f"greedy continuation: {decode(np.array(context[SEQUENCE_LENGTH:]))!r}")

# 7. The unwrapped model (the original architecture with the trained weights) computes the same logits.
inputs, _ = windows(held_out_ids, 4, rng)
difference = float(np.max(np.abs(np.asarray(wrapped.unwrap()(inputs)) - np.asarray(wrapped(inputs)))))
print(f"unwrapped model vs pipelined model, largest logit difference: {difference:.2e}")
print(f"done in {time.perf_counter() - started:.1f} s")

if not (losses[-1] < losses[0] and report.ok and difference < 1e-4):
    print("FAILED: the loss did not fall, a variable is off its device, or unwrap() differs")
    sys.exit(1)
