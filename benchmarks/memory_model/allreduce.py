"""What a stage's R action holds: its gradient sums all-reduced over D = 2 replicas, measured on 2 logical CPU devices.

Each replica's stage holds G bytes of gradient sums (four float32 tensors of 16 MiB: G = 64 MiB), computed in
the step, on its own logical device; the step then either sums them over the two replicas with the runtime's own
collective (``runtime.replicas.StageCollectives.sum``: the sums packed into one flat tensor, one
``CollectiveReduceV2``, the result split back) or uses them as they are, and applies them to variables of their
shapes. TensorFlow's CPU allocator keeps statistics with ``TF_CPU_ALLOCATOR_USE_BFC=true``; the two logical
devices share it, so the step's peak above the resting memory (the variables), halved, is one replica's. Each
variant runs three times after a warm-up step. The cost model's ``REDUCING_COPIES`` (partitioner/cost.py) reads
this: with D > 1 a stage holds two gradient copies, the sums and the packed one.

Writes allreduce.json beside this script and the table between the allreduce markers of README.md:

    .venv/bin/python benchmarks/memory_model/allreduce.py      # seconds
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root
from benchmarks.readme import write_block  # noqa: E402

MIB = 2**20
GRADIENTS = 4  # tensors per stage
GRADIENT_MIB = 16  # each
ROUNDS = 3


def measure() -> dict[str, Any]:
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # the allocator's statistics
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    from runtime.replicas import StageCollectives

    collectives = [StageCollectives(0, d, len(devices)) for d in devices]
    weights = []
    for device in devices:
        with tf.device(device):
            weights.append([tf.Variable(tf.zeros([GRADIENT_MIB * MIB // 4])) for _ in range(GRADIENTS)])

    def step_of(reduce: bool) -> Any:
        @tf.function
        def step() -> list[Any]:
            totals = []
            for replica, device in enumerate(devices):
                with tf.device(device):
                    sums = [w * 2.0 + 1.0 for w in weights[replica]]  # the step's gradient sums, made here
                    summed = collectives[replica].sum(sums) if reduce else sums
                    for w, g in zip(weights[replica], summed, strict=True):
                        w.assign_add(g * 0.0)  # applied, as the optimizer applies them
                    totals.append(tf.add_n([tf.reduce_sum(g) for g in summed]))
            return totals

        return step

    rows: dict[str, list[float]] = {"without the all-reduce": [], "all-reduced (R)": []}
    for label, reduce in (("without the all-reduce", False), ("all-reduced (R)", True)):
        step = step_of(reduce)
        step()  # traced and warmed up
        for _ in range(ROUNDS):
            tf.config.experimental.reset_memory_stats("CPU:0")
            resting = tf.config.experimental.get_memory_info("CPU:0")["current"]
            step()
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            rows[label].append((peak - resting) / len(devices) / MIB)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "tensorflow": tf.__version__,
        "replicas": len(devices),
        "gradient_mib": GRADIENTS * GRADIENT_MIB,
        "peak_above_resting_mib_per_replica": rows,
    }


def table(results: dict[str, Any]) -> str:
    g = results["gradient_mib"]
    lines = [
        f"{results['replicas']} replicas on logical CPU devices of one process, G = {g} MiB of gradient sums per "
        f"replica's stage; TensorFlow {results['tensorflow']}; {results['machine']}; run of {results['date']}.",
        "",
        "| step | peak above resting per replica (MiB), each run | median / G |",
        "|---|---|---|",
    ]
    for label, runs in results["peak_above_resting_mib_per_replica"].items():
        lines.append(f"| {label} | {', '.join(f'{r:.0f}' for r in runs)} | {statistics.median(runs) / g:.2f} |")
    return "\n".join(lines)


def main() -> None:
    results = measure()
    (HERE / "allreduce.json").write_text(json.dumps(results, indent=1) + "\n")
    write_block(HERE / "README.md", "allreduce", table(results))
    print(table(results))


if __name__ == "__main__":
    main()
