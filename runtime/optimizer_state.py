"""Carries optimizer state (slots, iteration count) between a model and its pipelined twin.

Keras names each optimizer slot after the variable it belongs to: the slot "momentum" of the
variable at path "dense/kernel" is called "dense_kernel_momentum". Given pairs of corresponding
model variables, this module copies every slot across by that rule, plus the optimizer's own
counters, so a checkpoint of either model resumes training on the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from partitioner.errors import InputError
from profiles.internals import (
    backing_value,
    compile_config,
    metric_function,
    metric_function_kwargs,
    set_weight_decay_exclusions,
    set_weight_decay_function,
    variable_key,
    weight_decay_exclusions,
    weight_decay_function,
)


def updates_sparse_rows_linearly(optimizer: Any) -> bool:
    """True iff ``optimizer`` updates a variable from an embedding's sparse gradient (IndexedSlices, one
    row per token) as from the rows summed first: plain SGD, momentum and weight decay included, without
    clipping. Adam, RMSprop, Adagrad and the like square (or clip) each row before Keras sums repeated
    rows, so they differ. A loss-scaling wrapper is judged by the optimizer it wraps."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    clipping = any(getattr(inner, name, None) is not None for name in ("clipnorm", "global_clipnorm", "clipvalue"))
    return type(inner) is keras.optimizers.SGD and not clipping


def _prefix(variable: Any) -> str:
    return f"{variable.path.replace('/', '_')}_"


def copy_optimizer_state(source: Any, destination: Any, pairs: Iterable[tuple[Any, Any]]) -> int:
    """Copies ``source``'s optimizer state into ``destination`` for matching model variables.

    Args:
        source: a built Keras optimizer.
        destination: a built Keras optimizer of the same class and configuration.
        pairs: (variable seen by source, corresponding variable seen by destination).

    Returns:
        The number of optimizer variables copied.
    """
    destination_vars = {v.name: v for v in destination.variables}
    done: set[int] = set()  # ids of the source's and destination's variables copied as slots
    for src_var, dst_var in pairs:
        src_prefix, dst_prefix = _prefix(src_var), _prefix(dst_var)
        for slot in source.variables:
            if slot.name.startswith(src_prefix):
                target = destination_vars.get(dst_prefix + slot.name[len(src_prefix) :])
                if target is not None and tuple(target.shape) == tuple(slot.shape):
                    target.assign(slot)
                    done.update((id(slot), id(target)))
    copied = len(done) // 2
    # the rest belongs to no model variable: the iteration counts (a MultiOptimizer's, one per optimizer, all
    # named "iteration"), the learning rate, a loss scale, a custom optimizer's own; the two optimizers, of one
    # class and configuration, made them in the same order (found by probing, stop 38: taken by name, a
    # MultiOptimizer's counts collapsed into one and a LossScaleOptimizer's scale went back to its start)
    rest = [v for v in source.variables if id(v) not in done], [v for v in destination.variables if id(v) not in done]
    if len(rest[0]) == len(rest[1]) and all(
        a.name == b.name and tuple(a.shape) == tuple(b.shape) for a, b in zip(*rest, strict=True)
    ):
        for a, b in zip(*rest, strict=True):
            b.assign(a)
        return copied + len(rest[0])
    source_vars = {v.name: v for v in rest[0]}
    for name in ("iteration", "iterations", "learning_rate"):
        if name in source_vars and name in destination_vars:
            destination_vars[name].assign(source_vars[name])
            copied += 1
    return copied


