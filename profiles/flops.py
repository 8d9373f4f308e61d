"""Counts the forward FLOPs of a traced TensorFlow graph, op by op.

The profiler traces each layer call once with ``tf.function`` at micro-batch shapes and sums
:func:`op_flops` over the ops of the traced graph (:func:`graph_flops`). A multiply-add counts as
two FLOPs. The formulas, with ``out`` the number of output elements::

    op                                          forward FLOPs
    ------------------------------------------  ---------------------------------------------------
    MatMul, BatchMatMul, BatchMatMulV2/V3       2 * out * K                (K: contracted size)
    Einsum                                      2 * (n - 1) * product of every index size for n >= 2
                                                operands; input elements for one operand
    Conv2D, Conv3D (Conv1D is a Conv2D in TF)   2 * out * kernel_h * kernel_w [* kernel_d] * C_in
    DepthwiseConv2dNative                       2 * out * kernel_h * kernel_w
    Conv2DBackpropInput, Conv3DBackpropInputV2  2 * in * kernel_h * kernel_w [* kernel_d] * C_out
      (Conv2DTranspose, Conv3DTranspose)
    CudnnRNN*                                   2 * T * B * gates * H * (I + H)
    MaxPool, AvgPool (2D and 3D)                out * window size
    Sum, Mean, Max, Min, Prod, ArgMax, ...      input elements
    Softmax, LogSoftmax                         5 * input elements  (max, subtract, exp, sum, divide)
    AddN                                        (n - 1) * out
    FusedBatchNorm*                             5 (training) or 2 (inference) * input elements
    data movement (Reshape, Transpose, Concat,  0
      Gather, Slice, Pad, Cast, ReadVariableOp,
      Const, Identity, TensorList*, ...)
    any other op (Add, Mul, Relu, Exp, ...)     out  (one FLOP per output element)

Ops the table does not name therefore count one FLOP per output element: most of them are
elementwise math, and the count errs on the side of work rather than none. Function calls
(``PartitionedCall``), loops (``While``, body FLOPs times the trip count when it is static, else
once) and conditionals (``If``, ``Case``: the costlier branch) are followed into their bodies.
Dead ops (no path to an output or side effect) are skipped, as TensorFlow prunes them.
Dimensions that stay unknown count as 0 elements.

Example:
    >>> import tensorflow as tf                                          # doctest: +SKIP
    >>> f = tf.function(lambda a, b: tf.matmul(a, b))                    # doctest: +SKIP
    >>> g = f.get_concrete_function(tf.TensorSpec([4, 8]), tf.TensorSpec([8, 16])).graph  # doctest: +SKIP
    >>> graph_flops(g)                                                   # doctest: +SKIP
    1024.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from profiles.internals import function_graph

SOFTMAX_FLOPS_PER_ELEMENT = 5  # max, subtract, exp, sum, divide

# Ops that move, reshape or describe data without arithmetic.
# fmt: off
ZERO_FLOP_OPS = frozenset([
    "Assert", "AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp", "BatchToSpaceND", "Bitcast",
    "BroadcastArgs", "BroadcastGradientArgs", "BroadcastTo", "Cast", "CheckNumerics", "Concat", "ConcatV2",
    "Const", "DepthToSpace", "Enter", "Exit", "ExpandDims", "Fill", "Gather", "GatherNd", "GatherV2",
    "Identity", "IdentityN", "LoopCond", "Merge", "MirrorPad", "NextIteration", "NoOp", "OneHot", "OnesLike",
    "Pack", "Pad", "PadV2", "Placeholder", "PlaceholderWithDefault", "PreventGradient", "Print", "PrintV2",
    "Range", "Rank", "ReadVariableOp", "Reshape", "ResourceGather", "ReverseV2", "Shape", "ShapeN", "Size",
    "Slice", "Snapshot", "SpaceToBatchND", "SpaceToDepth", "Split", "SplitV", "Squeeze", "StopGradient",
    "StridedSlice", "StringFormat", "Switch", "TensorArrayGatherV3", "TensorArrayReadV3",
    "TensorArrayScatterV3", "TensorArraySizeV3", "TensorArrayV3", "TensorArrayWriteV3",
    "TensorListElementShape", "TensorListFromTensor", "TensorListGetItem", "TensorListLength",
    "TensorListPopBack", "TensorListPushBack", "TensorListReserve", "TensorListSetItem", "TensorListStack",
    "Tile", "Transpose", "Unpack", "VarHandleOp", "VarIsInitializedOp", "ZerosLike",
])
# fmt: on
REDUCTION_OPS = frozenset(["All", "Any", "ArgMax", "ArgMin", "EuclideanNorm", "Max", "Mean", "Min", "Prod", "Sum"])
MATMUL_OPS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"])
CONV_OPS = frozenset(["Conv2D", "Conv3D"])
TRANSPOSED_CONV_OPS = frozenset(["Conv2DBackpropInput", "Conv3DBackpropInput", "Conv3DBackpropInputV2"])
POOL_OPS = frozenset(["AvgPool", "AvgPool3D", "MaxPool", "MaxPool3D", "MaxPoolV2"])
CUDNN_RNN_OPS = frozenset(["CudnnRNN", "CudnnRNNV2", "CudnnRNNV3"])
_CALL_OPS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
_WHILE_OPS = frozenset(["While", "StatelessWhile"])
_IF_OPS = frozenset(["If", "StatelessIf"])
_CASE_OPS = frozenset(["Case", "StatelessCase"])
_RNN_GATES = {"lstm": 4, "gru": 3, "rnn_relu": 1, "rnn_tanh": 1}


def num_elements(shape: tf.TensorShape | Iterable[int | None] | None) -> int:
    """Returns the number of elements of a shape; 0 when a dimension (or the rank) is unknown.

    Example:
        >>> num_elements([4, 8])
        32
    """
    if shape is None:
        return 0
    dims = tf.TensorShape(shape)
    if dims.rank is None:
        return 0
    size = 1
    for dim in dims.as_list():
        if dim is None:
            return 0
        size *= dim
    return size


def _dims(tensor: tf.Tensor) -> list[int | None]:
    shape = tensor.shape
    return [] if shape.rank is None else list(shape.as_list())


def _size(value: int | None) -> int:
    return 0 if value is None else int(value)


def _outputs_elements(op: tf.Operation) -> int:
    return sum(num_elements(out.shape) for out in op.outputs)


def _einsum_flops(equation: str, shapes: list[list[int | None]]) -> float:
    """FLOPs of an einsum: 2 * product of all index sizes for two operands, input size for one."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != len(shapes):
        return 0.0
    sizes: dict[str, int] = {}
    ellipsis = 1
    for spec, shape in zip(inputs, shapes, strict=True):
        if "..." in spec:
            head, tail = spec.split("...")
            num_broadcast = len(shape) - len(head) - len(tail)
            broadcast = shape[len(head) : len(head) + num_broadcast]
            ellipsis = max(ellipsis, math.prod(_size(d) for d in broadcast))
            shape = shape[: len(head)] + shape[len(head) + num_broadcast :]
            spec = head + tail
        if len(spec) != len(shape):
            return 0.0
        for letter, dim in zip(spec, shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 0), _size(dim))
    if len(shapes) == 1:
        return float(math.prod(_size(d) for d in shapes[0]))
    return 2.0 * (len(shapes) - 1) * math.prod(sizes.values()) * ellipsis


