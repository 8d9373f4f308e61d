"""What a stage holds while it sums its weight gradients over the micro-batches, measured on logical CPU devices.

An MLP whose weights dominate its activations (8 Dense(1024) + Dense(10): 32.1 MiB of float32 weights, batch 256,
SGD) is wrapped by the runtime on one stage and on two (GPipe, the first half of its layers on each), at M = 1, 4
and 8, and one training step is measured per device: what the step's own allocations held there at once beyond
what was held when it started (``runtime.step_memory``, TensorFlow's allocation records read back to the devices
that made them; ``TF_CPU_ALLOCATOR_USE_BFC=true``). Beside it, the simulated peak of the same plan
(``partitioner.simulate``) less the device's weights and the split batch (``ModeCost.step_bytes``), which are
held before the step starts. With M > 1 the loop adds each micro-batch's weight gradients into the stage's sums,
the adds inlined into the loop so that they write into the sums' buffer: the cost model counts two copies of the
gradients there (the sums and the micro-batch's gradients: ``ACCUMULATING_COPIES`` in partitioner/cost.py), which
this measures (with the add a function the loop called, until stop 35, one stage held three).

Writes gradient_sums.json beside this script and the table between the gradient_sums markers of README.md:

    .venv/bin/python benchmarks/memory_model/gradient_sums.py      # about a minute
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root
from benchmarks.readme import write_block  # noqa: E402

MIB = 2**20
WIDTH, DEPTH, BATCH = 1024, 8, 256
MICROBATCHES = (1, 4, 8)


def measure() -> dict[str, Any]:
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # the allocator's statistics
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    from runtime import executed

    executed.enable_collection()  # step_memory reads where each node ran
    import keras
    import numpy as np

    import partitioner as pt
    from partitioner.graph import topological_order
    from profiles import profile_model
    from runtime import make_virtual_devices, wrap
    from runtime.memory import step_memory

    make_virtual_devices(2)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    x = inputs
    for _ in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(BATCH, WIDTH)).astype("float32"), np.zeros(BATCH, "int64")
    cluster = pt.Cluster.uniform(2, memory="8GiB", prefix="/device:CPU:")
    rows = []
    for m in MICROBATCHES:
        graph = profile_model(model, batch_size=BATCH, num_microbatches=m, measure_time=False)
        order = topological_order(graph)
        splits = {
            "1 stage": {v: cluster.names[0] for v in order},
            "2 stages": {v: cluster.names[0 if i < len(order) // 2 else 1] for i, v in enumerate(order)},
        }
        for label, assignment in splits.items():
            costs = pt.CostModel(graph, cluster, num_microbatches=m, optimizer_slots=0)
            plan = pt.score_assignment(assignment, costs, method=label)
            simulation = pt.simulate(plan, graph, cluster)
            wrapped = wrap(model, plan, validate=False)
            wrapped.compile(
                optimizer=keras.optimizers.SGD(0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            wrapped.train_on_batch(images, labels)
            memory = step_memory(wrapped, images, labels)
            stage_costs = costs.evaluate(assignment).stage_costs
            for s, device in enumerate(simulation.stages):
                weights = sum(int(graph.nodes[v]["param_bytes"]) for v in order if assignment[v] == device)
                simulated = simulation.peak_memory_bytes[device] - weights - stage_costs[s].step_bytes
                rows.append(
                    {
                        "num_microbatches": m,
                        "plan": label,
                        "stage": s,
                        "weight_bytes": weights,
                        "measured_bytes": memory.device_peak_bytes.get(device, 0),  # step_memory's names
                        "simulated_bytes": simulated,
                    }
                )
                print(
                    f"M = {m}, {label}, stage {s}: measured {rows[-1]['measured_bytes'] / MIB:.1f} MiB, "
                    f"simulated {simulated / MIB:.1f} MiB (weights {weights / MIB:.1f})",
                    flush=True,
                )
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "model": f"MLP {DEPTH} x Dense({WIDTH}) + Dense(10), batch {BATCH}, SGD",
        "rows": rows,
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{results['model']}; 2 logical CPU devices; {results['machine']}; run of {results['date']}.",
        "",
        "| M | plan | stage | weights (MiB) | measured: the step's allocations there at once (MiB) "
        "| simulated, less weights and batch (MiB) | measured / simulated |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        ratio = row["measured_bytes"] / row["simulated_bytes"] if row["simulated_bytes"] else float("nan")
        lines.append(
            f"| {row['num_microbatches']} | {row['plan']} | {row['stage']} | {row['weight_bytes'] / MIB:.1f} "
            f"| {row['measured_bytes'] / MIB:.1f} | {row['simulated_bytes'] / MIB:.1f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def write_readme(results: dict[str, Any]) -> None:
    """Replaces the table between the gradient_sums markers of README.md."""
    write_block(HERE / "README.md", "gradient_sums", table(results))


def main() -> None:
    results = measure()
    (HERE / "gradient_sums.json").write_text(json.dumps(results, indent=2) + "\n")
    write_readme(results)
    print(table(results))


if __name__ == "__main__":
    main()
