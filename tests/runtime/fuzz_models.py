"""Draws small functional Keras models, their batch, loss and optimizer for the fuzzer (tests/runtime/test_fuzz.py).

A drawn ``Case`` is plain data (its repr is a regression test): the inputs, a list of ``Step``s and how
to train. ``build`` turns it into a model deterministically. Every step is valid whatever it draws: a
step reads tensors of the pool made so far (``a`` and ``b`` count back from the newest, so 0 chains),
and where two tensors must agree in shape the second is brought to the first's (a sequence pooled, a
vector repeated along the steps, a Dense to the width). The tensors no step reads feed the first head,
so every input is used; a second head reads any tensor of the pool, and ``returned`` makes a tensor
that later steps read a model output too.

Kinds of tensors: "vec" [B, width] and "seq" [B, STEPS, width]; a "tokens" input goes through an
Embedding (``mask_zero`` for "masked_tokens") before any step reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import keras
import numpy as np
from hypothesis import strategies as st

STEPS = 5  # the length of every sequence
VOCABULARY = 10
CLASSES = 3
INPUT_KINDS = ("vec", "seq", "tokens", "masked_tokens")
# dense first: hypothesis shrinks towards the first of a sampled_from
OPS = (
    "dense",
    "conv",
    "pool",
    "layer_norm",
    "batch_norm",
    "dropout",
    "add",
    "concat",
    "tanh",
    "op_add",
    "scale",
    "shared",
    "nested",
)
REDUCTIONS = ("sum_over_batch_size", "sum", "mean_with_sample_weight")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


@dataclass(frozen=True)
class Step:
    """One layer or op: ``op`` reads pool[-1 - a] (and pool[-1 - b] for two-operand ops, counted modulo
    the pool's size); ``width`` is a new layer's width, ``flag`` an op's variant (an activation, a
    batch norm's axis 1 instead of -1, a constant 2 instead of 0.5, a kernel of 3 instead of 1)."""

    op: str
    a: int = 0
    b: int = 1
    width: int = 4
    flag: bool = False


@dataclass(frozen=True)
class Case:
    """A model and how to train it: the fuzzer's unit, printed when it fails."""

    inputs: tuple[str, ...]
    steps: tuple[Step, ...]
    second_head: int | None = None  # a pool index read by a regression head, None: one output
    returned: int | None = None  # a pool index that is also a model output (regression on its value)
    reductions: tuple[str, ...] = ("sum_over_batch_size",)  # one per output, in output order
    loss_weights: tuple[float, ...] | None = None
    sample_weight: bool = False
    l2: bool = False  # every Dense and Conv1D gets kernel_regularizer=L2(0.01)
    optimizer: str = "sgd"
    num_devices: int = 2
    num_microbatches: int = 1
    batch: int = 8
    schedule: str = "gpipe"
    recompute: str = "never"
    seed: int = 0

    @property
    def num_outputs(self) -> int:
        return 1 + (self.second_head is not None) + (self.returned is not None)

    @property
    def num_train_steps(self) -> int:
        """Two steps for an optimizer with state (slots, momentum), one for plain SGD."""
        return 1 if self.optimizer == "sgd" else 2


@st.composite
def steps(draw: st.DrawFn) -> Step:
    return Step(
        op=draw(st.sampled_from(OPS)),
        a=draw(st.integers(0, 7)),
        b=draw(st.integers(0, 7)),
        width=draw(st.sampled_from((4, 6))),
        flag=draw(st.booleans()),
    )


@st.composite
def cases(draw: st.DrawFn, max_steps: int = 6) -> Case:
    """A Case: 1-2 inputs, 1-``max_steps`` steps, 1-3 outputs, and a plan of 2-4 stages."""
    inputs = tuple(draw(st.lists(st.sampled_from(INPUT_KINDS), min_size=1, max_size=2)))
    drawn = tuple(draw(st.lists(steps(), min_size=1, max_size=max_steps)))
    second_head = draw(st.none() | st.integers(0, 7))
    returned = draw(st.none() | st.integers(0, 7))
    case = Case(inputs, drawn, second_head, returned)
    reductions = tuple(draw(st.sampled_from(REDUCTIONS)) for _ in range(case.num_outputs))
    loss_weights = draw(st.none() | st.just(tuple(np.linspace(0.5, 2.0, case.num_outputs).tolist())))
    num_microbatches = draw(st.sampled_from((1, 2, 4)))
    return Case(
        inputs=inputs,
        steps=drawn,
        second_head=second_head,
        returned=returned,
        reductions=reductions,
        loss_weights=loss_weights,
        sample_weight=draw(st.booleans()),
        l2=draw(st.booleans()),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),  # Adam on an embedding's sparse rows too (test_fuzz's regression)
        num_devices=draw(st.integers(2, 4)),
        num_microbatches=num_microbatches,
        batch=draw(st.sampled_from((8, 7, 10))),  # 7 and 10 leave a remainder at M = 2 or 4
        schedule=draw(st.sampled_from(("gpipe", "1f1b"))),
        recompute=draw(st.sampled_from(("never", "always"))),
        seed=draw(st.integers(0, 3)),
    )


