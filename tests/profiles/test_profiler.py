"""Tests profile_model on tiny Keras models: the layer-graph contract, costs, errors and JSON."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

keras = pytest.importorskip("keras")

from tf_split import kept_for_backward  # noqa: E402

from partitioner.cluster import Cluster  # noqa: E402
from partitioner.cost import CostModel, forward_share  # noqa: E402
from partitioner.errors import InputError, ProfileError  # noqa: E402
from partitioner.graph import (  # noqa: E402
    graph_from_dict,
    graph_to_dict,
    rescale_graph,
    topological_order,
    validate_graph,
)
from profiles import load_profile, profile_model, save_profile  # noqa: E402

layers = keras.layers


def mlp(hidden=32):
    inputs = keras.Input((16,), name="x")
    h = layers.Dense(hidden, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, layers.Dense(8, name="logits")(h), name="mlp")


def cnn():
    inputs = keras.Input((12, 12, 8), name="image")
    h = layers.Conv2D(16, 3, name="conv")(inputs)
    h = layers.BatchNormalization(name="bn")(h)
    h = layers.Dropout(0.5, name="drop")(h)
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inputs, layers.Dense(4, name="head")(h), name="cnn")


def shared():
    inputs = keras.Input((8,), name="x")
    dense = layers.Dense(8, name="shared")
    return keras.Model(inputs, dense(dense(inputs)), name="shared_model")


def nested():
    block = keras.Sequential([keras.Input((8,)), layers.Dense(6, name="inner_a"), layers.Dense(4, name="inner_b")])
    inputs = keras.Input((8,), name="x")
    h = layers.Dense(8, name="pre")(inputs)
    return keras.Model(inputs, layers.Dense(2, name="post")(block(h)), name="nested")


def two_in_two_out():
    a, b = keras.Input((4,), name="a"), keras.Input((6,), name="b")
    joined = layers.Concatenate(name="join")([layers.Dense(5, name="da")(a), layers.Dense(5, name="db")(b)])
    out1 = layers.Dense(3, name="out1")(joined)
    out2 = layers.Dense(1, name="out2")(joined)
    return keras.Model([a, b], [out1, out2], name="two_io")


class Block(layers.Layer):
    """A composite layer: two Dense sublayers and a residual add."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(units * 2, activation="relu")
        self.down = layers.Dense(units)

    def call(self, x):
        return x + self.down(self.up(x))


def with_block():
    inputs = keras.Input((8,), name="x")
    return keras.Model(inputs, Block(8, name="block")(inputs), name="with_block")


ZOO = {"mlp": mlp, "cnn": cnn, "shared": shared, "nested": nested, "two_io": two_in_two_out, "block": with_block}


def _profile(model, **kwargs):
    kwargs.setdefault("measure_time", False)
    return profile_model(model, **kwargs)


def _total(graph, key):
    return sum(data[key] for _, data in graph.nodes(data=True))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_profile_model_params_equal_count_params(name):
    model = ZOO[name]()
    graph = _profile(model)
    validate_graph(graph)
    assert _total(graph, "param_bytes") == model.count_params() * 4


@pytest.mark.parametrize("name", sorted(ZOO))
def test_profile_model_nodes_in_topological_order(name):
    graph = _profile(ZOO[name]())
    assert list(graph.nodes) == topological_order(graph)
    assert nx.is_directed_acyclic_graph(graph)


def test_profile_model_dense_flops_match_analytic():
    inputs = keras.Input((64,))
    model = keras.Model(inputs, layers.Dense(32, name="dense_only")(inputs))
    graph = _profile(model, batch_size=32, num_microbatches=4)
    batch = 8
    forward = 2 * batch * 64 * 32 + batch * 32
    assert graph.nodes["dense_only"]["flops"] == pytest.approx(3 * forward, rel=0.05)


def test_profile_model_conv2d_flops_match_analytic():
    inputs = keras.Input((12, 12, 8))
    model = keras.Model(inputs, layers.Conv2D(16, 3, name="conv_only")(inputs))
    graph = _profile(model, batch_size=8, num_microbatches=2)
    batch, out_hw = 4, 10
    forward = 2 * batch * out_hw * out_hw * 16 * 3 * 3 * 8
    assert graph.nodes["conv_only"]["flops"] == pytest.approx(3 * forward, rel=0.05)


def test_profile_model_layer_without_weights_costs_twice_forward():
    inputs = keras.Input((10,))
    model = keras.Model(inputs, layers.ReLU(name="relu")(inputs))
    graph = _profile(model, batch_size=4, num_microbatches=1)
    assert graph.nodes["relu"]["flops"] == 2 * 4 * 10


def test_profile_model_mlp_bytes_by_hand():
    graph = _profile(mlp(), batch_size=32, num_microbatches=4)  # micro-batch of 8 samples
    assert list(graph.nodes) == ["x", "hidden", "logits"]
    assert graph.edges["x", "hidden"]["bytes"] == 8 * 16 * 4
    assert graph.edges["hidden", "logits"]["bytes"] == 8 * 32 * 4
    assert [graph.nodes[n]["activation_bytes"] for n in graph] == [0, 8 * 32 * 4, 8 * 8 * 4]
    assert [graph.nodes[n]["param_bytes"] for n in graph] == [0, (16 * 32 + 32) * 4, (32 * 8 + 8) * 4]
    digest = graph.nodes["x"].pop("config_digest")
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert graph.nodes["x"] == {
        "layer_type": "InputLayer",
        "flops": 0.0,
        "param_bytes": 0,
        "activation_bytes": 0,
        "model_input_bytes": 8 * 16 * 4,  # the batch's inputs per micro-batch, held by the runtime where x is
        "output_bytes": 0,  # a model input gets no gradient
    }
    # the gradients each layer's backward makes: its outputs'
    assert [graph.nodes[n]["output_bytes"] for n in ("hidden", "logits")] == [8 * 32 * 4, 8 * 8 * 4]
    assert graph.nodes["logits"]["model_output_bytes"] == 8 * 8 * 4  # collected per micro-batch for the loss
    assert "model_output_bytes" not in graph.nodes["hidden"] and "model_input_bytes" not in graph.nodes["hidden"]
    assert graph.nodes["hidden"]["layer_type"] == "Dense"
    assert graph.graph == {
        "model_name": "mlp",
        "batch_size": 32,
        "num_microbatches": 4,
        "micro_batch_size": 8,
        "compute_dtype": "float32",
    }


