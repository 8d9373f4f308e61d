"""The cost model on hand-computed examples: stage times, receive times, memory, step time."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest
from graphs import add_layer, chain, diamond

from partitioner.cluster import Cluster, Device, load_device_profile
from partitioner.cost import CostModel, bubble_fraction, relative_gap
from partitioner.errors import ClusterError, GraphError, InputError, PlanError
from partitioner.graph import load_graph, rescale_graph
from partitioner.schedule import schedule_family
from partitioner.simulate import simulate_assignment

G0, G1, G2 = "/GPU:0", "/GPU:1", "/GPU:2"
RECEIVED = 2 * 10**6  # _abc's l1 -> l2 tensor: l2's stage makes its gradient in a backward (M > 1)


def _slow_cluster(num_devices: int = 2, **kwargs) -> Cluster:
    """1 GFLOP/s devices and 1 MB/s links: times in the tests below are whole seconds."""
    return Cluster.uniform(num_devices, memory="1GiB", flops_per_s=1e9, bandwidth=1e6, **kwargs)


def _abc() -> nx.DiGraph:
    """a -> b -> c with 2, 4 and 6 GFLOP; 1 MB and 2 MB sent; 100, 200, 300 B of weights; 10, 20, 30 B kept."""
    return chain(
        [2e9, 4e9, 6e9], param_bytes=[100, 200, 300], activation_bytes=[10, 20, 30], edge_bytes=[10**6, 2 * 10**6]
    )


def test_costmodel_stage_times_by_hand():
    costs = CostModel(_abc(), _slow_cluster(), num_microbatches=4, optimizer_slots=2)
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G1})
    assert ev.compute_times == {G0: 6.0, G1: 6.0}
    assert ev.receive_times == {G0: 0.0, G1: 4.0}  # 2 MB over 1 MB/s forward, and its gradient back
    assert ev.stage_times == {G0: 6.0, G1: 10.0}
    assert ev.bottleneck_s == 10.0
    assert ev.stages == (G0, G1)
    assert ev.transfer_bytes == 2 * 10**6
    assert ev.step_time_s == (4 + 2 - 1) * 10.0


def test_costmodel_memory_by_hand():
    costs = CostModel(_abc(), _slow_cluster(), num_microbatches=4, optimizer_slots=2)
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G1})
    # param_bytes * (weights + gradient + its micro-batch's beside the sum (M > 1) + slots) + M * activation_bytes
    # + with M > 1 one micro-batch's activation gradients while a backward runs in the loop, and on G1 the
    # gradient of the 2 MB it received (its backward makes it, to send back); G1, GPipe's last stage, holds
    # one micro-batch's activations (its backward follows its forward) and a copy of the 2 MB it receives for
    # each of G0's 4 micro-batches (one its forward keeps, 3 G0 ran ahead, waiting for its forwards)
    assert ev.memory_bytes == {
        G0: (100 + 200) * 5 + (4 + 1) * (10 + 20),
        G1: 300 * 5 + (1 + 1) * 30 + RECEIVED + 4 * RECEIVED,
    }
    sgd = CostModel(_abc(), _slow_cluster(), num_microbatches=1, optimizer_slots=0).evaluate(
        {"l0": G0, "l1": G0, "l2": G1}
    )
    # M = 1: no loop, no gradients' copy; G1 holds one copy of the 2 MB it receives
    assert sgd.memory_bytes == {G0: (100 + 200) * 2 + (10 + 20), G1: 300 * 2 + 30 + RECEIVED}


def test_costmodel_working_set_is_the_gradients_of_the_nodes_outputs():
    # profiled graphs say each node's output bytes: a running backward (M > 1) holds their gradients, not its
    # activations (l1 keeps 20 B for its backward but outputs 5 B); a node without the attribute: its activations
    graph = _abc()
    graph.nodes["l0"]["output_bytes"] = 3
    graph.nodes["l1"]["output_bytes"] = 5
    costs = CostModel(graph, _slow_cluster(), num_microbatches=4, optimizer_slots=2)
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G1})
    ahead = 4 * RECEIVED  # GPipe's last stage: a copy of its input for each of the sender's M micro-batches
    assert ev.memory_bytes == {
        G0: (100 + 200) * 5 + 4 * (10 + 20) + (3 + 5),
        G1: 300 * 5 + (1 + 1) * 30 + RECEIVED + ahead,
    }
    assert costs.node_cost("l1", "kept").once_bytes == 5  # a node alone prices it alike


def test_costmodel_gradient_sums_need_a_second_copy_only_with_microbatches():
    # M = 1: the one micro-batch's gradients are the step's; M > 1: the sum so far and the micro-batch's
    for m, copies in ((1, 1), (2, 2), (8, 2)):
        costs = CostModel(_abc(), _slow_cluster(), num_microbatches=m, optimizer_slots=0)
        assert costs.weight_bytes("l1") == 200 * (1 + copies)


def _abc_with_boundary() -> nx.DiGraph:
    """_abc with 1000 B of model inputs held by l0 and 50 B of model outputs from l2, per micro-batch."""
    graph = _abc()
    graph.nodes["l0"]["model_input_bytes"] = 1000
    graph.nodes["l2"]["model_output_bytes"] = 50
    return graph


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # G0: weights 300 x 5 + the batch's inputs 4 x 1000 + 4 in flight x 30 of activations + 30 of their
        # gradients in a backward; G1: weights 300 x 5 + the collected outputs 4 x 50 + one micro-batch's 50
        # (the loss's gradient, the metrics' temporaries) + 1 x 30 in flight (the last stage) + 30 and the
        # received 2 MB's gradient in a backward + a copy of the received 2 MB for each of G0's micro-batches in
        # flight (GPipe 4, 1F1B 2: the one G1's forward keeps, the rest waiting for its forwards)
        ("gpipe", {G0: 1500 + 4000 + 5 * 30, G1: 1500 + 200 + 50 + 2 * 30 + RECEIVED + 4 * RECEIVED}),
        ("1f1b", {G0: 1500 + 4000 + 3 * 30, G1: 1500 + 200 + 50 + 2 * 30 + RECEIVED + 2 * RECEIVED}),
    ],
)
def test_costmodel_prices_the_inputs_and_outputs_on_their_nodes_devices(schedule, expected):
    costs = CostModel(_abc_with_boundary(), _slow_cluster(), num_microbatches=4, schedule=schedule)
    assert [costs.step_bytes(v) for v in ("l0", "l1", "l2")] == [4 * 1000, 0, (4 + 1) * 50]
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G1})
    assert ev.memory_bytes == expected


def test_costmodel_node_memory_carries_the_step_terms():
    # what the planners budget per node and per received tensor is what evaluate sums per stage
    costs = CostModel(_abc_with_boundary(), _slow_cluster(), num_microbatches=4, optimizer_slots=0)
    node = costs.node_memory_bytes("kept", 4)
    assert node == {"l0": 100 * 3 + 4000 + 5 * 10, "l1": 200 * 3 + 5 * 20, "l2": 300 * 3 + 250 + 5 * 30}
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G1})
    received = costs.input_memory_bytes("kept", 4)
    # a kept stage: a copy for each of the sender's 4 micro-batches, and the gradient its backward makes
    assert received == {"l0": 5 * 10**6, "l1": 5 * RECEIVED, "l2": 0}
    last = costs.node_memory_bytes("kept", 1)  # G1 is GPipe's last stage: one micro-batch in flight
    assert last["l2"] == 300 * 3 + 250 + 2 * 30
    assert costs.input_memory_bytes("kept", 1)["l1"] == 5 * RECEIVED  # the sender's M copies, whatever it holds
    assert ev.memory_bytes == {G0: node["l0"] + node["l1"], G1: last["l2"] + costs.input_memory_bytes("kept", 1)["l1"]}


def test_costmodel_input_held_where_its_node_is():
    # an InputLayer node on the second device: its batch is split there, not on the first stage
    graph = _abc_with_boundary()
    graph.nodes["l0"]["model_input_bytes"] = 0
    graph.nodes["l1"]["model_input_bytes"] = 1000
    ev = CostModel(graph, _slow_cluster(), num_microbatches=4, optimizer_slots=0).evaluate(
        {"l0": G0, "l1": G1, "l2": G1}
    )
    # G1 last: 1 held, and a copy of the 1 MB from G0 for each of G0's 4 micro-batches
    assert ev.memory_bytes == {G0: 100 * 3 + 5 * 10, G1: 500 * 3 + 4000 + 250 + 2 * 50 + 10**6 + 4 * 10**6}


def test_costmodel_output_of_an_earlier_stage_is_collected_on_the_last_too():
    # the runtime collects every model output where the loss is (the last stage): an output of l0 on G0
    # is charged on G0 (its node's charge, which the planners see) and on G1, where it is held
    graph = _abc_with_boundary()
    graph.nodes["l0"]["model_output_bytes"] = 7
    ev = CostModel(graph, _slow_cluster(), num_microbatches=4, optimizer_slots=0).evaluate(
        {"l0": G0, "l1": G0, "l2": G1}
    )
    assert ev.memory_bytes == {
        G0: 300 * 3 + 4000 + 35 + 5 * 30,
        G1: 300 * 3 + 250 + 35 + 2 * 30 + RECEIVED + 4 * RECEIVED,  # + a copy of its input per sender's micro-batch
    }


def test_costmodel_one_stage_holds_batch_and_outputs_at_one_microbatch():
    costs = CostModel(_abc_with_boundary(), _slow_cluster(), num_microbatches=1, optimizer_slots=0)
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G0})
    # weights and gradients, the batch (1 x 1000), the outputs (1 x 50) and the loss's and metrics' work on
    # them (50), one micro-batch's activations
    assert ev.memory_bytes[G0] == 600 * 2 + 1000 + 2 * 50 + 60


def test_costmodel_graph_without_boundary_bytes_prices_none():
    # profiles written before model_input_bytes / model_output_bytes: today's figures; graph-level
    # attributes of those names (a development version's) are not read
    graph = _abc()
    graph.graph.update(model_input_bytes=1000, model_output_bytes=50)
    costs = CostModel(graph, _slow_cluster(), num_microbatches=4, optimizer_slots=0)
    assert [costs.step_bytes(v) for v in ("l0", "l1", "l2")] == [0, 0, 0]
    assert costs.evaluate({"l0": G0, "l1": G0, "l2": G1}).memory_bytes == {
        G0: 300 * 3 + 5 * 30,
        G1: 300 * 3 + 2 * 30 + RECEIVED + 4 * RECEIVED,  # GPipe's last stage: one micro-batch, 4 input copies
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_simulated_peak_memory_is_evaluates(schedule, recompute):
    costs = CostModel(_abc_with_boundary(), _slow_cluster(3), num_microbatches=4, schedule=schedule)
    assignment = {"l0": G0, "l1": G1, "l2": G2}
    ev = costs.evaluate(assignment, recompute)
    sim = simulate_assignment(costs, assignment, recompute=recompute)
    assert sim.peak_memory_bytes == {d: ev.memory_bytes[d] for d in ev.stages}
    assert sim.peak_memory_bytes[G0] >= 4 * 1000 and sim.peak_memory_bytes[G2] >= (4 + 1) * 50


def test_costmodel_one_device_holds_everything():
    costs = CostModel(_abc(), _slow_cluster(), num_microbatches=8)
    ev = costs.evaluate({"l0": G1, "l1": G1, "l2": G1})
    assert ev.stages == (G1,)
    assert ev.bottleneck_s == 12.0
    assert ev.step_time_s == 8 * 12.0  # K = 1: no bubble
    assert ev.receive_times == {G0: 0.0, G1: 0.0}
    assert ev.transfer_bytes == 0
    assert ev.stage_times[G0] == 0.0  # an unused device shows zero


def test_costmodel_step_time_counts_used_devices_only():
    costs = CostModel(_abc(), _slow_cluster(3), num_microbatches=5)
    ev = costs.evaluate({"l0": G0, "l1": G2, "l2": G2})
    assert ev.stages == (G0, G2)
    # G2 computes 4 + 6, receives 1 MB from G0 and sends its gradient back.
    assert ev.bottleneck_s == 12.0
    assert ev.step_time_s == (5 + 2 - 1) * 12.0


def test_costmodel_tensor_received_once_per_device_with_two_consumers():
    graph = diamond(edge_bytes=10**6)  # a -> b, a -> c, b -> d, c -> d; every tensor 1 MB
    costs = CostModel(graph, _slow_cluster(3), num_microbatches=1)
    ev = costs.evaluate({"a": G0, "b": G1, "c": G1, "d": G1})
    assert ev.receive_times == {G0: 0.0, G1: 2.0, G2: 0.0}  # a's output (and gradient) once, not twice
    assert ev.transfer_bytes == 10**6
    ev = costs.evaluate({"a": G0, "b": G1, "c": G2, "d": G2})
    # G1 receives a; G2 receives a and b (c is local).
    assert ev.receive_times == {G0: 0.0, G1: 2.0, G2: 4.0}
    assert ev.transfer_bytes == 3 * 10**6
    assert ev.stage_times == {G0: 1.0, G1: 3.0, G2: 6.0}


def test_costmodel_receive_uses_the_link_of_the_sender():
    devices = [Device(f"/GPU:{i}", memory="1GiB", flops_per_s=1e9) for i in range(3)]
    # row = sender: 0 -> 2 is slow (1 MB/s), 1 -> 2 fast (4 MB/s).
    cluster = Cluster(devices, bandwidth=[[0, 4e6, 1e6], [4e6, 0, 4e6], [4e6, 4e6, 0]])
    graph = diamond(edge_bytes=4 * 10**6)
    costs = CostModel(graph, cluster)
    ev = costs.evaluate({"a": G0, "b": G1, "c": G1, "d": G2})
    assert ev.receive_times[G1] == 2.0  # a: 4 MB at 4 MB/s, and its gradient back at 4 MB/s
    assert ev.receive_times[G2] == 4.0  # b and c: 1 s each way over the fast 1 <-> 2 links
    ev = costs.evaluate({"a": G0, "b": G0, "c": G0, "d": G2})
    assert ev.receive_times[G2] == 10.0  # b and c: 4 s over the slow 0 -> 2 link, 1 s back over 2 -> 0


def test_costmodel_out_bytes_is_the_tensor_size():
    graph = diamond()
    graph.edges["a", "b"]["bytes"] = 500
    graph.edges["a", "c"]["bytes"] = 800
    costs = CostModel(graph, _slow_cluster())
    assert costs.out_bytes == {"a": 800, "b": 1000, "c": 1000, "d": 0}


def test_costmodel_heterogeneous_speed():
    devices = [Device(G0, memory="1GiB", flops_per_s=1e9), Device(G1, memory="1GiB", flops_per_s=4e9)]
    costs = CostModel(_abc(), Cluster(devices, bandwidth=1e6))
    assert costs.compute_s["l2"] == [6.0, 1.5]
    assert costs.serial_step_s() == 3.0  # all 12 GFLOP on the faster device, M = 1
    # Perfect spread: 12 GFLOP over 5 GFLOP/s; the costliest node alone takes 1.5 s at best.
    assert costs.lower_bound_s() == pytest.approx(12 / 5)


def test_costmodel_lower_bound_single_node_dominates():
    costs = CostModel(chain([1e9, 10e9]), _slow_cluster(4))
    assert costs.lower_bound_s() == 10.0


def test_costmodel_fits():
    graph = chain([1e9, 1e9], param_bytes=[256, 256])  # 1 KiB each with Adam
    cluster = Cluster([Device(G0, memory=1024), Device(G1, memory=2047)])
    costs = CostModel(graph, cluster)
    assert costs.fits(costs.evaluate({"l0": G0, "l1": G1}))
    assert not costs.fits(costs.evaluate({"l0": G1, "l1": G1}))  # 2048 B > 2047 B
    assert not costs.fits(costs.evaluate({"l0": G0, "l1": G0}))


def test_costmodel_cost_time_rescales_by_profiled_speed():
    graph = _abc()
    for node, seconds in zip(["l0", "l1", "l2"], [0.5, 1.0, 2.0], strict=True):
        graph.nodes[node]["time_s"] = seconds
    graph.graph["profiled_flops_per_s"] = 2e9  # measured on a device twice as fast as ours
    devices = [Device(G0, memory="1GiB", flops_per_s=1e9), Device(G1, memory="1GiB", flops_per_s=4e9)]
    costs = CostModel(graph, Cluster(devices, bandwidth=1e6), cost="time")
    assert costs.compute_s["l0"] == [1.0, 0.25]
    assert costs.compute_s["l2"] == [4.0, 1.0]
    ev = costs.evaluate({"l0": G0, "l1": G0, "l2": G1})
    assert ev.compute_times == {G0: 3.0, G1: 1.0}
    assert ev.stage_times == {G0: 3.0, G1: 5.0}  # 1 s compute + 2 MB at 1 MB/s each way


def test_costmodel_cost_time_prices_summing_the_weight_gradients_in_every_backward_when_looped():
    """accumulate_time_s (0.3 s on the profiled device, twice as fast as G0) is paid by every backward when
    M > 1, not at M = 1 and not with FLOP costs: l0's 0.5 s (1.0 on G0: 1/3 forward, 2/3 backward) gets
    0.6 s in its backward on G0, 0.15 on G1."""
    graph = _abc()
    for node, seconds in zip(["l0", "l1", "l2"], [0.5, 1.0, 2.0], strict=True):
        graph.nodes[node]["time_s"] = seconds
    graph.nodes["l0"]["accumulate_time_s"] = 0.3
    graph.graph["profiled_flops_per_s"] = 2e9
    devices = [Device(G0, memory="1GiB", flops_per_s=1e9), Device(G1, memory="1GiB", flops_per_s=4e9)]
    cluster = Cluster(devices, bandwidth=1e6)
    looped = CostModel(graph, cluster, num_microbatches=4, cost="time")
    assert looped.forward_s["l0"] == pytest.approx([1 / 3, 1 / 12])
    assert looped.backward_s["l0"] == pytest.approx([2 / 3 + 0.6, 1 / 6 + 0.15])
    assert looped.compute_s["l0"] == pytest.approx([1.6, 0.4])
    assert looped.compute_s["l1"] == [2.0, 0.5]  # no weights summed: as measured
    assert CostModel(graph, cluster, num_microbatches=1, cost="time").compute_s["l0"] == [1.0, 0.25]
    flops = CostModel(graph, cluster, num_microbatches=4)
    assert flops.compute_s["l0"] == [graph.nodes["l0"]["flops"] / 1e9, graph.nodes["l0"]["flops"] / 4e9]


def test_costmodel_on_pooled_cpu_devices_keeps_the_gradient_sums_out_of_the_backward():
    """On logical CPU devices of one pool the sums run beside the stage's next pass (the simulator's pool job):
    CostModel.sums_s and Evaluation.sums_s carry them, the backward and compute_s do not; on a CPU of its own
    (no pool) they stay in the backward."""
    graph = _abc()
    for node, seconds in zip(["l0", "l1", "l2"], [0.5, 1.0, 2.0], strict=True):
        graph.nodes[node]["time_s"] = seconds
    graph.nodes["l0"]["accumulate_time_s"] = 0.3
    graph.nodes["l2"]["accumulate_time_s"] = 0.1
    graph.graph["profiled_flops_per_s"] = 1e9
    cpus = [Device(f"/CPU:{i}", memory="1GiB", flops_per_s=1e9, pool="host", pool_capacity=1.5) for i in range(2)]
    pooled = CostModel(graph, Cluster(cpus), num_microbatches=4, cost="time")
    assert pooled.backward_s["l0"] == pytest.approx([1 / 3, 1 / 3])
    assert pooled.sums_s["l0"] == pytest.approx([0.3, 0.3])
    ev = pooled.evaluate({"l0": "/CPU:0", "l1": "/CPU:0", "l2": "/CPU:1"})
    assert ev.sums_s == pytest.approx((0.3, 0.1))
    assert ev.compute_times == pytest.approx({"/CPU:0": 1.5, "/CPU:1": 2.0})
    own = CostModel(graph, Cluster([Device("/CPU:0", memory="1GiB", flops_per_s=1e9)]), num_microbatches=4, cost="time")
    assert own.backward_s["l0"] == pytest.approx([1 / 3 + 0.3]) and own.sums_s["l0"] == [0.0]
    assert own.evaluate(dict.fromkeys(graph.nodes, "/CPU:0")).sums_s == (0.0,)


def test_costmodel_cost_time_without_profiled_speed_uses_the_fastest_device():
    graph = _abc()
    for node in graph.nodes:
        graph.nodes[node]["time_s"] = 1.0
    devices = [Device(G0, memory="1GiB", flops_per_s=1e9), Device(G1, memory="1GiB", flops_per_s=4e9)]
    costs = CostModel(graph, Cluster(devices), cost="time")
    assert costs.compute_s["l0"] == [4.0, 1.0]


def test_costmodel_cost_time_needs_time_s():
    graph = _abc()
    graph.nodes["l0"]["time_s"] = 1.0
    with pytest.raises(InputError, match=r"cost='time' needs a measured time_s on every node; node 'l1' has none"):
        CostModel(graph, _slow_cluster(), cost="time")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_costmodel_bad_num_microbatches(value):
    with pytest.raises(InputError, match=rf"num_microbatches must be an integer >= 1. Received: {value!r}"):
        CostModel(_abc(), _slow_cluster(), num_microbatches=value)


@pytest.mark.parametrize("value", [-1, 2.0, None])
def test_costmodel_bad_optimizer_slots(value):
    with pytest.raises(InputError, match=rf"optimizer_slots must be an integer >= 0 .*Received: {value!r}"):
        CostModel(_abc(), _slow_cluster(), optimizer_slots=value)


def test_costmodel_bad_cost_source():
    with pytest.raises(InputError, match=r"cost must be one of \('flops', 'time'\). Received: 'bogus'"):
        CostModel(_abc(), _slow_cluster(), cost="bogus")


def test_costmodel_validates_the_graph():
    graph = _abc()
    graph.add_edge("l2", "l0", bytes=0)
    with pytest.raises(GraphError, match=r"cycle"):
        CostModel(graph, _slow_cluster())


def test_costmodel_check_assignment_messages():
    costs = CostModel(_abc(), _slow_cluster())
    with pytest.raises(PlanError, match=r"1 node\(s\) have no device \(e.g. \['l2'\]\)"):
        costs.check_assignment({"l0": G0, "l1": G0})
    with pytest.raises(PlanError, match=r"1 node\(s\) are not in the graph \(e.g. \['zz'\]\)"):
        costs.check_assignment({"l0": G0, "l1": G0, "l2": G0, "zz": G0})
    with pytest.raises(PlanError, match=r"device\(s\) \['/GPU:9'\] that the cluster lacks"):
        costs.check_assignment({"l0": G0, "l1": G0, "l2": "/GPU:9"})


def test_costmodel_order_is_topological():
    graph = nx.DiGraph()
    for name in ["z", "y", "x"]:
        add_layer(graph, name)
    graph.add_edge("x", "y", bytes=0)
    graph.add_edge("y", "z", bytes=0)
    assert CostModel(graph, _slow_cluster()).order == ["x", "y", "z"]


@pytest.mark.parametrize(("k", "m", "expected"), [(1, 8, 0.0), (2, 1, 0.5), (4, 8, 3 / 11), (8, 8, 7 / 15)])
def test_bubble_fraction(k, m, expected):
    assert bubble_fraction(k, m) == pytest.approx(expected)


def test_relative_gap():
    assert relative_gap(10.0, None) is None
    assert relative_gap(10.0, 10.0) == 0.0
    assert relative_gap(10.0, 9.0) == pytest.approx(0.1)
    assert relative_gap(10.0, 11.0) == 0.0
    assert relative_gap(0.0, 0.0) == 0.0


# ---------------------------------------------------------------- device speed by compute dtype


REPO = Path(__file__).resolve().parents[2]
H100 = "H100-SXM-80GB"


def _one_h100(**overrides) -> Cluster:
    data = {"schema_version": 1, "kind": "cluster", "device_profile": H100, "num_devices": 1}
    return Cluster.from_dict({**data, "bandwidth_bytes_per_s": 1e11, **overrides})


def _with_dtype(graph: nx.DiGraph, dtype: str) -> nx.DiGraph:
    graph = graph.copy()
    graph.graph["compute_dtype"] = dtype
    return graph


def test_costmodel_speed_is_the_peak_for_the_compute_dtype_times_efficiency():
    peaks = load_device_profile(H100)["peak_flops_per_s"]
    for dtype, peak in (("bfloat16", peaks["bfloat16"]), ("float16", peaks["float16"]), ("float32", peaks["tf32"])):
        costs = CostModel(_with_dtype(_abc(), dtype), _one_h100())
        assert costs.flops_per_s == [pytest.approx(peak * 0.4)], dtype  # the H100 profile's efficiency
        assert costs.compute_s["l2"][0] == pytest.approx(6e9 / (peak * 0.4))


def test_costmodel_float32_without_tf32_uses_the_float32_peak():
    v100 = Cluster.from_dict(
        {"schema_version": 1, "kind": "cluster", "device_profile": "V100-SXM2-32GB", "num_devices": 1,
         "bandwidth_bytes_per_s": 1e11}
    )  # fmt: skip
    costs = CostModel(_with_dtype(_abc(), "float32"), v100)
    assert costs.flops_per_s == [pytest.approx(15.7e12 * 0.3)]


def test_costmodel_bfloat16_graph_runs_faster_than_float32():
    slow = CostModel(_with_dtype(_abc(), "float32"), _one_h100())
    fast = CostModel(_with_dtype(_abc(), "bfloat16"), _one_h100())
    placement = {"l0": G0, "l1": G0, "l2": G0}
    overhead = 2 * _one_h100().devices[0].action_overhead_s  # one forward and one backward: not FLOPs
    ratio = (slow.evaluate(placement).step_time_s - overhead) / (fast.evaluate(placement).step_time_s - overhead)
    assert ratio == pytest.approx(989.4 / 494.7)  # the dense bf16 peak over the tf32 peak


def test_costmodel_cluster_efficiency_overrides_the_profile():
    default = CostModel(_with_dtype(_abc(), "bfloat16"), _one_h100())
    overridden = CostModel(_with_dtype(_abc(), "bfloat16"), _one_h100(efficiency=0.1))
    assert overridden.flops_per_s[0] == pytest.approx(default.flops_per_s[0] / 4)


def test_costmodel_graph_without_dtype_uses_the_cluster_dtype():
    costs = CostModel(_abc(), _one_h100(dtype="bfloat16"))
    assert costs.flops_per_s == [pytest.approx(989.4e12 * 0.4)]


def test_costmodel_missing_dtype_peak_is_one_clear_error():
    t4 = Cluster.from_json("4xT4-pcie")
    with pytest.raises(ClusterError, match=r"T4-16GB\) has no peak FLOP/s for the compute dtype 'bfloat16'") as info:
        CostModel(_with_dtype(_abc(), "bfloat16"), t4)
    message = str(info.value)
    assert "'float16'" in message and "mixed_float16" in message  # what it has, and how to fix it
    assert "\n" not in message


def test_costmodel_hand_built_device_ignores_the_dtype():
    costs = CostModel(_with_dtype(_abc(), "bfloat16"), _slow_cluster())
    assert costs.flops_per_s == [1e9, 1e9]


def test_costmodel_resnet50_float32_on_h100_is_predicted_at_a_plausible_rate():
    graph = load_graph(REPO / "benchmarks" / "planner_quality" / "graphs" / "ResNet50-b32-m8.json")
    graph.graph["compute_dtype"] = "float32"
    graph = rescale_graph(graph, batch_size=64)
    placement = dict.fromkeys(graph.nodes, "/GPU:0")
    images_per_s = 64 / CostModel(graph, _one_h100()).evaluate(placement).step_time_s
    assert 2_000 < images_per_s < 10_000  # tf32 peak x 0.4: about 8,500; measured TF32 training is lower still
    at_bf16_peak = Cluster([Device("/GPU:0", memory="80GiB", flops_per_s=989.4e12)])  # what was predicted before
    assert 64 / CostModel(graph, at_bf16_peak).evaluate(placement).step_time_s > 40_000


def test_costmodel_action_overhead_is_paid_once_per_pass() -> None:
    """A stage pays its device's fixed cost once per forward and once per backward of each micro-batch,
    and once more for the forward a recomputed stage runs again; the simulator steps by the same figures."""
    from partitioner.simulate import simulate_assignment

    graph = chain([1e9, 1e9])
    fast = Device("/GPU:0", memory="1GiB", flops_per_s=1e12, action_overhead_s=1e-3)
    second = Device("/GPU:1", memory="1GiB", flops_per_s=1e12, action_overhead_s=1e-3)
    costs = CostModel(graph, Cluster([fast, second]), num_microbatches=4)
    compute = sum(costs.compute_s[v][0] for v in costs.order)  # FLOPs only
    one = {v: "/GPU:0" for v in costs.order}
    assert costs.evaluate(one).compute_times["/GPU:0"] == pytest.approx(compute + 2e-3)
    assert simulate_assignment(costs, one).step_time_s == pytest.approx(4 * (compute + 2e-3))
    assert costs.serial_step_s() == pytest.approx(4 * (compute + 2e-3))
    split = {costs.order[0]: "/GPU:0", costs.order[1]: "/GPU:1"}
    kept, recomputed = costs.evaluate(split, "never"), costs.evaluate(split, "always")
    assert recomputed.compute_times["/GPU:0"] - kept.compute_times["/GPU:0"] == pytest.approx(
        costs.forward_s[costs.order[0]][0] + 1e-3
    )
    assert costs.lower_bound_s() == pytest.approx(CostModel(graph, _plain(2)).lower_bound_s() + 2e-3)


def _plain(num_devices: int) -> Cluster:
    return Cluster([Device(f"/GPU:{i}", memory="1GiB", flops_per_s=1e12) for i in range(num_devices)])


@pytest.mark.parametrize(
    ("schedule", "num_microbatches", "copies"),
    [
        ("gpipe", 4, [0, 4 * 10**6, 4 * RECEIVED]),
        ("1f1b", 4, [0, 3 * 10**6, 2 * RECEIVED]),
        ("1f1b", 2, [0, 2 * 10**6, 2 * RECEIVED]),
    ],
)
def test_costmodel_counts_a_copy_of_each_received_input_for_every_microbatch_its_sender_holds(
    schedule, num_microbatches, copies
):
    """_abc on three devices: a receiver holds a copy of its input for each micro-batch its sender holds
    (those its forwards keep for its backward, and those the sender ran ahead, waiting). GPipe (windows
    M, M, 1): M copies on each receiver, M - 1 of them waiting on the last stage; 1F1B at M = 4 (windows
    3, 2, 1): 3 and 2; at M = 2 (2, 2, 1): 2 and 2. Recomputed, the stage's held bytes count its own
    micro-batches' inputs and received_bytes the rest."""
    costs = CostModel(_abc(), _slow_cluster(3), num_microbatches=num_microbatches, schedule=schedule)
    ev = costs.evaluate({"l0": G0, "l1": G1, "l2": G2})
    assert [c.received_bytes for c in ev.stage_costs] == copies
    for cost, device in zip(ev.stage_costs, (G0, G1, G2), strict=True):
        assert ev.memory_bytes[device] == cost.memory_bytes(ev.in_flight[device])
    # the chain DP's budget for receiving l1's output on a stage of the last stage's window, from the stage
    # right before it: the same figure; CP-SAT's, from a sender anywhere before (the most any stage holds)
    before = schedule_family(schedule).window_before(num_microbatches, ev.in_flight[G2])
    last = costs.input_memory_bytes("kept", ev.in_flight[G2], before)["l1"]
    assert last == RECEIVED + copies[2]  # + the gradient its backward makes
    assert costs.input_memory_bytes("kept", 1)["l1"] == RECEIVED + costs.max_in_flight * RECEIVED
    recomputed = costs.evaluate({"l0": G0, "l1": G1, "l2": G2}, recompute=(False, True, False))
    held = recomputed.in_flight[G1]
    assert recomputed.stage_costs[1].held_bytes == 10**6  # its saved input, per micro-batch in flight
    assert recomputed.stage_costs[1].received_bytes == copies[1] - held * 10**6
    assert recomputed.memory_bytes[G1] - ev.memory_bytes[G1] == (
        recomputed.stage_costs[1].memory_bytes(held) - ev.stage_costs[1].memory_bytes(held)
    )


def test_costmodel_counts_a_skip_connections_inputs_against_its_own_sender():
    """Under 1F1B (M = 4, windows 3, 2, 1) the last stage holds 3 copies of a tensor sent from the first stage,
    2 of one sent from the stage before it."""
    graph = _abc()
    graph.add_edge("l0", "l2", bytes=10**6)
    costs = CostModel(graph, _slow_cluster(3), num_microbatches=4, schedule="1f1b")
    ev = costs.evaluate({"l0": G0, "l1": G1, "l2": G2})
    assert [c.received_bytes for c in ev.stage_costs] == [0, 3 * 10**6, 3 * 10**6 + 2 * RECEIVED]
