"""Runtime benchmark: overhead, overlap, trace cost, hand placement and peak memory of the pipeline runtime.

On logical CPU devices of this machine (``runtime.make_virtual_devices``; the machine of the committed
results has 2 cores and no GPU), with one intra-op thread (each op uses one core) and SYNTHETIC data
(random features, labels and tokens), it measures:

1. overhead: the PipelinedModel on 1 device with M = 1 against the plain Keras model, for the MLP
   and the transformer below. Both models (same weights) live in ONE process and take turns, round
   after round (a few training steps each, the order rotating); the ratio is median(wrapped round) /
   median(plain round), the spread the quartiles of the per-round ratios.
2. overlap: the pipelined step for M = 1, 2, 4, 8 on 2 (and, in the full run, 4) devices, with
   TensorFlow allowed to run as many ops at once as there are devices (inter-op threads = K),
   against the serial execution of the same plan (inter-op threads = 1: nothing overlaps), beside
   the fill-drain bound from FLOPs and the simulator on layer times measured in that configuration.
3. trace cost: a 4-block GPT-style transformer on 2 devices (uniform plan), batch 32, M = 1, 4, 16,
   GPipe and 1F1B: the first ``train_on_batch`` after compile (tracing + first run) and the median
   steady step on the same batch, each configuration in a fresh process (no trace cache survives),
   repeated with the configurations alternating; the plain Keras model on one device for reference.
4. hand placement: the MLP hand-placed on 2 devices the usual way (a functional model built with
   ``with tf.device(...)`` around its halves, trained with Keras' own step, ``train_on_batch``, the
   step ``fit`` runs, no micro-batches) against the PipelinedModel with the same split for
   M = 1, 2, 4, 8, and the model as ``plan_and_wrap(..., num_microbatches="auto")`` wraps it on the 2
   devices (the M, split and schedule the planner chooses from the layers timed there), in one process, in
   turns; 1 intra-op and 2 inter-op threads. Speedup = hand-placed step / pipelined step. Also counts the
   devices of the hand-placed step's matmuls.
5. peak memory: three models whose activations dominate (an MLP of narrow layers at a large batch, the
   CNN with batch normalization, a GPT-style decoder with a 4096-token vocabulary head) on 2 devices,
   M = 4 and 16: GPipe, 1F1B and either with recomputation, and the plain model on one device; each
   configuration in its own processes, measured with TensorFlow's allocator statistics
   (``tf.config.experimental.get_memory_info``: the logical CPU devices share one allocator, so it is the
   sum over devices), against the prediction: the most the simulated devices hold together at one moment
   (``Simulation.peak_total_bytes``, recomputation priced) plus the weights of the model the
   PipelinedModel wraps and keeps; and recomputation's saving, measured against predicted.
6. placement: the transformer on 2 devices, M = 4, for GPipe, 1F1B, GPipe with recomputation and 1F1B
   with XLA per stage: one training step, and per stage the share of its forward, backward and
   optimizer-update ops that ran on the planned device, read from the graphs TensorFlow executed
   (``runtime.executed_placement``).

TensorFlow's thread counts are fixed when it initialises, so every configuration runs in a child
process of this script. A background thread notes whether a pytest run shared the machine. Writes
results.json (seconds and bytes) and the tables in README.md (between the ``results:start`` /
``results:end`` markers); README.md says what each number includes.

    .venv/bin/python benchmarks/runtime/run.py            # full run (about 25 minutes on 2 idle cores)
    .venv/bin/python benchmarks/runtime/run.py --quick    # what `make bench` runs (about 9 minutes)
    .venv/bin/python benchmarks/runtime/run.py --only trace,memory   # some sections; prints, writes nothing
    .venv/bin/python benchmarks/runtime/run.py --readme   # README tables again from results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.readme
from benchmarks.readme import write_block  # noqa: E402

SECTIONS = ("overhead", "overlap", "trace", "handplaced", "memory", "placement")

# The balanced MLP (overhead, overlap, hand placement).
WIDTH, DEPTH, BATCH = 1024, 8, 256
STEPS, WARMUP = 12, 3  # overlap: timed and warm-up steps per child

# The GPT-style transformer (overhead, trace cost).
VOCABULARY, SEQUENCE, MODEL_DIM, NUM_HEADS, NUM_BLOCKS, TRANSFORMER_BATCH = 128, 32, 64, 4, 4, 32
TRACE_MICROBATCHES = (1, 4, 16)
TRACE_SCHEDULES = ("gpipe", "1f1b")

# The CNN with batch normalization (overhead): 3 blocks of Conv2D, BatchNormalization, ReLU, max pooling.
CNN_SIZE, CNN_FILTERS, CNN_BATCH = 32, (16, 32, 64), 64

# Peak memory: three models whose activations dominate their weights, SGD (no optimizer slots).
MEMORY_WIDTH, MEMORY_DEPTH, MEMORY_BATCH = 256, 8, 8192  # the MLP: wide batch, narrow layers
MEMORY_CNN_BATCH = 256  # the CNN above
MEMORY_VOCABULARY, MEMORY_SEQUENCE, MEMORY_TRANSFORMER_BATCH = 4096, 64, 64  # the decoder: the logits dominate
MEMORY_MODELS = ("mlp", "cnn", "transformer")
MEMORY_MICROBATCHES = (4, 16)
MEMORY_SCHEDULES = ("gpipe", "1f1b", "gpipe+recompute", "1f1b+recompute")

HANDPLACED_MICROBATCHES = (1, 2, 4, 8)

# Executed placement (transformer, 2 devices).
PLACEMENT_MICROBATCHES = 4
PLACEMENT_CONFIGS = ("gpipe", "1f1b", "gpipe+recompute", "1f1b+xla")


# ----- models and data ----------------------------------------------------------------------------


def mlp(width: int, depth: int, devices: Sequence[str] | None = None) -> Any:
    """``depth`` Dense(width, relu) layers and a Dense(10) head on inputs of ``width`` features.

    With two ``devices`` the model is hand-placed the usual way: the first half of the layers is
    built under ``with tf.device(devices[0])``, the rest under ``devices[1]``.
    """
    import contextlib

    import keras
    import tensorflow as tf

    def scope(i: int) -> Any:
        if devices is None:
            return contextlib.nullcontext()
        return tf.device(devices[0] if i < (depth + 1) // 2 else devices[1])

    inputs = keras.Input((width,))
    x = inputs
    for i in range(depth):
        with scope(i):
            x = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(x)
    with scope(depth):
        outputs = keras.layers.Dense(10, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def mlp_data(width: int, batch: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(batch, width)).astype("float32"), rng.integers(0, 10, batch)


def cnn() -> Any:
    """Conv2D (no bias) -> BatchNormalization -> ReLU -> MaxPooling2D per entry of CNN_FILTERS, global average
    pooling, a Dense(10) head, on CNN_SIZE x CNN_SIZE x 3 images."""
    import keras

    inputs = keras.Input((CNN_SIZE, CNN_SIZE, 3))
    x = inputs
    for filters in CNN_FILTERS:
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.MaxPooling2D()(keras.layers.ReLU()(keras.layers.BatchNormalization()(x)))
    return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x)), name="cnn")


def cnn_data(batch: int = CNN_BATCH) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(batch, CNN_SIZE, CNN_SIZE, 3)).astype("float32"), rng.integers(0, 10, batch)


def transformer(vocabulary: int = VOCABULARY, sequence: int = SEQUENCE) -> Any:
    """A GPT-style decoder from keras.layers: token + position embeddings, NUM_BLOCKS pre-LayerNorm
    blocks (causal multi-head attention, GELU MLP of 4 x width, residual adds), LayerNorm, LM head."""
    import keras

    @keras.saving.register_keras_serializable(package="benchmarks")
    class PositionEmbedding(keras.layers.Layer):  # type: ignore[misc]  # keras ships no type hints
        """Adds a learned embedding of each position to [batch, sequence, width] inputs."""

        def __init__(self, sequence_length: int, width: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.sequence_length, self.width = sequence_length, width

        def build(self, input_shape: Any) -> None:
            self.positions = self.add_weight(shape=(self.sequence_length, self.width), initializer="uniform")

        def call(self, x: Any) -> Any:
            return x + self.positions

        def get_config(self) -> dict[str, Any]:
            return {**super().get_config(), "sequence_length": self.sequence_length, "width": self.width}

    tokens = keras.Input((sequence,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocabulary, MODEL_DIM, name="embedding")(tokens)
    x = PositionEmbedding(sequence, MODEL_DIM, name="positions")(x)
    for i in range(NUM_BLOCKS):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"norm_attention_{i}")(x)
        h = keras.layers.MultiHeadAttention(NUM_HEADS, MODEL_DIM // NUM_HEADS, name=f"attention_{i}")(
            h, h, use_causal_mask=True
        )
        x = keras.layers.Add(name=f"add_attention_{i}")([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"norm_mlp_{i}")(x)
        h = keras.layers.Dense(4 * MODEL_DIM, activation="gelu", name=f"mlp_in_{i}")(h)
        h = keras.layers.Dense(MODEL_DIM, name=f"mlp_out_{i}")(h)
        x = keras.layers.Add(name=f"add_mlp_{i}")([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    return keras.Model(tokens, keras.layers.Dense(vocabulary, name="lm_head")(x), name="gpt")


def transformer_data(
    vocabulary: int = VOCABULARY, sequence: int = SEQUENCE, batch: int = TRANSFORMER_BATCH
) -> tuple[Any, Any]:
    """Random tokens; the targets are the inputs shifted by one."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, vocabulary, (batch, sequence + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def start_tensorflow(num_devices: int, inter_op: int, collect: bool = False) -> list[str]:
    """Fixes the thread counts (1 intra-op thread) and makes the logical CPU devices; returns their names.
    ``collect`` switches on TensorFlow's graph dumps first (``runtime.executed``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if collect:
        from runtime import executed

        executed.enable_collection()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    from runtime import make_virtual_devices

    return make_virtual_devices(num_devices)


def compile_for(runner: Any, model_name: str) -> None:
    """SGD for the MLPs (as in the overlap section), Adam for the transformer; cross-entropy on logits."""
    import keras

    optimizer = keras.optimizers.Adam(1e-3) if model_name == "transformer" else keras.optimizers.SGD(0.01)
    runner.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def uniform_plan(model: Any, devices: Sequence[str], batch: int, num_microbatches: int, **options: Any) -> Any:
    """The uniform baseline plan (equal layer counts per stage), and the layer graph and cluster it used."""
    import partitioner as pt
    from profiles import profile_model

    graph = profile_model(model, batch_size=batch, num_microbatches=num_microbatches, measure_time=False)
    cluster = pt.Cluster([pt.Device(d, memory="4GiB") for d in devices])
    return pt.baselines.uniform(graph, cluster, num_microbatches=num_microbatches, **options), graph, cluster


def take_turns(runners: dict[str, Any], data: tuple[Any, Any], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per configuration, the mean step time of each round; the configurations take turns every round,
    in an order that rotates, so a burst of other work on the machine slows all of them alike."""
    names = list(runners)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            for _ in range(steps):
                runners[name].train_on_batch(*data)
            per_round[name].append((time.perf_counter() - started) / steps)
    return per_round


