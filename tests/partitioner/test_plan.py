"""Plans as data: JSON round trips, corrupt or future files, and the derived views."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from graphs import chain, random_dag

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.errors import PlanError
from partitioner.plan import PLAN_SCHEMA_VERSION, Plan
from partitioner.score import score_assignment
from partitioner.search.choose import choose
from partitioner.search.replicas import plan_replicas
from partitioner.search.threshold_search import STEP_TOLERANCE

G0, G1, G2 = "/GPU:0", "/GPU:1", "/GPU:2"


def _abc_plan(*, lower_bound_s: float | None = None, memory: str | int = "1GiB") -> Plan:
    """l0 -> l1 -> l2 (2, 4, 6 s on 1 GFLOP/s) cut after l1; l2 receives 2 MB at 1 MB/s."""
    graph = chain([2e9, 4e9, 6e9], param_bytes=[100, 200, 300], activation_bytes=[10, 20, 30], edge_bytes=[10**6, 2e6])
    cluster = pt.Cluster.uniform(3, memory=memory, flops_per_s=1e9, bandwidth=1e6)
    costs = CostModel(graph, cluster, num_microbatches=4)
    return score_assignment({"l0": G0, "l1": G0, "l2": G2}, costs, method="manual", lower_bound_s=lower_bound_s)


PLAN_NAMES = ["solve", "solve_cp_sat", "solve_dag", "exact_chain", *sorted(pt.baselines.BASELINES)]


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """One plan from every method, on the same small chain (and one DAG)."""
    graph = chain([3e9, 1e9, 2e9, 2e9, 5e9], param_bytes=[1024] * 5, edge_bytes=[4096] * 4)
    graph.graph["model_name"] = "toy chain"
    cluster = pt.Cluster.uniform(3, memory="64MiB", flops_per_s=1e12, bandwidth="10GB/s")
    dag = random_dag(random.Random(1), 12)
    made = {
        "solve": pt.solve(graph, cluster, num_microbatches=4, time_limit_s=10),
        "solve_cp_sat": pt.solve(
            graph,
            cluster,
            num_microbatches=4,
            time_limit_s=10,
            options=pt.SolverOptions(exact_chains=False, shortest_step=False),  # CP-SAT's own plan
        ),
        "solve_dag": pt.solve(dag, cluster, num_microbatches=2, time_limit_s=10),
        "exact_chain": pt.exact_chain(graph, cluster, num_microbatches=4),
    }
    for name, baseline in pt.baselines.BASELINES.items():
        made[name] = baseline(graph, cluster, num_microbatches=4)
    return made


@pytest.mark.parametrize("name", PLAN_NAMES)
def test_plan_json_round_trip(plans, name):
    plan = plans[name]
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.assignment == plan.assignment
    assert isinstance(again.devices, tuple)


def test_plan_json_round_trip_methods_and_statuses(plans):
    methods = {name: p.method for name, p in plans.items()}
    # a DAG's plan (CP-SAT's, or the exact DP's on its runs where that steps shorter) is refined on the
    # simulated step, unless no move shortens it
    dag_method = methods.pop("solve_dag").removesuffix(", then step refinement")
    assert dag_method in ("cp-sat", "exact_chain on runs (shorter step than cp-sat)")
    assert set(methods.values()) == {"exact_chain", "cp-sat", "uniform", "by_params", "by_time"}
    assert plans["solve"].method == "exact_chain"  # chains without pins take the exact DP
    assert plans["solve_cp_sat"].status == "optimal"
    assert plans["uniform"].status == "heuristic"
    assert plans["uniform"].lower_bound_s is None
    assert plans["solve"].model_name == "toy chain"


def test_plan_to_dict_has_schema_version_and_kind(plans):
    data = json.loads(plans["solve"].to_json())
    assert data["schema_version"] == PLAN_SCHEMA_VERSION
    assert data["kind"] == "plan"


def test_plan_equality_sees_the_assignment(plans):
    plan = plans["uniform"]
    other = dataclasses.replace(plan, assignment={**plan.assignment, "l0": G2})
    assert other != plan
    assert Plan.from_json(other.to_json()) != plan


def test_plan_from_json_not_json():
    with pytest.raises(PlanError, match=r"The plan is not valid JSON"):
        Plan.from_json("{'kind': 'plan'")


@pytest.mark.parametrize("text", ["[]", "42", '{"schema_version": 1}', '{"kind": "layer_graph", "schema_version": 1}'])
def test_plan_from_json_not_a_plan(text):
    with pytest.raises(PlanError, match=r"is not a plan \(expected a JSON object with kind='plan'\)"):
        Plan.from_json(text)


def test_plan_from_json_kind_missing(plans):
    data = plans["solve"].to_dict()
    del data["kind"]
    with pytest.raises(PlanError, match=r"is not a plan"):
        Plan.from_json(json.dumps(data))


def test_plan_from_json_future_schema_version(plans):
    data = plans["solve"].to_dict()
    data["schema_version"] = PLAN_SCHEMA_VERSION + 1
    with pytest.raises(PlanError, match=rf"schema_version {PLAN_SCHEMA_VERSION + 1}; this version reads up to"):
        Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("version", [None, 0, "1", 1.0])
def test_plan_from_json_bad_schema_version(plans, version):
    data = plans["solve"].to_dict()
    data["schema_version"] = version
    with pytest.raises(PlanError, match=r"no valid schema_version"):
        Plan.from_json(json.dumps(data))


def test_plan_from_json_missing_fields(plans):
    data = plans["solve"].to_dict()
    del data["assignment"]
    del data["bottleneck_s"]
    with pytest.raises(PlanError, match=r"corrupt: missing field\(s\) \['assignment', 'bottleneck_s'\]"):
        Plan.from_json(json.dumps(data))


def test_plan_from_json_model_name_is_optional(plans):
    data = plans["solve"].to_dict()
    del data["model_name"]
    assert Plan.from_json(json.dumps(data)).model_name is None


def test_plan_from_json_reads_plans_written_before_the_simulator(plans):
    data = plans["solve"].to_dict()
    del data["fill_drain_step_s"]  # plans saved before the field existed
    plan = Plan.from_json(json.dumps(data))
    assert plan.fill_drain_step_s is None
    assert plan.assignment == plans["solve"].assignment


def test_plan_from_json_ignores_unknown_fields(plans):
    data = plans["solve"].to_dict()
    data["comment"] = "from a newer minor version"
    assert Plan.from_json(json.dumps(data)) == plans["solve"]


@pytest.mark.parametrize(
    ("key", "value"), [("status", "great"), ("status", ["optimal"]), ("assignment", [["l0", G0]]), ("devices", 5)]
)
def test_plan_from_json_malformed_fields(plans, key, value):
    data = plans["solve"].to_dict()
    data[key] = value
    with pytest.raises(PlanError, match=r"corrupt"):
        Plan.from_json(json.dumps(data))


def test_score_assignment_bad_status():
    graph = chain([1e9])
    costs = CostModel(graph, pt.Cluster.uniform(1, memory="1GiB"))
    with pytest.raises(PlanError, match=r"status must be one of"):
        score_assignment({"l0": G0}, costs, method="manual", status="perfect")


# ----- derived views -----------------------------------------------------------------------------


def test_plan_stages_and_nodes_on():
    plan = _abc_plan()
    assert plan.devices == (G0, G1, G2)
    assert plan.stages == (G0, G2)  # G1 is unused
    assert plan.num_stages == 2
    assert plan.nodes_on(G0) == ["l0", "l1"]
    assert plan.nodes_on(G1) == []
    assert plan.nodes_on(G2) == ["l2"]


def test_plan_figures_by_hand():
    plan = _abc_plan()
    assert plan.stage_times == {G0: 6.0, G1: 0.0, G2: 10.0}  # 6 s compute, 2 MB in and its gradient out
    assert plan.bottleneck_s == 10.0
    # Simulated GPipe (forward is 1/3 of a layer with weights): stage 0 forwards end at 8 s, the last
    # activation arrives at 10 s, stage 1 runs 4 forwards (2 s) and 4 backwards (4 s) until 28 s, the
    # last gradient arrives at 30 s and stage 0's last backward ends at 34 s.
    assert plan.step_time_s == 34.0
    assert plan.fill_drain_step_s == (4 + 2 - 1) * 10.0  # the closed-form bound
    assert plan.serial_step_s == 4 * 12.0
    assert plan.transfer_bytes == 2 * 10**6
    assert plan.capacity_bytes == {G0: 2**30, G1: 2**30, G2: 2**30}


def test_plan_bubble_fraction():
    plan = _abc_plan()
    k, m = plan.num_stages, plan.num_microbatches
    assert plan.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
    assert plan.bubble_fraction == pytest.approx(1 / 5)


def test_plan_speedup():
    plan = _abc_plan()
    assert plan.speedup == pytest.approx(48.0 / 34.0)  # serial step / simulated step


def test_plan_gap():
    assert _abc_plan().gap is None
    assert _abc_plan(lower_bound_s=7.5).gap == pytest.approx(0.25)
    assert _abc_plan(lower_bound_s=10.0).gap == 0.0
    # A bound above the bottleneck is clipped to it: the plan proves itself optimal.
    plan = _abc_plan(lower_bound_s=11.0)
    assert plan.lower_bound_s == 10.0
    assert plan.gap == 0.0


def test_plan_gap_is_against_the_step_bound_where_the_step_was_minimised():
    plan = dataclasses.replace(_abc_plan(lower_bound_s=7.5), step_lower_bound_s=25.5)  # step 34
    assert plan.objective == "step"
    assert plan.gap == pytest.approx((34 - 25.5) / 34)
    assert dataclasses.replace(plan, step_lower_bound_s=None).gap == pytest.approx(0.25)  # the bottleneck's


def test_plan_objective_follows_what_the_planner_minimised(plans):
    # chains: the exact DP minimises the step; DAGs: CP-SAT the bottleneck, then (shortest_step) the step
    assert {name: plans[name].objective for name in ("solve", "solve_dag", "exact_chain")} == dict.fromkeys(
        ("solve", "solve_dag", "exact_chain"), "step"
    )
    assert plans["solve_cp_sat"].objective == "bottleneck"
    assert plans["uniform"].objective == "bottleneck" and plans["uniform"].gap is None
    for name in ("solve", "solve_dag", "exact_chain"):
        assert plans[name].step_lower_bound_s <= plans[name].step_time_s


def test_plan_without_a_step_bound_loads_from_older_files(plans):
    data = plans["solve"].to_dict()
    del data["step_lower_bound_s"]  # written before the field existed
    plan = Plan.from_dict(data)
    assert plan.step_lower_bound_s is None and plan.objective == "bottleneck"


def test_plan_fits_memory():
    assert _abc_plan().fits_memory
    # G0 holds l0 and l1: (100 + 200) * 5 + (4 + 1) * (10 + 20) = 1650 bytes (weights, gradient, the
    # micro-batch's gradient beside the sum, 2 Adam slots; 4 micro-batches' activations and one's gradients);
    # G2 holds l2, GPipe's last stage: 300 * 5 + (1 + 1) * 30 (one micro-batch's activations and their
    # gradients: its backward follows its forward), the gradient of the 2 MB it receives and a copy of the 2 MB
    # for each of G0's 4 micro-batches (one its forward keeps, 3 waiting for its forwards) = 10,001,560 bytes.
    assert _abc_plan().memory_bytes == {G0: 1650, G1: 0, G2: 10_001_560}
    assert _abc_plan(memory=10_001_560).fits_memory
    assert not _abc_plan(memory=10_001_559).fits_memory


def test_plan_exact_chain_gap_is_within_the_search_tolerance(plans):
    # The exact GPipe search proves its plan's step optimal to STEP_TOLERANCE; the gap is against its proof.
    plan = plans["exact_chain"]
    assert plan.status == "optimal" and plan.objective == "step"
    assert 0.0 <= plan.gap <= STEP_TOLERANCE


def test_every_planner_carries_the_step_overhead_beside_the_pipeline():
    """A profile's step_overhead_s (the step's own work, once per step whatever the plan), measured on a
    device of the cluster, is on every planner's plan and in predicted_step_s; the planners compare and
    bound the pipeline's step alone, so the plans, steps, bounds and statuses are those of the same graph
    without it."""
    graph = chain([3e9, 1e9, 2e9, 2e9, 5e9], param_bytes=[1024] * 5, edge_bytes=[4096] * 4)
    graph.graph.update(batch_size=8, num_microbatches=1)
    timed = graph.copy()
    timed.graph.update(step_overhead_s=0.5, profiled_device="/job:localhost/replica:0/task:0/device:GPU:0")
    cluster = pt.Cluster.uniform(3, memory="1MiB", flops_per_s=1e12, bandwidth="10GB/s")
    planners = {
        "solve": lambda g: pt.solve(g, cluster, num_microbatches=4, time_limit_s=10),
        "cp-sat": lambda g: pt.solve(
            g, cluster, num_microbatches=4, time_limit_s=10, options=pt.SolverOptions(exact_chains=False)
        ),
        "exact_chain": lambda g: pt.exact_chain(g, cluster, num_microbatches=4),
        "choose": lambda g: choose(g, cluster, batch_size=8, num_microbatches="auto").plan,
        "replicas": lambda g: plan_replicas(g, cluster, batch_size=8, replicas=2, num_microbatches=1).plan,
        **{
            name: (lambda g, baseline=baseline: baseline(g, cluster, num_microbatches=4))
            for name, baseline in pt.baselines.BASELINES.items()
        },
    }
    for name, planner in planners.items():
        plain, with_overhead = planner(graph), planner(timed)
        assert plain.step_overhead_s == 0.0 and plain.predicted_step_s == plain.step_time_s, name
        assert with_overhead.step_overhead_s == 0.5, name
        assert with_overhead.predicted_step_s == pytest.approx(with_overhead.step_time_s + 0.5), name
        compared = ("assignment", "step_time_s", "step_lower_bound_s", "status", "num_microbatches")
        assert [getattr(with_overhead, k) for k in compared] == [getattr(plain, k) for k in compared], name
    # measured on a device this cluster does not have: the step's own work there is not known, not counted
    elsewhere = timed.copy()
    elsewhere.graph["profiled_device"] = "/device:CPU:0"
    assert pt.solve(elsewhere, cluster, num_microbatches=4, time_limit_s=10).step_overhead_s == 0.0
    assert Plan.from_json(with_overhead.to_json()) == with_overhead
    older = json.loads(with_overhead.to_json())
    del older["step_overhead_s"]  # a file written before the field: no overhead
    assert Plan.from_dict(older).step_overhead_s == 0.0
