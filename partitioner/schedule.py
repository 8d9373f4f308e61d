"""Pipeline schedules as data: which stage runs which forward or backward of which micro-batch, in what order.

An *action* is one stage running one pass of one micro-batch, written as torch.distributed.pipelining
writes it: ``1F3`` is stage 1's forward of micro-batch 3, ``0B2`` stage 0's backward of micro-batch 2.
A *schedule* is one row of actions per stage, in the order that stage runs them. The simulator replays
it (partitioner/simulate.py), the cost model reads its activation memory from it (partitioner/cost.py)
and the runtime issues its actions in :meth:`Schedule.global_order`. Between stages, data decides::

    F(s, m) needs F(s - 1, m)               the activation from the stage before
    B(s, m) needs B(s + 1, m) and F(s, m)   the gradient from the stage after, and its own forward

Generators: ``gpipe`` (fill-drain; Huang et al., "GPipe", NeurIPS 2019, with the last stage's backward
right after each forward, as the runtime's loop runs it) and ``1f1b`` (PipeDream-flush;
Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021). Any other order that
validates is a ``custom`` schedule, written as text and read back with :meth:`Schedule.parse`.

A named schedule is a :class:`ScheduleFamily` (one small class per name, for every K and M), found by
:func:`schedule_family`: it owns the facts the planners, the cost model and the error messages need
(its rows, the micro-batches in flight per position, the warm-up, the period a stage adds, the closed
form of the step where one exists). Nothing outside this module compares a schedule's name. The
runtime runs any Schedule whose rows it can express (:meth:`Schedule.windows`).

Example:
    >>> print(Schedule.gpipe(2, 2))
    # gpipe K=2 M=2
    0: 0F0 0F1 0B0 0B1
    1: 1F0 1B0 1F1 1B1
    >>> [str(a) for a in Schedule.gpipe(2, 2).global_order()]
    ['0F0', '0F1', '1F0', '1B0', '0B0', '1F1', '1B1', '0B1']
"""

from __future__ import annotations

import abc
import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partitioner.errors import InputError, ScheduleError

# "F" forward, "B" backward (of inputs and weights together). Reserved for later versions, never generated
# and refused by Schedule.validate: "W" the weight gradient split off a backward, "R" the all-reduce of a
# stage's gradients.
ACTION_KINDS = ("F", "B", "W", "R")
_RUNNABLE = ("F", "B")
_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient", "R": "all-reduce"}
_ACTION_TEXT = re.compile(r"(\d+)([A-Za-z])(\d+)")
_HEADER = re.compile(r"#\s*(\S+)\s+K=(\d+)\s+M=(\d+)\s*")


def _count(value: object) -> bool:
    """True for a non-negative int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Action:
    """One stage running one pass of one micro-batch; prints as ``1F3`` (stage 1, forward, micro-batch 3).

    Args:
        stage: the stage that runs it, 0 first.
        kind: one of ACTION_KINDS: "F" forward, "B" backward ("W", "R" are reserved).
        microbatch: the micro-batch, 0 first.

    Raises:
        ScheduleError: for a negative index or an unknown kind.

    Example:
        >>> str(Action(1, "F", 3))
        '1F3'
        >>> Action.parse("0B2")
        Action(stage=0, kind='B', microbatch=2)
    """

    stage: int
    kind: str  # one of ACTION_KINDS
    microbatch: int

    def __post_init__(self) -> None:
        if not (_count(self.stage) and self.kind in ACTION_KINDS and _count(self.microbatch)):
            raise ScheduleError(
                f"An action needs a stage >= 0, a kind in {ACTION_KINDS} and a micro-batch >= 0. "
                f"Received: stage={self.stage!r}, kind={self.kind!r}, microbatch={self.microbatch!r}."
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads an action written as ``<stage><kind><micro-batch>``, such as ``1F3``.

        Raises:
            ScheduleError: when ``text`` is not such an action.
        """
        found = _ACTION_TEXT.fullmatch(text.strip()) if isinstance(text, str) else None
        if found is None or found[2] not in ACTION_KINDS:
            raise ScheduleError(
                f"Cannot read {text!r} as an action: expected <stage><kind><micro-batch> with kind one of "
                f"{', '.join(ACTION_KINDS)}, such as '1F3' (stage 1, forward, micro-batch 3)."
            )
        return cls(int(found[1]), found[2], int(found[3]))

    def needs(self, num_stages: int) -> tuple[Action, ...]:
        """The actions whose data this one reads, in a pipeline of ``num_stages`` stages.

        Example:
            >>> [str(a) for a in Action(1, "B", 0).needs(3)]
            ['1F0', '2B0']
        """
        s, m = self.stage, self.microbatch
        if self.kind == "F":
            return (Action(s - 1, "F", m),) if s > 0 else ()
        if self.kind == "B":
            return (Action(s, "F", m), *((Action(s + 1, "B", m),) if s + 1 < num_stages else ()))
        return ()


