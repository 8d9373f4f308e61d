"""Measures the forward + backward seconds of one layer call for one micro-batch on one device.

The call runs inside a ``tf.function`` under a ``tf.GradientTape`` that takes gradients of every
floating-point output with respect to the floating-point inputs and the trainable weights, the
work one pipeline stage does per micro-batch. The function is traced once, warmed up (``warm_up``:
``warmup`` runs and on until its runs have taken WARM_SECONDS), then timed ``repeats`` times (each run
waits for the device), each run beside one of an empty function on the same inputs; the median of the
runs less the median of the empty ones is returned. So the time is the call's ops, not the dispatch of
a ``tf.function`` from Python (tens to hundreds of microseconds on CPU): a stage runs many layers in one
call and pays its call once per pass, which the cost model prices as the device's ``action_overhead_s``
(docs/cost-model.md). Summed over a stage's layers, times that kept the dispatch counted it once per layer.

Example:
    >>> import keras, tensorflow as tf                                            # doctest: +SKIP
    >>> dense = keras.layers.Dense(64); dense.build((None, 128))                # doctest: +SKIP
    >>> seconds = forward_backward_seconds(
    ...     dense, [tf.TensorSpec([4, 128])], dense.trainable_weights, device="/CPU:0")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import gc
import glob
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from partitioner.errors import InputError
from profiles import internals


def forward_backward_seconds(
    fn: Callable[..., Any],
    input_specs: Sequence[tf.TensorSpec],
    variables: Sequence[Any] = (),
    *,
    device: str,
    repeats: int = 5,
    warmup: int = 2,
    exclude_call: bool = True,
) -> float:
    """Returns the median seconds of one forward + backward pass of ``fn`` on ``device``.

    Args:
        fn: the call to time, e.g. a Keras layer; takes one tensor per spec.
        input_specs: fully defined shapes and dtypes of the inputs (at micro-batch size). Float
            inputs are filled with standard normal values, other inputs with zeros (valid indices
            for embeddings and one-hot layers).
        variables: the trainable weights to take gradients for (Keras or TF variables).
        device: a TensorFlow device name such as "/GPU:0" or "/device:CPU:1".
        repeats: timed runs; the median is returned.
        warmup: untimed runs after tracing.
        exclude_call: subtract the median seconds of calling an empty function on the same inputs
            (the dispatch from Python); the result is then >= 0, and 0 when the pass is too short to
            tell from the dispatch.

    Raises:
        InputError: for ``repeats < 1``, ``warmup < 0`` or specs with unknown dimensions.

    Note:
        ``fn`` really runs: stateful layers (batch normalisation statistics, dropout seeds)
        update their variables. The profiler saves and restores them around this call.

    Example:
        >>> forward_backward_seconds(tf.nn.relu, [tf.TensorSpec([8, 16])], device="/CPU:0")  # doctest: +SKIP
        3.1e-05
    """
    (seconds,) = forward_backward_seconds_by_size(
        fn, [input_specs], variables, device=device, repeats=repeats, warmup=warmup, exclude_call=exclude_call
    )
    return seconds


def forward_backward_seconds_by_size(
    fn: Callable[..., Any],
    specs_by_size: Sequence[Sequence[tf.TensorSpec]],
    variables: Sequence[Any] = (),
    *,
    device: str,
    repeats: int = 5,
    warmup: int = 2,
    exclude_call: bool = True,
) -> list[float]:
    """:func:`forward_backward_seconds` of ``fn`` at each of ``specs_by_size`` (the input specs at one size
    each), the sizes taking turns run by run rather than timed one after the other.

    A machine's speed can drift while a profile is taken: on this 2-core machine (logical CPU devices, 1
    intra-op thread) a model's forward and backward ran at 1.7 ms in one process and 2.05 ms in another for
    seconds on end, and fresh functions and inputs timed taking turns in one process agreed within 4%
    (2026-11-28, stop 35). Timed one size after another, a drift between two sizes tilted the layers' times
    across the micro-batch sizes the planner weighs; taking turns, a drift moves every size alike.

    Example:
        >>> forward_backward_seconds_by_size(model, [[tf.TensorSpec([64, 256])], [tf.TensorSpec([16, 256])]],
        ...     model.trainable_weights, device="/CPU:0")                            # doctest: +SKIP
        [0.0018, 0.0007]
    """
    _check_counts(repeats, warmup)
    for spec in (spec for specs in specs_by_size for spec in specs):
        if not spec.shape.is_fully_defined():
            raise InputError(
                f"Timing needs fully defined input shapes. Received: {spec}. "
                "Replace unknown dimensions (None) with sizes, e.g. the micro-batch size."
            )
    variables = list(variables)

    def step(*inputs: tf.Tensor) -> list[Any]:
        return forward_backward(fn, inputs, variables)

    return _medians_seconds(
        step, specs_by_size, device=device, repeats=repeats, warmup=warmup, exclude_call=exclude_call
    )


def forward_backward(fn: Callable[..., Any], inputs: Sequence[Any], variables: Sequence[Any] = ()) -> list[Any]:
    """One forward + backward pass of ``fn`` on ``inputs`` (to trace inside a function): the floating-point
    outputs and their gradients with respect to the floating-point inputs and ``variables``, as a stage's
    backward takes them. Returns the outputs and the gradients, so that nothing of the pass is pruned."""
    watched = [x for x in inputs if x.dtype.is_floating]
    with tf.GradientTape() as tape:
        tape.watch(watched)
        outputs = fn(*inputs)
    targets = [t for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    sources = watched + list(variables)
    if not targets or not sources:
        return targets
    grads = tape.gradient(targets, sources)
    return targets + [g for g in grads if g is not None]


def training_call(model: Any) -> Callable[..., Any]:
    """``model`` called in training mode on one tensor per input, in the order of ``model.inputs``, handed to it
    in the nesting it was built with (a dict of inputs for a keras-hub backbone): what ``forward_backward`` runs
    to time or measure the whole model."""
    import keras

    from profiles.walk import functional_graph

    structure = internals.input_structure(functional_graph(model))

    def call(*values: Any) -> Any:
        return model(keras.tree.pack_sequence_as(structure, list(values)), training=True)

    return call


@contextlib.contextmanager
def variables_kept(variables: Sequence[Any]) -> Iterator[None]:
    """Runs the block and gives ``variables`` back the values they had before it: a layer or model run in
    training mode moves its batch normalization statistics and its seeds."""
    state = [(v, v.numpy()) for v in variables]
    try:
        yield
    finally:
        for variable, value in state:
            variable.assign(value)


def accumulate_seconds(
    variables: Sequence[Any],
    *,
    device: str,
    repeats: int = 5,
    warmup: int = 2,
    evict: Callable[[], None] | None = None,
) -> float:
    """Returns the median seconds of adding one micro-batch's gradients of ``variables`` into sums of
    their shapes on ``device`` (``total + gradient`` for each, in one traced function, as the runtime's
    stage sums them when M > 1), less an empty call's; 0 for no variables.

    With ``evict`` (:func:`evict_caches`), each timed add starts as in the step of a model whose buffers do
    not fit the caches: the sums out of them (``evict`` runs, untimed, before it: the rest of the stage's
    work passes through the caches between two adds of the same sums) and the gradients just read (the
    backward has just made them). Timed again and again on warm buffers, such sums were priced at a third of
    what the step pays: benchmarks/runtime's overlap MLP on 2 stages at M = 8 (the model's 10 nodes 5 and 5)
    spent 17.3 ms of its 120.2 ms step on them (the step with the sums left out: 102.9 ms), priced 5.6 ms a
    stage from warm adds (the step predicted 7.5% short); a 1024 x 1024 weight's add took 0.32 ms warm, 0.60
    with the sums cold, 0.86 with the gradients cold too (one-off measurements on this 2-core machine, 32 MiB
    of L3). Without ``evict`` the adds are timed on warm buffers.

    Example:
        >>> accumulate_seconds(dense.trainable_weights, device="/CPU:0")      # doctest: +SKIP
        0.0002
        >>> cold = evict_caches("/CPU:0")                                          # doctest: +SKIP
        >>> accumulate_seconds(dense.trainable_weights, device="/CPU:0", evict=cold)  # doctest: +SKIP
        0.0005
    """
    _check_counts(repeats, warmup)
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    if not specs:
        return 0.0

    def add(*tensors: tf.Tensor) -> list[tf.Tensor]:
        half = len(tensors) // 2
        return [total + gradient for total, gradient in zip(tensors[:half], tensors[half:], strict=True)]

    before_timed = None
    if evict is not None:
        cold = evict
        read = tf.function(lambda tensors: [tf.reduce_sum(t) for t in tensors])

        def before_timed(inputs: Sequence[tf.Tensor]) -> None:  # the sums cold, the gradients just made
            cold()
            with tf.device(device):
                read(list(inputs[len(specs) :]))
            sync_device(device)

    return _median_seconds(
        add, specs + specs, device=device, repeats=repeats, warmup=warmup, exclude_call=True, before_timed=before_timed
    )


def cache_bytes() -> int:
    """The largest CPU cache this host reports (Linux's sysfs), or 32 MiB where it reports none. (A GPU's L2
    is of the same order, 40-60 MiB on A100 and H100: the profiler uses this figure for both.)

    Example:
        >>> cache_bytes() / 2**20                                                 # doctest: +SKIP
        32.0
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(path).read_text().strip().upper()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 * 2**20)


