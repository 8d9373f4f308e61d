"""Worker processes: one per pipeline replica, joined into a cluster by TensorFlow's own multi-worker machinery.

Data x pipeline parallelism runs D copies of a K-stage pipeline, one per worker process, each on its
own K devices; after every step's micro-batches the copies sum their gradients stage by stage (the
``R`` action, ``runtime.replicas``). A worker's program starts with ``start_worker()`` and then wraps
and trains as on one machine::

    from runtime import plan_and_wrap, start_worker
    worker = start_worker(num_devices=2)        # first: before anything touches TensorFlow
    model = build_model()
    wrapped = plan_and_wrap(model, devices=2, batch_size=32, num_microbatches=4)   # replicas: every worker
    wrapped.compile(optimizer="adam", loss="mse")
    wrapped.fit(dataset.shard(worker.num_workers, worker.rank), epochs=3)         # each worker its share
    if worker.rank == 0:
        wrapped.save("trained.keras")

The cluster comes from ``TF_CONFIG`` (``partitioner launch`` writes one per worker; Kubeflow's TFJob
does too; by hand on several machines): ``{"cluster": {"worker": ["host0:port", ...]}, "task":
{"type": "worker", "index": i}}``; under Slurm without one, from the job step's environment
(``tf_config_from_slurm``: ``srun --ntasks=D python train.py``). ``start_worker`` creates TensorFlow's
``MultiWorkerMirroredStrategy`` only to start the cluster (its gRPC server, collective executor and
heartbeat) and never enters its scope: Keras 3's ``fit`` under that scope fails
(keras-team/keras#20585). It must run before TensorFlow initialises its context.

Every worker must run the same number of steps in training and in validation, and call ``evaluate`` too:
give each worker shards of equal size, or ``steps_per_epoch`` and ``validation_steps``. A worker with a step
more fails with one clear error on every worker (``replicas.in_step``).

On a fault the others fail, they do not hang (measured with 2 workers on 2 CPU cores,
tests/runtime/test_faults.py): a killed worker's connections close and the others' collective aborts
0.05 s later (they exit 1.2-1.9 s after the kill); a hung (stopped) one is missed by the coordination
service's heartbeat (10 s without one; the abort came 6.5-6.9 s after the stop, ``partitioner launch``
returned 9 s after). TensorFlow's error ends "Restart your program to reset": a worker whose collectives
aborted cannot go on. Recovery is a restart of all from the last backup::

    wrapped.fit(shard, epochs=10, steps_per_epoch=100,
                callbacks=[keras.callbacks.BackupAndRestore(f"backup/worker-{worker.rank}")])   # a folder each
    # partitioner launch --workers 2 --devices-per-worker 2 --max-restarts 3 -- python train.py

Each worker restores its own folder, and the folders may hold different epochs (a worker killed after an
epoch's last step and before its backup): ``fit`` then takes replica 0's weights, optimizer state and
first epoch on every replica (``start_together``), so the run ends as if it had never been killed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from partitioner.errors import InputError
from partitioner.launch import DEVICES_PER_WORKER_ENV  # set by ``partitioner launch --devices-per-worker``


@dataclass(frozen=True)
class Worker:
    """This process's place in the cluster."""

    rank: int  # this worker's index in TF_CONFIG's worker list; 0 writes files
    num_workers: int  # D, the replicas of the pipeline
    task: str  # TensorFlow's name of this worker ('/job:worker/replica:0/task:1'), '' without TF_CONFIG
    devices: tuple[str, ...]  # this worker's devices, as the runtime names them ('/device:CPU:0', ...)


_state: dict[str, Any] = {"worker": None, "strategy": None, "task": ""}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_NUMBERS = (*_FLOATS, "int32", "int64")  # what a collective sums: an optimizer's slots and counters


def tf_config_from_slurm() -> bool:
    """Writes ``TF_CONFIG`` from Slurm's environment (a job step of one task per worker: ``srun``) where
    none is set, with TensorFlow's ``SlurmClusterResolver`` (hosts from ``SLURM_STEP_NODELIST``, one port
    per task from ``$PARTITIONER_PORT_BASE``, default 8888; on GPU nodes each task its share of the
    node's GPUs through ``CUDA_VISIBLE_DEVICES``). Returns True iff it wrote one.
    """
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1"))
    if os.environ.get("TF_CONFIG") or "SLURM_PROCID" not in os.environ or int(tasks) < 2:
        return False
    import tensorflow as tf

    gpus = bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or shutil.which("nvidia-smi") is not None
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=int(os.environ.get("PARTITIONER_PORT_BASE", "8888")),
        # CPU nodes: the resolver's GPU allocation is unused (nothing set), but it needs one GPU per task
        gpus_per_node=None if gpus else 1024,
        gpus_per_task=None if gpus else 1,
        auto_set_gpu=gpus,
    )
    workers = list(resolver.cluster_spec().as_dict()["worker"])
    _, index = resolver.get_task_info()
    config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": int(index)}}
    os.environ["TF_CONFIG"] = json.dumps(config)
    return True


