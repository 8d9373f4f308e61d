"""The threshold searches for chains: the split of the shortest step, by min-sum DPs under a bound on the period.

The step objective (the default, docs/cost-model.md "The objective: the step"). Users pay the simulated
step, a function of the stages' forward f, backward b, received activation a and returned gradient g
(:func:`_split_step`: GPipe's closed form ``ScheduleFamily.closed_step``, 1F1B's replay).

GPipe (:func:`_closed_form_search`): its step has a closed form, max(A, B) (docs/cost-model.md, "GPipe's
step"), and a lower bound with one period per stage, ``least_bound`` = max(W + (M - 1) q, C + (M - 1) p)
(W every stage time, C those before the last stage, p their largest period max(f, a) + max(b, g), q the
last stage's max(f + b, a, g)). For a threshold P on the periods before the last stage the DP
(:func:`_last_blocks`) gives the least C per end of the stages before the last and prices every last
block exactly; bisection on P, dropping intervals whose bound cannot win, finds the least least_bound
and proves it.

1F1B (:func:`_threshold_search`, the local search's starts): with ``period(s) = f + b`` (each link pacing
its own way), :func:`_step_program` finds, for a threshold T, the least sum of stage times over splits
whose every period is at most T (a min-sum DP), bisected on T to minimise ``w sum + (M - 1) max period``
for a few weights w, dropping intervals of T whose bound cannot win.

The splits met are ranked by the exact step, the best few simulated. The DPs are banded
(:func:`_banded_program`): a block's compute and memory bound how far it reaches, and a block on device
k must end where the devices after k can still cover the rest (:func:`_viable_ends`), so near the least
period, where the search spends its DPs, each device's cuts lie in a narrow window: O(K^2 window^2)
work instead of O(K^2 N^2). The searches start from the least bottleneck, found the same way
(:func:`_least_bottleneck`: banded min-max DPs at limits growing from a floor; the whole table of the
bottleneck DP below on small chains).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from partitioner.cost import CostModel
from partitioner.schedule import schedule_family
from partitioner.search.bottleneck_dp import (
    Blocks,
    _blocks,
    _by_level,
    _dynamic_program,
    _least_bytes_split,
    _level,
    _prefix_tables,
    _Tables,
)
from partitioner.simulate import chain_step

STEP_TOLERANCE = 1e-4  # relative: the threshold search stops once no split can beat its best by more
MAX_PROGRAMS = 64  # step DPs per device order at most
PROGRAM_WORK = 1.3e8  # ... and block figures (cells of _step_program over its levels, times modes) per order
# the least bottleneck of the step search: the whole table (_dynamic_program) up to this many cells of one
# level (K^2 N^2 / 2), where a banded program's fixed cost per device pair is the larger (about 400 nodes on 2
# devices, 170 on 4, 90 on 8); banded programs (_least_bottleneck) above
FULL_TABLE_CELLS = 1e6


class _Found(NamedTuple):
    """A split the step search found: its stages and their figures, and the order it is for."""

    step: float  # _split_step(): the simulated step of the split
    objective: float  # what the threshold search minimises: sum of stage times + (M - 1) * the longest period
    order: int  # index of the search that found it (its device order and tables)
    blocks: tuple[tuple[int, int, int], ...]  # (device index in the order, first node, end node) per stage


def _period(schedule: str, f: Any, b: Any, a: Any, g: Any, last: bool = False) -> Any:
    """The seconds per micro-batch a stage adds to the steady state (scalars or arrays alike).

    f, b: its forward and backward seconds; a, g: its activation received and gradient sent back;
    ``last``: the stage ends the pipeline. The schedule's own figure (``ScheduleFamily.period`` and
    ``last_period``): GPipe runs all forwards, then all backwards (max(f, a) + max(b, g)), but on its last
    stage and 1F1B's each forward and backward in turn (f + b, each link pacing its own way).
    """
    family = schedule_family(schedule)
    return family.last_period(f, b, a, g) if last else family.period(f, b, a, g)


def _split_step(schedule: str, num_microbatches: int, figures: list[tuple[float, float, float, float]]) -> float:
    """The simulated step of a split whose stages have ``figures`` (f, b, a, g) each, in pipeline order.

    The schedule's closed form where it has one (``ScheduleFamily.closed_step``; GPipe's: each phase a
    flow shop). 1F1B has none (a stage's warm-up forwards and its first backward wait on different
    stages): the schedule is replayed on the figures (partitioner.simulate.chain_step), O(K M).
    """
    return _split_steps(schedule, num_microbatches, [figures])[0]


def _split_steps(
    schedule: str, num_microbatches: int, splits: list[list[tuple[float, float, float, float]]]
) -> list[float]:
    """:func:`_split_step` of each split of ``splits``; the 1F1B replays of splits with as many stages run together."""
    m = num_microbatches
    closed = [schedule_family(schedule).closed_step(m, figures) for figures in splits]  # None: no closed form
    known = [step for step in closed if step is not None]
    if len(known) == len(closed):
        return known
    result = [0.0] * len(splits)
    by_count: dict[int, list[int]] = {}
    for index, figures in enumerate(splits):
        by_count.setdefault(len(figures), []).append(index)
    for indices in by_count.values():
        stacked = np.array([splits[i] for i in indices]).transpose(2, 1, 0)  # [figure, stage, split]
        for i, step in zip(indices, chain_step(schedule, m, *stacked)):
            result[i] = float(step)
    return result


def _stage_compute(
    tables: _Tables,
    k2: int,
    starts: np.ndarray,
    links: tuple[np.ndarray, np.ndarray],
    schedule: str | None,
    limit: float,
    ends: np.ndarray | None = None,
) -> np.ndarray:
    """[start, end]: the least compute seconds of block [start, end) on device k2 in a mode that fits
    its memory, is allowed there, and keeps the stage's period under ``schedule`` (its stage time,
    compute + receive, for None) within ``limit``; inf where none.

    ``starts`` is a column of block starts (0: the first block, which receives nothing); ``links``
    the activation and gradient seconds of each start's received tensor (columns too); ``ends`` the
    block ends to compute (all, 0..N, by default).
    """
    n = tables.modes[0].prefix.shape[0] - 1
    ends = np.arange(n + 1) if ends is None else ends
    a, g = links
    best = np.full((len(starts), len(ends)), np.inf)
    for mode in tables.modes:
        # memory grows with the end: each start's blocks fit up to an end (its received tensor counts)
        received = np.where(starts > 0, mode.boundary[np.maximum(starts - 1, 0)], 0.0)
        room = tables.capacity[k2] + mode.mem_prefix[starts] - received
        last = np.searchsorted(mode.mem_prefix, room, side="right") - 1
        fits = (ends[None, :] > starts) & (ends[None, :] <= last) & mode.allowed[ends][None, :]
        forward, backward = mode.forward[:, k2], mode.backward[:, k2]
        f = forward[ends][None, :] - forward[starts] + mode.fixed_forward[k2]
        b = backward[ends][None, :] - backward[starts] + mode.fixed_backward[k2]
        if np.isfinite(limit):
            fits &= (f + b + a + g if schedule is None else _period(schedule, f, b, a, g, tables.last)) <= limit
        best = np.minimum(best, np.where(fits, f + b, np.inf))
    return best


def _reach(tables: _Tables, k2: int, starts: np.ndarray, limit: float) -> np.ndarray:
    """The last end j of a block [start, j) on k2 that fits its memory in some mode and whose compute
    can be within ``limit``, per start (a period is at least the compute, and no node computes less in
    any mode than kept, modes[0])."""
    n = tables.modes[0].prefix.shape[0] - 1
    reach = np.full(len(starts), -1, dtype=np.int64)
    for mode in tables.modes:  # memory: as _stage_compute's ``last``
        received = np.where(starts > 0, mode.boundary[np.maximum(starts - 1, 0)], 0.0)
        room = tables.capacity[k2] + mode.mem_prefix[starts] - received
        reach = np.maximum(reach, np.searchsorted(mode.mem_prefix, room, side="right") - 1)
    if np.isfinite(limit):
        fastest = tables.modes[0].prefix[:, k2]
        reach = np.minimum(reach, np.searchsorted(fastest, fastest[starts] + limit * (1 + 1e-12), side="right") - 1)
    return np.asarray(np.minimum(reach, n))


def _links(tables: _Tables, k: int, k2: int, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of the activation (k -> k2) and of its gradient (k2 -> k) cut before each start."""
    size = tables.out_bytes[starts - 1]
    return size / tables.bandwidth[k][k2], size / tables.bandwidth[k2][k]  # as CostModel.receive_s, one way each