def test_profile_model_micro_batch_rounds_up():
    graph = _profile(mlp(), batch_size=10, num_microbatches=4)  # ceil(10 / 4) = 3
    assert graph.edges["x", "hidden"]["bytes"] == 3 * 16 * 4


def test_profile_model_shared_layer_gives_colocated_nodes():
    graph = _profile(shared())
    assert list(graph.nodes) == ["x", "shared", "shared:1"]
    assert graph.nodes["shared"]["colocation_group"] == graph.nodes["shared:1"]["colocation_group"] == "shared"
    assert graph.nodes["shared"]["param_bytes"] == (8 * 8 + 8) * 4
    assert graph.nodes["shared:1"]["param_bytes"] == 0
    assert graph.nodes["shared"]["flops"] == graph.nodes["shared:1"]["flops"] > 0
    assert "colocation_group" not in graph.nodes["x"]
    assert list(graph.edges) == [("x", "shared"), ("shared", "shared:1")]


def test_profile_model_layer_holding_another_gives_colocated_nodes():
    """zoo.TiedHead holds the embedding layer (a weight tied between two layers): one colocation group, named as
    the first of them, the shared table counted once (in the embedding's node)."""
    from zoo import tied_head

    model, _, _ = tied_head()
    graph = _profile(model)
    assert graph.nodes["embed"]["colocation_group"] == graph.nodes["tied"]["colocation_group"] == "embed"
    assert "colocation_group" not in graph.nodes["first"]
    assert graph.nodes["embed"]["param_bytes"] == 12 * 8 * 4
    assert graph.nodes["tied"]["param_bytes"] == 0
    assert _total(graph, "param_bytes") == model.count_params() * 4


def test_profile_model_nested_sequential_is_flattened():
    graph = _profile(nested())
    assert list(graph.nodes) == ["x", "pre", "inner_a", "inner_b", "post"]
    assert list(graph.edges) == [("x", "pre"), ("pre", "inner_a"), ("inner_a", "inner_b"), ("inner_b", "post")]


def test_profile_model_nested_name_collision_gets_prefix():
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, layers.Dense(4, name="proj")(inner_in), name="encoder")
    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, layers.Dense(2, name="proj")(inner(inputs)))
    graph = _profile(model)
    assert list(graph.nodes) == ["x", "encoder/proj", "proj"]


def test_profile_model_shared_nested_model_colocates_its_layers():
    block = keras.Sequential([keras.Input((4,)), layers.Dense(4, name="twice")], name="twice_block")
    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, block(block(inputs)))
    graph = _profile(model)
    assert list(graph.nodes) == ["x", "twice", "twice:1"]
    assert graph.nodes["twice:1"]["colocation_group"] == "twice"
    assert _total(graph, "param_bytes") == model.count_params() * 4


def test_profile_model_nested_model_called_on_two_inputs_gives_an_edge_per_call():
    """Siamese towers: the inner Dense's output is one Keras tensor for both calls; the Subtract reads
    two calls of it, so it has two edges (one tensor read twice would be one)."""
    tower = keras.Sequential([keras.Input((4,)), layers.Dense(3, name="embed")], name="tower")
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    model = keras.Model([a, b], layers.Subtract(name="diff")([tower(a), tower(b)]))
    graph = _profile(model, batch_size=4, num_microbatches=1)
    assert set(graph.edges) == {("a", "embed"), ("b", "embed:1"), ("embed", "diff"), ("embed:1", "diff")}
    assert graph.edges["embed:1", "diff"]["bytes"] == 4 * 3 * 4


def test_profile_model_two_inputs_two_outputs():
    graph = _profile(two_in_two_out(), batch_size=4, num_microbatches=2)
    assert set(graph.nodes) == {"a", "b", "da", "db", "join", "out1", "out2"}
    assert set(graph.edges) == {
        ("a", "da"),
        ("b", "db"),
        ("da", "join"),
        ("db", "join"),
        ("join", "out1"),
        ("join", "out2"),
    }
    assert graph.edges["b", "db"]["bytes"] == 2 * 6 * 4
    assert graph.edges["join", "out2"]["bytes"] == 2 * 10 * 4
    assert [n for n in graph if graph.in_degree(n) == 0] == ["a", "b"]
    # each input on its InputLayer node, each output on the node making it, per micro-batch of 2
    assert {n: d["model_input_bytes"] for n, d in graph.nodes(data=True) if "model_input_bytes" in d} == {
        "a": 2 * 4 * 4,
        "b": 2 * 6 * 4,
    }
    assert {n: d["model_output_bytes"] for n, d in graph.nodes(data=True) if "model_output_bytes" in d} == {
        "out1": 2 * 3 * 4,
        "out2": 2 * 1 * 4,
    }


def test_profile_model_output_read_twice_counts_once():
    inputs = keras.Input((4,), name="x")
    hidden = layers.Dense(5, name="hidden")(inputs)
    model = keras.Model(inputs, [hidden, hidden], name="twice")
    graph = _profile(model, batch_size=6, num_microbatches=3)
    assert graph.nodes["hidden"]["model_output_bytes"] == 2 * 5 * 4


