"""Trains a small GPT-style decoder split into pipeline stages across 4 virtual devices.

What it shows: a decoder-only transformer whose blocks are custom ``keras.layers.Layer``
subclasses (causal multi-head attention + MLP, pre-LayerNorm, residuals) is planned and
rebuilt by ``runtime.plan_and_wrap``. The runtime re-creates every layer on its device from
``get_config()`` / ``from_config()``, so custom layers need both (and
``@keras.saving.register_keras_serializable`` so the trained model saves and loads as a plain
``.keras`` file). The plan is printed, then the loss falls over a few dozen training steps.

Data: SYNTHETIC token sequences, made here: counting sequences modulo the vocabulary,
``t, t + s, t + 2s, ...`` with a random start ``t`` and a random step ``s`` in {1, 2, 3, 5}.
After two tokens the next one is predictable, so a language model can drive the loss from
ln(64) = 4.16 towards 0.

Run:
    .venv/bin/python examples/transformer_pipeline.py            # 40 training steps
    .venv/bin/python examples/transformer_pipeline.py --quick    # 12 steps (the smoke test)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported

import keras
import numpy as np
from rich.console import Console

from partitioner.show.report import device_table, summary_table
from runtime import make_virtual_devices, placement_report, plan_and_wrap

NUM_DEVICES = 4
VOCAB_SIZE = 64
SEQUENCE_LENGTH = 32
MODEL_DIM = 64
NUM_HEADS = 4
NUM_BLOCKS = 4
BATCH_SIZE = 32
NUM_MICROBATCHES = 4

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="fewer training steps, for the smoke test")
args = parser.parse_args()
num_steps = 12 if args.quick else 40
console = Console(width=None if sys.stdout.isatty() else 120)  # wide tables when piped
started = time.perf_counter()

# 1. Four logical CPU devices. Importing TensorFlow is fine; this must run before any TensorFlow op.
devices = make_virtual_devices(NUM_DEVICES)
console.print(f"[bold]Devices:[/] {devices}")

keras.utils.set_random_seed(0)


# 2. The custom layers. get_config returns every constructor argument, so from_config rebuilds them.
@keras.saving.register_keras_serializable(package="examples")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned embedding of each position."""

    def __init__(self, vocab_size: int, sequence_length: int, model_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.sequence_length, self.model_dim = vocab_size, sequence_length, model_dim
        self.tokens = keras.layers.Embedding(vocab_size, model_dim, name="tokens")
        self.positions = keras.layers.Embedding(sequence_length, model_dim, name="positions")

    def call(self, token_ids):
        positions = keras.ops.arange(keras.ops.shape(token_ids)[-1])
        return self.tokens(token_ids) + self.positions(positions)

    def get_config(self):
        config = super().get_config()
        config.update(vocab_size=self.vocab_size, sequence_length=self.sequence_length, model_dim=self.model_dim)
        return config


@keras.saving.register_keras_serializable(package="examples")
class DecoderBlock(keras.layers.Layer):
    """Pre-LayerNorm GPT block: x + attention(LN(x)) with a causal mask, then x + MLP(LN(x))."""

    def __init__(self, model_dim: int, num_heads: int, mlp_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.model_dim, self.num_heads, self.mlp_dim = model_dim, num_heads, mlp_dim
        self.norm_1 = keras.layers.LayerNormalization(epsilon=1e-5, name="norm_1")
        self.attention = keras.layers.MultiHeadAttention(num_heads, model_dim // num_heads, name="attention")
        self.norm_2 = keras.layers.LayerNormalization(epsilon=1e-5, name="norm_2")
        self.mlp_in = keras.layers.Dense(mlp_dim, activation="gelu", name="mlp_in")
        self.mlp_out = keras.layers.Dense(model_dim, name="mlp_out")

    def call(self, x):
        h = self.norm_1(x)
        x = x + self.attention(h, h, use_causal_mask=True)  # position i attends to positions <= i only
        return x + self.mlp_out(self.mlp_in(self.norm_2(x)))

    def get_config(self):
        config = super().get_config()
        config.update(model_dim=self.model_dim, num_heads=self.num_heads, mlp_dim=self.mlp_dim)
        return config


# 3. The decoder: embedding -> NUM_BLOCKS blocks -> LayerNorm -> LM head (logits over the vocabulary).
token_ids = keras.Input((SEQUENCE_LENGTH,), dtype="int32", name="token_ids")
x = TokenAndPositionEmbedding(VOCAB_SIZE, SEQUENCE_LENGTH, MODEL_DIM, name="embedding")(token_ids)
for block in range(NUM_BLOCKS):
    x = DecoderBlock(MODEL_DIM, NUM_HEADS, 4 * MODEL_DIM, name=f"block_{block}")(x)
x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
logits = keras.layers.Dense(VOCAB_SIZE, name="lm_head")(x)
model = keras.Model(token_ids, logits, name="tiny_gpt")
console.print(
    f"[bold]Model:[/] {model.name}: {NUM_BLOCKS} decoder blocks, width {MODEL_DIM}, {NUM_HEADS} heads, "
    f"vocabulary {VOCAB_SIZE}, context {SEQUENCE_LENGTH}; {model.count_params():,} parameters"
)


# 4. Synthetic data: counting sequences modulo VOCAB_SIZE. Targets are the inputs shifted by one.
def counting_sequences(num_sequences: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    starts = rng.integers(0, VOCAB_SIZE, size=(num_sequences, 1))
    steps = rng.choice([1, 2, 3, 5], size=(num_sequences, 1))
    tokens = (starts + steps * np.arange(SEQUENCE_LENGTH + 1)) % VOCAB_SIZE
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")


rng = np.random.default_rng(0)
console.print(
    "[bold]Data:[/] SYNTHETIC counting sequences (t, t+s, t+2s, ... mod 64, s in {1, 2, 3, 5}), "
    f"a fresh batch of {BATCH_SIZE} each step",
    highlight=False,
)
console.print(f"example: {counting_sequences(1, rng)[0][0, :12].tolist()} ...", highlight=False)

# 5. Plan the split into pipeline stages and rebuild the decoder on the devices.
#    Each device is given 14 MiB, less than the 14.7 MiB the planner counts for the model (weights,
#    Adam's slots, gradients, activations): it must be split to fit, whatever this machine's cores
#    make of the speed.
wrapped = plan_and_wrap(
    model, devices=NUM_DEVICES, batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, memory="14MiB"
)
plan = wrapped.plan
for stage, device in enumerate(plan.stages):
    console.print(f"stage {stage} on {device}: {', '.join(plan.nodes_on(device))}")
console.print(device_table(plan))
console.print(summary_table(plan))
report = placement_report(wrapped)
console.print(f"every variable on its planned device: {report.ok}")

# 6. Train: each train_on_batch is one pipelined step of NUM_MICROBATCHES micro-batches.
wrapped.compile(
    optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
)
console.print(
    f"[bold]Training[/] {num_steps} steps (loss at the start is about ln({VOCAB_SIZE}) = {math.log(VOCAB_SIZE):.2f})"
)
losses = []
for step in range(1, num_steps + 1):
    inputs, targets = counting_sequences(BATCH_SIZE, rng)
    losses.append(float(wrapped.train_on_batch(inputs, targets)))
    if step == 1 or step % 4 == 0 or step == num_steps:
        console.print(f"  step {step:>3}: loss {losses[-1]:.4f}")
console.print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")

# 7. No data lost: the unwrapped model (the original architecture with the trained weights) agrees.
inputs, _ = counting_sequences(4, rng)
plain = wrapped.unwrap()
difference = float(np.max(np.abs(np.asarray(plain(inputs)) - np.asarray(wrapped(inputs)))))
console.print(f"unwrapped model vs pipelined model, largest logit difference: {difference:.2e}")
console.print(f"done in {time.perf_counter() - started:.1f} s")

if not (losses[-1] < losses[0] and report.ok and difference < 1e-4):
    console.print("[bold red]FAILED:[/] the loss did not fall, a variable is off its device, or unwrap() differs")
    sys.exit(1)
