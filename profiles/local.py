"""Describes the devices TensorFlow sees on this machine as a ``partitioner.Cluster``.

Where the numbers come from::

    field             logical GPUs                                logical CPUs
    ----------------  ------------------------------------------  ---------------------------------
    memory_bytes      the virtual device's memory_limit, else      ``memory``, else the machine's
                      ``memory``, else a ClusterError               RAM split evenly over the devices
    flops_per_s       ``flops_per_s``, else measured once with a float32 matmul on the first device
                      (:func:`measure_flops_per_s`) and used for all of them
    bandwidth         ``bandwidth``, else DEFAULT_BANDWIDTH (50 GB/s, about PCIe 4.0 x16): a
                      documented constant, not measured; pass the real figure for NVLink or networks

Example:
    >>> from profiles.local import local_cluster                        # doctest: +SKIP
    >>> local_cluster(memory="8GiB").names                                  # doctest: +SKIP
    ['/device:CPU:0']
"""

from __future__ import annotations

import os
import time
from typing import Any

import tensorflow as tf

from partitioner.cluster import DEFAULT_BANDWIDTH, Cluster, Device
from partitioner.errors import ClusterError, InputError
from profiles.timing import sync_device

_MEASURED: dict[tuple[str, int, str], float] = {}  # (device, size, dtype) -> FLOP/s, once per process


def local_cluster(
    num_devices: int | None = None,
    *,
    memory: int | float | str | None = None,
    flops_per_s: float | str | None = None,
    bandwidth: Any = None,
    action_overhead_s: float = 0.0,
    names: list[str] | None = None,
) -> Cluster:
    """Returns a cluster of TensorFlow's local logical devices: the GPUs if any, else the CPUs.

    Args:
        num_devices: use the first ``num_devices`` devices; all of them when None.
        names: the local devices by name, where TensorFlow lists more than this process's (a worker of
            a cluster sees every worker's: ``runtime.devices.local_device_names`` keeps its own).
        memory: bytes per device (a number or a string like "16GiB"). Required for GPUs that
            have no virtual-device memory limit; overrides the RAM split on CPUs.
        flops_per_s: FLOP/s of every device; measured per device with a matmul when None.
        bandwidth: bytes/s of every link (anything ``partitioner.Cluster`` accepts); the
            documented constant ``DEFAULT_BANDWIDTH`` (50 GB/s) when None.
        action_overhead_s: every device's fixed seconds per forward or backward of a stage
            (``partitioner.Device``); 0, none, unless given.

    Returns:
        A ``partitioner.Cluster`` whose device names are TensorFlow's, e.g. '/device:GPU:0'.

    Raises:
        ClusterError: for a bad ``num_devices``, or a GPU whose memory is unknown.

    Example:
        >>> import tensorflow as tf                                              # doctest: +SKIP
        >>> gpu = tf.config.list_physical_devices("GPU")[0]                      # doctest: +SKIP
        >>> tf.config.set_logical_device_configuration(
        ...     gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * 2)  # doctest: +SKIP
        >>> [d.memory_bytes for d in local_cluster().devices]                   # doctest: +SKIP
        [1073741824, 1073741824]
    """
    gpus = tf.config.list_logical_devices("GPU")
    kind = "GPU" if gpus else "CPU"
    if names is None:
        names = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
    if num_devices is not None:
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ClusterError(f"num_devices must be an integer >= 1. Received: num_devices={num_devices!r}.")
        if num_devices > len(names):
            raise ClusterError(
                f"Asked for {num_devices} local devices but TensorFlow sees {len(names)} {kind} device(s): "
                f"{names}. Lower num_devices, or split a device into logical devices with "
                "tf.config.set_logical_device_configuration before TensorFlow initialises."
            )
        names = names[:num_devices]
    if kind == "GPU":
        memories = _gpu_memories(names, memory)
    else:
        per_device = memory if memory is not None else _ram_bytes() // len(names)
        memories = [per_device] * len(names)
    # Measured once, on the first device: logical devices share their physical device, and one
    # figure for all keeps plans from changing with timing noise between runs.
    speed = flops_per_s if flops_per_s is not None else measure_flops_per_s(names[0])
    devices = [
        Device(name, memory=size, flops_per_s=speed, action_overhead_s=action_overhead_s)
        for name, size in zip(names, memories, strict=True)
    ]
    return Cluster(
        devices,
        bandwidth=DEFAULT_BANDWIDTH if bandwidth is None else bandwidth,
        name=f"local {len(devices)}x {kind}",
    )