def compile_like(source_model: Any, destination_model: Any, pairs: Iterable[tuple[Any, Any]]) -> None:
    """Compiles ``destination_model`` as ``source_model`` was and gives it the same optimizer state.

    Does nothing when ``source_model`` is not compiled.
    """
    kept = compile_config(source_model) if getattr(source_model, "compiled", False) else None
    if kept is None or source_model.optimizer is None:
        return
    pairs = list(pairs)  # read twice: the exclusions from weight decay, the state
    destination_model.compile(**compile_arguments(kept))
    optimizer = destination_model.optimizer
    carry_weight_decay_exclusions(source_model.optimizer, optimizer, pairs)
    if destination_model.built and not optimizer.built:  # as Keras' compile_from_config does
        optimizer.build(destination_model.trainable_variables)
    if source_model.optimizer.built:
        copy_optimizer_state(source_model.optimizer, optimizer, pairs)


def carry_weight_decay_exclusions(source: Any, destination: Any, pairs: Iterable[tuple[Any, Any]]) -> None:
    """Gives ``destination`` (beside its own) what ``source.exclude_from_weight_decay`` excluded, which no optimizer
    config holds: the names, and each excluded variable of ``pairs``' first side as its second side. ``source``
    may be ``destination``: an optimizer whose ``var_list`` named the variables of the model that was wrapped
    then excludes their copies too (found by probing, stop 38: a wrapped AdamW decayed the excluded kernels, 1.1e-2
    off after 4 steps, and the copies of variables named that way, 0.033)."""
    pairs = list(pairs)
    for a, b in zip(_optimizers(source), _optimizers(destination)):
        keys, pattern = weight_decay_exclusions(a)
        own, own_pattern = weight_decay_exclusions(b)
        mapped = {variable_key(b, dst) for src, dst in pairs if variable_key(a, src) in keys}
        if mapped - own or pattern is not own_pattern:
            set_weight_decay_exclusions(b, own | mapped, own_pattern if pattern is None else pattern)


def _optimizers(optimizer: Any) -> list[Any]:
    """``optimizer`` and those inside it (a LossScaleOptimizer's inner one, a MultiOptimizer's), in order."""
    inner = [getattr(optimizer, "inner_optimizer", None), *(getattr(optimizer, "optimizers", None) or ())]
    return [optimizer] + [o for x in inner if x is not None for o in _optimizers(x)]


def compile_arguments(kept: dict[str, Any]) -> dict[str, Any]:
    """The arguments a model's ``compile`` was called with (``kept``: as Keras keeps them,
    ``internals.compile_config``), for compiling another model the same way.

    The optimizer and the metric objects are made anew from their configs (they hold state); losses,
    strings and the user's functions are passed as they are. A round trip of the whole compile config
    through Keras' serialization (``compile_from_config``) would look a plain Python function
    (``loss=my_loss``) up by its name in Keras' registry and fail, though the function is right here.

    Raises:
        InputError: when a metric object cannot be made anew from its config.
    """
    import keras

    arguments = dict(kept)
    optimizer = arguments["optimizer"]
    # the classes of the user's own optimizer and schedule, registered or not (found by probing, stop 38: an
    # unregistered one failed "Could not locate class" in unwrap, save_weights and wrapping a compiled model)
    classes = {type(o).__name__: type(o) for o in _optimizers(optimizer)}
    schedules = [getattr(o, "_learning_rate", None) for o in _optimizers(optimizer)]
    schedule = keras.optimizers.schedules.LearningRateSchedule
    classes.update({type(x).__name__: type(x) for x in schedules if isinstance(x, schedule)})
    try:
        with keras.saving.custom_object_scope(classes):
            config = keras.saving.serialize_keras_object(optimizer)
            arguments["optimizer"] = keras.saving.deserialize_keras_object(config)
    except (TypeError, ValueError) as err:  # a MultiOptimizer choosing by a function of the user's
        raise InputError(
            f"The optimizer {type(optimizer).__name__} cannot be made anew from its config for the other model "
            f"(the plain model of unwrap, save and save_weights, or the wrapped model of a compiled one): "
            f"{_first_line(err)} Expected an optimizer Keras can serialize (a MultiOptimizer with an "
            "OptimizerMap rather than a function), or compile that model yourself."
        ) from err
    for key in ("metrics", "weighted_metrics"):
        arguments[key] = _new_metrics(arguments[key])
    return arguments


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__).rstrip(".") + "."


