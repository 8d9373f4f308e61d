"""Schedules as data: printing and parsing, validation messages, the global order and activations in flight."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.errors import InputError, ScheduleError
from partitioner.schedule import ACTION_KINDS, SCHEDULES, Action, Schedule

SMALL = {"num_stages": st.integers(1, 4), "num_microbatches": st.integers(1, 8)}

GPIPE_2_4 = """\
# gpipe K=2 M=4
0: 0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0
1: 1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0"""

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
        r"where gpipe runs 0F2 0F3 0B3 \.\.\.\. Name it 'custom'",
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
        "0F0", "0F1", "1F0", "1F1", "1B1", "0B1", "1B0", "0B0"
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
        assert gpipe.max_in_flight(s) == num_microbatches
        assert one_f_one_b.max_in_flight(s) == min(num_stages - s, num_microbatches)


def test_max_in_flight_refuses_unknown_stages():
    with pytest.raises(InputError, match=r"stage must be an integer in 0..1. Received: 2"):
        Schedule.gpipe(2, 2).max_in_flight(2)