def test_profile_model_keras_op_becomes_node():
    inputs = keras.Input((4,), name="x")
    h = layers.Dense(4, name="d")(inputs)
    model = keras.Model(inputs, keras.ops.add(h, inputs))
    graph = _profile(model, batch_size=2, num_microbatches=1)
    (op,) = [n for n in graph if n not in ("x", "d")]
    assert graph.nodes[op]["layer_type"] == "Add"
    assert graph.nodes[op]["flops"] == 2 * (2 * 4)
    assert set(graph.predecessors(op)) == {"x", "d"}


def test_profile_model_same_tensor_twice_counts_bytes_once():
    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, layers.Add(name="double")([inputs, inputs]))
    graph = _profile(model, batch_size=2, num_microbatches=1)
    assert graph.edges["x", "double"]["bytes"] == 2 * 4 * 4


def test_profile_model_composite_layer_is_one_node_with_traced_activations():
    graph = _profile(with_block(), batch_size=4, num_microbatches=1)
    assert list(graph.nodes) == ["x", "block"]
    node = graph.nodes["block"]
    assert node["layer_type"] == "Block"
    forward = 2 * 4 * 8 * 16 + 2 * 4 * 16 * 8
    assert node["flops"] == pytest.approx(3 * forward, rel=0.1)
    # What the gradient reads: up's relu output (the relu's and down's gradients), and the block's
    # output (the next layer's input); x is its producer's. Every op's outputs would be 4 * 48 * 4.
    assert node["activation_bytes"] == 4 * (16 + 8) * 4


