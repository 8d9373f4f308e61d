"""The bottleneck DP for chains (the least time of the slowest stage), and the tables every chain planner reads.

For a chain of N layers and K devices in pipeline order, every legal plan cuts the chain into
contiguous blocks on increasing devices (some devices may stay empty). A block's compute and memory
are those of its mode (partitioner.cost.mode_cost): kept, or recomputed (forward twice, the received
tensor held per micro-batch in flight and the block's activations once), the fastest that fits and the
recompute policy allows (never the last block).

The bottleneck objective (``objective="bottleneck"``), with ``f[k][j]`` the best bottleneck that puts
layers ``[0, j)`` on devices up to ``k`` with layer ``j - 1`` on ``k``::

    f[k'][j] = min over k < k', i < j of  max(f[k][i], compute(k', i, j) + bytes(i - 1) / bw(k, k'))
               subject to memory(i, j) <= capacity(k')

O(K^2 N^2) work per mode, vectorised over j. This is the chain case of the dynamic programs of
PipeDream (Narayanan et al., SOSP 2019) and of Tarnawski et al., "Efficient algorithms for device
placement of DNN graph operators" (NeurIPS 2020), with our cost model (docs/cost-model.md).

Memory: each block is budgeted for the micro-batches its stage holds, in_flight(K - s) (M for GPipe but
1 on its last stage, min(K - s, M) for 1F1B on stage s of K), the figure :meth:`CostModel.evaluate`
charges. K - s is the number of stages from s to the end of the pipeline, so every DP carries it as a
*level*: the table of level r holds splits whose last block has r stages from it to the end (itself
included), and a block of level r follows one of level r + 1 (:func:`_by_level`). Levels that budget
alike are one: the top level R stands for every r >= R and follows itself (GPipe: R = 2, the last
stage and the others; 1F1B: R = min(number of devices, M)). The answer is level 1's (the last stage) at
the chain's end. A block of level r leaves r - 1 stages for later devices, so only the first D - r + 1
devices take it: about K^3 N^2 / 6 block figures for 1F1B with M >= K, three times one table of every
device (K^2 N^2 / 2). Where the whole chain fits the smallest device at the top level's budget, memory
cannot bind and the top level alone serves every stage (:func:`_memory_binds`), but for GPipe, whose
last stage paces the step otherwise (``ScheduleFamily.distinct_last``): its two levels stay. The banded programs of
partitioner.search.threshold_search go level by level too; their viable ends (``_viable_ends``) budget
every block as the last stage (level 1, the most room), so they drop no split that fits, whatever its
blocks' levels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from partitioner.cost import CostModel, in_flight, mode_cost
from partitioner.schedule import schedule_family


class _Mode(NamedTuple):
    """One mode's figures along the chain (partitioner.cost.mode_cost), as the DP reads them."""

    prefix: np.ndarray  # [i, k]: seconds of nodes [0, i) on device k in this mode
    forward: np.ndarray  # [i, k]: seconds of the forward passes of nodes [0, i) on device k in this mode
    backward: np.ndarray  # [i, k]: seconds of their backward passes (prefix = forward + backward)
    mem_prefix: np.ndarray  # [i]: bytes budgeted for nodes [0, i) in this mode
    boundary: np.ndarray  # [i]: bytes a stage in this mode budgets for receiving node i's output
    allowed: np.ndarray  # [j]: whether a stage ending just before node j may take this mode
    # [k]: the fixed seconds a stage's forward and backward pay on device k (action_overhead_s, per mode_cost)
    fixed_forward: np.ndarray
    fixed_backward: np.ndarray


Blocks = tuple[tuple[int, int, int], ...]  # (device index in the order, first node, end node) per stage


class _Tables(NamedTuple):
    """What the DP reads: the modes' figures along the chain, and each device's memory and links."""

    modes: list[_Mode]  # budgeted for one level's micro-batches in flight (levels[-1] unless _level chose)
    capacity: list[int]
    out_bytes: np.ndarray
    bandwidth: list[list[float]]
    # [r - 1]: the modes budgeted for a stage r stages from the pipeline's end (itself included), r = 1..R;
    # the last also for every r > R (module docstring, "Memory")
    levels: tuple[list[_Mode], ...]
    # True for level 1 of several (_level): blocks that end the pipeline, whose period is the schedule's
    # last stage's (ScheduleFamily.last_period); a single level serves every stage
    last: bool = False


