"""PipelinedModel: a keras.Model whose stages run on their devices, trained with GPipe micro-batches.

One training step splits the batch into M micro-batches (sizes differ by at most one; a batch
smaller than M leaves the extra micro-batches empty and skipped), runs every micro-batch's forward
pass stage by stage, and takes the gradient of the sum of the micro-batch losses, each weighted by
its share of the batch, so the step equals one step of the original model on the whole batch::

    loss = sum over m of loss(micro-batch m) * size(m) / batch size        (Keras' mean over the batch)

All micro-batches are traced into one ``tf.function``: TensorFlow's executor runs any op whose
inputs are ready, so stage k of micro-batch m + 1 runs while stage k + 1 works on micro-batch m,
and the backward passes overlap the same way (a fill-drain, GPipe-like order that the data
dependencies, not a fixed clock, decide). Gradients are colocated with their forward ops, and
optimizer slots with their variables, so each stage's update happens on its device.

    clock →   t0    t1    t2    t3    t4
    stage 0   F0    F1    F2    F3
    stage 1         F0    F1    F2    F3          (M = 4 micro-batches, K = 2 stages)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from partitioner.errors import InputError
from partitioner.plan import Plan
from runtime.optimizer_state import compile_like
from runtime.rebuild import Rebuilt, copy_weights


@dataclass(frozen=True)
class _State:
    """Plain Python state, kept in one object so Keras' attribute tracking leaves it alone."""

    rebuilt: Rebuilt  # the staged model and its maps
    plan: Plan  # the plan it was built from
    original: Any  # the model that was wrapped (never modified)
    num_microbatches: int  # M
    stages: tuple[str, ...]  # devices in pipeline order