class ViewBlock(layers.Layer):
    """A composite layer whose gradient reads a reshaped view of a tensor it also reads directly."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = layers.Dense(16, activation="relu")
        self.down = layers.Dense(4)

    def call(self, x):
        hidden = self.up(x)
        folded = keras.ops.reshape(hidden, (-1, 4, 4))
        return self.down(hidden) + keras.ops.sum(folded * folded, axis=-1)


def test_profile_model_composite_layer_counts_a_view_once():
    inputs = keras.Input((8,), name="x")
    model = keras.Model(inputs, ViewBlock(name="block")(inputs))
    node = _profile(model, batch_size=4, num_microbatches=1).nodes["block"]
    # The relu output (16 per sample), read by relu's, down's and the square's gradients, through its
    # reshape for the last; and the block's output (4).
    assert node["activation_bytes"] == 4 * (16 + 4) * 4


def residual_cnn():
    """Conv -> BN -> ReLU, a 1x1 skip, their Add read by a Keras op and a conv, then a Dense head."""
    inputs = keras.Input((6, 6, 3), name="image")
    h = layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    h = layers.BatchNormalization(name="bn")(h)
    h = layers.ReLU(name="relu")(h)
    added = layers.Add(name="add")([h, layers.Conv2D(4, 1, name="skip")(inputs)])
    h = layers.Add(name="join")([added * 2.0, layers.Conv2D(4, 1, name="mix")(added)])
    h = layers.Flatten(name="flat")(h)
    return keras.Model(inputs, layers.Dense(5, name="head")(h), name="residual_cnn")


def test_profile_model_charges_the_outputs_that_gradients_read():
    model = residual_cnn()
    before = [v.numpy().copy() for v in model.variables]
    calls_before = [len(layer._inbound_nodes) for layer in model.layers]
    graph = _profile(model, batch_size=4, num_microbatches=2)  # micro-batches of 2 samples
    (scale,) = [n for n in graph if graph.nodes[n]["layer_type"] == "Multiply"]
    feature_map = 2 * 6 * 6 * 4 * 4  # one 6x6x4 float32 map per sample
    expected = {
        "image": 0,  # the batch: not priced
        "conv": feature_map,  # bn's gradient reads its input
        # bn's output is read by no gradient (relu's reads its own output); bn keeps three per-channel
        # vectors of its own: the batch mean, 1 / sqrt(variance + epsilon) and gamma times that.
        "bn": 3 * 4 * 4,
        "relu": feature_map,  # relu's gradient reads its output
        "skip": 0,  # an Add's gradient reads neither input
        "add": feature_map,  # read by two consumers: by mix's gradient, not by the multiply's (it reads 2.0)
        scale: 0,
        "mix": 0,
        "join": 0,
        "flat": feature_map,  # head's gradient reads it (a view of join's output, charged once, here)
        "head": 2 * 5 * 4,  # a model output: the loss reads it
    }
    assert {n: graph.nodes[n]["activation_bytes"] for n in graph} == expected
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables, strict=True))
    assert [len(layer._inbound_nodes) for layer in model.layers] == calls_before


@pytest.mark.parametrize("trainable", [True, False])
def test_profile_model_frozen_consumer_keeps_its_input_at_a_function_boundary(trainable):
    """The kernel's gradient reads linear's output. A frozen consumer's gradient is its input's alone, but
    TensorFlow builds a matmul's gradient for both factors when it splits a function into forward and
    backward (the runtime's stages are functions), and its forward keeps what either reads: linear's
    output stays for the frozen kernel's gradient too (read from a stage function's split on TensorFlow
    2.21: a frozen Dense after a linear one keeps the linear output)."""
    inputs = keras.Input((4,), name="x")
    h = layers.Dense(6, name="linear")(inputs)  # a Dense's gradient does not read its own output
    consumer = layers.Dense(3, name="consumer")
    consumer.trainable = trainable
    graph = _profile(keras.Model(inputs, consumer(h)), batch_size=2, num_microbatches=1)
    assert graph.nodes["linear"]["activation_bytes"] == 2 * 6 * 4


def test_profile_model_unanalysed_consumer_keeps_its_inputs():
    inputs = keras.Input((4,), name="x")
    h = layers.Dense(4, name="linear")(inputs)  # a Dense's gradient does not read its own output
    model = keras.Model(inputs, layers.Dense(3, name="out")(NoGradient(name="opaque")(h)))
    graph = _profile(model, batch_size=2, num_microbatches=1)
    assert graph.nodes["linear"]["activation_bytes"] == 2 * 4 * 4  # kept: opaque may read it
    assert graph.nodes["opaque"]["activation_bytes"] == 2 * 4 * 4  # its outputs, the upper bound


def test_profile_model_recurrent_composite_layer_keeps_the_upper_bound():
    inputs = keras.Input((5, 3), name="x")
    model = keras.Model(inputs, layers.LSTM(4, name="lstm")(inputs))
    node = _profile(model, batch_size=2, num_microbatches=1).nodes["lstm"]
    # A loop keeps its steps in TensorLists that cannot be sized: every op's outputs, times the trip count.
    assert node["activation_bytes"] > 5 * 2 * 4 * 4 * 4  # more than the four gates of every step


def test_profile_model_mixed_precision_bytes():
    inputs = keras.Input((16,), name="x")
    model = keras.Model(inputs, layers.Dense(8, dtype="mixed_float16", name="half")(inputs))
    graph = _profile(model, batch_size=4, num_microbatches=1)
    # The float16 output (the loss reads it), and the float16 casts of the input and of the kernel that
    # the matmul's gradients read (the float32 input itself is read by no gradient).
    assert graph.nodes["half"]["activation_bytes"] == 4 * 8 * 2 + 4 * 16 * 2 + 16 * 8 * 2
    assert graph.nodes["half"]["param_bytes"] == (16 * 8 + 8) * 4  # float32 variables


def test_profile_model_frozen_layer_has_no_trainable_bytes_and_costs_twice_forward():
    model = mlp()
    model.get_layer("hidden").trainable = False
    graph = _profile(model, batch_size=4, num_microbatches=1)
    frozen, trained = graph.nodes["hidden"], graph.nodes["logits"]
    assert frozen["param_bytes"] == (16 * 32 + 32) * 4
    assert frozen["trainable_param_bytes"] == 0
    assert frozen["flops"] == 2 * frozen["forward_flops"]  # gradients for the inputs only
    assert trained["trainable_param_bytes"] == trained["param_bytes"] == (32 * 8 + 8) * 4
    assert trained["flops"] == 3 * trained["forward_flops"]
    # The cost model splits forward and backward by the profiler's own figures.
    assert forward_share(frozen) == pytest.approx(1 / 2)
    assert forward_share(trained) == pytest.approx(1 / 3)


def test_profile_model_frozen_layer_is_charged_its_weights_only():
    model = mlp()
    model.get_layer("hidden").trainable = False
    costs = CostModel(_profile(model, batch_size=4, num_microbatches=1), Cluster.uniform(1, memory="1GiB"))
    assert costs.weight_bytes("hidden") == (16 * 32 + 32) * 4  # no gradients, no Adam slots
    assert costs.weight_bytes("logits") == (32 * 8 + 8) * 4 * (1 + 1 + 2)  # weights, gradients, two Adam slots


def test_profile_model_batch_norm_statistics_are_not_trainable():
    graph = _profile(cnn(), batch_size=4, num_microbatches=1)
    bn = graph.nodes["bn"]
    assert bn["param_bytes"] == 4 * 16 * 4  # gamma, beta, moving mean and variance
    assert bn["trainable_param_bytes"] == 2 * 16 * 4  # gamma and beta


def test_profile_model_shared_layer_second_call_keeps_the_split():
    graph = _profile(shared(), batch_size=4, num_microbatches=1)
    second = graph.nodes["shared:1"]
    assert second["param_bytes"] == second["trainable_param_bytes"] == 0  # counted on the first call
    assert forward_share(second) == pytest.approx(1 / 3)  # its backward still computes weight gradients


@pytest.mark.parametrize(
    ("policy", "dtype", "itemsize"), [("mixed_bfloat16", "bfloat16", 2), ("float32", "float32", 4)]
)
def test_profile_model_records_compute_dtype(policy, dtype, itemsize):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = mlp()
    finally:
        keras.mixed_precision.set_global_policy(previous)
    graph = _profile(model, batch_size=4, num_microbatches=1)
    assert graph.graph["compute_dtype"] == dtype
    # The relu output in the compute dtype; under mixed precision also the casts of the input and the
    # kernel to it, which the matmul's gradients read.
    casts = (4 * 16 + 16 * 32) * itemsize if itemsize == 2 else 0
    assert graph.nodes["hidden"]["activation_bytes"] == 4 * 32 * itemsize + casts
    assert graph.nodes["hidden"]["param_bytes"] == (16 * 32 + 32) * 4  # variables stay float32
    assert graph.nodes["hidden"]["trainable_param_bytes"] == (16 * 32 + 32) * 4


def test_profile_model_compute_dtype_follows_most_flops():
    inputs = keras.Input((16,), name="x")
    h = layers.Dense(256, dtype="mixed_float16", name="big")(inputs)
    outputs = layers.Dense(2, dtype="float32", name="small")(h)
    graph = _profile(keras.Model(inputs, outputs), batch_size=4, num_microbatches=1)
    assert graph.graph["compute_dtype"] == "float16"


def test_profile_model_progress_reports_every_node():
    seen = []
    graph = _profile(mlp(), progress=lambda done, total, name: seen.append((done, total, name)))
    assert seen == [(1, 3, "x"), (2, 3, "hidden"), (3, 3, "logits")]
    assert len(graph) == 3


def test_profile_model_measure_time_records_times_and_device():
    graph = profile_model(cnn(), batch_size=4, num_microbatches=2, repeats=2, warmup=1)
    for name, data in graph.nodes(data=True):
        if data["layer_type"] == "InputLayer":
            assert data["time_s"] == 0.0
        else:  # the dispatch from Python is left out: a tiny layer may be too short to tell from it
            assert data["time_s"] >= 0, name
        assert "fixed_time_s" not in data  # only with measure_fixed_time
    assert graph.graph["profiled_flops_per_s"] > 0
    assert "CPU" in graph.graph["profiled_device"] or "GPU" in graph.graph["profiled_device"]


def test_profile_model_measure_fixed_time_records_the_part_one_sample_costs():
    """With measure_fixed_time each timed call gets fixed_time_s in [0, time_s]; a large matmul's time is
    mostly per sample, so rescaling its node to one sample leaves far less than the time at 64."""
    inputs = keras.Input((512,), name="x")
    model = keras.Model(inputs, layers.Dense(512, name="wide")(inputs))
    graph = profile_model(model, batch_size=64, num_microbatches=1, repeats=5, warmup=1, measure_fixed_time=True)
    wide = graph.nodes["wide"]
    assert 0 <= wide["fixed_time_s"] <= wide["time_s"] and wide["time_s"] > 0
    validate_graph(graph)
    one = rescale_graph(graph, batch_size=64, num_microbatches=64).nodes["wide"]
    assert wide["fixed_time_s"] <= one["time_s"] < wide["time_s"]


def test_profile_model_time_samples_records_the_time_at_each_size_and_the_gradient_sums():
    """time_samples times each call again at those sizes (not the profile's own, once each), which
    rescale_graph then prices as measured; measure_fixed_time also times summing the weight gradients
    (accumulate_time_s) on calls with weights only, and reuses the one-sample time for fixed_time_s. The layer's
    4 MiB of weights make its add (about 0.5 ms) stand out of an empty call's time: with 256 KiB the median of
    three adds less the empty call's came out 0.0 once under load (stop 35's CI run)."""
    inputs = keras.Input((1024,), name="x")
    hidden = layers.Dense(1024, name="wide")(inputs)
    model = keras.Model(inputs, layers.Activation("relu", name="act")(hidden))
    graph = profile_model(
        model,
        batch_size=64,
        num_microbatches=1,
        repeats=3,
        warmup=1,
        measure_fixed_time=True,
        time_samples=[16, 1, 64, 16],
    )
    wide, act = graph.nodes["wide"], graph.nodes["act"]
    assert [n for n, _ in wide["time_by_samples"]] == [1, 16] and all(t >= 0 for _, t in wide["time_by_samples"])
    assert [n for n, _ in act["time_by_samples"]] == [1, 16]
    assert wide["accumulate_time_s"] > 0 and "accumulate_time_s" not in act
    validate_graph(graph)
    measured = dict(wide["time_by_samples"])
    sixteen = rescale_graph(graph, batch_size=64, num_microbatches=4).nodes["wide"]["time_s"]
    assert sixteen == pytest.approx(max(measured[16], wide["fixed_time_s"]))
    untimed = profile_model(model, batch_size=64, num_microbatches=1, measure_time=False, time_samples=[16])
    assert "time_by_samples" not in untimed.nodes["wide"]
    # a layer called twice sums its weights' gradients once a micro-batch: charged on its first call
    twice = profile_model(shared(), batch_size=4, num_microbatches=1, repeats=1, warmup=0, measure_fixed_time=True)
    charged = [d.get("accumulate_time_s") for _, d in twice.nodes(data=True) if d["layer_type"] == "Dense"]
    assert len(charged) == 2 and charged[0] is not None and charged[1] is None


@pytest.mark.parametrize("sizes", [[0], [2.5], [True]])
def test_profile_model_rejects_bad_time_samples(sizes):
    with pytest.raises(InputError, match=r"time_samples must be micro-batch sizes \(integers >= 1\). Received: "):
        profile_model(mlp(), batch_size=4, num_microbatches=1, time_samples=sizes)


def test_profile_model_measure_fixed_time_records_the_steps_own_work():
    """With measure_fixed_time the graph records step_overhead_s: a Keras training step of a copy of the
    model on one sample less its layers' own work there, more than nothing (the step's dispatch from
    Python alone is hundreds of microseconds); the model is not compiled, trained or called."""
    model = cnn()
    before = [v.numpy().copy() for v in model.variables]
    calls_before = [len(layer._inbound_nodes) for layer in model.layers]
    graph = profile_model(model, batch_size=4, num_microbatches=2, repeats=3, warmup=1, measure_fixed_time=True)
    assert 0 < graph.graph["step_overhead_s"] < 1.0
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables, strict=True))
    assert [len(layer._inbound_nodes) for layer in model.layers] == calls_before
    assert getattr(model, "optimizer", None) is None and not model.compiled


def test_profile_model_warns_when_the_steps_copy_cannot_train(monkeypatch):
    from profiles import timing

    def cannot(*args, **kwargs):
        raise RuntimeError("no copy")

    monkeypatch.setattr(timing, "step_overhead_seconds", cannot)
    with pytest.warns(
        UserWarning, match=r"Could not time a training step of a copy of 'mlp' \(RuntimeError: no copy\); "
    ):
        graph = profile_model(mlp(), batch_size=4, num_microbatches=2, repeats=1, warmup=0, measure_fixed_time=True)
    assert "step_overhead_s" not in graph.graph
    assert all("fixed_time_s" in d for _, d in graph.nodes(data=True) if d["layer_type"] != "InputLayer")


def _whole_model(fn) -> bool:
    return "training_call" in getattr(fn, "__qualname__", "")  # the whole model, as _scale_to_model calls it


def test_profile_model_scales_the_calls_times_to_the_whole_model(monkeypatch):
    """At each size the calls were timed at, their times are scaled to add up to the whole model's forward +
    backward timed there (stubbed: each call 1 ms + 0.1 ms a sample, the model 60% of the calls' sum at one
    sample, 80% at 2, 50% at 4); fixed_time_s comes from the scaled times; the record survives a save."""
    from profiles import timing

    def stub(fn, specs, variables=(), **kwargs):
        samples = specs[0].shape[0]
        one_call = 1e-3 + 1e-4 * samples
        if _whole_model(fn):
            return {1: 0.6, 2: 0.8, 4: 0.5}[samples] * 2 * one_call  # mlp(): two timed calls
        return one_call

    whole_calls = []

    def by_size(fn, specs_by_size, variables=(), **kwargs):
        whole_calls.append([specs[0].shape[0] for specs in specs_by_size])
        return [stub(fn, specs, variables) for specs in specs_by_size]

    monkeypatch.setattr(timing, "forward_backward_seconds", stub)
    monkeypatch.setattr(timing, "forward_backward_seconds_by_size", by_size)
    graph = profile_model(
        mlp(), batch_size=8, num_microbatches=2, repeats=1, warmup=0, measure_fixed_time=True, time_samples=[2]
    )
    assert sorted(*whole_calls) == [1, 2, 4]  # the whole model's sizes timed in one call, taking turns
    records = {n: (model, layers) for n, model, layers in graph.graph["model_time_by_samples"]}
    assert sorted(records) == [1, 2, 4]
    for n, factor in ((1, 0.6), (2, 0.8), (4, 0.5)):
        assert records[n][1] == pytest.approx(2 * (1e-3 + 1e-4 * n))
        assert records[n][0] == pytest.approx(factor * records[n][1])
    hidden = graph.nodes["hidden"]
    assert hidden["time_s"] == pytest.approx(0.5 * 1.4e-3)
    assert hidden["time_by_samples"] == [[2, pytest.approx(0.8 * 1.2e-3)]]
    one, four = 0.6 * 1.1e-3, 0.5 * 1.4e-3  # the line through them at zero samples: within [0, time_s]
    assert hidden["fixed_time_s"] == pytest.approx(min(max(one - (four - one) / 3, 0.0), four))
    assert sum(d["time_s"] for _, d in graph.nodes(data=True)) == pytest.approx(records[4][0])
    saved = graph_from_dict(graph_to_dict(graph))
    assert saved.graph["model_time_by_samples"] == graph.graph["model_time_by_samples"]


def test_profile_model_whole_model_time_matches_the_scaled_calls():
    """Timed for real: at the profile's size the calls' times add up to the model's recorded seconds, and the
    model's weights come back as they were (its batch normalization ran)."""
    model = cnn()
    before = [v.numpy().copy() for v in model.variables]
    graph = profile_model(model, batch_size=8, num_microbatches=2, repeats=2, warmup=1)
    ((samples, seconds, layers_s),) = graph.graph["model_time_by_samples"]
    assert samples == 4 and seconds > 0 and layers_s > 0
    assert sum(d["time_s"] for _, d in graph.nodes(data=True)) == pytest.approx(seconds)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables, strict=True))


