"""Calibration benchmark: which M ``num_microbatches="auto"`` picks on local devices, before and after calibration.

On 2 logical CPU devices of this machine (1 intra-op thread, 2 inter-op threads: the two devices may run at
once), for an MLP of DEPTH Dense(WIDTH, relu) layers and a Dense(10) head at batch BATCH, SGD:

1. the M ``plan_and_wrap(model, ..., batch_size=BATCH, num_microbatches="auto")`` picks, and its predicted step,
   three ways: "before", the local cluster as it was before calibration (``devices=local_cluster(2,
   calibrate=False)``: FLOP/s measured, no fixed cost per pass, the 50 GB/s constant for the link, costs from
   FLOPs); "flops", the calibrated cluster passed as a Cluster (the fixed cost of a pass and the link measured,
   ``profiles.calibrate``; costs still from FLOPs); "timed", ``devices=2`` as a user writes it: the calibrated
   cluster, and the layers timed on the first device at the whole batch, at one sample and at the micro-batch
   sizes auto weighs, with the summing of each micro-batch's weight gradients
   (``profile_model(measure_fixed_time=True, time_samples=timed_sizes(BATCH))``), planned by those times;
   auto takes the fewest micro-batches within 5% of the shortest simulated step (``choose``'s margin).
2. for M = 1, 2, 4, 8, 16 and each picked M: the timed plan at that M (``solve`` on the timed graph rescaled to
   M, ``cost="time"``, the calibrated cluster), its stage count, its predicted step (``Plan.predicted_step_s``: the
   simulated step and the step's own work the profile measured, ``step_overhead_s``), and the measured steady step
   of the model wrapped with it (median of ROUNDS rounds of STEPS ``train_on_batch`` calls on one batch, after
   WARMUP untimed ones; the M's take turns round by round since 2026-11-28, where each was timed in turn before).

Writes results.json and the table in README.md (between the ``results:start`` / ``results:end`` markers).

    .venv/bin/python benchmarks/calibration/run.py            # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/calibration/run.py --readme   # README table again from results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from benchmarks.readme import write_block  # noqa: E402

WIDTH, DEPTH, BATCH = 256, 8, 64
MICROBATCHES = (1, 2, 4, 8, 16)
WARMUP, ROUNDS, STEPS = 3, 7, 5


def start_tensorflow(num_devices: int) -> list[str]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(num_devices)
    from runtime import make_virtual_devices

    return make_virtual_devices(num_devices)


def mlp() -> Any:
    import keras

    inputs = keras.Input((WIDTH,))
    x = inputs
    for i in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(x), name="mlp")


def steady_steps_s(wrapped: list[Any], x: Any, y: Any) -> list[float]:
    """Per wrapped model, the median seconds of one train_on_batch over ROUNDS rounds of STEPS, after WARMUP
    untimed steps; the models take turns round by round, so a slow spell of the machine falls on all of them."""
    import keras

    for model in wrapped:
        model.compile(
            optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        for _ in range(WARMUP):
            model.train_on_batch(x, y)
    rounds: list[list[float]] = [[] for _ in wrapped]
    for _ in range(ROUNDS):
        for model, seconds in zip(wrapped, rounds, strict=True):
            start = time.perf_counter()
            for _ in range(STEPS):
                model.train_on_batch(x, y)
            seconds.append((time.perf_counter() - start) / STEPS)
    return [statistics.median(seconds) for seconds in rounds]


def measure() -> dict[str, Any]:
    start_tensorflow(2)
    import numpy as np

    from partitioner import rescale_graph, solve
    from partitioner.search.choose import timed_sizes
    from profiles import profile_model
    from profiles.local import local_cluster, local_cluster_and_sources, with_model_pool_capacities
    from runtime import plan_and_wrap, wrap

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH, WIDTH)).astype("float32"), rng.integers(0, 10, BATCH)
    model = mlp()
    before = local_cluster(2, calibrate=False)
    after, sources = local_cluster_and_sources(2)
    picked = {}
    for label, devices in (("before", before), ("flops", after), ("timed", 2)):
        plan = plan_and_wrap(model, devices=devices, batch_size=BATCH, num_microbatches="auto").plan
        picked[label] = {"num_microbatches": plan.num_microbatches, "predicted_step_s": plan.predicted_step_s}
        print(f"{label}: auto picks M = {plan.num_microbatches} ({plan.num_stages} stages)", flush=True)
    timed = profile_model(  # as plan_and_wrap(devices=2, num_microbatches="auto") profiles
        model,
        batch_size=BATCH,
        num_microbatches=1,
        device=after.devices[0].name,
        measure_fixed_time=True,
        time_samples=timed_sizes(BATCH),
    )
    sizes = timed_sizes(BATCH)  # and the pool's capacity with the model's own passes, as plan_and_wrap measures it
    shared = with_model_pool_capacities(after, model, sizes[len(sizes) // 2])
    counts = sorted({*MICROBATCHES, *(p["num_microbatches"] for p in picked.values())})
    wrapped = [
        wrap(model, solve(rescale_graph(timed, BATCH, m), shared, num_microbatches=m, cost="time")) for m in counts
    ]
    original_step, *steps = steady_steps_s([model, *wrapped], x, y)  # the original takes its turn too
    rows = []
    for m, pipelined, step in zip(counts, wrapped, steps, strict=True):
        rows.append(
            {
                "num_microbatches": m,
                "num_stages": pipelined.plan.num_stages,
                "predicted_step_s": pipelined.plan.predicted_step_s,  # the simulated step + the step's own work
                "step_overhead_s": pipelined.plan.step_overhead_s,
                "measured_step_s": step,
            }
        )
        print(
            f"M = {m}: {pipelined.plan.num_stages} stages, predicted {pipelined.plan.predicted_step_s * 1e3:.2f} ms, "
            f"measured {step * 1e3:.2f} ms",
            flush=True,
        )
    device = after.devices[0]
    whole = dict((samples, seconds) for samples, seconds, _ in timed.graph["model_time_by_samples"])[BATCH]
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "model": f"MLP {DEPTH} x Dense({WIDTH}) + Dense(10), batch {BATCH}, SGD",
        "calibrated": {
            "flops_per_s": device.flops_per_s,
            "action_overhead_s": device.action_overhead_s,
            "bandwidth_bytes_per_s": after.bandwidth(0, 1),
            "pool_capacity": device.pool_capacity if device.pool is not None else None,
            "model_pool_capacity": shared.devices[0].pool_capacity if device.pool is not None else None,
            "source": sources,
        },
        "picked": picked,
        # [[samples, the model's forward + backward (s), its layers' sum before scaling (s)], ...] of the timed profile
        "model_time_by_samples": timed.graph.get("model_time_by_samples"),
        "rows": rows,
        # the original model's step: the profile's forward + backward at the batch and the step's own work
        # (what the profile measured), against its steps timed among the wrapped models' rounds
        "original": {"predicted_step_s": whole + timed.graph["step_overhead_s"], "measured_step_s": original_step},
    }


def table(results: dict[str, Any]) -> str:
    cal = results["calibrated"]
    best = min(r["measured_step_s"] for r in results["rows"])
    original = results.get("original")
    # how much slower the machine ran the steps than the profile timed it: the original model's step measured
    # among the rounds against its step predicted from the profile (1 where a run did not record it)
    speed = original["measured_step_s"] / original["predicted_step_s"] if original else 1.0
    lines = [
        f"{results['model']}; 2 logical CPU devices; {results['machine']}; run of {results['date']}.",
        f"Calibrated: {cal['flops_per_s'] / 1e9:.1f} GFLOP/s, action_overhead_s "
        f"{cal['action_overhead_s'] * 1e6:.1f} µs, link {cal['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s"
        + (
            f", the two devices' pool {cal['pool_capacity']:.2f} devices' worth at once (a matmul chain), "
            f"{cal['model_pool_capacity']:.2f} with the model's own passes (what the timed rows plan with)."
            if cal.get("pool_capacity") and cal.get("model_pool_capacity")
            else " (no pool: each device priced as if it had the cores alone)."
        ),
    ]
    if original:
        lines.append(
            f"The original model (plain Keras, one device) measured {original['measured_step_s'] * 1e3:.2f} ms a step "
            f"among the rounds against {original['predicted_step_s'] * 1e3:.2f} ms predicted from the profile (its "
            f"forward and backward at the batch and the step's own work): the steps ran at {speed:.2f}x the "
            "profile's times, the last column's factor."
        )
    lines += [
        "",
        "| M | stages | picked by auto | predicted step (ms) | of which the step's own work (ms) | measured step (ms) "
        "| measured / predicted - 1 | measured / (predicted x the original's factor) - 1 | vs best measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        m = r["num_microbatches"]
        who = ", ".join(label for label, p in results["picked"].items() if p["num_microbatches"] == m)
        error = r["measured_step_s"] / r["predicted_step_s"] - 1
        lines.append(
            f"| {m} | {r['num_stages']} | {who or ''} | {r['predicted_step_s'] * 1e3:.2f} | "
            f"{r.get('step_overhead_s', 0.0) * 1e3:.2f} | {r['measured_step_s'] * 1e3:.2f} | {error:+.0%} | "
            f"{(error + 1) / speed - 1:+.0%} | {r['measured_step_s'] / best:.2f}x |"
        )
    return "\n".join(lines)


def write_readme(results: dict[str, Any]) -> None:
    write_block(HERE / "README.md", "results", table(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="rewrite the README table from results.json")
    args = parser.parse_args()
    if args.readme:
        results = json.loads((HERE / "results.json").read_text())
    else:
        results = measure()
        (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    write_readme(results)


if __name__ == "__main__":
    main()
