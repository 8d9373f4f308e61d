"""Planner quality on real models: CP-SAT against the exact DP and the baselines, scored by the simulator.

For each model (keras.applications CNNs and keras-hub transformer backbones, all built from their
code with random weights: nothing is downloaded) and each K in 2, 4, 8 devices of a bundled
hardware profile, this plans with CP-SAT (``pt.solve``), the exact chain DP (chains only), and the
uniform, parameter-balanced and time-balanced baselines; replays every plan's GPipe step with the
pipeline simulator; and writes results.json, the table in README.md and speedup.png beside this
script. A second section plans on the heterogeneous bundled clusters (slow devices listed first):
``pt.solve`` with the device-order search, the listed order, Metis' "fastest device on the heaviest
stage" order and the fastest-first order, and the baselines. A third lets the planner choose
M and the schedule for the batch (``pt.plan_for_batch``) against today's fixed M = 8 GPipe. A fourth
checks ``pt.solve`` on small random chains against brute force over every legal plan, a fifth
(``--section random-dags``) on small random DAGs. A sixth (``--section replicas``) lets the planner
choose D replicas x K stages (``plan_replicas``) on one and two 8-GPU nodes for global batches 32 and 512,
beside pure data parallel and one pipeline. Run from the repository root:

    .venv/bin/python benchmarks/planner_quality/run.py            # --quick: 4 models, 3 on mixed clusters
    .venv/bin/python benchmarks/planner_quality/run.py --full     # all 10 models
    .venv/bin/python benchmarks/planner_quality/run.py --section choose   # one section; the others are kept

Profiled layer graphs are cached in graphs/ (JSON); ``--reprofile`` rebuilds them, which needs
keras-hub for the transformers (see README.md for the install line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import networkx as nx

import partitioner as pt
from partitioner.graph import colocation_groups, is_chain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.readme
from benchmarks.readme import replace_block  # noqa: E402

GRAPHS = HERE / "graphs"
CLUSTER = "8xH100-nvlink"
DEVICES = (2, 4, 8)
BATCH_SIZE, NUM_MICROBATCHES = 32, 8
SEQUENCE_LENGTH = 128  # tokens per sample for the transformers
METHODS = ("solve", "cp-sat", "exact_chain", "uniform", "by_params", "by_time")
SHOWN = ("exact_chain", "uniform", "by_params", "by_time")  # the columns beside solve's
BASELINES = ("uniform", "by_params", "by_time")

# name -> (family, keyword arguments). CNNs are keras.applications builders (weights=None, 224x224
# unless the model's own size differs); transformers are keras-hub backbones built from a config.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "ResNet50": ("keras.applications", {}),
    "InceptionV3": ("keras.applications", {}),
    "MobileNetV2": ("keras.applications", {}),
    "DenseNet121": ("keras.applications", {}),
    "EfficientNetB0": ("keras.applications", {}),
    "VGG16": ("keras.applications", {}),  # a chain: the exact DP applies
    "GPT2-12": (  # GPT-2 small (124M)
        "GPT2Backbone",
        {"vocabulary_size": 50257, "num_layers": 12, "num_heads": 12, "hidden_dim": 768, "intermediate_dim": 3072},
    ),
    "GPT2-48": (  # GPT-2 XL (1.5B)
        "GPT2Backbone",
        {"vocabulary_size": 50257, "num_layers": 48, "num_heads": 25, "hidden_dim": 1600, "intermediate_dim": 6400},
    ),
    "BERT-12": (  # BERT base (110M)
        "BertBackbone",
        {"vocabulary_size": 30522, "num_layers": 12, "num_heads": 12, "hidden_dim": 768, "intermediate_dim": 3072},
    ),
    "BERT-48": (  # BERT-large width, twice its depth (640M)
        "BertBackbone",
        {"vocabulary_size": 30522, "num_layers": 48, "num_heads": 16, "hidden_dim": 1024, "intermediate_dim": 4096},
    ),
}
QUICK = ("ResNet50", "DenseNet121", "VGG16", "GPT2-12")
# Heterogeneous bundled clusters, each listing its slow devices first (the worst order to follow blindly).
HETERO_CLUSTERS = ("2xT4+2xA100", "4xT4+4xV100", "2x4xV100+A100-ib")
HETERO_QUICK = ("ResNet50", "VGG16", "GPT2-12")
HETERO_ORDERS = ("search", "given", "metis", "fastest_first")  # the pipeline orders solve plans in
SECTIONS = ("quality", "hetero", "choose", "random-chains", "random-dags", "replicas")
# Planner-chosen M and schedule against fixed M = 8 GPipe: two chains and two transformer DAGs, on a fast
# cluster and on one where memory is tight.
CHOOSE_MODELS = ("VGG16", "ResNet50", "GPT2-12", "GPT2-48")
CHOOSE_CLUSTERS = ("8xH100-nvlink", "4xT4-pcie")


# ----- models --------------------------------------------------------------------------------------


def build_model(name: str) -> Any:
    """The Keras model ``name`` of MODELS, with random weights and static shapes."""
    import keras

    family, config = MODELS[name]
    if family == "keras.applications":
        return getattr(keras.applications, name)(weights=None)
    try:
        import keras_hub
    except ImportError as err:
        raise SystemExit(
            f"{name} needs keras-hub to be profiled. Install it without its TensorFlow pins:\n"
            "  .venv/bin/pip install --no-deps keras-hub==0.32.0 && .venv/bin/pip install regex tokenizers"
        ) from err
    backbone = getattr(keras_hub.models, family)(max_sequence_length=SEQUENCE_LENGTH, **config)
    # keras-hub backbones take (batch, None) token inputs; the profiler needs static shapes. Replaying
    # the backbone's graph on fixed-length inputs gives a flat functional model of the same layers.
    inputs = {t.name: keras.Input(shape=(SEQUENCE_LENGTH,), dtype=t.dtype, name=t.name) for t in backbone.inputs}
    return keras.Model(inputs, backbone.call(inputs), name=name)


def load_graph(name: str, reprofile: bool) -> tuple[nx.DiGraph, float | None]:
    """The profiled layer graph of ``name`` (cached in graphs/), and the seconds profiling took."""
    path = GRAPHS / f"{name}-b{BATCH_SIZE}-m{NUM_MICROBATCHES}.json"
    if path.exists() and not reprofile:
        return pt.load_graph(path), None
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from profiles import profile_model

    started = time.perf_counter()
    graph = profile_model(
        build_model(name), batch_size=BATCH_SIZE, num_microbatches=NUM_MICROBATCHES, measure_time=False
    )
    graph.graph["model_name"] = name
    seconds = time.perf_counter() - started
    GRAPHS.mkdir(exist_ok=True)
    pt.save_graph(graph, path)
    return graph, seconds


# ----- plans -----------------------------------------------------------------------------------------


def _planners(time_limit_s: float) -> dict[str, Callable[[nx.DiGraph, pt.Cluster], pt.Plan]]:
    kw = {"num_microbatches": NUM_MICROBATCHES}
    return {
        # What a user gets: pt.solve as it is (CP-SAT on every graph here, even chains), which returns a legal
        # baseline instead of CP-SAT's bottleneck-optimal plan when the baseline's simulated step is shorter.
        "solve": lambda g, c: pt.solve(
            g, c, time_limit_s=time_limit_s, options=pt.SolverOptions(exact_chains=False), **kw
        ),
        # CP-SAT's own bottleneck-optimal plan, for its gap to the proven bound.
        "cp-sat": lambda g, c: pt.solve(
            g, c, time_limit_s=time_limit_s, options=pt.SolverOptions(exact_chains=False, shortest_step=False), **kw
        ),
        "exact_chain": lambda g, c: pt.exact_chain(g, c, **kw),
        **{name: (lambda g, c, b=baseline: b(g, c, **kw)) for name, baseline in pt.baselines.BASELINES.items()},
    }


def score(plan: pt.Plan, graph: nx.DiGraph, cluster: pt.Cluster) -> dict[str, Any]:
    """The figures of one plan: simulated step, peak memory per stage, bound, speedup."""
    sim = pt.simulate(plan, graph, cluster, schedule="gpipe")
    step_s, peak, bubble = sim.step_time_s, dict(sim.peak_memory_bytes), sim.bubble_fraction
    used = [peak[d] for d in plan.stages]
    return {
        "method": plan.method,
        "status": plan.status,
        "num_stages": plan.num_stages,
        "step_time_s": step_s,
        "bottleneck_s": plan.bottleneck_s,
        "fill_drain_step_s": plan.fill_drain_step_s,
        "lower_bound_s": plan.lower_bound_s,
        "step_lower_bound_s": plan.step_lower_bound_s,  # where the planner minimised the step (solve)
        "objective": plan.objective,  # what status and gap are about: "step" or "bottleneck"
        "gap": plan.gap,
        "speedup": plan.serial_step_s / step_s if step_s > 0 else 1.0,
        "bubble_fraction": bubble,
        "peak_memory_bytes": {d: peak[d] for d in plan.stages},
        "max_memory_bytes": max(used),
        "memory_ratio": max(used) / min(used) if min(used) > 0 else None,
        "fits_memory": all(peak[d] <= plan.capacity_bytes[d] for d in plan.stages),
        "transfer_bytes": plan.transfer_bytes,
        "solve_time_s": plan.solve_time_s,
    }


def run_model(name: str, devices: tuple[int, ...], time_limit_s: float, reprofile: bool) -> list[dict[str, Any]]:
    graph, profile_s = load_graph(name, reprofile)
    full = pt.Cluster.from_json(CLUSTER)
    planners = _planners(time_limit_s)
    chain = is_chain(graph) and not colocation_groups(graph)
    rows = []
    for k in devices:
        cluster = full.take(k)
        row: dict[str, Any] = {
            "model": name,
            "nodes": graph.number_of_nodes(),
            "chain": chain,
            "devices": k,
            "profile_s": profile_s,
            "params": sum(graph.nodes[v]["param_bytes"] for v in graph) // 4,
            "plans": {},
        }
        for method, plan_with in planners.items():
            if method == "exact_chain" and not chain:
                row["plans"][method] = None
                continue
            try:
                plan = plan_with(graph, cluster)
            except pt.InfeasiblePlanError as err:
                row["plans"][method] = {"status": "infeasible", "error": str(err).splitlines()[0]}
                continue
            pt.validate_plan(plan, graph, cluster, check_memory=False)  # baselines may not fit: reported
            row["plans"][method] = score(plan, graph, cluster)
        row["losses"] = losses(row["plans"])
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def losses(plans: dict[str, Any]) -> list[str]:
    """Where a planner does worse than another plan that fits memory on what it optimises (each one a bug):
    solve's simulated step, and CP-SAT's bottleneck."""
    found = []
    for ours_name, key in (("solve", "step_time_s"), ("cp-sat", "bottleneck_s")):
        ours = plans.get(ours_name)
        if not ours or "step_time_s" not in ours:
            continue
        for method, other in plans.items():
            # solve and cp-sat are both CP-SAT runs (several workers: equally good plans may differ), not rivals.
            if method in ("solve", "cp-sat") or not other or "step_time_s" not in other or not other["fits_memory"]:
                continue
            if other[key] < ours[key] * (1 - 1e-6):
                found.append(f"{method} {key} {other[key] * 1e6:.1f} µs < {ours_name} {ours[key] * 1e6:.1f} µs")
    return found


def _line(row: dict[str, Any]) -> str:
    cells = []
    for method in METHODS:
        p = row["plans"].get(method)
        if p is None:
            continue
        cells.append(f"{method}=" + ("infeasible" if "step_time_s" not in p else f"{p['step_time_s'] * 1e3:.2f}ms"))
    cp = row["plans"]["cp-sat"]
    gap = f" gap={100 * cp['gap']:.2f}%" if cp and cp.get("gap") is not None else ""
    gap += f" step gap={_step_gap(row['plans']['solve'])}"
    picked = (row["plans"]["solve"] or {}).get("method", "")
    gap += f" (solve picked {picked.split()[0]})" if "shorter step" in picked else ""
    return f"{row['model']:14s} K={row['devices']}{gap}  " + " ".join(cells) + (" LOSS" if row["losses"] else "")


def _step_gap(p: dict[str, Any] | None) -> str:
    """A plan's gap against the proven lower bound on the step, or "-" (no step bound: results from before it)."""
    if not p or p.get("objective") != "step" or p.get("gap") is None:
        return "-"
    return f"{100 * p['gap']:.1f}%"