def _viable_ends(tables: _Tables, limit: float) -> np.ndarray:
    """[k]: the first end j from which nodes [j, N) can still be covered by the devices after k, every
    block's compute within ``limit`` (the kept compute, modes[0], is the least of any mode) and its
    memory, less the tensor it receives, within its device's in some mode at the smallest budget a
    stage can have (level 1's, the last stage's: the most room; bottleneck_dp's docstring, "Memory").

    A relaxation (transfers and received tensors left out, any mode anywhere, every block budgeted as
    the last stage), so a split ending a block on k before it has no completion, whatever its blocks'
    levels: :func:`_banded_program` leaves those cells out. Each device's block goes as far back as it
    can: from a start further back no device after it reaches N.
    """
    modes = tables.levels[0]
    num_devices, n = len(tables.capacity), modes[0].prefix.shape[0] - 1
    first = np.full(num_devices, n, dtype=np.int64)
    for k in range(num_devices - 2, -1, -1):
        end = first[k + 1]
        back = min(
            int(np.searchsorted(m.mem_prefix, m.mem_prefix[end] - tables.capacity[k + 1], side="left")) for m in modes
        )
        if np.isfinite(limit):
            fastest = modes[0].prefix[:, k + 1]
            # generous: never drops a split that fits
            back = max(back, int(np.searchsorted(fastest, fastest[end] - limit * (1 + 1e-9), side="left")))
        first[k] = min(end, back)
    return first