def _level(tables: _Tables, r: int) -> _Tables:
    """``tables`` budgeted for a stage r stages from the end of the pipeline (itself included)."""
    return tables._replace(modes=tables.levels[min(r, len(tables.levels)) - 1], last=r == 1 and len(tables.levels) > 1)


def _prefix_tables(tables: _Tables, num_devices: int) -> _Tables:
    """``tables`` for the first ``num_devices`` devices only."""
    s = num_devices

    def cut(modes: list[_Mode]) -> list[_Mode]:
        return [
            m._replace(
                prefix=m.prefix[:, :s],
                forward=m.forward[:, :s],
                backward=m.backward[:, :s],
                fixed_forward=m.fixed_forward[:s],
                fixed_backward=m.fixed_backward[:s],
            )
            for m in modes
        ]

    return _Tables(
        cut(tables.modes),
        tables.capacity[:s],
        tables.out_bytes,
        [row[:s] for row in tables.bandwidth[:s]],
        tuple(cut(modes) for modes in tables.levels),
        tables.last,
    )


def _rebuild(costs: CostModel, tables: _Tables, optimum: float) -> dict[str, str]:
    """The split with the fewest bytes sent among those whose every stage takes at most ``optimum``."""
    return {
        v: costs.devices[k] for k, start, end in _least_bytes_split(tables, optimum) for v in costs.order[start:end]
    }


def _least_bytes_split(tables: _Tables, optimum: float) -> Blocks:
    """The blocks of :func:`_rebuild`'s split."""
    n = tables.modes[0].prefix.shape[0] - 1
    sent, parent = _dynamic_program(tables, limit=optimum * (1 + 1e-9))
    return _blocks(parent, int(np.argmin(sent[:, n])), n)


def _blocks(parent: np.ndarray, last: int, n: int) -> Blocks:
    """The split a DP's ``parent`` table ([level - 1, k, j], :func:`_by_level`) gives for nodes [0, n)
    ending on device ``last`` (the last stage: level 1)."""
    blocks, k, j, level = [], last, n, 0
    while j > 0:
        k_prev, i = (int(x) for x in parent[level, k, j])
        blocks.append((k, i, j))
        k, j, level = k_prev, i, min(level + 1, len(parent) - 1)
    return tuple(reversed(blocks))


