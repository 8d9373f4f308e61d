"""Tests the per-op FLOP formulas on tiny traced TensorFlow graphs."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

from profiles.flops import fold_graph, graph_flops, num_elements, op_flops  # noqa: E402


def _graph(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph


def _ops(graph, kind):
    return [op for op in graph.get_operations() if op.type == kind]


def _spec(*shape, dtype="float32"):
    return tf.TensorSpec(shape, dtype)


def test_num_elements_known_and_unknown():
    assert num_elements([4, 8]) == 32
    assert num_elements([]) == 1
    assert num_elements([4, None]) == 0
    assert num_elements(None) == 0


def test_op_flops_matmul_is_two_per_multiply_add():
    graph = _graph(tf.matmul, _spec(4, 8), _spec(8, 16))
    (matmul,) = _ops(graph, "MatMul")
    assert op_flops(matmul) == 2 * 4 * 8 * 16


def test_op_flops_matmul_with_transposed_input():
    graph = _graph(lambda a, b: tf.matmul(a, b, transpose_a=True), _spec(8, 4), _spec(8, 16))
    (matmul,) = _ops(graph, "MatMul")
    assert op_flops(matmul) == 2 * 4 * 8 * 16


def test_op_flops_batch_matmul():
    graph = _graph(tf.matmul, _spec(3, 4, 8), _spec(3, 8, 16))
    (matmul,) = [op for op in graph.get_operations() if op.type.startswith("BatchMatMul")]
    assert op_flops(matmul) == 2 * 3 * 4 * 8 * 16


@pytest.mark.parametrize(
    ("equation", "shapes", "expected"),
    [
        ("ab,bc->ac", [(4, 8), (8, 16)], 2 * 4 * 8 * 16),
        ("BTNH,BSNH->BNTS", [(2, 5, 3, 4), (2, 7, 3, 4)], 2 * 2 * 5 * 3 * 4 * 7),
        ("...ij,...jk->...ik", [(2, 3, 4, 8), (2, 3, 8, 16)], 2 * 6 * 4 * 8 * 16),
        ("ij->ji", [(4, 8)], 4 * 8),
    ],
)
def test_op_flops_einsum(equation, shapes, expected):
    specs = [_spec(*shape) for shape in shapes]
    graph = _graph(lambda *xs: tf.einsum(equation, *xs), *specs)
    (einsum,) = _ops(graph, "Einsum")
    assert op_flops(einsum) == expected


def test_op_flops_conv2d():
    graph = _graph(lambda x, k: tf.nn.conv2d(x, k, 1, "VALID"), _spec(2, 10, 10, 3), _spec(3, 3, 3, 8))
    (conv,) = _ops(graph, "Conv2D")
    assert op_flops(conv) == 2 * (2 * 8 * 8 * 8) * 3 * 3 * 3


def test_op_flops_conv1d_is_a_conv2d():
    graph = _graph(lambda x, k: tf.nn.conv1d(x, k, 1, "VALID"), _spec(2, 10, 3), _spec(3, 3, 8))
    assert graph_flops(graph) == 2 * (2 * 8 * 8) * 3 * 3


def test_op_flops_conv3d():
    graph = _graph(lambda x, k: tf.nn.conv3d(x, k, [1] * 5, "VALID"), _spec(1, 6, 6, 6, 2), _spec(3, 3, 3, 2, 4))
    (conv,) = _ops(graph, "Conv3D")
    assert op_flops(conv) == 2 * (4 * 4 * 4 * 4) * 27 * 2


def test_op_flops_depthwise_conv():
    graph = _graph(
        lambda x, k: tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "VALID"), _spec(2, 6, 6, 4), _spec(3, 3, 4, 2)
    )
    (conv,) = _ops(graph, "DepthwiseConv2dNative")
    assert op_flops(conv) == 2 * (2 * 4 * 4 * 8) * 3 * 3


def test_op_flops_transposed_conv_counts_its_input():
    def transposed(x, k):
        return tf.nn.conv2d_transpose(x, k, [2, 10, 10, 4], 2, "SAME")

    graph = _graph(transposed, _spec(2, 5, 5, 3), _spec(3, 3, 4, 3))
    (conv,) = _ops(graph, "Conv2DBackpropInput")
    assert op_flops(conv) == 2 * (2 * 5 * 5 * 3) * 3 * 3 * 4


def test_op_flops_pooling_counts_the_window():
    graph = _graph(lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID"), _spec(2, 8, 8, 3))
    (pool,) = _ops(graph, "MaxPool")
    assert op_flops(pool) == (2 * 4 * 4 * 3) * 4


def test_op_flops_reduction_and_softmax_count_input_elements():
    graph = _graph(lambda x: tf.reduce_sum(tf.nn.softmax(x), axis=1), _spec(4, 10))
    (softmax,) = _ops(graph, "Softmax")
    (total,) = _ops(graph, "Sum")
    assert op_flops(softmax) == 5 * 40
    assert op_flops(total) == 40


def test_op_flops_elementwise_and_addn():
    graph = _graph(lambda a, b: tf.add_n([tf.nn.relu(a), b, a]), _spec(4, 8), _spec(4, 8))
    (relu,) = _ops(graph, "Relu")
    (add_n,) = _ops(graph, "AddN")
    assert op_flops(relu) == 32
    assert op_flops(add_n) == 2 * 32


def test_op_flops_data_movement_is_free():
    graph = _graph(lambda x: tf.transpose(tf.reshape(x, [8, 4])), _spec(4, 8))
    assert graph_flops(graph) == 0


def test_graph_flops_follows_nested_function_calls():
    inner = tf.function(lambda a, b: tf.matmul(a, b))
    graph = _graph(lambda a, b: inner(a, b) + 1.0, _spec(4, 8), _spec(8, 16))
    assert graph_flops(graph) == 2 * 4 * 8 * 16 + 4 * 16


def test_graph_flops_while_loop_multiplies_the_body():
    def loop(x):
        return tf.while_loop(lambda i, y: i < 5, lambda i, y: (i + 1, y * 2.0), [0, x], maximum_iterations=5)[1]

    graph = _graph(loop, _spec(4, 8))
    # 5 iterations of a Mul over 32 elements, plus the counter's scalar adds and compares
    assert 5 * 32 <= graph_flops(graph) <= 5 * 32 + 20


def test_graph_flops_conditional_takes_the_costlier_branch():
    def branch(flag, a, b):
        return tf.cond(flag, lambda: tf.matmul(a, b), lambda: tf.zeros([4, 16]))

    graph = _graph(branch, _spec(dtype="bool"), _spec(4, 8), _spec(8, 16))
    assert graph_flops(graph) == 2 * 4 * 8 * 16


def test_fold_graph_counts_ops():
    graph = _graph(lambda x: tf.nn.relu(x) * 2.0, _spec(4))
    assert fold_graph(graph, lambda op: 1.0) == len(graph.get_operations())


def test_graph_flops_keras_lstm_counts_every_time_step():
    import keras

    lstm = keras.layers.LSTM(8)
    steps, batch, features = 6, 4, 3
    graph = _graph(lambda x: lstm(x), _spec(batch, steps, features))
    matmuls = steps * 2 * batch * 4 * 8 * (features + 8)
    assert matmuls <= graph_flops(graph) <= 1.3 * matmuls