def _call_fn(operation: Any, device: str, training: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if training is not None and "training" in getattr(operation, "_call_context_args", {}):
            kwargs["training"] = training
        with tf.device(device):
            return operation(*args, **kwargs)

    return call


class PipelinedModel(keras.Model):  # type: ignore[misc]  # keras ships no type hints
    """A Keras model whose layers run on the devices of a plan, trained with pipelined micro-batches.

    Build one with ``runtime.plan_and_wrap(model, ...)`` or ``runtime.wrap(model, plan)``. It is
    a ``keras.Model``: compile, fit, evaluate, predict and callbacks work as usual.
    ``save(path)`` writes the original architecture with the current weights (a plain ``.keras``
    file), and ``unwrap()`` returns that model.

    Attributes:
        plan: the Plan the model was built from.
        num_microbatches: M, the micro-batches per training step.
    """

    def __init__(self, rebuilt: Rebuilt, plan: Plan, original: Any, num_microbatches: int, **kwargs: Any) -> None:
        super().__init__(name=kwargs.pop("name", f"{original.name}_pipelined"), **kwargs)
        self.staged = rebuilt.model
        self._state = _State(
            rebuilt=rebuilt,
            plan=plan,
            original=original,
            num_microbatches=num_microbatches,
            stages=tuple(plan.stages),
        )

    # ----- what it is ------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan the model was built from."""
        return self._state.plan

    @property
    def num_microbatches(self) -> int:
        """M, the number of micro-batches per training step."""
        return self._state.num_microbatches

    def device_of(self, layer: Any) -> str:
        """The device a (cloned) layer of ``self.staged`` runs on."""
        return self._state.rebuilt.device_of[id(layer)]

    # ----- forward ---------------------------------------------------------------------------------

    def call(self, inputs: Any, training: Any = None) -> Any:
        staged = self.staged
        device_of = self._state.rebuilt.device_of
        inputs = staged._standardize_inputs(inputs)
        return staged._run_through_graph(inputs, operation_fn=lambda op: _call_fn(op, device_of[id(op)], training))

    def _microbatches(self, batch: Any) -> list[tuple[Any, Any]]:
        """(start, size) of each micro-batch: sizes differ by at most one, empty ones come last.

        With a static batch size (eager calls, or a traced step whose batch dimension is known) the
        bounds are Python ints and empty micro-batches are dropped; otherwise they are tensors.
        """
        m = self.num_microbatches
        base, extra = batch // m, batch % m
        bounds, start = [], 0 if isinstance(batch, int) else tf.constant(0, batch.dtype)
        for i in range(m):
            size = base + (int(i < extra) if isinstance(batch, int) else tf.cast(i < extra, batch.dtype))
            if isinstance(size, int) and size == 0:
                break
            bounds.append((start, size))
            start = start + size
        return bounds

    def _forward_microbatches(
        self, x: Any, y: Any, sample_weight: Any, training: bool, with_loss: bool
    ) -> tuple[Any, tf.Tensor | None]:
        """Runs every micro-batch; returns (concatenated predictions, summed weighted loss or None)."""
        first = keras.tree.flatten(x)[0]
        batch = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]
        batch_f = tf.cast(batch, tf.float32)
        preds, losses = [], []

        def take(structure: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
            return keras.tree.map_structure(
                lambda t: (
                    None
                    if t is None
                    else tf.slice(t, [start] + [0] * (len(t.shape) - 1), [size] + [-1] * (len(t.shape) - 1))
                ),
                structure,
            )

        empty_pred = keras.tree.map_structure(lambda s: tf.zeros([0, *s.shape[1:]], dtype=s.dtype), self.staged.outputs)
        empty_pred = keras.tree.pack_sequence_as(self.staged._outputs_struct, keras.tree.flatten(empty_pred))

        for index, (start, size) in enumerate(self._microbatches(batch)):

            def run(start: tf.Tensor = start, size: tf.Tensor = size) -> tuple[Any, tf.Tensor]:
                x_m, y_m, w_m = take(x, start, size), take(y, start, size), take(sample_weight, start, size)
                pred = self(x_m, training=training)
                if not with_loss:
                    return pred, tf.zeros([], tf.float32)
                with tf.device(self._state.stages[-1]):
                    loss = self._compute_loss(x=x_m, y=y_m, y_pred=pred, sample_weight=w_m, training=training)
                    return pred, tf.cast(loss, tf.float32) * tf.cast(size, tf.float32) / batch_f

            if index == 0 or isinstance(size, int):
                pred, loss = run()
            else:
                pred, loss = tf.cond(size > 0, run, lambda: (empty_pred, tf.zeros([], tf.float32)))
            preds.append(pred)
            losses.append(loss)
        y_pred = keras.tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *preds)
        return y_pred, (tf.add_n(losses) if with_loss else None)

    # ----- Keras steps -----------------------------------------------------------------------------

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """keras.Model.compile, then builds the optimizer so its slots exist (on their variables'
        devices) before the first step is traced: otherwise the first step is traced twice.

        Raises:
            InputError: for ``jit_compile=True``: XLA compiles one device's graph, and per-stage
                compilation is not implemented yet. "auto" (Keras' default) is turned off.
        """
        if kwargs.get("jit_compile") is True:
            raise InputError(
                "jit_compile=True is not supported by PipelinedModel yet: XLA compiles a graph for one "
                "device, and compiling each stage separately is not implemented. Received: jit_compile=True. "
                "Use jit_compile=False (the stages still run as one TensorFlow graph)."
            )
        kwargs["jit_compile"] = False
        super().compile(*args, **kwargs)
        if self.optimizer is not None and not self.optimizer.built and self.trainable_variables:
            self.optimizer.build(self.trainable_variables)

    def compile_from_config(self, config: Any) -> None:
        """Compiles from ``get_compile_config()`` output (Keras skips models that override compile)."""
        self.compile(**keras.saving.deserialize_keras_object(config))

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred, loss = self._forward_microbatches(x, y, sample_weight, training=True, with_loss=True)
            assert loss is not None
            batch = tf.shape(keras.tree.flatten(x)[0])[0]
            self._loss_tracker.update_state(loss, sample_weight=batch)
            scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
        if self.trainable_weights:
            gradients = tape.gradient(scaled, self.trainable_weights)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, data: Any) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, loss = self._forward_microbatches(x, y, sample_weight, training=False, with_loss=True)
        batch = tf.shape(keras.tree.flatten(x)[0])[0]
        self._loss_tracker.update_state(loss, sample_weight=batch)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data: Any) -> Any:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, _ = self._forward_microbatches(x, None, None, training=False, with_loss=False)
        return y_pred

    # ----- getting the plain model back ------------------------------------------------------------

    def unwrap(self) -> Any:
        """Returns the original architecture (a new model) with the current weights.

        When this model is compiled, the result is compiled the same way and its optimizer carries
        this one's state (slots and iteration count), so ``save`` writes a checkpoint that resumes.

        Example:
            >>> plain = wrapped.unwrap()        # doctest: +SKIP
            >>> plain.save("trained.keras")     # doctest: +SKIP
        """
        original = self._state.original
        plain = keras.models.clone_model(original)
        places = _layer_pairs(original, plain)
        layers = [(clone, places[id(orig)]) for orig, clone in self._state.rebuilt.origin]
        copy_weights(layers)
        compile_like(self, plain, [(a, b) for clone, target in layers for a, b in zip(clone.weights, target.weights)])
        return plain

    def save(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes the original architecture with the current weights (and optimizer state, when
        compiled): a ``.keras`` file that ``keras.models.load_model`` loads without this library."""
        self.unwrap().save(filepath, overwrite=overwrite, **kwargs)

    def sync_original(self) -> None:
        """Copies the current weights back into the model that was wrapped."""
        copy_weights([(clone, orig) for orig, clone in self._state.rebuilt.origin])


def _layer_pairs(original: Any, copy: Any) -> dict[int, Any]:
    """{id(layer of original): the layer at the same place in copy}, nested models included."""
    pairs: dict[int, Any] = {}
    for a, b in zip(original.layers, copy.layers):
        pairs[id(a)] = b
        if isinstance(a, keras.Model):
            pairs.update(_layer_pairs(a, b))
    return pairs
