"""The solver's options: the knobs of the search that most users leave alone, as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of the CP-SAT search that most users leave alone."""

    num_workers: int = 8  # parallel search workers (with deterministic=False); 0 = CP-SAT's default here
    seed: int = 0  # random seed, for reproducible runs
    # True: one CP-SAT worker that stops on a deterministic time budget (CP-SAT's own count of work,
    # partitioner.search.cpsat.DETERMINISTIC_TIME_PER_S per second of the limit), so the same input gives the same
    # plan; the wall-clock limit still holds and, on a machine so loaded that it ends the search first, runs
    # can differ. Parallel workers never repeat (whichever finds a solution first wins), and CP-SAT's
    # deterministic interleaved search spends its whole budget even on tiny models. False: num_workers in
    # parallel, more search per second.
    deterministic: bool = True
    # "search": the planner chooses which device runs which stage (partitioner.search.order; Plan.devices is the
    # order chosen); "given": stages follow the cluster's order, for pipelines wired by hand.
    device_order: str = "search"
    hint: bool = True  # start from the best baseline (or the exact DP on chains) that fits
    exact_chains: bool = True  # solve chains without pins by the exact DP (partitioner.search.chain) instead
    log: bool = False  # print CP-SAT's search log
    time_resolution: int = 1_000_000  # integer steps for the slowest device running the whole graph
    byte_resolution: int = 10_000  # integer steps for all transfers the graph could make
    relative_gap: float = 0.0  # stop once (bottleneck - bound) / bottleneck is below this
    coarsen: bool | None = None  # place runs of nodes, then refine near boundaries; None = above AUTO_COARSEN_*
    # Return the legal baseline instead when its simulated step is shorter than the solver's plan's
    # (the solver minimises the bottleneck; the step also pays fill, drain and transfers, see docs/cost-model.md).
    shortest_step: bool = True
