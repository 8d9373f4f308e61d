"""Lists the nodes TensorFlow executed and their devices, nested and generated backward functions included."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.errors import InputError
from runtime.devices import canonical

# TensorFlow's graph dumper writes every graph that its ProcessFunctionLibraryRuntime places and
# partitions, at each stage, nested function calls included, named after the function. It reads the
# name filter once, when TensorFlow places its first function, and the folder and format at each dump.
_NAME_FILTER = "TF_DUMP_GRAPH_NAME_FILTER"
_FOLDER = "TF_DUMP_GRAPH_PREFIX"
_FORMAT = "TF_DUMP_GRAPH_FMT"
# '<function>_partition_<device, its '/' written '_'>.<count>.main.<stage>.pb'; this last stage is what runs
_PARTITION = re.compile(r"(?P<graph>.+)_partition_[^.]*device:[^.]+\.\d+\.main\.after_partition_passes\.pb")

_SOURCES = {"ReadVariableOp", "VarHandleOp", "Const", "HostConst", "_Arg", "_DeviceArg", "Placeholder"}
_FROM_ELSEWHERE = {"_Recv", "_HostRecv", "PartitionedCall", "StatefulPartitionedCall"}
# nodes that hand on their input unchanged: the written value's producer is behind them
_PASS_THROUGH = {"Identity", "IdentityN", "Snapshot", "StopGradient"}
# a written value whose producer is one of these was not computed on the write's device ("": not in the dump)
_NOT_COMPUTED_HERE = {"_Recv", "_HostRecv", "_Arg", "_DeviceArg", "Placeholder", ""}

_state = {"enabled": False, "probed": False}


@dataclass(frozen=True)
class ExecutedNode:
    """One node of a graph partition that TensorFlow placed and ran.

    ``graph`` is the function the node belongs to, as TensorFlow names it:

        __inference_step_330                 a traced ``tf.function`` named ``step``
        __forward_stage1_forward_139         a nested function ``stage1_forward`` that a GradientTape recorded
        __inference___backward_stage1_forward_125_140     the backward function generated for it
        ..._specialized_for_PartitionedCall_1_at___inference_step_330   one pruned for a single call site

    Example:
        >>> node                                  # doctest: +SKIP
        ExecutedNode(graph='__inference___backward_stage1_forward_125_140',
                     name='gradients/stage1/dense_1/MatMul_grad/MatMul', op='_MklMatMul',
                     device='/device:CPU:1', inputs=('gradients/stage1/dense_1/Relu_grad/ReluGrad', ...))
    """

    graph: str  # function name, e.g. '__inference___backward_stage1_forward_125_140'
    name: str  # node name, e.g. 'gradients/stage1/dense_1/MatMul_grad/MatMul'
    op: str  # kernel as run, e.g. 'MatMul', '_MklMatMul', '_MklNativeFusedMatMul' (MatMul + BiasAdd + Relu)
    device: str  # e.g. '/device:CPU:1'
    inputs: tuple[str, ...] = ()  # the nodes feeding its data inputs, all in its partition (graph and device)
    calls: str = ""  # for a function call node, the function it runs (an XLA-compiled one lists no body)
    dtype: str = ""  # the type it is instantiated for (attribute T), e.g. 'DT_VARIANT' for a _Send of a TensorList
    # a call of a function XLA must compile (attribute _XlaMustCompile: tf.function(jit_compile=True)): XLA compiles
    # it whole for the call's device and runs it there, tf.device scopes inside ignored (TensorFlow PR #125907)
    compiled: bool = False


@dataclass(frozen=True)
class VariableWrite:
    """A node that writes a variable, and the nodes of its partition that compute the value written.

    Example:
        >>> write.write.op, write.write.device, sorted({f.op for f in write.feeders})   # doctest: +SKIP
        ('AssignSubVariableOp', '/device:CPU:1', ['Mul', 'PartitionedCall', 'ReadVariableOp', 'Sub'])
    """

    write: ExecutedNode  # an Assign*VariableOp, ResourceApply* or ResourceScatter* node
    variable: str  # the node that supplies the variable's handle, e.g. the argument 'unknown_2'
    feeders: tuple[ExecutedNode, ...]  # every node between the write and its sources, sources included
    # the nodes that compute the value written, pass-through nodes (Identity...) skipped: the write itself
    # for a fused Resource*Apply* kernel; a name not in the partition is missing (never happens in a dump)
    values: tuple[ExecutedNode, ...] = ()

    @property
    def computed_here(self) -> bool:
        """True iff the value written was computed on the write's device (so on the variable's).

        Each node that computes the value (``values``) must be in the write's partition and compute
        it there: not a ``_Recv`` (computed on another device) nor a function argument (computed by
        the caller). A fused ``Resource*Apply*`` kernel computes its update itself, on the variable's
        device. It is not enough that some feeder is local: a scatter whose indices are computed here
        but whose rows are received writes a value computed elsewhere.

        Example:
            >>> [w.computed_here for w in executed.variable_writes(nodes)]     # doctest: +SKIP
            [True, True, False]
        """
        return bool(self.values) and all(v.op not in _NOT_COMPUTED_HERE for v in self.values)


def enable_collection() -> None:
    """Turns on TensorFlow's graph dumps; call it before TensorFlow places its first function.

    TensorFlow reads the switch once, when it places its first function (the first ``tf.function``
    call, or the first Keras layer built), so call this first thing in a script, or at import time of
    a test module or conftest. It sets ``TF_DUMP_GRAPH_NAME_FILTER=*`` and ``TF_DUMP_GRAPH_FMT=BIN``
    for the rest of the process; ``collect_executed`` sets ``TF_DUMP_GRAPH_PREFIX`` only while it
    runs. Outside those runs TensorFlow writes nothing, but logs a warning for each graph it would
    have dumped (hidden with ``TF_CPP_MIN_LOG_LEVEL=2``, as the tests' conftest sets).

    Example:
        >>> from runtime import executed           # doctest: +SKIP
        >>> executed.enable_collection()           # doctest: +SKIP
    """
    os.environ.setdefault(_NAME_FILTER, "*")
    os.environ[_FORMAT] = "BIN"
    _state["enabled"] = True


def collect_executed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[ExecutedNode]]:
    """Runs ``fn`` and returns its result and every node of every function TensorFlow placed meanwhile.

    TensorFlow places a function the first time it runs it, and every later run executes that
    placement. The traced step is placed as a whole; a nested function that is not inlined
    (``tf.function(f, experimental_attributes={"_noinline": True})``), and each backward function
    TensorFlow generates for one, is placed on its own, when the call first runs, with the calling
    op's device as the default for its nodes. All of them are listed here, each node under the
    function it belongs to and the device it ran on. ``context.export_run_metadata()`` lists only the
    functions the eager runtime places itself (the outer step), not the nested ones, and
    ``tf.debugging.set_log_device_placement`` only works if set before TensorFlow starts and does not
    name the graphs (checked with TensorFlow 2.21).

    Call it on a fresh function (for Keras: a newly compiled model, or after
    ``model.make_train_function(force=True)``): a function placed before the call is not listed.
    Nor is a function whose dump file name would pass 255 characters (TensorFlow logs "Failed to dump
    graph": a nested body specialised for a call site in a call site gets such a name), nor the body
    of an XLA-compiled function: a call node whose ``calls`` names no listed graph was not read.

    Args:
        fn: what to run, e.g. ``model.train_on_batch``.
        *args: passed to ``fn``.
        **kwargs: passed to ``fn``.

    Returns:
        ``fn``'s result, and the nodes in no particular order. A function placed twice alike (two
        calls from one device) is listed once; placed on two devices, it is listed twice.

    Raises:
        InputError: when ``enable_collection`` was not called, or was called too late, or when
            ``fn`` placed no new function.

    Example:
        >>> executed.enable_collection()                                         # doctest: +SKIP
        >>> _, nodes = executed.collect_executed(model.train_on_batch, x, y)     # doctest: +SKIP
        >>> {n.device for n in nodes if "stage1_forward" in n.graph and "MatMul" in n.op}   # doctest: +SKIP
        {'/device:CPU:1'}
    """
    _check_enabled()
    with _dumps_to_temporary_folder() as folder:
        result = fn(*args, **kwargs)
        nodes = _read_dumps(folder)
    if not nodes:
        raise InputError(
            "fn placed no new function, so there is nothing to list: TensorFlow places a function once, the first "
            "time it runs it. Call collect_executed on a fresh function (for Keras, a newly compiled model or "
            "model.make_train_function(force=True))."
        )
    return result, nodes


def variable_writes(nodes: Iterable[ExecutedNode]) -> list[VariableWrite]:
    """Finds each node that writes a variable and the nodes of its partition that compute the value written.

    A write is an ``Assign*VariableOp``, ``Resource*Apply*`` or ``ResourceScatter*`` node. From it the
    search walks data inputs backwards within the write's partition (one function on one device) and
    stops at a source: a variable read, a constant, a function argument, a ``_Recv`` (the value was
    computed on another device) or a nested function call (the value was computed in another
    graph; look that up by name). Sources are included. So a write whose feeders are only a
    ``_Recv`` had its update arithmetic done on another device, and arithmetic ops (``Mul``,
    ``Sub``, ``Sqrt``, ``RealDiv``...) among the feeders ran on the write's device. Whether the
    value written was computed there is ``VariableWrite.computed_here``: it looks at the node that
    produces the value (``values``), not at any feeder.

    Limits: it follows data edges only, so it finds what computes the value, not what merely runs
    before; it names the variable by the node that supplies its handle (inside a function, an
    argument such as ``unknown_2``, which it cannot map back to a Keras variable); and where the
    value is computed in a nested function it stops at the call.

    Args:
        nodes: the nodes ``collect_executed`` returned.

    Returns:
        One VariableWrite per write node, in the order of ``nodes``.

    Example:
        >>> for write in executed.variable_writes(nodes):                                   # doctest: +SKIP
        ...     print(write.write.device, sorted({f.op for f in write.feeders}))
        /device:CPU:1 ['AddV2', 'Mul', 'PartitionedCall', 'ReadVariableOp', 'Sub']
        /device:CPU:1 ['_Recv']                     <- computed elsewhere, only written here
    """
    nodes = list(nodes)
    partitions: dict[tuple[str, str], dict[str, ExecutedNode]] = {}
    for node in nodes:
        partitions.setdefault((node.graph, node.device), {})[node.name] = node
    writes = []
    for node in nodes:
        if not _is_write(node.op) or not node.inputs:
            continue
        partition = partitions[(node.graph, node.device)]
        feeders: dict[str, ExecutedNode] = {}
        stack = list(node.inputs[1:])  # input 0 is the variable's handle
        while stack:
            feeder = partition.get(stack.pop())
            if feeder is None or feeder.name in feeders:
                continue
            feeders[feeder.name] = feeder
            if feeder.op not in _SOURCES and feeder.op not in _FROM_ELSEWHERE:
                stack.extend(feeder.inputs)
        value = node.inputs[_value_input(node.op) :][:1]
        values = (node,) if _is_fused_update(node.op) else _producers(value, partition)
        writes.append(VariableWrite(node, node.inputs[0], tuple(feeders.values()), values))
    return writes


def _is_fused_update(op: str) -> bool:
    return op.startswith("Resource") and "Apply" in op


def _value_input(op: str) -> int:
    """The position of the value a write writes: 2 for ResourceScatter* (variable, indices, updates), else 1."""
    return 2 if op.startswith("ResourceScatter") else 1


def _producers(names: Iterable[str], partition: dict[str, ExecutedNode]) -> tuple[ExecutedNode, ...]:
    """The nodes that compute ``names``' values, pass-through nodes skipped (an IdentityN: every input,
    as an input name carries no output port here); a name not in the partition gives a node of op "",
    so that the value does not count as computed here."""
    found: dict[str, ExecutedNode] = {}
    stack, seen = list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = partition.get(name)
        if node is None:
            found[name] = ExecutedNode("", name, "", "")
        elif node.op in _PASS_THROUGH:
            stack.extend(node.inputs)
        else:
            found[name] = node
    return tuple(found.values())


def _is_write(op: str) -> bool:
    if op.startswith("Assign") and op.endswith("VariableOp"):
        return True
    return op.startswith("Resource") and ("Apply" in op or op.startswith("ResourceScatter"))


def _check_enabled() -> None:
    if not _state["enabled"] or os.environ.get(_NAME_FILTER) != "*":
        raise InputError(
            "TensorFlow's graph dumps are off. Call runtime.executed.enable_collection() before TensorFlow places "
            f"its first function (first thing in the script, or in conftest.py). Received: {_NAME_FILTER}="
            f"{os.environ.get(_NAME_FILTER)!r}."
        )
    if not _state["probed"]:
        _probe()


def _probe() -> None:
    """Places a tiny function and checks that TensorFlow dumped it (it reads the switch only once)."""
    import tensorflow as tf

    with _dumps_to_temporary_folder() as folder:
        tf.function(lambda: tf.constant(1.0) + 1.0)()
        dumped = any(folder.iterdir())
    if not dumped:
        raise InputError(
            "enable_collection() ran after TensorFlow had placed its first function, and TensorFlow reads that "
            "switch only once, so it dumps no graphs in this process. Call it before any tf.function runs or "
            "any Keras layer is built."
        )
    _state["probed"] = True


@contextlib.contextmanager
def _dumps_to_temporary_folder() -> Iterator[Path]:
    previous = os.environ.get(_FOLDER)
    with tempfile.TemporaryDirectory(prefix="executed-") as folder:
        os.environ[_FOLDER] = folder
        try:
            yield Path(folder)
        finally:
            if previous is None:
                del os.environ[_FOLDER]
            else:
                os.environ[_FOLDER] = previous


def _read_dumps(folder: Path) -> list[ExecutedNode]:
    from tensorflow.core.framework import graph_pb2, types_pb2

    nodes: dict[ExecutedNode, None] = {}  # an ordered set
    for path in sorted(folder.iterdir()):
        match = _PARTITION.fullmatch(path.name)
        if match is None:
            continue
        graph_def = graph_pb2.GraphDef()
        graph_def.ParseFromString(path.read_bytes())
        for node in graph_def.node:
            inputs = tuple(i.split(":")[0] for i in node.input if not i.startswith("^"))
            calls = node.attr["f"].func.name if "f" in node.attr else ""
            dtype = types_pb2.DataType.Name(node.attr["T"].type) if "T" in node.attr else ""
            compiled = bool(calls) and "_XlaMustCompile" in node.attr and node.attr["_XlaMustCompile"].b
            device = canonical(node.device)
            nodes[ExecutedNode(match["graph"], node.name, node.op, device, inputs, calls, dtype, compiled)] = None
    return list(nodes)
