"""PipelinedModel: a keras.Model whose stages run on their devices, trained by a pipeline schedule.

A training step splits the batch into M micro-batches and runs the plan's schedule (GPipe or 1F1B,
``partitioner.schedule``) with ``runtime.executor``: each stage's forward and backward on its device,
in the schedule's order on every device, the gradients accumulated per stage on its device, then one
optimizer update whose arithmetic runs on each variable's device. The loss is Keras' loss of the whole
batch (the micro-batches' parts summed), so a step equals one step of the original model on the batch::

    loss = sum over m of loss(micro-batch m) * size(m) / batch size        (Keras' mean over the batch)
    masked outputs:  sum over m of loss(m) * valid(m) / valid of the batch  (Keras' mean over valid steps)
    reduction="sum": sum over m of loss(m); other reductions: runtime.losses

    clock →   t0    t1    t2    t3    t4    t5    t6    t7
    stage 0   F0    F1    F2    F3                      B3 ...
    stage 1         F0    F1    F2    F3    B3    B2 ...          (GPipe, M = 4 micro-batches, K = 2 stages)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from partitioner.errors import InputError
from partitioner.plan import Plan
from profiles.internals import (
    compile_loss,
    compile_metrics,
    functional_class,
    get_keras_mask,
    initial_epoch,
    keras_compile_arguments,
    keras_logits,
    loss_tracker,
    output_structure,
    replace_sublayer,
    run_through_graph,
    set_initial_epoch,
    set_keras_logits,
    set_keras_mask,
    standardize_inputs,
    takes_training,
    weighted_output_losses,
)
from profiles.walk import tied_layers
from runtime.devices import canonical
from runtime.executor import ExecutionOptions, Executor
from runtime.losses import (
    build_loss,
    check_loss_fits,
    check_loss_splits,
    microbatch_part,
    splits_exactly,
    weight_sums,
)
from runtime.metrics import ByMicrobatch, sums_over_rows, warn_stacked
from runtime.optimizer_state import (
    carry_weight_decay_exclusions,
    compile_like,
    copy_optimizer_state,
    place_updates,
    updates_sparse_rows_linearly,
)
from runtime.rebuild import Rebuilt, clone_operation, copy_weights, user_code
from runtime.replicas import check_in_step, in_step, out_of_step_raised
from runtime.stages import cut_stages
from runtime.workers import start_together


@dataclass(frozen=True)
class _State:
    """Plain Python state, kept in one object so Keras' attribute tracking leaves it alone."""

    rebuilt: Rebuilt  # the staged model and its maps
    plan: Plan  # the plan it was built from
    original: Any  # the model that was wrapped (never modified)
    executor: Executor  # runs the schedule
    stages: tuple[str, ...]  # devices in pipeline order


class NestedLayers:
    """A nested model of the original as the wrapped model holds it: the copies of its layers (the staged model
    flattens nested models). Setting ``trainable`` sets it on each of them, as Keras sets it on a nested model's
    layers; as in Keras, it counts from the next ``compile()``."""

    def __init__(self, name: str, layers: list[Any]) -> None:
        self.name = name
        self.layers = layers

    @property
    def trainable(self) -> bool:
        return all(layer.trainable for layer in self.layers)

    @trainable.setter
    def trainable(self, value: bool) -> None:
        for layer in self.layers:
            layer.trainable = value

    def _variables(self, kind: str) -> list[Any]:
        return list({id(v): v for layer in self.layers for v in getattr(layer, kind, [])}.values())

    @property
    def weights(self) -> list[Any]:
        return self._variables("weights")

    @property
    def trainable_weights(self) -> list[Any]:
        return self._variables("trainable_weights")

    @property
    def non_trainable_weights(self) -> list[Any]:
        return self._variables("non_trainable_weights")

    def count_params(self) -> int:
        return sum(int(np.prod(v.shape)) for v in self.weights)

    def get_weights(self) -> list[Any]:
        return [np.asarray(v) for v in self.weights]

    def set_weights(self, values: list[Any]) -> None:
        weights = self.weights
        if len(values) != len(weights):
            raise InputError(f"'{self.name}' holds {len(weights)} weights. Received {len(values)} values.")
        for variable, value in zip(weights, values, strict=True):
            variable.assign(value)

    def get_layer(self, name: str | None = None, index: int | None = None) -> Any:
        if index is not None:
            return self.layers[index]
        return next(layer for layer in self.layers if layer.name == name)


def _copies(layers: list[Any], clone_of: dict[int, Any]) -> list[Any]:
    """Each of ``layers`` (an original model's) as its copy in the staged model; a nested model as
    ``NestedLayers`` of its own layers' copies."""
    copies: list[Any] = []
    for layer in layers:
        if id(layer) in clone_of:
            copies.append(clone_of[id(layer)])
        elif isinstance(layer, keras.Model):
            copies.append(NestedLayers(layer.name, _copies(layer.layers, clone_of)))
    return copies


