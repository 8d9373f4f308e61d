"""GPipe scaling: the pipeline simulator against the GPipe paper's Table 2, and the runtime on CPU devices.

Part 1, simulated. Two models built from code (no weights are downloaded), profiled by FLOP count:

- Transformer-48: the paper's Transformer-L with L = 48 (model dimension 2048, feed-forward 8192,
  32 heads, vocabulary 32k, sequence length 1024, batch 32; arXiv:1811.06965, Section 3), as plain
  Keras layers: embedding, 48 x (self-attention, add, LayerNorm, Dense 8192, Dense 2048, add,
  LayerNorm), output projection. 2.55B parameters; weights are never allocated (StatelessScope).
- NASNet-A Large at 224 x 224 (keras.applications.NASNetLarge, weights=None), batch 128: the
  closest AmoebaNet relative Keras ships (18 normal cells, 2 reduction cells and a reduction stem,
  the cells uneven in cost), standing in for the paper's AmoebaNet-D (18, 256).

For K = 2, 4, 8 cores of the bundled cluster 8xTPUv3-core, pt.solve plans each model once (the
planner picks the split; memory is not binding, see below), then the GPipe schedule is simulated for
M = 1 ... 32 micro-batches at a fixed global batch: per-micro-batch FLOPs, activation and edge bytes
are the batch's divided by M. Normalised throughput = throughput(K, M) / throughput(K=2, M=1), as in
the paper's Table 2, where (K=2, M=1) is 1 for both models; the reference is the planner's plan for
(K=2, M=1), while each K's split is made for M = 32 and kept for every M. The uniform
baseline (equal layer counts) is simulated too. Without re-materialisation, which the cost model does
not model, neither model fits in 16 GiB per core at these batches, so the planner gets unbounded
memory here and results.json records how much each stage would need.

Part 2, measured. A small transformer of the same family trains on 2 logical CPU devices (1 intra-op
thread, 2 inter-op threads, fixed when TensorFlow starts, so in a child process) for M = 1, 2, 4, 8.
For each M the child profiles the model with measured layer times at that micro-batch size, plans
with cost="time", simulates the step and wraps the model with that plan; then the configurations
take turns at training steps for a few rounds, and the fastest step of each is kept (other jobs
share this machine's cores). The measured and predicted normalised throughputs are compared.

Writes results.json, the table in README.md and a timeline picture beside this script:

    .venv/bin/python benchmarks/gpipe_scaling/run.py            # --quick (default), a few minutes
    .venv/bin/python benchmarks/gpipe_scaling/run.py --full     # longer solves, more timed steps

Profiled layer graphs of part 1 are cached in graphs/ (JSON); ``--reprofile`` rebuilds them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import networkx as nx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.readme
from benchmarks.readme import write_block  # noqa: E402

GRAPHS = HERE / "graphs"
CLUSTER = "8xTPUv3-core"
DEVICES = (2, 4, 8)
MICROBATCHES = (1, 2, 4, 8, 16, 32)
OPTIMIZER_SLOTS = 1  # RMSProp, as in the paper (12 bytes per weight: weight, gradient, one slot)
UNBOUNDED_MEMORY = "64TiB"
SEEDS = (0, 1, 2)  # CP-SAT seeds tried while the plan is not proven optimal
TIMELINE = ("Transformer-48", 4, 8)  # model, K, M of the timeline picture

# The paper's Table 2 (arXiv:1811.06965v5, Section 3): normalised training throughput on TPUs.
PAPER = {
    "Transformer-48": {1: (1.0, 1.07, 1.3), 4: (1.7, 3.2, 4.8), 32: (1.8, 3.4, 6.3)},
    "AmoebaNet-like": {1: (1.0, 1.13, 1.38), 4: (1.07, 1.26, 1.72), 32: (1.21, 1.84, 3.48)},
}
PAPER_MODEL = {"Transformer-48": "Transformer-48", "AmoebaNet-like": "AmoebaNet-D (18, 256)"}

# name -> description, global batch, graph file
MODELS = {
    "Transformer-48": {
        "batch_size": 32,
        "file": "transformer48-b32.json",
        "description": "48 layers, model dim 2048, feed-forward 8192, 32 heads, vocabulary 32k, sequence 1024",
    },
    "AmoebaNet-like": {
        "batch_size": 128,
        "file": "nasnetlarge224-b128.json",
        "description": "keras.applications.NASNetLarge (NASNet-A 6@4032), 224 x 224, weights=None",
    },
}

# Part 2: the small transformer measured on logical CPU devices.
SMALL = {"num_layers": 4, "model_dim": 256, "ff_dim": 1024, "num_heads": 4, "vocabulary": 1024, "sequence": 64}
SMALL_BATCH = 32
MEASURED_MICROBATCHES = (1, 2, 4, 8)


# ----- models -------------------------------------------------------------------------------------


def build_transformer(
    num_layers: int, model_dim: int, ff_dim: int, num_heads: int, vocabulary: int, sequence: int, *, lazy: bool
) -> Any:
    """A Transformer-L as in the GPipe paper: each layer is self-attention + feed-forward (post-LayerNorm).

    With ``lazy`` the weights are declared but never allocated (keras.StatelessScope without
    initialisation, zeros initialisers): enough to trace and count FLOPs of a 2.5B-parameter model
    in a few hundred MB of RAM. Such a model cannot be trained.
    """
    import contextlib

    import keras

    init = "zeros" if lazy else "glorot_uniform"
    scope = keras.StatelessScope(initialize_variables=False) if lazy else contextlib.nullcontext()
    with scope:
        tokens = keras.Input((sequence,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(vocabulary, model_dim, embeddings_initializer="zeros" if lazy else "uniform")(tokens)
        for i in range(num_layers):
            attention = keras.layers.MultiHeadAttention(
                num_heads, model_dim // num_heads, kernel_initializer=init, name=f"attention_{i}"
            )(x, x)
            x = keras.layers.Add(name=f"add_attention_{i}")([x, attention])
            x = keras.layers.LayerNormalization(name=f"norm_attention_{i}")(x)
            hidden = keras.layers.Dense(ff_dim, activation="relu", kernel_initializer=init, name=f"ff_in_{i}")(x)
            hidden = keras.layers.Dense(model_dim, kernel_initializer=init, name=f"ff_out_{i}")(hidden)
            x = keras.layers.Add(name=f"add_ff_{i}")([x, hidden])
            x = keras.layers.LayerNormalization(name=f"norm_ff_{i}")(x)
        logits = keras.layers.Dense(vocabulary, kernel_initializer=init, name="logits")(x)
        return keras.Model(tokens, logits, name=f"transformer_{num_layers}")


def profile_part1(name: str) -> nx.DiGraph:
    """Profiles model ``name`` of MODELS at its global batch as one micro-batch (M = 1), FLOPs only."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    from profiles import profile_model

    if name == "Transformer-48":
        model = build_transformer(48, 2048, 8192, 32, 32000, 1024, lazy=True)
    else:
        model = keras.applications.NASNetLarge(weights=None, input_shape=(224, 224, 3))
    return profile_model(model, batch_size=MODELS[name]["batch_size"], num_microbatches=1, measure_time=False)