# ----- heterogeneous clusters ----------------------------------------------------------------------


def _best_baseline(graph: nx.DiGraph, cluster: pt.Cluster) -> tuple[str, pt.Plan | None, dict[str, Any] | None]:
    """The baseline (in the cluster's listed order) with the shortest simulated step among those that fit,
    else among all; with its scored figures."""
    found = []
    for method, baseline in pt.baselines.BASELINES.items():
        try:
            plan = baseline(graph, cluster, num_microbatches=NUM_MICROBATCHES)
        except pt.InfeasiblePlanError:
            continue
        found.append((method, plan, score(plan, graph, cluster)))
    if not found:
        return "-", None, None
    return min(found, key=lambda f: (not f[2]["fits_memory"], f[2]["step_time_s"]))


def hetero_orders(graph: nx.DiGraph, cluster: pt.Cluster, base: pt.Plan | None) -> dict[str, pt.Cluster]:
    """The cluster listed in each order solve plans in with device_order="given" (search: the listed one).

    metis: the best baseline's stages, the one with the most FLOPs on the fastest device and so on
    down (Metis' rule, :func:`partitioner.search.order.fastest_on_heaviest`); fastest_first: devices by speed.
    """
    from partitioner.cluster import reorder
    from partitioner.search.order import by_speed, fastest_on_heaviest

    orders = {"search": cluster, "given": cluster, "fastest_first": reorder(cluster, by_speed(cluster))}
    if base is not None:
        work = [sum(float(graph.nodes[v]["flops"]) for v in base.nodes_on(d)) for d in base.stages]
        orders["metis"] = reorder(cluster, fastest_on_heaviest(cluster, work))
    return {name: orders[name] for name in HETERO_ORDERS if name in orders}


def run_hetero(name: str, time_limit_s: float) -> list[dict[str, Any]]:
    """One row per heterogeneous cluster: solve in each order of :func:`hetero_orders`, and the best baseline."""
    graph, _ = load_graph(name, reprofile=False)
    rows = []
    for cluster_name in HETERO_CLUSTERS:
        cluster = pt.Cluster.from_json(cluster_name)
        base_method, base_plan, base_score = _best_baseline(graph, cluster)
        row: dict[str, Any] = {"model": name, "cluster": cluster_name, "plans": {}}
        for order_name, listed in hetero_orders(graph, cluster, base_plan).items():
            options = pt.SolverOptions(device_order="search" if order_name == "search" else "given")
            try:
                plan = pt.solve(
                    graph, listed, num_microbatches=NUM_MICROBATCHES, time_limit_s=time_limit_s, options=options
                )
            except pt.InfeasiblePlanError as err:
                row["plans"][order_name] = {"status": "infeasible", "error": str(err).splitlines()[0]}
                continue
            pt.validate_plan(plan, graph, cluster)  # against the cluster as listed: the plan carries its order
            figures = score(plan, graph, cluster)
            figures["stages"] = [f"{d} ({cluster.devices[cluster.index(d)].hardware})" for d in plan.stages]
            row["plans"][order_name] = figures
        row["plans"]["best_baseline"] = base_score and {**base_score, "baseline": base_method}
        row["losses"] = hetero_losses(row["plans"])
        rows.append(row)
        cells = " ".join(f"{k}={_ms(p)}" for k, p in row["plans"].items())
        print(f"{name:14s} {cluster_name:18s} {cells}" + (" LOSS" if row["losses"] else ""), flush=True)
    return rows