def _read_tf_config() -> tuple[list[str], int] | None:
    tf_config_from_slurm()
    text = os.environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
        workers = list(config["cluster"]["worker"])
        task = config.get("task", {})
        kind, index = task.get("type", "worker"), int(task.get("index", 0))
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(
            f"TF_CONFIG is not a cluster of workers: {err}. Expected JSON such as "
            '{"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 0}}.'
        ) from None
    if kind != "worker" or not 0 <= index < len(workers):
        raise InputError(
            f"TF_CONFIG's task is {{'type': {kind!r}, 'index': {index}}}; expected a worker of the cluster's "
            f"{len(workers)}: type 'worker', index 0 to {len(workers) - 1}."
        )
    return workers, index


def start_worker(num_devices: int | None = None) -> Worker:
    """Joins this process to the cluster ``TF_CONFIG`` describes; call it before anything touches TensorFlow.

    Args:
        num_devices: the devices of this worker: on a GPU machine its visible GPUs (set
            ``CUDA_VISIBLE_DEVICES`` per worker, as ``partitioner launch`` does), else this many logical
            CPU devices. Defaults to ``$PARTITIONER_DEVICES_PER_WORKER``, else 1 on CPU.

    Returns:
        The Worker (rank, number of workers, devices). Without ``TF_CONFIG``: the only worker, rank 0.

    Raises:
        InputError: TF_CONFIG is malformed, or TensorFlow initialised before this call.

    Example:
        >>> worker = start_worker(num_devices=2)       # doctest: +SKIP
        >>> worker.rank, worker.num_workers            # doctest: +SKIP
        (0, 2)
    """
    if _state["worker"] is not None:
        return _state["worker"]  # type: ignore[no-any-return]
    import tensorflow as tf

    from runtime.devices import local_device_names

    if num_devices is None:
        num_devices = int(os.environ.get(DEVICES_PER_WORKER_ENV, "1"))
    cluster = _read_tf_config()
    if not tf.config.list_physical_devices("GPU"):  # logical CPU devices, without listing them (that initialises)
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
        except RuntimeError as err:
            raise InputError(
                f"Cannot make {num_devices} devices for this worker: {err}. Expected start_worker() to run before "
                "anything initialises TensorFlow (listing devices, making a tensor or a model): call it first."
            ) from None
    if cluster is None or len(cluster[0]) == 1:
        worker = Worker(0, 1, "", tuple(local_device_names()))
        _state["worker"] = worker
        return worker
    _, rank = cluster
    try:
        # starts the gRPC server, the collective executor and the heartbeat; its scope is never entered
        _state["strategy"] = tf.distribute.MultiWorkerMirroredStrategy()
    except RuntimeError as err:
        raise InputError(
            f"Cannot join the cluster of TF_CONFIG: {err}. Expected start_worker() to run before anything "
            "initialises TensorFlow (listing devices, making a tensor or a model): call it first."
        ) from None
    _restore_sigterm()
    _state["task"] = task = f"/job:worker/replica:0/task:{rank}"  # what local_device_names keeps
    _state["worker"] = worker = Worker(rank, len(cluster[0]), task, tuple(local_device_names()))
    return worker


def _restore_sigterm() -> None:
    """Lets SIGTERM end the worker again. MultiWorkerMirroredStrategy installs TensorFlow's preemption notifier,
    which catches SIGTERM and logs it ("SIGTERM caught"), and the process goes on: ``timeout``, a plain ``kill`` or a
    scheduler's first signal (Slurm's, Kubernetes') no longer ended a hung worker (found by probing, stop 38: one
    waited 600 s in a collective after its SIGTERM). The runtime uses no preemption checkpointing."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():  # Python sets handlers from the main thread only
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def current_worker() -> Worker | None:
    """The Worker ``start_worker`` made in this process, or None."""
    return _state["worker"]  # type: ignore[no-any-return]


def local_task() -> str:
    """This worker's TensorFlow task name ('/job:worker/replica:0/task:1'), '' outside a cluster."""
    return str(_state["task"])


