"""Virtual devices for tests and demos, and the ``devices=`` argument of plan_and_wrap as a Cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from partitioner.cluster import Cluster, Device, canonical_device_name
from partitioner.errors import ClusterError, InputError
from runtime.workers import current_worker, local_task


def make_virtual_devices(num_devices: int, *, gpu_memory_mb: int = 1024) -> list[str]:
    """Splits this machine into ``num_devices`` logical devices; call before TensorFlow initialises.

    On a machine with a GPU the first GPU becomes ``num_devices`` virtual GPUs of ``gpu_memory_mb``
    each; otherwise the CPU becomes ``num_devices`` logical CPU devices. Calling it again with the
    same number once TensorFlow has initialised returns the existing devices.

    Returns:
        The logical device names, e.g. ['/device:CPU:0', ..., '/device:CPU:3'].

    Raises:
        InputError: when TensorFlow already initialised with a different number of devices.

    Example:
        >>> from runtime import make_virtual_devices          # doctest: +SKIP
        >>> make_virtual_devices(4)                           # doctest: +SKIP
        ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
    """
    import tensorflow as tf

    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise InputError(f"num_devices must be an integer >= 1. Received: {num_devices!r}.")
    gpus = tf.config.list_physical_devices("GPU")
    kind = "GPU" if gpus else "CPU"
    physical = gpus[0] if gpus else tf.config.list_physical_devices("CPU")[0]
    config = (
        [tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb) for _ in range(num_devices)]
        if gpus
        else [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
    )
    try:
        tf.config.set_logical_device_configuration(physical, config)
    except RuntimeError as err:  # TensorFlow already initialised
        existing = [d.name for d in tf.config.list_logical_devices(kind)]
        if len(existing) >= num_devices:
            return existing[:num_devices]
        raise InputError(
            f"TensorFlow already initialised with {len(existing)} {kind} device(s); cannot make {num_devices}. "
            "Call runtime.make_virtual_devices before any TensorFlow operation runs."
        ) from err
    return [d.name for d in tf.config.list_logical_devices(kind)]


def local_device_names() -> list[str]:
    """TensorFlow's logical accelerators of this process: the GPUs if any, else the CPUs. In a cluster
    (``runtime.workers``) TensorFlow lists every worker's devices: this worker's only, named locally."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    names = [canonical(d.name) for d in (gpus or tf.config.list_logical_devices("CPU"))]
    return [n for n in names if not n.startswith("/job:")]


def canonical(name: str) -> str:
    """'/GPU:1', 'GPU:1' and '/device:GPU:1' -> '/device:GPU:1': the planner's one rule for device names
    (``partitioner.cluster.canonical_device_name``), where this worker's own task prefix
    ('/job:worker/replica:0/task:1', ``runtime.workers``) is dropped too: its devices are the local ones."""
    name = canonical_device_name(name)
    task = local_task()
    return name[len(task) :] if task and name.startswith(f"{task}/device:") else name


def require_devices(devices: Sequence[str], available: Sequence[str] | None = None) -> list[str]:
    """The devices named, canonical (``canonical``), once each exists here; nothing is measured.

    Raises:
        ClusterError: naming the devices that do not exist here, and listing those that do.
    """
    available = local_device_names() if available is None else list(available)
    names = [canonical(str(d)) for d in devices]
    known = {canonical(a) for a in available}
    missing = [d for d in names if d not in known]
    if missing or not names:
        raise ClusterError(f"Device(s) {missing or '[]'} do not exist here. TensorFlow sees: {available}.")
    return names


def resolve_devices(
    devices: int | Sequence[str] | Cluster,
    *,
    memory: int | float | str | None = None,
    flops_per_s: float | None = None,
) -> Cluster:
    """Turns ``devices=`` (a count, TensorFlow device names, or a Cluster) into a Cluster of local devices.

    Raises:
        ClusterError: naming the devices that do not exist here, and listing those that do.
    """
    available = local_device_names()
    if isinstance(devices, Cluster):
        missing = [d.name for d in devices.devices if canonical(d.name) not in map(canonical, available)]
        if missing:
            raise ClusterError(f"Device(s) {missing} do not exist here. TensorFlow sees: {available}.")
        return devices
    if isinstance(devices, bool):
        raise InputError(f"devices must be a count, a list of device names or a Cluster. Received: {devices!r}.")
    if isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise ClusterError(
                f"devices={devices} but TensorFlow sees {len(available)} device(s): {available}. "
                "Use fewer, or make virtual devices first with runtime.make_virtual_devices(n)."
            )
        names = available[:devices]
    else:
        names = require_devices(devices, available)
    from profiles.local import local_cluster

    # A worker of several (runtime.workers) does not calibrate: each would measure its own figures, and the
    # replicas must agree on one plan (join_replicas); a Cluster passed as devices= gives them measured ones.
    cluster = local_cluster(
        len(available), memory=memory, flops_per_s=flops_per_s, names=available, calibrate=current_worker() is None
    )
    by_name = {canonical(d.name): d for d in cluster.devices}
    chosen: list[Device] = [by_name[canonical(n)] for n in names]
    index = [cluster.index(d.name) for d in chosen]
    bandwidth: Any = [[cluster.bandwidth(i, j) for j in index] for i in index]
    return Cluster(chosen, bandwidth=bandwidth, name=f"{len(chosen)} local devices")
