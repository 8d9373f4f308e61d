"""Planner benchmark: solve time and optimality gap on synthetic graphs, and plan quality on real models.

Writes results.json beside this script and regenerates the tables in README.md between the
markers. Run from the repository root:

    .venv/bin/python benchmarks/planner/run.py            # everything (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/planner/run.py --quick    # synthetic graphs up to 200 nodes, ResNet50 only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import partitioner as pt
from partitioner.synthetic import random_chain, random_dag

HERE = Path(__file__).resolve().parent
MODELS = ["ResNet50", "InceptionV3", "MobileNetV2", "DenseNet121"]
CLUSTER = "8xH100-nvlink"
BATCH_SIZE, NUM_MICROBATCHES = 32, 8


def _row(plan: pt.Plan, baselines: list[pt.Plan]) -> dict[str, Any]:
    fitting = [b for b in baselines if b.fits_memory]
    best = min((b.bottleneck_s for b in fitting), default=None)
    return {
        "method": plan.method,
        "status": plan.status,
        "bottleneck_s": plan.bottleneck_s,
        "lower_bound_s": plan.lower_bound_s,
        "gap": plan.gap,
        "solve_time_s": plan.solve_time_s,
        "step_time_s": plan.step_time_s,
        "speedup": plan.speedup,
        "max_memory_bytes": max(plan.memory_bytes.values()),
        "baselines": {
            b.method: {
                "bottleneck_s": b.bottleneck_s,
                "step_time_s": b.step_time_s,
                "fits_memory": b.fits_memory,
                "max_memory_bytes": max(b.memory_bytes.values()),
            }
            for b in baselines
        },
        "best_fitting_baseline_s": best,
        "vs_best_baseline": (best / plan.bottleneck_s) if best else None,
    }


def synthetic(sizes: list[int], devices: list[int], time_limit_s: float) -> list[dict[str, Any]]:
    rows = []
    for kind, make in (("chain", random_chain), ("dag", random_dag)):
        for n in sizes:
            graph = make(n, seed=n)
            need = sum(
                pt.CostModel(graph, pt.Cluster.uniform(1, memory=1), num_microbatches=NUM_MICROBATCHES).memory.values()
            )
            for k in devices:
                # 16 GiB per device, or 30% more than an even share of the graph's memory if that is larger.
                memory = max(16 * 2**30, int(1.3 * need / k))
                cluster = pt.Cluster.uniform(k, memory=memory, flops_per_s=100e12, bandwidth="50GB/s")
                kw = {"num_microbatches": NUM_MICROBATCHES}
                plan = pt.solve(graph, cluster, time_limit_s=time_limit_s, **kw)
                pt.validate_plan(plan, graph, cluster)
                base = [m(graph, cluster, **kw) for m in pt.baselines.BASELINES.values()]
                row = {"graph": kind, "nodes": n, "devices": k, **_row(plan, base)}
                if kind == "chain" and n <= 200:
                    cp = pt.solve(
                        graph, cluster, time_limit_s=time_limit_s, options=pt.SolverOptions(exact_chains=False), **kw
                    )
                    row["cp_sat_on_chain"] = {
                        "status": cp.status,
                        "bottleneck_s": cp.bottleneck_s,
                        "gap": cp.gap,
                        "solve_time_s": cp.solve_time_s,
                    }
                rows.append(row)
                print(
                    f"{kind:5s} n={n:5d} K={k}  {plan.method:11s} {plan.status:8s} gap={100 * (plan.gap or 0):.3f}% "
                    f"solve={plan.solve_time_s:.2f}s  vs best baseline x{row['vs_best_baseline'] or float('nan'):.3f}",
                    flush=True,
                )
    return rows


def models(names: list[str], devices: list[int], time_limit_s: float) -> list[dict[str, Any]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from profiles import profile_model
    from profiles.loader import load_model

    full = pt.Cluster.from_json(CLUSTER)
    rows = []
    for name in names:
        started = time.perf_counter()
        graph = profile_model(
            load_model(name), batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, measure_time=False
        )
        profile_s = time.perf_counter() - started
        for k in devices:
            cluster = full.take(k)
            kw = {"num_microbatches": NUM_MICROBATCHES}
            plan = pt.solve(graph, cluster, time_limit_s=time_limit_s, **kw)
            pt.validate_plan(plan, graph, cluster)
            base = [m(graph, cluster, **kw) for m in pt.baselines.BASELINES.values()]
            row = {"model": name, "nodes": graph.number_of_nodes(), "devices": k, "profile_s": profile_s}
            row.update(_row(plan, base))
            rows.append(row)
            print(
                f"{name:12s} K={k} {plan.status:8s} gap={100 * (plan.gap or 0):.3f}% solve={plan.solve_time_s:.2f}s "
                f"bottleneck={plan.bottleneck_s * 1e6:.1f}us "
                f"vs best baseline x{row['vs_best_baseline'] or float('nan'):.3f}",
                flush=True,
            )
    return rows


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def tables(results: dict[str, Any]) -> str:
    lines = [
        f"Machine: {results['machine']}. Solver time limit {results['time_limit_s']} s. "
        f"Generated by `{results['command']}` on {results['date']}.",
        "",
        "### Synthetic graphs (uniform devices: 100 TFLOP/s, 50 GB/s links, 16 GiB or 1.3x an even share "
        "of the graph's memory, whichever is larger; M = 8)",
        "",
        "| graph | nodes | devices | method | status | bottleneck (µs) | lower bound (µs) | gap | solve (s) "
        "| best baseline (µs) | baseline / plan | CP-SAT alone on the chain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["synthetic"]:
        cp = r.get("cp_sat_on_chain")
        cp_text = f"{cp['status']}, gap {100 * (cp['gap'] or 0):.2f}%, {cp['solve_time_s']:.2f} s" if cp else "-"
        lines.append(
            f"| {r['graph']} | {r['nodes']} | {r['devices']} | {r['method']} | {r['status']} "
            f"| {_us(r['bottleneck_s'])} "
            f"| {_us(r['lower_bound_s'])} | {100 * (r['gap'] or 0):.3f}% | {r['solve_time_s']:.2f} "
            f"| {_us(r['best_fitting_baseline_s'])} | {r['vs_best_baseline'] or float('nan'):.3f} | {cp_text} |"
        )
    lines += [
        "",
        f"### keras.applications models (weights=None; batch {BATCH_SIZE}, M = {NUM_MICROBATCHES}, "
        f"first K devices of `{CLUSTER}`)",
        "",
        "Bottleneck stage time per micro-batch in µs; a baseline marked * does not fit in memory.",
        "",
        "| model | layers | K | status | gap | solve (s) | CP-SAT | uniform | by_params | by_time "
        "| best baseline / CP-SAT |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["models"]:
        cells = []
        for method in ("uniform", "by_params", "by_time"):
            b = r["baselines"][method]
            cells.append(_us(b["bottleneck_s"]) + ("" if b["fits_memory"] else "*"))
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['devices']} | {r['status']} | {100 * (r['gap'] or 0):.3f}% "
            f"| {r['solve_time_s']:.2f} | {_us(r['bottleneck_s'])} | {' | '.join(cells)} "
            f"| {r['vs_best_baseline'] or float('nan'):.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and ResNet50 only")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    sizes = [50, 200] if args.quick else [50, 200, 1000]
    names = MODELS[:1] if args.quick else MODELS
    results: dict[str, Any] = {
        "command": "python benchmarks/planner/run.py" + (" --quick" if args.quick else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, ortools {__import__('ortools').__version__}",
        "time_limit_s": args.time_limit,
        "synthetic": synthetic(sizes, [2, 4, 8], args.time_limit),
        "models": models(names, [2, 4, 8], args.time_limit),
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    readme = HERE / "README.md"
    text = readme.read_text()
    generated = "<!-- results:start -->\n" + tables(results) + "\n<!-- results:end -->"
    readme.write_text(re.sub(r"<!-- results:start -->.*<!-- results:end -->", generated, text, flags=re.S))
    print(f"wrote {HERE / 'results.json'} and the tables in {readme}")


if __name__ == "__main__":
    sys.exit(main())
