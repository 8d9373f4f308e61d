"""Describes the devices TensorFlow sees on this machine as a ``partitioner.Cluster``.

Where the numbers come from::

    field             logical GPUs                                logical CPUs
    ----------------  ------------------------------------------  ---------------------------------
    memory_bytes      the virtual device's memory_limit, else      ``memory``, else the machine's
                      ``memory``, else a ClusterError               RAM split evenly over the devices
    flops_per_s       ``flops_per_s``, else measured once with a float32 matmul on the first device
                      (:func:`measure_flops_per_s`) and used for all of them
    bandwidth         ``bandwidth``, else measured once between the first two devices (a copy,
                      :func:`profiles.calibrate.measure_bandwidth`); with ``calibrate=False`` or one
                      device, DEFAULT_BANDWIDTH (50 GB/s, about PCIe 4.0 x16), a documented constant
    action_overhead_s ``action_overhead_s``, else measured once on the first device (a ``_noinline``
                      call from a loop, alternating with the second device where there is one:
                      :func:`profiles.calibrate.measure_action_overhead_s`); 0 with ``calibrate=False``
    pool, pool_capacity  two or more logical devices of one processor (the host CPU's, or the GPUs split
                      from the one physical GPU) form one pool; its capacity ``pool_capacity``, else
                      measured once on all of them (:func:`profiles.calibrate.measure_pool_capacity`);
                      no pool with ``calibrate=False``, one device, or several physical GPUs

:func:`local_cluster_and_sources` also says where each figure came from (what ``partitioner calibrate``
writes into the cluster file). Calibration is the default where a figure is not given: without the fixed
cost of a pass, ``num_microbatches="auto"`` sees more micro-batches as always faster and picks the most;
measuring costs a fraction of a second, once per process.

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
from profiles.calibrate import (
    measure_action_overhead_s,
    measure_bandwidth,
    measure_model_pool_capacity,
    measure_pool_capacity,
)
from profiles.timing import sync_device

_MEASURED: dict[tuple[str, int, str], float] = {}  # (device, size, dtype) -> FLOP/s, once per process


def local_cluster(
    num_devices: int | None = None,
    *,
    memory: int | float | str | None = None,
    flops_per_s: float | str | None = None,
    bandwidth: Any = None,
    action_overhead_s: float | None = None,
    names: list[str] | None = None,
    calibrate: bool = True,
    pool_capacity: float | None = None,
) -> Cluster:
    """Returns a cluster of TensorFlow's local logical devices: the GPUs if any, else the CPUs.

    Args:
        num_devices: use the first ``num_devices`` devices; all of them when None.
        names: the local devices by name, where TensorFlow lists more than this process's (a worker of
            a cluster sees every worker's: ``runtime.devices.local_device_names`` keeps its own).
        memory: bytes per device (a number or a string like "16GiB"). Required for GPUs that
            have no virtual-device memory limit; overrides the RAM split on CPUs.
        flops_per_s: FLOP/s of every device; measured per device with a matmul when None.
        bandwidth: bytes/s of every link (anything ``partitioner.Cluster`` accepts); measured between
            the first two devices when None (``DEFAULT_BANDWIDTH``, 50 GB/s, without calibration).
        action_overhead_s: every device's fixed seconds per forward or backward of a stage
            (``partitioner.Device``); measured when None (0 without calibration).
        calibrate: measure the bandwidth, the fixed cost of a pass and a pool's capacity where they are
            not given (FLOP/s are measured either way).
        pool_capacity: how many devices' worth of work logical devices of one processor compute at once
            (``partitioner.Device``); measured when None (no pool without calibration).

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
    return local_cluster_and_sources(
        num_devices,
        memory=memory,
        flops_per_s=flops_per_s,
        bandwidth=bandwidth,
        action_overhead_s=action_overhead_s,
        names=names,
        calibrate=calibrate,
        pool_capacity=pool_capacity,
    )[0]