def _cudnn_rnn_flops(op: tf.Operation) -> float:
    """2 * T * B * gates * H * (I + H) for each layer and direction of a cuDNN RNN."""
    gates = _RNN_GATES.get(op.get_attr("rnn_mode").decode(), 4)
    x, h = _dims(op.inputs[0]), _dims(op.inputs[1])
    if len(x) != 3 or len(h) != 3:
        return 0.0
    time_major = True
    if "time_major" in op.node_def.attr:
        time_major = bool(op.get_attr("time_major"))
    steps, batch = (x[0], x[1]) if time_major else (x[1], x[0])
    layers_dirs, units, features = _size(h[0]), _size(h[2]), _size(x[2])
    return 2.0 * _size(steps) * _size(batch) * gates * units * (features + units) * max(layers_dirs, 1)


def op_flops(op: tf.Operation) -> float:
    """Returns the forward FLOPs of one op (not following function calls; see the module table).

    Example:
        >>> import tensorflow as tf                                      # doctest: +SKIP
        >>> g = tf.function(tf.nn.relu).get_concrete_function(tf.TensorSpec([4, 8])).graph  # doctest: +SKIP
        >>> [op_flops(op) for op in g.get_operations()]                  # doctest: +SKIP
        [0.0, 32.0, 0.0]
    """
    kind = op.type
    if kind in ZERO_FLOP_OPS:
        return 0.0
    out = _outputs_elements(op)
    if kind in MATMUL_OPS:
        a = _dims(op.inputs[0])
        if len(a) < 2:
            return 0.0
        if kind == "MatMul":
            k = a[0] if op.get_attr("transpose_a") else a[1]
        else:
            k = a[-2] if op.get_attr("adj_x") else a[-1]
        return 2.0 * num_elements(op.outputs[0].shape) * _size(k)
    if kind == "Einsum":
        return _einsum_flops(op.get_attr("equation").decode(), [_dims(t) for t in op.inputs])
    if kind in CONV_OPS:
        kernel = _dims(op.inputs[1])  # [kh, kw, (kd,) C_in per group, C_out]
        return 2.0 * num_elements(op.outputs[0].shape) * math.prod(_size(d) for d in kernel[:-1])
    if kind == "DepthwiseConv2dNative":
        kernel = _dims(op.inputs[1])  # [kh, kw, C_in, multiplier]
        return 2.0 * num_elements(op.outputs[0].shape) * math.prod(_size(d) for d in kernel[:2])
    if kind in TRANSPOSED_CONV_OPS:
        kernel = _dims(op.inputs[1])  # [kh, kw, (kd,) C_out, C_in]; input 2 is the transposed conv's input
        return 2.0 * num_elements(op.inputs[2].shape) * math.prod(_size(d) for d in kernel[:-1])
    if kind in CUDNN_RNN_OPS:
        return _cudnn_rnn_flops(op)
    if kind in POOL_OPS:
        if "ksize" in op.node_def.attr:
            window = math.prod(int(k) for k in op.get_attr("ksize"))
        else:  # MaxPoolV2 takes ksize as an input
            window = math.prod(int(k) for k in (tf.get_static_value(op.inputs[1]) or [1]))
        return float(num_elements(op.outputs[0].shape) * window)
    if kind in REDUCTION_OPS:
        return float(num_elements(op.inputs[0].shape))
    if kind in ("Softmax", "LogSoftmax"):
        return float(SOFTMAX_FLOPS_PER_ELEMENT * num_elements(op.inputs[0].shape))
    if kind == "AddN":
        return float(max(len(op.inputs) - 1, 0) * out)
    if kind.startswith("FusedBatchNorm"):
        per_element = 5 if op.get_attr("is_training") else 2
        return float(per_element * num_elements(op.inputs[0].shape))
    return float(out)