# ----- building ---------------------------------------------------------------------------------


class _Builder:
    """Applies the steps of a Case to a pool of (tensor, kind) pairs."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.pool: list[tuple[object, str]] = []
        self.read: set[int] = set()  # pool indices some step read
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"s{self.count}_{what}"

    def pick(self, back: int) -> int:
        index = len(self.pool) - 1 - back % len(self.pool)
        self.read.add(index)
        return index

    def dense(self, width: int, activation: str | None = None) -> keras.layers.Dense:
        regularizer = keras.regularizers.L2(0.01) if self.case.l2 else None
        return keras.layers.Dense(width, activation=activation, kernel_regularizer=regularizer, name=self.name("dense"))

    def to_kind(self, tensor: object, kind: str, target: str) -> object:
        if kind == target:
            return tensor
        if target == "vec":
            return keras.layers.GlobalAveragePooling1D(name=self.name("pool"))(tensor)
        return keras.layers.RepeatVector(STEPS, name=self.name("repeat"))(tensor)

    def like(self, index: int, other: int) -> object:
        """pool[index] brought to the kind and width of pool[other]."""
        tensor, kind = self.pool[index]
        target, target_kind = self.pool[other]
        tensor = self.to_kind(tensor, kind, target_kind)
        if tensor.shape[-1] != target.shape[-1]:
            tensor = self.dense(target.shape[-1])(tensor)
        return tensor

    def input(self, kind: str, position: int) -> keras.KerasTensor:
        name = f"in{position}"
        if kind == "vec":
            tensor = keras.Input((6,), name=name)
        elif kind == "seq":
            tensor = keras.Input((STEPS, 4), name=name)
        else:
            tensor = keras.Input((STEPS,), dtype="int32", name=name)
        if kind in ("vec", "seq"):
            self.pool.append((tensor, kind))
        else:  # the tokens are read by their embedding only
            layer = keras.layers.Embedding(VOCABULARY, 4, mask_zero=kind == "masked_tokens", name=self.name("embed"))
            self.pool.append((layer(tensor), "seq"))
        return tensor

    def step(self, step: Step) -> None:
        i = self.pick(step.a)
        tensor, kind = self.pool[i]
        width = tensor.shape[-1]
        op = step.op
        if op in ("conv", "pool") and kind == "vec":
            op = "dense"
        if op == "dense":
            out = [self.dense(step.width, "relu" if step.flag else None)(tensor)]
        elif op == "conv":
            regularizer = keras.regularizers.L2(0.01) if self.case.l2 else None
            conv = keras.layers.Conv1D(
                step.width,
                3 if step.flag else 1,
                padding="same",
                kernel_regularizer=regularizer,
                name=self.name("conv"),
            )
            out = [conv(tensor)]
        elif op == "pool":
            out = [self.to_kind(tensor, kind, "vec")]
        elif op == "layer_norm":
            out = [keras.layers.LayerNormalization(name=self.name("layer_norm"))(tensor)]
        elif op == "batch_norm":
            norm = keras.layers.BatchNormalization(axis=1 if step.flag else -1, momentum=0.5, name=self.name("bn"))
            out = [norm(tensor)]
        elif op == "dropout":
            # masks can be compared only where the wrapped model draws them as the original does: M = 1
            rate = 0.3 if self.case.num_microbatches == 1 else 0.0
            out = [keras.layers.Dropout(rate, name=self.name("dropout"))(tensor)]
        elif op == "tanh":
            out = [keras.ops.tanh(tensor)]
        elif op == "scale":
            out = [tensor * (2.0 if step.flag else 0.5)]
        elif op in ("add", "op_add", "concat"):
            other = self.like(self.pick(step.b), i) if op != "concat" else None
            if op == "add":
                out = [keras.layers.Add(name=self.name("add"))([tensor, other])]
            elif op == "op_add":
                out = [keras.ops.add(tensor, other)]
            else:
                j = self.pick(step.b)
                other = self.to_kind(self.pool[j][0], self.pool[j][1], kind)
                out = [keras.layers.Concatenate(name=self.name("concat"))([tensor, other])]
        elif op == "shared":
            shared = self.dense(width, "tanh")
            out = [shared(tensor), shared(self.like(self.pick(step.b), i))]
        else:  # nested: a functional model called twice
            inner_in = keras.Input(tuple(tensor.shape[1:]))
            inner = keras.layers.LayerNormalization()(self.dense(width, "tanh")(inner_in))
            nested = keras.Model(inner_in, inner, name=self.name("nested"))
            out = [nested(tensor), nested(self.like(self.pick(step.b), i))]
        self.pool += [(t, "vec" if len(t.shape) == 2 else "seq") for t in out]


def build(case: Case) -> keras.Model:
    """The model a Case describes (weights drawn from ``case.seed``); its outputs are, in order: the head
    on every unread tensor, the second head, the returned tensor."""
    keras.utils.set_random_seed(case.seed)
    builder = _Builder(case)
    inputs = [builder.input(kind, i) for i, kind in enumerate(case.inputs)]
    for step in case.steps:
        builder.step(step)
    made = len(builder.pool)
    returned = None
    if case.returned is not None:
        # a vector a step made and another step read (an input is not an output; a sequence's loss would
        # not take sample weights of one per row)
        candidates = [
            i for i in sorted(builder.read) if builder.pool[i][0] not in inputs and builder.pool[i][1] == "vec"
        ]
        if candidates:
            returned = builder.pool[candidates[case.returned % len(candidates)]][0]
    leaves = [builder.to_kind(*builder.pool[i], "vec") for i in range(made) if i not in builder.read]
    second = None
    if case.second_head is not None:
        tensor, kind = builder.pool[builder.pick(case.second_head)]
        second = keras.layers.Dense(2, name="out_value")(builder.to_kind(tensor, kind, "vec"))
    merged = leaves[0] if len(leaves) == 1 else keras.layers.Concatenate(name="merge")(leaves)
    outputs = [keras.layers.Dense(CLASSES, name="out_class")(merged)]
    outputs += [t for t in (second, returned) if t is not None]
    return keras.Model(inputs, outputs if len(outputs) > 1 else outputs[0], name="fuzzed")


def effective(case: Case, model: keras.Model) -> Case:
    """The Case as built: without ``returned`` where the model had no tensor to return (its reduction dropped)."""
    if len(keras.tree.flatten(model.outputs)) == case.num_outputs:
        return case
    loss_weights = case.loss_weights[:-1] if case.loss_weights else None
    return replace(case, returned=None, reductions=case.reductions[:-1], loss_weights=loss_weights)


def batch(case: Case, model: keras.Model) -> tuple[object, object, np.ndarray | None]:
    """(x, y, sample_weight) for ``case.batch`` rows, in the model's input and output structure."""
    rng = np.random.default_rng(case.seed + 100)
    rows = case.batch
    x = []
    for kind in case.inputs:
        if kind == "vec":
            x.append(rng.normal(size=(rows, 6)).astype("float32"))
        elif kind == "seq":
            x.append(rng.normal(size=(rows, STEPS, 4)).astype("float32"))
        else:  # one token at least per row, then tokens or padding (0)
            tokens = rng.integers(1, VOCABULARY, (rows, STEPS))
            lengths = rng.integers(1, STEPS + 1, rows)
            tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
            x.append(tokens.astype("int32"))
    y = [rng.integers(0, CLASSES, rows)]
    for output in model.outputs[1:]:
        y.append(rng.normal(size=(rows, *output.shape[1:])).astype("float32"))
    weights = np.linspace(0.2, 3.0, rows).astype("float32")[::-1].copy() if case.sample_weight else None
    return (x if len(x) > 1 else x[0]), (y if len(y) > 1 else y[0]), weights


