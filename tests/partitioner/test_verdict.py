"""A plan's verdict: a bound called proven holds for every plan the search could return.

The default search solves several pipeline orders (``SolverOptions.device_order="search"``) and keeps one
plan; each order's CP-SAT bound holds for the plans of that order only. The status and ``lower_bound_s`` of
what it returns must hold over every order it could have returned a plan in (issue 20's repro: every node on
the fast device, "optimal" with a bound of 4.257 ms, while a legal plan in the other order has a bottleneck of
3.800 ms).
"""

from __future__ import annotations

import ast
import itertools
import random
import time
from pathlib import Path

import networkx as nx
import pytest
from graphs import KIB, brute_force, dag_problems, memory_need, random_dag
from hypothesis import HealthCheck, given, settings

import partitioner as pt
from partitioner.cluster import reorder
from partitioner.cost import CostModel
from partitioner.graph import load_graph, topological_order
from partitioner.score import shorter_step
from partitioner.search import exhaustive, multilevel
from partitioner.search import solve as solve_module
from partitioner.simulate import simulate_assignment
from partitioner.synthetic import random_block_dag
from partitioner.validate import validate_plan
from partitioner.verdict import TOLERANCE, least_bound, on_bottleneck, on_step, verdict

DATA = Path(__file__).parent / "data"
RESOLUTION = 1e-4  # CP-SAT's time unit, as in test_solver
# the least bottleneck, pipeline orders searched (chains too: the exact chain DP minimises the step)
BOTTLENECK = pt.SolverOptions(shortest_step=False, exact_chains=False)


def _best_over_orders(graph, cluster: pt.Cluster, **kwargs: object) -> float | None:
    """The least bottleneck over every legal placement in every pipeline order of the cluster."""
    found = []
    for order in itertools.permutations(range(cluster.num_devices)):
        best = brute_force(graph, reorder(cluster, order), **kwargs)
        if best is not None:
            found.append(best)
    return min(found, default=None)


def test_the_bound_of_a_searched_plan_holds_in_every_order() -> None:
    graph = load_graph(DATA / "hetero-dag-20.json")
    cluster = pt.Cluster.from_json(DATA / "hetero-dag-20-cluster.json")
    plan = pt.solve(graph, cluster, num_microbatches=4, optimizer_slots=2, options=BOTTLENECK)
    first = set(topological_order(graph)[:3])
    other = {v: ("gpu1" if v in first else "gpu0") for v in graph}  # the slow device runs the first three
    rival = CostModel(graph, cluster, num_microbatches=4, optimizer_slots=2)
    evaluation = rival.evaluate(other)
    assert rival.fits(evaluation)
    assert evaluation.bottleneck_s == pytest.approx(3.800e-3, rel=1e-3)
    assert plan.lower_bound_s is not None
    assert plan.lower_bound_s <= evaluation.bottleneck_s  # 4.257 ms before the fix
    assert plan.bottleneck_s <= evaluation.bottleneck_s * (1 + RESOLUTION)  # the least bottleneck is what it minimises


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problem=dag_problems(max_nodes=6, max_devices=3, max_shared=1))
def test_a_searched_plan_is_optimal_only_where_no_order_beats_it(problem) -> None:
    graph, cluster, num_microbatches = problem
    best = _best_over_orders(graph, cluster, num_microbatches=num_microbatches)
    if best is None:
        return
    try:
        plan = pt.solve(graph, cluster, num_microbatches=num_microbatches, options=BOTTLENECK, time_limit_s=10)
    except pt.InfeasiblePlanError:
        pytest.fail(f"a legal plan of bottleneck {best} exists")
    assert plan.objective == "bottleneck"
    if plan.lower_bound_s is not None:
        assert plan.lower_bound_s <= best * (1 + RESOLUTION)
    if plan.status == "optimal":
        assert plan.bottleneck_s == pytest.approx(best, rel=RESOLUTION)


# ----- the rule (partitioner.verdict) -----------------------------------------------------------------


def test_verdict_meets_the_bound_within_the_tolerance() -> None:
    assert verdict(1.0, 1.0 / (1 + TOLERANCE / 2)) == ("optimal", 1.0 / (1 + TOLERANCE / 2))
    assert verdict(1.0, 1.0 / (1 + 2 * TOLERANCE))[0] == "feasible"


def test_verdict_caps_the_bound_at_the_value() -> None:
    assert verdict(1.0, 1.5) == ("optimal", 1.0)


def test_verdict_proven_is_optimal_whatever_the_bound() -> None:
    assert verdict(2.0, 1.0, proven=True) == ("optimal", 1.0)
    assert verdict(2.0, None, proven=True) == ("optimal", None)


def test_verdict_without_a_bound_is_heuristic() -> None:
    assert verdict(2.0, None) == ("heuristic", None)