def _call_fn(operation: Any, device: str, training: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if training is not None and takes_training(operation):
            kwargs["training"] = training
        with tf.device(device):
            return operation(*args, **kwargs)

    return call


def _own_rows(outputs: Any, batch: tf.Tensor) -> Any:
    """The executor's outputs, [M * ceil(B/M), ...] -> the batch's B rows, with their Keras masks and logits
    (``Executor.with_logits``): the micro-batches' rows one after the other are the batch's in order, then the
    repeated rows."""

    def one(x: tf.Tensor) -> tf.Tensor:
        output = x[:batch]
        mask = get_keras_mask(x)
        if mask is not None:
            set_keras_mask(output, mask[:batch])
        logits = keras_logits(x)
        if logits is not None:
            set_keras_logits(output, logits[:batch])
        return output

    return keras.tree.map_structure(one, outputs)


CANCELLED_NOTE = (
    "keras-partitioner: an op of this pipelined step failed on one device, and TensorFlow reported another "
    "device's cancelled receive ('RecvAsync is cancelled') instead of the failure. TensorFlow logs the failure "
    "as 'Local rendezvous is aborting with status: ...' (a warning: TF_CPP_MIN_LOG_LEVEL=2 or more hides it); "
    "the same step on one device raises it: the unwrapped model (wrapped.unwrap()) on the same batch, or "
    "plan_and_wrap(model, devices=1, ...)."
)


LEFT_NOTE = (
    "keras-partitioner: another worker left the cluster (it ended, failed or was killed) while this one waited "
    "for it in a collective. Every worker must run the same number of steps and call fit and evaluate alike "
    "(evaluate on every worker, not only on worker 0); the other worker's log says whether it failed."
)


def _explaining(function: Any, num_stages: int, num_replicas: int) -> Any:
    """``function`` (a Keras train, test or predict function), explaining what TensorFlow raises for a pipeline or
    its replicas: ``CANCELLED_NOTE`` added to a CancelledError where the plan has several stages (an error inside
    the micro-batch loop on one device cancels the other devices' receives, and TensorFlow raises one of those
    instead of the error); with replicas, a replica out of step with another (``replicas.in_step``'s assertion)
    as one InputError, and ``LEFT_NOTE`` added where another worker left the cluster."""
    if function is None or (num_stages < 2 and num_replicas < 2):
        return function

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except tf.errors.CancelledError as error:
            _note(error, CANCELLED_NOTE)
            raise
        except tf.errors.InvalidArgumentError as error:
            line = out_of_step_raised(str(error.message)) if num_replicas > 1 else None
            if line is not None:
                raise InputError(line) from None
            raise
        except tf.errors.UnavailableError as error:
            if num_replicas > 1:
                _note(error, LEFT_NOTE)
            raise

    return run


def _note(error: BaseException, note: str) -> None:
    """Adds ``note`` to ``error`` once (Python 3.11+; on 3.10 the error goes unexplained)."""
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):
        error.add_note(note)


