"""The layer-graph contract: validation, JSON round trips, chains and topological order."""

from __future__ import annotations

import json
import random

import networkx as nx
import pytest
from graphs import add_layer, chain, diamond, random_dag, shared_layer_graph

from partitioner.errors import GraphError, InputError
from partitioner.graph import (
    GRAPH_SCHEMA_VERSION,
    chain_graph,
    colocation_groups,
    graph_from_dict,
    graph_to_dict,
    is_chain,
    load_graph,
    rescale_graph,
    save_graph,
    topological_order,
    validate_graph,
)


def _assert_same_graph(a: nx.DiGraph, b: nx.DiGraph) -> None:
    assert list(a.nodes(data=True)) == list(b.nodes(data=True))
    assert sorted(a.edges(data=True)) == sorted(b.edges(data=True))
    assert a.graph == b.graph


# ----- validate_graph ----------------------------------------------------------------------------


@pytest.mark.parametrize("graph", [chain([1e9, 2e9]), diamond(), shared_layer_graph()])
def test_validate_graph_accepts_the_shared_graphs(graph):
    validate_graph(graph)


def test_validate_graph_accepts_a_random_dag():
    validate_graph(random_dag(random.Random(0), 20, num_shared=2))


@pytest.mark.parametrize("key", ["flops", "param_bytes", "activation_bytes"])
def test_validate_graph_missing_attribute(key):
    graph = chain([1e9, 1e9])
    del graph.nodes["l1"][key]
    with pytest.raises(GraphError, match=rf"Node 'l1' has no numeric '{key}' attribute"):
        validate_graph(graph)


def test_validate_graph_non_numeric_attribute():
    graph = chain([1e9])
    graph.nodes["l0"]["flops"] = "many"
    with pytest.raises(GraphError, match=r"Node 'l0' has no numeric 'flops' attribute \(got 'many'\)"):
        validate_graph(graph)


def test_validate_graph_bool_is_not_a_number():
    graph = chain([1e9])
    graph.nodes["l0"]["param_bytes"] = True
    with pytest.raises(GraphError, match=r"no numeric 'param_bytes'"):
        validate_graph(graph)


@pytest.mark.parametrize(("key", "value"), [("flops", -1.0), ("param_bytes", -4), ("activation_bytes", float("nan"))])
def test_validate_graph_negative_or_nan_attribute(key, value):
    graph = chain([1e9, 1e9])
    graph.nodes["l0"][key] = value
    with pytest.raises(GraphError, match=rf"Node 'l0' has {key}=.*expected a finite value >= 0"):
        validate_graph(graph)


def test_validate_graph_negative_time():
    graph = chain([1e9])
    graph.nodes["l0"]["time_s"] = -0.5
    with pytest.raises(GraphError, match=r"Node 'l0' has time_s=-0.5; expected seconds >= 0"):
        validate_graph(graph)


def test_validate_graph_edge_without_bytes():
    graph = chain([1e9, 1e9])
    del graph.edges["l0", "l1"]["bytes"]
    with pytest.raises(GraphError, match=r"Edge 'l0' -> 'l1' needs a 'bytes' attribute >= 0. Received: None"):
        validate_graph(graph)


def test_validate_graph_negative_edge_bytes():
    graph = chain([1e9, 1e9], edge_bytes=[-8])
    with pytest.raises(GraphError, match=r"Edge 'l0' -> 'l1' needs a 'bytes' attribute >= 0. Received: -8"):
        validate_graph(graph)


def test_validate_graph_cycle():
    graph = chain([1e9, 1e9, 1e9])
    graph.add_edge("l2", "l0", bytes=0)
    with pytest.raises(GraphError, match=r"has a cycle through .*needs a DAG"):
        validate_graph(graph)


def test_validate_graph_self_loop_is_a_cycle():
    graph = chain([1e9])
    graph.add_edge("l0", "l0", bytes=0)
    with pytest.raises(GraphError, match=r"cycle"):
        validate_graph(graph)


@pytest.mark.parametrize(("graph", "received"), [(nx.Graph(), "Graph"), ({"a": 1}, "dict"), (None, "NoneType")])
def test_validate_graph_not_a_digraph(graph, received):
    with pytest.raises(GraphError, match=rf"Expected a networkx.DiGraph layer graph. Received: {received}"):
        validate_graph(graph)