def compile_arguments(case: Case) -> dict[str, object]:
    """compile's loss, loss_weights and metrics (lists, in output order) for a fresh optimizer."""
    losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=case.reductions[0])]
    losses += [keras.losses.MeanSquaredError(reduction=r) for r in case.reductions[1:]]
    metrics = [["accuracy"]] + [["mae"]] * (case.num_outputs - 1)
    single = case.num_outputs == 1
    weights = None if case.loss_weights is None else list(case.loss_weights)
    return {
        "optimizer": optimizer(case.optimizer),
        "loss": losses[0] if single else losses,
        "loss_weights": weights[0] if single and weights else weights,
        "metrics": metrics[0] if single else metrics,
    }


def optimizer(name: str) -> keras.optimizers.Optimizer:
    """The drawn optimizer. Adam's epsilon is 1e-3, not Keras' 1e-7: Adam moves a weight by about
    ``lr * g / (|g| + epsilon)``, so a weight whose true gradient is zero (a Dense bias that only batch
    normalizations read) moves by +-lr on float32 rounding noise of 1e-9 in its gradient, which differs
    with the order of the sums. With epsilon 1e-3 a gradient difference d moves the weight by at most
    ``lr * d / 1e-3``, and equal gradients (within the tolerance) give equal weights (make test-slow's
    fuzzer found such a case: Dense, then two batch norms, Adam at M = 4, off by 3e-4)."""
    if name == "sgd":
        return keras.optimizers.SGD(0.05)
    if name == "momentum":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(0.01, epsilon=1e-3)
    return keras.optimizers.AdamW(0.01, weight_decay=0.1, epsilon=1e-3)