def test_profile_model_warns_and_keeps_the_calls_times_where_the_model_cannot_be_timed_whole(monkeypatch):
    from profiles import timing

    timed = timing.forward_backward_seconds_by_size

    def whole_fails(fn, *args, **kwargs):
        if _whole_model(fn):
            raise MemoryError("out of memory")
        return timed(fn, *args, **kwargs)

    monkeypatch.setattr(timing, "forward_backward_seconds_by_size", whole_fails)
    with pytest.warns(
        UserWarning,
        match=r"Could not time the forward and backward of 'mlp' as a whole on .*CPU:0 \(MemoryError: out of memory\); "
        "its layers' times are kept as timed one call at a time",
    ):
        graph = profile_model(mlp(), batch_size=4, num_microbatches=2, repeats=1, warmup=0)
    assert "model_time_by_samples" not in graph.graph
    assert all(d["time_s"] >= 0 for _, d in graph.nodes(data=True))


def test_profile_model_measure_time_on_named_device(virtual_devices):
    graph = profile_model(mlp(), batch_size=4, num_microbatches=2, device=virtual_devices[1], repeats=1, warmup=0)
    assert graph.graph["profiled_device"] == virtual_devices[1]


def test_profile_model_leaves_the_model_intact():
    model = cnn()
    x = np.random.default_rng(0).normal(size=(2, 12, 12, 8)).astype("float32")
    before = [v.numpy().copy() for v in model.variables]
    calls_before = [len(layer._inbound_nodes) for layer in model.layers]
    expected = model(x, training=False)
    profile_model(model, batch_size=4, num_microbatches=2, repeats=1, warmup=1)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables, strict=True))
    assert [len(layer._inbound_nodes) for layer in model.layers] == calls_before
    np.testing.assert_array_equal(model(x, training=False), expected)