def local_cluster_and_sources(
    num_devices: int | None = None,
    *,
    memory: int | float | str | None = None,
    flops_per_s: float | str | None = None,
    bandwidth: Any = None,
    action_overhead_s: float | None = None,
    names: list[str] | None = None,
    calibrate: bool = True,
    pool_capacity: float | None = None,
) -> tuple[Cluster, dict[str, str]]:
    """``local_cluster``, and where each of its figures came from: {field: "measured: ..." or "given" or ...}.

    The fields are those of the cluster file: ``memory_bytes``, ``flops_per_s``, ``action_overhead_s``,
    ``bandwidth_bytes_per_s``, ``pool_capacity``. ``partitioner calibrate`` writes the mapping into the file as
    ``source``.

    Example:
        >>> cluster, sources = local_cluster_and_sources(2)                      # doctest: +SKIP
        >>> sources["action_overhead_s"]                                         # doctest: +SKIP
        'measured: median of a _noinline call from a loop on /device:CPU:0, alternating with /device:CPU:1'
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
    sources: dict[str, str] = {}
    if kind == "GPU":
        memories = _gpu_memories(names, memory)
        sources["memory_bytes"] = "the virtual devices' memory_limit, else given"
    else:
        per_device = memory if memory is not None else _ram_bytes() // len(names)
        memories = [per_device] * len(names)
        sources["memory_bytes"] = "given" if memory is not None else f"the machine's RAM split over {len(names)}"
    # Measured once, on the first device: logical devices share their physical device, and one
    # figure for all keeps plans from changing with timing noise between runs.
    first, peer = names[0], (names[1] if len(names) > 1 else None)
    if flops_per_s is None:
        flops_per_s = measure_flops_per_s(first)
        side = 1024 if kind == "CPU" else 4096
        sources["flops_per_s"] = f"measured: float32 matmul {side} x {side} on {first}, best of 3"
    else:
        sources["flops_per_s"] = "given"
    if action_overhead_s is None and calibrate:
        action_overhead_s = measure_action_overhead_s(first, peer=peer)
        sources["action_overhead_s"] = f"measured: median of a _noinline call from a loop on {first}" + (
            f", alternating with {peer}" if peer else ""
        )
    elif action_overhead_s is None:
        action_overhead_s = 0.0
        sources["action_overhead_s"] = "none: not calibrated"
    else:
        sources["action_overhead_s"] = "given"
    if bandwidth is None and calibrate and peer is not None:
        bandwidth = measure_bandwidth(first, peer)
        sources["bandwidth_bytes_per_s"] = f"measured: copy of 16 MiB from {first} to {peer}, less a tiny one's"
    elif bandwidth is None:
        bandwidth = DEFAULT_BANDWIDTH
        sources["bandwidth_bytes_per_s"] = "DEFAULT_BANDWIDTH, a documented constant (50 GB/s, about PCIe 4.0 x16)"
    else:
        sources["bandwidth_bytes_per_s"] = "given"
    pool = _pool_name(kind, names)
    if pool is None:
        sources["pool_capacity"] = "none: " + (
            "one device" if len(names) == 1 else "the GPUs are not split from one physical GPU"
        )
    elif pool_capacity is not None:
        sources["pool_capacity"] = "given"
    elif calibrate:
        pool_capacity = measure_pool_capacity(names)
        sources["pool_capacity"] = (
            f"measured: a chain of 1024-wide matmuls and its gradient on {first} alone, then on all "
            f"{len(names)} at once"
        )
    else:
        pool = None
        sources["pool_capacity"] = "none: not calibrated (each device computes as if it had its processor alone)"
    devices = [
        Device(
            name,
            memory=size,
            flops_per_s=flops_per_s,
            action_overhead_s=action_overhead_s,
            pool=pool,
            pool_capacity=pool_capacity if pool is not None and pool_capacity is not None else 1.0,
        )
        for name, size in zip(names, memories, strict=True)
    ]
    return Cluster(devices, bandwidth=bandwidth, name=f"local {len(devices)}x {kind}"), sources


def with_model_pool_capacities(
    cluster: Cluster,
    model: Any,
    samples: int,
    *,
    input_shapes: Any = None,
    sequence_length: int | None = None,
) -> Cluster:
    """``cluster`` with each pool's capacity measured with ``model``'s own forward and backward on ``samples``
    samples (:func:`profiles.calibrate.measure_model_pool_capacity`) in place of the matmul chain's, all else
    kept; the same cluster where it has no pool. What ``plan_and_wrap`` plans with where it times the model:
    the model's layers are timed as the whole model runs alone (``profiles.profile_model`` scales them to it),
    and the capacity says how much of that speed each of the pool's devices keeps when they compute at once.
    Where the model's passes cannot run on every device at once (memory), warns and keeps the cluster's.
    """
    import warnings

    capacities = {}
    members: dict[str, list[str]] = {}  # every pool of two devices or more, the chain's capacity full or not
    for device in cluster.devices:
        if device.pool is not None:
            members.setdefault(device.pool, []).append(device.name)
    for pool, names in members.items():
        if len(names) < 2:
            continue
        try:
            capacities[pool] = measure_model_pool_capacity(
                model, names, samples, input_shapes=input_shapes, sequence_length=sequence_length
            )
        except (tf.errors.OpError, MemoryError, ValueError, TypeError) as error:
            warnings.warn(
                f"Could not run '{getattr(model, 'name', 'the model')}' on the {len(names)} devices of {pool} at "
                f"once ({type(error).__name__}); planning with the pool's capacity measured by a matmul chain.",
                stacklevel=2,
            )
    return cluster.with_pool_capacities(capacities) if capacities else cluster


def _pool_name(kind: str, names: list[str]) -> str | None:
    """The processor the devices named share, or None: logical CPU devices are the host's; logical GPUs share
    one when TensorFlow sees one physical GPU (several physical GPUs split in several: which is whose is not
    told, so none)."""
    if len(names) < 2:
        return None
    if kind == "CPU":
        return "host CPU"
    return "GPU 0" if len(tf.config.list_physical_devices("GPU")) == 1 else None


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