@dataclass(frozen=True)
class Schedule:
    """The order in which every stage runs the forwards and backwards of M micro-batches: plain data.

    ``actions[s]`` is stage s's row, in the order the stage runs it. A schedule validates where it is
    built (see :meth:`validate`), so one that exists runs every pass once and cannot deadlock.

    1F1B for K=2 stages and M=4 micro-batches: stage 0 runs K - 1 = 1 warm-up forward, then one forward
    and one backward in turn, then drains; each column is one clock tick of :meth:`global_order`::

          stage  0    1    2    3    4    5    6    7    8    9
              0  0F0  0F1       0B0  0F2  0B1  0F3  0B2       0B3
              1       1F0  1B0  1F1  1B1  1F2  1B2  1F3  1B3

    Stage 0 holds at most 2 micro-batches' activations (``max_in_flight(0) == 2``), GPipe holds all 4.

    Args:
        name: "gpipe", "1f1b" (whose rows must be exactly what the generators give) or "custom".
        num_stages: K, the number of stages (rows).
        num_microbatches: M.
        actions: one tuple of actions per stage.

    Raises:
        ScheduleError: when the schedule is malformed or deadlocks; the message draws its grid.

    Example:
        >>> s = Schedule.make("1f1b", 2, 4)
        >>> print(s)
        # 1f1b K=2 M=4
        0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
        >>> Schedule.parse(str(s)) == s, s.max_in_flight(0), s.max_in_flight(1)
        (True, 2, 1)
    """

    name: str  # one of SCHEDULE_NAMES
    num_stages: int  # K
    num_microbatches: int  # M
    actions: tuple[tuple[Action, ...], ...]  # per stage, in the order that stage runs them

    def __post_init__(self) -> None:
        try:
            rows = tuple(tuple(row) for row in self.actions)
        except TypeError:
            rows = None
        if rows is None or not all(isinstance(a, Action) for row in rows for a in row):
            raise ScheduleError(
                "Schedule.actions must be one sequence of Action objects per stage (Action.parse reads '1F3'). "
                f"Received: {self.actions!r:.200}."
            )
        object.__setattr__(self, "actions", rows)
        self.validate()

    # ----- generators ----------------------------------------------------------------------------

    @classmethod
    def gpipe(cls, num_stages: int, num_microbatches: int) -> Schedule:
        """Fill-drain: every stage but the last runs all M forwards, then all M backwards, each in order;
        the last stage runs each micro-batch's backward right after its forward (its backward needs nothing
        else, so waiting would only hold more activations).

        Example:
            >>> print(Schedule.gpipe(3, 3))
            # gpipe K=3 M=3
            0: 0F0 0F1 0F2 0B0 0B1 0B2
            1: 1F0 1F1 1F2 1B0 1B1 1B2
            2: 2F0 2B0 2F1 2B1 2F2 2B2
        """
        return cls.make("gpipe", num_stages, num_microbatches)

    @classmethod
    def one_f_one_b(cls, num_stages: int, num_microbatches: int) -> Schedule:
        """PipeDream-flush: min(K - s - 1, M) warm-up forwards on stage s, then 1 forward and 1 backward in turn.

        Example:
            >>> print(Schedule.one_f_one_b(2, 2))
            # 1f1b K=2 M=2
            0: 0F0 0F1 0B0 0B1
            1: 1F0 1B0 1F1 1B1
        """
        return cls.make("1f1b", num_stages, num_microbatches)

    @classmethod
    def make(cls, name: str, num_stages: int, num_microbatches: int) -> Schedule:
        """The schedule called ``name`` (one of SCHEDULES: "gpipe" or "1f1b") for K stages and M micro-batches.

        Raises:
            InputError: for another name, or counts below 1.

        Example:
            >>> Schedule.make("gpipe", 4, 8) == Schedule.gpipe(4, 8)
            True
        """
        family = schedule_family(name)
        _check_counts(num_stages, num_microbatches)
        return cls(name, num_stages, num_microbatches, family.rows(num_stages, num_microbatches))

    # ----- text ----------------------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [f"# {self.name} K={self.num_stages} M={self.num_microbatches}"]
        lines += [f"{s}: {' '.join(str(a) for a in row)}".rstrip() for s, row in enumerate(self.actions)]
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """Reads a schedule: an optional header ``# <name> K=<stages> M=<micro-batches>``, then one line per stage.

        A stage's line lists its actions separated by spaces or commas, optionally after its index and a
        colon (``1: 1F0 1B0``). Without a header the name is "custom", K the number of lines and M one more
        than the largest micro-batch. Further lines starting with ``#`` are comments.

        Raises:
            ScheduleError: for text that is not a schedule, or a schedule that does not validate.

        Example:
            >>> Schedule.parse("0: 0F0 0F1 0B1 0B0").name
            'custom'
            >>> Schedule.parse(str(Schedule.gpipe(2, 3))) == Schedule.gpipe(2, 3)
            True
        """
        if not isinstance(text, str):
            raise ScheduleError(f"Schedule.parse reads text. Received: {type(text).__name__}.")
        header: tuple[str, int, int] | None = None
        rows: list[tuple[Action, ...]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                if header is None and not rows:
                    found = _HEADER.fullmatch(line)
                    if found is None:
                        raise ScheduleError(
                            f"Line {number} {line!r} is not a schedule header: expected '# <name> K=<stages> "
                            f"M=<micro-batches>', such as '# 1f1b K=2 M=4'."
                        )
                    header = (found[1], int(found[2]), int(found[3]))
                continue
            label, colon, rest = line.partition(":")
            if colon:
                if label.strip() != str(len(rows)):
                    raise ScheduleError(
                        f"Line {number} is labelled stage {label.strip()!r} but is row {len(rows)}: list the "
                        "stages in order 0, 1, 2, ..., one line each."
                    )
                line = rest
            tokens = [t for t in re.split(r"[,\s]+", line) if t]
            try:
                rows.append(tuple(Action.parse(t) for t in tokens))
            except ScheduleError as error:
                raise ScheduleError(f"Line {number}: {error}") from None
        if header is None:
            last = max((a.microbatch for row in rows for a in row), default=-1)
            header = ("custom", len(rows), last + 1)
        return cls(header[0], header[1], header[2], tuple(rows))

    def grid(self) -> str:
        """The device-by-step picture: one row per stage, one column per clock tick of :meth:`global_order`.

        Example:
            >>> print(Schedule.gpipe(2, 2).grid())
              stage  0    1    2    3    4    5
                  0  0F0  0F1       0B0       0B1
                  1       1F0  1B0  1F1  1B1
        """
        _order, columns, _done = self._ticks()
        return _draw(self.actions, columns)

    # ----- checks --------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raises ScheduleError unless every stage can run its row to the end.

        Checked: the name and counts; one row per stage, each holding only its own stage's actions;
        only forwards and backwards, of micro-batches 0..M-1; each forward and each backward exactly once;
        a micro-batch's forward before its backward; no deadlock under the data dependencies (module
        docstring); a "gpipe" or "1f1b" schedule holds exactly that order. The message names the first
        problem and draws the grid with the failing stage marked ``>``.
        """
        if self.name not in SCHEDULE_NAMES:
            raise ScheduleError(f"A schedule's name must be one of {SCHEDULE_NAMES}. Received: {self.name!r}.")
        if not (_count(self.num_stages) and self.num_stages >= 1):
            raise ScheduleError(f"num_stages must be an integer >= 1. Received: {self.num_stages!r}.")
        if not (_count(self.num_microbatches) and self.num_microbatches >= 1):
            raise ScheduleError(f"num_microbatches must be an integer >= 1. Received: {self.num_microbatches!r}.")
        if len(self.actions) != self.num_stages:
            raise ScheduleError(
                f"The schedule is for K={self.num_stages} stages but has {len(self.actions)} row(s): give one "
                "row of actions per stage.\n" + _draw(self.actions)
            )
        for s, row in enumerate(self.actions):
            problem = self._row_problem(s, row)
            if problem:
                raise ScheduleError(f"Stage {s}: {problem}\n{_draw(self.actions, marked={s})}")
        order, columns, done = self._ticks()
        if len(order) < sum(len(row) for row in self.actions):
            raise self._deadlock(columns, done)
        if self.name in FAMILIES:
            expected = FAMILIES[self.name].rows(self.num_stages, self.num_microbatches)
            for s, (row, want) in enumerate(zip(self.actions, expected)):
                if row != want:
                    step = next((i for i, (a, b) in enumerate(zip(row, want)) if a != b), min(len(row), len(want)))
                    raise ScheduleError(
                        f"A schedule named {self.name!r} must run the {self.name} order, but stage {s} runs "
                        f"{_few(row[step:])} from step {step}, where {self.name} runs {_few(want[step:])}. Name it "
                        f"'custom', or build it with Schedule.make({self.name!r}, {self.num_stages}, "
                        f"{self.num_microbatches}).\n{_draw(self.actions, columns, marked={s})}"
                    )

    def _row_problem(self, s: int, row: Sequence[Action]) -> str | None:
        """What is wrong with stage ``s``'s row on its own, or None."""
        m_total = self.num_microbatches
        seen: set[Action] = set()
        for a in row:
            if a.stage != s:
                return f"its row holds {a}, an action of stage {a.stage}; each row lists only its own stage."
            if a.kind not in _RUNNABLE:
                return (
                    f"{a} is a {_KIND_NAMES[a.kind]} ('{a.kind}'), which this version reserves but cannot run; "
                    "use only F (forward) and B (backward)."
                )
            if a.microbatch >= m_total:
                return f"{a} names micro-batch {a.microbatch} but M={m_total} (micro-batches 0..{m_total - 1})."
            if a in seen:
                return f"{a} appears twice; each stage runs each forward and each backward exactly once."
            if a.kind == "B" and Action(s, "F", a.microbatch) not in seen:
                return (
                    f"runs {a} before {Action(s, 'F', a.microbatch)}; a backward needs its own forward first."
                    if Action(s, "F", a.microbatch) in row
                    else f"runs {a} but never {Action(s, 'F', a.microbatch)}; a backward needs its own forward."
                )
            seen.add(a)
        missing = [str(Action(s, k, m)) for k in _RUNNABLE for m in range(m_total) if Action(s, k, m) not in seen]
        if missing:
            listed = " ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            return f"never runs {listed}; each stage runs the forward and the backward of every micro-batch once."
        return None

    def _ticks(self) -> tuple[list[Action], list[list[int]], list[int]]:
        """Runs the schedule on a clock: at each tick, each stage in order 0..K-1 runs its next action if
        every action it needs ran at an earlier tick.

        Returns the actions in the order they ran, the tick of each stage's actions that ran (row by
        row), and how many actions of each row ran (fewer than the row on a deadlock).
        """
        num_stages = len(self.actions)
        ran_at: dict[Action, int] = {}
        order: list[Action] = []
        columns: list[list[int]] = [[] for _ in self.actions]
        done = [0] * num_stages
        left = sum(len(row) for row in self.actions)
        tick = 0
        while left:
            ran = False
            for s, row in enumerate(self.actions):
                if done[s] == len(row):
                    continue
                action = row[done[s]]
                if all(ran_at.get(need, tick) < tick for need in action.needs(num_stages)):
                    ran_at[action] = tick
                    order.append(action)
                    columns[s].append(tick)
                    done[s] += 1
                    left -= 1
                    ran = True
            if not ran:
                break
            tick += 1
        return order, columns, done

    def _deadlock(self, columns: list[list[int]], done: list[int]) -> ScheduleError:
        """The error for a schedule whose stages all wait: what each waits for."""
        ran = {a for row, n in zip(self.actions, done) for a in row[:n]}
        waiting = [s for s, row in enumerate(self.actions) if done[s] < len(row)]
        reasons = []
        for s in waiting:
            action = self.actions[s][done[s]]
            missing = [str(need) for need in action.needs(self.num_stages) if need not in ran]
            reasons.append(f"stage {s} waits to run {action}, which needs {' and '.join(missing)}")
        last = max((c[-1] for c in columns if c), default=-1)
        return ScheduleError(
            f"The schedule deadlocks after {last + 1} tick(s): {'; '.join(reasons)}. Each stage runs its row in "
            "order, so no stage can move. Reorder the rows so that every action comes after what it needs: F(s, m) "
            "needs F(s - 1, m); B(s, m) needs B(s + 1, m) and F(s, m).\n"
            + _draw(self.actions, columns, marked=set(waiting))
        )

    # ----- views ---------------------------------------------------------------------------------

    def global_order(self) -> list[Action]:
        """One total order of every action, consistent with each stage's row and with the data dependencies.

        Stages interleave as they would run in time: on a clock where every action takes one tick, each
        stage in order 0..K-1 runs its next action as soon as what it needs ran at an earlier tick. A
        runtime that issues the actions in this order into one graph never waits for a later action.

        Example:
            >>> [str(a) for a in Schedule.one_f_one_b(2, 2).global_order()]
            ['0F0', '0F1', '1F0', '1B0', '0B0', '1F1', '1B1', '0B1']
        """
        order, columns, done = self._ticks()
        if len(order) < sum(len(row) for row in self.actions):  # only for an object bypassing validation
            raise self._deadlock(columns, done)
        return order

    def max_in_flight(self, stage: int) -> int:
        """The most micro-batches whose forward has run on ``stage`` and whose backward has not.

        That many micro-batches' activations are held at once: M for GPipe (1 on its last stage), min(K - s, M)
        for 1F1B.

        Raises:
            InputError: for a stage outside 0..K-1.

        Example:
            >>> [Schedule.one_f_one_b(4, 8).max_in_flight(s) for s in range(4)]
            [4, 3, 2, 1]
        """
        if not (_count(stage) and stage < self.num_stages):
            raise InputError(f"stage must be an integer in 0..{self.num_stages - 1}. Received: {stage!r}.")
        held = most = 0
        for a in self.actions[stage]:
            held += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
            most = max(most, held)
        return most

    def windows(self) -> tuple[int, ...]:
        """Per stage, its in-flight window: what the runtime's loop needs to run this schedule.

        The loop (runtime.executor) runs each stage's forwards in micro-batch order, and the forward of
        micro-batch m only after the backward of m - w, w the stage's window (here its ``max_in_flight``);
        the rest follows the data. It runs every schedule whose rows keep to that order: GPipe (w = M),
        1F1B (w = K - s) and any custom schedule that does.

        Raises:
            InputError: for a row the loop cannot follow: forwards out of micro-batch order, or a forward
                before the backward its window waits for. The message draws the grid.

        Example:
            >>> Schedule.one_f_one_b(3, 4).windows()
            (3, 2, 1)
            >>> Schedule.parse("0: 0F1 0F0 0B0 0B1").windows()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            partitioner.errors.InputError: The runtime cannot run this custom schedule: stage 0 runs 0F1 before 0F0, ...
        """
        windows = []
        for s, row in enumerate(self.actions):
            place = {a: i for i, a in enumerate(row)}
            forwards = [a for a in row if a.kind == "F"]
            early = next((m for m, a in enumerate(forwards) if a.microbatch != m), None)
            if early is not None:
                problem = (
                    f"stage {s} runs {forwards[early]} before {Action(s, 'F', early)}, but the runtime's loop runs "
                    f"each stage's forwards in micro-batch order. Reorder stage {s}'s forwards"
                )
                raise self._not_runnable(problem, s)
            window = self.max_in_flight(s)
            for m in range(window, self.num_microbatches):
                forward, backward = Action(s, "F", m), Action(s, "B", m - window)
                if place[forward] < place[backward]:
                    problem = (
                        f"stage {s} holds at most {window} micro-batch(es) in flight but runs {forward} before "
                        f"{backward}, and the runtime's loop keeps a stage's in-flight window by running the "
                        f"forward of micro-batch m after the backward of m - {window}. Move {backward} before "
                        f"{forward}"
                    )
                    raise self._not_runnable(problem, s)
            windows.append(window)
        return tuple(windows)

    def _not_runnable(self, problem: str, stage: int) -> InputError:
        return InputError(
            f"The runtime cannot run this {self.name} schedule: {problem}, or run a schedule of {SCHEDULES} "
            f"(Schedule.make(name, {self.num_stages}, {self.num_microbatches})).\n"
            + _draw(self.actions, self._ticks()[1], marked={stage})
        )