def test_validate_graph_empty():
    with pytest.raises(GraphError, match=r"has no nodes"):
        validate_graph(nx.DiGraph())


def test_validate_graph_node_name_not_a_string():
    graph = nx.DiGraph()
    graph.add_node(3, flops=1.0, param_bytes=0, activation_bytes=0)
    with pytest.raises(GraphError, match=r"Node names must be strings. Received: 3"):
        validate_graph(graph)


# ----- JSON --------------------------------------------------------------------------------------


def _annotated_graph() -> nx.DiGraph:
    graph = shared_layer_graph()
    graph.nodes["mid_0"]["time_s"] = 0.0125
    graph.graph.update(model_name="toy", batch_size=32, num_microbatches=4, profiled_flops_per_s=1.5e12)
    return graph


@pytest.mark.parametrize(
    "graph", [_annotated_graph(), diamond(), chain([1e9]), random_dag(random.Random(3), 30, num_shared=3)]
)
def test_graph_to_dict_round_trip(graph):
    data = json.loads(json.dumps(graph_to_dict(graph)))
    assert data["schema_version"] == GRAPH_SCHEMA_VERSION
    _assert_same_graph(graph_from_dict(data), graph)


def test_save_graph_load_graph_round_trip(tmp_path):
    graph = _annotated_graph()
    path = tmp_path / "profile.json"
    save_graph(graph, path)
    loaded = load_graph(path)
    _assert_same_graph(loaded, graph)
    assert loaded.graph["model_name"] == "toy"
    assert loaded.nodes["mid_0"]["time_s"] == 0.0125
    assert colocation_groups(loaded) == {"dense": ["dense_call0", "dense_call1"]}


def test_save_graph_refuses_an_invalid_graph(tmp_path):
    graph = chain([1e9])
    graph.nodes["l0"]["flops"] = -1.0
    with pytest.raises(GraphError, match=r"flops=-1.0"):
        save_graph(graph, tmp_path / "g.json")
    assert not (tmp_path / "g.json").exists()


def test_load_graph_future_schema_version(tmp_path):
    data = graph_to_dict(diamond())
    data["schema_version"] = GRAPH_SCHEMA_VERSION + 1
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GraphError, match=rf"schema_version {GRAPH_SCHEMA_VERSION + 1}, newer than .*Upgrade"):
        load_graph(path)


def test_load_graph_not_json(tmp_path):
    path = tmp_path / "corrupt.json"
    path.write_text(json.dumps(graph_to_dict(diamond()))[:40])  # truncated
    with pytest.raises(GraphError, match=r"corrupt.json' is not valid JSON"):
        load_graph(path)


def test_load_graph_missing_file(tmp_path):
    with pytest.raises(GraphError, match=r"Cannot read layer graph .*nope.json"):
        load_graph(tmp_path / "nope.json")


def test_load_graph_not_a_layer_graph(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"kind": "plan", "schema_version": 1}))
    with pytest.raises(GraphError, match=r"is not a layer graph \(expected an object with kind='layer_graph'\)"):
        load_graph(path)


@pytest.mark.parametrize("version", [None, 0, "1"])
def test_graph_from_dict_bad_schema_version(version):
    data = graph_to_dict(diamond())
    data["schema_version"] = version
    with pytest.raises(GraphError, match=r"no valid schema_version .*corrupt"):
        graph_from_dict(data)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d.pop("nodes"),
        lambda d: d.pop("edges"),
        lambda d: d["nodes"][0].pop("name"),
        lambda d: d["edges"][0].pop("target"),
        lambda d: d.__setitem__("nodes", 5),
        lambda d: d.__setitem__("nodes", ["a"]),
        lambda d: d["nodes"][0].__setitem__("name", None),
    ],
)
def test_graph_from_dict_corrupt_fields(corrupt):
    data = graph_to_dict(diamond())
    corrupt(data)
    with pytest.raises(GraphError, match=r"is corrupt: missing or malformed field"):
        graph_from_dict(data)


def test_graph_from_dict_edge_to_unknown_node():
    data = graph_to_dict(diamond())
    data["edges"][0]["target"] = "zzz"
    with pytest.raises(GraphError, match=r"edge 'a' -> 'zzz' names a node that is not in the graph"):
        graph_from_dict(data)


def test_graph_from_dict_validates_the_result():
    data = graph_to_dict(diamond())
    del data["nodes"][1]["flops"]
    with pytest.raises(GraphError, match=r"Node 'b' has no numeric 'flops'"):
        graph_from_dict(data)


