"""Planner speed: solve time and optimality gap against graph size and number of devices.

For seeded synthetic chains and DAGs (partitioner.synthetic; the graph of n nodes uses seed n) on
2 to 16 uniform devices, this times ``pt.solve`` (the default options: the exact DP on small chains,
CP-SAT on small DAGs, coarsening above SolverOptions' thresholds; ``shortest_step=False``, so the plan
is the solver's own bottleneck-optimal one, whose gap is measured), then again with the default
options (the step objective: its time, status and step), checks every plan with
``pt.validate_plan``, and records status, gap to the proven lower bound, bottleneck, and the best
baseline that fits. It writes results.json and the table in README.md beside this script. Run from
the repository root:

    .venv/bin/python benchmarks/planner_speed/run.py            # --quick: up to 1000 nodes + the 10k DAG on 8
    .venv/bin/python benchmarks/planner_speed/run.py --full     # 50 to 10,000 nodes, 2 to 16 devices

The goal it checks (issue 4): a 10,000-node DAG on 8 devices within 2% of the lower bound in under 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import partitioner as pt
from partitioner.cost import CostModel, relative_gap
from partitioner.search.solve import AUTO_COARSEN_DAG
from partitioner.synthetic import random_chain, random_dag

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.readme
from benchmarks.readme import write_block  # noqa: E402

SIZES = (50, 200, 1000, 5000, 10000)
QUICK_SIZES = (50, 200, 1000)
DEVICES = (2, 4, 8, 16)
NUM_MICROBATCHES = 8
GOAL = {"graph": "dag", "nodes": 10000, "devices": 8, "gap": 0.02, "solve_s": 30.0}
GENERATORS = {"chain": random_chain, "dag": random_dag}


def make_cluster(graph: Any, num_devices: int) -> pt.Cluster:
    """Uniform devices as in benchmarks/planner: 100 TFLOP/s, 50 GB/s links, and 16 GiB or 1.3x an even
    share of the graph's memory (weights, gradients, Adam slots, M activations), whichever is larger."""
    costs = CostModel(graph, pt.Cluster.uniform(1, memory=1), num_microbatches=NUM_MICROBATCHES)
    # every node holding M micro-batches' activations (one device alone is a last stage, which holds one)
    need = sum(costs.node_memory_bytes("kept", NUM_MICROBATCHES).values())
    memory = max(16 * 2**30, int(1.3 * need / num_devices))
    return pt.Cluster.uniform(num_devices, memory=memory, flops_per_s=100e12, bandwidth="50GB/s")