def ratio_stats(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """median(numerator) / median(denominator), and the quartiles of the per-round ratios."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"ratio": statistics.median(numerator) / statistics.median(denominator), "q1": q1, "q3": q3}


# ----- children: one configuration (or one set of turn-taking configurations) per process ----------


def child_overlap(mode: str, num_devices: int, num_microbatches: int, inter_op: int, graph_file: str) -> dict[str, Any]:
    """Section 2: the median step of one configuration, and the two predictions."""
    devices = start_tensorflow(max(num_devices, 1), inter_op)
    import keras

    import partitioner as pt
    from profiles import profile_model
    from profiles.calibrate import measure_model_pool_capacity
    from profiles.local import measure_flops_per_s
    from runtime import wrap

    keras.utils.set_random_seed(0)
    model = mlp(WIDTH, DEPTH)
    data = mlp_data(WIDTH, BATCH)
    predicted = simulated = None
    if mode == "plain":
        runner = model
    else:
        # Layer times measured at the micro-batch size on the first device, in this very configuration (the
        # same thread settings), as a user would profile before training, with the fixed part of a pass and
        # the gradient sums of M > 1 (measure_fixed_time, as plan_and_wrap's timed path); saved for the record.
        graph = profile_model(
            model, batch_size=BATCH, num_microbatches=num_microbatches, device=devices[0], measure_fixed_time=True
        )
        pt.save_graph(graph, graph_file)
        flops = measure_flops_per_s(devices[0])
        # the devices share this machine's cores: their pool's capacity measured in this very configuration with the
        # model's own forward and backward at the micro-batch size, as plan_and_wrap measures it (with one
        # inter-op thread nothing runs at once: about 1)
        shared: dict[str, Any] = {}
        if num_devices > 1:
            samples = -(-BATCH // num_microbatches)
            capacity = measure_model_pool_capacity(model, devices[:num_devices], samples)
            shared = {"pool": "host CPU", "pool_capacity": capacity}
        cluster = pt.Cluster([pt.Device(d, memory="4GiB", flops_per_s=flops, **shared) for d in devices[:num_devices]])
        plan = pt.baselines.by_time(graph, cluster, num_microbatches=num_microbatches, cost="time")
        simulated = plan.step_time_s  # the GPipe schedule simulated with the measured layer times
        by_flops = pt.CostModel(graph, cluster, num_microbatches=num_microbatches)  # the same split, from FLOPs
        predicted = pt.score_assignment(plan.assignment, by_flops, method="by_time").fill_drain_step_s
        runner = wrap(model, plan, validate=False)
    compile_for(runner, "mlp")
    times = []
    for step in range(WARMUP + STEPS):
        started = time.perf_counter()
        runner.train_on_batch(*data)
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    return {"measured_s": statistics.median(times), "predicted_s": predicted, "simulated_s": simulated}


def child_overhead(model_name: str, rounds: int, steps: int) -> dict[str, Any]:
    """Section 1: plain Keras and the model wrapped on one device (M = 1), same weights, in turns."""
    devices = start_tensorflow(1, 1, collect=True)
    import keras

    from runtime import executed, wrap

    keras.utils.set_random_seed(0)
    if model_name == "mlp":
        model, data, batch = mlp(WIDTH, DEPTH), mlp_data(WIDTH, BATCH), BATCH
    elif model_name == "cnn":
        model, data, batch = cnn(), cnn_data(), CNN_BATCH
    else:
        model, data, batch = transformer(), transformer_data(), TRANSFORMER_BATCH
    plan, _, _ = uniform_plan(model, devices, batch, 1)
    wrapped = wrap(model, plan, validate=False)  # clones the layers with the model's current weights
    runners = {"plain": model, "wrapped": wrapped}
    kernels = {}
    for name, runner in runners.items():
        compile_for(runner, model_name)
        _, nodes = executed.collect_executed(runner.train_on_batch, *data)  # the first step, as it ran
        kernels[name] = sum(
            1 for n in nodes if "initialize_variables" not in n.graph and n.op not in ("_Arg", "_Retval")
        )
        for _ in range(2):
            runner.train_on_batch(*data)
    per_round = take_turns(runners, data, rounds, steps)
    return {
        "plain_kernels": kernels["plain"],
        "wrapped_kernels": kernels["wrapped"],
        "plain_s": statistics.median(per_round["plain"]),
        "wrapped_s": statistics.median(per_round["wrapped"]),
        **ratio_stats(per_round["wrapped"], per_round["plain"]),
        "rounds": rounds,
        "steps_per_round": steps,
    }


def child_trace(schedule: str, num_microbatches: int, steady_steps: int) -> dict[str, Any]:
    """Section 3: the first training step (trace + run) and the median steady step of one configuration.

    ``schedule="plain"`` times the plain Keras model on one device instead (the reference).
    """
    devices = start_tensorflow(2, 2)
    import keras

    from runtime import wrap

    keras.utils.set_random_seed(0)
    model = transformer()
    data = transformer_data()
    wrap_s = None
    if schedule == "plain":
        runner = model
    else:
        plan, _, _ = uniform_plan(model, devices, TRANSFORMER_BATCH, num_microbatches, schedule=schedule)
        started = time.perf_counter()
        runner = wrap(model, plan, schedule=schedule, validate=False)
        wrap_s = time.perf_counter() - started
    compile_for(runner, "transformer")
    started = time.perf_counter()
    runner.train_on_batch(*data)
    first_s = time.perf_counter() - started
    for _ in range(2):
        runner.train_on_batch(*data)
    times = []
    for _ in range(steady_steps):
        started = time.perf_counter()
        runner.train_on_batch(*data)
        times.append(time.perf_counter() - started)
    return {"first_s": first_s, "steady_s": statistics.median(times), "wrap_s": wrap_s}


def matmuls_per_device(runner: Any, data: tuple[Any, Any]) -> dict[str, int]:
    """Runs the first training step of a compiled Keras model and counts the matmul kernels TensorFlow
    placed on each device (forward and backward), from the step function's partition graphs."""
    from collections import Counter

    from profiles.internals import eager_context  # run metadata: the graphs of functions placed meanwhile

    ctx = eager_context()
    ctx.enable_run_metadata()
    try:
        runner.train_on_batch(*data)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return dict(
        Counter(
            node.device.split("device:")[-1]
            for graph in metadata.function_graphs
            for partition in graph.partition_graphs
            for node in partition.node
            if "MatMul" in node.op
        )
    )


def child_handplaced(rounds: int, steps: int) -> dict[str, Any]:
    """Section 4: plain Keras, the hand-placed model and the PipelinedModel for each M, in turns."""
    devices = start_tensorflow(2, 2)
    import keras

    from runtime import plan_and_wrap, wrap

    keras.utils.set_random_seed(0)
    model = mlp(WIDTH, DEPTH)
    data = mlp_data(WIDTH, BATCH)
    hand = mlp(WIDTH, DEPTH, devices=devices)
    hand.set_weights(model.get_weights())
    hand_devices = sorted({w.value.device.split("device:")[-1] for w in hand.weights})
    runners: dict[str, Any] = {"hand-placed": hand}
    stages = None
    for m in HANDPLACED_MICROBATCHES:
        plan, _, _ = uniform_plan(model, devices, BATCH, m)
        stages = [len(plan.nodes_on(d)) for d in plan.stages]
        runners[f"M={m}"] = wrap(model, plan, validate=False)
    auto = plan_and_wrap(model, devices=devices, batch_size=BATCH, num_microbatches="auto")
    runners["auto"] = auto
    runners["plain"] = model  # trained last: the wrapped models copied its initial weights
    for runner in runners.values():
        compile_for(runner, "mlp")
    hand_matmuls = matmuls_per_device(hand, data)
    for runner in runners.values():
        for _ in range(3):
            runner.train_on_batch(*data)
    per_round = take_turns(runners, data, rounds, steps)
    return {
        "step_s": {name: statistics.median(times) for name, times in per_round.items()},
        "speedup": {
            name: ratio_stats(per_round["hand-placed"], times)
            for name, times in per_round.items()
            if name != "hand-placed"
        },
        "hand_placed_variable_devices": hand_devices,
        "hand_placed_matmuls_per_device": hand_matmuls,
        "layers_per_stage": stages,
        "auto": {
            "num_microbatches": auto.plan.num_microbatches,
            "num_stages": auto.plan.num_stages,
            "schedule": auto.plan.schedule,
            "layers_per_stage": [len(auto.plan.nodes_on(d)) for d in auto.plan.stages],
        },
        "rounds": rounds,
        "steps_per_round": steps,
    }


def memory_model(model_name: str) -> tuple[Any, tuple[Any, Any], int]:
    """Section 5's model, its batch (x, y as numpy arrays) and the batch size."""
    if model_name == "mlp":
        return mlp(MEMORY_WIDTH, MEMORY_DEPTH), mlp_data(MEMORY_WIDTH, MEMORY_BATCH), MEMORY_BATCH
    if model_name == "cnn":
        return cnn(), cnn_data(MEMORY_CNN_BATCH), MEMORY_CNN_BATCH
    data = transformer_data(MEMORY_VOCABULARY, MEMORY_SEQUENCE, MEMORY_TRANSFORMER_BATCH)
    return transformer(MEMORY_VOCABULARY, MEMORY_SEQUENCE), data, MEMORY_TRANSFORMER_BATCH


def child_memory(model_name: str, config: str, num_microbatches: int, steps: int) -> dict[str, Any]:
    """Section 5: the allocator's peak during a training step of one configuration, and the simulator's.

    ``config="plain"`` is the Keras model itself on one device, the whole batch at once (the simulator's
    M = 1 on one device); otherwise the schedule, "+recompute" for recomputation, on 2 devices.
    """
    # TensorFlow's default CPU allocator keeps no statistics (reset_memory_stats refuses "CPU:0"); its
    # BFC allocator, chosen by this variable before TensorFlow starts, keeps them, as a GPU's does
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    devices = start_tensorflow(2, 2, collect=config != "plain")  # executed graphs: runtime.step_memory's devices
    import keras
    import tensorflow as tf

    import partitioner as pt
    from runtime import step_memory, wrap

    keras.utils.set_random_seed(0)
    model, data, batch = memory_model(model_name)
    schedule, _, recompute = config.partition("+")  # "1f1b+recompute" -> "1f1b", "recompute"
    model_weight_bytes = sum(int(w.value.numpy().nbytes) for w in model.weights)
    if config == "plain":
        plan, graph, cluster = uniform_plan(model, devices[:1], batch, 1, optimizer_slots=0)
        runner, kept_bytes = model, 0
    else:  # the plan records which stages recompute (all but the last); wrap runs the plan's choice
        plan, graph, cluster = uniform_plan(
            model,
            devices,
            batch,
            num_microbatches,
            optimizer_slots=0,
            schedule=schedule,
            recompute="always" if recompute else "never",
        )
        runner = wrap(model, plan, validate=False)
        kept_bytes = model_weight_bytes  # the PipelinedModel keeps the model it wrapped (sync_original)
    sim = pt.simulate(plan, graph, cluster)  # the plan's schedule and stage modes
    # the logical devices share one allocator: what they hold together at the simulated step's fullest
    # moment, not the sum of their peaks, which need not coincide
    simulated_bytes = sim.peak_total_bytes
    # what each device holds when the step starts, of what the simulator counts: its stage's weights and the
    # batch's inputs (a batch M divides is reshaped into the micro-batches, not copied); a step's allocation
    # records count from there (runtime.step_memory)
    start = dict.fromkeys(sim.stages, 0)
    for node, device in plan.assignment.items():
        attrs = graph.nodes[node]
        start[device] += int(attrs["param_bytes"]) + plan.num_microbatches * int(attrs.get("model_input_bytes") or 0)
    predicted = {
        "bytes": simulated_bytes + kept_bytes,
        "start_bytes": start,
        "received_bytes": received_copies(plan, graph, cluster),
        "simulated_total_bytes": simulated_bytes,
        "stage_peaks_sum_bytes": sum(sim.peak_memory_bytes.values()),
        "wrapped_model_weight_bytes": kept_bytes,
        "stages": list(sim.stages),  # in pipeline order, as "recompute"
        "peak_bytes": dict(sim.peak_memory_bytes),
        "in_flight": dict(sim.peak_in_flight),
        "recompute": list(plan.recompute),
    }
    runner.compile(  # SGD for every model: no optimizer slots, as the plans' optimizer_slots=0 say
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # a metric reads the model's outputs, as the cost model prices them (the outputs kept for the loss and
        # the metrics, and their stack after the loop); without one TensorFlow prunes the stack
        metrics=["accuracy"],
    )
    # Tensors before the first step: TensorFlow copies a numpy array it cannot alias (an unaligned one) at
    # every step, and whether that copy is live at the peak is chance. tf.constant aliases the array or
    # copies it, by the array's alignment again; DeepCopy puts the batch in the allocator every time, as
    # the simulator counts it.
    x, y = (tf.raw_ops.DeepCopy(x=tf.constant(a)) for a in data)
    for _ in range(2):
        runner.train_on_batch(x, y)
    peaks, baselines = [], []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        baselines.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
        runner.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    # per device, after the timed steps (it traces the step again): the step's allocation records, each
    # traced to the device of the node that made it (runtime.step_memory); a record it cannot trace is
    # counted apart, and a trace it cannot read is reported, not guessed
    per_device: dict[str, Any] = {}
    if config != "plain":
        try:
            records = step_memory(runner, x, y)
            per_device = {
                "step_bytes": dict(records.device_peak_bytes),
                "unknown_bytes": records.unknown_peak_bytes,
                "start_bytes": records.start_bytes,
            }
        except Exception as error:  # the benchmark goes on; results.json says why
            per_device = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {
        "per_device": per_device,
        "peak_bytes": max(peaks),
        "lowest_peak_bytes": min(peaks),
        "step_peaks_bytes": peaks,
        "between_steps_bytes": statistics.median(baselines),
        "model_weight_bytes": model_weight_bytes,
        "input_bytes": int(sum(a.nbytes for a in data)),
        "predicted": predicted,
    }


def child_placement(config: str) -> dict[str, Any]:
    """Section 6: one training step of the transformer; per stage, forward, backward and optimizer ops on
    the planned device, from the executed graphs."""
    devices = start_tensorflow(2, 2, collect=True)
    import keras

    from runtime import executed_placement, wrap

    keras.utils.set_random_seed(0)
    model = transformer()
    schedule, _, extra = config.partition("+")
    plan, _, _ = uniform_plan(
        model,
        devices,
        TRANSFORMER_BATCH,
        PLACEMENT_MICROBATCHES,
        schedule=schedule,
        recompute="always" if extra == "recompute" else "never",
    )
    runner = wrap(model, plan, validate=False)
    runner.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=extra == "xla",
    )
    report = executed_placement(runner, *transformer_data())
    return {
        "stages": list(report.stages),
        "recompute": list(plan.recompute),
        **{
            kind: [[share.on_device, share.total] for share in getattr(report, kind)]
            for kind in ("forward", "backward", "optimizer", "compiled")
        },
        "off_device": list(report.off_device),
        "unread": list(report.unread),
        "ok": report.ok,
    }


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "overlap": child_overlap,
    "overhead": child_overhead,
    "trace": child_trace,
    "handplaced": child_handplaced,
    "memory": child_memory,
    "placement": child_placement,
}