# ----- shape helpers -----------------------------------------------------------------------------


def test_is_chain_true_for_chains():
    assert is_chain(chain([1e9]))
    assert is_chain(chain([1e9] * 5))


def test_is_chain_false_for_branches_and_pieces():
    assert not is_chain(diamond())
    two_pieces = chain([1e9, 1e9])
    add_layer(two_pieces, "lonely")
    assert not is_chain(two_pieces)
    fan_in = chain([1e9, 1e9])
    add_layer(fan_in, "side")
    fan_in.add_edge("side", "l1", bytes=0)
    assert not is_chain(fan_in)


def test_topological_order_is_valid_and_keeps_insertion_order():
    graph = nx.DiGraph()
    for name in ["c", "a", "b", "d"]:
        add_layer(graph, name)
    graph.add_edge("b", "d", bytes=0)
    graph.add_edge("d", "a", bytes=0)
    # c and b have no inputs: insertion order puts c first; a waits for d.
    assert topological_order(graph) == ["c", "b", "d", "a"]


def test_topological_order_is_deterministic_and_valid():
    graph = random_dag(random.Random(7), 40)
    order = topological_order(graph)
    assert sorted(order) == sorted(graph.nodes)
    position = {v: i for i, v in enumerate(order)}
    assert all(position[u] < position[v] for u, v in graph.edges)
    rebuilt = graph_from_dict(json.loads(json.dumps(graph_to_dict(graph))))
    assert [topological_order(graph) for _ in range(3)] == [order] * 3
    assert topological_order(rebuilt) == order


def test_colocation_groups_ignores_single_members():
    graph = shared_layer_graph()
    graph.nodes["head"]["colocation_group"] = "alone"
    assert colocation_groups(graph) == {"dense": ["dense_call0", "dense_call1"]}


def test_chain_graph_builds_the_contract():
    graph = chain_graph([1e9, 2e9, 1e9], param_bytes=[1, 2, 3], activation_bytes=[4, 5, 6], edge_bytes=[7, 8])
    validate_graph(graph)
    assert list(graph.edges(data="bytes")) == [("layer_0", "layer_1", 7), ("layer_1", "layer_2", 8)]
    assert graph.nodes["layer_1"]["flops"] == 2e9
    assert graph.nodes["layer_2"]["param_bytes"] == 3
    assert graph.nodes["layer_0"]["activation_bytes"] == 4
    assert is_chain(graph)


def test_chain_graph_lengths_must_match():
    with pytest.raises(GraphError, match=r"one flops/param/activation value per layer and one edge fewer"):
        chain_graph([1e9, 1e9], edge_bytes=[1, 2])


# ---------------------------------------------------------------- rescaling to another batch size


def _profiled() -> nx.DiGraph:
    """Costs per micro-batch of 4 samples (batch 32 in 8 micro-batches), as the profiler records them."""
    graph = chain_graph([3e9, 6e9], param_bytes=[400, 800], activation_bytes=[1024, 2048], edge_bytes=[512])
    graph.nodes["layer_0"].update(forward_flops=1e9, trainable_param_bytes=0, time_s=0.5, output_bytes=512)
    graph.graph.update(model_name="m", batch_size=32, num_microbatches=8, micro_batch_size=4)
    return graph


def test_rescale_graph_scales_per_sample_costs_and_keeps_weights():
    scaled = rescale_graph(_profiled(), batch_size=64, num_microbatches=2)  # 32 samples per micro-batch: x8
    first, second = scaled.nodes["layer_0"], scaled.nodes["layer_1"]
    assert (first["flops"], first["forward_flops"], first["time_s"]) == (24e9, 8e9, 4.0)
    assert (first["activation_bytes"], second["activation_bytes"]) == (8 * 1024, 8 * 2048)
    assert scaled.edges["layer_0", "layer_1"]["bytes"] == 8 * 512
    assert (first["output_bytes"], "output_bytes" in second) == (8 * 512, False)
    assert (first["param_bytes"], first["trainable_param_bytes"], second["param_bytes"]) == (400, 0, 800)
    assert scaled.graph == {"model_name": "m", "batch_size": 64, "num_microbatches": 2, "micro_batch_size": 32}
    validate_graph(scaled)