def test_save_profile_load_profile_round_trip(tmp_path):
    graph = profile_model(shared(), batch_size=8, num_microbatches=2, repeats=1, warmup=0)
    path = tmp_path / "shared.json"
    save_profile(graph, path)
    loaded = load_profile(path)
    assert list(loaded.nodes(data=True)) == list(graph.nodes(data=True))
    assert list(loaded.edges(data=True)) == list(graph.edges(data=True))
    assert loaded.graph == graph.graph


def test_profile_model_rejects_subclassed_model():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(ProfileError, match=r"no functional graph.*functional API.*keras\.Sequential"):
        profile_model(model)


def test_profile_model_rejects_unbuilt_sequential():
    with pytest.raises(ProfileError, match=r"not built.*model\.build\(input_shape\).*keras\.Input"):
        profile_model(keras.Sequential([layers.Dense(2)]))


@pytest.mark.parametrize("value", [layers.Dense(2), "model.keras", None])
def test_profile_model_rejects_non_models(value):
    with pytest.raises(ProfileError, match=r"needs a keras\.Model\. Received: .*Wrap layers"):
        profile_model(value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, r"batch_size must be an integer >= 1\. Received: batch_size=0"),
        ({"num_microbatches": 0}, r"num_microbatches must be an integer >= 1\. Received: num_microbatches=0"),
        ({"batch_size": 4, "num_microbatches": 8}, r"must not exceed batch_size.*Lower num_microbatches"),
        ({"batch_size": 2.5}, r"batch_size must be an integer"),
        ({"repeats": 0}, r"repeats must be an integer >= 1"),
        ({"warmup": -1}, r"warmup must be an integer >= 0"),
    ],
)
def test_profile_model_rejects_bad_numbers(kwargs, message):
    with pytest.raises(InputError, match=message):
        profile_model(mlp(), **kwargs)


