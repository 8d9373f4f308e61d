"""Draws small functional Keras models, their batch, loss and optimizer for the fuzzer (tests/runtime/test_fuzz.py).

A drawn ``Case`` is plain data (its repr is a regression test): the inputs, a list of ``Step``s and how
to train. ``build`` turns it into a model deterministically. Every step is valid whatever it draws: a
step reads tensors of the pool made so far (``a`` and ``b`` count back from the newest, so 0 chains),
and where two tensors must agree in shape the second is brought to the first's (a sequence pooled, a
vector repeated along the steps, a Dense to the width). The tensors no step reads feed the first head,
so every input is used; a second head reads any tensor of the pool, and ``returned`` makes a tensor
that later steps read a model output too.

Kinds of tensors: "vec" [B, width], "seq" [B, STEPS, width] and "image" [B, STEPS, SIDE, width]; a
"tokens" input goes through an Embedding (``mask_zero`` for "masked_tokens") before any step reads it.
On an image "conv" is a Conv2D and "pool" a 2-D pooling; "positions" adds a position embedding looked up
with the same ids for every sample (``AddPositions``, as ViT's) to a sequence.

The outputs, in order (``heads``): a classifier over every unread tensor, perhaps a regression head, perhaps
a returned tensor. A sequence tagger (``tagger``) is the only output instead: per-step classes over a
sequence that carries an Embedding's mask, joined with every unread tensor, so that the mask reaches the
output and its loss (the runtime refuses a masked output beside unmasked ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import keras
import numpy as np
from hypothesis import strategies as st

STEPS = 5  # the length of every sequence, the height of every image
SIDE = 4  # the width of every image
VOCABULARY = 10
CLASSES = 3
INPUT_KINDS = ("vec", "seq", "tokens", "masked_tokens", "image")
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
    "positions",
)
REDUCTIONS = ("sum_over_batch_size", "sum", "mean_with_sample_weight")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
PLANNERS = ("uniform", "solver")
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0}  # for ``Case.class_weight``


@dataclass(frozen=True)
class Step:
    """One layer or op: ``op`` reads pool[-1 - a] (and pool[-1 - b] for two-operand ops, counted modulo
    the pool's size); ``width`` is a new layer's width, ``flag`` an op's variant (an activation, a
    batch norm's axis 1 instead of -1, a constant 2 instead of 0.5, a kernel of 3 instead of 1, an
    image's max pooling that keeps its shape instead of a global average)."""

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
    tagger: int | None = None  # the only output is a tagger over this masked sequence (second_head, returned unused)
    reductions: tuple[str, ...] = ("sum_over_batch_size",)  # one per output, in output order
    loss_weights: tuple[float, ...] | None = None
    sample_weight: bool = False
    class_weight: bool = False  # train_on_batch(class_weight=CLASS_WEIGHT): one output, no sample weights
    l2: bool = False  # every Dense and Conv1D gets kernel_regularizer=L2(0.01)
    optimizer: str = "sgd"
    num_devices: int = 2
    num_microbatches: int = 1
    batch: int = 8
    schedule: str = "gpipe"
    recompute: str = "never"
    seed: int = 0
    planner: str = "uniform"  # "uniform": the baseline; "solver": plan_and_wrap, pinned to cut (test_fuzz._plan)
    jit_compile: bool = False  # compile(jit_compile=True): XLA per stage, and for the original's step
    mixed_precision: bool = False  # built and trained under the global policy "mixed_float16"

    @property
    def heads(self) -> tuple[str, ...]:
        """What each output is, in output order: "class", "value", "returned", or "tags" alone."""
        if self.tagger is not None:
            return ("tags",)
        optional = (("value", self.second_head), ("returned", self.returned))
        return ("class", *(head for head, index in optional if index is not None))

    @property
    def num_outputs(self) -> int:
        return len(self.heads)

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
    tagger = draw(st.sampled_from((None, None, None, 0, 1, 2, 3)))  # three cases of seven: no tagger
    # Keras takes class weights for one output only, and neither kind of weights for a tagger's per-step loss
    weighting = "none" if tagger is not None else draw(st.sampled_from(("none", "sample", "class")))
    if tagger is not None or weighting == "class":
        second_head = returned = None
        if "masked_tokens" not in inputs:
            inputs = ("masked_tokens", *inputs[:1])
    case = Case(inputs, drawn, second_head, returned, tagger)
    # a masked output's loss must be a mean over the valid steps (others are refused: runtime/losses.py)
    reduction = st.just(REDUCTIONS[0]) if tagger is not None else st.sampled_from(REDUCTIONS)
    reductions = tuple(draw(reduction) for _ in range(case.num_outputs))
    loss_weights = draw(st.none() | st.just(tuple(np.linspace(0.5, 2.0, case.num_outputs).tolist())))
    num_microbatches = draw(st.sampled_from((1, 2, 4)))
    # XLA compiles slowly, in float16 on CPU more so: an eighth each, never both
    precision = draw(st.sampled_from(("float32",) * 6 + ("jit", "mixed_float16")))
    return Case(
        inputs=inputs,
        steps=drawn,
        second_head=second_head,
        returned=returned,
        tagger=tagger,
        reductions=reductions,
        loss_weights=loss_weights,
        sample_weight=weighting == "sample",
        class_weight=weighting == "class",
        l2=draw(st.booleans()),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),  # Adam on an embedding's sparse rows too (test_fuzz's regression)
        num_devices=draw(st.integers(2, 4)),
        num_microbatches=num_microbatches,
        batch=draw(st.sampled_from((8, 7, 10))),  # 7 and 10 leave a remainder at M = 2 or 4
        schedule=draw(st.sampled_from(("gpipe", "1f1b"))),
        recompute=draw(st.sampled_from(("never", "always"))),
        seed=draw(st.integers(0, 3)),
        planner=draw(st.sampled_from(PLANNERS)),
        jit_compile=precision == "jit",
        mixed_precision=precision == "mixed_float16",
    )


