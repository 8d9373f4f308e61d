"""Schedules as data: printing and parsing, validation messages, the global order and activations in flight."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from graphs import KIB, chain
from hypothesis import given, settings
from hypothesis import strategies as st

import partitioner as pt
from partitioner.cost import CostModel, in_flight
from partitioner.errors import InfeasiblePlanError, InputError, ScheduleError
from partitioner.schedule import ACTION_KINDS, SCHEDULES, Action, Schedule
from partitioner.simulate import chain_step

SMALL = {"num_stages": st.integers(1, 4), "num_microbatches": st.integers(1, 8)}

GPIPE_2_4 = """\
# gpipe K=2 M=4
0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"""

ONE_F_ONE_B_2_4 = """\
# 1f1b K=2 M=4
0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"""

# Stage 0 waits for 1B0 before sending 0F1; stage 1 waits for 0F1 before running 1B0.
DEADLOCK = """\
0: 0F0 0B0 0F1 0B1
1: 1F0 1F1 1B0 1B1"""


# ----- actions -------------------------------------------------------------------------------------


def test_action_prints_and_parses_in_torch_notation():
    assert str(Action(1, "F", 3)) == "1F3"
    assert Action.parse("1F3") == Action(1, "F", 3)
    assert Action.parse(" 12B40 ") == Action(12, "B", 40)
    assert ACTION_KINDS == ("F", "B", "W", "R")
    assert all(Action.parse(str(Action(2, kind, 5))) == Action(2, kind, 5) for kind in ACTION_KINDS)


@pytest.mark.parametrize("text", ["", "F3", "1F", "1X3", "-1F3", "1 F 3", "1F3 0B2", "stage1"])
def test_action_parse_refuses_other_text(text):
    with pytest.raises(ScheduleError, match=rf"Cannot read {text!r} as an action: expected <stage><kind><micro-batch>"):
        Action.parse(text)


def test_action_refuses_bad_fields():
    with pytest.raises(ScheduleError, match=r"kind in \('F', 'B', 'W', 'R'\).*Received: stage=0, kind='X'"):
        Action(0, "X", 0)
    with pytest.raises(ScheduleError, match=r"Received: stage=-1"):
        Action(-1, "F", 0)


def test_action_needs_its_inputs():
    assert Action(0, "F", 2).needs(3) == ()
    assert Action(2, "F", 2).needs(3) == (Action(1, "F", 2),)
    assert Action(1, "B", 2).needs(3) == (Action(1, "F", 2), Action(2, "B", 2))
    assert Action(2, "B", 2).needs(3) == (Action(2, "F", 2),)


# ----- generators and text -------------------------------------------------------------------------


def test_gpipe_and_1f1b_orders_for_two_stages_and_four_microbatches():
    assert str(Schedule.gpipe(2, 4)) == GPIPE_2_4
    assert str(Schedule.one_f_one_b(2, 4)) == ONE_F_ONE_B_2_4
    assert Schedule.parse(GPIPE_2_4) == Schedule.make("gpipe", 2, 4)
    assert Schedule.parse(ONE_F_ONE_B_2_4) == Schedule.make("1f1b", 2, 4)


@pytest.mark.parametrize("name", SCHEDULES)
@given(**SMALL)
@settings(max_examples=40, deadline=None)
def test_schedule_print_parse_round_trip(name, num_stages, num_microbatches):
    schedule = Schedule.make(name, num_stages, num_microbatches)
    assert Schedule.parse(str(schedule)) == schedule
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches) == (name, num_stages, num_microbatches)
    assert len(schedule.actions) == num_stages
    assert all(len(row) == 2 * num_microbatches for row in schedule.actions)


@given(**SMALL)
@settings(max_examples=40, deadline=None)
def test_1f1b_warms_up_then_alternates(num_stages, num_microbatches):
    for s, row in enumerate(Schedule.one_f_one_b(num_stages, num_microbatches).actions):
        warmup = min(num_stages - s - 1, num_microbatches)
        assert [a.kind for a in row[:warmup]] == ["F"] * warmup
        assert [a.microbatch for a in row if a.kind == "F"] == list(range(num_microbatches))
        assert [a.microbatch for a in row if a.kind == "B"] == list(range(num_microbatches))


def test_parse_without_header_is_custom_and_counts_stages_and_microbatches():
    schedule = Schedule.parse("0F0, 0F1, 0B0, 0B1\n\n# a comment\n1F0 1B0 1F1 1B1\n")
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches) == ("custom", 2, 2)
    assert schedule.actions[1] == (Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1))
    assert Schedule.parse(str(schedule)) == schedule
    assert str(schedule).splitlines()[0] == "# custom K=2 M=2"


def test_parse_refuses_bad_text_by_line():
    with pytest.raises(ScheduleError, match=r"Line 2: Cannot read '1Q0' as an action"):
        Schedule.parse("0: 0F0 0B0\n1: 1Q0")
    with pytest.raises(ScheduleError, match=r"Line 1 '# gpipe 2 2' is not a schedule header"):
        Schedule.parse("# gpipe 2 2\n0: 0F0 0B0")
    with pytest.raises(ScheduleError, match=r"Line 2 is labelled stage '0' but is row 1"):
        Schedule.parse("0: 0F0 0B0\n0: 1F0 1B0")


def test_make_refuses_unknown_names_and_counts():
    with pytest.raises(InputError, match=r"schedule must be one of \('gpipe', '1f1b'\)\. Received: 'interleaved'"):
        Schedule.make("interleaved", 2, 4)
    with pytest.raises(InputError, match=r"num_microbatches must be an integer >= 1. Received: 0"):
        Schedule.gpipe(2, 0)
    with pytest.raises(InputError, match=r"num_stages must be an integer >= 1. Received: True"):
        Schedule.one_f_one_b(True, 2)


# ----- validation ----------------------------------------------------------------------------------


def test_deadlocking_schedule_is_refused_with_its_grid():
    with pytest.raises(ScheduleError) as caught:
        Schedule.parse(DEADLOCK)
    message = str(caught.value)
    assert message.startswith(
        "The schedule deadlocks after 2 tick(s): stage 0 waits to run 0B0, which needs 1B0; "
        "stage 1 waits to run 1F1, which needs 0F1."
    )
    grid = message.splitlines()[1:]
    assert grid == [
        "  stage  0    1    2    3    4",
        ">     0  0F0       0B0  0F1  0B1",
        ">     1       1F0  1F1  1B0  1B1",
    ]


def test_backward_before_its_forward_is_refused():
    with pytest.raises(ScheduleError, match=r"Stage 1: runs 1B0 before 1F0; a backward needs its own forward first"):
        Schedule.parse("0: 0F0 0B0\n1: 1B0 1F0")
    with pytest.raises(ScheduleError, match=r"(?s)\n      0  0F0  0B0\n>     1  1B0  1F0$"):  # the failing row marked
        Schedule.parse("0: 0F0 0B0\n1: 1B0 1F0")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# custom K=1 M=2\n0: 0F0 0F1 0B1", r"Stage 0: never runs 0B0; each stage runs the forward and the backward"),
        ("0: 0F0 0F0 0B0", r"Stage 0: 0F0 appears twice"),
        ("0: 0F0 1B0", r"Stage 0: its row holds 1B0, an action of stage 1"),
        ("0: 0F0 0W0 0B0", r"Stage 0: 0W0 is a weight gradient \('W'\), which this version reserves but cannot run"),
        ("# custom K=1 M=1\n0: 0F0 0B0 0F1 0B1", r"Stage 0: 0F1 names micro-batch 1 but M=1"),
        ("# custom K=3 M=1\n0: 0F0 0B0\n1: 1F0 1B0", r"The schedule is for K=3 stages but has 2 row\(s\)"),
        ("0: 0B1 0F0 0F1 0B0", r"Stage 0: runs 0B1 before 0F1"),
        ("0:", r"num_microbatches must be an integer >= 1. Received: 0"),
        ("# fancy K=1 M=1\n0: 0F0 0B0", r"A schedule's name must be one of \('gpipe', '1f1b', 'custom'\)"),
    ],
)
def test_malformed_schedules_are_refused_by_message(text, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule.parse(text)


def test_a_named_schedule_must_hold_its_order():
    text = ONE_F_ONE_B_2_4.replace("# 1f1b", "# gpipe")
    with pytest.raises(
        ScheduleError,
        match=r"named 'gpipe' must run the gpipe order, but stage 0 runs 0B0 0F2 0B1 \.\.\. from step 2, "
        r"where gpipe runs 0F2 0F3 0B0 \.\.\.\. Name it 'custom'",
    ):
        Schedule.parse(text)
    assert Schedule.parse(ONE_F_ONE_B_2_4.replace("# 1f1b", "# custom")).name == "custom"


def test_schedule_rows_become_tuples_and_refuse_other_items():
    rows = [[Action(0, "F", 0), Action(0, "B", 0)]]
    schedule = Schedule("custom", 1, 1, rows)  # type: ignore[arg-type]
    assert schedule.actions == ((Action(0, "F", 0), Action(0, "B", 0)),)
    assert hash(schedule) == hash(Schedule.parse("0: 0F0 0B0"))
    with pytest.raises(ScheduleError, match=r"one sequence of Action objects per stage"):
        Schedule("custom", 1, 1, (("0F0", "0B0"),))  # type: ignore[arg-type]


# ----- global order and memory ---------------------------------------------------------------------


def _check_global_order(schedule: Schedule) -> None:
    order = schedule.global_order()
    position = {a: i for i, a in enumerate(order)}
    assert len(position) == len(order) == sum(len(row) for row in schedule.actions)
    for row in schedule.actions:  # each stage's own order is kept
        assert [position[a] for a in row] == sorted(position[a] for a in row)
    for a in order:  # and every action comes after what it needs
        assert all(position[need] < position[a] for need in a.needs(schedule.num_stages))


@pytest.mark.parametrize("name", SCHEDULES)
@given(**SMALL)
@settings(max_examples=40, deadline=None)
def test_global_order_respects_stage_order_and_dependencies(name, num_stages, num_microbatches):
    _check_global_order(Schedule.make(name, num_stages, num_microbatches))


def test_global_order_interleaves_stages_in_time():
    assert [str(a) for a in Schedule.gpipe(2, 2).global_order()] == [
        "0F0", "0F1", "1F0", "1B0", "0B0", "1F1", "1B1", "0B1"
    ]  # fmt: skip
    assert [str(a) for a in Schedule.one_f_one_b(2, 4).global_order()][:6] == ["0F0", "0F1", "1F0", "1B0", "0B0", "1F1"]
    custom = Schedule.parse("0: 0F0 0F1 0B1 0B0\n1: 1F0 1B0 1F1 1B1")  # valid, though neither gpipe nor 1f1b
    _check_global_order(custom)


def test_grid_draws_one_column_per_tick():
    assert Schedule.one_f_one_b(2, 4).grid().splitlines() == [
        "  stage  0    1    2    3    4    5    6    7    8    9",
        "      0  0F0  0F1       0B0  0F2  0B1  0F3  0B2       0B3",
        "      1       1F0  1B0  1F1  1B1  1F2  1B2  1F3  1B3",
    ]


@given(**SMALL)
@settings(max_examples=40, deadline=None)
def test_max_in_flight_gpipe_holds_every_microbatch_1f1b_at_most_k_minus_s(num_stages, num_microbatches):
    gpipe = Schedule.gpipe(num_stages, num_microbatches)
    one_f_one_b = Schedule.one_f_one_b(num_stages, num_microbatches)
    for s in range(num_stages):
        # GPipe's last stage runs each backward right after its forward
        assert gpipe.max_in_flight(s) == (num_microbatches if s < num_stages - 1 else 1)
        assert one_f_one_b.max_in_flight(s) == min(num_stages - s, num_microbatches)


def test_max_in_flight_refuses_unknown_stages():
    with pytest.raises(InputError, match=r"stage must be an integer in 0..1. Received: 2"):
        Schedule.gpipe(2, 2).max_in_flight(2)


# ----- the simulator, the cost model and plans follow the schedule ---------------------------------


def _pipeline(num_stages: int, num_microbatches: int, *, schedule: str = "gpipe"):
    """One layer per device, activations much larger than weights: memory is the activations held."""
    graph = chain(
        [3e12] * num_stages,
        param_bytes=[KIB] * num_stages,
        activation_bytes=[64 * KIB] * num_stages,
        edge_bytes=[KIB] * (num_stages - 1),
    )
    cluster = pt.Cluster.uniform(num_stages, memory="1GiB", flops_per_s=1e12, bandwidth=1e9)
    costs = CostModel(graph, cluster, num_microbatches=num_microbatches, schedule=schedule)
    plan = pt.score_assignment({f"l{i}": f"/GPU:{i}" for i in range(num_stages)}, costs, method="manual")
    return plan, graph, cluster


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(1, 1), (2, 4), (3, 2), (4, 8)])
def test_simulator_given_a_schedule_equals_simulator_given_its_name(name, num_stages, num_microbatches):
    plan, graph, cluster = _pipeline(num_stages, num_microbatches)
    by_name = pt.simulate(plan, graph, cluster, schedule=name)
    by_object = pt.simulate(plan, graph, cluster, schedule=Schedule.make(name, num_stages, num_microbatches))
    assert by_object == by_name
    assert by_object.timeline == by_name.timeline
    for s, row in enumerate(Schedule.make(name, num_stages, num_microbatches).actions):  # the device runs its row
        spans = by_name.actions_on(f"/GPU:{s}")
        assert [f"{s}{'F' if a.kind == 'forward' else 'B'}{a.microbatch}" for a in spans] == [str(a) for a in row]


def test_simulator_replays_a_custom_schedule():
    plan, graph, cluster = _pipeline(2, 2)
    custom = Schedule.parse("0: 0F0 0F1 0B1 0B0\n1: 1F0 1B0 1F1 1B1")
    sim = pt.simulate(plan, graph, cluster, schedule=custom)
    assert sim.schedule == "custom"
    assert [(a.kind, a.microbatch) for a in sim.actions_on("/GPU:1")] == [
        ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)
    ]  # fmt: skip
    assert sim.peak_in_flight == {"/GPU:0": 2, "/GPU:1": 1}


def test_simulator_refuses_a_schedule_for_another_pipeline():
    plan, graph, cluster = _pipeline(2, 4)
    with pytest.raises(InputError, match=r"The schedule is for K=3 stages and M=4 micro-batches, but the plan has K=2"):
        pt.simulate(plan, graph, cluster, schedule=Schedule.one_f_one_b(3, 4))
    with pytest.raises(InputError, match=r"but the plan has K=2 stages and M=4. Build one for this plan"):
        pt.simulate(plan, graph, cluster, schedule=Schedule.gpipe(2, 3))
    with pytest.raises(InputError, match=r"schedule must be a name in \('gpipe', '1f1b'\) or a partitioner.Schedule"):
        pt.simulate(plan, graph, cluster, schedule=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_1f1b_memory_is_each_stages_own_and_at_most_gpipes(num_stages, num_microbatches):
    gpipe, graph, cluster = _pipeline(num_stages, num_microbatches)
    one_f_one_b, _, _ = _pipeline(num_stages, num_microbatches, schedule="1f1b")
    weights = KIB * (3 + gpipe.optimizer_slots)  # weights, gradient and its micro-batch's beside the sum (M > 1), slots
    for s, device in enumerate(gpipe.stages):
        held = min(num_stages - s, num_microbatches)
        received = KIB if s > 0 else 0
        # the micro-batches held, and one micro-batch's activation gradients and its received input's while
        # a backward runs (M > 1); and a copy of the received input for each micro-batch the stage before holds
        # (those this stage's forwards keep, and those run ahead, waiting for them)
        before = min(num_stages - s + 1, num_microbatches)
        assert one_f_one_b.memory_bytes[device] == weights + (held + 1) * 64 * KIB + received * (1 + before)
        held_gpipe = num_microbatches if s < num_stages - 1 else 1  # its last stage: one, as 1F1B's
        before_gpipe = num_microbatches  # every stage but the last holds M
        assert gpipe.memory_bytes[device] == weights + (held_gpipe + 1) * 64 * KIB + received * (1 + before_gpipe)
        assert one_f_one_b.memory_bytes[device] <= gpipe.memory_bytes[device]
    sim = pt.simulate(one_f_one_b, graph, cluster)  # the plan's own schedule
    assert sim.schedule == "1f1b"
    assert sim.peak_memory_bytes == {d: one_f_one_b.memory_bytes[d] for d in sim.stages}  # the simulator agrees
    assert one_f_one_b.step_time_s == pytest.approx(sim.step_time_s)


def test_cost_model_budgets_the_fullest_stage_and_evaluates_each_stage():
    graph = chain([1e12] * 6, activation_bytes=[KIB] * 6)
    cluster = pt.Cluster.uniform(4, memory="1GiB", flops_per_s=1e12)
    assert CostModel(graph, cluster, num_microbatches=8).max_in_flight == 8
    one_f_one_b = CostModel(graph, cluster, num_microbatches=8, schedule="1f1b")
    assert one_f_one_b.max_in_flight == 4  # min(number of devices, M): what the planners budget per node
    assert one_f_one_b.memory["l0"] == (4 + 1) * KIB  # 4 held, and the gradients of one in a backward
    # Three used devices: stage s holds min(3 - s, 8); the unused device holds nothing.
    ev = one_f_one_b.evaluate(
        {"l0": "/GPU:0", "l1": "/GPU:0", "l2": "/GPU:1", "l3": "/GPU:3", "l4": "/GPU:3", "l5": "/GPU:3"}
    )
    assert ev.in_flight == {"/GPU:0": 3, "/GPU:1": 2, "/GPU:2": 0, "/GPU:3": 1}
    assert ev.memory_bytes == {"/GPU:0": (6 + 2) * KIB, "/GPU:1": (2 + 1) * KIB, "/GPU:2": 0, "/GPU:3": (3 + 3) * KIB}
    assert in_flight("1f1b", 3, 8, 0) == 3 and in_flight("gpipe", 3, 8, 1) == 8 and in_flight("gpipe", 3, 8, 2) == 1
    with pytest.raises(InputError, match=r"schedule must be one of \('gpipe', '1f1b'\). Received: 'zb'"):
        CostModel(graph, cluster, schedule="zb")


def test_1f1b_fits_where_gpipe_does_not():
    # Activations dominate: 4 layers of 10 KiB activations, M = 8, two devices of 80 KiB. GPipe's first stage
    # holds 8 micro-batches (80 KiB for one layer), its last stage one (the whole chain on one device: 40 KiB,
    # 40 more for a micro-batch's activation gradients in a backward, and the weights); 1F1B's first stage at
    # most min(2, 8) = 2 (40 KiB for 2 layers), 20 KiB more for its activation gradients in a backward.
    graph = chain([1e12] * 4, param_bytes=[KIB] * 4, activation_bytes=[10 * KIB] * 4)
    cluster = pt.Cluster.uniform(2, memory=80 * KIB, flops_per_s=1e12)
    with pytest.raises(InfeasiblePlanError, match=r"no split into stages .*plan for the 1f1b schedule \(fewer micro-b"):
        pt.solve(graph, cluster, num_microbatches=8, time_limit_s=10)
    for options in (pt.SolverOptions(), pt.SolverOptions(exact_chains=False)):  # the exact DP, then CP-SAT
        plan = pt.solve(graph, cluster, num_microbatches=8, schedule="1f1b", time_limit_s=10, options=options)
        assert plan.schedule == "1f1b" and plan.fits_memory
        pt.validate_plan(plan, graph, cluster)
        gpipe = pt.score_assignment(plan.assignment, CostModel(graph, cluster, num_microbatches=8), method="same")
        assert all(plan.memory_bytes[d] <= gpipe.memory_bytes[d] for d in plan.devices)
        assert not gpipe.fits_memory
        with pytest.raises(
            # 8 x 20 KiB held on stage 0, 20 KiB of one micro-batch's activation gradients, 10 KiB of weights
            pt.PlanError,
            match=r"needs 190.0 KiB but holds 80.0 KiB \(with 8 micro-batches in flight under gpipe",
        ):
            pt.validate_plan(gpipe, graph, cluster)


def test_plan_for_1f1b_records_it_and_round_trips():
    graph = chain([1e12] * 6, param_bytes=[KIB] * 6, activation_bytes=[KIB] * 6, edge_bytes=[KIB] * 5)
    cluster = pt.Cluster.uniform(3, memory="1GiB", flops_per_s=1e12)
    plan = pt.solve(graph, cluster, num_microbatches=4, schedule="1f1b", time_limit_s=10)
    assert plan.schedule == "1f1b"
    assert json.loads(plan.to_json())["schedule"] == "1f1b"
    assert pt.Plan.from_json(plan.to_json()) == plan
    assert plan.step_time_s == pytest.approx(pt.simulate(plan, graph, cluster, schedule="1f1b").step_time_s)
    for name, baseline in pt.baselines.BASELINES.items():
        assert baseline(graph, cluster, num_microbatches=4, schedule="1f1b").schedule == "1f1b", name
    assert pt.exact_chain(graph, cluster, num_microbatches=4, schedule="1f1b").schedule == "1f1b"
    assert pt.solve(graph, cluster, num_microbatches=4, time_limit_s=10).schedule == "gpipe"  # the default


def test_plan_saved_before_schedules_loads_as_gpipe_and_a_bad_schedule_is_corrupt():
    plan, _, _ = _pipeline(2, 4)
    data = plan.to_dict()
    del data["schedule"]  # plans saved before the field existed
    old = pt.Plan.from_json(json.dumps(data))
    assert old.schedule == "gpipe"
    assert old == plan
    data["schedule"] = "zero-bubble"
    with pytest.raises(pt.PlanError, match=r"is corrupt: schedule 'zero-bubble' is not one of \('gpipe', '1f1b'\)"):
        pt.Plan.from_json(json.dumps(data))


def _compared_schedule_names(root: Path) -> list[str]:
    """``path:line`` of every comparison (==, !=, in, not in) with a schedule's name as a string constant,
    alone or in a tuple, list or set, in the packages under ``root`` but partitioner/schedule.py."""
    names = set(SCHEDULES)
    found = []
    for package in ("partitioner", "runtime", "profiles"):
        for path in sorted((root / package).rglob("*.py")):
            if path == root / "partitioner" / "schedule.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Compare):
                    continue
                for operand in (node.left, *node.comparators):
                    items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
                    if any(isinstance(x, ast.Constant) and x.value in names for x in items):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(found)


def test_schedule_names_are_compared_only_in_the_schedule_module() -> None:
    """Planners, the cost model, the error messages and the runtime ask the schedule (ScheduleFamily,
    Schedule.windows) for its facts; none branches on its name (a new schedule touches schedule.py only)."""
    root = Path(pt.__file__).resolve().parent.parent
    assert _compared_schedule_names(root) == []
    probe = root / "partitioner" / "schedule.py"
    assert probe.read_text().count('"gpipe"') > 0  # the names do live in the schedule module


def test_schedule_names_finder_finds_a_comparison(tmp_path: Path) -> None:
    """The finder above is not blind: it reports a comparison and an `in` test on a name."""
    (tmp_path / "partitioner").mkdir()
    (tmp_path / "partitioner" / "x.py").write_text(
        'def f(s):\n    return s == "gpipe" or s in ("1f1b", "other")\n\n\ndef g(s):\n    return s != "1f1b"\n'
    )
    for package in ("runtime", "profiles"):
        (tmp_path / package).mkdir()
    assert _compared_schedule_names(tmp_path) == ["partitioner/x.py:2", "partitioner/x.py:2", "partitioner/x.py:6"]


def test_schedule_family_owns_the_facts_planners_ask() -> None:
    """Each named schedule answers the facts its name used to stand for: in flight per position, warm-up,
    the period a stage adds, the closed form of the step (GPipe's, checked against the replay) and a floor."""
    gpipe, one_f_one_b = pt.schedule_family("gpipe"), pt.schedule_family("1f1b")
    assert [gpipe.in_flight(4, 8, s) for s in range(4)] == [8, 8, 8, 1]
    assert [one_f_one_b.in_flight(4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [one_f_one_b.early_forwards(4, 8, t) for t in (1, 2, 3, 4)] == [3, 2, 1, 0]
    assert [gpipe.early_forwards(4, 8, t) for t in (1, 2, 3, 4)] == [7, 7, 7, 0]
    assert (gpipe.period(1.0, 2.0, 1.5, 0.5), one_f_one_b.period(1.0, 2.0, 1.5, 0.5)) == (3.5, 3.0)
    assert gpipe.last_period(1.0, 2.0, 1.5, 0.5) == one_f_one_b.last_period(1.0, 2.0, 1.5, 0.5) == 3.0
    figures = [(1.0, 2.0, 0.0, 0.0), (0.5, 3.0, 0.25, 0.125), (2.0, 1.0, 0.5, 0.5)]
    columns = [np.array(column) for column in zip(*figures, strict=True)]
    assert gpipe.closed_form and not one_f_one_b.closed_form
    assert gpipe.closed_step(4, figures) == pytest.approx(float(chain_step("gpipe", 4, *columns)))
    assert gpipe.least_bound(4, figures) <= gpipe.closed_step(4, figures)
    assert one_f_one_b.closed_step(4, figures) is None and one_f_one_b.least_bound(4, figures) is None
    assert gpipe.least_step(6.0, 2, 4) == pytest.approx(6.0 * 16 / 7) and one_f_one_b.least_step(6.0, 2, 4) == 12.0
    assert "min(K - s, M)" in one_f_one_b.in_flight_rule(4) and "all M = 4" in gpipe.in_flight_rule(4)
    with pytest.raises(InputError, match=r"schedule must be one of \('gpipe', '1f1b'\)\. Received: 'zb'"):
        pt.schedule_family("zb")


@pytest.mark.parametrize("name", SCHEDULES)
def test_named_schedules_run_with_their_in_flight_windows(name: str) -> None:
    """Every named schedule is one the runtime's loop can follow; its windows are its in-flight counts."""
    schedule = Schedule.make(name, 4, 6)
    assert schedule.windows() == tuple(schedule.max_in_flight(s) for s in range(4))


def test_custom_schedule_windows_refuse_orders_the_loop_cannot_follow() -> None:
    """A custom order is runnable when its forwards go in micro-batch order and each waits for the
    backward its window names; otherwise one InputError says which action breaks which rule."""
    assert Schedule.parse("0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3").windows() == (3,)
    with pytest.raises(InputError, match=r"stage 0 runs 0F2 before 0F1, but the runtime's loop runs each stage's"):
        Schedule.parse("0: 0F0 0F2 0F1 0B0 0B1 0B2").windows()
    with pytest.raises(InputError, match=r"stage 1 holds at most 2 micro-batch\(es\) in flight but runs 1F2 before"):
        Schedule.parse("0: 0F0 0F1 0F2 0B1 0B0 0B2\n1: 1F0 1F1 1B1 1F2 1B0 1B2").windows()