def run_child(kind: str, *args: Any) -> dict[str, Any]:
    """Runs ``CHILDREN[kind](*args)`` in a fresh Python process and returns its JSON answer."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps([str(a) if isinstance(a, Path) else a for a in args])],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {kind}{args} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    answer: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return answer


# ----- sections -------------------------------------------------------------------------------------


def section_overhead(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for model_name in ("mlp", "cnn", "transformer"):
        rounds, steps = (10, 3) if quick else (12, 5)
        if model_name != "mlp":
            steps *= 4  # shorter steps
        row = {"model": model_name, **run_child("overhead", model_name, rounds, steps)}
        rows.append(row)
        print(
            f"overhead {model_name}: plain {row['plain_s'] * 1e3:.1f} ms, wrapped {row['wrapped_s'] * 1e3:.1f} ms, "
            f"{100 * (row['ratio'] - 1):+.1f}% (per-round quartiles {100 * (row['q1'] - 1):+.1f}% .. "
            f"{100 * (row['q3'] - 1):+.1f}%); kernels per step {row['plain_kernels']} plain, "
            f"{row['wrapped_kernels']} wrapped",
            flush=True,
        )
    return rows


def section_overlap(quick: bool, scratch: Path) -> dict[str, Any]:
    repeats = 1 if quick else 2
    rows = []
    for k in (2,) if quick else (2, 4):
        for m in (1, 2, 4, 8):
            serial: list[dict[str, Any]] = []
            overlapped: list[dict[str, Any]] = []
            for r in range(repeats):  # serial and pipelined processes alternate
                for inter_op, runs in ((1, serial), (k, overlapped))[:: 1 if r % 2 == 0 else -1]:
                    graph_file = scratch / f"graph-k{k}-m{m}-inter{inter_op}-{r}.json"
                    runs.append(run_child("overlap", "wrapped", k, m, inter_op, graph_file))
            # The lower of the processes' medians: other work on the machine only ever slows a step down.
            best = min(overlapped, key=lambda x: x["measured_s"])
            row = {
                "devices": k,
                "microbatches": m,
                "serial_s": min(x["measured_s"] for x in serial),
                "pipelined_s": best["measured_s"],
                "predicted_s": best["predicted_s"],
                "simulated_s": best["simulated_s"],
                "serial_s_runs": [x["measured_s"] for x in serial],
                "pipelined_s_runs": [x["measured_s"] for x in overlapped],
            }
            row["speedup"] = row["serial_s"] / row["pipelined_s"]
            row["simulated_error"] = row["simulated_s"] / row["pipelined_s"] - 1
            rows.append(row)
            print(
                f"overlap K={k} M={m}: serial {row['serial_s'] * 1e3:.1f} ms, pipelined "
                f"{row['pipelined_s'] * 1e3:.1f} ms, speedup {row['speedup']:.2f}x, predicted "
                f"{row['predicted_s'] * 1e3:.1f} ms, simulated {row['simulated_s'] * 1e3:.1f} ms "
                f"({100 * row['simulated_error']:+.0f}%)",
                flush=True,
            )
    return {"repeats": repeats, "rows": rows}


def section_trace(quick: bool) -> dict[str, Any]:
    repeats, steady_steps = (1, 10) if quick else (3, 20)
    configs = [("plain", 1)] + [(s, m) for s in TRACE_SCHEDULES for m in TRACE_MICROBATCHES]
    runs: dict[str, list[dict[str, Any]]] = {f"{s} M={m}": [] for s, m in configs}
    for r in range(repeats):  # every configuration once per repeat, in an order that rotates
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for schedule, m in order:
            result = run_child("trace", schedule, m, steady_steps)
            runs[f"{schedule} M={m}"].append(result)
            print(
                f"trace {schedule} M={m}: first step {result['first_s']:.2f} s, steady "
                f"{result['steady_s'] * 1e3:.1f} ms",
                flush=True,
            )
    rows = []
    for schedule, m in configs:
        results = runs[f"{schedule} M={m}"]
        wraps = [x["wrap_s"] for x in results if x["wrap_s"] is not None]
        rows.append(
            {
                "schedule": schedule,
                "microbatches": m,
                "first_s": statistics.median(x["first_s"] for x in results),
                "steady_s": statistics.median(x["steady_s"] for x in results),
                "wrap_s": statistics.median(wraps) if wraps else None,
                "first_s_runs": [x["first_s"] for x in results],
                "steady_s_runs": [x["steady_s"] for x in results],
            }
        )
    ratios = {}
    for schedule in TRACE_SCHEDULES:
        by_m = {row["microbatches"]: row for row in rows if row["schedule"] == schedule}
        low, high = by_m[min(TRACE_MICROBATCHES)], by_m[max(TRACE_MICROBATCHES)]
        ratios[schedule] = {
            "first_step": high["first_s"] / low["first_s"],
            "steady_step": high["steady_s"] / low["steady_s"],
        }
        print(
            f"trace {schedule}: first step M={high['microbatches']} / M={low['microbatches']} "
            f"{ratios[schedule]['first_step']:.2f}x, steady {ratios[schedule]['steady_step']:.2f}x",
            flush=True,
        )
    return {"repeats": repeats, "steady_steps": steady_steps, "rows": rows, "ratios": ratios}


def section_handplaced(quick: bool) -> dict[str, Any]:
    rounds, steps = (6, 2) if quick else (12, 3)
    result = run_child("handplaced", rounds, steps)
    for name, step_s in result["step_s"].items():
        speedup = result["speedup"].get(name)
        extra = f", speedup {speedup['ratio']:.2f}x" if speedup else ""
        print(f"hand placement {name}: {step_s * 1e3:.1f} ms{extra}", flush=True)
    return result


def memory_configs() -> list[tuple[str, str, int]]:
    """Section 5's (model, configuration, M) triples: per model the plain model (M = 1), then each schedule
    for each M."""
    return [
        (model_name, config, m)
        for model_name in MEMORY_MODELS
        for config, m in [("plain", 1)] + [(s, m) for m in MEMORY_MICROBATCHES for s in MEMORY_SCHEDULES]
    ]


def section_memory(quick: bool) -> dict[str, Any]:
    repeats, steps = (1, 2) if quick else (3, 3)
    configs = memory_configs()
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(repeats):  # the peak differs from process to process: several processes, in turns
        shift = r % len(configs)
        for model_name, config, m in configs[shift:] + configs[:shift]:
            result = run_child("memory", model_name, config, m, steps)
            runs[model_name, config, m].append(result)
            p = result["predicted"]
            print(
                f"memory {model_name} {config} M={m}: peak {mib(result['peak_bytes'])} MiB (lowest step "
                f"{mib(result['lowest_peak_bytes'])}, between steps {mib(result['between_steps_bytes'])}), "
                f"predicted {mib(p['bytes'])} MiB (simulator {mib(p['simulated_total_bytes'])}, its stages' peaks "
                f"summed {mib(p['stage_peaks_sum_bytes'])}, + wrapped model's weights "
                f"{mib(p['wrapped_model_weight_bytes'])}), measured / predicted "
                f"{result['peak_bytes'] / p['bytes']:.2f}",
                flush=True,
            )
    rows = []
    for (model_name, config, m), results in runs.items():
        row = {
            "model": model_name,
            "config": config,
            "microbatches": m,
            "peak_bytes": max(x["peak_bytes"] for x in results),
            "lowest_peak_bytes": min(x["lowest_peak_bytes"] for x in results),
            "between_steps_bytes": statistics.median(x["between_steps_bytes"] for x in results),
            "model_weight_bytes": results[0]["model_weight_bytes"],
            "input_bytes": results[0]["input_bytes"],
            "predicted": results[0]["predicted"],
            "processes": results,
        }
        row["ratio"] = row["peak_bytes"] / row["predicted"]["bytes"]
        rows.append(row)
    by_key = {(row["model"], row["config"], row["microbatches"]): row for row in rows}
    for row in rows:  # a recomputing row against the same schedule and M without recomputation
        schedule, _, recompute = row["config"].partition("+")
        if not recompute:
            continue
        kept = by_key[row["model"], schedule, row["microbatches"]]
        row["measured_saving_bytes"] = kept["peak_bytes"] - row["peak_bytes"]
        row["predicted_saving_bytes"] = (
            kept["predicted"]["simulated_total_bytes"] - row["predicted"]["simulated_total_bytes"]
        )
        predicted_saving = row["predicted_saving_bytes"]
        share = row["measured_saving_bytes"] / predicted_saving if predicted_saving > 0 else None  # None: no saving
        row["saving_share"] = share
        stage_saving = row["stage_saving_bytes"] = recomputed_stages_saving(row, kept)
        print(
            f"memory {row['model']} {row['config']} M={row['microbatches']}: saving measured "
            f"{mib(row['measured_saving_bytes'])} MiB, predicted {mib(row['predicted_saving_bytes'])} MiB"
            + (f" ({100 * share:.0f}%)" if share is not None else "")
            + (
                "; on the recomputed stages measured {} MiB, predicted {} MiB".format(*map(mib, stage_saving))
                if stage_saving
                else ""
            ),
            flush=True,
        )
    return {"repeats": repeats, "steps": steps, "models": memory_model_names(), "rows": rows}


def received_copies(plan: Any, graph: Any, cluster: Any) -> dict[str, int]:
    """{device: bytes} of the copies of received inputs the cost model counts on each stage (a copy per
    micro-batch its sender holds: ``ModeCost.received_bytes``, and a recomputed stage's saved inputs): on
    GPUs copies on the receiver, on logical CPU devices the sender's buffers, which the receiver's
    allocation records do not hold."""

    costs = plan.cost_model(graph, cluster)
    ev = costs.evaluate(plan.assignment, list(plan.recompute))
    return {
        device: cost.received_bytes + (cost.held_bytes * ev.in_flight[device] if recomputed else 0)
        for device, cost, recomputed in zip(ev.stages, ev.stage_costs, ev.recompute, strict=True)
    }


def recomputed_stages_saving(row: dict[str, Any], kept: dict[str, Any]) -> tuple[int, int] | None:
    """What recomputation saved on the stages it recomputes, without it minus with it: (measured from each
    stage's allocation records, the first process of each row; simulated per-device peaks), or None where
    the records were not read. On one shared allocator the total's peak may fall where another stage
    peaks (the last stage's collected outputs), so the total's saving says less about recomputation."""
    records = [r["processes"][0].get("per_device") or {} for r in (kept, row)]
    if any("step_bytes" not in r for r in records):
        return None
    simulated = [r["predicted"]["peak_bytes"] for r in (kept, row)]
    stages = row["predicted"].get("stages", list(simulated[1]))  # older results: the dict's (stage) order
    chosen = [d for d, r in zip(stages, row["predicted"]["recompute"], strict=True) if r]
    measured = sum(records[0]["step_bytes"].get(d, 0) - records[1]["step_bytes"].get(d, 0) for d in chosen)
    return measured, sum(simulated[0][d] - simulated[1][d] for d in chosen)


def memory_model_names() -> dict[str, str]:
    """Section 5's models, in words."""
    return {
        "mlp": f"MLP of {MEMORY_DEPTH} Dense({MEMORY_WIDTH}) + Dense(10), batch {MEMORY_BATCH}",
        "cnn": f"CNN of {len(CNN_FILTERS)} Conv2D-BatchNormalization-ReLU-MaxPooling blocks "
        f"({'/'.join(map(str, CNN_FILTERS))} filters) + Dense(10), {CNN_SIZE}x{CNN_SIZE}x3, batch {MEMORY_CNN_BATCH}",
        "transformer": f"GPT-style decoder, {NUM_BLOCKS} blocks, width {MODEL_DIM}, {NUM_HEADS} heads, "
        f"vocabulary {MEMORY_VOCABULARY}, sequence {MEMORY_SEQUENCE}, batch {MEMORY_TRANSFORMER_BATCH}",
    }


def section_placement(quick: bool) -> dict[str, Any]:
    rows = []
    for config in PLACEMENT_CONFIGS:
        result = {"config": config, **run_child("placement", config)}
        rows.append(result)
        shares = ", ".join(
            f"stage {s} "
            + " ".join(
                f"{kind[0].upper()} {result[kind][s][0]}/{result[kind][s][1]}"
                for kind in ("forward", "backward", "optimizer")
            )
            + (f" XLA calls {result['compiled'][s][0]}/{result['compiled'][s][1]}" if result["compiled"][s][1] else "")
            for s in range(len(result["stages"]))
        )
        print(f"placement {config}: {shares}; {'all on their devices' if result['ok'] else 'OFF DEVICE'}", flush=True)
    return {"microbatches": PLACEMENT_MICROBATCHES, "rows": rows}


# ----- tables ---------------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def write_readme(results: dict[str, Any]) -> None:
    """Replaces the part of README.md between the results markers with the tables of ``results``."""
    readme = HERE / "README.md"
    write_block(readme, "results", "\n".join(tables(results)))
    print(f"wrote the tables of {readme}")


def verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def tables(results: dict[str, Any]) -> list[str]:
    """The generated part of README.md."""
    r = results
    lines = [
        f"Machine: {r['machine']}, logical CPU devices, 1 intra-op thread. Synthetic data. "
        f"Generated by `{r['command']}` on {r['date']} in {r['run_time_s'] / 60:.1f} minutes. {r['load']}",
        "",
        "**Overhead** on one device, M = 1, against plain Keras (same process and weights, taking turns, "
        "1 inter-op thread; median of per-round mean steps):",
        "",
        "| model | rounds x steps | plain Keras (ms) | PipelinedModel (ms) | overhead | per-round quartiles "
        "| goal < 2% | kernels per step: plain / wrapped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["overhead"]:
        kernels = f"{row['plain_kernels']} / {row['wrapped_kernels']}" if "plain_kernels" in row else "n/a"
        lines.append(
            f"| {r['models'][row['model']]} | {row['rounds']} x {row['steps_per_round']} | {row['plain_s'] * 1e3:.1f} "
            f"| {row['wrapped_s'] * 1e3:.1f} | {100 * (row['ratio'] - 1):+.1f}% "
            f"| {100 * (row['q1'] - 1):+.1f}% .. {100 * (row['q3'] - 1):+.1f}% | {verdict(row['ratio'] < 1.02)} "
            f"| {kernels} |"
        )
    lines += [
        "",
        f"**Overlap** ({r['models']['mlp']}; by_time plan on measured layer times, their fixed part and "
        f"their gradient sums (`measure_fixed_time`); each configuration in "
        f"{r['overlap']['repeats']} process(es), serial and pipelined alternating, each the median of {STEPS} steps "
        f"after {WARMUP} warm-up steps, the lower process kept; serial = 1 inter-op thread, pipelined = K):",
        "",
        "| devices | M | serial (ms) | pipelined (ms) | speedup | fill-drain bound from FLOPs (ms) "
        "| simulated from measured layer times (ms) | simulated / measured - 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    best = max((row for row in r["overlap"]["rows"] if row["devices"] == 2), key=lambda row: row["speedup"])
    overlap_lines = [
        "",
        f"Best speedup on 2 devices: {best['speedup']:.2f}x at M = {best['microbatches']} "
        f"(goal >= 1.4x: {verdict(best['speedup'] >= 1.4)}).",
    ]
    for row in r["overlap"]["rows"]:
        lines.append(
            f"| {row['devices']} | {row['microbatches']} | {row['serial_s'] * 1e3:.1f} "
            f"| {row['pipelined_s'] * 1e3:.1f} | {row['speedup']:.2f}x | {row['predicted_s'] * 1e3:.1f} "
            f"| {row['simulated_s'] * 1e3:.1f} "
            f"| {100 * row['simulated_error']:+.0f}% |"
        )
    lines += overlap_lines
    trace = r["trace"]
    lines += [
        "",
        f"**Trace cost** ({r['models']['transformer']}; 2 devices, uniform plan, 2 inter-op threads; each "
        f"configuration in a fresh process, median over {trace['repeats']} process(es); steady = median of "
        f"{trace['steady_steps']} steps on the same batch; wrap = `runtime.wrap` itself):",
        "",
        "| schedule | M | first step (s) | steady step (ms) | wrap (s) |",
        "|---|---|---|---|---|",
    ]
    for row in trace["rows"]:
        name = "plain Keras, 1 device" if row["schedule"] == "plain" else row["schedule"]
        wrap_s = "-" if row["wrap_s"] is None else f"{row['wrap_s']:.2f}"
        lines.append(
            f"| {name} | {row['microbatches']} | {row['first_s']:.2f} | {row['steady_s'] * 1e3:.1f} | {wrap_s} |"
        )
    low, high = min(TRACE_MICROBATCHES), max(TRACE_MICROBATCHES)
    lines += [""] + [
        f"{schedule}: first step M={high} / M={low} = {ratio['first_step']:.2f}x "
        f"(goal <= 1.5x: {verdict(ratio['first_step'] <= 1.5)}), "
        f"steady step M={high} / M={low} = {ratio['steady_step']:.2f}x (the first runtime: 6.3x).  "
        for schedule, ratio in trace["ratios"].items()
    ]
    hand = r["handplaced"]
    lines += [
        "",
        f"**Hand placement** ({r['models']['mlp']}; 2 devices, 2 inter-op threads; one process, configurations "
        f"taking turns for {hand['rounds']} rounds of {hand['steps_per_round']} steps; layers per stage "
        f"{hand['layers_per_stage']}; the hand-placed model's variables are on "
        f"{', '.join(hand['hand_placed_variable_devices'])}, the matmul kernels of its training step on "
        + ", ".join(f"{d}: {n}" for d, n in sorted(hand["hand_placed_matmuls_per_device"].items()))
        + "):",
        "",
        "| model | step (ms) | speedup over hand-placed | per-round quartiles |",
        "|---|---|---|---|",
        f"| hand-placed functional model, Keras' own step | {hand['step_s']['hand-placed'] * 1e3:.1f} | 1.00x | |",
        f"| plain Keras, no placement | {hand['step_s']['plain'] * 1e3:.1f} | {hand['speedup']['plain']['ratio']:.2f}x "
        f"| {hand['speedup']['plain']['q1']:.2f}x .. {hand['speedup']['plain']['q3']:.2f}x |",
    ]
    for m in HANDPLACED_MICROBATCHES:
        s = hand["speedup"][f"M={m}"]
        lines.append(
            f"| PipelinedModel, M = {m} | {hand['step_s'][f'M={m}'] * 1e3:.1f} | {s['ratio']:.2f}x "
            f"| {s['q1']:.2f}x .. {s['q3']:.2f}x |"
        )
    if "auto" in hand:  # results written before the planner's pick was measured lack it
        a, s = hand["auto"], hand["speedup"]["auto"]
        lines.append(
            f'| PipelinedModel as the planner chooses (`num_microbatches="auto"`): M = {a["num_microbatches"]}, '
            f"{a['num_stages']} stage(s) {a['layers_per_stage']}, {a['schedule']} | {hand['step_s']['auto'] * 1e3:.1f} "
            f"| {s['ratio']:.2f}x | {s['q1']:.2f}x .. {s['q3']:.2f}x |"
        )
        lines += [
            "",
            f"At the planner's choice the pipeline runs {s['ratio']:.2f}x the hand-placed step (goal: never slower, "
            f">= 1.00x: {verdict(s['ratio'] >= 1.0)}).",
        ]
    lines += memory_tables(r["memory"])
    if "placement" in r:
        lines += [
            "",
            f"**Executed placement** ({r['models']['transformer']}; 2 devices, uniform plan, M = "
            f"{r['placement']['microbatches']}, one training step; ops on the planned device / ops counted, read "
            "from the graphs TensorFlow executed; with XLA a stage function is one compiled cluster that XLA runs "
            "wholly on its call's device, so its ops are not listed and its calls are counted where they ran):",
            "",
            "| configuration | stage | device | forward | backward | optimizer updates | "
            "XLA calls (forward, backward) |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in r["placement"]["rows"]:
            for s, device in enumerate(row["stages"]):
                kinds = ("forward", "backward", "optimizer", "compiled")
                cells = " | ".join(
                    f"{on}/{total} ({on / total if total else 1:.0%})" if total or kind != "compiled" else "-"
                    for kind, (on, total) in ((k, row.get(k, [[0, 0]] * len(row["stages"]))[s]) for k in kinds)
                )
                lines.append(f"| {row['config']} | {s} | {device.split('device:')[-1]} | {cells} |")
        everywhere = all(row["ok"] for row in r["placement"]["rows"])
        lines += [
            "",
            f"Every counted op on its planned device in every configuration: {'yes' if everywhere else 'no'}.",
        ]
    return lines


def memory_tables(memory: dict[str, Any]) -> list[str]:
    """Section 5's part of README.md: one table per model."""
    lines = [
        "",
        f"**Peak memory** (2 devices, 2 inter-op threads, uniform plan, SGD; plain = the Keras model on one device, "
        f"the whole batch at once; each configuration in {memory['repeats']} process(es) of {memory['steps']} "
        "steps after 2 warm-up steps; measured = TensorFlow's CPU allocator, all devices together, the highest "
        "and the lowest step peak; predicted = the most the simulated devices hold together at one moment "
        "(`Simulation.peak_total_bytes`: the devices' peaks need not coincide; received activations waiting "
        "for their stage count), plus the weights of the model the PipelinedModel wraps and keeps; beside it, the "
        "simulated devices' peaks summed, which a shared memory holds where they coincide; saving = peak without "
        "recomputation - peak with, same schedule and M: on the recomputed stages (each stage's allocation "
        "records against its simulated peak; goal: measured >= 80% of predicted) and of the total):",
    ]
    for model_name, description in memory["models"].items():
        rows = [row for row in memory["rows"] if row["model"] == model_name]
        if not rows:
            continue
        kept = rows[-1]["predicted"]["wrapped_model_weight_bytes"]
        lines += [
            "",
            f"{description}:",
            "",
            "| configuration | M | measured peak, highest / lowest step (MiB) | between steps (MiB) | predicted "
            "(MiB) | stages' peaks summed (MiB) | measured / predicted | goal within 10% | saving on the recomputed "
            "stages, measured / predicted (MiB) | goal >= 80% | saving of the total, measured / predicted (MiB) "
            "| per device: step's records above its start / simulated, less its weights, the batch and the copies "
            "of what it receives (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            name = "plain Keras, 1 device" if row["config"] == "plain" else row["config"]
            total = stage = share = "-"
            if "saving_share" in row:
                total = f"{mib(row['measured_saving_bytes'])} / {mib(row['predicted_saving_bytes'])}"
                share = "records not read" if "stage_saving_bytes" in row else "-"  # older results: not computed
                if row.get("stage_saving_bytes"):
                    measured, predicted = row["stage_saving_bytes"]
                    stage = f"{mib(measured)} / {mib(predicted)}"
                    share = (
                        "n/a (no saving predicted)"
                        if predicted <= 0
                        else f"{100 * measured / predicted:.0f}% ({verdict(measured >= 0.8 * predicted)})"
                    )
            summed = row["predicted"].get("stage_peaks_sum_bytes")
            summed_cell = "-" if summed is None else mib(summed + row["predicted"]["wrapped_model_weight_bytes"])
            lines.append(
                f"| {name} | {row['microbatches']} | {mib(row['peak_bytes'])} / {mib(row['lowest_peak_bytes'])} "
                f"| {mib(row['between_steps_bytes'])} | {mib(row['predicted']['bytes'])} | {summed_cell} "
                f"| {row['ratio']:.2f} | {verdict(abs(row['ratio'] - 1) <= 0.1)} | {stage} | {share} | {total} "
                f"| {per_device_cell(row)} |"
            )
        lines += [
            "",
            f"Predicted includes the wrapped model's weights, {mib(kept)} MiB (not on the plain row); the input batch "
            f"(x and y) is {mib(rows[0]['input_bytes'])} MiB, all weights {mib(rows[0]['model_weight_bytes'])} MiB. "
            "Per-device simulated peaks and micro-batches in flight: results.json.",
        ]
    return lines


def per_device_cell(row: dict[str, Any]) -> str:
    """Section 5's per-device cell: what the step's allocation records held on each device beyond the step's
    start (runtime.step_memory; the first process), against the simulator's per-device peak less what the
    device held when the step started (its weights, the batch's inputs) and the copies of the inputs it
    receives (on these logical devices the sender's buffers, in the sender's records)."""
    records = row["processes"][0].get("per_device") or {}
    if "error" in records:
        return f"not read ({records['error']})"
    if not records:
        return "-"
    simulated, start = row["predicted"]["peak_bytes"], row["predicted"].get("start_bytes", {})
    received = row["predicted"].get("received_bytes", {})
    cells = [
        f"{mib(records['step_bytes'].get(device, 0))} / "
        f"{mib(simulated[device] - start.get(device, 0) - received.get(device, 0))}"
        for device in sorted(simulated)
    ]
    unknown = f"; unattributed {mib(records['unknown_bytes'])}" if records["unknown_bytes"] else ""
    return ", ".join(cells) + unknown


def pytest_running() -> bool:
    """True iff a pytest process (someone's test run) is on this machine now."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return any("pytest" in line for line in ps)


class LoadWatch:
    """Samples, every few seconds in a background thread, whether a pytest run shares the machine."""

    def __init__(self, every_s: float = 5.0) -> None:
        import threading

        self.every_s = every_s
        self.samples: list[tuple[float, bool]] = []  # (time.perf_counter(), a pytest was running)
        self.load_at_start = os.getloadavg()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), pytest_running()))
            self._stop.wait(self.every_s)

    def share(self, start: float, end: float) -> float:
        """The share of the samples between start and end that saw a pytest run."""
        inside = [busy for t, busy in self.samples if start <= t <= end]
        return sum(inside) / max(len(inside), 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 devices only, fewer repeats (about 9 minutes)")
    parser.add_argument("--only", help=f"comma-separated sections of {SECTIONS}; prints, writes nothing")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's tables from results.json")
    args = parser.parse_args()
    if args.child:
        kind, arguments = args.child
        print(json.dumps(CHILDREN[kind](*json.loads(arguments))))
        return
    if args.readme:
        write_readme(json.loads((HERE / "results.json").read_text()))
        return

    sections = SECTIONS if args.only is None else tuple(args.only.split(","))
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    started = time.perf_counter()
    watch = LoadWatch()
    scratch = Path(tempfile.mkdtemp(prefix="runtime-bench-"))
    quick = args.quick
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python benchmarks/runtime/run.py{' --quick' if quick else ''}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "models": {
            "mlp": f"MLP of {DEPTH} Dense({WIDTH}) + Dense(10), batch {BATCH}",
            "cnn": f"CNN of {len(CNN_FILTERS)} Conv2D-BatchNormalization-ReLU-MaxPooling blocks "
            f"({'/'.join(map(str, CNN_FILTERS))} filters) + Dense(10), {CNN_SIZE}x{CNN_SIZE}x3, batch {CNN_BATCH}",
            "transformer": f"GPT-style decoder, {NUM_BLOCKS} blocks, width {MODEL_DIM}, {NUM_HEADS} heads, "
            f"vocabulary {VOCABULARY}, sequence {SEQUENCE}, batch {TRANSFORMER_BATCH}, Adam",
        },
    }
    run_section: dict[str, Callable[[], Any]] = {
        "overhead": lambda: section_overhead(quick),
        "overlap": lambda: section_overlap(quick, scratch),
        "trace": lambda: section_trace(quick),
        "handplaced": lambda: section_handplaced(quick),
        "memory": lambda: section_memory(quick),
        "placement": lambda: section_placement(quick),
    }
    shared: dict[str, float] = {}
    for section in sections:
        begun = time.perf_counter()
        results[section] = run_section[section]()
        shared[section] = watch.share(begun, time.perf_counter())
        print(f"{section}: a pytest run shared the machine during {100 * shared[section]:.0f}% of it", flush=True)
    watch.stop()
    results["run_time_s"] = time.perf_counter() - started
    results["pytest_share"] = shared
    results["load"] = f"Load average at the start {watch.load_at_start:.2f}; " + (
        "no pytest run was seen during the run."
        if not any(shared.values())
        else "share of each section during which another pytest run used the machine (sampled every 5 s): "
        + ", ".join(f"{name} {100 * share:.0f}%" for name, share in shared.items())
        + "."
    )
    print(f"ran in {results['run_time_s'] / 60:.1f} minutes", flush=True)
    if args.only is not None:
        print(json.dumps(results, indent=1))
        return
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    write_readme(results)


if __name__ == "__main__":
    main()