def test_profile_model_rejects_unknown_dimensions():
    inputs = keras.Input((None, 4), name="tokens")
    model = keras.Model(inputs, layers.Dense(2)(inputs))
    message = r"unknown dimensions beyond the batch axis.*sequence_length=128.*input_shapes=\{'tokens': \(128, 4\)\}"
    with pytest.raises(ProfileError, match=message):
        profile_model(model, measure_time=False)


def test_profile_model_rejects_unknown_device():
    with pytest.raises(InputError, match=r"Unknown device '/TPU:7'\. TensorFlow sees"):
        profile_model(mlp(), device="/TPU:7")


@pytest.mark.slow
def test_profile_model_mobilenet_v2():
    model = keras.applications.MobileNetV2(input_shape=(64, 64, 3), weights=None, classes=10)
    graph = profile_model(model, batch_size=8, num_microbatches=4, measure_time=False)
    validate_graph(graph)
    assert _total(graph, "param_bytes") == model.count_params() * 4
    assert len(graph) == len(model.layers)
    assert list(graph.nodes) == topological_order(graph)
    assert _total(graph, "flops") > 0


class NoGradient(layers.Layer):
    """A layer whose backward pass fails, so it cannot be timed forward + backward, and what its
    gradient reads cannot be known."""

    def call(self, x):
        import tensorflow as tf

        @tf.custom_gradient
        def forward(y):
            def backward(upstream):
                raise ValueError("this layer has no gradient")

            return tf.identity(y), backward

        return forward(x)


def test_profile_model_reports_layers_that_cannot_be_timed():
    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, NoGradient(name="broken")(inputs))
    assert profile_model(model, batch_size=2, num_microbatches=1, measure_time=False).nodes["broken"]["flops"] == 0
    with pytest.raises(ProfileError, match=r"Timing 'broken' \(NoGradient\).*no gradient.*measure_time=False"):
        profile_model(model, batch_size=2, num_microbatches=1, repeats=1, warmup=0)


def test_profile_model_reports_layers_that_cannot_be_traced_at_micro_batch_size():
    inputs = keras.Input((4,), batch_size=8, name="x")
    fixed = layers.Lambda(lambda t: keras.ops.reshape(t, (8, 4)), output_shape=(4,), name="fixed_batch")
    model = keras.Model(inputs, fixed(inputs))
    with pytest.raises(ProfileError, match=r"Tracing 'fixed_batch' \(Lambda\).*failed: .*micro-batch size"):
        profile_model(model, batch_size=8, num_microbatches=4, measure_time=False)


def test_forward_backward_seconds_by_size_times_the_sizes_taking_turns(monkeypatch):
    """Every size's pass and its empty call take turns run by run (a drift of the machine's speed moves all
    sizes alike); each size's median less its empty call's median comes back, in the sizes' order."""
    import tensorflow as tf

    from profiles import timing

    order = []

    def fake(run, devices):
        rows, empty = int(run.args[0].shape[0]), b"empty" in run.func.name
        order.append((rows, "empty" if empty else "pass"))
        return 1.0 if empty else {8: 3.0, 16: 5.0}[rows]

    monkeypatch.setattr(timing, "synced_seconds", fake)
    specs = [[tf.TensorSpec([8, 4])], [tf.TensorSpec([16, 4])]]
    seconds = timing.forward_backward_seconds_by_size(tf.nn.relu, specs, device="/CPU:0", repeats=2, warmup=0)
    assert seconds == [2.0, 4.0]
    assert order == [(8, "pass"), (8, "empty"), (16, "pass"), (16, "empty")] * 2


def test_forward_backward_seconds_leaves_out_the_call_from_python():
    """An identity's pass is next to nothing once the dispatch of its function is left out; counted with
    the dispatch (exclude_call=False) it is the dispatch itself."""
    import tensorflow as tf

    from profiles.timing import forward_backward_seconds

    spec = [tf.TensorSpec([8, 16])]
    with_call = forward_backward_seconds(tf.identity, spec, device="/CPU:0", repeats=21, exclude_call=False)
    without = forward_backward_seconds(tf.identity, spec, device="/CPU:0", repeats=21)
    assert 0 <= without < with_call


def _kept_by_tensorflow(layer, shape) -> tuple[int, bool]:
    """What TensorFlow's split of a function calling ``layer`` into forward and backward hands the backward
    (a private API, read on TensorFlow 2.21): the bytes of the layer's own tensors (not its input, not its
    weights), and whether its input is among them."""
    tf = pytest.importorskip("tensorflow")
    function = tf.function(lambda x: layer(x, training=True))
    concrete = function.get_concrete_function(tf.TensorSpec(shape, "float32"))
    own, input_kept = {}, False
    for tensor in kept_for_backward(concrete):
        while tensor.op.type in ("Identity", "Reshape") and tensor.op.inputs:  # views
            tensor = tensor.op.inputs[0]
        if tensor.op.type == "Placeholder":
            input_kept = True
        elif tensor.op.type not in ("ReadVariableOp", "Const"):  # weights and constants hold no activation
            own[tensor.name] = tensor.shape.num_elements() * tensor.dtype.size
    return sum(own.values()), input_kept