def _new_metrics(metrics: Any) -> Any:
    """``metrics`` (a metric, a list or a dict of them) with every Metric object replaced by a new one."""
    import keras

    if isinstance(metrics, (list, tuple)):
        return type(metrics)(_new_metrics(m) for m in metrics)
    if isinstance(metrics, dict):
        return {key: _new_metrics(m) for key, m in metrics.items()}
    if not isinstance(metrics, keras.metrics.Metric):
        return metrics  # None, a name or a function: compile makes the metric
    try:
        return type(metrics).from_config(metrics.get_config())
    except Exception as err:
        if type(metrics) is keras.metrics.MeanMetricWrapper:  # around a lambda or the user's function: the same one
            kwargs = metric_function_kwargs(metrics)
            return keras.metrics.MeanMetricWrapper(metric_function(metrics), metrics.name, metrics.dtype, **kwargs)
        raise InputError(
            f"The metric {metrics.name!r} ({type(metrics).__name__}) cannot be made anew from its config for the "
            f"other model: from_config(get_config()) failed with {type(err).__name__}: {err}. Implement "
            "get_config() in the metric's class (returning every __init__ argument), or compile that model yourself."
        ) from err


def place_updates(optimizer: Any) -> None:
    """Makes ``optimizer`` issue each variable's update arithmetic on that variable's device.

    Keras' TensorFlow optimizer computes a variable's update (moments, bias correction, weight
    decay, the assign) with no device of its own: inside a compiled step, whose variables are
    captured without their devices, all of it lands on the step's default device, and only the final
    assign follows the variable. This wraps the optimizer's per-variable ``update_step`` and its
    weight decay in ``tf.device(variable.device)``. It applies once per optimizer (the innermost one,
    when a LossScaleOptimizer wraps another).
    """
    import tensorflow as tf

    target = getattr(optimizer, "inner_optimizer", optimizer)
    if getattr(target, "_partitioner_placed", False):
        return
    update_step = target.update_step
    apply_weight_decay = weight_decay_function(target)

    def placed_update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        with tf.device(_device(variable)):
            return update_step(gradient, variable, learning_rate)

    def placed_weight_decay(variables: Any) -> None:
        by_device: dict[str, list[Any]] = {}
        for variable in variables:
            by_device.setdefault(_device(variable), []).append(variable)
        for device, group in by_device.items():
            with tf.device(device):
                apply_weight_decay(group)

    target.update_step = placed_update_step
    set_weight_decay_function(target, placed_weight_decay)
    target._partitioner_placed = True


def _device(variable: Any) -> str:
    """The device of a Keras or TensorFlow variable ('' when it has none)."""
    device = getattr(variable, "device", None)
    if not isinstance(device, str):
        device = getattr(backing_value(variable), "device", "")
    return device or ""


def slots(optimizer: Any, variables: Iterable[Any]) -> list[tuple[Any, Any]]:
    """(slot, variable) for every optimizer variable that belongs to one of ``variables``.

    Keras names a slot after its variable (``_prefix``: "dense_kernel_" + "momentum"); a slot whose
    name starts with several variables' prefixes goes to the longest. The optimizer's own counters
    (iteration, learning rate) match no variable and are left out. A loss-scaling wrapper's slots
    are its inner optimizer's.

    Example:
        >>> [(s.path, v.path) for s, v in slots(model.optimizer, model.trainable_variables)][:1]  # doctest: +SKIP
        [('adam/dense_kernel_momentum', 'dense/kernel')]
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    prefixes = sorted(((_prefix(v), v) for v in variables), key=lambda pair: -len(pair[0]))
    found = []
    for slot in inner.variables:
        variable = next((v for prefix, v in prefixes if slot.name.startswith(prefix)), None)
        if variable is not None:
            found.append((slot, variable))
    return found