def test_verdict_of_a_plan_no_search_found_is_heuristic_unless_it_meets_the_bound() -> None:
    assert verdict(2.0, 1.0, searched=False) == ("heuristic", 1.0)
    assert verdict(2.0, 2.0, searched=False) == ("optimal", 2.0)


def test_least_bound_is_unknown_when_one_part_is() -> None:
    assert least_bound([3.0, 1.0, 2.0]) == 1.0
    assert least_bound([3.0, None]) is None
    assert least_bound([]) is None


def test_on_step_and_on_bottleneck_set_the_objectives_bound() -> None:
    costs = CostModel(pt.chain_graph([1e12] * 2), pt.Cluster.uniform(2, memory="1GiB", flops_per_s=1e12))
    plan = pt.baselines.uniform(costs.graph, costs.cluster)
    stepped = on_step(plan, plan.step_time_s / 2)
    assert (stepped.status, stepped.objective, stepped.gap) == ("feasible", "step", pytest.approx(0.5))
    judged = on_bottleneck(plan, plan.bottleneck_s)
    assert (judged.status, judged.objective, judged.gap) == ("optimal", "bottleneck", 0.0)


def _statuses_set(path: Path) -> list[int]:
    """Lines of ``path`` where the constant "optimal" is written other than in a docstring, a comparison
    (reading a status) or plan.py's list of the statuses."""
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            allowed |= {id(n) for n in ast.walk(node)}
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            allowed.add(id(node.body[0].value))  # type: ignore[attr-defined]
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "STATUSES" for t in node.targets):
            allowed |= {id(n) for n in ast.walk(node)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == "optimal" and id(node) not in allowed
    ]


def test_only_the_verdict_module_says_optimal() -> None:
    root = Path(pt.__file__).parent
    found = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if path.name != "verdict.py" and (lines := _statuses_set(path))
    }
    assert found == {}  # a status is decided by partitioner.verdict.verdict alone
    assert _statuses_set(root / "verdict.py")  # the check sees the one place that does


# ----- a bound that knows which splits fit (partitioner.search.exhaustive) ------------------------------


def _tight_problem(seed: int) -> tuple[nx.DiGraph, pt.Cluster, int]:
    """A random DAG of 5-7 layers on 2 devices (3 for 5 layers) of mixed speeds, each holding 45-80% of
    what the whole graph needs: memory, not compute, decides the best split."""
    rng = random.Random(seed)
    num_nodes = rng.randint(5, 7)
    num_devices = 3 if num_nodes == 5 else 2
    num_microbatches = rng.choice([1, 4])
    graph = random_dag(rng, num_nodes, skip_prob=0.3)
    need = memory_need(graph, num_microbatches, num_devices=num_devices)
    devices = [
        pt.Device(
            f"/GPU:{k}",
            memory=max(1, round(rng.uniform(0.45, 0.8) * need / KIB)) * KIB,
            flops_per_s=rng.choice([50e12, 100e12, 200e12]),
        )
        for k in range(num_devices)
    ]
    return graph, pt.Cluster(devices, bandwidth=50e9), num_microbatches


def _least_step(graph: nx.DiGraph, cluster: pt.Cluster, num_microbatches: int) -> float | None:
    """The shortest simulated step of every legal plan, by brute force: every labeling of the nodes with
    devices whose edges go forward, in every order of the devices, that fits."""
    least = None
    for order in itertools.permutations(range(cluster.num_devices)):
        listed = reorder(cluster, order)
        costs = CostModel(graph, listed, num_microbatches=num_microbatches)
        for labels in itertools.product(range(cluster.num_devices), repeat=len(costs.order)):
            where = dict(zip(costs.order, labels, strict=True))
            if any(where[u] > where[v] for u, v in graph.edges):
                continue
            assignment = {v: listed.names[k] for v, k in where.items()}
            evaluation = costs.evaluate(assignment)
            if costs.fits(evaluation):
                step = simulate_assignment(costs, assignment, recompute=evaluation.recompute).step_time_s
                least = step if least is None else min(least, step)
    return least


TIGHT_SEEDS = (1, 0, 4, 5, 8, 9, 10, 11, 12, 13, 14, 17)  # problems that fit, each "feasible" with a gap before


@pytest.mark.parametrize("seed", TIGHT_SEEDS)
def test_a_plan_equal_to_the_best_legal_one_is_optimal_on_a_memory_tight_dag(seed: int) -> None:
    graph, cluster, num_microbatches = _tight_problem(seed)
    least = _least_step(graph, cluster, num_microbatches)
    assert least is not None
    plan = pt.solve(graph, cluster, num_microbatches=num_microbatches)
    assert plan.step_time_s == pytest.approx(least, rel=1e-9)
    assert (plan.objective, plan.status, plan.gap) == ("step", "optimal", 0.0)


