"""An exact dynamic program for chains: the optimum the CP-SAT solver is checked against.

For a chain of N layers and K devices in pipeline order, every legal plan cuts the chain into
contiguous blocks on increasing devices (some devices may stay empty). With ``f[k][j]`` the best
bottleneck that puts layers ``[0, j)`` on devices up to ``k`` with layer ``j - 1`` on ``k``::

    f[k'][j] = min over k < k', i < j of  max(f[k][i], compute(k', i, j) + bytes(i - 1) / bw(k, k'))
               subject to memory(i, j) <= capacity(k')

which is O(K^2 N^2) work, vectorised over j. This is the chain case of the dynamic programs of
PipeDream (Narayanan et al., SOSP 2019) and of Tarnawski et al., "Efficient algorithms for device
placement of DNN graph operators" (NeurIPS 2020), with our cost model (docs/cost-model.md).
"""

from __future__ import annotations

import time

import networkx as nx
import numpy as np

from partitioner.baselines import check_stage_count
from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.errors import InputError
from partitioner.graph import colocation_groups, is_chain
from partitioner.infeasibility import explain_infeasible
from partitioner.plan import Plan


def exact_chain(
    graph: nx.DiGraph,
    cluster: Cluster,
    *,
    num_microbatches: int = 1,
    optimizer_slots: int = 2,
    cost: str = "flops",
    schedule: str = "gpipe",
) -> Plan:
    """Returns a plan with the minimum bottleneck for a chain graph (status "optimal").

    Memory is budgeted as in the CP-SAT model: each layer's activations ``CostModel.max_in_flight`` times
    (``schedule`` "gpipe": M; "1f1b": min(number of devices, M)); the plan reports each stage's own need.

    Raises:
        InputError: when the graph is not a single chain or has colocation groups.
        InfeasiblePlanError: when no split fits in memory.

    Example:
        >>> plan = exact_chain(pt.chain_graph([1e9] * 8), pt.Cluster.uniform(4, memory="1GiB"))  # doctest: +SKIP
    """
    started = time.perf_counter()
    costs = CostModel(
        graph, cluster, num_microbatches=num_microbatches, optimizer_slots=optimizer_slots, cost=cost, schedule=schedule
    )
    if not is_chain(graph):
        raise InputError(
            "exact_chain needs a chain (every layer feeds only the next one); this graph branches. "
            "Use partitioner.solve, which handles any DAG."
        )
    if colocation_groups(graph):
        raise InputError("exact_chain does not handle shared layers (colocation groups); use partitioner.solve.")
    check_stage_count(costs)
    order = costs.order
    n, k_total = len(order), len(costs.devices)
    compute = np.array([costs.compute_s[v] for v in order])  # [node, device]
    prefix = np.vstack([np.zeros(k_total), np.cumsum(compute, axis=0)])  # prefix[i, k] = sum of [0, i)
    mem_prefix = np.concatenate([[0], np.cumsum([costs.memory[v] for v in order])]).astype(np.float64)
    capacity = [d.memory_bytes for d in cluster.devices]
    out_bytes = np.array([costs.out_bytes[v] for v in order], dtype=np.float64)

    bandwidth = [[cluster.bandwidth(k, k2) for k2 in range(k_total)] for k in range(k_total)]
    best, _ = _dynamic_program(prefix, mem_prefix, capacity, out_bytes, bandwidth)
    optimum = float(best[:, n].min())
    if not np.isfinite(optimum):
        raise explain_infeasible(costs)
    # Second pass: among splits whose every stage takes at most the optimum, the fewest bytes sent.
    sent, parent = _dynamic_program(prefix, mem_prefix, capacity, out_bytes, bandwidth, limit=optimum * (1 + 1e-9))
    k = int(np.argmin(sent[:, n]))
    assignment: dict[str, str] = {}
    j = n
    while j > 0:
        k_prev, i = (int(x) for x in parent[k, j])
        for v in order[i:j]:
            assignment[v] = costs.devices[k]
        k, j = k_prev, i
    return Plan.from_assignment(
        assignment,
        costs,
        method="exact_chain",
        status="optimal",
        lower_bound_s=optimum,
        solve_time_s=time.perf_counter() - started,
    )


def _dynamic_program(
    prefix: np.ndarray,
    mem_prefix: np.ndarray,
    capacity: list[int],
    out_bytes: np.ndarray,
    bandwidth: list[list[float]],
    limit: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Fills table[k, j] over layers [0, j) with layer j - 1 on device k, and the parents to rebuild it.

    Without ``limit`` the table holds the least bottleneck (min-max); with it, the fewest bytes sent
    (min-sum) over splits whose every stage takes at most ``limit`` seconds.
    """
    num_devices, n = prefix.shape[1], prefix.shape[0] - 1
    table = np.full((num_devices, n + 1), np.inf)
    parent = np.full((num_devices, n + 1, 2), -1, dtype=np.int64)  # (previous device, block start)
    for k2 in range(num_devices):
        fits = mem_prefix <= capacity[k2]
        if limit is None:
            first = np.where(fits, prefix[:, k2], np.inf)  # the first block starts the chain on k2
        else:
            first = np.where(fits & (prefix[:, k2] <= limit), 0.0, np.inf)
        first[0] = np.inf
        better = first < table[k2]
        table[k2][better] = first[better]
        parent[k2][better] = (-1, 0)
        for k in range(k2):
            receive = out_bytes / bandwidth[k][k2] + out_bytes / bandwidth[k2][k]  # as CostModel.receive_s
            byte_limit = None if limit is None else (out_bytes, limit)
            _relax(table, parent, k, k2, prefix[:, k2], mem_prefix, capacity[k2], receive, byte_limit)
    return table, parent


def _relax(
    best: np.ndarray,
    parent: np.ndarray,
    k: int,
    k2: int,
    prefix: np.ndarray,
    mem_prefix: np.ndarray,
    capacity: int,
    receive: np.ndarray,
    byte_limit: tuple[np.ndarray, float] | None = None,
) -> None:
    """Improves best[k2, j] with blocks [i, j) on k2 after a block ending at i - 1 on k (in place).

    Without ``byte_limit`` ``best`` holds bottlenecks (min-max). With ``byte_limit=(out_bytes, T)``
    it holds bytes sent (min-sum) over splits whose every stage takes at most T seconds.
    """
    n = len(prefix) - 1
    starts = np.flatnonzero(np.isfinite(best[k, 1:n])) + 1  # i in [1, n) with a finite best[k, i]
    ends = np.arange(n + 1)
    chunk = max(1, 2_000_000 // (n + 1))
    for lo in range(0, len(starts), chunk):
        i = starts[lo : lo + chunk][:, None]
        stage = prefix[None, :] - prefix[i] + receive[i - 1]
        valid = (ends[None, :] > i) & (mem_prefix[None, :] - mem_prefix[i] <= capacity)
        if byte_limit is None:
            cand = np.maximum(best[k, i], stage)
        else:
            cand = best[k, i] + byte_limit[0][i - 1]
            valid &= stage <= byte_limit[1]
        cand = np.where(valid, cand, np.inf)
        arg = np.argmin(cand, axis=0)
        value = cand[arg, ends]
        better = value < best[k2]
        best[k2][better] = value[better]
        parent[k2, better, 0] = k
        parent[k2, better, 1] = i[arg[better], 0]
