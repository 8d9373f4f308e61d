"""1F1B plans of the chain DP on bundled graphs and clusters: what the per-stage memory budget changes.

Deterministic (no time limit): VGG16 (a chain) by ``pt.exact_chain``, the DAGs by the DP on runs of
their topological order (``partitioner.search.multilevel.coarse_chain_plan``, ``solve``'s chain start on a
DAG), each plan validated on the graph itself. Prints one JSON line per case and writes them to the
file given. To compare two versions of the planner, run it from each checkout:

    PYTHONPATH=. python benchmarks/planner_quality/memory_budget.py /tmp/after.json

No README table comes from it; the figures it printed are in the commit that added it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import partitioner as pt
from partitioner.cost import CostModel
from partitioner.graph import is_chain, load_graph
from partitioner.search.multilevel import coarse_chain_plan

HERE = Path(__file__).resolve().parent
GRAPHS = ("GPT2-48", "BERT-48", "GPT2-12", "BERT-12", "VGG16")
CLUSTERS = ("4xT4-pcie", "4xT4+4xV100", "2xT4+2xA100")
NUM_MICROBATCHES = 8


def plan_1f1b(graph: object, cluster: pt.Cluster, recompute: str) -> pt.Plan | None:
    """The chain DP's 1F1B plan (on runs of the topological order for a DAG), or None when none fits."""
    if is_chain(graph):
        try:
            return pt.exact_chain(
                graph, cluster, num_microbatches=NUM_MICROBATCHES, schedule="1f1b", recompute=recompute
            )
        except pt.InfeasiblePlanError:
            return None
    costs = CostModel(graph, cluster, num_microbatches=NUM_MICROBATCHES, schedule="1f1b", recompute=recompute)
    return coarse_chain_plan(costs, {})


def main() -> None:
    rows = []
    for name in GRAPHS:
        graph = load_graph(HERE / "graphs" / f"{name}-b32-m8.json")
        for cluster_name in CLUSTERS:
            cluster = pt.Cluster.from_json(cluster_name)
            for recompute in ("never", "auto"):
                started = time.perf_counter()
                plan = plan_1f1b(graph, cluster, recompute)
                row: dict[str, object] = {"graph": name, "cluster": cluster_name, "recompute": recompute}
                row["wall_s"] = round(time.perf_counter() - started, 1)
                if plan is not None:
                    pt.validate_plan(plan, graph, cluster)
                    row.update(step_ms=plan.step_time_s * 1e3, stages=plan.num_stages, recomputed=sum(plan.recompute))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
