"""Measures on the devices at hand what the planner prices besides FLOPs: the fixed seconds of a pass, the
bandwidth of a link, and how much of the devices' work one processor runs at once when they share it.

What each function times, and why that shape::

    figure                 what is timed                                                 result
    ---------------------  ------------------------------------------------------------  -------------------------
    action_overhead_s      a tf.while_loop in a tf.function on the device whose every    median seconds per call
                           iteration calls a tiny ``_noinline`` function (a Boundary of   (loop iteration included)
                           runtime/program.py, whose body is one call of an inner
                           tf.function) on the previous iteration's output; with a
                           ``peer`` the calls alternate between the two devices, so each
                           call also receives its input from the other device, as a stage
                           does from the stage before it
    bandwidth_bytes_per_s  a tensor made on one device read on another, inside a          bytes / (median seconds of
                           tf.function, at a large and a tiny size                        the large copy - the tiny)
    pool_capacity          a chain of Dense-sized matmuls (1024 wide, 128 rows) and        n x (median alone) /
                           their gradient, on the first device alone, then one chain on    (median together),
                           each of the n devices at once in one tf.function                in [1, n]

The runtime's loop (runtime/executor.py) calls each stage's function once per forward and once per backward
of a micro-batch; a call that TensorFlow does not inline costs the same whatever the micro-batch's size, which
is the ``action_overhead_s`` of ``partitioner.Device`` (docs/cost-model.md, "Fixed cost per action"). The ops
inside a real stage add their own fixed costs on top (one executor dispatch each): the figure measured here is
the least a pass costs, not all of it. Logical devices split from one CPU (or one GPU) share its cores: two
stages computing at once each run slower than one alone, which ``pool_capacity`` of ``partitioner.Device``
says and the simulator applies (docs/cost-model.md, "Devices that share a processor").

Example:
    >>> measure_action_overhead_s("/device:CPU:0") > 0                       # doctest: +SKIP
    True
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from partitioner.errors import InputError
from profiles.timing import synced_seconds, warm_up

_OVERHEAD: dict[tuple[str, str | None, int], float] = {}  # (device, peer, calls) -> seconds, once per process
_BANDWIDTH: dict[tuple[str, str, int], float] = {}  # (sender, receiver, bytes) -> bytes/s, once per process
_CAPACITY: dict[tuple[Any, ...], float] = {}  # (devices, sizes) -> devices' worth computed at once, once per process


def measure_action_overhead_s(
    device_name: str,
    *,
    peer: str | None = None,
    num_calls: int = 100,
    num_rounds: int = 15,
) -> float:
    """The median seconds of one call of a tiny ``_noinline`` function on ``device_name``, made from a loop.

    Args:
        device_name: a TensorFlow device name, e.g. "/device:CPU:0".
        peer: another device; the calls then alternate between the two, each on the other's output
            (a pass receives its input from the previous stage), and the figure is per call.
        num_calls: calls per timed round (an even number of them with a peer).
        num_rounds: timed rounds; the median round gives the figure.

    Returns:
        Seconds per call, > 0. Cached per process.

    Raises:
        InputError: for a non-positive count.

    Example:
        >>> measure_action_overhead_s("/device:CPU:0", peer="/device:CPU:1") > 0   # doctest: +SKIP
        True
    """
    _check_count(num_calls, "num_calls")
    _check_count(num_rounds, "num_rounds")
    key = (device_name, peer, num_calls)
    if key in _OVERHEAD:
        return _OVERHEAD[key]
    devices = [device_name] if peer is None else [device_name, peer]
    calls = [_boundary(name) for name in devices]
    iterations = max(1, num_calls // len(devices))

    def loop(x: Any) -> Any:
        def body(i: Any, y: Any) -> Any:
            for name, call in zip(devices, calls, strict=True):
                with tf.device(name):
                    y = call(y)
            return i + 1, y

        return tf.while_loop(lambda i, _: i < iterations, body, (tf.constant(0), x))[1]

    with tf.device(device_name):
        x = tf.zeros([8])
        run = tf.function(loop, autograph=False).get_concrete_function(x)
        seconds = _median_seconds(lambda: run(x), device_name, num_rounds) / (iterations * len(devices))
    _OVERHEAD[key] = max(seconds, 1e-9)
    return _OVERHEAD[key]


def measure_bandwidth(
    sender: str,
    receiver: str,
    *,
    num_bytes: int = 16 * 2**20,
    num_rounds: int = 9,
) -> float:
    """Bytes per second of a copy from ``sender`` to ``receiver``: the time of a ``num_bytes`` tensor read on the
    receiver, less that of a tiny one (the fixed cost of any transfer, which ``measure_action_overhead_s`` with a
    peer counts), medians of ``num_rounds``. Logical CPU devices share one memory: the copy is a memcpy, or none
    (TensorFlow may hand the buffer over), and the figure is then large.

    Returns:
        Bytes/s, > 0 and finite. Cached per process.

    Raises:
        InputError: for a non-positive size or count.

    Example:
        >>> measure_bandwidth("/device:CPU:0", "/device:CPU:1") > 1e9         # doctest: +SKIP
        True
    """
    _check_count(num_bytes, "num_bytes")
    _check_count(num_rounds, "num_rounds")
    key = (sender, receiver, num_bytes)
    if key in _BANDWIDTH:
        return _BANDWIDTH[key]
    seconds = []
    for size in (num_bytes, 4):
        with tf.device(sender):
            tensor = tf.random.uniform([max(1, size // 4)])

        def copy(x: Any) -> Any:
            with tf.device(receiver):
                return tf.identity(x)[:1]  # the whole tensor arrives; one element comes back

        run = tf.function(copy, autograph=False).get_concrete_function(tensor)
        seconds.append(_median_seconds(lambda run=run, tensor=tensor: run(tensor), receiver, num_rounds))
    extra = seconds[0] - seconds[1]
    # a copy faster than the clock can tell from the tiny one: the bandwidth is at least num_bytes per microsecond
    _BANDWIDTH[key] = num_bytes / max(extra, 1e-6)
    return _BANDWIDTH[key]


def measure_pool_capacity(
    device_names: Sequence[str],
    *,
    width: int = 1024,
    rows: int = 128,
    depth: int = 4,
    num_rounds: int = 7,
) -> float:
    """How many devices' worth of work the devices named compute at once, where they share one processor.

    Times a chain of ``depth`` Dense-like layers (``rows x width`` by ``width x width`` matmuls with a tanh)
    and its gradient on the first device alone, then one such chain on each device at once, in one
    tf.function whose chains TensorFlow's executor runs side by side. n devices of their own would take as
    long together as one alone (capacity n); devices that take turns on one core, n times as long
    (capacity 1). Returns n x alone / together, clipped to [1, n] (noise can push it past either end).
    :func:`measure_model_pool_capacity` times a model's own pass instead.

    Raises:
        InputError: for fewer than two devices or a non-positive size.

    Example:
        >>> 1 <= measure_pool_capacity(["/device:CPU:0", "/device:CPU:1"]) <= 2    # doctest: +SKIP
        True
    """
    names = _pool_devices(device_names)
    for value, name in ((width, "width"), (rows, "rows"), (depth, "depth"), (num_rounds, "num_rounds")):
        _check_count(value, name)
    key = (names, width, rows, depth, num_rounds)
    if key in _CAPACITY:
        return _CAPACITY[key]
    weights = []
    for name in names:
        with tf.device(name):
            weights.append([tf.random.normal([width, width], stddev=width**-0.5)])

    def chain(arguments: list[Any]) -> Any:
        (w,) = arguments
        with tf.GradientTape() as tape:
            tape.watch(w)
            y = tf.ones([rows, width])
            for _ in range(depth):
                y = tf.tanh(tf.matmul(y, w))
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, w)[:1, :1]

    _CAPACITY[key] = _capacity(names, weights, chain, num_rounds)
    return _CAPACITY[key]


def measure_model_pool_capacity(
    model: Any,
    device_names: Sequence[str],
    samples: int,
    *,
    input_shapes: Any = None,
    sequence_length: int | None = None,
    num_rounds: int = 7,
) -> float:
    """:func:`measure_pool_capacity` with ``model``'s own forward and backward (training mode, gradients for its
    float inputs and trainable weights, as ``profiles.timing.forward_backward`` takes them) on ``samples``
    samples instead of the matmul chain: one pass on the first device alone, then one on each device at once.

    A model's pass shares a processor differently from a chain of large matmuls: one that already keeps the
    processor's cores busy alone (independent ops run side by side, on TensorFlow's inter-op threads) gains
    less from a second device computing beside it. Measured on 2 logical CPU devices of 2 cores (1 intra-op,
    2 inter-op threads): the chain 1.46-1.54, a 4-block transformer 1.24-1.30, an MLP of 8 Dense(1024)
    1.40-1.51. The model's variables (batch normalization's statistics, seeds) come back as they were.

    Raises:
        InputError: for fewer than two devices, ``samples`` or ``num_rounds`` < 1, or input shapes that do not
            fit the model (``profiles.shapes.input_shapes``).

    Example:
        >>> measure_model_pool_capacity(model, ["/device:CPU:0", "/device:CPU:1"], 16)   # doctest: +SKIP
        1.27
    """
    from profiles.shapes import input_names
    from profiles.shapes import input_shapes as resolve_input_shapes
    from profiles.timing import fill, forward_backward, training_call, variables_kept

    names = _pool_devices(device_names)
    _check_count(samples, "samples")
    _check_count(num_rounds, "num_rounds")
    shapes = resolve_input_shapes(model, input_shapes, sequence_length)
    specs = [
        tf.TensorSpec([samples, *shapes[name]], tensor.dtype)
        for name, tensor in zip(input_names(model), model.inputs, strict=True)
    ]
    forward = training_call(model)
    inputs = []
    for name in names:
        with tf.device(name):
            inputs.append([fill(spec) for spec in specs])

    def step(arguments: list[Any]) -> Any:
        outputs = forward_backward(forward, arguments, model.trainable_weights)
        return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in outputs]) if outputs else tf.constant(0.0)

    with variables_kept(model.variables):  # the passes move batch statistics and seeds
        return _capacity(names, inputs, step, num_rounds)


def _pool_devices(device_names: Sequence[str]) -> tuple[str, ...]:
    names = tuple(device_names)
    if len(names) < 2:
        raise InputError(f"A pool's capacity needs two devices or more. Received: {list(names)}.")
    return names


def _capacity(
    names: tuple[str, ...], arguments: Sequence[list[Any]], work: Callable[[list[Any]], Any], num_rounds: int
) -> float:
    """n x (median seconds of ``work`` on the first device alone) / (median seconds of one ``work`` on each of
    the n devices at once, in one tf.function), clipped to [1, n]. ``work(arguments[i])`` is traced under device
    i; each device's arguments live on it."""

    def on(devices: Sequence[int]) -> Any:
        def run(*flat: Any) -> Any:
            outs, offset = [], 0
            for i in devices:
                count = len(arguments[i])
                with tf.device(names[i]):
                    outs.append(work(list(flat[offset : offset + count])))
                offset += count
            return outs

        chosen = [a for i in devices for a in arguments[i]]
        concrete = tf.function(run, autograph=False).get_concrete_function(*chosen)
        return lambda: concrete(*chosen)

    alone_run, together_run = on([0]), on(range(len(names)))
    # untimed: the first calls of each run its function's setup, and run slow for a while after it
    warm_up([alone_run, together_run], names, 2)
    # the two take turns, so both see the same load; a short pass gets more rounds (a model's of a few
    # milliseconds moved its capacity by a tenth between runs at 7), up to CAPACITY_SECONDS of timing
    once = synced_seconds(alone_run, names[:1]) + synced_seconds(together_run, names)
    rounds = max(num_rounds, min(MAX_CAPACITY_ROUNDS, int(CAPACITY_SECONDS / max(once, 1e-9))))
    alone, together = [], []
    for _ in range(rounds):
        alone.append(synced_seconds(alone_run, names[:1]))
        together.append(synced_seconds(together_run, names))  # every device synced: all done
    ratio = len(names) * statistics.median(alone) / statistics.median(together)
    return min(max(ratio, 1.0), float(len(names)))


CAPACITY_SECONDS, MAX_CAPACITY_ROUNDS = 0.5, 60  # a pool capacity's timing: at least num_rounds, up to these


def _boundary(device_name: str) -> Any:
    """A ``_noinline`` function whose body is one call of a tiny inner function, as runtime/program.py's
    Boundary builds each stage's: the shape of call the runtime's loop makes once per pass."""
    inner = tf.function(lambda x: x + 1.0, autograph=False)

    def call(x: Any) -> Any:
        with tf.device(device_name):
            return inner(x)

    return tf.function(call, autograph=False, experimental_attributes={"_noinline": True})


def _median_seconds(run: Any, devices: str | Sequence[str], num_rounds: int) -> float:
    """Median wall seconds of ``run()`` after its warm-up (``profiles.timing.warm_up``: two untimed calls and on
    until they took WARM_SECONDS), each device named synced after each."""
    names = [devices] if isinstance(devices, str) else list(devices)
    warm_up([run], names, 2)
    return statistics.median(synced_seconds(run, names) for _ in range(num_rounds))


def _check_count(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer. Received: {name}={value!r}.")