def run_one(kind: str, num_nodes: int, num_devices: int, time_limit_s: float, fine_too: bool) -> dict[str, Any]:
    """Solves one problem with the default options; with ``fine_too`` also with coarsen=False."""
    graph = GENERATORS[kind](num_nodes, seed=num_nodes)
    cluster = make_cluster(graph, num_devices)
    kw: dict[str, Any] = {"num_microbatches": NUM_MICROBATCHES, "time_limit_s": time_limit_s}
    started = time.perf_counter()
    plan = pt.solve(graph, cluster, options=pt.SolverOptions(shortest_step=False), **kw)
    wall_s = time.perf_counter() - started
    pt.validate_plan(plan, graph, cluster)
    baselines = [b(graph, cluster, num_microbatches=NUM_MICROBATCHES) for b in pt.baselines.BASELINES.values()]
    fitting = [b for b in baselines if b.fits_memory]
    best = min(fitting, key=lambda b: b.bottleneck_s, default=None)
    row: dict[str, Any] = {
        "graph": kind,
        "nodes": num_nodes,
        "edges": graph.number_of_edges(),
        "devices": num_devices,
        "method": plan.method,
        "status": plan.status,
        "solve_s": wall_s,
        "bottleneck_s": plan.bottleneck_s,
        "lower_bound_s": plan.lower_bound_s,
        # against the bound on the bottleneck, also for chains, whose DP minimises the step (plan.gap is on the step)
        "gap": relative_gap(plan.bottleneck_s, plan.lower_bound_s),
        "num_stages": plan.num_stages,
        "transfer_bytes": plan.transfer_bytes,
        "best_baseline": best.method if best else None,
        "best_baseline_s": best.bottleneck_s if best else None,
        "baseline_over_plan": best.bottleneck_s / plan.bottleneck_s if best else None,
    }
    started = time.perf_counter()
    stepped = pt.solve(graph, cluster, **kw)  # the default options: the step objective
    row["step"] = {
        "method": stepped.method,
        "status": stepped.status,
        "solve_s": time.perf_counter() - started,
        "step_s": stepped.step_time_s,
        "bottleneck_plan_step_s": plan.step_time_s,
        "step_lower_bound_s": stepped.step_lower_bound_s,  # CostModel.step_lower_bound_s (or the chain DP's proof)
        "step_gap": stepped.gap,  # against step_lower_bound_s
    }
    pt.validate_plan(stepped, graph, cluster)
    if fine_too:
        started = time.perf_counter()
        fine = pt.solve(graph, cluster, options=pt.SolverOptions(coarsen=False, shortest_step=False), **kw)
        fine_s = time.perf_counter() - started
        pt.validate_plan(fine, graph, cluster)
        row["fine"] = {
            "method": fine.method,
            "status": fine.status,
            "solve_s": fine_s,
            "bottleneck_s": fine.bottleneck_s,
            "lower_bound_s": fine.lower_bound_s,
            "gap": relative_gap(fine.bottleneck_s, fine.lower_bound_s),
        }
    return row


def goal_verdict(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The goal's row and whether it is met, or None when the sweep did not include it."""
    for r in rows:
        if (r["graph"], r["nodes"], r["devices"]) == (GOAL["graph"], GOAL["nodes"], GOAL["devices"]):
            met = r["gap"] is not None and r["gap"] <= GOAL["gap"] and r["solve_s"] < GOAL["solve_s"]
            return {"met": met, "solve_s": r["solve_s"], "gap": r["gap"], "status": r["status"]}
    return None


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.1f}"


def _pct(gap: float | None) -> str:
    return "-" if gap is None else f"{100 * gap:.3f}%"