def load_part1(name: str, reprofile: bool) -> nx.DiGraph:
    import partitioner as pt

    path = GRAPHS / MODELS[name]["file"]
    if reprofile or not path.exists():
        started = time.perf_counter()
        graph = profile_part1(name)
        GRAPHS.mkdir(exist_ok=True)
        pt.save_graph(graph, path)
        print(f"profiled {name} in {time.perf_counter() - started:.0f} s -> {path.relative_to(HERE)}", flush=True)
    return pt.load_graph(path)


def per_microbatch(graph: nx.DiGraph, num_microbatches: int) -> nx.DiGraph:
    """The graph's costs for micro-batches of 1/M of the profiled batch (weights unchanged)."""
    scaled = graph.copy()
    for _, data in scaled.nodes(data=True):
        for key in ("flops", "forward_flops", "time_s"):
            if key in data:
                data[key] = float(data[key]) / num_microbatches
        data["activation_bytes"] = round(int(data["activation_bytes"]) / num_microbatches)
    for _, _, data in scaled.edges(data=True):
        data["bytes"] = round(int(data["bytes"]) / num_microbatches)
    scaled.graph["num_microbatches"] = num_microbatches
    return scaled


# ----- part 1: simulated --------------------------------------------------------------------------


def tpu_cluster(num_devices: int) -> Any:
    """The first ``num_devices`` cores of CLUSTER, each with unbounded memory (see the module docstring)."""
    import partitioner as pt

    base = pt.Cluster.from_json(CLUSTER).take(num_devices)
    devices = [
        pt.Device(d.name, memory=UNBOUNDED_MEMORY, flops_per_s=d.flops_per_s, hardware=d.hardware) for d in base.devices
    ]
    return pt.Cluster(devices, bandwidth=base.bandwidth_bytes_per_s, name=base.name), base