def measure_flops_per_s(
    device_name: str,
    *,
    size: int | None = None,
    dtype: str = "float32",
    min_seconds: float = 0.1,
) -> float:
    """Measures the sustained FLOP/s of square matmuls on one device; cached per process.

    Runs ``size x size`` matmuls (1024 on CPUs, 4096 on GPUs by default) until ``min_seconds``
    have passed, three times, and returns the best rate (2 * size**3 FLOPs per matmul).

    Args:
        device_name: a TensorFlow device name, e.g. "/GPU:0" or "/device:CPU:0".
        size: the matrix side; by default 1024 on CPUs and 4096 on accelerators.
        dtype: the matmul dtype, e.g. "float32" or "float16".
        min_seconds: the least time of each of the three timed rounds.

    Raises:
        InputError: for a non-positive size or duration.

    Example:
        >>> measure_flops_per_s("/CPU:0") > 1e9                                  # doctest: +SKIP
        True
    """
    kind = tf.DeviceSpec.from_string(device_name).device_type or "CPU"
    if size is None:
        size = 1024 if kind.upper() == "CPU" else 4096
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InputError(f"size must be a positive integer. Received: size={size!r}.")
    if not min_seconds > 0:
        raise InputError(f"min_seconds must be positive. Received: min_seconds={min_seconds!r}.")
    key = (device_name, size, dtype)
    if key in _MEASURED:
        return _MEASURED[key]
    flops = 2.0 * size**3
    with tf.device(device_name):
        a = tf.cast(tf.random.normal([size, size]), dtype)
        b = tf.cast(tf.random.normal([size, size]), dtype)
        matmul = tf.function(tf.matmul).get_concrete_function(a, b)
        per_sync = 1 if kind.upper() == "CPU" else 8  # accelerators queue work: sync less often
        for _ in range(2):
            matmul(a, b)
        sync_device(device_name)
        rates = []
        for _ in range(3):
            start, count = time.perf_counter(), 0
            while True:
                for _ in range(per_sync):
                    matmul(a, b)
                count += per_sync
                sync_device(device_name)
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    break
            rates.append(flops * count / elapsed)
    _MEASURED[key] = max(rates)
    return _MEASURED[key]


def _gpu_memories(names: list[str], memory: int | float | str | None) -> list[int | float | str]:
    """Memory of each logical GPU: its virtual-device memory_limit (MiB), else ``memory``."""
    limits: list[int | None] = []
    for gpu in tf.config.list_physical_devices("GPU"):
        configs = tf.config.get_logical_device_configuration(gpu)
        if not configs:
            limits.append(None)
        else:
            limits.extend(c.memory_limit for c in configs)
    logical = [d.name for d in tf.config.list_logical_devices("GPU")]
    by_name = dict(zip(logical, limits, strict=False))  # logical GPUs enumerate the physical ones' configs
    memories: list[int | float | str] = []
    for name in names:
        limit = by_name.get(name)
        if limit is not None:
            memories.append(int(limit) * 2**20)
        elif memory is not None:
            memories.append(memory)
        else:
            raise ClusterError(
                f"The memory of GPU '{name}' is unknown: it has no virtual-device memory limit. "
                "Pass memory='40GiB' (the bytes the model may use per device), or give it a limit with "
                "tf.config.set_logical_device_configuration(gpu, "
                "[tf.config.LogicalDeviceConfiguration(memory_limit=40960)]) before TensorFlow initialises."
            )
    return memories


def _ram_bytes() -> int:
    """The machine's physical memory, from sysconf."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError) as err:
        raise ClusterError(
            "Cannot read this machine's RAM size to split it over the CPU devices. "
            "Pass memory='8GiB' (the bytes each device may use)."
        ) from err