# ----- building ---------------------------------------------------------------------------------


class AddPositions(keras.layers.Layer):
    """Adds a position embedding looked up with the same ids for every sample (as ViT's; as
    tests/runtime/test_optimizers.py has it)."""

    def build(self, shape) -> None:
        self.positions = keras.layers.Embedding(shape[1], shape[2], name="positions")
        self.positions.build((1, shape[1]))

    def call(self, x):
        ids = keras.ops.arange(keras.ops.shape(x)[1])[None, :]
        return x + self.positions(ids)


def _kind(tensor: object) -> str:
    return {2: "vec", 3: "seq", 4: "image"}[len(tensor.shape)]


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
        """A vector repeated along the steps (and an image's side), a sequence pooled or repeated along the
        side, an image pooled or reshaped to steps of side x width."""
        if kind == target:
            return tensor
        if target == "vec":
            pool = keras.layers.GlobalAveragePooling1D if kind == "seq" else keras.layers.GlobalAveragePooling2D
            return pool(name=self.name("pool"))(tensor)
        if kind == "image":  # to a sequence
            return keras.layers.Reshape((STEPS, SIDE * tensor.shape[-1]), name=self.name("reshape"))(tensor)
        if kind == "vec":
            tensor = keras.layers.RepeatVector(STEPS, name=self.name("repeat"))(tensor)
        if target == "seq":
            return tensor
        tensor = keras.layers.Reshape((STEPS, 1, tensor.shape[-1]), name=self.name("reshape"))(tensor)
        return keras.layers.UpSampling2D((1, SIDE), name=self.name("upsample"))(tensor)

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
        elif kind == "image":
            tensor = keras.Input((STEPS, SIDE, 3), name=name)
        else:
            tensor = keras.Input((STEPS,), dtype="int32", name=name)
        if kind in ("vec", "seq", "image"):
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
        if (op in ("conv", "pool") and kind == "vec") or (op == "positions" and kind != "seq"):
            op = "dense"
        if op == "dense":
            out = [self.dense(step.width, "relu" if step.flag else None)(tensor)]
        elif op == "conv":
            regularizer = keras.regularizers.L2(0.01) if self.case.l2 else None
            conv = (keras.layers.Conv1D if kind == "seq" else keras.layers.Conv2D)(
                step.width,
                3 if step.flag else 1,
                padding="same",
                kernel_regularizer=regularizer,
                name=self.name("conv"),
            )
            out = [conv(tensor)]
        elif op == "pool" and kind == "image" and step.flag:
            out = [keras.layers.MaxPooling2D(3, strides=1, padding="same", name=self.name("max_pool"))(tensor)]
        elif op == "pool":
            out = [self.to_kind(tensor, kind, "vec")]
        elif op == "positions":
            out = [AddPositions(name=self.name("positions"))(tensor)]
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
        self.pool += [(t, _kind(t)) for t in out]