def join_replicas(wrapped: Any, num_replicas: int) -> None:
    """Every replica checks it wraps the same plan with the same stage variables (one clear error, not
    a hang), then takes replica 0's initial weights (floating variables; seed states stay each one's).

    Raises:
        InputError: when a replica's plan or stage variables differ from another's.
    """
    from runtime.replicas import agree, broadcast_variables

    if num_replicas == 1:
        return
    worker = _state["worker"]
    rank = 0 if worker is None else worker.rank
    executor = wrapped.executor
    plan = wrapped.plan
    # what decides the collectives every replica issues: the placement, the schedule, the variables; and what
    # the layers compute (two workers whose models differed in an activation trained a silent mix of the two:
    # found by probing, stop 38)
    decisions = (sorted(plan.assignment.items()), plan.stages, executor.options)
    shapes = [[(v.path, tuple(v.shape), str(v.dtype)) for v in _stage_weights(stage)] for stage in executor.stages]
    layers = [[_config_text(operation) for operation in stage.operations] for stage in executor.stages]
    fingerprint = hashlib.sha256(repr((decisions, shapes, layers)).encode()).hexdigest()
    agree(executor.collectives, fingerprint, "the plan, its stages' variables and their layers' configs")
    broadcast_variables(
        executor.collectives, [[v.value for v in _stage_weights(stage)] for stage in executor.stages], rank
    )


def start_together(wrapped: Any, first_epoch: int | None) -> int | None:
    """Every replica takes replica 0's weights, optimizer state and first epoch: ``fit`` runs this after
    its callbacks' ``on_train_begin``, where ``BackupAndRestore`` restored each worker's own folder.

    The folders need not hold the same epoch: a worker killed between an epoch's last step and its
    backup restarts an epoch behind the others, and replicas that trained on from different weights
    would sum gradients of different models, each one's wrong (and run different numbers of steps).

    Args:
        wrapped: the PipelinedModel.
        first_epoch: the epoch this replica's callbacks resume from (Keras' ``_initial_epoch``), or None.

    Returns:
        Replica 0's ``first_epoch`` (None where it had none).
    """
    import tensorflow as tf

    from runtime.replicas import StageCollectives, check_in_step

    executor = wrapped.executor
    num_replicas = executor.options.num_replicas
    if num_replicas == 1:
        return first_epoch
    check_in_step(executor.collectives, "the start of fit")  # not a worker still in another's evaluate
    worker = _state["worker"]
    rank = 0 if worker is None else worker.rank
    variables = [v for stage in executor.stages for v in _stage_weights(stage)]
    optimizer = wrapped.optimizer
    if optimizer is not None:
        if not optimizer.built:  # its slots exist before they are sent (as BackupAndRestore does)
            optimizer.build(wrapped.trainable_variables)
        variables += [v for v in optimizer.variables if v.dtype in _NUMBERS]
    stage = executor.stages[0]
    # collective keys of its own: what is sent may differ from one fit to the next (another optimizer)
    group = StageCollectives(stage.index, stage.device, num_replicas)
    epoch = tf.constant(-1 if first_epoch is None else first_epoch, tf.int64)

    @tf.function(autograph=False)  # type: ignore[untyped-decorator]  # TensorFlow ships no type hints
    def run() -> tf.Tensor:
        with tf.device(group.device):
            *values, first = group.broadcast([v.value.read_value() for v in variables] + [epoch], rank)
            for variable, value in zip(variables, values):
                variable.value.assign(value)
            return first

    first = int(run())
    return None if first < 0 else first


def _config_text(operation: Any) -> str:
    """A layer's config as text that is the same in every process for the same layer: JSON with sorted keys, each
    object Keras cannot serialize by its type's name, any memory address left out ("0x7f..."); the type's name
    alone where there is no config."""
    try:
        text = json.dumps(operation.get_config(), sort_keys=True, default=lambda x: type(x).__name__)
    except Exception:  # a layer without get_config: its type is what can be compared
        text = ""
    return type(operation).__name__ + re.sub(r"0x[0-9a-fA-F]+", "0x", text)


def _stage_weights(stage: Any) -> list[Any]:
    """Every floating weight of the stage's layers, each once, in a fixed order."""
    found: dict[int, Any] = {}
    for operation in stage.operations:
        for variable in operation.weights:
            if variable.dtype in _FLOATS:
                found.setdefault(id(variable), variable)
    return list(found.values())