@pytest.mark.parametrize(
    ("name", "make", "shape"),
    [
        ("gelu", lambda: layers.Dense(16, activation="gelu"), (8, 4, 8)),  # five tensors, three read by the gradients
        ("relu", lambda: layers.Dense(16, activation="relu"), (8, 4, 8)),
        ("norm", lambda: layers.LayerNormalization(), (8, 4, 8)),
        ("dropout", lambda: layers.Dropout(0.5), (8, 4, 8)),  # the input too, for the mask's (unused) gradient
        ("softmax", lambda: layers.Softmax(), (8, 4, 8)),
        ("conv", lambda: layers.Conv2D(4, 3, padding="same", activation="relu"), (8, 6, 6, 3)),
    ],
)
def test_activation_bytes_are_what_a_functions_forward_keeps(name, make, shape):
    """A node's activation bytes (its own tensors and outputs) and its input's charge are what TensorFlow's
    forward keeps for the backward when the layer runs in a function, as the runtime's stages do."""
    layer = make()
    inputs = keras.Input(shape[1:], name="x")
    source = layers.Identity(name="source")(inputs)  # a node for the input, charged if the layer reads it
    model = keras.Model(inputs, layers.Identity(name="sink")(layer(source)))
    graph = _profile(model, batch_size=shape[0], num_microbatches=1)
    own, input_kept = _kept_by_tensorflow(layer, shape)
    assert graph.nodes[layer.name]["activation_bytes"] == own
    assert (graph.nodes["source"]["activation_bytes"] > 0) == input_kept


def test_accumulate_seconds_evicts_the_caches_before_each_timed_add():
    """Given evict_caches' function, the sums are timed cold, as a step of a model that outgrows the caches
    meets them: the caches are emptied before every timed add (not before the warm-up runs nor the empty
    call's); without it, never."""
    import tensorflow as tf

    from profiles import timing

    evictions = []
    evict = timing.evict_caches("/CPU:0")

    def counting():
        evictions.append(1)
        evict()

    weight = tf.Variable(tf.zeros([256, 256]))
    timing.accumulate_seconds([weight], device="/CPU:0", repeats=3, warmup=2, evict=counting)
    assert len(evictions) == 3
    timing.accumulate_seconds([weight], device="/CPU:0", repeats=3, warmup=2)
    assert len(evictions) == 3
    assert timing.accumulate_seconds([], device="/CPU:0", evict=counting) == 0.0 and len(evictions) == 3


def test_warm_up_runs_the_given_count_then_on_until_the_first_run_took_its_time(monkeypatch):
    """At least ``warmup`` rounds, then on until the first function's runs took WARM_SECONDS, at most
    MAX_WARM_RUNS rounds; each round runs every function once, in turn; warmup=0 runs nothing. The garbage
    collector is paused in every timed run and back on after it."""
    import gc
    import time

    from profiles import timing

    calls: list[str] = []
    collecting: list[bool] = []

    def first() -> None:
        calls.append("first")
        collecting.append(gc.isenabled())

    monkeypatch.setattr(timing, "WARM_SECONDS", 1e9)  # never reached: the cap ends it
    timing.warm_up([first, lambda: calls.append("second")], "/CPU:0", 3)
    assert calls == ["first", "second"] * timing.MAX_WARM_RUNS
    assert not any(collecting) and gc.isenabled()
    calls.clear()
    monkeypatch.setattr(timing, "WARM_SECONDS", 0.0)  # reached at once: the given count alone
    timing.warm_up([first, lambda: calls.append("second")], "/CPU:0", 3)
    assert calls == ["first", "second"] * 3
    calls.clear()
    timing.warm_up([first], "/CPU:0", 0)
    assert calls == []
    monkeypatch.setattr(timing, "WARM_SECONDS", 0.05)
    slow = []
    timing.warm_up([lambda: (slow.append(1), time.sleep(0.02))], "/CPU:0", 1)
    assert 2 <= len(slow) <= 3  # 0.02 s or more each: on until 0.05 s (two runs where the machine slows a sleep)
    # counted by the first function's own seconds (a clock that says 0.02 s a run): three runs reach 0.05 s
    monkeypatch.setattr(timing, "synced_seconds", lambda run, devices: (run(), 0.02)[1])
    counted: list[int] = []
    timing.warm_up([lambda: counted.append(1), lambda: counted.append(2)], "/CPU:0", 1)
    assert counted == [1, 2] * 3
    counted.clear()
    timing.warm_up([lambda: counted.append(1)], "/CPU:0", timing.MAX_WARM_RUNS + 5)  # the given count, past the cap
    assert len(counted) == timing.MAX_WARM_RUNS + 5


def test_cache_bytes_is_the_largest_cache_the_host_reports(monkeypatch, tmp_path):
    from profiles import timing

    sizes = {"index0": "48K", "index2": "2048K", "index3": "32768K\n", "index4": "junk", "index5": "1M"}
    for name, text in sizes.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(timing.glob, "glob", lambda pattern: sorted(str(p) for p in tmp_path.iterdir()))
    assert timing.cache_bytes() == 32 * 2**20
    monkeypatch.setattr(timing.glob, "glob", lambda pattern: [])
    assert timing.cache_bytes() == 32 * 2**20  # none reported: the default
    (tmp_path / "index3").write_text("256M")
    monkeypatch.setattr(timing.glob, "glob", lambda pattern: [str(tmp_path / "index3")])
    assert timing.cache_bytes() == 256 * 2**20


def test_gradient_sums_are_timed_cold_only_where_the_model_outgrows_the_caches(monkeypatch):
    """A model whose weights, gradients and sums fit the host's largest cache meets its sums warm in a step:
    they are timed warm; where they do not fit, cold."""
    from profiles import timing

    seen = []
    real = timing.accumulate_seconds

    def recording(variables, **kwargs):
        seen.append(kwargs["evict"] is not None)
        return real(variables, **kwargs)

    monkeypatch.setattr(timing, "accumulate_seconds", recording)
    inputs = keras.Input((64,), name="x")
    model = keras.Model(inputs, layers.Dense(64, name="small")(inputs))  # 3 x 16.6 KB
    kwargs = dict(batch_size=8, num_microbatches=1, repeats=1, warmup=0, measure_fixed_time=True)
    monkeypatch.setattr(timing, "cache_bytes", lambda: 2**20)
    assert "accumulate_time_s" in profile_model(model, **kwargs).nodes["small"]
    monkeypatch.setattr(timing, "cache_bytes", lambda: 3 * (64 * 64 + 64) * 4 - 1)
    profile_model(model, **kwargs)
    assert seen == [False, True]