def graph_flops(graph: tf.Graph) -> float:
    """Returns the forward FLOPs of every op of ``graph``, following calls, loops and conditionals.

    Args:
        graph: a traced graph, e.g. ``tf.function(f).get_concrete_function(*specs).graph``.

    Example:
        >>> f = tf.function(lambda a, b: tf.matmul(a, b))                # doctest: +SKIP
        >>> graph_flops(f.get_concrete_function(tf.TensorSpec([4, 8]), tf.TensorSpec([8, 16])).graph)  # doctest: +SKIP
        1024.0
    """
    return fold_graph(graph, op_flops)


def fold_graph(graph: tf.Graph, leaf: Callable[[tf.Operation], float]) -> float:
    """Sums ``leaf(op)`` over the ops of ``graph``, recursing into function bodies.

    A ``While`` body counts trip-count times (once when the trip count is not static), a
    conditional counts its costliest branch, a call counts its function once.

    Example:
        >>> fold_graph(graph, lambda op: 1.0)  # the number of ops              # doctest: +SKIP
        12.0
    """
    return _Folder(graph, leaf).fold(graph)


class _Folder:
    """Walks a graph and the function bodies it calls, memoising each body by name."""

    def __init__(self, root: tf.Graph, leaf: Callable[[tf.Operation], float]) -> None:
        self._root = root
        self._leaf = leaf
        self._memo: dict[str, float] = {}

    def fold(self, graph: tf.Graph) -> float:
        total = 0.0
        for op in live_ops(graph):
            kind = op.type
            if kind in _CALL_OPS:
                total += self._function(op, op.get_attr("f").name)
            elif kind in _WHILE_OPS:
                total += _trip_count(op) * self._function(op, op.get_attr("body").name)
            elif kind in _IF_OPS:
                branches = [op.get_attr("then_branch").name, op.get_attr("else_branch").name]
                total += max(self._function(op, name) for name in branches)
            elif kind in _CASE_OPS:
                total += max((self._function(op, f.name) for f in op.get_attr("branches")), default=0.0)
            else:
                total += self._leaf(op)
        return total

    def _function(self, op: tf.Operation, name: str) -> float:
        if name not in self._memo:
            self._memo[name] = 0.0  # guards against recursion
            body = function_graph(op.graph, name) or function_graph(self._root, name)
            self._memo[name] = self.fold(body) if body is not None else 0.0
        return self._memo[name]