def build(case: Case) -> keras.Model:
    """The model a Case describes (weights drawn from ``case.seed``); its outputs are, in order: the head
    on every unread tensor, the second head, the tagger, the returned tensor."""
    keras.utils.set_random_seed(case.seed)
    builder = _Builder(case)
    inputs = [builder.input(kind, i) for i, kind in enumerate(case.inputs)]
    for step in case.steps:
        builder.step(step)
    made = len(builder.pool)
    if case.tagger is not None:
        return keras.Model(inputs, _tagger(builder, case.tagger, made), name="fuzzed")
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


def _tagger(builder: _Builder, tagger: int, made: int) -> object:
    """Per-step classes over pool[tagger] among the sequences with a mask (an Embedding's with mask_zero,
    through the layers that pass it on; else any sequence), joined with every unread tensor (Concatenate
    keeps the mask)."""
    sequences = [i for i in range(made) if builder.pool[i][1] == "seq"]
    masked = [i for i in sequences if getattr(builder.pool[i][0], "_keras_mask", None) is not None]
    candidates = masked or sequences
    if candidates:
        chosen = candidates[tagger % len(candidates)]
        tensor = builder.pool[chosen][0]
    else:
        chosen, tensor = None, builder.to_kind(*builder.pool[-1], "seq")
    unread = [i for i in range(made) if i not in builder.read and i != chosen]
    joined = [tensor] + [builder.to_kind(*builder.pool[i], "seq") for i in unread]
    merged = joined[0] if len(joined) == 1 else keras.layers.Concatenate(name="merge")(joined)
    return keras.layers.Dense(CLASSES, name="out_tags")(merged)


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
        elif kind == "image":
            x.append(rng.normal(size=(rows, STEPS, SIDE, 3)).astype("float32"))
        else:  # one token at least per row, then tokens or padding (0)
            tokens = rng.integers(1, VOCABULARY, (rows, STEPS))
            lengths = rng.integers(1, STEPS + 1, rows)
            tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
            x.append(tokens.astype("int32"))
    outputs = keras.tree.flatten(model.outputs)
    assert len(outputs) == case.num_outputs, (len(outputs), case.heads)
    y = []
    for head, output in zip(case.heads, outputs, strict=True):
        if head in ("class", "tags"):
            y.append(rng.integers(0, CLASSES, (rows, *output.shape[1:-1])))
        else:
            y.append(rng.normal(size=(rows, *output.shape[1:])).astype("float32"))
    weights = np.linspace(0.2, 3.0, rows).astype("float32")[::-1].copy() if case.sample_weight else None
    return (x if len(x) > 1 else x[0]), (y if len(y) > 1 else y[0]), weights


def compile_arguments(case: Case) -> dict[str, object]:
    """compile's loss, loss_weights and metrics (lists, in output order) for a fresh optimizer."""
    losses = [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        if head in ("class", "tags")
        else keras.losses.MeanSquaredError(reduction=reduction)
        for head, reduction in zip(case.heads, case.reductions, strict=True)
    ]
    metrics = [["accuracy"] if head in ("class", "tags") else ["mae"] for head in case.heads]
    single = case.num_outputs == 1
    weights = None if case.loss_weights is None else list(case.loss_weights)
    chosen = optimizer(case.optimizer)
    if case.mixed_precision:
        # Keras' default scale, 2 ** 15, makes a float16 gradient sum over the whole batch overflow where the
        # micro-batches' shorter sums do not: Keras skips the step, the wrapped model rightly takes it (found
        # by make test-slow; test_fuzz's mixed_precision_near_overflow). A smaller scale keeps both finite.
        chosen = keras.optimizers.LossScaleOptimizer(chosen, initial_scale=2.0**8)
    return {
        "optimizer": chosen,
        "loss": losses[0] if single else losses,
        "loss_weights": weights[0] if single and weights else weights,
        "metrics": metrics[0] if single else metrics,
        "jit_compile": case.jit_compile,
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