def table(results: dict[str, Any]) -> str:
    verdict = results["goal"]
    if verdict is None:
        headline = "The goal row (10,000-node DAG on 8 devices) was not in this run; run with --quick or --full."
    else:
        headline = (
            f"**Goal {'met' if verdict['met'] else 'NOT met'}**: the 10,000-node DAG on 8 devices was planned in "
            f"{verdict['solve_s']:.1f} s with a gap of {_pct(verdict['gap'])} to the lower bound "
            f"(goal: within {100 * GOAL['gap']:.0f}% in under {GOAL['solve_s']:.0f} s)."
        )
    lines = [
        headline,
        "",
        f"Machine: {results['machine']}. Time limit {results['time_limit_s']:g} s per solve. "
        f"Generated by `{results['command']}` on {results['date']}.",
        "",
        "Solve time is the wall-clock time of `pt.solve` (cost model, baselines for the hint, coarsening, "
        "CP-SAT or DP, scoring). Gap = (bottleneck - lower bound) / bottleneck; the bound of a coarsened plan "
        "is the cost model's (total work over total speed), which ignores transfers.",
        "",
        "| graph | nodes | devices | method | status | solve (s) | gap | bottleneck (µs) | lower bound (µs) "
        "| best baseline (µs) | baseline / plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['graph']} | {r['nodes']:,} | {r['devices']} | {r['method']} | {r['status']} | {r['solve_s']:.2f} "
            f"| {_pct(r['gap'])} | {_us(r['bottleneck_s'])} | {_us(r['lower_bound_s'])} "
            f"| {_us(r['best_baseline_s'])} ({r['best_baseline']}) "
            f"| {'-' if r['baseline_over_plan'] is None else format(r['baseline_over_plan'], '.4f')} |"
        )
    stepped = [r for r in results["rows"] if "step" in r]
    if stepped:
        lines += [
            "",
            "The same problems with the default options, whose objective is the simulated step (the chain "
            "planner's step search, CP-SAT's plan refined on the step): its solve time and status (on the step), "
            "its step against the step of the bottleneck-optimal plan above, and its step gap: against the proven "
            "lower bound on the step of any plan (`CostModel.step_lower_bound_s`, docs/cost-model.md).",
            "",
            "| graph | nodes | devices | method | status | solve (s) | step (µs) | bottleneck plan's step (µs) "
            "| step / bottleneck plan's | step gap |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in stepped:
            t = r["step"]
            lines.append(
                f"| {r['graph']} | {r['nodes']:,} | {r['devices']} | {t['method']} | {t['status']} "
                f"| {t['solve_s']:.2f} | {_us(t['step_s'])} | {_us(t['bottleneck_plan_step_s'])} "
                f"| {t['step_s'] / t['bottleneck_plan_step_s']:.4f} | {_pct(t.get('step_gap'))} |"
            )
    fine = [r for r in results["rows"] if "fine" in r]
    if fine:
        lines += [
            "",
            "The same problems with `SolverOptions(coarsen=False)` (one CP-SAT model over every node):",
            "",
            "| graph | nodes | devices | coarsened: solve (s), bottleneck (µs), gap | fine: status, solve (s), "
            "bottleneck (µs), gap |",
            "|---|---|---|---|---|",
        ]
        for r in fine:
            f = r["fine"]
            lines.append(
                f"| {r['graph']} | {r['nodes']:,} | {r['devices']} | {r['solve_s']:.2f}, {_us(r['bottleneck_s'])}, "
                f"{_pct(r['gap'])} | {f['status']}, {f['solve_s']:.2f}, {_us(f['bottleneck_s'])}, {_pct(f['gap'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="up to 1000 nodes, and the 10k DAG on 8 devices (default)")
    mode.add_argument("--full", action="store_true", help="50 to 10,000 nodes on 2 to 16 devices")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve (default 30)")
    args = parser.parse_args()

    problems = [(kind, n, k) for kind in GENERATORS for n in (SIZES if args.full else QUICK_SIZES) for k in DEVICES]
    if not args.full:
        problems.append(("dag", GOAL["nodes"], GOAL["devices"]))
    rows = []
    for kind, n, k in problems:
        # --full also solves the 1000-node DAGs that auto mode coarsens without coarsening, for comparison.
        fine_too = args.full and kind == "dag" and n == 1000 and n * k > AUTO_COARSEN_DAG
        row = run_one(kind, n, k, args.time_limit, fine_too)
        rows.append(row)
        print(
            f"{kind:5s} n={n:6d} K={k:2d}  {row['method']:19s} {row['status']:8s} solve={row['solve_s']:6.2f}s "
            f"gap={_pct(row['gap']):>8s}  baseline/plan={row['baseline_over_plan'] or float('nan'):.4f}"
            + (f"  fine: {row['fine']['solve_s']:.2f}s gap={_pct(row['fine']['gap'])}" if fine_too else ""),
            flush=True,
        )
    results: dict[str, Any] = {
        "command": "python benchmarks/planner_speed/run.py" + (" --full" if args.full else " --quick"),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, ortools {__import__('ortools').__version__}",
        "time_limit_s": args.time_limit,
        "num_microbatches": NUM_MICROBATCHES,
        "cluster": "uniform: 100 TFLOP/s, 50 GB/s links, max(16 GiB, 1.3 x even share of the graph's memory)",
        "goal": None,
        "rows": rows,
    }
    results["goal"] = goal_verdict(rows)
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    readme = HERE / "README.md"
    write_block(readme, "results", table(results))
    print(f"wrote {HERE / 'results.json'} and the table in {readme}")
    if results["goal"] is not None:
        print(f"goal {'met' if results['goal']['met'] else 'NOT met'}: {results['goal']}")


if __name__ == "__main__":
    sys.exit(main())