def test_without_the_enumeration_the_memory_blind_bound_proves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exhaustive, "MAX_PLANS", 0)  # too many legal plans to enumerate
    graph, cluster, num_microbatches = _tight_problem(TIGHT_SEEDS[0])
    plan = pt.solve(graph, cluster, num_microbatches=num_microbatches)
    assert plan.step_time_s == pytest.approx(_least_step(graph, cluster, num_microbatches), rel=1e-9)
    assert plan.status == "feasible"  # the optimum, but nothing proves it
    assert plan.gap > 0.05


def test_a_plan_above_the_best_legal_one_gives_way_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # test_coarsen's fall-back: nothing found on the coarse units, and the fine model without a start
    # finds a plan whose step the enumeration beats: solve returns the enumeration's, optimal
    monkeypatch.setattr(multilevel, "_place_units", lambda *args, **kwargs: None)
    graph = random_dag(random.Random(4), 14, skip_prob=0.5)
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12, bandwidth="10GB/s")
    options = pt.SolverOptions(coarsen=True, device_order="given", hint=False)
    searched = solve_module._search(
        CostModel(graph, cluster), {}, options, started=time.perf_counter(), time_limit_s=10.0
    )
    plan = pt.solve(graph, cluster, time_limit_s=10, options=options)
    costs = CostModel(graph, cluster)
    best = exhaustive.least_plan(costs, {}, objective="step", device_order="given", deadline=float("inf"))
    assert best is not None and shorter_step(best, searched)  # the search alone stops above the best
    assert (plan.objective, plan.status, plan.gap) == ("step", "optimal", 0.0)
    assert plan.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)
    assert plan.assignment == best.assignment and "better than" in plan.method
    validate_plan(plan, graph, cluster)


def test_the_enumeration_gives_up_past_its_deadline_or_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    graph, cluster, num_microbatches = _tight_problem(TIGHT_SEEDS[0])
    costs = CostModel(graph, cluster, num_microbatches=num_microbatches)
    assert exhaustive.least_plan(costs, {}, objective="step", device_order="search", deadline=0.0) is None
    monkeypatch.setattr(exhaustive, "MAX_PLANS", 3)
    assert exhaustive.least_plan(costs, {}, objective="step", device_order="search", deadline=float("inf")) is None


def test_cp_sat_proof_on_interchangeable_devices_holds_in_every_order():
    # 4 identical devices: every pipeline order has one signature, so the one order CP-SAT solves is every
    # order and its proof stands. The order search judged it by the memory-blind bound (on more than
    # EVERY_ORDER_UP_TO devices), so a proven plan read "feasible" with a gap (here 4.8%; ResNet50 on 8 H100s
    # 25.7%, benchmarks/planner_quality).
    graph = random_block_dag(40, seed=0)  # more than exhaustive.MAX_ENUMERATED_NODES: CP-SAT's own bound
    assert len(graph) > exhaustive.MAX_ENUMERATED_NODES
    cluster = pt.Cluster.uniform(4, memory="1GiB", flops_per_s=1e12, bandwidth="100GB/s")
    options = pt.SolverOptions(exact_chains=False, shortest_step=False)
    plan = pt.solve(graph, cluster, num_microbatches=4, time_limit_s=10, options=options)
    assert (plan.method, plan.status) == ("cp-sat", "optimal")
    assert plan.gap < 1e-4  # CP-SAT's bound, rounded down to its time unit


def test_a_step_plans_bound_on_the_bottleneck_holds_in_every_order():
    # Found by test_solve_gives_a_valid_plan_or_says_why_not_on_random_dags: the shortest step came from a
    # pipeline order whose CP-SAT bound was above another order's, and the plan kept its own order's bound as its
    # lower bound on the bottleneck of every plan. Over orders, the bound is the least of the orders' bounds.
    # The graph and devices are what hypothesis shrank that bug to (stop 35; with the bug the plan's bound is
    # 0.040 s, the least bottleneck 0.038 s): the graph this test had before stopped showing it once received
    # copies were priced (every plan fitted one device only).
    graph = load_graph(DATA / "order-bound-dag-3.json")
    devices = [
        pt.Device("/GPU:0", memory_bytes=2818048, flops_per_s=1e12),
        pt.Device("/GPU:1", memory_bytes=2818048, flops_per_s=1e12),
        pt.Device("/GPU:2", memory_bytes=2818048, flops_per_s=2e12),
    ]
    cluster = pt.Cluster(devices, bandwidth=1e9)
    plan = pt.solve(graph, cluster, num_microbatches=1, time_limit_s=10)
    least = pt.solve(graph, cluster, num_microbatches=1, time_limit_s=10, options=pt.SolverOptions(shortest_step=False))
    assert least.status == "optimal"  # the least bottleneck of every plan, proven over every order
    assert plan.lower_bound_s <= least.bottleneck_s * (1 + TOLERANCE)
    assert plan.lower_bound_s <= plan.bottleneck_s