def test_rescale_graph_keeps_the_fixed_part_of_a_measured_time():
    """Only time_s - fixed_time_s scales with the samples: 0.1 s fixed + 0.4 s for 4 samples becomes
    0.1 + 0.4 * 8 for 32 samples and 0.1 + 0.4 / 4 for one (a plain rescale would give 4.0 and 0.125)."""
    graph = _profiled()
    graph.nodes["layer_0"]["fixed_time_s"] = 0.1
    larger = rescale_graph(graph, batch_size=64, num_microbatches=2).nodes["layer_0"]
    smaller = rescale_graph(graph, batch_size=32, num_microbatches=32).nodes["layer_0"]
    assert larger["time_s"] == pytest.approx(3.3) and smaller["time_s"] == pytest.approx(0.2)
    assert larger["fixed_time_s"] == smaller["fixed_time_s"] == 0.1


def test_rescale_graph_prices_each_measured_size_as_measured_and_between_on_the_line():
    """Timed at 4 samples (0.5 s), 1 (0.2 s) and 16 (3.0 s; a device slower per sample there than the line
    through 1 and 4 says, 0.1 s a sample: 1.7 s): 16 samples cost 3.0 s, not 1.7; 8 samples read 1.33 s off
    the line through (4, 0.5) and (16, 3.0), 2 samples 0.3 s off the line through (1, 0.2) and (4, 0.5); 32
    samples 5.9 s off the line through (0, 0.1) and the largest, (16, 3.0)."""
    graph = _profiled()
    graph.nodes["layer_0"].update(fixed_time_s=0.1, time_by_samples=[[1, 0.2], [16, 3.0]])
    times = {
        n: rescale_graph(graph, batch_size=32 * n // 4, num_microbatches=8).nodes["layer_0"]["time_s"]
        for n in (1, 2, 8, 16, 32)
    }
    assert times == pytest.approx({1: 0.2, 2: 0.3, 8: 0.5 + 4 * 2.5 / 12, 16: 3.0, 32: 0.1 + 32 * 2.9 / 16})
    again = rescale_graph(rescale_graph(graph, batch_size=64, num_microbatches=8), batch_size=32, num_microbatches=8)
    assert again.nodes["layer_0"]["time_s"] == pytest.approx(0.5)  # back at the profile's size: as measured
    assert again.nodes["layer_0"]["time_by_samples"] == [[1, 0.2], [8, pytest.approx(0.5 + 4 * 2.5 / 12)], [16, 3.0]]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("time_by_samples", [[0, 0.1]], r"time_by_samples=\[\[0, 0.1\]\]; expected a list of \[samples, seconds\]"),
        ("time_by_samples", [[2, -1.0]], "expected a list of"),
        ("time_by_samples", 0.3, "expected a list of"),
        ("accumulate_time_s", -1e-3, r"accumulate_time_s=-0.001; expected seconds >= 0"),
    ],
)
def test_validate_graph_rejects_bad_timings(key, value, message):
    graph = _profiled()
    graph.nodes["layer_0"][key] = value
    with pytest.raises(GraphError, match=message):
        validate_graph(graph)


@pytest.mark.parametrize("fixed", [-0.1, 0.6, "0.1"])
def test_validate_graph_rejects_a_fixed_time_outside_the_time(fixed):
    graph = _profiled()
    graph.nodes["layer_0"]["fixed_time_s"] = fixed
    with pytest.raises(GraphError, match=r"has fixed_time_s=.*; expected seconds between 0 and its time_s"):
        validate_graph(graph)


def test_rescale_graph_leaves_the_input_unchanged():
    graph = _profiled()
    rescale_graph(graph, batch_size=8)
    assert graph.nodes["layer_0"]["flops"] == 3e9 and graph.graph["micro_batch_size"] == 4


def test_rescale_graph_rounds_micro_batches_up():
    scaled = rescale_graph(_profiled(), batch_size=10, num_microbatches=4)  # ceil(10 / 4) = 3 samples
    assert scaled.graph["micro_batch_size"] == 3
    assert scaled.nodes["layer_1"]["activation_bytes"] == 3 * 2048 // 4


def test_rescale_graph_reads_older_profiles_without_micro_batch_size():
    graph = _profiled()
    del graph.graph["micro_batch_size"]  # ceil(32 / 8) = 4, as the profiler measured
    assert rescale_graph(graph, batch_size=4).nodes["layer_1"]["flops"] == 6e9


