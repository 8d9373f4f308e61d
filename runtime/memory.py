"""Measures the memory a training step holds on each device: allocator statistics, or the step's allocation records.

On GPUs each device has its own allocator, and TensorFlow's statistics of it
(``tf.config.experimental.get_memory_info``, ``reset_memory_stats``) give each device's peak directly.

Logical CPU devices (``runtime.make_virtual_devices``) share ONE allocator, so its statistics give the
sum over devices only. The per-device split comes from the step's allocation records, which TensorFlow's
profiler writes (``tf.profiler.experimental.start`` / ``stop``; the trace is an XSpace protobuf, its
``/host:CPU`` plane). What the records hold, as read with TensorFlow 2.21:

    MemoryAllocation / MemoryDeallocation   one per allocator call, zero duration, on the calling thread
        addr, allocation_bytes      the block (a free names the block by addr)
        bytes_allocated             the allocator's bytes in use right after the call
        peak_bytes_in_use, allocator_name ('bfc_cpu_allocator_for_gpu' for every logical CPU device)
        tf_op                       the node that allocated, named inside ITS function ('PartitionedCall/add_2');
                                    absent for the eager conversion of the batch to tensors
        id                          the step id of the function run that allocated (0: eager)
        region_type, shape, data_type   (allocations made by a kernel)
    FunctionRun {id}                a function run starts: ``id`` is the step id its allocations carry
    ExecutorState::ProcessAsync::Start {name, step_id}   the call node (PartitionedCall...) that runs a
                                    nested function; the FunctionRun it starts lies inside it, on the same thread
    EagerExecute {eager_op, is_func}    the eager call of the step function, around its FunctionRun

No record names a device. So each allocation is traced to its function: its step id, the FunctionRun
of that id, the call node around that run (itself in a function found the same way, up to the eager
call), and the call node's function (``ExecutedNode.calls``). The node of that name in that function is
looked up in the graphs TensorFlow placed (``runtime.executed``), which name its device. A node name
alone does not do: the stages' functions share names (each stage's boundary function, ``stage<s>_forward``
and the others, calls its body through a node named ``PartitionedCall``). What cannot be traced (no ``tf_op``,
an eager op, a function run whose caller is not found, a node placed on two devices) goes to the unknown bucket,
with its op's name.

The records are checked against the allocator: replayed in time order (allocations add, frees remove
the block of that address), they must give ``bytes_allocated`` after every call and the allocator's own
peak, else ``ProfileError``. (TF_CPP_VMODULE=log_memory=2 logs the same allocations, but only when set
before TensorFlow starts, so in a child process, and without the function runs.)
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from partitioner.errors import InputError, ProfileError
from runtime.devices import canonical, local_device_names
from runtime.executed import ExecutedNode, collect_executed

UNKNOWN = "unknown"  # the bucket of allocations no device was found for
_RECORDS = ("MemoryAllocation", "MemoryDeallocation")  # the profiler's events of allocator calls


@dataclass(frozen=True)
class StepMemory:
    """The memory one training step held: in all, and per device.

    Per device, the figure is what the step held there beyond what was held when it started: on GPUs
    the device allocator's peak less its bytes in use at the start; from allocation records, the most
    bytes the step's own allocations on that device held at once. A step may free blocks it did not
    allocate (the last step's outputs): ``start_freed_bytes``. So, from records,

        max(device_peak_bytes) <= step_peak_bytes + start_freed_bytes
        step_peak_bytes        <= sum(device_peak_bytes) + unknown_peak_bytes

    Example:
        >>> m = step_memory(wrapped, x, y)                       # doctest: +SKIP
        >>> m.source, m.device_peak_bytes                        # doctest: +SKIP
        ('allocation records', {'/device:CPU:0': 190976, '/device:CPU:1': 20972800})
    """

    source: str  # "allocator statistics" (GPUs) or "allocation records" (logical CPU devices, one allocator)
    start_bytes: int  # bytes in use when the step started, all devices together
    # the most bytes in use at once during the step, all devices together; with allocator statistics the
    # sum of each device's peak, an upper bound, as the devices need not peak at the same time
    peak_bytes: int
    device_peak_bytes: dict[str, int]  # device -> the most bytes the step held there at once, beyond the start
    unknown_peak_bytes: int = 0  # the most bytes held at once by allocations no device was found for
    start_freed_bytes: int = 0  # bytes held at the start that the step freed (records only)
    # bytes allocated per op no device was found for ('': no op named, e.g. the batch made into tensors)
    unknown_ops: dict[str, int] = field(default_factory=dict)

    @property
    def step_peak_bytes(self) -> int:
        """The most bytes in use at once during the step beyond those in use when it started."""
        return self.peak_bytes - self.start_bytes


def step_memory(model: Any, x: Any, y: Any = None, sample_weight: Any = None) -> StepMemory:
    """Runs a training step of ``model`` (it updates the weights) and measures the memory it held per device.

    On GPUs it runs ONE step (``model.train_on_batch``) and reads each device's allocator statistics.
    On logical CPU devices it runs TWO: the first on freshly traced functions, to list where each node
    runs (``runtime.executed.collect_executed``; so a compiled model, and ``enable_collection()`` called
    first thing in the process), the second measured, under TensorFlow's profiler. The CPU's statistics
    need TensorFlow's BFC allocator: ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the environment before
    TensorFlow starts.

    Args:
        model: a compiled Keras model: a PipelinedModel, or a plain one.
        x: the inputs of one batch.
        y: its targets.
        sample_weight: its sample weights.

    Returns:
        A StepMemory.

    Raises:
        InputError: on CPUs, when the BFC allocator is off, graph dumps are off, or a profiler is running.
        ProfileError: when the allocation records do not replay to the allocator's figures.

    Example:
        >>> import os; os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"      # doctest: +SKIP
        >>> from runtime import executed; executed.enable_collection()       # doctest: +SKIP
        >>> runtime.make_virtual_devices(2)                                  # doctest: +SKIP
        >>> m = step_memory(wrapped, x, y)                                   # doctest: +SKIP
        >>> {d: b >> 20 for d, b in m.device_peak_bytes.items()}, m.unknown_peak_bytes >> 20   # doctest: +SKIP
        ({'/device:CPU:0': 41, '/device:CPU:1': 169}, 2)
    """
    import tensorflow as tf

    if tf.config.list_logical_devices("GPU"):
        return _from_statistics(model, x, y, sample_weight)
    return _from_records(model, x, y, sample_weight)


def _from_statistics(model: Any, x: Any, y: Any, sample_weight: Any) -> StepMemory:
    import tensorflow as tf

    devices = local_device_names()
    start = {}
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
        start[device] = tf.config.experimental.get_memory_info(device)["current"]
    model.train_on_batch(x, y, sample_weight=sample_weight)
    peak = {device: tf.config.experimental.get_memory_info(device)["peak"] for device in devices}
    return StepMemory(
        source="allocator statistics",
        start_bytes=sum(start.values()),
        peak_bytes=sum(peak.values()),
        device_peak_bytes={device: peak[device] - start[device] for device in devices},
    )


def _from_records(model: Any, x: Any, y: Any, sample_weight: Any) -> StepMemory:
    import tensorflow as tf

    # TensorFlow's default CPU allocator keeps no statistics: it reports 0 bytes in use (its BFC allocator,
    # chosen by TF_CPU_ALLOCATOR_USE_BFC before TensorFlow starts, keeps them, as a GPU's does). The
    # variable decides: once a profiler has run in the process the default allocator may report bytes too
    chosen = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true")
    if not chosen or tf.config.experimental.get_memory_info("CPU:0")["current"] == 0:
        raise InputError(
            "TensorFlow's CPU allocator keeps no statistics (it reports 0 bytes in use), so the step's memory "
            "cannot be measured. Set TF_CPU_ALLOCATOR_USE_BFC=true in the environment before TensorFlow starts "
            "(in a child process, or first thing in the script)."
        )
    if hasattr(model, "retrace"):  # a PipelinedModel: its stage functions too
        model.retrace()
    else:
        model.make_train_function(force=True)
    _, nodes = collect_executed(model.train_on_batch, x, y, sample_weight=sample_weight)
    with tempfile.TemporaryDirectory(prefix="step-memory-") as folder:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0)
        try:
            tf.profiler.experimental.start(folder, options=options)
        except tf.errors.AlreadyExistsError as err:
            raise InputError(
                "A TensorFlow profiler is running already, and only one can run at a time. Stop it "
                "(tf.profiler.experimental.stop()) before measuring a step's memory."
            ) from err
        try:
            tf.config.experimental.reset_memory_stats("CPU:0")
            start = tf.config.experimental.get_memory_info("CPU:0")["current"]
            model.train_on_batch(x, y, sample_weight=sample_weight)
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        finally:
            tf.profiler.experimental.stop()
        events = _host_events(folder)
    return _replay(events, nodes, start, peak)


@dataclass(frozen=True)
class _Event:
    """One event of the profiler's host plane: on which thread (line), when, what, with its stats."""

    line: int
    start_ps: int
    end_ps: int
    name: str
    stats: dict[str, Any]


def _host_events(folder: str) -> list[_Event]:
    """The events of the ``/host:CPU`` plane of the trace the profiler wrote under ``folder``."""
    # the profiler's trace format; checked with TensorFlow 2.21
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(f"{folder}/plugins/profile/*/*.xplane.pb")
    if len(paths) != 1:
        raise ProfileError(f"TensorFlow's profiler wrote {len(paths)} traces under {folder}, expected one.")
    space = xplane_pb2.XSpace()
    with open(paths[0], "rb") as file:
        space.ParseFromString(file.read())
    events = []
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                stats = {}
                for stat in event.stats:
                    kind = stat.WhichOneof("value")
                    value = getattr(stat, kind) if kind else None
                    stats[names[stat.metadata_id]] = names[value] if kind == "ref_value" else value
                start = line.timestamp_ns * 1000 + event.offset_ps
                name = plane.event_metadata[event.metadata_id].name
                events.append(_Event(line.id, start, start + event.duration_ps, name, stats))
    return events


def _replay(events: list[_Event], nodes: Iterable[ExecutedNode], start: int, peak: int) -> StepMemory:
    """Replays the allocation records in time order, each allocation on its node's device."""
    device_of = _device_finder(events, nodes)
    records = sorted((e for e in events if e.name in _RECORDS), key=lambda e: e.start_ps)
    held: dict[int, tuple[int, str]] = {}  # address -> bytes, device (or UNKNOWN) of each block the step allocated
    now: dict[str, int] = defaultdict(int)  # device -> bytes the step's own blocks there hold now
    most: dict[str, int] = {d: 0 for d in sorted({canonical(n.device) for n in nodes} - {""})}
    unknown_ops: dict[str, int] = defaultdict(int)
    in_use, most_in_use, freed, disagree = start, start, 0, 0
    for record in records:
        size = record.stats["allocation_bytes"]
        if record.name == "MemoryAllocation":
            device = device_of(record)
            if device == UNKNOWN:
                unknown_ops[record.stats.get("tf_op", "")] += size
            held[record.stats["addr"]] = (size, device)
            now[device] += size
            most[device] = max(most.get(device, 0), now[device])
            in_use += size
        else:
            block = held.pop(record.stats["addr"], None)
            if block is None:  # a block held when the step started
                freed += size
            else:
                now[block[1]] -= size
            in_use -= size
        disagree += in_use != record.stats["bytes_allocated"]
        most_in_use = max(most_in_use, in_use)
    if disagree or most_in_use != peak:
        raise ProfileError(
            f"The step's {len(records)} allocation records do not replay to the allocator's figures: {disagree} "
            f"disagree with its bytes in use, and they peak at {most_in_use} bytes where the allocator says {peak}. "
            "Expected every allocation of the step in the profiler's trace; measure again on an idle process."
        )
    unknown_peak = most.pop(UNKNOWN, 0)
    return StepMemory("allocation records", start, peak, most, unknown_peak, freed, dict(unknown_ops))


def _device_finder(events: list[_Event], nodes: Iterable[ExecutedNode]) -> Callable[[_Event], str]:
    """A function from an allocation record to the device of the node that made it, or UNKNOWN."""
    devices: dict[tuple[str, str], set[str]] = defaultdict(set)  # (function, node) -> its devices
    calls: dict[tuple[str, str], set[str]] = defaultdict(set)  # (function, call node) -> the functions it runs
    for node in nodes:
        devices[(node.graph, node.name)].add(canonical(node.device))
        if node.calls:
            calls[(node.graph, node.name)].add(node.calls)
    starts = _starts(events)
    functions: dict[int, str | None] = {}

    def function_of(step_id: int) -> str | None:
        """The function whose run carries ``step_id``: the eager call's, or the one its call node runs."""
        if step_id not in functions:
            functions[step_id] = None  # until found: a caller loop finds none
            how = starts.get(step_id, set())
            if len(how) == 1:
                (start,) = how
                if start[0] == "eager":
                    functions[step_id] = start[1]
                elif start[0] == "call" and (caller := function_of(start[1])) is not None:
                    runs = calls.get((caller, start[2]), set())
                    functions[step_id] = next(iter(runs)) if len(runs) == 1 else None
        return functions[step_id]

    def device_of(record: _Event) -> str:
        op, step_id = record.stats.get("tf_op"), record.stats.get("id")
        function = function_of(step_id) if op and step_id else None
        found = devices.get((function, op), set()) if function and op else set()
        return next(iter(found)) if len(found) == 1 else UNKNOWN

    return device_of


def _starts(events: list[_Event]) -> dict[int, set[tuple[Any, ...]]]:
    """Per step id, how the function runs that carry it were started, from the event around each run on its
    thread: ("eager", function) or ("call", the caller's step id, the call node), ("none",) if neither."""
    by_line: dict[int, list[_Event]] = defaultdict(list)
    for event in events:
        by_line[event.line].append(event)
    starts: dict[int, set[tuple[Any, ...]]] = defaultdict(set)
    for line in by_line.values():
        callers = [e for e in line if e.name == "ExecutorState::ProcessAsync::Start" or _eager_call(e)]
        for run in (e for e in line if e.name == "FunctionRun"):
            around = [c for c in callers if c.start_ps <= run.start_ps and run.end_ps <= c.end_ps]
            if not around:
                starts[run.stats["id"]].add(("none",))
                continue
            caller = max(around, key=lambda c: c.start_ps)  # the innermost
            if caller.name == "EagerExecute":
                starts[run.stats["id"]].add(("eager", caller.stats["eager_op"]))
            else:
                starts[run.stats["id"]].add(("call", caller.stats["step_id"], caller.stats["name"]))
    return starts


def _eager_call(event: _Event) -> bool:
    return event.name == "EagerExecute" and bool(event.stats.get("is_func"))
