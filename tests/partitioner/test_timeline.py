"""Pictures of a simulated step: the text chart's rows and symbols, and the Gantt chart file."""

from __future__ import annotations

import pytest
from graphs import KIB, chain

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.errors import InputError
from partitioner.show.timeline import save_timeline, text_timeline
from partitioner.simulate import simulate_assignment
from partitioner.units import format_bytes


def two_stage_simulation(schedule: str = "gpipe") -> pt.Simulation:
    """Two layers of 1 s forward + 2 s backward, one per device, and a 1 s transfer each way, M = 2."""
    graph = chain([3e12, 3e12], param_bytes=[KIB, KIB], edge_bytes=[10**9])
    cluster = pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12, bandwidth=1e9)
    plan = pt.score_assignment(
        {"l0": "/GPU:0", "l1": "/GPU:1"}, CostModel(graph, cluster, num_microbatches=2), method="manual"
    )
    return pt.simulate(plan, graph, cluster, schedule=schedule)


def test_text_timeline_columns_follow_the_simulation():
    sim = two_stage_simulation()
    # GPU:0 forwards 0-2, sends 1-2 and 2-3; GPU:1 (the last stage: each backward right after its forward)
    # forwards 2-3, backwards 3-5, forwards 5-6, backwards 6-8; gradients 5-6 and 8-9; GPU:0 backwards 6-8
    # and 9-11.
    assert sim.step_time_s == pytest.approx(2 * 3 + 3 + 2 * 1)
    lines = text_timeline(sim, width=11).splitlines()  # one column per second
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in lines if "|" in line}
    assert rows["/GPU:0"] == "FF....BB.BB"
    assert rows["/GPU:1"] == "..FBBFBB..."
    assert rows["/GPU:0 -> /GPU:1"] == ".>>........"
    assert rows["/GPU:1 -> /GPU:0"] == ".....<..<.."
    assert "gpipe schedule, 2 stages x 2 micro-batches: step 11.00 s" in lines[0]
    assert any("peak memory" in line and "(2 micro-batches in flight)" in line for line in lines)
    assert lines[-1].split() == [
        "together",
        "peak",
        "memory",
        *format_bytes(sim.peak_total_bytes).split(),
        "at",
        "one",
        "moment",
    ]


def test_text_timeline_shows_gradient_sums_beside_the_passes_on_a_row_of_their_own(tmp_path):
    # one stage of forward 1 s, backward 2 s and sums 1 s per micro-batch on a pooled CPU device with room for
    # both (capacity 2 of 3 devices): the passes fill 0-6, each micro-batch's sums the second after its backward
    graph = chain([3e12], param_bytes=[KIB])
    graph.nodes["l0"].update(time_s=3.0, accumulate_time_s=1.0)
    graph.graph["profiled_flops_per_s"] = 1e12
    cpus = [pt.Device(f"/CPU:{i}", memory="1GiB", flops_per_s=1e12, pool="host", pool_capacity=2.0) for i in range(3)]
    costs = CostModel(graph, pt.Cluster(cpus), num_microbatches=2, cost="time")
    sim = simulate_assignment(costs, {"l0": "/CPU:0"})
    rows = {
        line.split("|")[0].strip(): line.split("|")[1]
        for line in text_timeline(sim, width=14).splitlines()
        if "|" in line
    }
    assert rows == {"/CPU:0": "FFBBBBFFBBBB..", "/CPU:0 sums": "......++....++"}
    assert save_timeline(sim, tmp_path / "sums.png").read_bytes().startswith(b"\x89PNG")


def test_text_timeline_width_is_checked():
    with pytest.raises(InputError, match=r"width must be an integer >= 10 columns\. Received: 3"):
        text_timeline(two_stage_simulation(), width=3)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_save_timeline_writes_the_picture(tmp_path, suffix):
    path = save_timeline(two_stage_simulation("1f1b"), tmp_path / f"t{suffix}", title="two stages")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data