def test_rescale_graph_refuses_a_graph_without_a_batch_size():
    with pytest.raises(GraphError, match="does not record the batch size its costs were measured at"):
        rescale_graph(chain_graph([1e9, 1e9]), batch_size=64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"batch_size": 4, "num_microbatches": 8}, "must not exceed batch_size"),
        ({"batch_size": 4, "num_microbatches": 1.5}, "num_microbatches must be an integer"),
    ],
)
def test_rescale_graph_rejects_bad_numbers(kwargs, message):
    with pytest.raises(InputError, match=message):
        rescale_graph(_profiled(), **kwargs)


@pytest.mark.parametrize(
    ("key", "value"), [("micro_batch_size", 0), ("batch_size", 2.5), ("compute_dtype", ""), ("compute_dtype", 16)]
)
def test_validate_graph_rejects_bad_graph_attributes(key, value):
    graph = _profiled()
    graph.graph[key] = value
    with pytest.raises(GraphError, match=key):
        validate_graph(graph)


def test_graph_json_round_trip_keeps_batch_and_dtype(tmp_path):
    graph = _profiled()
    graph.graph["compute_dtype"] = "bfloat16"
    save_graph(graph, tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json").graph == graph.graph


def test_rescale_graph_scales_the_models_inputs_and_outputs():
    graph = chain_graph([4e9, 4e9], activation_bytes=[4096, 4096])
    graph.graph.update(batch_size=32, num_microbatches=8)
    graph.nodes["layer_0"]["model_input_bytes"] = 400
    graph.nodes["layer_1"]["model_output_bytes"] = 40
    scaled = rescale_graph(graph, batch_size=64, num_microbatches=4)  # 4 -> 16 samples per micro-batch
    assert scaled.nodes["layer_0"]["model_input_bytes"] == 1600
    assert scaled.nodes["layer_1"]["model_output_bytes"] == 160
    assert "model_output_bytes" not in scaled.nodes["layer_0"]  # absent stays absent


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_validate_graph_refuses_bad_model_bytes(value):
    graph = chain_graph([1e9])
    graph.nodes["layer_0"]["model_output_bytes"] = value
    with pytest.raises(GraphError, match=r"'layer_0' has model_output_bytes=.*expected bytes per micro-batch"):
        validate_graph(graph)
    del graph.nodes["layer_0"]["model_output_bytes"]
    graph.nodes["layer_0"]["output_bytes"] = value
    with pytest.raises(GraphError, match=r"'layer_0' has output_bytes=.*expected bytes per micro-batch"):
        validate_graph(graph)


def test_model_bytes_survive_a_json_round_trip(tmp_path):
    graph = chain_graph([1e9])
    graph.nodes["layer_0"].update(model_input_bytes=12, model_output_bytes=3, output_bytes=5)
    save_graph(graph, tmp_path / "g.json")
    loaded = load_graph(tmp_path / "g.json")
    node = loaded.nodes["layer_0"]
    assert (node["model_input_bytes"], node["model_output_bytes"], node["output_bytes"]) == (12, 3, 5)


def test_graph_level_model_bytes_load_and_are_dropped(tmp_path):
    # a development version wrote them per graph; such a file still loads, priced as a profile without them
    graph = chain_graph([1e9])
    save_graph(graph, tmp_path / "g.json")
    data = json.loads((tmp_path / "g.json").read_text())
    data.update(model_input_bytes=12, model_output_bytes=3)
    (tmp_path / "g.json").write_text(json.dumps(data))
    loaded = load_graph(tmp_path / "g.json")
    assert "model_input_bytes" not in loaded.graph and "model_output_bytes" not in loaded.graph


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), True, "1 ms"])
def test_validate_graph_step_overhead_must_be_seconds(value):
    graph = chain([1e9, 1e9])
    graph.graph["step_overhead_s"] = value
    with pytest.raises(GraphError, match=r"step_overhead_s=.*expected the seconds a step spends beyond its layers"):
        validate_graph(graph)


def test_step_overhead_is_saved_and_not_rescaled(tmp_path):
    # a step's own work, once per step: the same whatever the batch or the micro-batches
    graph = chain([1e9, 1e9])
    graph.graph.update(batch_size=8, num_microbatches=1, step_overhead_s=0.25)
    save_graph(graph, tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json").graph["step_overhead_s"] == 0.25
    assert rescale_graph(graph, batch_size=64, num_microbatches=8).graph["step_overhead_s"] == 0.25