def simulate_model(name: str, graph: nx.DiGraph, time_limit_s: float) -> dict[str, Any]:
    import partitioner as pt
    from partitioner.show.timeline import save_timeline

    graphs = {m: per_microbatch(graph, m) for m in MICROBATCHES}
    # The reference, throughput at (K = 2, M = 1), comes from the plan the planner makes for that
    # configuration; each K's split below is made for M = 32 and kept for every M.
    cluster, _ = tpu_cluster(2)
    reference_plan = pt.solve(
        graphs[1], cluster, num_microbatches=1, optimizer_slots=OPTIMIZER_SLOTS, time_limit_s=time_limit_s
    )
    reference = pt.simulate(reference_plan, graphs[1], cluster, num_microbatches=1).step_time_s
    rows = []
    for k in DEVICES:
        cluster, real = tpu_cluster(k)
        started = time.perf_counter()
        # CP-SAT stops at its time limit; where that leaves the plan unproven, the best of SEEDS searches.
        plans = []
        for seed in SEEDS:
            plans.append(
                pt.solve(
                    graphs[max(MICROBATCHES)],
                    cluster,
                    num_microbatches=max(MICROBATCHES),
                    optimizer_slots=OPTIMIZER_SLOTS,
                    time_limit_s=time_limit_s,
                    options=pt.SolverOptions(seed=seed),
                )
            )
            if plans[-1].status == "optimal":
                break
        plan = min(plans, key=lambda p: (p.step_time_s, p.bottleneck_s))
        solve_s = time.perf_counter() - started
        uniform = pt.baselines.uniform(
            graphs[max(MICROBATCHES)], cluster, num_microbatches=max(MICROBATCHES), optimizer_slots=OPTIMIZER_SLOTS
        )
        steps, uniform_steps, bubbles = {}, {}, {}
        for m in MICROBATCHES:
            sim = pt.simulate(plan, graphs[m], cluster, num_microbatches=m)
            steps[m] = sim.step_time_s
            bubbles[m] = sim.bubble_fraction
            uniform_steps[m] = pt.simulate(uniform, graphs[m], cluster, num_microbatches=m).step_time_s
            if (name, k, m) == TIMELINE:
                save_timeline(
                    sim,
                    HERE / "timeline.png",
                    title=f"{name} on {k} TPU v3 cores, GPipe, M = {m} (simulated)",
                )
        # The same plan with links 10x slower and 10x faster: how much the uncertain ICI figure matters.
        links = {}
        for factor in (0.1, 10.0):
            rates = [[rate * factor for rate in row] for row in cluster.bandwidth_bytes_per_s]
            other = pt.Cluster(cluster.devices, bandwidth=rates, name=cluster.name)
            links[str(factor)] = reference / pt.simulate(plan, graphs[32], other, num_microbatches=32).step_time_s
        capacity = real.devices[0].memory_bytes
        row = {
            "devices": k,
            "method": plan.method,
            "status": plan.status,
            "gap": plan.gap,
            "solve_time_s": solve_s,
            "bottleneck_s_per_seed": [p.bottleneck_s for p in plans],
            "layers_per_stage": [len(plan.nodes_on(d)) for d in plan.stages],
            "memory_gib_per_stage": [plan.memory_bytes[d] / 2**30 for d in plan.stages],
            "fits_16gib": max(plan.memory_bytes.values()) <= capacity,
            "step_s": {str(m): steps[m] for m in MICROBATCHES},
            "bubble_fraction": {str(m): bubbles[m] for m in MICROBATCHES},
            "normalised": {str(m): reference / steps[m] for m in MICROBATCHES},
            "uniform_step_s": {str(m): uniform_steps[m] for m in MICROBATCHES},
            "uniform_normalised": {str(m): reference / uniform_steps[m] for m in MICROBATCHES},
            "normalised_m32_link_factor": links,
        }
        rows.append(row)
        cells = " ".join(f"{reference / steps[m]:.2f}" for m in MICROBATCHES)
        print(
            f"{name} K={k}: {plan.method} ({plan.status}, {solve_s:.1f} s), normalised throughput at M = "
            f"{', '.join(map(str, MICROBATCHES))}: {cells}; uniform split at M = 32: "
            f"{reference / uniform_steps[32]:.2f}",
            flush=True,
        )
    return {
        "paper_model": PAPER_MODEL[name],
        "description": MODELS[name]["description"],
        "global_batch": MODELS[name]["batch_size"],
        "num_params": sum(int(d["param_bytes"]) for _, d in graph.nodes(data=True)) // 4,  # float32 weights
        "num_layers_in_graph": graph.number_of_nodes(),
        "tflop_per_step": sum(float(d["flops"]) for _, d in graph.nodes(data=True)) / 1e12,
        "reference_step_s": reference,  # K = 2, M = 1, the planner's plan for it
        "reference_method": reference_plan.method,
        "rows": rows,
    }


