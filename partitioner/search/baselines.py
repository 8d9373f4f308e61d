"""The splits users get from other tools today, scored by our cost model for comparison.

Each baseline cuts the graph's topological order into contiguous blocks, one per device in
pipeline order (contiguous blocks of a topological order never send activations backward):

- ``uniform``: equal numbers of layers per stage (DeepSpeed ``partition_method="uniform"``).
- ``by_params``: balances parameter bytes (DeepSpeed ``partition_method="parameters"``).
- ``by_time``: balances per-layer compute time (torchgpipe ``balance_by_time``).

None of them looks at memory, transfers or device speed; ``plan.fits_memory`` says whether the
result fits. ``recompute`` ("never", "always", "auto") sets the stages' modes of the split they make
(partitioner.cost), not the split itself. Cuts never fall between the calls of a shared layer (they stay on one device).
Block boundaries minimise the largest block's weight (binary search + greedy fill).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import networkx as nx

from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.errors import InputError
from partitioner.graph import colocation_groups
from partitioner.plan import Plan
from partitioner.problem import Reductions
from partitioner.score import score_assignment

__all__ = ["BASELINES", "by_params", "by_time", "split_balanced", "split_even", "split_with", "uniform"]


def check_stage_count(costs: CostModel) -> None:
    """Raises InputError when there are more devices than nodes to put on them."""
    num_nodes, num_devices = len(costs.order), len(costs.devices)
    if num_devices > num_nodes:
        raise InputError(
            f"The cluster has {num_devices} devices but the graph has only {num_nodes} nodes; every stage "
            f"needs at least one node. Use at most {num_nodes} devices."
        )


def _greedy_blocks(weights: Sequence[float], limit: float) -> list[int]:
    """Block start indices when each block is filled up to ``limit``."""
    starts, total = [0], 0.0
    for i, w in enumerate(weights):
        if total + w > limit and total > 0:
            starts.append(i)
            total = 0.0
        total += w
    return starts


def split_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Cuts ``weights`` into at most ``num_parts`` contiguous blocks minimising the largest block sum.

    Returns the block index of every item. With zero-weight items the blocks still use every part
    when there are enough items, as DeepSpeed's ``partition_balanced`` does.

    Example:
        >>> split_balanced([1, 1, 1, 3], 2)
        [0, 0, 0, 1]
    """
    n = len(weights)
    lo, hi = max(weights, default=0.0), float(sum(weights))
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if len(_greedy_blocks(weights, mid)) <= num_parts:
            hi = mid
        else:
            lo = mid
    starts = _greedy_blocks(weights, hi)
    # Use spare parts by splitting the longest blocks (keeps the max, uses every device).
    while len(starts) < min(num_parts, n):
        ends = [*starts[1:], n]
        longest = max(range(len(starts)), key=lambda b: ends[b] - starts[b])
        if ends[longest] - starts[longest] < 2:
            break
        starts.insert(longest + 1, (starts[longest] + ends[longest] + 1) // 2)
    block, labels = 0, []
    for i in range(n):
        while block + 1 < len(starts) and i >= starts[block + 1]:
            block += 1
        labels.append(block)
    return labels


def split_even(num_items: int, num_parts: int) -> list[int]:
    """Cuts ``num_items`` items into ``num_parts`` contiguous blocks whose sizes differ by at most one.

    The first ``num_items % num_parts`` blocks get the extra item, as DeepSpeed's ``partition_uniform``.

    Example:
        >>> split_even(10, 4)
        [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    """
    size, extra = divmod(num_items, num_parts)
    return [b for b in range(num_parts) for _ in range(size + (b < extra))]


def _units(costs: CostModel) -> list[list[str]]:
    """Runs of the topological order that no cut may split: a shared layer's calls and all between them.

    Without this a split could put the two calls of a shared layer on different devices, which no
    runtime can execute with one copy of the weights.
    """
    position = {v: i for i, v in enumerate(costs.order)}
    no_cut_before = [False] * len(costs.order)
    for nodes in colocation_groups(costs.graph).values():
        first, last = min(position[v] for v in nodes), max(position[v] for v in nodes)
        for i in range(first + 1, last + 1):
            no_cut_before[i] = True
    units: list[list[str]] = []
    for i, v in enumerate(costs.order):
        if units and no_cut_before[i]:
            units[-1].append(v)
        else:
            units.append([v])
    return units


def _plan_from_blocks(costs: CostModel, labels: Sequence[int], method: str, started: float) -> Plan:
    assignment = {v: costs.devices[b] for v, b in zip(costs.order, labels, strict=False)}
    return score_assignment(assignment, costs, method=method, solve_time_s=time.perf_counter() - started)


_WEIGHTS: dict[str, Callable[[CostModel, str], float] | None] = {
    "uniform": None,  # equal numbers of layers
    "by_params": lambda costs, v: float(costs.graph.nodes[v]["param_bytes"]),
    "by_time": lambda costs, v: costs.compute_s[v][0],
}


def split_with(costs: CostModel, method: str, *, started: float | None = None) -> Plan:
    """The baseline ``method`` ("uniform", "by_params" or "by_time") scored with an existing cost model."""
    started = time.perf_counter() if started is None else started
    check_stage_count(costs)
    units = _units(costs)
    weight = _WEIGHTS[method]
    if weight is None:
        unit_labels = split_even(len(units), len(costs.devices))
    else:
        unit_labels = split_balanced([sum(weight(costs, v) for v in unit) for unit in units], len(costs.devices))
    labels = [label for unit, label in zip(units, unit_labels) for _ in unit]
    return _plan_from_blocks(costs, labels, method, started)


def _baseline(method: str) -> Callable[..., Plan]:
    def run(
        graph: nx.DiGraph,
        cluster: Cluster,
        *,
        num_microbatches: int = 1,
        optimizer_slots: int = 2,
        cost: str = "flops",
        schedule: str = "gpipe",
        recompute: str = "never",
        num_replicas: int = 1,
        reductions: Reductions | None = None,
    ) -> Plan:
        started = time.perf_counter()
        costs = CostModel(
            graph,
            cluster,
            num_microbatches=num_microbatches,
            optimizer_slots=optimizer_slots,
            cost=cost,
            schedule=schedule,
            recompute=recompute,
            num_replicas=num_replicas,
            reductions=reductions,
        )
        return split_with(costs, method, started=started)

    run.__name__ = method
    return run


uniform = _baseline("uniform")
uniform.__doc__ = """Equal numbers of layers per stage (DeepSpeed's "uniform"). Returns a heuristic Plan."""

by_params = _baseline("by_params")
by_params.__doc__ = """Balances parameter bytes across stages (DeepSpeed's "parameters"). Returns a heuristic Plan."""

by_time = _baseline("by_time")
by_time.__doc__ = """Balances per-layer compute time on the first device (torchgpipe's balance_by_time)."""

BASELINES: dict[str, Callable[..., Plan]] = {"uniform": uniform, "by_params": by_params, "by_time": by_time}