def _gpipe_rows(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """All M forwards, then all M backwards, each in micro-batch order, on every stage but the last; the last
    stage runs each micro-batch's backward right after its forward (it needs nothing else)."""
    last = num_stages - 1
    forwards = [[Action(s, "F", m) for m in range(num_microbatches)] for s in range(num_stages)]
    backwards = [[Action(s, "B", m) for m in range(num_microbatches)] for s in range(num_stages)]
    rows = [tuple(forwards[s] + backwards[s]) for s in range(last)]
    rows.append(tuple(a for pair in zip(forwards[last], backwards[last]) for a in pair))
    return tuple(rows)


def _one_f_one_b_rows(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """min(K - s - 1, M) warm-up forwards on stage s, then one forward and one backward in turn, then the drain."""
    rows = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        row = [Action(s, "F", m) for m in range(warmup)]
        next_forward = warmup
        for m in range(num_microbatches):
            if next_forward < num_microbatches:
                row.append(Action(s, "F", next_forward))
                next_forward += 1
            row.append(Action(s, "B", m))
        rows.append(tuple(row))
    return tuple(rows)


class ScheduleFamily(abc.ABC):
    """A named schedule for every K stages and M micro-batches: its rows, and the facts the planners,
    the cost model and the error messages ask of it instead of comparing names.

    One small class per name (as DeepSpeed's ``PipeSchedule``), registered in FAMILIES and found by
    :func:`schedule_family`. A new schedule (interleaved or zero-bubble 1F1B) is a new subclass here.
    """

    name: str  # the name Schedule.make and the plan know it by
    closed_form: bool  # True iff closed_step gives the step of a chain of stages (and the planners' search is exact)
    distinct_last = False  # True iff the last stage's period differs from the others' (last_period)

    @abc.abstractmethod
    def rows(self, num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
        """Each stage's actions, in the order it runs them."""

    def in_flight(self, num_stages: int, num_microbatches: int, stage: int) -> int:
        """The most micro-batches whose activations ``stage`` of K holds: the built schedule's own count.

        Example:
            >>> [schedule_family("1f1b").in_flight(4, 8, s) for s in range(4)]
            [4, 3, 2, 1]
        """
        return _built(self.name, num_stages, num_microbatches).max_in_flight(stage)

    def window_before(self, num_microbatches: int, in_flight: int) -> int:
        """The micro-batches in flight of the stage right before one that holds ``in_flight``: how many
        forwards it may run ahead, sending their outputs, of the ones the later stage has taken.

        Example:
            >>> schedule_family("gpipe").window_before(8, 1), schedule_family("gpipe").window_before(8, 8)
            (8, 8)
            >>> [schedule_family("1f1b").window_before(8, n) for n in (1, 3, 8)]
            [2, 4, 8]
        """
        return self.in_flight(in_flight + 1, num_microbatches, 0)

    @abc.abstractmethod
    def in_flight_rule(self, num_microbatches: int) -> str:
        """How many micro-batches the stage holding the fewest holds, in words, for error messages."""

    @abc.abstractmethod
    def early_forwards(self, num_devices: int, num_microbatches: int, position: int = 1) -> int:
        """The most forwards a stage runs, beyond micro-batch 0's, before its first backward can start, for a
        stage at ``position`` (1 or more) of a chain of stages on at most ``num_devices`` devices (its warm-up)."""

    @abc.abstractmethod
    def period(self, f: Any, b: Any, a: Any, g: Any) -> Any:
        """The seconds per micro-batch a stage adds to the steady state (scalars or arrays alike).

        f, b: its forward and backward seconds; a, g: its activation received and gradient sent back.
        """

    def last_period(self, f: Any, b: Any, a: Any, g: Any) -> Any:
        """The seconds per micro-batch the pipeline's last stage adds: :meth:`period` unless the schedule
        runs its last stage otherwise (``distinct_last``)."""
        return self.period(f, b, a, g)

    def closed_step(self, num_microbatches: int, figures: Sequence[tuple[float, float, float, float]]) -> float | None:
        """The step of a chain of stages with ``figures`` (f, b, a, g) each, in pipeline order, as the
        simulator replays it, where a closed form exists (``closed_form``); None where none does."""
        return None

    def least_bound(self, num_microbatches: int, figures: Sequence[tuple[float, float, float, float]]) -> float | None:
        """A lower bound on :meth:`closed_step` that the exact chain search minimises, where a closed form
        exists; None where none does."""
        return None

    @abc.abstractmethod
    def least_step(self, work_s: float, num_stages: int, num_microbatches: int) -> float:
        """A floor on the step of ``num_stages`` stages whose compute per micro-batch sums to ``work_s``."""


class GPipe(ScheduleFamily):
    """Fill-drain: every stage but the last runs all M forwards, then all M backwards (M micro-batches in
    flight); the last stage runs each micro-batch's forward and backward in turn (one in flight)."""

    name = "gpipe"
    closed_form = True
    distinct_last = True

    def rows(self, num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
        return _gpipe_rows(num_stages, num_microbatches)

    def in_flight_rule(self, num_microbatches: int) -> str:
        return f"every stage before the last holds all M = {num_microbatches}, the last stage 1"

    def early_forwards(self, num_devices: int, num_microbatches: int, position: int = 1) -> int:
        """M - 1 for a stage that may have a stage after it (position < num_devices): all its forwards run
        first; 0 for the last of num_devices, which runs each backward right after its forward.

        Example:
            >>> GPipe().early_forwards(4, 8), GPipe().early_forwards(4, 8, 4)
            (7, 0)
        """
        return num_microbatches - 1 if position < num_devices else 0

    def period(self, f: Any, b: Any, a: Any, g: Any) -> Any:
        """A stage before the last: a forward phase paced by max(f, a), then a backward phase paced by max(b, g)."""
        return np.maximum(f, a) + np.maximum(b, g)

    def last_period(self, f: Any, b: Any, a: Any, g: Any) -> Any:
        """The last stage: one forward and one backward in turn, each link pacing its own way."""
        return np.maximum(np.maximum(f + b, a), g)

    def closed_step(self, num_microbatches: int, figures: Sequence[tuple[float, float, float, float]]) -> float:
        """The step as the simulator replays it: the longest chain of actions that wait for one another.

        A flow shop of M equal jobs (docs/cost-model.md, "GPipe's step"). The machines, in a micro-batch's
        route: each stage's forward and the link into it, the last stage (forward and backward in turn),
        each returning link and stage's backward. A stage before the last also starts its backwards only
        after its last forward, so a longest chain either follows the route (A: every machine's time plus
        M - 1 times the slowest) or leaves it once, at the stage before the last (B: there and back
        through the stages before the last, M - 1 times their slowest forward machine and M - 1 times
        their slowest backward machine; leaving it earlier is never longer)::

            A = sum_s (f + b + a + g)_s + (M - 1) max(max_(s<K-1) max(f, b, a, g)_s, (f + b)_(K-1), a_(K-1), g_(K-1))
            B = sum_(s<K-1) (f + b + a + g)_s + (M - 1) (max_(s<K-1) max(f, a)_s + max_(s<K-1) max(b, g)_s)
            step = max(A, B)

        Example:
            >>> GPipe().closed_step(4, [(1.0, 2.0, 0.0, 0.0), (1.0, 2.0, 0.0, 0.0)])  # (4 + 2 - 1) x 3
            15.0
            >>> GPipe().closed_step(4, [(2.0, 2.0, 0.0, 0.0), (1.0, 1.0, 0.0, 0.0)])  # B: 4 + 3 x (2 + 2)
            16.0
        """
        m = num_microbatches
        *before, (fl, bl, al, gl) = figures
        slowest = max([fl + bl, al, gl, *(max(x) for x in before)])
        step = sum(sum(x) for x in figures) + (m - 1) * slowest
        if before:
            forward = max(max(f, a) for f, _, a, _ in before)
            backward = max(max(b, g) for _, b, _, g in before)
            step = max(step, sum(sum(x) for x in before) + (m - 1) * (forward + backward))
        return step

    def least_bound(self, num_microbatches: int, figures: Sequence[tuple[float, float, float, float]]) -> float:
        """A lower bound on :meth:`closed_step` that the exact chain search minimises
        (partitioner.search.threshold_search): A with the last stage's machines, B with one stage's
        forward and backward machines (``period``), the stage of the largest::

            max(sum_s (f + b + a + g)_s + (M - 1) last_period_(K-1),
                sum_(s<K-1) (f + b + a + g)_s + (M - 1) max_(s<K-1) period_s)

        Equal to the step where one stage before the last holds both B's slowest machines and A's slowest
        is the last stage's or at most B (the usual case).

        Example:
            >>> figures = [(2.0, 1.0, 0.0, 0.0), (1.0, 2.0, 0.0, 0.0), (1.0, 1.0, 0.0, 0.0)]
            >>> GPipe().least_bound(4, figures), GPipe().closed_step(4, figures)
            (15.0, 18.0)
        """
        m = num_microbatches
        *before, last = figures
        bound = sum(sum(x) for x in figures) + (m - 1) * float(self.last_period(*last))
        if before:
            bound = max(bound, sum(sum(x) for x in before) + (m - 1) * max(float(self.period(*x)) for x in before))
        return bound

    def least_step(self, work_s: float, num_stages: int, num_microbatches: int) -> float:
        """W M^2 / (K (M - 1) + 1), and W: a stage before the last runs M forwards and backwards of c_s
        (B_s >= M c_s), the last adds (M - 1) c_(K-1) to every stage's work (A); at best all K - 1 of
        the first equal A (docs/cost-model.md, "GPipe's step").

        Example:
            >>> GPipe().least_step(6.0, 2, 4), GPipe().least_step(6.0, 1, 4)  # one stage: M W
            (13.714285714285714, 24.0)
        """
        m = num_microbatches
        return max(work_s, work_s * m * m / (num_stages * (m - 1) + 1))


class OneFOneB(ScheduleFamily):
    """PipeDream-flush: min(K - s - 1, M) warm-up forwards on stage s, then one forward and one backward in
    turn; min(K - s, M) micro-batches in flight on stage s."""

    name = "1f1b"
    closed_form = False  # a stage's warm-up forwards and its first backward wait on different stages

    def rows(self, num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
        return _one_f_one_b_rows(num_stages, num_microbatches)

    def in_flight_rule(self, num_microbatches: int) -> str:
        return (
            f"the fewest a stage holds: stage s of K holds min(K - s, M), M = {num_microbatches}, "
            "so 1 on the last stage"
        )

    def early_forwards(self, num_devices: int, num_microbatches: int, position: int = 1) -> int:
        """min(num_devices - position, M - 1): the warm-up of a stage with at most that many stages after it.

        Example:
            >>> OneFOneB().early_forwards(8, 8), OneFOneB().early_forwards(8, 3), OneFOneB().early_forwards(8, 8, 8)
            (7, 2, 0)
        """
        return max(0, min(num_devices - position, num_microbatches - 1))

    def period(self, f: Any, b: Any, a: Any, g: Any) -> Any:
        """One forward and one backward in turn: f + b (each link paces its own way)."""
        return np.maximum(np.maximum(f + b, a), g)

    def least_step(self, work_s: float, num_stages: int, num_microbatches: int) -> float:
        """The busiest stage runs M forwards and backwards of at least the mean; micro-batch 0 passes every stage."""
        return max(num_microbatches * work_s / num_stages, work_s)


# The named schedules, by name: what Schedule.make builds and the planners plan for.
FAMILIES: dict[str, ScheduleFamily] = {family.name: family for family in (GPipe(), OneFOneB())}
SCHEDULES = tuple(FAMILIES)  # the names Schedule.make builds; a schedule read from text may also be "custom"
SCHEDULE_NAMES = (*SCHEDULES, "custom")


def schedule_family(name: object) -> ScheduleFamily:
    """The named schedule ``name`` (one of SCHEDULES), for every K and M.

    Raises:
        InputError: for another name.

    Example:
        >>> schedule_family("1f1b").early_forwards(4, 8), schedule_family("gpipe").closed_form
        (3, True)
    """
    check_schedule_name(name)
    assert isinstance(name, str)  # checked above, for mypy
    return FAMILIES[name]


def check_schedule_name(name: object) -> None:
    """Raises InputError unless ``name`` is one of SCHEDULES, the schedules Schedule.make builds."""
    if not isinstance(name, str) or name not in FAMILIES:
        raise InputError(f"schedule must be one of {SCHEDULES}. Received: {name!r}.")


def schedule_for(schedule: str | Schedule, num_stages: int, num_microbatches: int) -> Schedule:
    """``schedule`` (a name in SCHEDULES, or a Schedule) as a Schedule for K stages and M micro-batches.

    Raises:
        InputError: for an unknown name, something else, or a Schedule for another K or M.

    Example:
        >>> schedule_for("1f1b", 2, 4) == Schedule.one_f_one_b(2, 4)
        True
    """
    if isinstance(schedule, str):
        return _built(schedule, num_stages, num_microbatches)
    if not isinstance(schedule, Schedule):
        raise InputError(
            f"schedule must be a name in {SCHEDULES} or a partitioner.Schedule. Received: {type(schedule).__name__}."
        )
    if (schedule.num_stages, schedule.num_microbatches) != (num_stages, num_microbatches):
        raise InputError(
            f"The schedule is for K={schedule.num_stages} stages and M={schedule.num_microbatches} micro-batches, "
            f"but the plan has K={num_stages} stages and M={num_microbatches}. Build one for this plan, such as "
            f"Schedule.make('1f1b', {num_stages}, {num_microbatches})."
        )
    return schedule


@functools.lru_cache(maxsize=64)
def _built(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Schedule.make, cached: the planners ask for the same few schedules many times."""
    return Schedule.make(name, num_stages, num_microbatches)


def _few(actions: Sequence[Action]) -> str:
    """The first three actions as text, then "..." if more follow."""
    return " ".join(str(a) for a in actions[:3]) + (" ..." if len(actions) > 3 else "")


def _check_counts(num_stages: int, num_microbatches: int) -> None:
    for label, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not (_count(value) and value >= 1):
            raise InputError(f"{label} must be an integer >= 1. Received: {value!r}.")


def _draw(
    rows: Sequence[Sequence[Action]], columns: Sequence[Sequence[int]] | None = None, *, marked: Collection[int] = ()
) -> str:
    """The device-by-step grid, one line per stage, stages in ``marked`` marked ``>``.

    Stage s's actions stand in ``columns[s]`` (default: 0, 1, 2, ... in row order); those without a column
    (a deadlock stopped them) follow, in row order, after the last column used.
    """
    given = columns if columns is not None else [range(len(row)) for row in rows]
    end = max((c[-1] + 1 for c in given if len(c)), default=0)
    placed: list[dict[int, str]] = []
    for row, cols in zip(rows, given):
        cells = {col: str(a) for col, a in zip(cols, row)}
        cells.update((end + i, str(a)) for i, a in enumerate(row[len(cols) :]))
        placed.append(cells)
    width = max([3, *(len(text) for cells in placed for text in cells.values())])
    num_columns = max((max(cells) + 1 for cells in placed if cells), default=0)
    lines = ["  stage  " + "  ".join(f"{c:<{width}}" for c in range(num_columns))]
    for s, cells in enumerate(placed):
        body = "  ".join(f"{cells.get(c, ''):<{width}}" for c in range(num_columns))
        lines.append(f"{'>' if s in marked else ' '} {s:>5}  {body}")
    return "\n".join(line.rstrip() for line in lines)