class PipelinedModel(keras.Model):  # type: ignore[misc]  # keras ships no type hints
    """A Keras model whose layers run on the devices of a plan, trained by a pipeline schedule.

    Build one with ``runtime.plan_and_wrap(model, ...)`` or ``runtime.wrap(model, plan)``. It is
    a ``keras.Model``: compile, fit, evaluate, predict and callbacks work as usual.
    ``compile(jit_compile=True)`` compiles each stage with XLA on its device.
    ``save(path)`` writes the original architecture with the current weights (a plain ``.keras``
    file), and ``unwrap()`` returns that model.

    Attributes:
        plan: the Plan the model was built from.
        num_microbatches: M, the micro-batches per training step.
        options: the ExecutionOptions (schedule, recompute, batch_norm, jit_compile).
        executor: what runs the schedule (its ``schedule`` prints the actions of every stage).
    """

    def __init__(self, rebuilt: Rebuilt, plan: Plan, original: Any, options: ExecutionOptions, **kwargs: Any) -> None:
        super().__init__(name=kwargs.pop("name", f"{original.name}_pipelined"), **kwargs)
        self.staged = rebuilt.model
        stages = tuple(canonical(d) for d in plan.stages)  # the spelling the rebuilt layers' devices use
        executor = Executor(rebuilt.model, cut_stages(rebuilt.model, rebuilt.device_of, stages), options)
        self._state = _State(rebuilt=rebuilt, plan=plan, original=original, executor=executor, stages=stages)
        self._evaluating = 0  # evaluate calls under way (validation runs inside fit)
        self.built = True  # its variables exist (the staged model is built): BackupAndRestore checks it

    # ----- what it is ------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan the model was built from."""
        return self._state.plan

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Not pipelined (a keras-hub task's ``generate`` runs its cache loop on the whole model): raises, saying to
        generate with ``unwrap()``, the original's class with the trained weights."""
        original = self._state.original
        has = callable(getattr(original, "generate", None))
        raise InputError(
            "PipelinedModel.generate: generation is not pipelined. "
            + (
                f"Train wrapped, then generate with the original's class and the trained weights: "
                f"wrapped.unwrap().generate(...) (a {type(original).__name__})."
                if has
                else f"The wrapped model ({type(original).__name__}) has no generate() either."
            )
        )

    def reprice(self, plan: Plan) -> None:
        """Takes ``plan`` as this model's plan: the same placement, other prices (``plan_and_wrap`` with workers
        puts each stage's all-reduce it timed in the predicted step).

        Raises:
            InputError: when ``plan`` places a node elsewhere or has other stages, micro-batches or schedule.
        """
        now = self._state.plan
        same = (plan.assignment, plan.stages, plan.num_microbatches, plan.schedule, plan.recompute) == (
            now.assignment, now.stages, now.num_microbatches, now.schedule, now.recompute,
        )  # fmt: skip
        if not same:
            raise InputError(
                "reprice takes a plan of the same placement, stages, micro-batches, schedule and recomputation as "
                "the model's: it changes what the plan predicts, not what runs. Wrap the model again for another plan."
            )
        self._state = replace(self._state, plan=plan)

    @property
    def num_microbatches(self) -> int:
        """M, the number of micro-batches per training step."""
        return self._state.executor.num_microbatches

    @property
    def options(self) -> ExecutionOptions:
        """How the steps run: M, the schedule, recomputation, batch normalization, XLA per stage."""
        return self._state.executor.options

    @property
    def executor(self) -> Executor:
        """The object that emits the schedule's actions into a training step (stages, schedule, functions)."""
        return self._state.executor

    @property
    def output_names(self) -> list[str]:
        """The original model's output names: Keras' compile names each output's loss and metrics by
        them (``label_loss``, ``label_accuracy``) and matches a dict of losses to them."""
        return list(self._state.original.output_names)

    @property
    def inputs(self) -> list[Any]:
        """The symbolic inputs of the staged model (those of the original, in its order)."""
        return list(self.staged.inputs)

    @property
    def outputs(self) -> list[Any]:
        """The symbolic outputs of the staged model (those of the original, in its order)."""
        return list(self.staged.outputs)

    @property
    def layers(self) -> list[Any]:
        """The original's layers (``original.layers``, in its order), each as its copy here: the copy on its
        device, whose weights training moves, so ``for layer in wrapped.layers[:-1]: layer.trainable = False``
        freezes what it freezes in the original. A nested model (the staged model flattens them) comes as a
        ``NestedLayers`` of its layers' copies. Keras' own ``layers`` held one layer, the staged model: that
        idiom froze nothing, and ``layers[-1].trainable = False`` everything (found by probing, stop 37)."""
        return _copies(self._state.original.layers, self._state.rebuilt.clone_of)

    def get_layer(self, name: str | None = None, index: int | None = None) -> Any:
        """A layer by index (in ``layers``, the original's order) or name: the copy on its device, whose
        weights are the ones training moves. Nested models are flattened: their layers are found by their own
        names too (``"inner_fc"`` where a name repeats across nesting levels)."""
        layers = self.layers
        if index is not None:
            return layers[index]
        for layer in layers:
            if layer.name == name:
                return layer
        return self.staged.get_layer(name=name)

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """The staged model's summary: every layer copy (nested models flattened), in the staged graph's order."""
        self.staged.summary(*args, **kwargs)

    def device_of(self, layer: Any) -> str:
        """The device a (cloned) layer of ``self.staged`` runs on."""
        return self._state.rebuilt.device_of[id(layer)]

    # ----- forward ---------------------------------------------------------------------------------

    def call(self, inputs: Any, training: Any = None) -> Any:
        staged = self.staged
        device_of = self._state.rebuilt.device_of
        inputs = standardize_inputs(staged, inputs)
        return run_through_graph(staged, inputs, operation_fn=lambda op: _call_fn(op, device_of[id(op)], training))

    def _flat_inputs(self, x: Any) -> list[tf.Tensor]:
        """The model's inputs, each on its InputLayer's device: the executor splits it into micro-batches
        there (runtime.microbatches), where the plan charges them (partitioner.cost, ``step_bytes``)."""
        flat = standardize_inputs(self.staged, x)
        placed = []
        for t, device in zip(flat, self._state.rebuilt.input_devices, strict=True):
            with tf.device(device):
                placed.append(tf.identity(t))
        return placed

    def _micro_loss(self, y: Any, y_pred: Any, sample_weight: Any, share: tf.Tensor, weight_sums: Any) -> tf.Tensor:
        """Micro-batch m's part of the batch's loss; 0 for a micro-batch without rows of the batch (a batch shorter
        than the one planned for: 6 rows in M = 4 micro-batches of 2), whose loss of no rows is NaN where the loss
        reduces over the batch axis (``"mae"`` of outputs of shape (batch,)): the logged loss was NaN (found by
        probing, stop 36), and ``TerminateOnNaN`` stopped ``fit``."""
        part = microbatch_part(
            compile_loss(self), y, y_pred, sample_weight, share, weight_sums, self.options.num_replicas
        )
        return tf.where(share > 0, part, tf.zeros_like(part))

    def loss_and_gradients(self, x: Any, y: Any = None, sample_weight: Any = None) -> tuple[tf.Tensor, list[Any]]:
        """One pipelined forward and backward of a batch, without an update.

        Returns:
            (the batch's loss, the gradients of ``self.executor.trainable_variables``, in that order).
            Useful to inspect gradients or to accumulate them by hand; ``fit`` does the same and then
            applies them. Every gradient is dense (an embedding's sparse rows summed), or None for a
            variable the loss does not reach, as a tape gives it; ``fit`` hands the optimizer an
            embedding's rows as they are, as Keras does.

        Example:
            >>> loss, grads = wrapped.loss_and_gradients(x, y)                        # doctest: +SKIP
        """
        loss, _, gradients, _ = self._state.executor.train(
            self._flat_inputs(x), y, sample_weight, self._micro_loss, _unscaled
        )
        return loss, [None if g is None else tf.convert_to_tensor(g) for g in gradients]  # sparse rows summed

    # ----- Keras steps -----------------------------------------------------------------------------

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """keras.Model.compile. ``jit_compile=True`` compiles each stage's functions with XLA on its
        device (one XLA cluster per stage: XLA runs a cluster on one device), but a stage holding a
        recurrent layer, which runs uncompiled (``xla_stages``); Keras' "auto" means False here. The
        optimizer is built at once, its slots on their variables' devices, and its update arithmetic
        is issued on each variable's device. A model whose class has a ``compile`` of its own (keras-hub's
        tasks: their "auto" optimizer, loss and metrics) is compiled with what that ``compile`` gives Keras'
        (``internals.keras_compile_arguments``): without it ``compile()`` took Keras' defaults (RMSprop where the
        task's is Adam(5e-5), found by probing, stop 36)."""
        resolved = keras_compile_arguments(self._state.original, args, kwargs)
        if resolved is not None:
            args, kwargs = (), resolved
        jit = kwargs.get("jit_compile") is True
        kwargs["jit_compile"] = False
        super().compile(*args, **kwargs)
        self._state = replace(self._state, executor=self._recut(jit_compile=jit))
        if self.optimizer is not None:
            carry_weight_decay_exclusions(self.optimizer, self.optimizer, _weight_pairs(self._state.rebuilt.origin))
            if not self.optimizer.built and self.trainable_variables:
                self.optimizer.build(self.trainable_variables)
            place_updates(self.optimizer)

    def _recut(self, **changes: Any) -> Executor:
        """A new executor (stage functions traced afresh) on the stages cut again, each with its layers' trainable
        weights as they are now, as Keras' ``compile`` takes them: a layer frozen or unfrozen after the wrap, or
        the whole model's ``trainable = False``, then ``compile()``. Cut once at the wrap, the stages trained
        what was trainable then (found by probing, stop 37: a layer unfrozen after the wrap stayed frozen, 0.059
        off after 2 epochs; ``wrapped.trainable = False`` trained every weight; a layer frozen after the wrap
        failed in Keras' optimizer with "Unknown variable"; a BatchNormalization frozen after training kept
        normalising by the batch in functions traced before)."""
        state = self._state
        stages = cut_stages(state.rebuilt.model, state.rebuilt.device_of, state.stages)
        return Executor(state.rebuilt.model, stages, replace(state.executor.options, **changes))

    def retrace(self) -> None:
        """Drops every traced function (stage functions and Keras' step functions): the next step traces afresh."""
        self._state = replace(self._state, executor=self._recut())
        self.make_train_function(force=True)
        self.make_test_function(force=True)
        self.make_predict_function(force=True)

    @property
    def stage_jit_compile(self) -> bool:
        """True iff the stages' functions are compiled with XLA where XLA can (``compile(jit_compile=True)``)."""
        return self._state.executor.options.jit_compile

    @property
    def xla_stages(self) -> tuple[bool, ...]:
        """Per stage, whether its functions are compiled with XLA: with ``jit_compile=True`` every stage but
        those holding a recurrent layer (``runtime.program.xla_blockers``: XLA cannot hand an LSTM's loop
        state to the backward), which run uncompiled, as plain Keras runs such a layer."""
        return tuple(program.jit_compile for program in self._state.executor.programs)

    def make_train_function(self, force: bool = False) -> Any:
        """keras.Model's, its step explained where TensorFlow reports a cancelled receive (``_explaining``)."""
        return self._explained("train_function", super().make_train_function, force)

    def make_test_function(self, force: bool = False) -> Any:
        """keras.Model's, explained as ``make_train_function``'s."""
        return self._explained("test_function", super().make_test_function, force)

    def make_predict_function(self, force: bool = False) -> Any:
        """keras.Model's, explained as ``make_train_function``'s."""
        return self._explained("predict_function", super().make_predict_function, force)

    def _explained(self, attribute: str, make: Any, force: bool) -> Any:
        """Keras' ``make`` of the function kept in ``attribute``, wrapped by ``_explaining`` when made anew."""
        made = getattr(self, attribute) is None or force
        make(force)
        if made:
            explained = _explaining(getattr(self, attribute), self.plan.num_stages, self.options.num_replicas)
            setattr(self, attribute, explained)
        return getattr(self, attribute)

    def compile_from_config(self, config: Any) -> None:
        """Compiles from ``get_compile_config()`` output (Keras skips models that override compile)."""
        self.compile(**keras.saving.deserialize_keras_object(config))

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """keras.Model.fit. With replicas (workers), every replica then starts from replica 0's weights,
        optimizer state and first epoch, once the callbacks' ``on_train_begin`` ran (``BackupAndRestore``
        restores each worker's own folder there, and a worker killed before its backup is an epoch
        behind the others): ``runtime.workers.start_together``."""
        if self.options.num_replicas == 1:
            return super().fit(*args, **kwargs)
        arguments = inspect.signature(super().fit).bind(*args, **kwargs).arguments
        callbacks = arguments.get("callbacks")
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.append(_StartTogether())  # after the user's, whose on_train_begin restores
            callbacks.set_model(self)
        else:
            arguments["callbacks"] = [*(callbacks or []), _StartTogether()]
        return super().fit(**arguments)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """keras.Model.evaluate. With replicas every worker must call it (its steps sum the replicas' losses and
        metrics), with the same number of steps (``_get_metrics_result_or_logs`` checks)."""
        self._evaluating += 1
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._evaluating -= 1

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        inputs = self._flat_inputs(x)
        executor = self._state.executor
        scale = self.optimizer.scale_loss if self.optimizer is not None else _unscaled
        summable = self.optimizer is None or updates_sparse_rows_linearly(self.optimizer)
        check_loss_fits(compile_loss(self), y, self._output_specs(), sample_weight)  # before the loop hides why
        problem = self._loss_split_problem(y, sample_weight)
        if problem is not None:
            raise InputError(problem)
        in_step(executor.collectives, "a training step", inputs)  # the replicas are all at a training step
        with self._first_stage():  # the targets split into micro-batches, the loop's bookkeeping
            loss, collected, gradients, rows = executor.train(
                inputs, y, sample_weight, self._micro_loss, scale, summable
            )
        if gradients:
            self.optimizer.apply(gradients, executor.trainable_variables)
        batch = tf.shape(inputs[0])[0]
        with tf.device(self._state.stages[-1]):
            loss_tracker(self).update_state(loss, sample_weight=rows)  # the global batch's rows with replicas
            # without compiled metrics nothing reads the outputs here (the stack below is pruned)
            by_microbatch = (
                self._by_microbatch(y, collected, batch, sample_weight) if compile_metrics(self) is not None else None
            )
            if by_microbatch is not None:
                by_microbatch.run(self._update_metrics(by_microbatch), tf.zeros([]))
                return self._metrics_result()
            y_pred = _own_rows(executor.model_outputs(collected), batch)
            if compile_loss(self).metrics:  # each output's loss, logged as Keras does: once, on the whole batch
                self._compiled_loss(y, y_pred, sample_weight, batch)
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return self._metrics_result()

    def _compiled_loss(self, y: Any, y_pred: Any, sample_weight: Any, batch: tf.Tensor) -> Any:
        """Keras' compiled loss on the whole batch, which also logs each output's loss (where there are several).
        With replicas each output's loss is logged weighted by this worker's rows (its valid steps, with a masked
        output), which ``_metrics_result`` sums over the workers: Keras weights it by the batch's static size, 1
        where that is unknown when traced (a tf.data batch, a short last batch), so the workers logged the plain
        mean of their shards' losses (found by probing, stop 38: 0.945 against Keras' 0.865 on shards of 10 and
        6 rows)."""
        loss = compile_loss(self)
        if self.options.num_replicas == 1 or not loss.metrics:
            return loss(y, y_pred, sample_weight)
        mask = next((m for m in map(get_keras_mask, keras.tree.flatten(y_pred)) if m is not None), None)
        weight = tf.cast(batch if mask is None else tf.reduce_sum(tf.cast(mask, tf.int32)), tf.float32)
        with weighted_output_losses(loss, [weight] * len(loss.metrics)):
            return loss(y, y_pred, sample_weight)

    def _metrics_result(self, purpose: str = "metrics") -> dict[str, Any]:
        """The step's logs, as Keras' ``get_metrics_result``; with replicas, every metric's variables are summed
        over the replicas first (one collective, on the last stage's device) and its result taken from the sums
        (``Metric.stateless_result``), as tf.distribute sums a metric's variables over its replicas: each worker
        logs the global batch's metrics and per-output losses, so callbacks that watch one act alike on every
        worker. Each worker logged its own shard's before: ``ReduceLROnPlateau(monitor="accuracy")`` set the
        replicas' learning rates apart (weights 0.027 apart after 5 epochs while both logged the same loss) and
        ``EarlyStopping`` on it stopped one worker and left the other waiting in a collective forever (found
        by probing, stop 37). The loss tracker is global already (``train_step._reduce``)."""
        if self.options.num_replicas == 1:
            return dict(self.get_metrics_result())
        tracker = loss_tracker(self)
        metrics = [m for m in self.metrics if m is not tracker]
        values = [tf.convert_to_tensor(v) for m in metrics for v in m.variables]
        kept = [v.dtype if v.dtype.is_floating else None for v in values]  # integer states summed as float64
        sent = [v if dtype is not None else tf.cast(v, tf.float64) for v, dtype in zip(values, kept)]
        summed = iter(self._state.executor.collectives[-1].sum(sent, purpose=purpose))
        logs: dict[str, Any] = {}
        for metric in self.metrics:
            if metric is tracker:
                result = metric.result()
            else:
                states = [next(summed) for _ in metric.variables]
                result = metric.stateless_result(
                    [t if t.dtype == v.dtype else tf.cast(t, v.dtype) for t, v in zip(states, metric.variables)]
                )
            if isinstance(result, dict):
                logs.update(result)
            else:
                logs[metric.name] = result
        return logs

    def _get_metrics_result_or_logs(self, logs: Any) -> Any:
        """With replicas, the last step's logs (global, ``_metrics_result``) are the epoch's and evaluate's, not
        Keras' ``get_metrics_result()`` read again outside the step, which would give this worker's own metrics
        (Keras reads them again for asynchronous steps, which these are not). Overrides a method of Keras'
        Trainer (``fit`` calls it at the end of an epoch's training steps, ``evaluate`` at its end; checked on 3.15).

        There the replicas check they all are (``replicas.check_in_step``): a worker with a step more in an epoch
        (a larger shard) would have summed its gradients with the next epoch's first step of the others, and a
        worker's extra evaluate step waited forever; now both fail with one clear error."""
        if self.options.num_replicas == 1:
            return super()._get_metrics_result_or_logs(logs)
        at = "the end of evaluate" if self._evaluating else "the end of an epoch"
        check_in_step(self._state.executor.collectives, at)
        return logs

    def _by_microbatch(self, y: Any, collected: list[Any], batch: tf.Tensor, sample_weight: Any) -> ByMicrobatch | None:
        """The batch micro-batch by micro-batch (``runtime.metrics``), where the compiled loss and metrics
        taken so give the batch's values: M > 1, targets, no output mask, no per-output loss trackers, every
        metric one that sums over rows (they are built here, as Keras' first update builds them). Else None:
        the caller stacks the outputs, as Keras takes them."""
        executor = self._state.executor
        metrics, loss = compile_metrics(self), compile_loss(self)
        if executor.num_microbatches == 1 or y is None or executor.mask is not None:
            return None
        by_microbatch = ByMicrobatch(executor, collected, y, sample_weight, batch)
        if loss is not None:  # built (evaluate may come first) to know its per-output trackers
            build_loss(loss, *by_microbatch(0))
            if loss.metrics or not splits_exactly(loss):
                return None
        if metrics is not None:
            first = by_microbatch(0)[:2]
            if not metrics.built:  # resolves "accuracy" and the like by the outputs' shapes
                metrics.build(*first)
            others = [metric for metric in metrics.metrics if not sums_over_rows(metric, *first)]
            if others:
                warn_stacked(others, executor, collected)
                return None
        return by_microbatch

    def _evaluate_microbatch(self, by_microbatch: ByMicrobatch) -> Any:
        """A ``ByMicrobatch.run`` step that adds micro-batch m's part of the batch's compiled loss to the
        total (``microbatch_part``: the parts sum to Keras' loss of the batch) and updates the metrics."""
        sums = weight_sums(by_microbatch.sample_weight)
        metrics = compile_metrics(self)

        def step(m: Any, total: tf.Tensor) -> tf.Tensor:
            y, y_pred, sample_weight = by_microbatch(m)
            part = microbatch_part(compile_loss(self), y, y_pred, sample_weight, by_microbatch.share(m), sums)
            if metrics is not None:
                metrics.update_state(y, y_pred, sample_weight)
            return total + tf.cast(part, total.dtype)

        return step

    def _update_metrics(self, by_microbatch: ByMicrobatch) -> Any:
        """A ``ByMicrobatch.run`` step that updates the compiled metrics with micro-batch m."""

        def step(m: Any, total: tf.Tensor) -> tf.Tensor:
            compile_metrics(self).update_state(*by_microbatch(m))
            return total

        return step

    def _first_stage(self) -> Any:
        """The device of the step's ops that no stage places: the targets split into micro-batches and
        the loop's bookkeeping. Without it TensorFlow's default device takes them (GPU:0 or CPU:0), which
        the plan may not use. The inputs are split where their InputLayers are (``_flat_inputs``)."""
        return tf.device(self._state.stages[0])

    def _loss_split_problem(self, y: Any, sample_weight: Any) -> str | None:
        """Why the compiled loss is not a mean or sum of per-row values where the step adds up parts
        (``runtime.losses.check_loss_splits``: M micro-batches, or replicas), or None."""
        executor = self._state.executor
        return check_loss_splits(
            compile_loss(self),
            y,
            self._output_specs(),
            sample_weight,
            executor.num_microbatches,
            self.options.num_replicas,
            output_names=list(executor.model.output_names),
        )

    def _output_specs(self) -> Any:
        """The model's outputs as KerasTensors, in its output structure (for ``check_loss_fits``)."""
        model = self._state.executor.model
        return keras.tree.pack_sequence_as(output_structure(model), list(model.outputs))

    def test_step(self, data: Any) -> Any:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        inputs = self._flat_inputs(x)
        executor = self._state.executor
        check_loss_fits(compile_loss(self), y, self._output_specs(), sample_weight)
        problem = self._loss_split_problem(y, sample_weight)
        if problem is not None and self.options.num_replicas > 1:
            raise InputError(problem)  # each replica's loss is averaged by rows
        in_step(executor.collectives, "an evaluate (or validation) step", inputs)
        with self._first_stage():
            collected, layer_loss = executor.forward(inputs, losses=True)
        batch = tf.shape(inputs[0])[0]
        with tf.device(self._state.stages[-1]):
            # the compiled loss and this forward's layer losses (add_loss, activity regularizers). Not Keras'
            # compute_loss: it adds self.losses, what the layers kept from the model's last call outside a
            # step (an eager call leaves its values there; Keras drops them at the next call, which no step makes)
            by_microbatch = (  # a loss that does not split (problem) is taken on the whole batch, as Keras takes it
                self._by_microbatch(y, collected, batch, sample_weight)
                if compile_loss(self) is not None and problem is None
                else None
            )
            if by_microbatch is not None:  # each micro-batch's part of the loss, summed, and its metrics
                loss, y_pred = by_microbatch.run(self._evaluate_microbatch(by_microbatch), tf.zeros([])), None
            else:
                y_pred = _own_rows(executor.model_outputs(collected), batch)
                loss = None if compile_loss(self) is None else self._compiled_loss(y, y_pred, sample_weight, batch)
            if layer_loss is not None:
                loss = layer_loss if loss is None else loss + tf.cast(layer_loss, loss.dtype)
            if loss is None:
                raise InputError("No loss to evaluate: compile(loss=...) first, as Keras' evaluate needs one.")
            # the loss is a mean over rows, or over valid steps where the outputs carry a mask (one mask)
            masks = [] if y_pred is None else map(get_keras_mask, keras.tree.flatten(y_pred))
            mask = next((m for m in masks if m is not None), None)
            loss, rows = executor.mean_over_replicas(
                loss, batch if mask is None else tf.reduce_sum(tf.cast(mask, tf.float32)), batch
            )
        penalty = executor.weight_penalties()  # as Keras' compute_loss adds them (the same on every replica)
        with tf.device(self._state.stages[-1]):
            if penalty is not None:
                loss = loss + tf.cast(penalty, loss.dtype)
            loss_tracker(self).update_state(loss, sample_weight=rows)  # the global batch's rows with replicas
            if y_pred is not None:  # else the metrics were updated micro-batch by micro-batch
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return self._metrics_result("evaluate_metrics")

    def predict_step(self, data: Any) -> Any:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        inputs = self._flat_inputs(x)
        executor = self._state.executor
        with self._first_stage():
            collected, _ = executor.forward(inputs)
        with tf.device(self._state.stages[-1]):
            return _own_rows(executor.model_outputs(collected), tf.shape(inputs[0])[0])

    # ----- getting the plain model back ------------------------------------------------------------

    def unwrap(self) -> Any:
        """Returns the original architecture (a new model) with the current weights.

        When this model is compiled, the result is compiled the same way and its optimizer carries
        this one's state (slots and iteration count), so ``save`` writes a checkpoint that resumes.

        Example:
            >>> plain = wrapped.unwrap()        # doctest: +SKIP
            >>> plain.save("trained.keras")     # doctest: +SKIP
        """
        plain, layers = self._plain_twin()
        copy_weights(layers)
        compile_like(self, plain, _weight_pairs(layers))
        return plain

    def _plain_twin(self, every_place: bool = True) -> tuple[Any, list[tuple[Any, Any]]]:
        """A new model of the original architecture, and (clone of this model, its layer there) pairs.

        A layer the original uses at two nesting levels (at the top and inside a nested model) is two
        layers in the copy (Keras' cloning and loading make the nested model anew): with
        ``every_place`` each of them is paired with the clone, else only the last one."""
        original = self._state.original
        plain = _copy_architecture(original)
        places = _layer_pairs(original, plain)
        return plain, [
            (clone, target)
            for orig, clone in self._state.rebuilt.origin
            for target in (places[id(orig)] if every_place else places[id(orig)][-1:])
        ]

    def get_config(self) -> dict[str, Any]:
        """Refused in one line: a wrapped model is made from a plan and devices, not from a config. Keras asks for
        it when a model that holds this one as a layer is saved or cloned (it raised its own NotImplementedError,
        "must override get_config()", found by probing, stop 37); ``save`` writes the original architecture."""
        raise InputError(
            f"'{self.name}' (PipelinedModel) has no config to save: it is built from a plan and its devices. "
            "Expected the original architecture: save this model itself (wrapped.save writes the plain model), or "
            "use wrapped.unwrap() as the layer of a model to save."
        )

    def save(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes the original architecture with the current weights (and optimizer state, when
        compiled): a ``.keras`` file that ``keras.models.load_model`` loads without this library."""
        self.unwrap().save(filepath, overwrite=overwrite, **kwargs)

    def save_weights(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes the current weights as the original architecture's (and the optimizer state, when
        compiled, as Keras does): ``original.load_weights(filepath)`` reads the file without this
        library, and so does ``load_weights`` of any model wrapped from that architecture.
        ``ModelCheckpoint(save_weights_only=True)`` calls this.

        Example:
            >>> wrapped.save_weights("step.weights.h5")     # doctest: +SKIP
            >>> original.load_weights("step.weights.h5")    # doctest: +SKIP
        """
        self.unwrap().save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath: Any, skip_mismatch: bool = False, **kwargs: Any) -> None:
        """Reads weights saved from the original architecture (by ``save_weights`` of this model, of
        another model wrapped from it, or of the plain model itself; a ``.keras`` file works too), and
        the optimizer state the file holds when this model is compiled. Needs no step to have run.

        Example:
            >>> fresh = runtime.wrap(model, plan)            # doctest: +SKIP
            >>> fresh.load_weights("step.weights.h5")        # doctest: +SKIP
        """
        plain, layers = self._plain_twin(every_place=False)
        copy_weights(layers)  # what the file does not hold stays as it is (a weights file has no assets: vocabularies)
        compile_like(self, plain, [])  # an optimizer of the same kind, for the state the file holds
        plain.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        copy_weights([(target, clone) for clone, target in layers])
        if getattr(plain, "optimizer", None) is not None and plain.optimizer.built and self.optimizer is not None:
            copy_optimizer_state(plain.optimizer, self.optimizer, [(b, a) for a, b in _weight_pairs(layers)])

    def sync_original(self) -> None:
        """Copies the current weights back into the model that was wrapped."""
        copy_weights([(clone, orig) for orig, clone in self._state.rebuilt.origin])


class _StartTogether(keras.callbacks.Callback):  # type: ignore[misc]
    """The last callback of a fit with replicas: they take replica 0's state and first epoch."""

    def on_train_begin(self, logs: Any = None) -> None:
        # Keras reads the first epoch once, after on_train_begin; BackupAndRestore sets it there
        set_initial_epoch(self.model, start_together(self.model, initial_epoch(self.model)))


def _weight_pairs(layers: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """(variable of a clone, the same variable of the plain model) for every weight of the layer pairs."""
    return [(a, b) for clone, target in layers for a, b in zip(clone.weights, target.weights)]


def _unscaled(loss: tf.Tensor) -> tf.Tensor:
    """The loss as it is (no optimizer's loss scaling); one function, so the traced loss function is reused."""
    return loss


def _copy_architecture(model: Any) -> Any:
    """A new model of ``model``'s own class and architecture (weights not copied, not compiled).

    A functional model of a class of its own (a keras-hub ``GPT2CausalLM`` or ``BertBackbone``) is
    made again from its config, so the user gets their class back, with its methods; a plain
    Functional or Sequential model, and a class that cannot be made from its config (a subclass
    without ``get_config``, which Keras' own ``save`` refuses too), is cloned with
    ``keras.models.clone_model``: a functional model of the same layers, each copied by
    ``clone_operation`` (a Lambda keeps the user's function), nested models likewise; a layer that
    holds a layer copied before it (a tied weight, ``profiles.walk.tied_layers``) holds that copy.
    """
    plain_classes = (keras.Model, functional_class(), keras.Sequential)
    originals: dict[int, Any] = {}  # id(layer copied so far) -> the layer
    copies: dict[int, Any] = {}  # id(layer copied so far) -> its copy

    def clone_model(model: Any) -> Any:
        with _uncompiled(model):
            return keras.models.clone_model(model, clone_function=clone)

    def clone(layer: Any) -> Any:
        if type(layer) in plain_classes:
            return clone_model(layer)
        copy = clone_operation(layer, layer.name)
        originals[id(layer)], copies[id(layer)] = layer, copy
        return copy

    def tied(copy: Any) -> Any:
        """``copy`` with each layer that holds another copied layer holding that one's copy (a tied weight)."""
        for key, layer in originals.items():
            for attribute, held in tied_layers(layer, originals).items():
                replace_sublayer(copies[key], attribute, copies[id(held)])
        return copy

    with user_code(model):  # the user's own model, in memory: their functions, not an untrusted file's
        if type(model) not in plain_classes:
            try:
                return type(model).from_config(model.get_config())
            except (TypeError, ValueError, KeyError, NotImplementedError):
                pass
        return tied(clone_model(model))


@contextmanager
def _uncompiled(model: Any) -> Iterator[None]:
    """``model`` counts as not compiled for a moment: ``keras.models.clone_model`` compiles its copy from
    the model's compile config through Keras' serialization, which cannot find a plain Python function
    (``loss=my_loss``) by its name. The copy is compiled after, as the wrapped model is (``compile_like``)."""
    compiled = model.compiled
    model.compiled = False
    try:
        yield
    finally:
        model.compiled = compiled


def _layer_pairs(original: Any, copy: Any, pairs: dict[int, list[Any]] | None = None) -> dict[int, list[Any]]:
    """{id(layer of original): every layer at its places in copy}, nested models included."""
    pairs = {} if pairs is None else pairs
    for a, b in zip(original.layers, copy.layers):
        places = pairs.setdefault(id(a), [])
        if not any(b is p for p in places):
            places.append(b)
        if isinstance(a, keras.Model):
            _layer_pairs(a, b, pairs)
    return pairs
