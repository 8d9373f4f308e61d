"""partitioner.Problem: the planning problem validated once, and the keyword front doors as thin adapters of it."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import networkx as nx
import pytest
from graphs import KIB, chain, diamond, random_dag

import partitioner as pt
import partitioner.problem
from partitioner.cost import CostModel
from partitioner.errors import GraphError, InputError
from partitioner.problem import Problem
from partitioner.search import baselines
from partitioner.search.chain import exact_chain, exact_chain_for
from partitioner.search.solve import solve, solve_problem


def _cluster(num_devices: int = 2) -> pt.Cluster:
    return pt.Cluster.uniform(num_devices, memory="1GiB", flops_per_s=1e12, bandwidth="10GB/s")


def _chain() -> nx.DiGraph:
    return chain([1e12, 2e12, 1e12, 3e12], param_bytes=[KIB] * 4, activation_bytes=[KIB] * 4, edge_bytes=[1000] * 3)


# (keyword, bad value, error class, message): each keyword door raised these before the Problem; it still does.
BAD = [
    ("num_microbatches", 0, InputError, r"num_microbatches must be an integer >= 1\. Received: 0\."),
    ("num_microbatches", True, InputError, r"num_microbatches must be an integer >= 1\. Received: True\."),
    ("num_microbatches", 2.0, InputError, r"num_microbatches must be an integer >= 1\. Received: 2\.0\."),
    ("optimizer_slots", -1, InputError, r"optimizer_slots must be an integer >= 0 \(2 for Adam, 0 for SGD\)"),
    ("cost", "wallclock", InputError, r"cost must be one of \('flops', 'time'\)\. Received: 'wallclock'\."),
    ("schedule", "zb", InputError, r"schedule must be one of \('gpipe', '1f1b'\)\. Received: 'zb'\."),
    ("recompute", "sometimes", InputError, r"recompute must be one of \('never', 'always', 'auto'\)"),
]
DOORS = {
    "Problem": Problem,
    "CostModel": CostModel,
    "solve": solve,
    "exact_chain": exact_chain,
    "uniform": baselines.uniform,
    "by_params": baselines.by_params,
    "by_time": baselines.by_time,
}


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize(("keyword", "value", "kind", "message"), BAD)
def test_problem_bad_input_is_the_same_one_line_error_at_every_door(door, keyword, value, kind, message):
    with pytest.raises(kind, match=message) as raised:
        DOORS[door](_chain(), _cluster(), **{keyword: value})
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("door", DOORS)
def test_problem_bad_graph_is_a_graph_error_at_every_door(door):
    with pytest.raises(GraphError, match=r"Expected a networkx\.DiGraph layer graph\. Received: list"):
        DOORS[door]([1, 2], _cluster())


def test_problem_validates_once(monkeypatch):
    """The graph is checked when the Problem is built, not again by the cost model made from it."""
    calls = []
    check = partitioner.problem.validate_graph
    monkeypatch.setattr(partitioner.problem, "validate_graph", lambda graph: calls.append(graph) or check(graph))
    problem = Problem(_chain(), _cluster(), num_microbatches=4)
    assert len(calls) == 1
    costs = CostModel.from_problem(problem)
    assert len(calls) == 1
    assert costs.problem is problem
    CostModel(problem.graph, problem.cluster, num_microbatches=4)  # the keyword door builds (and checks) one
    assert len(calls) == 2


def test_problem_is_frozen_and_replace_validates():
    problem = Problem(_chain(), _cluster())
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.num_microbatches = 4  # type: ignore[misc]
    with pytest.raises(InputError, match="num_microbatches must be an integer >= 1"):
        dataclasses.replace(problem, num_microbatches=0)


def test_costmodel_from_problem_refuses_anything_else():
    with pytest.raises(InputError, match=r"Expected a partitioner\.Problem\. Received: DiGraph"):
        CostModel.from_problem(_chain())  # type: ignore[arg-type]


def test_costmodel_problem_holds_the_keywords():
    graph, cluster = _chain(), _cluster()
    costs = CostModel(
        graph, cluster, num_microbatches=3, optimizer_slots=1, cost="flops", schedule="1f1b", recompute="auto"
    )
    assert costs.problem == Problem(
        graph, cluster, num_microbatches=3, optimizer_slots=1, cost="flops", schedule="1f1b", recompute="auto"
    )
    assert (costs.num_microbatches, costs.optimizer_slots, costs.schedule, costs.recompute) == (3, 1, "1f1b", "auto")
    moved = costs.on(cluster.take(1)).with_recompute("always")
    assert moved.problem == dataclasses.replace(costs.problem, cluster=cluster.take(1), recompute="always")


def _equal(a: pt.Plan, b: pt.Plan) -> bool:
    """Equal plans up to the wall-clock time they took."""
    return dataclasses.replace(a, solve_time_s=0.0) == dataclasses.replace(b, solve_time_s=0.0)


SETTINGS = [
    {"num_microbatches": 1},
    {"num_microbatches": 4, "schedule": "1f1b", "optimizer_slots": 0},
    {"num_microbatches": 4, "recompute": "always"},
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("graph", ["chain", "diamond", "dag"])
def test_solve_with_keywords_and_with_a_problem_give_equal_plans(graph, settings):
    layers = {"chain": _chain(), "diamond": diamond(), "dag": random_dag(random.Random(3), 8)}[graph]
    cluster = _cluster(2)
    by_keywords = solve(layers, cluster, time_limit_s=10, **settings)
    by_problem = solve_problem(Problem(layers, cluster, **settings), time_limit_s=10)
    assert by_problem.num_microbatches == settings["num_microbatches"]
    assert _equal(by_keywords, by_problem), (by_keywords, by_problem)


@pytest.mark.parametrize("settings", SETTINGS)
def test_exact_chain_and_baselines_with_keywords_and_with_a_problem_give_equal_plans(settings):
    graph, cluster = _chain(), _cluster(2)
    costs = CostModel.from_problem(Problem(graph, cluster, **settings))
    assert _equal(exact_chain(graph, cluster, **settings), exact_chain_for(costs))
    for name, baseline in baselines.BASELINES.items():
        assert _equal(baseline(graph, cluster, **settings), baselines.split_with(costs, name))


def test_problem_sits_below_the_cost_model():
    """The floors: cost.py builds its Problem; problem.py imports no pricing and no planner."""
    source = Path(partitioner.problem.__file__).read_text()
    assert "from partitioner.problem import" in Path(partitioner.cost.__file__).read_text()
    for upper in ("partitioner.cost", "partitioner.search", "partitioner.show", "partitioner.plan"):
        assert f"from {upper}" not in source and f"import {upper}" not in source