def _by_level(
    tables: _Tables, program: Callable[[_Tables, np.ndarray | None, int], tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """Runs a DP level by level (module docstring, "Memory"): table[k, j] of level 1 (the last stage ends
    on device k at node j), and the parents of every level, [level - 1, k, j].

    ``program(level_tables, source, num_devices)`` fills one level's table from ``source``, the table
    of the level after it (None: its own, for the top level, which stands for every level above it),
    for blocks on the first ``num_devices`` devices only (D - r + 1 at level r: r - 1 stages follow).
    """
    num_devices = len(tables.capacity)
    source, parents = None, []
    for r in range(len(tables.levels), 0, -1):
        table, parent = program(_level(tables, r), source, num_devices - r + 1)
        source = table
        parents.append(parent)
    assert source is not None  # there is at least one level
    return source, np.stack(parents[::-1])


def _solve_chain(costs: CostModel) -> tuple[dict[str, str], float] | None:
    """The least-bottleneck split of ``costs.graph`` (a chain), fewest bytes among ties; None if none fits."""
    tables = _tables(costs)
    best, _ = _dynamic_program(tables)
    optimum = float(best[:, len(costs.order)].min())
    if not np.isfinite(optimum):
        return None
    return _rebuild(costs, tables, optimum), optimum


def _in_flight_levels(costs: CostModel) -> list[int]:
    """[r - 1]: the micro-batches a stage r stages from the end of its pipeline (itself included) holds,
    for r = 1..R, with R the least level from which every stage holds as many (module docstring, "Memory").

    ``in_flight(schedule, K, M, s)`` depends on K - s alone (for GPipe M, 1 on the last stage; min(K - s,
    M) for 1F1B), so a stage r from the end of any pipeline holds in_flight(schedule, r, M, 0).

    Example:
        >>> import partitioner as pt
        >>> graph, cluster = pt.chain_graph([1e9] * 6), pt.Cluster.uniform(4, memory="1GiB")
        >>> _in_flight_levels(pt.CostModel(graph, cluster, num_microbatches=3, schedule="1f1b"))
        [1, 2, 3]
        >>> _in_flight_levels(pt.CostModel(graph, cluster, num_microbatches=3, schedule="gpipe"))
        [1, 3]
    """
    m = costs.num_microbatches
    held = [in_flight(costs.schedule, r, m, 0) for r in range(1, len(costs.devices) + 1)]
    while len(held) > 1 and held[-2] == held[-1]:
        held.pop()
    return held


def _memory_binds(costs: CostModel, num_in_flight: int) -> bool:
    """False when the whole chain, in every mode with ``num_in_flight`` micro-batches and its largest
    received tensor, fits the smallest device: then every block fits wherever it goes, at this budget
    and every smaller one, and one level serves every stage."""
    smallest = min(d.memory_bytes for d in costs.cluster.devices)
    for mode in costs.modes:
        whole = sum(costs.node_memory_bytes(mode, num_in_flight).values())
        received = max(_received(costs, mode, num_in_flight).values(), default=0)
        if whole + received > smallest:
            return True
    return False


def _received(costs: CostModel, mode: str, num_in_flight: int) -> dict[str, int]:
    """{node: bytes} a chain's stage holding ``num_in_flight`` needs for receiving the node's output: from the
    stage right before it, which holds ``ScheduleFamily.window_before`` micro-batches."""
    sender = schedule_family(costs.schedule).window_before(costs.num_microbatches, num_in_flight)
    return costs.input_memory_bytes(mode, num_in_flight, sender)


def _tables(costs: CostModel) -> _Tables:
    """The DP's inputs for ``costs`` (a chain), each level budgeted for its micro-batches in flight."""
    held = _in_flight_levels(costs)
    if len(held) > 1 and not _memory_binds(costs, held[-1]):
        # the top level's tables are every level's; one level serves every stage, or two where the
        # schedule paces its last stage otherwise (GPipe: ScheduleFamily.distinct_last)
        held = held[-1:] * (2 if schedule_family(costs.schedule).distinct_last else 1)
    levels = tuple(_modes(costs, c) for c in held)
    k_total = len(costs.devices)
    capacity = [d.memory_bytes for d in costs.cluster.devices]
    out_bytes = np.array([costs.out_bytes[v] for v in costs.order], dtype=np.float64)
    bandwidth = [[costs.cluster.bandwidth(k, k2) for k2 in range(k_total)] for k in range(k_total)]
    return _Tables(levels[-1], capacity, out_bytes, bandwidth, levels)


def _modes(costs: CostModel, num_in_flight: int) -> list[_Mode]:
    """The figures of ``costs.modes`` along the chain, memory budgeted for ``num_in_flight`` micro-batches."""
    order = costs.order
    n, k_total = len(order), len(costs.devices)
    last = np.arange(n + 1) == n  # a block ending at n is the last stage: never recomputed
    modes = []
    for mode in costs.modes:
        compute = np.array([costs.mode_compute_s[mode][v] for v in order])  # [node, device]
        node = [[costs.node_cost(v, mode, k) for k in range(k_total)] for v in order]
        forward = np.array([[c.forward_s for c in row] for row in node]).reshape(n, k_total)
        backward = np.array([[c.backward_s for c in row] for row in node]).reshape(n, k_total)
        memory = costs.node_memory_bytes(mode, num_in_flight)
        received = _received(costs, mode, num_in_flight)
        overhead = np.array(costs.action_overhead_s, dtype=np.float64)
        fixed = mode_cost(mode, forward_s=1.0, backward_s=1.0)  # how often each pass pays it in this mode
        modes.append(
            _Mode(
                prefix=np.vstack([np.zeros(k_total), np.cumsum(compute, axis=0)]),
                forward=np.vstack([np.zeros(k_total), np.cumsum(forward, axis=0)]),
                backward=np.vstack([np.zeros(k_total), np.cumsum(backward, axis=0)]),
                mem_prefix=np.concatenate([[0], np.cumsum([memory[v] for v in order])]).astype(np.float64),
                boundary=np.array([received[v] for v in order], dtype=np.float64),
                allowed=~last if mode == "recomputed" else (last if costs.recompute == "always" else ~last | last),
                fixed_forward=fixed.forward_s * overhead,
                fixed_backward=fixed.backward_s * overhead,
            )
        )
    return modes


def _dynamic_program(tables: _Tables, limit: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fills table[k, j] over layers [0, j) with layer j - 1 on device k, the last stage, and the parents
    to rebuild it (:func:`_by_level`: each stage budgeted for its own micro-batches in flight).

    A block takes the fastest of ``modes`` that fits and is allowed for it. Without ``limit`` the table
    holds the least bottleneck (min-max); with it, the fewest bytes sent (min-sum) over splits whose
    every stage takes at most ``limit`` seconds.
    """
    return _by_level(tables, lambda level, source, usable: _level_program(level, source, usable, limit))


def _level_program(
    tables: _Tables, source: np.ndarray | None, usable: int, limit: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """One level of :func:`_dynamic_program`: blocks on the first ``usable`` devices after a split of
    ``source`` (the next level's table; None: this level's own)."""
    modes, capacity, out_bytes, bandwidth = tables.modes, tables.capacity, tables.out_bytes, tables.bandwidth
    num_devices, n = modes[0].prefix.shape[1], modes[0].prefix.shape[0] - 1
    table = np.full((num_devices, n + 1), np.inf)
    parent = np.full((num_devices, n + 1, 2), -1, dtype=np.int64)  # (previous device, block start)
    source = table if source is None else source
    for k2 in range(usable):
        first = np.full(n + 1, np.inf)  # the first block starts the chain on k2: nothing received
        for mode in modes:
            fits = (mode.mem_prefix <= capacity[k2]) & mode.allowed
            fixed = mode.fixed_forward[k2] + mode.fixed_backward[k2]
            first = np.minimum(first, np.where(fits, mode.prefix[:, k2] + fixed, np.inf))
        if limit is not None:
            first = np.where(first <= limit, 0.0, np.inf)
        first[0] = np.inf
        better = first < table[k2]
        table[k2][better] = first[better]
        parent[k2][better] = (-1, 0)
        for k in range(k2):
            receive = out_bytes / bandwidth[k][k2] + out_bytes / bandwidth[k2][k]  # as CostModel.receive_s
            byte_limit = None if limit is None else (out_bytes, limit)
            _relax(table, parent, source, k, k2, modes, capacity[k2], receive, byte_limit)
    return table, parent


def _relax(
    best: np.ndarray,
    parent: np.ndarray,
    source: np.ndarray,
    k: int,
    k2: int,
    modes: list[_Mode],
    capacity: int,
    receive: np.ndarray,
    byte_limit: tuple[np.ndarray, float] | None = None,
) -> None:
    """Improves best[k2, j] with blocks [i, j) on k2 after a block ending at i - 1 on k, of ``source`` (in place).

    Without ``byte_limit`` ``best`` holds bottlenecks (min-max). With ``byte_limit=(out_bytes, T)``
    it holds bytes sent (min-sum) over splits whose every stage takes at most T seconds.
    """
    n = modes[0].prefix.shape[0] - 1
    starts = np.flatnonzero(np.isfinite(source[k, 1:n])) + 1  # i in [1, n) with a finite source[k, i]
    ends = np.arange(n + 1)
    chunk = max(1, 2_000_000 // ((n + 1) * len(modes)))
    for lo in range(0, len(starts), chunk):
        i = starts[lo : lo + chunk][:, None]
        after = ends[None, :] > i
        stage = np.full((len(i), n + 1), np.inf)
        for mode in modes:
            prefix = mode.prefix[:, k2]
            held = mode.mem_prefix[None, :] - mode.mem_prefix[i] + mode.boundary[i - 1]
            fits = after & (held <= capacity) & mode.allowed[None, :]
            fixed = mode.fixed_forward[k2] + mode.fixed_backward[k2]
            stage = np.minimum(stage, np.where(fits, prefix[None, :] - prefix[i] + fixed + receive[i - 1], np.inf))
        valid = np.isfinite(stage)
        if byte_limit is None:
            cand = np.maximum(source[k, i], stage)
        else:
            cand = source[k, i] + byte_limit[0][i - 1]
            valid &= stage <= byte_limit[1]
        cand = np.where(valid, cand, np.inf)
        arg = np.argmin(cand, axis=0)
        value = cand[arg, ends]
        better = value < best[k2]
        best[k2][better] = value[better]
        parent[k2, better, 0] = k
        parent[k2, better, 1] = i[arg[better], 0]