def live_ops(graph: tf.Graph) -> list[tf.Operation]:
    """The ops the outputs (and side effects) of a traced graph depend on, in graph order.

    Dead code, which TensorFlow prunes before running, is left out: a Keras RNN, for one, runs
    its first step outside the loop only to learn the output shape.

    Example:
        >>> [op.type for op in live_ops(graph)]                                # doctest: +SKIP
        ['Placeholder', 'Relu', 'Identity']
    """
    roots = [t.op for t in getattr(graph, "outputs", [])] + list(getattr(graph, "control_outputs", []))
    if not roots:
        return list(graph.get_operations())
    live: set[tf.Operation] = set()
    stack = roots
    while stack:
        op = stack.pop()
        if op in live:
            continue
        live.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return [op for op in graph.get_operations() if op in live]


def _trip_count(op: tf.Operation) -> int:
    """The static ``maximum_iterations`` of a While op (its input 1), else 1."""
    value = _static_value(op.inputs[1]) if len(op.inputs) > 1 else None
    if value is None or np.ndim(value) != 0 or int(value) < 0:
        return 1
    return int(value)


def _static_value(tensor: tf.Tensor) -> Any:
    """``tf.get_static_value``, plus reductions of static tensors (Keras RNNs use ``Max``)."""
    value = tf.get_static_value(tensor)
    if value is not None:
        return value
    op = tensor.op
    reducers: dict[str, Callable[..., Any]] = {"Max": np.max, "Min": np.min, "Sum": np.sum, "Prod": np.prod}
    if op.type in reducers and len(op.inputs) == 2:
        data, axes = tf.get_static_value(op.inputs[0]), tf.get_static_value(op.inputs[1])
        if data is not None and axes is not None:
            axis = tuple(int(a) for a in np.atleast_1d(axes))
            if np.ndim(data) == 0 or not axis:
                return data
            return reducers[op.type](data, axis=axis, keepdims=bool(op.get_attr("keep_dims")))
    return None
