"""The local search for chains under 1F1B: a split improved by moving, splitting and merging its stages.

1F1B has no closed form (a stage's warm-up forwards and its first backward wait on different stages).
Its step is still exact for a given split: ``_split_step`` (partitioner.search.threshold_search)
replays the schedule on the stages' (f, b, a, g) (partitioner.simulate.chain_step), the simulator's step
without its spans (on devices of their own: a shared processor, ``Device.pool``, is the simulator's alone).
The search is not exact: the threshold searches (weighing sum and period as
ONE_F_ONE_B_WEIGHTS of partitioner.search.chain say) and the
least-bottleneck split of every prefix of devices give starts, and a local search
(:func:`_local_search`: boundaries moved, stages split, merged or moved to an idle device) improves the
LOCAL_STARTS (partitioner.search.chain) shortest, scored by the replay (the searches side by side, each
round's neighbours of all of them replayed together, each split once). On the 200 1F1B cases of
benchmarks/planner_quality ("Random chains against brute force") every plan is within 0.1% of the best
enumerated; hypothesis found one 0.33% off (tests/partitioner/test_exact_step.py).
"""

from __future__ import annotations

import dataclasses

from partitioner.search.bottleneck_dp import Blocks, _level, _Tables
from partitioner.search.threshold_search import _block_figures, _Found, _split_steps

LOCAL_ROUNDS = 32  # moves at most from each start
LOCAL_WINDOW = 16  # nodes a boundary moves at most, and cut points tried per stage split


def _neighbours(blocks: Blocks, num_devices: int) -> list[Blocks]:
    """Splits one move away from ``blocks``: a boundary moved, a stage split onto an idle device
    between its neighbours', two stages merged, or a stage moved to such an idle device. On long
    chains a boundary moves at most LOCAL_WINDOW nodes and a stage splits at most at LOCAL_WINDOW points."""
    result: list[Blocks] = []
    used = {k for k, _, _ in blocks}
    count = len(blocks)
    for s in range(count):
        k, start, end = blocks[s]
        low = blocks[s - 1][0] if s > 0 else -1
        high = blocks[s + 1][0] if s + 1 < count else num_devices
        idle = [d for d in range(low + 1, high) if d not in used]
        for d in idle:  # the stage on another device
            result.append((*blocks[:s], (d, start, end), *blocks[s + 1 :]))
        cuts = range(start + 1, end)
        if len(cuts) > LOCAL_WINDOW:
            cuts = range(start + 1, end, -(-len(cuts) // LOCAL_WINDOW))
        for cut in cuts:  # split: one part stays on k, the other goes to an idle device on its side
            for d in idle:
                pair = ((k, start, cut), (d, cut, end)) if d > k else ((d, start, cut), (k, cut, end))
                result.append((*blocks[:s], *pair, *blocks[s + 1 :]))
        if s + 1 < count:
            k2, _, end2 = blocks[s + 1]
            for d in (k, k2):  # merge with the next stage
                result.append((*blocks[:s], (d, start, end2), *blocks[s + 2 :]))
            lo, hi = max(start + 1, end - LOCAL_WINDOW), min(end2 - 1, end + LOCAL_WINDOW)
            for cut in range(lo, hi + 1):  # move the boundary
                if cut != end:
                    result.append((*blocks[:s], (k, start, cut), (k2, cut, end2), *blocks[s + 2 :]))
    return result


@dataclasses.dataclass
class _Walk:
    """One local search of :func:`_local_search`: where it stands, the best split it visited, its path."""

    current: Blocks
    current_step: float
    best: Blocks
    shortest: float  # the step of ``best``
    visited: set[Blocks]
    candidates: list[Blocks] = dataclasses.field(default_factory=list)  # this round's unvisited neighbours


def _local_search(tables: _Tables, schedule: str, num_microbatches: int, starts: list[_Found]) -> list[_Found]:
    """Each of ``starts`` improved by :func:`_neighbours` moves: for 1F1B, whose step the threshold
    search's objective only approximates, and for GPipe where stages differ in forward share. Each round
    moves to the neighbour of the shortest step (:func:`_split_step`) not visited yet, sideways too
    (equal steps, plateaus), and stops when every neighbour is worse or after LOCAL_ROUNDS rounds; the
    best split visited is returned, one per start.

    The searches run side by side, one round of all of them at a time, so that the neighbours of every
    search are replayed together (one partitioner.simulate.chain_step per stage count) and a split met
    by several searches, or again, is replayed once: each search takes the path it would take alone.
    """
    num_devices = len(tables.capacity)
    blocks_seen: dict[tuple[int, int, int, int, int], tuple[float, float, float, float] | None] = {}
    levels = [_level(tables, r) for r in range(1, len(tables.levels) + 1)]
    steps: dict[Blocks, float | None] = {}  # the step of each split met, None where a block fits no mode

    def figures_of(split: Blocks) -> list[tuple[float, float, float, float]] | None:
        figures, previous = [], -1
        for s, (k, start, end) in enumerate(split):
            level = min(len(split) - s, len(levels))  # its micro-batches in flight (bottleneck_dp, "Memory")
            key = (previous, k, start, end, level)
            if key not in blocks_seen:
                blocks_seen[key] = _block_figures(levels[level - 1], previous, k, start, end, schedule)
            block = blocks_seen[key]
            if block is None:
                return None
            figures.append(block)
            previous = k
        return figures

    walks = [_Walk(f.blocks, f.step, f.blocks, f.step, {f.blocks}) for f in starts]
    active = list(walks)
    for _ in range(LOCAL_ROUNDS):
        pending: dict[Blocks, list[tuple[float, float, float, float]]] = {}
        for walk in active:
            walk.candidates = [c for c in _neighbours(walk.current, num_devices) if c not in walk.visited]
            for candidate in walk.candidates:
                if candidate not in steps and candidate not in pending:
                    figures = figures_of(candidate)
                    if figures is None:
                        steps[candidate] = None
                    else:
                        pending[candidate] = figures
        steps.update(zip(pending, _split_steps(schedule, num_microbatches, list(pending.values()))))
        moved = []
        for walk in active:
            scored = [(step, c) for c in walk.candidates if (step := steps[c]) is not None]
            if not scored:
                continue
            value, candidate = min(scored)
            if value > walk.current_step * (1 + 1e-12):
                continue
            walk.visited.add(candidate)
            walk.current, walk.current_step = candidate, value
            if value < walk.shortest * (1 - 1e-12):
                walk.best, walk.shortest = candidate, value
            moved.append(walk)
        active = moved
        if not active:
            break
    return [found._replace(step=walk.shortest, blocks=walk.best) for found, walk in zip(starts, walks)]