# ----- part 2: measured on logical CPU devices ----------------------------------------------------


def child(rounds: int, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Part 2 in a fresh process: plans and wraps the small model for every M, then times them in turns.

    Every configuration runs ``steps`` training steps per round, the configurations taking turns for
    ``rounds`` rounds, so that a burst of other work on this shared machine slows all of them alike
    rather than one. The plain Keras model (same process and thread settings) takes its turn too.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    from runtime import make_virtual_devices

    devices = make_virtual_devices(2)
    import keras
    import numpy as np

    import partitioner as pt
    from profiles import profile_model
    from profiles.local import local_cluster, with_model_pool_capacities
    from runtime import wrap

    keras.utils.set_random_seed(0)
    model = build_transformer(**SMALL, lazy=False)
    rng = np.random.default_rng(0)
    data_x = rng.integers(0, SMALL["vocabulary"], (SMALL_BATCH, SMALL["sequence"])).astype("int32")
    data_y = rng.integers(0, SMALL["vocabulary"], (SMALL_BATCH, SMALL["sequence"])).astype("int32")
    cluster = local_cluster(2, memory="4GiB")

    runners: dict[int, Any] = {0: model}  # M = 0: the plain model
    rows: dict[int, dict[str, Any]] = {}
    for m in MEASURED_MICROBATCHES:
        graph = profile_model(
            model,
            batch_size=SMALL_BATCH,
            num_microbatches=m,
            measure_time=True,
            device=devices[0],
            repeats=repeats,
            warmup=1,
        )
        # the two devices share the cores as this model shares them at this micro-batch, as plan_and_wrap measures
        shared = with_model_pool_capacities(cluster, model, -(-SMALL_BATCH // m))
        plan = pt.solve(graph, shared, num_microbatches=m, cost="time", time_limit_s=10)
        sim = pt.simulate(plan, graph, shared)
        rows[m] = {
            "microbatches": m,
            "predicted_s": sim.step_time_s,
            "predicted_serial_s": plan.serial_step_s,
            "bubble_fraction": sim.bubble_fraction,
            "layers_per_stage": [len(plan.nodes_on(d)) for d in plan.stages],
        }
        runners[m] = wrap(model, plan, validate=False)
    for runner in runners.values():
        runner.compile(
            optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        for _ in range(warmup):
            runner.train_on_batch(data_x, data_y)
    times: dict[int, list[float]] = {m: [] for m in runners}
    for _ in range(rounds):
        for m, runner in runners.items():
            for _ in range(steps):
                started = time.perf_counter()
                runner.train_on_batch(data_x, data_y)
                times[m].append(time.perf_counter() - started)
    # The fastest step: other jobs share this machine's two cores, and a step they slow down says
    # nothing about the pipeline. The median is kept too.
    for m, row in rows.items():
        row.update(measured_s=min(times[m]), measured_median_s=statistics.median(times[m]), step_times_s=times[m])
    return {
        "plain": {"measured_s": min(times[0]), "measured_median_s": statistics.median(times[0])},
        "rows": [rows[m] for m in MEASURED_MICROBATCHES],
    }


def measure(rounds: int, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(rounds), str(steps), str(warmup), str(repeats)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the part-2 child process failed:\n{out.stderr[-3000:]}")
    found = json.loads(out.stdout.strip().splitlines()[-1])
    plain, rows = found["plain"], found["rows"]
    print(f"CPU, plain Keras on 1 device: {plain['measured_s'] * 1e3:.0f} ms per step", flush=True)
    first = rows[0]
    for r in rows:
        r["measured_normalised"] = first["measured_s"] / r["measured_s"]
        r["predicted_normalised"] = first["predicted_s"] / r["predicted_s"]
        r["normalised_error"] = r["predicted_normalised"] / r["measured_normalised"] - 1
        r["step_error"] = r["predicted_s"] / r["measured_s"] - 1
        print(
            f"CPU, 2 devices, M={r['microbatches']}: measured {r['measured_s'] * 1e3:.0f} ms, "
            f"predicted {r['predicted_s'] * 1e3:.0f} ms",
            flush=True,
        )
    return {
        "model": (
            f"Transformer-{SMALL['num_layers']} (model dim {SMALL['model_dim']}, feed-forward {SMALL['ff_dim']}, "
            f"{SMALL['num_heads']} heads, vocabulary {SMALL['vocabulary']}, sequence {SMALL['sequence']}), "
            f"batch {SMALL_BATCH}, synthetic tokens, SGD"
        ),
        "plain_one_device_s": plain["measured_s"],
        "predicted_serial_s": first["predicted_serial_s"],
        "load_average_1min": [load_before, os.getloadavg()[0]],  # before and after: other jobs share the cores
        "timed_steps": rounds * steps,
        "rounds": rounds,
        "warmup_steps": warmup,
        "rows": rows,
    }


# ----- report -------------------------------------------------------------------------------------


def table_part1(results: dict[str, Any]) -> list[str]:
    ms = MICROBATCHES
    lines = [
        "| model | K | "
        + " | ".join(f"M={m}" for m in ms)
        + " | paper M=1 | paper M=4 | paper M=32 | uniform split M=32 |",
        "|---|---|" + "---|" * len(ms) + "---|---|---|---|",
    ]
    for name, model in results["simulated"].items():
        for i, row in enumerate(model["rows"]):
            paper = [PAPER[name][m][i] for m in (1, 4, 32)]
            lines.append(
                f"| {name if i == 0 else ''} | {row['devices']} | "
                + " | ".join(f"{row['normalised'][str(m)]:.2f}" for m in ms)
                + " | "
                + " | ".join(f"{p:g}" for p in paper)
                + f" | {row['uniform_normalised']['32']:.2f} |"
            )
    return lines


def table_part2(measured: dict[str, Any]) -> list[str]:
    lines = [
        "| M | measured step (ms) | predicted step (ms) | step error | measured normalised | predicted normalised "
        "| normalised error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in measured["rows"]:
        lines.append(
            f"| {r['microbatches']} | {r['measured_s'] * 1e3:.0f} | {r['predicted_s'] * 1e3:.0f} "
            f"| {100 * r['step_error']:+.0f}% | {r['measured_normalised']:.2f} | {r['predicted_normalised']:.2f} "
            f"| {100 * r['normalised_error']:+.0f}% |"
        )
    return lines


def headline(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, model in results["simulated"].items():
        ours = " / ".join(f"{row['normalised']['32']:.2f}" for row in model["rows"])
        paper = " / ".join(f"{p:g}" for p in PAPER[name][32])
        lines.append(f"- {name}, M = 32, K = 2 / 4 / 8: simulated {ours}; paper ({model['paper_model']}) {paper}.")
    measured = results.get("measured")
    if measured:
        worst = max(measured["rows"], key=lambda r: abs(r["normalised_error"]))
        lines.append(
            f"- CPU, 2 logical devices, M = 1 to {MEASURED_MICROBATCHES[-1]}: measured normalised throughput "
            + " / ".join(f"{r['measured_normalised']:.2f}" for r in measured["rows"])
            + ", predicted "
            + " / ".join(f"{r['predicted_normalised']:.2f}" for r in measured["rows"])
            + f"; largest error {100 * worst['normalised_error']:+.0f}% (M = {worst['microbatches']})."
        )
    return lines


def write_readme(results: dict[str, Any]) -> None:
    sim = results["simulated"]
    lines = [
        f"Generated by `python benchmarks/gpipe_scaling/run.py{' --full' if results['mode'] == 'full' else ''}` "
        f"on {results['date']}. Machine: {results['machine']}.",
        "",
        *headline(results),
        "",
        f"Simulated normalised throughput (throughput / throughput of the planner's plan for K = 2, M = 1) on "
        f"{results['cluster']}, GPipe schedule; for each K the planner's split for M = 32, kept for every M; "
        "the paper's Table 2 beside it. "
        + "; ".join(
            f"{name}: {m['num_params'] / 1e9:.2f}B parameters, {m['tflop_per_step']:.0f} TFLOP per step, "
            f"global batch {m['global_batch']}, {m['num_layers_in_graph']} layer nodes"
            for name, m in sim.items()
        )
        + ".",
        "",
        *table_part1(results),
    ]
    measured = results.get("measured")
    if measured:
        lines += [
            "",
            f"Measured on this machine: {measured['model']}, 2 logical CPU devices (1 intra-op thread, 2 inter-op "
            f"threads), fastest of {measured['timed_steps']} steps ({measured['rounds']} rounds in which the "
            f"configurations take turns) after {measured['warmup_steps']} warm-up steps. "
            "Predicted: the simulator on the plan made from layer times measured at each micro-batch size. "
            "Normalised to M = 1. The plain Keras model in the same process: "
            f"{measured['plain_one_device_s'] * 1e3:.0f} ms per step (predicted from the layer times: "
            f"{measured['predicted_serial_s'] * 1e3:.0f} ms). One-minute load average before and after: "
            + " and ".join(f"{x:.1f}" for x in measured["load_average_1min"])
            + f" on {os.cpu_count()} cores.",
            "",
            *table_part2(measured),
        ]
    lines += ["", "![simulated timeline](timeline.png)"]
    write_block(HERE / "README.md", "results", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short solves, few timed steps (the default)")
    mode.add_argument("--full", action="store_true", help="longer solves, more timed steps")
    parser.add_argument("--reprofile", action="store_true", help="profile the part-1 models again")
    parser.add_argument("--no-measure", action="store_true", help="skip part 2 (the CPU measurement)")
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    full = args.full
    time_limit_s, rounds, steps, warmup, repeats = (60.0, 10, 2, 3, 7) if full else (15.0, 5, 2, 2, 5)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "mode": "full" if full else "quick",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "cluster": CLUSTER,
        "paper": "Huang et al., GPipe, arXiv:1811.06965v5, Table 2 (normalised training throughput on TPUs)",
        "paper_table2": {name: {str(m): list(v) for m, v in cells.items()} for name, cells in PAPER.items()},
        "simulated": {},
    }
    for name in MODELS:
        graph = load_part1(name, args.reprofile)
        results["simulated"][name] = simulate_model(name, graph, time_limit_s)
    if not args.no_measure:
        results["measured"] = measure(rounds, steps, warmup, repeats)
    results["wall_time_s"] = time.perf_counter() - started
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    write_readme(results)
    print("\n".join(headline(results)))
    print(f"wrote results.json, README.md and timeline.png in {HERE} ({results['wall_time_s']:.0f} s)")


if __name__ == "__main__":
    main()