def _step_program(tables: _Tables, schedule: str, limit: float) -> tuple[np.ndarray, np.ndarray, int]:
    """table[k, j]: the least sum of stage times (compute + receive) over splits of nodes [0, j) whose
    last stage ends on device k, every stage's period at most ``limit`` and its memory budgeted for its
    own micro-batches in flight (:func:`_by_level`); the parents to rebuild them; and the number of
    (start, end) cells computed, the DP's work (:func:`_banded_program`)."""
    return _banded_program(tables, limit, schedule, "time")


def _banded_program(
    tables: _Tables, limit: float, schedule: str | None, value: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """table[k, j] over splits of nodes [0, j) whose last stage ends on device k, every stage keeping
    within ``limit`` its period under ``schedule`` (its stage time, compute + receive, for None) and its
    memory budgeted for its own micro-batches in flight (:func:`_by_level`); the parents of every level
    to rebuild them; and the number of (start, end) cells computed, over every level.

    ``value`` says what the table holds: "time", the least sum of stage times; "bottleneck", the least
    longest stage time; "bytes", the fewest bytes sent. Ties go to the first device, then the first start.

    A finite ``limit`` bounds how far a block reaches (:func:`_reach`), so each start's ends are a
    band, not the whole chain, and how early a block on device k may end (:func:`_viable_ends`: the
    devices after k must cover the rest). Near the least feasible limit both leave a narrow window of
    cut positions per device: the work falls from O(N^2) per device pair to O(N * band), and near
    that limit to about the window squared.
    """
    viable = _viable_ends(tables, limit)
    work = 0

    def level(level_tables: _Tables, source: np.ndarray | None, usable: int) -> tuple[np.ndarray, np.ndarray]:
        nonlocal work
        table, parent, cells = _banded_level(level_tables, limit, schedule, value, viable, source, usable)
        work += cells
        return table, parent

    table, parent = _by_level(tables, level)
    return table, parent, work


def _banded_level(
    tables: _Tables,
    limit: float,
    schedule: str | None,
    value: str,
    viable: np.ndarray,
    source: np.ndarray | None,
    usable: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """One level of :func:`_banded_program`: blocks on the first ``usable`` devices after a split of
    ``source`` (the next level's table; None: this level's own), each ending no earlier than ``viable``
    says for its device; and the number of (start, end) cells computed."""
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    table = np.full((num_devices, n + 1), np.inf)
    parent = np.full((num_devices, n + 1, 2), -1, dtype=np.int64)  # (previous device, block start)
    source = table if source is None else source
    none = np.zeros((1, 1))
    budget = max(1, 2_000_000 // len(tables.modes))  # array cells per chunk of starts
    work = 0
    for k2 in range(usable):
        zero = np.zeros(1, dtype=np.int64)
        ends = np.arange(max(1, int(viable[k2])), int(_reach(tables, k2, zero, limit)[0]) + 1)
        if len(ends):
            first = _stage_compute(tables, k2, zero[:, None], (none, none), schedule, limit, ends)[0]
            work += len(ends)
            if value == "bytes":
                first = np.where(np.isfinite(first), 0.0, np.inf)
            better = first < table[k2, ends]
            table[k2, ends[better]] = first[better]
            parent[k2, ends[better]] = (-1, 0)
        for k in range(k2):
            starts = np.flatnonzero(np.isfinite(source[k, 1:n])) + 1
            reach = _reach(tables, k2, starts, limit)
            keep = reach >= viable[k2]  # a start whose block cannot reach a viable end is no use
            starts, reach = starts[keep], reach[keep]
            if not len(starts):
                continue
            band = max(1, int((reach - np.maximum(starts, viable[k2] - 1)).max()))
            chunk = max(1, budget // band - band)  # a chunk's ends span its starts and one band
            for lo in range(0, len(starts), chunk):
                i = starts[lo : lo + chunk][:, None]
                ends = np.arange(max(int(i[0, 0]) + 1, int(viable[k2])), int(reach[lo : lo + chunk].max()) + 1)
                if not len(ends):
                    continue
                a, g = _links(tables, k, k2, i)
                stage = _stage_compute(tables, k2, i, (a, g), schedule, limit, ends) + a + g
                work += stage.size
                if value == "time":
                    cand = source[k, i] + stage
                elif value == "bottleneck":
                    cand = np.maximum(source[k, i], stage)
                else:
                    cand = np.where(np.isfinite(stage), source[k, i] + tables.out_bytes[i - 1], np.inf)
                arg = np.argmin(cand, axis=0)
                best = cand[arg, np.arange(len(ends))]
                better = best < table[k2, ends]
                table[k2, ends[better]] = best[better]
                parent[k2, ends[better], 0] = k
                parent[k2, ends[better], 1] = i[arg[better], 0]
    return table, parent, work


def _least_bottlenecks(tables: _Tables, sizes: Sequence[int]) -> list[tuple[float, Blocks]]:
    """(least bottleneck, its split of fewest bytes) on the first s of ``tables``' devices (any subset of
    them, in order), for each s of ``sizes``; (inf, ()) where none fits: from one :func:`_dynamic_program`
    table on small problems (FULL_TABLE_CELLS), else from :func:`_least_bottleneck` on each prefix."""
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    if num_devices**2 * n**2 / 2 > FULL_TABLE_CELLS:
        return [_least_bottleneck(_prefix_tables(tables, s)) for s in sizes]
    table, _ = _dynamic_program(tables)
    result: list[tuple[float, Blocks]] = []
    for s in sizes:
        least = float(table[:s, n].min())
        result.append((least, _least_bytes_split(_prefix_tables(tables, s), least) if np.isfinite(least) else ()))
    return result


def _least_bottleneck(tables: _Tables) -> tuple[float, Blocks]:
    """The least bottleneck (longest stage time) of any split on ``tables``' devices (any subset of them,
    in order), and the split of it with the fewest bytes sent (the first among ties); (inf, ()) when
    none fits.

    The same as :func:`_dynamic_program` and :func:`_least_bytes_split`, by banded programs
    (:func:`_banded_program`): at a limit at or above the least bottleneck the min-max program finds it
    exactly, below it finds none. Limits grow from a floor (the least compute spread over the devices,
    or the costliest node) by 1/64, 1/32, ... of it, so the last tried is at most about twice as far
    above the least bottleneck as needed, and each try is cheap while its limit stays near the floor;
    past a ceiling (no stage can take longer) the program runs unbanded, at most 27 tries in all.
    """
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    nodes = np.diff(tables.modes[0].prefix, axis=0).min(axis=1)
    floor = max(float(nodes.sum()) / num_devices, float(nodes.max(initial=0.0)))
    # no stage takes longer: every node in its slowest mode on its slowest device, the largest fixed
    # seconds and the slowest transfer; from there on a limit prunes nothing
    ceiling = sum(
        float(np.diff(m.prefix, axis=0).max(axis=1).sum() + (m.fixed_forward + m.fixed_backward).max())
        for m in tables.modes
    ) + 2 * float(tables.out_bytes.max(initial=0.0)) / min(min(row) for row in tables.bandwidth)
    step = floor / 64
    while True:
        # the whole table past the ceiling, or a million floors above the floor (an infinite ceiling)
        limit = floor + step if 0 < step < floor * 2**20 and floor + step < ceiling else np.inf
        table, _, _ = _banded_program(tables, limit, None, "bottleneck")
        least = float(table[:, n].min())
        if np.isfinite(least) or not np.isfinite(limit):
            break
        step *= 2
    if not np.isfinite(least):
        return least, ()
    sent, parent, _ = _banded_program(tables, least * (1 + 1e-9), None, "bytes")
    return least, _blocks(parent, int(np.argmin(sent[:, n])), n)


def _block_figures(
    tables: _Tables, previous: int, k2: int, start: int, end: int, schedule: str, limit: float = np.inf
) -> tuple[float, float, float, float] | None:
    """(f, b, a, g) of block [start, end) on k2 after a stage on ``previous`` (-1: none), in the mode
    _stage_compute chooses for it (the least compute that fits, is allowed and keeps the period within
    ``limit``; the first mode among equals), for one block in scalars; None when no mode fits."""
    a = g = 0.0
    if previous >= 0:
        size = tables.out_bytes[start - 1]
        a, g = size / tables.bandwidth[previous][k2], size / tables.bandwidth[k2][previous]
    best: tuple[float, float, float, float] | None = None
    for mode in tables.modes:
        received = mode.boundary[start - 1] if start > 0 else 0.0
        if not (end > start and mode.allowed[end]):
            continue
        if mode.mem_prefix[end] > tables.capacity[k2] + mode.mem_prefix[start] - received:
            continue
        f = float(mode.forward[end, k2] - mode.forward[start, k2] + mode.fixed_forward[k2])
        b = float(mode.backward[end, k2] - mode.backward[start, k2] + mode.fixed_backward[k2])
        if np.isfinite(limit) and _period(schedule, f, b, a, g, tables.last) > limit:
            continue
        if best is None or f + b < best[0] + best[1]:
            best = (f, b, float(a), float(g))
    return best


def _threshold_search(
    tables: _Tables,
    schedule: str,
    num_microbatches: int,
    order: int,
    incumbent: float,
    weight: float,
    least_bottleneck: float,
    least_sum: float,
) -> tuple[list[_Found], float, bool]:
    """Splits that minimise weight * sum(stage times) + (M - 1) * max(period) on ``tables``' devices
    (any subset of them in order), by bisection on the period threshold T; with a lower bound on that
    objective over every split, and whether the search finished (else it stopped after MAX_PROGRAMS DPs or
    PROGRAM_WORK cells of them).

    The DP at threshold T gives s(T), the least sum among splits whose periods are all <= T, and
    s is non-increasing in T. A split y with period p(y) in an interval (lo, hi] of thresholds has
    sum(y) >= s(hi), so its objective is at least w s(hi) + (M - 1) lo: intervals whose bound reaches
    the best objective found (``incumbent`` from other orders, then this search's) are dropped, the
    others halved. The split found at hi has period p <= hi, and no split with a period in [p, hi] beats
    it, so an interval shrinks to (lo, p] at once.

    The search starts at the least bottleneck ``least_bottleneck`` of these devices (a split within it
    exists), and above it only up to where (M - 1) * T alone exceeds the best found less
    w * ``least_sum`` (a bound on any split's sum): the DP's work is a band below the threshold
    (:func:`_step_program`), so small thresholds are cheap.
    """
    n = tables.modes[0].prefix.shape[0] - 1
    m = num_microbatches
    found: list[_Found] = []
    work = 0

    def run(limit: float) -> tuple[float, float] | None:
        nonlocal work
        table, parent, cells = _step_program(tables, schedule, limit)
        work += cells * len(tables.modes)
        k = int(np.argmin(table[:, n]))
        if not np.isfinite(table[k, n]):
            return None
        stages = _blocks(parent, k, n)
        figures = _figures(tables, stages, schedule, limit)
        assert figures is not None  # the DP found them
        total = sum(f + b + a + g for f, b, a, g in figures)
        period = max(float(_period(schedule, *x)) for x in figures)
        found.append(
            _Found(
                _split_step(schedule, m, figures),
                weight * total + (m - 1) * period,
                order,
                stages,
            )
        )
        return total, period

    # The least-bottleneck split's stages take at most ``least_bottleneck`` (compute + receive), so its
    # periods too: the DP at that threshold finds a split, an incumbent, at the cost of a narrow band.
    start = run(least_bottleneck * (1 + 1e-9)) if np.isfinite(least_bottleneck) else run(np.inf)
    if start is None:
        return found, np.inf, True
    best = min(incumbent, weight * start[0] + (m - 1) * start[1])
    # No period is below the compute of the busiest stage, at least the least sum spread over every
    # device (kept, on its fastest device: a lower bound for any mode) or the costliest node.
    nodes = np.diff(tables.modes[0].prefix, axis=0).min(axis=1)
    floor = max(least_sum / len(tables.capacity), float(nodes.max(initial=0.0))) * (1 - 1e-9)
    heap = [
        (weight * start[0] + (m - 1) * floor, floor, start[1], start[0])
    ]  # (bound, lo, hi, s(hi)): periods in (lo, hi]
    programs = 1
    # A split whose period exceeds T_max cannot beat ``best``: w * sum >= w * least_sum.
    top = (best - weight * least_sum) / (m - 1) if m > 1 else np.inf
    if top > least_bottleneck * (1 + 1e-9):
        result = run(top)
        programs += 1
        if result is not None and result[1] > least_bottleneck:
            best = min(best, weight * result[0] + (m - 1) * result[1])
            heapq.heappush(heap, (weight * result[0] + (m - 1) * least_bottleneck, least_bottleneck, *result[::-1]))
    while heap and heap[0][0] < best * (1 - STEP_TOLERANCE) and programs < MAX_PROGRAMS and work < PROGRAM_WORK:
        _, lo, hi, at_hi = heapq.heappop(heap)
        mid = (lo + hi) / 2
        result = run(mid)
        programs += 1
        if result is not None:
            at_mid, period = result
            best = min(best, weight * at_mid + (m - 1) * period)
            heapq.heappush(heap, (weight * at_mid + (m - 1) * lo, lo, period, at_mid))
        heapq.heappush(heap, (weight * at_hi + (m - 1) * mid, mid, hi, at_hi))
    complete = not heap or heap[0][0] >= best * (1 - STEP_TOLERANCE)
    bound = min(best, heap[0][0]) if heap else best
    return found, bound, complete


class _LastBlocks(NamedTuple):
    """The pipelines a DP at a period threshold P offers: each a split of the stages before the last (every
    period within P, the least sum of stage times) and a last block on a later device, to the chain's end."""

    before: np.ndarray  # [c]: the stage times before the last block, summed (0: the last block is alone)
    alone: np.ndarray  # [c]: the last block's stage time plus (M - 1) times its period (last_period)
    device: np.ndarray  # [c]: the last block's device
    previous: np.ndarray  # [c]: the device of the stage before it (-1: none)
    start: np.ndarray  # [c]: the last block's first node
    parents: np.ndarray  # the DP's parents of the levels before the last ([level - 2, k, j])

    def least(self, weight: float, period: float) -> tuple[float, int]:
        """The least least_bound (ScheduleFamily.least_bound) a pipeline here can have if the stages
        before its last have periods up to ``period`` (M - 1 = ``weight``), and the pipeline giving it:
        max(the whole pipeline's A term, the stages before the last's B term at that period)."""
        steady = weight * period if weight else 0.0  # (M = 1: nothing; 0 x inf is nan)
        values = np.maximum(self.before + self.alone, self.before + np.where(self.previous >= 0, steady, 0.0))
        if not len(values):
            return np.inf, -1
        least = float(values.min())
        # among equals (M = 1 and free links: every split), the one with the least last block
        ties = np.flatnonzero(values <= least * (1 + 1e-12))
        index = int(ties[np.argmin(self.alone[ties])])
        return least, index

    def blocks(self, index: int, n: int) -> Blocks:
        """The split of pipeline ``index``."""
        parents = np.concatenate([self.parents[:1], self.parents])  # level 1's own, for the last block
        parents[0, self.device[index], n] = (self.previous[index], self.start[index])
        return _blocks(parents, int(self.device[index]), n)


def _last_blocks(tables: _Tables, schedule: str, weight: float, limit: float, reach: float) -> tuple[_LastBlocks, int]:
    """The DP of :func:`_closed_form_search` at period threshold ``limit``: the least sum of stage times
    over splits before the last stage whose every period is at most ``limit`` (levels 2 and up, banded),
    then every last block after one of them whose compute is within ``reach``, with its stage time and
    period; and the (start, end) cells computed."""
    num_devices, n = len(tables.capacity), tables.modes[0].prefix.shape[0] - 1
    viable = _viable_ends(tables, max(limit, reach))
    source, parents, work = None, [], 0
    # levels R..2; a single level (memory alike everywhere, M = 1) serves the stages before the last too
    for r in range(len(tables.levels), 1, -1) if len(tables.levels) > 1 else (1,):
        table, parent, cells = _banded_level(
            _level(tables, r), limit, schedule, "time", viable, source, num_devices - max(r, 2) + 1
        )
        source, work = table, work + cells
        parents.append(parent)
    last = _level(tables, 1)._replace(last=True)  # the last block, whatever the number of levels

    columns: list[list[np.ndarray]] = [[], [], [], [], []]
    end = np.array([n])
    for k2 in range(num_devices):
        groups = [(-1, np.zeros(1, dtype=np.int64))]
        if source is not None:
            groups += [(k, np.flatnonzero(np.isfinite(source[k, 1:n])) + 1) for k in range(k2)]
        for k, starts in groups:
            if not len(starts):
                continue
            a, g = (np.zeros((1, 1)), np.zeros((1, 1))) if k < 0 else _links(last, k, k2, starts[:, None])
            compute = _stage_compute(last, k2, starts[:, None], (a, g), schedule, reach, end)[:, 0]
            work += len(starts)
            keep = np.isfinite(compute)
            a, g = np.broadcast_to(a[:, 0], compute.shape)[keep], np.broadcast_to(g[:, 0], compute.shape)[keep]
            # the schedule's last_period, of the block's compute f + b (a last stage's period depends on it alone)
            period = _period(schedule, compute[keep], 0.0, a, g, last=True)
            alone = np.full(compute.shape, np.inf)
            alone[keep] = compute[keep] + a + g + weight * period
            before = np.zeros(len(starts)) if k < 0 or source is None else source[k, starts]
            devices = (np.full(len(starts), k2), np.full(len(starts), k))
            for column, values in zip(columns, (before, alone, *devices, starts)):
                column.append(values[keep])
    joined = [np.concatenate(c) if c else np.zeros(0) for c in columns]
    result = _LastBlocks(
        joined[0],
        joined[1],
        joined[2].astype(np.int64),
        joined[3].astype(np.int64),
        joined[4].astype(np.int64),
        np.stack(parents[::-1]),
    )
    return result, work


def _closed_form_search(
    tables: _Tables,
    schedule: str,
    num_microbatches: int,
    order: int,
    incumbent: float,
    least_bottleneck: float,
) -> tuple[list[_Found], float, bool]:
    """Splits of the least ``ScheduleFamily.least_bound`` on ``tables``' devices (any subset of them in
    order), for a schedule with a closed form of the step whose last stage runs apart (GPipe), by
    bisection on the threshold P of the periods of the stages before the last; with a lower bound on
    every split's step there, and whether the search finished (else it stopped after MAX_PROGRAMS DPs or
    PROGRAM_WORK cells of them).

    least_bound = max(W + (M - 1) q, C + (M - 1) p), with W the sum of stage times, C that of the stages
    before the last, p their largest period and q the last stage's, is at most the step
    (docs/cost-model.md, "GPipe's step"). The DP at threshold P (:func:`_last_blocks`) gives, for
    every last block, the least C of the stages before it with periods within P: a split y with p(y) in
    an interval (lo, hi] of thresholds has least_bound(y) >= the least over hi's pipelines of
    max(W + (M - 1) q, C + (M - 1) lo), so intervals whose bound reaches the shortest step found
    (``incumbent`` from other orders, then this search's) are dropped, the others halved; an interval
    narrower than STEP_TOLERANCE keeps its bound. Every split met is kept with its exact step
    (``closed_step``) for the caller to rank. The search starts at the least bottleneck
    ``least_bottleneck`` of these devices (a split within it exists), and covers the periods above it up
    to where M P reaches the shortest step found (C holds the stage of period p, whose stage time is at
    least p, so least_bound >= M p); last blocks whose M q exceeds the shortest step are left out (W >= q).
    ``complete`` says no open interval can win; an interval settled for its width keeps its bound in the
    returned one, which is what a plan's "optimal" is judged against.
    """
    family = schedule_family(schedule)
    n = tables.modes[0].prefix.shape[0] - 1
    m = num_microbatches
    weight = float(m - 1)
    found: list[_Found] = []
    work = 0
    best = incumbent

    def run(limit: float) -> _LastBlocks:
        nonlocal work, best
        # the last block's compute c: least_bound >= its stage time + (M - 1) q >= M c, at most the step
        reach = best / m if np.isfinite(best) else np.inf
        pipelines, cells = _last_blocks(tables, schedule, weight, limit, reach)
        work += cells * len(tables.modes)
        value, index = pipelines.least(weight, limit)
        if np.isfinite(value):
            stages = pipelines.blocks(index, n)
            figures = _figures(tables, stages, schedule)
            assert figures is not None  # the DP found them
            step, bound = family.closed_step(m, figures), family.least_bound(m, figures)
            assert step is not None and bound is not None  # a schedule with a closed form (the caller's check)
            found.append(_Found(step, bound, order, stages))
            best = min(best, found[-1].step)
        return pipelines._replace(parents=pipelines.parents[:0])  # the bounds need no parents

    start = least_bottleneck * (1 + 1e-9) if np.isfinite(least_bottleneck) else np.inf
    at_start = run(start)
    if not found:
        return found, np.inf, True
    heap: list[tuple[float, float, float, int]] = []  # (bound, lo, hi, index of hi's pipelines): periods in (lo, hi]
    kept = [at_start]

    def push(lo: float, hi: float, index: int) -> None:
        heapq.heappush(heap, (kept[index].least(weight, lo)[0], lo, hi, index))

    push(0.0, start, 0)
    programs = 1
    # A split whose periods before the last exceed T_max cannot beat ``best``: its least_bound is at least
    # C + (M - 1) p >= M p (C holds the stage of period p, whose stage time is at least p).
    top = best / m
    if np.isfinite(start) and top > start:
        kept.append(run(top))
        programs += 1
        push(start, top, 1)
    settled: list[float] = []
    while heap and heap[0][0] < best * (1 - STEP_TOLERANCE) and programs < MAX_PROGRAMS and work < PROGRAM_WORK:
        bound, lo, hi, index = heapq.heappop(heap)
        if hi - lo <= STEP_TOLERANCE * hi:
            settled.append(bound)  # as narrow as the tolerance: its bound stands
            continue
        mid = (lo + hi) / 2
        kept.append(run(mid))
        programs += 1
        push(lo, mid, len(kept) - 1)
        push(mid, hi, index)
    open_bounds = [b for b, *_ in heap]
    complete = not heap or heap[0][0] >= best * (1 - STEP_TOLERANCE)
    return found, min([best, *settled, *open_bounds]), complete


def _bottleneck_splits(
    tables: _Tables, bottlenecks: list[tuple[float, Blocks]], order: int, costs: CostModel
) -> list[_Found]:
    """The least-bottleneck splits (fewest bytes among ties) of :func:`_least_bottleneck` on each prefix
    of ``tables``' devices (``bottlenecks``), as starts for the 1F1B local search."""
    result = []
    for least, split in bottlenecks:
        figures = _figures(tables, split, costs.schedule) if np.isfinite(least) else None
        if figures is not None:
            result.append(_Found(_split_step(costs.schedule, costs.num_microbatches, figures), np.inf, order, split))
    return result


def _figures(
    tables: _Tables, blocks: Blocks, schedule: str, limit: float = np.inf
) -> list[tuple[float, float, float, float]] | None:
    """(f, b, a, g) of each stage of ``blocks``, or None when a block fits in no mode (each budgeted for
    its own micro-batches in flight)."""
    figures = []
    previous = -1
    for s, (k, start, end) in enumerate(blocks):
        block = _block_figures(_level(tables, len(blocks) - s), previous, k, start, end, schedule, limit)
        if block is None:
            return None
        figures.append(block)
        previous = k
    return figures