def evict_caches(device: str) -> Callable[[], None]:
    """A function that pushes what the caches hold out of them: it reads a buffer on ``device`` of twice
    the host's largest cache (:func:`cache_bytes`; at least 64 MiB, more than a GPU's L2 holds) and waits
    for the device. The buffer lives as long as the function: make one per profile, not per timing.

    Example:
        >>> evict = evict_caches("/CPU:0")                                        # doctest: +SKIP
        >>> evict()   # the caches now hold the buffer, not what was timed before   # doctest: +SKIP
    """
    size = 2 * max(cache_bytes(), 32 * 2**20)
    with tf.device(device):
        buffer = tf.ones([size // 4], tf.float32)
    read = tf.function(tf.reduce_sum)

    def evict() -> None:
        with tf.device(device):
            read(buffer)
        sync_device(device)

    return evict


def _median_seconds(
    fn: Callable[..., Any],
    input_specs: Sequence[tf.TensorSpec],
    *,
    device: str,
    repeats: int,
    warmup: int,
    exclude_call: bool,
    before_timed: Callable[[Sequence[tf.Tensor]], None] | None = None,
) -> float:
    """The median seconds of ``fn`` traced as a function on filled inputs on ``device``, less the median of
    an empty function's on the same inputs (the two take turns) where ``exclude_call``; >= 0.
    ``before_timed(inputs)`` runs, untimed, before each timed run of ``fn``."""
    (seconds,) = _medians_seconds(
        fn,
        [input_specs],
        device=device,
        repeats=repeats,
        warmup=warmup,
        exclude_call=exclude_call,
        before_timed=before_timed,
    )
    return seconds


def _medians_seconds(
    fn: Callable[..., Any],
    specs_by_size: Sequence[Sequence[tf.TensorSpec]],
    *,
    device: str,
    repeats: int,
    warmup: int,
    exclude_call: bool,
    before_timed: Callable[[Sequence[tf.Tensor]], None] | None = None,
) -> list[float]:
    """:func:`_median_seconds` of ``fn`` at each of ``specs_by_size``, every size's function and empty call
    taking turns run by run: a machine whose speed drifts while they are timed moves them all alike."""

    def empty(*inputs: tf.Tensor) -> tf.Tensor:
        return tf.constant(0.0)

    with tf.device(device):
        timed: list[tuple[Any, list[tf.Tensor], bool]] = []  # (traced function, its inputs, whether fn's)
        for specs in specs_by_size:
            inputs = [fill(spec) for spec in specs]
            timed.append((tf.function(fn).get_concrete_function(*specs), inputs, True))
            if exclude_call:
                timed.append((tf.function(empty).get_concrete_function(*specs), inputs, False))
        warm_up([functools.partial(run, *inputs) for run, inputs, _ in timed], device, warmup)
        times: list[list[float]] = [[] for _ in timed]
        for _ in range(repeats):  # every size's pass and empty call take turns, so all see the same load
            for (run, inputs, is_fn), seconds in zip(timed, times, strict=True):
                if before_timed is not None and is_fn:
                    before_timed(inputs)
                seconds.append(synced_seconds(functools.partial(run, *inputs), device))
    medians = [statistics.median(seconds) for seconds in times]
    per_size = 2 if exclude_call else 1
    return [max(0.0, medians[i] - (medians[i + 1] if exclude_call else 0.0)) for i in range(0, len(medians), per_size)]


def step_overhead_seconds(
    model: Any,
    input_specs: Sequence[tf.TensorSpec],
    target_specs: Sequence[tf.TensorSpec],
    *,
    device: str,
    repeats: int = 5,
    warmup: int = 2,
) -> float:
    """Returns the seconds one Keras training step of a copy of ``model`` on ``device`` spends beyond the
    copy's forward + backward: ``train_on_batch`` (the compiled step, the loss, the gradients, the optimizer's
    update, the call from Python) less the copy's :func:`forward_backward` in a function (its dispatch left
    out, as :func:`forward_backward_seconds` leaves it out), on inputs filled as that fills them and zero
    targets. The step, the pass and an empty call take turns; the median of the rounds' differences is
    returned, at least 0. Timed apart, the two moved by more than their difference: the overlap MLP's at one
    sample came out 0.7 to 11 ms between profiles.

    Example:
        >>> x, y = [tf.TensorSpec([1, 784])], [tf.TensorSpec([1, 10])]             # doctest: +SKIP
        >>> step_overhead_seconds(model, x, y, device="/CPU:0")                    # doctest: +SKIP
        0.0025

    The copy (``keras.models.clone_model``, its weights made on ``device``) trains with SGD at learning
    rate 0 and mean squared error; ``model`` and its weights are not touched.

    Raises:
        InputError: for ``repeats < 1``, ``warmup < 0``; whatever Keras raises for a model it cannot
            copy or a loss that does not fit its outputs.
    """
    import keras

    _check_counts(repeats, warmup)
    with tf.device(device):
        copy = keras.models.clone_model(model)
        # no XLA ("auto" compiles the step on a host with a GPU): the pass below is not compiled either
        copy.compile(optimizer=keras.optimizers.SGD(0.0), loss="mean_squared_error", jit_compile=False)
        inputs = [fill(spec) for spec in input_specs]
        targets = [tf.zeros(spec.shape, spec.dtype) for spec in target_specs]
        call, variables = training_call(copy), copy.trainable_weights
        passes = tf.function(lambda *xs: forward_backward(call, xs, variables)).get_concrete_function(*input_specs)
        empty = tf.function(lambda *xs: tf.constant(0.0)).get_concrete_function(*input_specs)
    x = inputs[0] if len(inputs) == 1 else inputs
    y = targets[0] if len(targets) == 1 else targets

    def train() -> None:
        with tf.device(device):  # the step traced (first call) and run on the device, as the pass is
            copy.train_on_batch(x, y)

    def round_() -> float:
        step = synced_seconds(train, device)
        return step - (synced_seconds(lambda: passes(*inputs), device) - synced_seconds(lambda: empty(*inputs), device))

    round_()  # traces the step
    warm_up([train, lambda: passes(*inputs), lambda: empty(*inputs)], device, warmup)
    return max(0.0, statistics.median(round_() for _ in range(repeats)))


def _check_counts(repeats: int, warmup: int) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"repeats must be an integer >= 1. Received: repeats={repeats!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InputError(f"warmup must be an integer >= 0. Received: warmup={warmup!r}.")


def fill(spec: tf.TensorSpec) -> tf.Tensor:
    """A tensor of ``spec``: standard normal values for floats, zeros for other dtypes (valid indices)."""
    if spec.dtype.is_floating:
        return tf.cast(tf.random.normal(spec.shape), spec.dtype)
    return tf.zeros(spec.shape, spec.dtype)


# Untimed runs of a traced function before it is timed: at least the caller's ``warmup`` and until the first
# function has run WARM_SECONDS, at most MAX_WARM_RUNS times (``warm_up``).
WARM_SECONDS, MAX_WARM_RUNS = 0.05, 50


def warm_up(runs: Sequence[Callable[[], Any]], devices: str | Sequence[str], warmup: int) -> None:
    """Runs the ``runs`` in turn, untimed, ``warmup`` times and then on until the first has taken WARM_SECONDS
    (at most MAX_WARM_RUNS rounds); ``warmup=0`` runs nothing. A traced function runs slow for its first calls
    after its trace: benchmarks/calibration's MLP's forward and backward (8 x Dense(256), 1 intra-op thread,
    measured 2026-11-28) took 3.9, 4.6, 3.7, 3.6, 2.8, ... ms at 64 rows and settled at 1.8-1.9 after about 12
    calls, at 16 rows 2.0, 1.4, 1.2, ... settling at 0.8 after 6, at 4 rows 1.7, 1.3, 0.8, ... settling at 0.55
    after 5: two warm-up runs left most of that in a median of ten.

    Example:
        >>> warm_up([lambda: step(x), lambda: empty(x)], "/CPU:0", warmup=2)         # doctest: +SKIP
    """
    spent = 0.0
    for count in range(max(warmup, MAX_WARM_RUNS) if warmup else 0):
        if count >= warmup and spent >= WARM_SECONDS:
            return
        for index, run in enumerate(runs):
            seconds = synced_seconds(run, devices)
            spent += seconds if index == 0 else 0.0


def synced_seconds(run: Callable[[], Any], devices: str | Sequence[str]) -> float:
    """Wall seconds of one ``run()``, each device named synced after it (GPU kernels run asynchronously), with
    Python's garbage collector paused meanwhile, as ``timeit`` pauses it, so that no collection falls in a
    timed run.

    Example:
        >>> synced_seconds(lambda: step(x), ["/GPU:0", "/GPU:1"])                  # doctest: +SKIP
        0.0123
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        run()
        for name in [devices] if isinstance(devices, str) else devices:
            sync_device(name)
        return time.perf_counter() - start
    finally:
        if collecting:
            gc.enable()


def sync_device(device: str) -> None:
    """Blocks until ``device`` has finished the work queued on it (GPU kernels run asynchronously).

    Example:
        >>> sync_device("/CPU:0")                                                  # doctest: +SKIP
    """
    internals.sync_device(device)  # what tf.test.experimental.sync_devices() does, for one device