def hetero_losses(plans: dict[str, Any]) -> list[str]:
    """Where solve with the order search has a longer simulated step than another column's plan that fits."""
    ours = plans.get("search")
    if not ours or "step_time_s" not in ours:
        return []
    found = []
    for method, other in plans.items():
        if method == "search" or not other or "step_time_s" not in other or not other["fits_memory"]:
            continue
        if other["step_time_s"] < ours["step_time_s"] * (1 - 1e-6):
            found.append(
                f"{method} step {other['step_time_s'] * 1e3:.3f} ms < search {ours['step_time_s'] * 1e3:.3f} ms"
            )
    return found


def _hardware_counts(stages: list[str]) -> str:
    """'2x A100-SXM-80GB' from stage labels '/GPU:2 (A100-SXM-80GB)', in pipeline order of first use."""
    kinds = [s.split("(")[-1].rstrip(")") for s in stages]
    return " + ".join(f"{kinds.count(k)}x {k}" for k in dict.fromkeys(kinds))


def hetero_tables(results: dict[str, Any]) -> str:
    rows = results["hetero_rows"]
    run = results.get("hetero_run", results)  # the run that made the section, else the quality run's
    lines = [
        f"Generated by `{run['command']}` on {run['date']} ({run['machine']}; a machine shared with "
        "other jobs: plan quality figures, not timings). Models: "
        + ", ".join(dict.fromkeys(r["model"] for r in rows))
        + f"; batch {BATCH_SIZE}, M = {NUM_MICROBATCHES}, float32 as profiled; CP-SAT time limit "
        f"{results['hetero_time_limit_s']} s per plan. Step times from the pipeline simulator (GPipe), in ms "
        '(* = does not fit in memory). Columns: `search` = `pt.solve` (device_order="search", the default); '
        '`given` = `pt.solve(..., options=SolverOptions(device_order="given"))` on the listed order (slow '
        "devices first); `metis` = solve in the order that puts the best baseline's heaviest stage (FLOPs) on the "
        "fastest device and so on down (Metis' rule, `partitioner.search.order.fastest_on_heaviest`), with "
        'device_order="given"; `fastest first` = solve with device_order="given" on the devices sorted '
        "fastest first (`partitioner.search.order.by_speed`); `best baseline` = the fastest of uniform, by_params and "
        "by_time that fits, on the listed order and all devices. Ratios are the column's step over search's "
        "(above 1: search is faster).",
        "",
        "| model | cluster | search | devices used by search | given | metis | fastest first | best baseline "
        "| given / search | metis / search | fastest first / search | baseline / search |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plans = r["plans"]
        ours = plans.get("search")
        used = _hardware_counts(ours["stages"]) if ours and "stages" in ours else "-"
        base = plans.get("best_baseline")
        base_cell = _ms(base) + (f" ({base['baseline']})" if base else "")
        ratios = []
        for method in ("given", "metis", "fastest_first", "best_baseline"):
            other = plans.get(method)
            if ours and other and "step_time_s" in ours and "step_time_s" in other:
                ratios.append(f"{other['step_time_s'] / ours['step_time_s']:.2f}")
            else:
                ratios.append("-")
        steps = " | ".join(_ms(plans.get(m)) for m in ("given", "metis", "fastest_first"))
        lines.append(
            f"| {r['model']} | `{r['cluster']}` | {_ms(ours)} | {used} | {steps} | {base_cell} | {' | '.join(ratios)} |"
        )
    lost = [(r["model"], r["cluster"], loss) for r in rows for loss in r["losses"]]
    lines += [
        "",
        "Where search's step is longer than another column's plan that fits: "
        + ("none." if not lost else "")
        + ("" if not lost else f"{len(lost)} losses."),
    ]
    lines += [f"- {m} on `{c}`: {loss}" for m, c, loss in lost]
    return "\n".join(lines)


# ----- M and the schedule chosen ----------------------------------------------------------------------


def run_choose(name: str, cluster_name: str, time_limit_s: float) -> dict[str, Any]:
    """Fixed M = 8 GPipe (``pt.solve``) against ``pt.plan_for_batch`` choosing both, with the same time limit."""
    from partitioner.search.choose import choose

    graph, _ = load_graph(name, reprofile=False)
    cluster = pt.Cluster.from_json(cluster_name)
    row: dict[str, Any] = {"model": name, "cluster": cluster_name, "nodes": graph.number_of_nodes()}
    started = time.perf_counter()
    try:
        fixed = pt.solve(graph, cluster, num_microbatches=NUM_MICROBATCHES, time_limit_s=time_limit_s)
        row["fixed"] = {"num_stages": fixed.num_stages, "step_time_s": fixed.step_time_s}
    except pt.InfeasiblePlanError as error:
        row["fixed"] = {"error": str(error)}
    row["fixed"]["wall_s"] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        choice = choose(graph, cluster, batch_size=BATCH_SIZE, time_limit_s=time_limit_s)
        plan = choice.plan
        row["auto"] = {
            "num_microbatches": plan.num_microbatches,
            "schedule": plan.schedule,
            "num_stages": plan.num_stages,
            "step_time_s": plan.step_time_s,
            "candidates": [
                {
                    "num_microbatches": c.num_microbatches,
                    "schedule": c.schedule,
                    "step_time_s": c.step_time_s,
                    "screened_step_s": c.screened_step_s,
                    "error": c.error,
                    "solved": c.solved,
                }
                for c in choice.candidates
            ],
        }
    except pt.InfeasiblePlanError as error:
        row["auto"] = {"error": str(error)}
    row["auto"]["wall_s"] = time.perf_counter() - started
    return row


def choose_tables(results: dict[str, Any]) -> str:
    section = results["choose"]
    lines = [
        f"Generated by `{section['command']}` on {section['date']} ({section['machine']}; a machine shared with "
        "other jobs: plan quality figures, not timings). Batch "
        f"{section['batch_size']}, float32 as profiled, Adam; each device pays the bundled profiles' assumed "
        f"{section['action_overhead_s'] * 1e6:.0f} µs per forward or backward of a stage (docs/cost-model.md); "
        f"time limit {section['time_limit_s']} s for each column's whole planning. `fixed` = `pt.solve(graph, "
        f"cluster, num_microbatches={NUM_MICROBATCHES})` with GPipe, what the tables above use; `chosen` = "
        f"`pt.plan_for_batch(graph, cluster, batch_size={section['batch_size']})`, M among the divisors of the "
        "batch and GPipe or 1F1B, the fewest micro-batches within 5% of the shortest simulated step (`choose`'s "
        "margin). Steps in ms from the simulator, each plan in its own schedule. solved = candidates planned "
        "(chains: all; DAGs: the 3 best screened by baselines) / candidates with a plan among them.",
        "",
        "| model | nodes | cluster | fixed: K | fixed: step | chosen: M | schedule | K | step | fixed / chosen "
        "| solved / with a plan | planning s (fixed, chosen) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in section["rows"]:
        fixed, auto = r["fixed"], r["auto"]
        fixed_k = str(fixed["num_stages"]) if "step_time_s" in fixed else "-"
        fixed_step = f"{fixed['step_time_s'] * 1e3:.2f}" if "step_time_s" in fixed else "does not fit"
        if "step_time_s" in auto:
            tried = [c for c in auto["candidates"] if c["solved"]]
            planned = [c for c in tried if c["step_time_s"] is not None]
            chosen = (
                f"{auto['num_microbatches']} | {auto['schedule']} | {auto['num_stages']} "
                f"| {auto['step_time_s'] * 1e3:.2f}"
            )
            ratio = f"{fixed['step_time_s'] / auto['step_time_s']:.2f}x" if "step_time_s" in fixed else "-"
            solved = f"{len(tried)} / {len(planned)}"
        else:
            chosen, ratio, solved = "- | - | - | no plan", "-", "-"
        lines.append(
            f"| {r['model']} | {r['nodes']} | `{r['cluster']}` | {fixed_k} | {fixed_step} | {chosen} | {ratio} "
            f"| {solved} | {fixed['wall_s']:.1f}, {auto['wall_s']:.1f} |"
        )
    return "\n".join(lines)


# ----- data x pipeline: replicas chosen by the planner -----------------------------------------------

REPLICA_CLUSTERS = ("8xH100-nvlink", "2x8xH100-ib")
REPLICA_BATCHES = (32, 512)  # global batches; the graphs (profiled at 32) are rescaled by the planner
REPLICAS_TIME_LIMIT_S = 20.0  # per row, shared by its 6 (one node) or 8 (two nodes) D x layout candidates


def run_replicas(name: str, cluster_name: str, batch_size: int, time_limit_s: float) -> dict[str, Any]:
    """``plan_replicas`` with D, M and the schedule chosen: the hybrid it picks beside pure data parallel
    (D = N, K = 1) and one pipeline (D = 1), each the best candidate of its D from the same search."""
    from partitioner.search.replicas import plan_replicas

    graph, _ = load_graph(name, reprofile=False)
    cluster = pt.Cluster.from_json(cluster_name)
    n = cluster.num_devices
    row: dict[str, Any] = {"model": name, "cluster": cluster_name, "num_devices": n, "batch_size": batch_size}
    started = time.perf_counter()
    try:
        choice = plan_replicas(
            graph, cluster, batch_size=batch_size, num_microbatches="auto", schedule="auto", time_limit_s=time_limit_s
        )
    except pt.InfeasiblePlanError as error:  # no D fits: the message lists every candidate's reason
        row.update(wall_s=time.perf_counter() - started, infeasible=str(error))
        print(f"{name:14s} {cluster_name:14s} B={batch_size:<4d} no plan: {_first_sentence(str(error))}", flush=True)
        return row
    except Exception as error:  # a planner bug: recorded in the row, not hidden
        row.update(wall_s=time.perf_counter() - started, error=f"{type(error).__name__}: {error}")
        print(f"{name:14s} {cluster_name:14s} B={batch_size:<4d} ERROR {row['error']}", flush=True)
        return row
    row["wall_s"] = time.perf_counter() - started
    best = choice.best()
    assert best is not None and best.plan is not None  # plan_replicas returned: a candidate fits
    row["chosen"] = {**_replica_figures(choice.plan), "layout": best.layout, "status": choice.plan.status}
    for kind, d in (("data_parallel", n), ("pipeline", 1)):
        row[kind] = _pure(choice, graph, cluster, batch_size, d, time_limit_s)
        if "step_time_s" in row[kind]:
            row[kind]["chosen_speedup"] = row[kind]["step_time_s"] / row["chosen"]["step_time_s"]
    row["candidates"] = [
        {
            "num_replicas": c.num_replicas,
            "devices_per_replica": c.devices_per_replica,
            "layout": c.layout,
            **(_replica_figures(c.plan) if c.plan is not None else {"error": c.reason}),
        }
        for c in choice.candidates
    ]
    print(_replica_line(row), flush=True)
    return row


def _pure(
    choice: Any, graph: nx.DiGraph, cluster: pt.Cluster, batch_size: int, d: int, time_limit_s: float
) -> dict[str, Any]:
    """The figures of the search's best candidate with D = ``d``, or why it has none.

    Where every candidate of that D ran out of its share of the time (CP-SAT found no plan in time,
    which says nothing about fitting), that D is planned again alone with the row's whole time limit
    (``"alone": True``); ``"timed_out": True`` where that found none either.
    """
    from partitioner.search.replicas import plan_replicas

    found = choice.best(num_replicas=d)
    if found is not None and found.plan is not None:
        return {**_replica_figures(found.plan), "layout": found.layout}
    tried = [c for c in choice.candidates if c.num_replicas == d]
    if not tried:
        return {"error": f"{d} replicas do not split the batch of {batch_size} evenly"}
    if not all(_timed_out(c.reason) for c in tried):
        reason = next(c.reason for c in tried if not _timed_out(c.reason))
        return {"error": _why(reason), "reason": reason}
    started = time.perf_counter()
    try:
        alone = plan_replicas(
            graph,
            cluster,
            batch_size=batch_size,
            replicas=d,
            num_microbatches="auto",
            schedule="auto",
            time_limit_s=time_limit_s,
        )
    except pt.InfeasiblePlanError as error:
        figures = {"error": _why(str(error)), "reason": str(error), "timed_out": _timed_out(str(error))}
    else:
        best = alone.best()
        assert best is not None
        figures = {**_replica_figures(alone.plan), "layout": best.layout, "alone": True}
    return {**figures, "search_reason": tried[0].reason, "alone_wall_s": time.perf_counter() - started}


def _timed_out(reason: str) -> bool:
    """Whether a candidate's reason is CP-SAT's time limit (partitioner.search.solve's message), not memory.

    ``ReplicaCandidate`` keeps the message only, not whether it was a ``SolverTimeoutError``."""
    return "found no feasible plan within time_limit_s" in reason


def _why(reason: str) -> str:
    """The planner's own first sentence: past ``choose``'s "No plan for batch ... M=8 with gpipe: " preamble."""
    line = reason.splitlines()[0] if reason else ""
    closest = re.search(r"M=(\d+) with (\w+): (.*)", line)
    if closest is None:
        return _first_sentence(line)
    return f"M = {closest[1]} {closest[2]}: {_first_sentence(closest[3])}"


def _replica_figures(plan: pt.Plan) -> dict[str, Any]:
    """The figures of one candidate's plan (replica 0's, with its R): D, stages, M, schedule, step, memory."""
    return {
        "num_replicas": plan.num_replicas,
        "num_stages": plan.num_stages,
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "step_time_s": plan.step_time_s,
        "max_reduce_s": max(plan.reduce_times.values(), default=0.0),
        "max_memory_bytes": max(plan.memory_bytes[d] for d in plan.stages),
        "capacity_bytes": min(plan.capacity_bytes[d] for d in plan.stages),
    }


def _first_sentence(text: str) -> str:
    """The first sentence of an error's first line: up to the first '.' followed by a space."""
    line = text.splitlines()[0] if text else ""
    return re.split(r"(?<=\.)\s", line, maxsplit=1)[0]


def _replica_line(row: dict[str, Any]) -> str:
    chosen = row["chosen"]
    cells = [f"chosen {chosen['num_replicas']}x{chosen['num_stages']} {chosen['layout']} {_step_cell(chosen)}"]
    for kind in ("data_parallel", "pipeline"):
        p = row[kind]
        cells.append(f"{kind}=" + (_step_cell(p) if "step_time_s" in p else "does not fit"))
    return f"{row['model']:14s} {row['cluster']:14s} B={row['batch_size']:<4d} " + " ".join(cells)


def _step_cell(p: dict[str, Any]) -> str:
    return f"{p['step_time_s'] * 1e3:.2f}ms"


def _pure_step(p: dict[str, Any]) -> str:
    """A step in ms, marked ‡ where that D was planned again alone (its share of the search timed out)."""
    return f"{p['step_time_s'] * 1e3:.2f}" + ("‡" if p.get("alone") else "")


def _no_plan(p: dict[str, Any]) -> str:
    if p.get("timed_out"):
        return "no plan in time (CP-SAT's time limit, alone too)"
    return f"does not fit: {p['error']}"


def replica_tables(results: dict[str, Any]) -> str:
    section = results["replicas"]
    lines = [
        f"Generated by `{section['command']}` on {section['date']} ({section['machine']}; a machine shared with "
        "other jobs: plan quality figures, not timings). Float32 as profiled at batch 32 and rescaled to the "
        "global batch, Adam; time limit "
        f"{section['time_limit_s']} s for each row's whole planning (shared by its candidates). "
        '`chosen` = `plan_replicas(graph, cluster, batch_size=B, num_microbatches="auto", '
        'schedule="auto")`: D replicas x K stages (K = stages replica 0 uses of its N / D devices) in the '
        "`blocks` or `strided` layout, M and the schedule per replica; `data parallel` = its best candidate with "
        "D = N (K = 1); `pipeline` = its best with D = 1 (one pipeline on all N devices, M and schedule chosen). "
        "Steps in ms from the simulator with each stage's R; memory = the largest predicted peak of a device "
        "in GiB (80 GB devices); R (max) = the longest stage's all-reduce in ms; speedup = that column's step "
        "/ chosen's; planning s = the row's `plan_replicas` wall time (over the limit where CP-SAT's model "
        "building and `choose`'s screen, which runs outside the budget, take long on 2 shared cores). "
        "‡: the search's candidates of that D "
        "found no plan within their share of the time limit (CP-SAT's time limit, not memory), so that D was "
        "planned again alone with the row's whole time limit (`plan_replicas(..., replicas=D)`): a plan the "
        "search itself could not weigh.",
        "",
        "| model | cluster | B | chosen D x K | layout | M, schedule | step | memory | R (max) "
        "| data parallel: step | memory | pipeline: K | step | memory | DP / chosen | pipeline / chosen "
        "| planning s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failed = []
    for r in section["rows"]:
        head = f"| {r['model']} | `{r['cluster']}` | {r['batch_size']} "
        if "chosen" not in r:
            why = "error" if "error" in r else "no plan"
            failed.append((r, r.get("error") or r["infeasible"]))
            lines.append(head + f"| {why} (below) |" + " - |" * 12 + f" {r['wall_s']:.1f} |")
            continue
        c, dp, pp = r["chosen"], r["data_parallel"], r["pipeline"]
        cells = [
            f"{c['num_replicas']} x {c['num_stages']}",
            c["layout"],
            f"{c['num_microbatches']}, {c['schedule']}",
            f"{c['step_time_s'] * 1e3:.2f}",
            f"{c['max_memory_bytes'] / 2**30:.1f}",
            f"{c['max_reduce_s'] * 1e3:.2f}",
        ]
        if "step_time_s" in dp:
            cells += [_pure_step(dp), f"{dp['max_memory_bytes'] / 2**30:.1f}"]
        else:
            cells += [_no_plan(dp), "-"]
        if "step_time_s" in pp:
            cells += [str(pp["num_stages"]), _pure_step(pp), f"{pp['max_memory_bytes'] / 2**30:.1f}"]
        else:
            cells += ["-", _no_plan(pp), "-"]
        cells += [f"{p['chosen_speedup']:.2f}x" if "chosen_speedup" in p else "-" for p in (dp, pp)]
        cells.append(f"{r['wall_s']:.1f}")
        lines.append(head + "| " + " | ".join(cells) + " |")
    if failed:
        lines += ["", "Rows without a plan:"]
        lines += [
            f"- {r['model']} on `{r['cluster']}`, B = {r['batch_size']}: {_why(why)}"
            + (" (CP-SAT's time limit, not memory)" if _timed_out(why) else "")
            for r, why in failed
        ]
    return "\n".join(lines)


# ----- random chains against brute force -----------------------------------------------------------

RANDOM_CHAIN_CASES = {"quick": 14, "full": 40}  # (chain, cluster) pairs, each planned for every M and schedule
RANDOM_CHAIN_MS = (1, 2, 4, 8, 16)
RANDOM_CHAIN_SCHEDULES = ("gpipe", "1f1b")
RANDOM_CHAIN_MAX_PLANS = {"quick": 400, "full": 1500}  # plans to enumerate per pair at most (sizes redrawn above)
SPEEDS = (25e12, 50e12, 100e12, 200e12)  # FLOP/s the heterogeneous devices are drawn from
BANDWIDTHS = (10e9, 50e9, 450e9)  # bytes/s of every link, drawn per cluster


def _need_at_16(graph: nx.DiGraph) -> int:
    """The graph's bytes with every node holding 16 micro-batches' activations, the figure the random
    problems' memories are drawn against (a one-device cost model's own budget is a last stage's: one)."""
    costs = pt.CostModel(graph, pt.Cluster.uniform(1, memory=1), num_microbatches=16)
    return sum(costs.node_memory_bytes("kept", 16).values())


def random_chain_pair(rng: Any, max_plans: int) -> tuple[nx.DiGraph, pt.Cluster, str]:
    """A random chain of 8-20 layers and a cluster of 2-8 devices (uniform, or two kinds of device
    with mixed speeds and memories), redrawn until it has at most ``max_plans`` legal placements."""
    from partitioner.synthetic import random_chain

    while True:
        n, k = rng.randint(8, 20), rng.randint(2, 8)
        graph = random_chain(n, seed=rng.randint(0, 10**9))
        need = _need_at_16(graph)
        bandwidth = rng.choice(BANDWIDTHS)
        if rng.random() < 0.5:
            kind = "uniform"
            cluster = pt.Cluster.uniform(k, memory=int(2 * need), flops_per_s=rng.choice(SPEEDS), bandwidth=bandwidth)
        else:
            kind = "mixed"
            kinds = [(rng.choice(SPEEDS), int(need * rng.choice((0.4, 0.7, 2.0)))) for _ in range(2)]
            picks = [rng.randrange(2) for _ in range(k)]
            picks[rng.randrange(k)] = 1 - picks[0]  # both kinds present
            devices = [pt.Device(f"/GPU:{i}", memory=kinds[p][1], flops_per_s=kinds[p][0]) for i, p in enumerate(picks)]
            cluster = pt.Cluster(devices, bandwidth=bandwidth)
        if len(every_chain_placement(graph, cluster, count_only=True)) <= max_plans:
            return graph, cluster, kind


def every_chain_placement(graph: nx.DiGraph, cluster: pt.Cluster, count_only: bool = False) -> list[Any]:
    """Every legal plan of a chain: each contiguous split into 1..K blocks on distinct devices in any
    order, up to swapping interchangeable devices (partitioner.search.order.device_classes: such swaps change
    no cost). Each item is (device order, assignment); with ``count_only`` the items are placeholders."""
    import itertools
    import math

    from partitioner.cluster import reorder
    from partitioner.search.order import _devices, _label_sequences, device_classes

    classes = device_classes(cluster)
    order = pt.CostModel(graph, pt.Cluster.uniform(1, memory=1)).order
    n = len(order)
    items: list[Any] = []
    for blocks in range(1, min(n, cluster.num_devices) + 1):
        sequences = []
        for counts in itertools.product(*(range(len(c) + 1) for c in classes)):
            if sum(counts) == blocks:
                sequences += _label_sequences(list(counts))
        splits = math.comb(n - 1, blocks - 1)
        if count_only:
            items += [None] * (splits * len(sequences))
            continue
        for cuts in itertools.combinations(range(1, n), blocks - 1):
            bounds = [0, *cuts, n]
            for labels in sequences:
                used = _devices(classes, labels)
                rest = [d for d in range(cluster.num_devices) if d not in used]
                listed = reorder(cluster, [*used, *rest])
                assignment = {v: listed.names[b] for b in range(blocks) for v in order[bounds[b] : bounds[b + 1]]}
                items.append((listed, assignment))
    return items


def run_random_chains(cases: int, max_plans: int, seed: int = 0) -> list[dict[str, Any]]:
    """One row per (pair, M, schedule): pt.solve's simulated step against the best of every legal plan."""
    import random

    from partitioner.simulate import simulate_assignment

    rng = random.Random(seed)
    rows = []
    for case in range(cases):
        graph, cluster, kind = random_chain_pair(rng, max_plans)
        placements = every_chain_placement(graph, cluster)
        for schedule in RANDOM_CHAIN_SCHEDULES:
            for m in RANDOM_CHAIN_MS:
                best = None
                for listed, assignment in placements:
                    costs = pt.CostModel(graph, listed, num_microbatches=m, schedule=schedule)
                    if not costs.fits(costs.evaluate(assignment)):
                        continue
                    step = simulate_assignment(costs, assignment).step_time_s
                    best = step if best is None else min(best, step)
                started = time.perf_counter()
                try:
                    plan = pt.solve(graph, cluster, num_microbatches=m, schedule=schedule)
                    ours = pt.simulate(plan, graph, cluster).step_time_s
                except pt.InfeasiblePlanError:
                    ours = None
                row = {
                    "case": case,
                    "layers": graph.number_of_nodes(),
                    "devices": cluster.num_devices,
                    "cluster": kind,
                    "num_microbatches": m,
                    "schedule": schedule,
                    "plans": len(placements),
                    "best_step_s": best,
                    "solve_step_s": ours,
                    "solve_stages": None if ours is None else plan.num_stages,
                    "solve_s": time.perf_counter() - started,
                    "ratio": None if best is None or ours is None else ours / best,
                }
                rows.append(row)
        mine = [r["ratio"] for r in rows[-len(RANDOM_CHAIN_MS) * len(RANDOM_CHAIN_SCHEDULES) :] if r["ratio"]]
        print(
            f"random chain {case}: {graph.number_of_nodes()} layers, {cluster.num_devices} {kind} devices, "
            f"{len(placements)} plans: worst solve/best {max(mine, default=float('nan')):.4f}",
            flush=True,
        )
    return rows


def random_chain_tables(results: dict[str, Any]) -> str:
    rows = results["random_chain_rows"]
    lines = [
        f"Generated by `{results['command']}` on {results['date']} ({results['machine']}). "
        f"{len({r['case'] for r in rows})} random chains (`partitioner.synthetic.random_chain`, 8-20 layers) on "
        "clusters of 2-8 devices (uniform, or two kinds drawn from 25-200 TFLOP/s with memories of 0.4x, 0.7x "
        "or 2x the chain's need at M = 16; links of 10, 50 or 450 GB/s), sizes redrawn while a pair has more "
        f"than {results['random_chain_max_plans']} legal plans; each pair planned for M in "
        f"{', '.join(map(str, RANDOM_CHAIN_MS))} and both schedules. Brute force: every contiguous split into "
        "1..K blocks on distinct devices in every order (up to swapping interchangeable devices), each that "
        "fits simulated (`partitioner.simulate`). Ratio = `pt.solve`'s simulated step / the best enumerated "
        "step (goal: worst <= 1.01, mean <= 1.002).",
        "",
        "| schedule | M | cases | worst | mean | cases above 1.001 | solve time, mean (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + _brute_force_rows(rows, RANDOM_CHAIN_MS))


def _brute_force_rows(rows: list[dict[str, Any]], microbatches: Sequence[int]) -> list[str]:
    """The rows of a brute-force table (random chains or DAGs): worst and mean ratio per schedule and M,
    then overall, and the cases where no plan fits."""
    lines = []
    groups = [(s, m) for s in RANDOM_CHAIN_SCHEDULES for m in microbatches] + [("all", None)]
    for schedule, m in groups:
        mine = [
            r
            for r in rows
            if r["ratio"] is not None and schedule in ("all", r["schedule"]) and m in (None, r["num_microbatches"])
        ]
        if not mine:
            continue
        ratios = [r["ratio"] for r in mine]
        label = "**all**" if schedule == "all" else schedule
        lines.append(
            f"| {label} | {m or 'all'} | {len(mine)} | {max(ratios):.4f} | {sum(ratios) / len(ratios):.4f} "
            f"| {sum(x > 1.001 for x in ratios)} | {sum(r['solve_s'] for r in mine) / len(mine):.3f} |"
        )
    neither = sum(r["best_step_s"] is None and r["solve_step_s"] is None for r in rows)
    missed = sum(r["best_step_s"] is not None and r["solve_step_s"] is None for r in rows)
    lines += [
        "",
        f"Cases where no plan fits (brute force and solve agree): {neither}. Cases where a plan fits but solve "
        f"found none: {missed}.",
    ]
    return lines


# ----- random DAGs against brute force -------------------------------------------------------------

RANDOM_DAG_CASES = {"quick": 12, "full": 40}  # (DAG, cluster) pairs, each planned for every M and schedule
RANDOM_DAG_MS = (1, 4, 16)
RANDOM_DAG_MAX_PLANS = {"quick": 1500, "full": 4000}  # plans to enumerate per pair at most (sizes redrawn above)


def random_dag_pair(rng: Any, max_plans: int) -> tuple[nx.DiGraph, pt.Cluster, str]:
    """A random DAG of 6-10 layers with branches and joins (``partitioner.synthetic.random_block_dag``:
    residual and inception blocks) and a cluster of 2-4 devices (uniform, or two kinds of device with
    mixed speeds and memories), redrawn until it has at most ``max_plans`` legal placements."""
    from partitioner.synthetic import random_block_dag

    while True:
        n, k = rng.randint(6, 10), rng.randint(2, 4)
        graph = random_block_dag(n, seed=rng.randint(0, 10**9))
        need = _need_at_16(graph)
        bandwidth = rng.choice(BANDWIDTHS)
        if rng.random() < 0.5:
            kind = "uniform"
            cluster = pt.Cluster.uniform(k, memory=int(2 * need), flops_per_s=rng.choice(SPEEDS), bandwidth=bandwidth)
        else:
            kind = "mixed"
            kinds = [(rng.choice(SPEEDS), int(need * rng.choice((0.4, 0.7, 2.0)))) for _ in range(2)]
            picks = [rng.randrange(2) for _ in range(k)]
            picks[rng.randrange(k)] = 1 - picks[0]  # both kinds present
            devices = [pt.Device(f"/GPU:{i}", memory=kinds[p][1], flops_per_s=kinds[p][0]) for i, p in enumerate(picks)]
            cluster = pt.Cluster(devices, bandwidth=bandwidth)
        if sum(len(assignments) for _, assignments in every_dag_placement(graph, cluster)) <= max_plans:
            return graph, cluster, kind


def monotone_labelings(graph: nx.DiGraph, num_stages: int) -> list[dict[str, int]]:
    """Every {node: stage} onto stages 0..num_stages-1 (each used) where every edge goes forward
    (stage of u <= stage of v): the rule of the CP-SAT model and of ``validate_plan``."""
    order = list(nx.topological_sort(graph))
    preds = {v: list(graph.predecessors(v)) for v in order}
    found: list[dict[str, int]] = []
    labels: dict[str, int] = {}

    def place(i: int) -> None:
        if i == len(order):
            if len(set(labels.values())) == num_stages:
                found.append(dict(labels))
            return
        v = order[i]
        for s in range(max((labels[u] for u in preds[v]), default=0), num_stages):
            labels[v] = s
            place(i + 1)
        del labels[v]

    place(0)
    return found


def every_dag_placement(graph: nx.DiGraph, cluster: pt.Cluster) -> list[tuple[pt.Cluster, list[dict[str, str]]]]:
    """Every legal plan of a DAG, grouped by pipeline: for 1..K stages, each labeling of
    :func:`monotone_labelings` on each sequence of that many distinct devices in any order, up to swapping
    interchangeable devices (partitioner.search.order.device_classes). Each item is (the cluster listed in the
    pipeline order, the idle devices after it; the assignments on it)."""
    import itertools

    from partitioner.cluster import reorder
    from partitioner.search.order import _devices, _label_sequences, device_classes

    classes = device_classes(cluster)
    groups = []
    for blocks in range(1, min(graph.number_of_nodes(), cluster.num_devices) + 1):
        labelings = monotone_labelings(graph, blocks)
        for counts in itertools.product(*(range(len(c) + 1) for c in classes)):
            if sum(counts) != blocks:
                continue
            for labels in _label_sequences(list(counts)):
                used = _devices(classes, labels)
                listed = reorder(cluster, [*used, *(d for d in range(cluster.num_devices) if d not in used)])
                groups.append((listed, [{v: listed.names[s] for v, s in lab.items()} for lab in labelings]))
    return groups


def run_random_dags(cases: int, max_plans: int, seed: int = 0) -> list[dict[str, Any]]:
    """One row per (pair, M, schedule): pt.solve's simulated step against the best of every legal plan."""
    import random

    from partitioner.simulate import simulate_assignment

    rng = random.Random(seed)
    rows = []
    for case in range(cases):
        graph, cluster, kind = random_dag_pair(rng, max_plans)
        placements = every_dag_placement(graph, cluster)
        count = sum(len(assignments) for _, assignments in placements)
        for schedule in RANDOM_CHAIN_SCHEDULES:
            for m in RANDOM_DAG_MS:
                best, best_stages = None, None
                for listed, assignments in placements:
                    costs = pt.CostModel(graph, listed, num_microbatches=m, schedule=schedule)
                    for assignment in assignments:
                        if not costs.fits(costs.evaluate(assignment)):
                            continue
                        step = simulate_assignment(costs, assignment).step_time_s
                        if best is None or step < best:
                            best, best_stages = step, len(set(assignment.values()))
                started = time.perf_counter()
                try:
                    plan = pt.solve(graph, cluster, num_microbatches=m, schedule=schedule)
                    ours = pt.simulate(plan, graph, cluster).step_time_s
                except pt.InfeasiblePlanError:
                    ours = None
                rows.append(
                    {
                        "case": case,
                        "layers": graph.number_of_nodes(),
                        "devices": cluster.num_devices,
                        "cluster": kind,
                        "num_microbatches": m,
                        "schedule": schedule,
                        "plans": count,
                        "best_step_s": best,
                        "best_stages": best_stages,
                        "solve_step_s": ours,
                        "solve_stages": None if ours is None else plan.num_stages,
                        "solve_method": None if ours is None else plan.method,
                        "solve_s": time.perf_counter() - started,
                        "ratio": None if best is None or ours is None else ours / best,
                    }
                )
        mine = [r["ratio"] for r in rows[-len(RANDOM_DAG_MS) * len(RANDOM_CHAIN_SCHEDULES) :] if r["ratio"]]
        print(
            f"random DAG {case}: {graph.number_of_nodes()} layers, {graph.number_of_edges()} edges, "
            f"{cluster.num_devices} {kind} devices, {count} plans: worst solve/best "
            f"{max(mine, default=float('nan')):.4f}",
            flush=True,
        )
    return rows


def random_dag_tables(results: dict[str, Any]) -> str:
    rows = results["random_dag_rows"]
    lines = [
        f"Generated by `{results['command']}` on {results['date']} ({results['machine']}). "
        f"{len({r['case'] for r in rows})} random DAGs (`partitioner.synthetic.random_block_dag`, 6-10 layers in "
        "residual and inception blocks) on clusters of 2-4 devices (uniform, or two kinds drawn from 25-200 "
        "TFLOP/s with memories of 0.4x, 0.7x or 2x the DAG's need at M = 16; links of 10, 50 or 450 GB/s), sizes "
        f"redrawn while a pair has more than {results['random_dag_max_plans']} legal plans; each pair planned for "
        f"M in {', '.join(map(str, RANDOM_DAG_MS))} and both schedules. Brute force: every assignment of the "
        "nodes to 1..K stages in which every edge goes forward (stage of u <= stage of v, the rule of the CP-SAT "
        "model and `validate_plan`; a stage need not be contiguous in one topological order), on distinct "
        "devices in every order (up to swapping interchangeable devices), each that fits simulated "
        "(`partitioner.simulate`). Ratio = `pt.solve`'s simulated step / the best enumerated step (goal: worst "
        "<= 1.01, mean <= 1.002).",
        "",
        "| schedule | M | cases | worst | mean | cases above 1.001 | solve time, mean (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + _brute_force_rows(rows, RANDOM_DAG_MS))


# ----- report ----------------------------------------------------------------------------------------


def _ms(p: dict[str, Any] | None) -> str:
    if p is None:
        return "n/a"
    if "step_time_s" not in p:
        return "infeasible"
    return f"{p['step_time_s'] * 1e3:.2f}" + ("" if p["fits_memory"] else "*")


def _gib(p: dict[str, Any] | None) -> str:
    if p is None or "step_time_s" not in p:
        return "-"
    ratio = p["memory_ratio"]
    text = "∞" if not ratio else f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:,.0f}x"
    return f"{p['max_memory_bytes'] / 2**30:.1f} ({text})"


def ratio(rows: list[dict[str, Any]], method: str) -> list[float]:
    """Simulated step time of ``method`` over solve's, on rows where both plans exist.

    ``method="best"`` takes the fastest baseline that fits in memory.
    """
    out = []
    for r in rows:
        ours = r["plans"]["solve"]
        if method == "best":
            fitting = [
                p for m, p in r["plans"].items() if m in BASELINES and p and "step_time_s" in p and p["fits_memory"]
            ]
            other = min(fitting, key=lambda p: p["step_time_s"]) if fitting else None
        else:
            other = r["plans"].get(method)
        if ours and other and "step_time_s" in ours and "step_time_s" in other:
            out.append(other["step_time_s"] / ours["step_time_s"])
    return out


def tables(results: dict[str, Any]) -> str:
    rows = results["rows"]
    lines = [
        f"Machine: {results['machine']}. Generated by `{results['command']}` on {results['date']}.",
        f"Cluster: the first K devices of `{CLUSTER}`; batch {BATCH_SIZE}, M = {NUM_MICROBATCHES} micro-batches, "
        f"sequence length {SEQUENCE_LENGTH} for the transformers; Adam (2 slots); CP-SAT time limit "
        f"{results['time_limit_s']} s. Step times from the pipeline simulator (GPipe).",
        "",
        "Step time per training step in ms (* = does not fit in memory). `solve` is `pt.solve` as users call it: "
        "CP-SAT's bottleneck-optimal plan, or (†) the legal baseline whose simulated step is shorter. gap = "
        "CP-SAT's bottleneck against its proven lower bound on the bottleneck; step gap = solve's simulated step "
        "against the proven lower bound on the step of any plan (`CostModel.step_lower_bound_s`, docs/cost-model.md); "
        "speedup = solve's step against the whole model on "
        "one device; memory is the largest peak of a used device in GiB, with the max/min ratio over used devices.",
        "",
        "| model | params | K | solve | gap | step gap | speedup | exact DP | uniform | by_params | by_time "
        "| memory solve | memory uniform | memory by_params | memory by_time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cp, ours = r["plans"]["cp-sat"], r["plans"]["solve"]
        ok = ours is not None and "step_time_s" in ours
        gap = f"{100 * cp['gap']:.2f}%" if cp and cp.get("gap") is not None else "-"
        speedup = f"{ours['speedup']:.2f}x" if ok else "-"
        dagger = "†" if ok and "shorter step" in ours["method"] else ""
        steps = " | ".join(_ms(r["plans"].get(m)) for m in SHOWN)
        memory = " | ".join(_gib(r["plans"].get(m)) for m in ("solve", "uniform", "by_params", "by_time"))
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['devices']} | {_ms(ours)}{dagger} | {gap} "
            f"| {_step_gap(ours)} | {speedup} "
            f"| {steps} | {memory} |"
        )
    return "\n".join(lines)


def _geomean(values: list[float]) -> float:
    import math

    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary(results: dict[str, Any]) -> str:
    """Headline figures: how much slower each baseline's step is than CP-SAT's, and CP-SAT's gaps."""
    rows = results["rows"]
    lines = [
        "",
        "Other plan's step time / solve's step time (above 1: solve is faster): geometric mean and range "
        'over K where both plans exist (fitting or not; "best" is the fastest baseline that fits).',
        "",
        "| model | exact DP | uniform | by_params | by_time | best | CP-SAT gap (K = "
        + ", ".join(map(str, DEVICES))
        + ") |",
        "|---|---|---|---|---|---|---|",
    ]
    names = list(dict.fromkeys(r["model"] for r in rows))
    for name in [*names, "all"]:
        mine = [r for r in rows if name in ("all", r["model"])]
        cells = []
        for method in [*SHOWN, "best"]:
            values = ratio(mine, method)
            cells.append(f"{_geomean(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "n/a")
        gaps = [r["plans"]["cp-sat"].get("gap") for r in mine if r["plans"]["cp-sat"]]
        gap_text = (
            ", ".join("-" if g is None else f"{100 * g:.1f}%" for g in gaps)
            if name != "all"
            else (f"max {100 * max((g for g in gaps if g is not None), default=0):.1f}%")
        )
        label = "**all (geometric mean, range)**" if name == "all" else name
        lines.append(f"| {label} | {' | '.join(cells)} | {gap_text} |")
    lost = [(r["model"], r["devices"], loss) for r in rows for loss in r["losses"]]
    lines += [
        "",
        "Where solve's step or CP-SAT's bottleneck loses to a plan that fits: " + ("none." if not lost else ""),
    ]
    lines += [f"- {m}, K = {k}: {loss}" for m, k, loss in lost]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Speedup against devices, one panel per model: solve solid, baselines dashed, hollow = does not fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(4, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.8 * nrows), squeeze=False, sharex=True)
    styles = {
        "solve": ("C0", "-", "o"),
        "exact_chain": ("C4", ":", "D"),
        "uniform": ("C1", "--", "s"),
        "by_params": ("C2", "--", "^"),
        "by_time": ("C3", "--", "v"),
    }
    for ax, name in zip(axes.flat, names):
        mine = [r for r in rows if r["model"] == name]
        ks = [r["devices"] for r in mine]
        ax.plot(
            ks, [k * NUM_MICROBATCHES / (NUM_MICROBATCHES + k - 1) for k in ks], color="0.7", lw=1, label="GPipe ideal"
        )
        for method, (color, line, marker) in styles.items():
            points = [(r["devices"], r["plans"].get(method)) for r in mine]
            points = [(k, p) for k, p in points if p and "speedup" in p]
            if not points:
                continue
            ax.plot(
                [k for k, _ in points], [p["speedup"] for _, p in points], color=color, ls=line, lw=1.5, label=method
            )
            for k, p in points:
                ax.plot(k, p["speedup"], marker=marker, color=color, mfc=color if p["fits_memory"] else "white", ms=5)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(list(DEVICES))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("speedup over 1 device")
    for ax in axes[-1]:
        ax.set_xlabel("devices")
    legend: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    handles, labels = list(legend.values()), list(legend)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(
        f"Simulated GPipe speedup, {CLUSTER}, M = {NUM_MICROBATCHES} (hollow marker: does not fit)", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (the default)")
    mode.add_argument("--full", action="store_true", help="every model")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="these models only")
    parser.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per plan")
    parser.add_argument("--reprofile", action="store_true", help="profile again instead of reading graphs/")
    parser.add_argument(
        "--hetero-time-limit", type=float, default=10.0, help="CP-SAT seconds per plan on the mixed clusters"
    )
    parser.add_argument(
        "--choose-time-limit", type=float, default=12.0, help="seconds per planning in the choose section"
    )
    parser.add_argument(
        "--replicas-time-limit",
        type=float,
        default=REPLICAS_TIME_LIMIT_S,
        help="seconds per planning (every D, M and schedule together) in the replicas section",
    )
    parser.add_argument(
        "--section",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="run these sections only (default: all); results.json and README.md keep the others' last results",
    )
    parser.add_argument(
        "--readme", action="store_true", help="rewrite README.md's tables of --section from results.json, run nothing"
    )
    args = parser.parse_args()
    names = args.models or (list(MODELS) if args.full else list(QUICK))
    flag = " --full" if args.full else (" --models " + " ".join(names) if args.models else " --quick")
    if list(args.section) != list(SECTIONS):
        flag += " --section " + " ".join(args.section)
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, ortools {__import__('ortools').__version__}"
    )
    path = HERE / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if args.readme:
        write_readme(results, args.section)
        return
    if "quality" in args.section:
        rows = []
        for name in names:
            rows += run_model(name, DEVICES, args.time_limit, args.reprofile)
        results.update(
            {
                "command": "python benchmarks/planner_quality/run.py" + flag,
                "date": time.strftime("%Y-%m-%d"),
                "machine": machine,
                "cluster": CLUSTER,
                "batch_size": BATCH_SIZE,
                "num_microbatches": NUM_MICROBATCHES,
                "sequence_length": SEQUENCE_LENGTH,
                "time_limit_s": args.time_limit,
                "rows": rows,
            }
        )
    if "hetero" in args.section:
        hetero_names = [n for n in names if args.full or args.models or n in HETERO_QUICK]
        hetero_rows = []
        for name in hetero_names:
            hetero_rows += run_hetero(name, args.hetero_time_limit)
        results.update(
            {
                "hetero_clusters": list(HETERO_CLUSTERS),
                "hetero_time_limit_s": args.hetero_time_limit,
                "hetero_rows": hetero_rows,
                "hetero_run": {
                    "command": "python benchmarks/planner_quality/run.py" + flag,
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": machine,
                },
            }
        )
    if "choose" in args.section:
        choose_rows = [run_choose(n, c, args.choose_time_limit) for n in CHOOSE_MODELS for c in CHOOSE_CLUSTERS]
        results["choose"] = {
            "command": "python benchmarks/planner_quality/run.py" + flag,
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine,
            "batch_size": BATCH_SIZE,
            "action_overhead_s": pt.Cluster.from_json(CHOOSE_CLUSTERS[0]).devices[0].action_overhead_s,
            "time_limit_s": args.choose_time_limit,
            "rows": choose_rows,
        }
    if "random-chains" in args.section:
        size = "full" if args.full else "quick"
        random_rows = run_random_chains(RANDOM_CHAIN_CASES[size], RANDOM_CHAIN_MAX_PLANS[size])
        results.update(random_chain_rows=random_rows, random_chain_max_plans=RANDOM_CHAIN_MAX_PLANS[size])
        results["random_chain_run"] = {
            "command": "python benchmarks/planner_quality/run.py" + flag,
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine,
        }
    if "random-dags" in args.section:
        size = "full" if args.full else "quick"
        dag_rows = run_random_dags(RANDOM_DAG_CASES[size], RANDOM_DAG_MAX_PLANS[size])
        results.update(random_dag_rows=dag_rows, random_dag_max_plans=RANDOM_DAG_MAX_PLANS[size])
        results["random_dag_run"] = {
            "command": "python benchmarks/planner_quality/run.py" + flag,
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine,
        }
    if "replicas" in args.section:
        replica_rows = [
            run_replicas(n, c, b, args.replicas_time_limit)
            for n in names
            for c in REPLICA_CLUSTERS
            for b in REPLICA_BATCHES
        ]
        results["replicas"] = {
            "command": "python benchmarks/planner_quality/run.py" + flag,
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine,
            "time_limit_s": args.replicas_time_limit,
            "rows": replica_rows,
        }
    path.write_text(json.dumps(results, indent=1))
    write_readme(results, args.section)
    print(f"wrote {path}")


def write_readme(results: dict[str, Any], sections: list[str]) -> None:
    """Rewrites the tables of ``sections`` in README.md (and speedup.png) from ``results``."""
    readme = HERE / "README.md"
    text = readme.read_text() if readme.exists() else "<!-- results:start -->\n<!-- results:end -->\n"
    if "quality" in sections:
        plot(results, HERE / "speedup.png")
        text = replace_block(text, "results", tables(results) + "\n" + summary(results))
        print(summary(results))
    blocks = {  # section: (its marker, the heading of its part of the README, its tables)
        "hetero": ("hetero", "Heterogeneous clusters", lambda: hetero_tables(results)),
        "choose": ("choose", "M and the schedule chosen by the planner", lambda: choose_tables(results)),
        "random-chains": (
            "random-chains",
            "Random chains against brute force",
            lambda: random_chain_tables({**results, **results["random_chain_run"]}),
        ),
        "random-dags": (
            "random-dags",
            "Random DAGs against brute force",
            lambda: random_dag_tables({**results, **results["random_dag_run"]}),
        ),
        "replicas": ("replicas", "Data x pipeline: replicas chosen by the planner", lambda: replica_tables(results)),
    }
    for section, (marker, heading, make) in blocks.items():
        if section in sections:
            block = make()
            text = replace_block(text, marker, block, heading=heading)
            print(block)
    readme.write_text(text)
    print(f"wrote the tables of {', '.join(sections)} in {readme}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
