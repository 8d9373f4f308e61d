"""Devices and clusters: memory, speed, and the bandwidth of every link, as data.

A cluster lists its devices in pipeline order: stage k of a plan runs on the k-th device that
holds any node, so put devices that are close (same node, NVLink) next to each other.

Example:
    >>> import partitioner as pt
    >>> c = pt.Cluster.uniform(4, memory="16GiB", flops_per_s=100e12, bandwidth="50GB/s")
    >>> c.devices[0].name, c.devices[0].memory_bytes
    ('/GPU:0', 17179869184)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from partitioner.errors import ClusterError, InfeasiblePlanError, InputError
from partitioner.units import format_bytes, parse_bytes, parse_rate

CLUSTER_SCHEMA_VERSION = 1
DEFAULT_FLOPS_PER_S = 100e12  # a mid-range accelerator
DEFAULT_BANDWIDTH = 50e9  # bytes/s, about PCIe 4.0 x16 in both directions
# The share of each device's memory plan_and_wrap and the CLI leave free for what the planner does not
# price (workspace, allocator rounding, the batch): docs/cost-model.md, "Memory headroom".
DEFAULT_MEMORY_HEADROOM = 0.1


def canonical_device_name(name: str) -> str:
    """TensorFlow's full spelling of a device name, the one the runtime uses: '/GPU:1', 'gpu:1' and
    '/device:GPU:1' are one device, '/device:GPU:1'. The one-process job TensorFlow prefixes to
    the names of what ran ('/job:localhost/replica:0/task:0') is dropped; another job or task
    ('/job:worker/task:1/device:GPU:0', a device of another worker) is kept. A name that is not a
    device spec (a planning label such as 'fast') is kept as it is.

    Example:
        >>> canonical_device_name("/GPU:1"), canonical_device_name("/job:worker/task:1/device:cpu:0")
        ('/device:GPU:1', '/job:worker/task:1/device:CPU:0')
        >>> canonical_device_name("/job:localhost/replica:0/task:0/device:CPU:2"), canonical_device_name("fast")
        ('/device:CPU:2', 'fast')
    """
    prefix, _, short = name.rpartition("device:")
    short = short.lstrip("/")
    kind, colon, number = short.partition(":")
    if not colon or not number.isdigit() or not kind.replace("_", "").isalpha():
        return name
    prefix = "" if prefix.startswith("/job:localhost") else prefix.rstrip("/")
    return f"{prefix}/device:{kind.upper()}:{number}"


@dataclass(frozen=True, init=False)
class Device:
    """One device: its TensorFlow name, memory and sustained FLOP/s.

    ``action_overhead_s`` is the fixed time each forward or backward of one micro-batch on a stage
    costs beyond its FLOPs (docs/cost-model.md); 0 unless given or read from a hardware profile.

    A device from a hardware profile also keeps its peak FLOP/s per dtype and the share of peak it
    reaches (``efficiency``): the cost model asks :meth:`flops_per_s_for` with the model's compute
    dtype, so one cluster serves float32 and bfloat16 models alike. A device given one
    ``flops_per_s`` runs every model at that rate.

    Example:
        >>> Device(name="/GPU:0", memory="80GiB", flops_per_s=989e12).memory_bytes
        85899345920
        >>> peaks = {"float32": 67e12, "bfloat16": 1e15}
        >>> Device("/GPU:0", memory="80GiB", peak_flops_per_s=peaks, efficiency=0.4).flops_per_s_for("bfloat16")
        400000000000000.0
    """

    name: str  # TensorFlow device name, e.g. "/GPU:0"
    memory_bytes: int  # capacity available to the model
    flops_per_s: float  # sustained FLOP/s for a model that does not say its compute dtype
    hardware: str | None = None  # the hardware profile it came from, e.g. "H100-SXM-80GB"
    peak_flops_per_s: tuple[tuple[str, float], ...] = ()  # (dtype, peak FLOP/s), sorted; () for one rate
    efficiency: float = 1.0  # share of the peak reached in training, in (0, 1]
    action_overhead_s: float = 0.0  # fixed seconds per forward or backward of a stage (per micro-batch)
    # devices of one pool share one processor (logical devices of one CPU or one GPU): together they compute at
    # most pool_capacity devices' worth at once (the simulator shares it among those busy); None: its own processor
    pool: str | None = None
    pool_capacity: float = 1.0

    def __init__(
        self,
        name: str,
        memory: int | float | str | None = None,
        flops_per_s: float | str | None = None,
        hardware: str | None = None,
        *,
        memory_bytes: int | None = None,
        peak_flops_per_s: Mapping[str, float] | None = None,
        efficiency: float = 1.0,
        dtype: str = "float32",  # with peaks and no flops_per_s: the dtype whose speed flops_per_s is
        action_overhead_s: float = 0.0,
        pool: str | None = None,
        pool_capacity: float = 1.0,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ClusterError(f"A device needs a non-empty name such as '/GPU:0'. Received: {name!r}.")
        if memory is None and memory_bytes is None:
            raise ClusterError(f"Device '{name}' needs a memory size, e.g. memory='16GiB'.")
        if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
            raise ClusterError(
                f"Device '{name}': efficiency is the share of peak FLOP/s reached in training, in (0, 1]. "
                f"Received: {efficiency!r}."
            )
        if (
            isinstance(action_overhead_s, bool)
            or not isinstance(action_overhead_s, (int, float))
            or not 0 <= action_overhead_s < math.inf
        ):
            raise ClusterError(
                f"Device '{name}': action_overhead_s is the fixed seconds a stage's forward or backward of one "
                f"micro-batch costs beyond its FLOPs, a finite number >= 0. Received: {action_overhead_s!r}."
            )
        if pool is not None and (not isinstance(pool, str) or not pool.strip()):
            raise ClusterError(
                f"Device '{name}': pool names the processor it shares with other devices, a non-empty string such "
                f"as 'host CPU', or None for a device of its own. Received: {pool!r}."
            )
        if (
            isinstance(pool_capacity, bool)
            or not isinstance(pool_capacity, (int, float))
            or not 0 < pool_capacity < math.inf
        ):
            raise ClusterError(
                f"Device '{name}': pool_capacity is how many devices' worth of work its pool computes at once (1.57: "
                f"two busy devices each run at 0.785 of their speed), a finite number > 0. Received: {pool_capacity!r}."
            )
        if pool is None and pool_capacity != 1.0:
            raise ClusterError(
                f"Device '{name}': pool_capacity={pool_capacity:g} without a pool: name the processor the device "
                "shares, e.g. pool='host CPU', or leave pool_capacity out for a device of its own."
            )
        peaks = tuple(
            sorted(
                (str(key), parse_rate(value, name=f"peak_flops_per_s['{key}'] of device '{name}'", unit="FLOP/s"))
                for key, value in (peak_flops_per_s or {}).items()
            )
        )
        size = memory if memory is not None else memory_bytes
        assert size is not None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "memory_bytes", parse_bytes(size, name=f"memory of device '{name}'"))
        object.__setattr__(self, "hardware", hardware)
        object.__setattr__(self, "peak_flops_per_s", peaks)
        object.__setattr__(self, "efficiency", float(efficiency))
        object.__setattr__(self, "action_overhead_s", float(action_overhead_s))
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "pool_capacity", float(pool_capacity))
        if flops_per_s is None and peaks:
            try:
                flops_per_s = self.flops_per_s_for(dtype)
            except ClusterError:
                raise ClusterError(
                    f"Device '{name}' has no {dtype} peak for its default speed (flops_per_s); its peaks are for "
                    f"{[key for key, _ in peaks]}. Pass dtype= one of them, add a '{dtype}' peak, or pass flops_per_s."
                ) from None
        elif flops_per_s is None:
            flops_per_s = DEFAULT_FLOPS_PER_S
        object.__setattr__(
            self,
            "flops_per_s",
            parse_rate(flops_per_s, name=f"flops_per_s of device '{name}'", unit="FLOP/s"),
        )

    def flops_per_s_for(self, dtype: str | None) -> float:
        """Sustained FLOP/s for a model computing in ``dtype``: its peak times ``efficiency``.

        A float32 model uses the ``tf32`` peak where the device has one (TensorFlow runs float32
        matmuls and convolutions on TF32 tensor cores by default on Ampere and later GPUs), else the
        ``float32`` peak. A device without per-dtype peaks, or ``dtype=None``, gives ``flops_per_s``.

        Raises:
            ClusterError: when the device has peaks but none for ``dtype``; the message lists them.

        Example:
            >>> a100 = Device("/GPU:0", memory="80GiB", peak_flops_per_s={"float32": 19.5e12, "tf32": 156e12})
            >>> a100.flops_per_s_for("float32")
            156000000000000.0
        """
        if dtype is None or not self.peak_flops_per_s:
            return self.flops_per_s
        peaks = dict(self.peak_flops_per_s)
        key = "tf32" if dtype == "float32" and "tf32" in peaks else dtype
        if key not in peaks:
            what = f"'{self.name}'" + (f" ({self.hardware})" if self.hardware else "")
            raise ClusterError(
                f"Device {what} has no peak FLOP/s for the compute dtype '{dtype}'; it has {sorted(peaks)}. "
                "Profile the model under a dtype policy the device runs (e.g. "
                "keras.mixed_precision.set_global_policy('mixed_float16')), or give the device one flops_per_s."
            )
        return peaks[key] * self.efficiency

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-ready form of the device."""
        data: dict[str, Any] = {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "flops_per_s": self.flops_per_s,
        }
        if self.hardware:
            data["hardware"] = self.hardware
        if self.peak_flops_per_s:
            data["peak_flops_per_s"] = dict(self.peak_flops_per_s)
            data["efficiency"] = self.efficiency
        if self.action_overhead_s:
            data["action_overhead_s"] = self.action_overhead_s
        if self.pool is not None:
            data["pool"] = self.pool
            data["pool_capacity"] = self.pool_capacity
        return data


@dataclass(frozen=True, init=False)
class Cluster:
    """Devices in pipeline order and the bandwidth of every link between them.

    Args:
        devices: the devices, in the order pipeline stages should use them.
        bandwidth: bytes/s of every link (one number or a string like "50GB/s"), a K x K matrix
            (row = sender, column = receiver; the diagonal is ignored), or a mapping
            {(sender name, receiver name): bytes/s} that must cover every ordered pair.
        name: a label for tables and JSON.

    Raises:
        ClusterError: for an empty cluster, duplicate device names, or a malformed bandwidth.
    """

    devices: tuple[Device, ...]
    bandwidth_bytes_per_s: tuple[tuple[float, ...], ...]  # [sender][receiver]; inf on the diagonal
    name: str = "cluster"
    _index: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)
    memory_headroom: float = field(default=0.0, compare=False)  # set by with_headroom: the share left free
    # set by with_reserved: (device name, bytes) held outside the plan on that device, and what holds them
    memory_reserved: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    reserved_for: str = field(default="", compare=False)

    def __init__(
        self,
        devices: Sequence[Device],
        bandwidth: Any = DEFAULT_BANDWIDTH,
        name: str = "cluster",
    ) -> None:
        devices = tuple(devices)
        if not devices:
            raise ClusterError("A cluster needs at least one device. Received: devices=[].")
        for device in devices:
            if not isinstance(device, Device):
                raise ClusterError(f"Cluster devices must be partitioner.Device objects. Received: {device!r}.")
        keys = [canonical_device_name(d.name) for d in devices]
        duplicates = sorted({d.name for d, key in zip(devices, keys) if keys.count(key) > 1})
        if duplicates:
            raise ClusterError(
                f"Device names must be unique. Received duplicates: {duplicates} (two spellings of one "
                "TensorFlow device, such as '/GPU:0' and '/device:GPU:0', are one name)."
            )
        capacity: dict[str, float] = {}
        for device in devices:
            if (
                device.pool is not None
                and capacity.setdefault(device.pool, device.pool_capacity) != device.pool_capacity
            ):
                raise ClusterError(
                    f"The devices of pool '{device.pool}' give two capacities ({capacity[device.pool]:g} and "
                    f"{device.pool_capacity:g} on '{device.name}'); a pool is one processor: give its devices one "
                    "pool_capacity."
                )
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_index", {key: i for i, key in enumerate(keys)})
        object.__setattr__(self, "bandwidth_bytes_per_s", self._bandwidth_matrix(bandwidth))

    def _bandwidth_matrix(self, bandwidth: Any) -> tuple[tuple[float, ...], ...]:
        k = len(self.devices)
        names = self.names
        if isinstance(bandwidth, (int, float, str)) and not isinstance(bandwidth, bool):
            rate = parse_rate(bandwidth, name="bandwidth")
            rows = [[rate] * k for _ in range(k)]
        elif isinstance(bandwidth, Mapping):
            rows = [[math.inf] * k for _ in range(k)]
            for i, a in enumerate(names):
                for j, b in enumerate(names):
                    if i == j:
                        continue
                    if (a, b) not in bandwidth:
                        raise ClusterError(
                            f"The bandwidth mapping has no entry for link ('{a}', '{b}'); it must cover "
                            "every ordered pair of devices, or pass one number for all links."
                        )
                    rows[i][j] = parse_rate(bandwidth[(a, b)], name=f"bandwidth {a}->{b}")
        elif isinstance(bandwidth, Iterable):
            rows = [list(row) for row in bandwidth]
            if len(rows) != k or any(len(row) != k for row in rows):
                raise ClusterError(
                    f"The bandwidth matrix must be {k} x {k} for {k} devices. "
                    f"Received: {len(rows)} rows of lengths {[len(r) for r in rows]}."
                )
            rows = [
                [math.inf if i == j else parse_rate(rows[i][j], name=f"bandwidth[{i}][{j}]") for j in range(k)]
                for i in range(k)
            ]
        else:
            raise ClusterError(f"bandwidth must be a number, a K x K matrix or a mapping. Received: {bandwidth!r}.")
        for i in range(k):
            rows[i][i] = math.inf
        return tuple(tuple(float(x) for x in row) for row in rows)

    @property
    def names(self) -> list[str]:
        """Device names in pipeline order."""
        return [d.name for d in self.devices]

    @property
    def num_devices(self) -> int:
        """How many devices the cluster has."""
        return len(self.devices)

    def index(self, name: str) -> int:
        """Position of device ``name`` in pipeline order; any spelling of the device's TensorFlow name
        finds it (``canonical_device_name``): '/GPU:1' and '/device:GPU:1' are one device.

        Raises:
            ClusterError: when no device has that name; the message lists those that exist.
        """
        try:
            return self._index[canonical_device_name(name)]
        except KeyError:
            raise ClusterError(f"Unknown device '{name}'. The cluster has: {self.names}.") from None

    def bandwidth(self, sender: int, receiver: int) -> float:
        """Bytes/s from device index ``sender`` to device index ``receiver`` (inf for itself)."""
        return self.bandwidth_bytes_per_s[sender][receiver]

    def pools(self, *, every: bool = False) -> dict[str, tuple[float, tuple[int, ...]]]:
        """{pool: (capacity, indices of its devices)} for each pool whose devices cannot all compute at full speed
        at once (capacity below their count): the pools the simulator shares. One device of a pool of
        capacity below 1 (a replica's share of a processor, ``partitioner.search.replicas``) runs slower alone.
        ``every``: every pool, whatever its capacity (work beside the devices' passes, a pooled CPU stage's
        gradient sums, shares it too).

        Example:
            >>> cpu = [Device(f"/CPU:{i}", memory="1GiB", pool="host CPU", pool_capacity=1.5) for i in range(2)]
            >>> Cluster(cpu).pools(), Cluster(cpu[:1]).pools(), Cluster(cpu[:1]).pools(every=True)
            ({'host CPU': (1.5, (0, 1))}, {}, {'host CPU': (1.5, (0,))})
        """
        members: dict[str, list[int]] = {}
        for i, device in enumerate(self.devices):
            if device.pool is not None:
                members.setdefault(device.pool, []).append(i)
        return {
            pool: (self.devices[idx[0]].pool_capacity, tuple(idx))
            for pool, idx in members.items()
            if every or self.devices[idx[0]].pool_capacity < len(idx)
        }

    def pooled_cpus(self) -> tuple[int, ...]:
        """Indices of the logical CPU devices of a pool (``Device.pool``, whatever its capacity): their ops run on
        the host's threads, so one device's independent work runs at once and shares the pool as its own passes
        do (the simulator runs a stage's gradient sums beside its next pass there; docs/cost-model.md, "the
        gradient sums"). A GPU runs a device's kernels on one stream, one after another; a device without a pool
        has no capacity to share.

        Example:
            >>> cpu = [Device(f"/CPU:{i}", memory="1GiB", pool="host CPU", pool_capacity=2) for i in range(2)]
            >>> Cluster(cpu).pooled_cpus(), Cluster([Device("/CPU:0", memory="1GiB")]).pooled_cpus()
            ((0, 1), ())
        """
        pooled = sorted(i for _, members in self.pools(every=True).values() for i in members)
        return tuple(i for i in pooled if "/device:CPU:" in canonical_device_name(self.devices[i].name))

    @property
    def total_memory_bytes(self) -> int:
        """Sum of the devices' memory."""
        return sum(d.memory_bytes for d in self.devices)

    def take(self, num_devices: int) -> Cluster:
        """The first ``num_devices`` devices of this cluster, with their links.

        Example:
            >>> Cluster.from_json("8xH100-nvlink").take(2).names
            ['/GPU:0', '/GPU:1']
        """
        if (
            isinstance(num_devices, bool)
            or not isinstance(num_devices, int)
            or not 1 <= num_devices <= self.num_devices
        ):
            raise ClusterError(f"num_devices must be between 1 and {self.num_devices}. Received: {num_devices!r}.")
        rows = [list(row[:num_devices]) for row in self.bandwidth_bytes_per_s[:num_devices]]
        return Cluster(self.devices[:num_devices], bandwidth=rows, name=f"{self.name} (first {num_devices})")

    def with_headroom(self, fraction: float) -> Cluster:
        """This cluster with each device's memory cut by ``fraction``: what the planner may fill.

        The memory the planner charges (weights, gradients, optimizer slots, the activations that
        gradients read) leaves out the framework's workspace, the allocator's rounding, the batch
        and the backward's temporaries: for whole models on one CPU device, TensorFlow's peak was
        0.93-0.99x the planner's figure in three checks and 1.05x in the fourth (ResNet50 at batch
        16; benchmarks/memory_model). A headroom of 0.1 (``plan_and_wrap``'s and the CLI's default,
        DEFAULT_MEMORY_HEADROOM) plans into 90% of every device; 0 returns this cluster.

        Raises:
            ClusterError: unless 0 <= fraction < 1.

        Example:
            >>> Cluster.uniform(2, memory="10GiB").with_headroom(0.1).devices[0].memory_bytes / 2**30
            9.0
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
            raise ClusterError(
                f"memory headroom is the share of each device's memory the plan leaves free, in [0, 1), "
                f"e.g. 0.1. Received: {fraction!r}."
            )
        if fraction == 0:
            return self
        cut = self._with_memory([int(d.memory_bytes * (1.0 - fraction)) for d in self.devices])
        object.__setattr__(cut, "memory_headroom", 1.0 - (1.0 - self.memory_headroom) * (1.0 - fraction))
        return cut

    def with_reserved(self, reserved: Mapping[str, int], reason: str) -> Cluster:
        """This cluster with each device named in ``reserved`` holding that many bytes less (at least 1 byte
        is left, so a plan that needs it is refused by the planner with the figures): memory that something
        outside the plan holds there, ``reason`` saying what (for errors, :meth:`headroom_note`).

        Example:
            >>> c = Cluster.uniform(2, memory="10GiB").with_reserved({"/GPU:0": 2**30}, "the model's weights")
            >>> [d.memory_bytes / 2**30 for d in c.devices]
            [9.0, 10.0]
        """
        held = [0] * self.num_devices
        for name, num_bytes in reserved.items():
            held[self.index(name)] += int(num_bytes)
        if not any(held):
            return self
        cut = self._with_memory([max(d.memory_bytes - h, 1) for d, h in zip(self.devices, held, strict=True)])
        object.__setattr__(cut, "memory_headroom", self.memory_headroom)
        kept = dict(self.memory_reserved)
        for d, h in zip(self.devices, held, strict=True):
            if h:
                kept[d.name] = kept.get(d.name, 0) + h
        object.__setattr__(cut, "memory_reserved", tuple(kept.items()))
        object.__setattr__(cut, "reserved_for", reason)
        return cut

    def with_pool_capacities(self, capacities: Mapping[str, float]) -> Cluster:
        """This cluster with the capacity of each pool named in ``capacities`` replaced, all else kept.

        Example:
            >>> cpu = [Device(f"/CPU:{i}", memory="1GiB", pool="host CPU", pool_capacity=1.5) for i in range(2)]
            >>> Cluster(cpu).with_pool_capacities({"host CPU": 0.75}).pools()
            {'host CPU': (0.75, (0, 1))}
        """
        changed = self._with_memory(
            [d.memory_bytes for d in self.devices],
            [capacities.get(d.pool, d.pool_capacity) if d.pool is not None else 1.0 for d in self.devices],
        )
        for kept in ("memory_headroom", "memory_reserved", "reserved_for"):
            object.__setattr__(changed, kept, getattr(self, kept))
        return changed

    def _with_memory(self, memory_bytes: Sequence[int], pool_capacity: Sequence[float] | None = None) -> Cluster:
        """This cluster with the devices' memory (and pools' capacities) replaced, all else kept (names, speeds,
        links)."""
        capacity = pool_capacity if pool_capacity is not None else [d.pool_capacity for d in self.devices]
        devices = [
            Device(
                d.name,
                memory_bytes=m,
                flops_per_s=d.flops_per_s,
                hardware=d.hardware,
                peak_flops_per_s=dict(d.peak_flops_per_s),
                efficiency=d.efficiency,
                action_overhead_s=d.action_overhead_s,
                pool=d.pool,
                pool_capacity=c,
            )
            for d, m, c in zip(self.devices, memory_bytes, capacity, strict=True)
        ]
        return Cluster(devices, bandwidth=[list(row) for row in self.bandwidth_bytes_per_s], name=self.name)

    def headroom_note(self, error: InfeasiblePlanError) -> InfeasiblePlanError:
        """``error`` with a sentence saying the capacities in it leave this cluster's headroom free
        (unchanged for a cluster without headroom)."""
        notes = []
        if self.memory_reserved:
            held = ", ".join(f"{format_bytes(n)} on {name}" for name, n in self.memory_reserved)
            notes.append(f"Those capacities leave out {held}: {self.reserved_for}.")
        if self.memory_headroom:
            notes.append(
                f"Those capacities leave {self.memory_headroom:.0%} of each device's memory free (memory "
                f"headroom {self.memory_headroom:g}, for what the planner does not price); a smaller headroom "
                "gives the plan more."
            )
        return type(error)(" ".join([str(error), *notes])) if notes else error

    @classmethod
    def uniform(
        cls,
        num_devices: int,
        *,
        memory: int | float | str,
        flops_per_s: float | str = DEFAULT_FLOPS_PER_S,
        bandwidth: Any = DEFAULT_BANDWIDTH,
        prefix: str = "/GPU:",
        name: str | None = None,
        action_overhead_s: float = 0.0,
    ) -> Cluster:
        """A cluster of ``num_devices`` identical devices named ``/GPU:0`` ... with one link speed.

        Example:
            >>> Cluster.uniform(2, memory="16GiB").names
            ['/GPU:0', '/GPU:1']
        """
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ClusterError(f"num_devices must be an integer >= 1. Received: {num_devices!r}.")
        devices = [
            Device(f"{prefix}{i}", memory=memory, flops_per_s=flops_per_s, action_overhead_s=action_overhead_s)
            for i in range(num_devices)
        ]
        return cls(devices, bandwidth=bandwidth, name=name or f"{num_devices}x uniform")

    def to_dict(self) -> dict[str, Any]:
        """Returns the explicit JSON-ready form (every device, the full bandwidth matrix)."""
        k = self.num_devices
        matrix = [[0.0 if i == j else self.bandwidth(i, j) for j in range(k)] for i in range(k)]
        flat = {matrix[i][j] for i in range(k) for j in range(k) if i != j}
        return {
            "schema_version": CLUSTER_SCHEMA_VERSION,
            "kind": "cluster",
            "name": self.name,
            "devices": [d.to_dict() for d in self.devices],
            "bandwidth_bytes_per_s": flat.pop() if len(flat) == 1 else matrix,
        }

    def to_json(self) -> str:
        """Returns the cluster as JSON text that :meth:`from_json` reads back."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "cluster") -> Cluster:
        """Builds a cluster from its JSON form (explicit devices, or a bundled device profile).

        Two forms are read. Explicit: ``devices`` (name, memory_bytes, flops_per_s, and optionally
        peak_flops_per_s and efficiency, action_overhead_s, pool and pool_capacity) and
        ``bandwidth_bytes_per_s`` (a number or a matrix). From a
        profile: ``device_profile`` (a file under partitioner/hardware/devices), ``num_devices``,
        optionally ``dtype`` (the compute dtype assumed for a graph that does not say its own; default
        float32) and ``efficiency`` (overrides the profile's share of peak), and either
        ``bandwidth_bytes_per_s`` or ``topology`` with ``devices_per_node``,
        ``intra_node_bandwidth_bytes_per_s`` and ``inter_node_bandwidth_bytes_per_s``. Each device
        keeps the profile's peaks: the cost model picks the peak for the model's compute dtype.
        Mixed devices: ``groups``, a list of ``{device_profile, num_devices, bandwidth_bytes_per_s}``
        (each optionally with its own ``efficiency``), listed in the cluster's order, with
        ``inter_group_bandwidth_bytes_per_s`` for any two devices of different groups; ``dtype`` and
        ``device_prefix`` apply to all (devices are numbered across the groups: /GPU:0, /GPU:1, ...).

        Example:
            >>> t4 = {"device_profile": "T4-16GB", "num_devices": 2, "bandwidth_bytes_per_s": 15.75e9}
            >>> a100 = {"device_profile": "A100-SXM-80GB", "num_devices": 2, "bandwidth_bytes_per_s": 3e11}
            >>> mixed = {"schema_version": 1, "kind": "cluster", "dtype": "float16",
            ...          "inter_group_bandwidth_bytes_per_s": 12.5e9, "groups": [t4, a100]}
            >>> [d.hardware for d in Cluster.from_dict(mixed).devices]
            ['T4-16GB', 'T4-16GB', 'A100-SXM-80GB', 'A100-SXM-80GB']
        """
        if not isinstance(data, dict) or data.get("kind") != "cluster":
            raise ClusterError(f"{source} is not a cluster description (expected kind='cluster').")
        version = data.get("schema_version")
        if not isinstance(version, int) or version < 1:
            raise ClusterError(f"{source} has no valid schema_version (got {version!r}); the file is corrupt.")
        if version > CLUSTER_SCHEMA_VERSION:
            raise ClusterError(
                f"{source} has schema_version {version}; this version reads up to {CLUSTER_SCHEMA_VERSION}. "
                "Upgrade keras-partitioner."
            )
        try:
            name = str(data.get("name", "cluster"))
            bandwidth: Any
            if "groups" in data:
                devices, bandwidth = _group_devices(data, source)
            elif "devices" in data:
                devices = [
                    Device(
                        d["name"],
                        memory_bytes=d["memory_bytes"],
                        flops_per_s=d["flops_per_s"],
                        hardware=d.get("hardware"),
                        peak_flops_per_s=d.get("peak_flops_per_s"),
                        efficiency=d.get("efficiency", 1.0),
                        action_overhead_s=d.get("action_overhead_s", 0.0),
                        pool=d.get("pool"),
                        pool_capacity=d.get("pool_capacity", 1.0),
                    )
                    for d in data["devices"]
                ]
            else:
                devices = _profile_devices(
                    data, data["device_profile"], data["num_devices"], data.get("efficiency"), 0, source
                )
            if "groups" in data:
                pass  # _group_devices gave the links
            elif "topology" in data:
                topo = data["topology"]
                per_node = _positive_int(topo["devices_per_node"], "devices_per_node", source)
                intra = parse_rate(topo["intra_node_bandwidth_bytes_per_s"], name="intra-node bandwidth")
                inter = parse_rate(topo["inter_node_bandwidth_bytes_per_s"], name="inter-node bandwidth")
                k = len(devices)
                bandwidth = [[intra if i // per_node == j // per_node else inter for j in range(k)] for i in range(k)]
            else:
                bandwidth = data["bandwidth_bytes_per_s"]
                if isinstance(bandwidth, list):
                    bandwidth = [[x if x else math.inf for x in row] for row in bandwidth]
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, InputError):
                raise
            raise ClusterError(f"{source} is corrupt: missing or malformed field {err}.") from err
        return cls(devices, bandwidth=bandwidth, name=name)

    @classmethod
    def from_json(cls, source: str | Path) -> Cluster:
        """Reads a cluster from a JSON file path, JSON text, or the name of a bundled cluster.

        Example:
            >>> Cluster.from_json("8xH100-nvlink").num_devices
            8
        """
        text = str(source)
        if text.lstrip().startswith("{"):
            label = "cluster JSON"
        else:
            path = Path(text)
            if not path.exists():
                bundled = _hardware_dir() / f"{text}.json"
                if not bundled.exists():
                    raise ClusterError(
                        f"No cluster file '{text}'. Pass a path to a cluster JSON or one of the bundled "
                        f"clusters: {bundled_clusters()}."
                    )
                path = bundled
            label = f"'{path}'"
            text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ClusterError(f"{label} is not valid JSON ({err.msg} at line {err.lineno}).") from err
        return cls.from_dict(data, source=label)


def reorder(cluster: Cluster, order: Sequence[int] | Sequence[str]) -> Cluster:
    """The same devices and links, listed in ``order`` (device indices, or names).

    Raises:
        ClusterError: unless ``order`` names every device of the cluster exactly once.

    Example:
        >>> reorder(Cluster.uniform(3, memory="1GiB"), [2, 0, 1]).names
        ['/GPU:2', '/GPU:0', '/GPU:1']
    """
    index = [cluster.index(k) if isinstance(k, str) else k for k in order]
    if sorted(index) != list(range(cluster.num_devices)):
        raise ClusterError(
            f"A device order must list each of the cluster's {cluster.num_devices} devices once. "
            f"Received: {list(order)}; the cluster has {cluster.names}."
        )
    if index == list(range(cluster.num_devices)):
        return cluster
    rows = [[cluster.bandwidth(a, b) for b in index] for a in index]
    return Cluster([cluster.devices[k] for k in index], bandwidth=rows, name=cluster.name)


def subset(cluster: Cluster, names: Sequence[str], name: str | None = None) -> Cluster:
    """The devices of ``cluster`` named in ``names``, in that order, with their links (one replica's devices).

    Example:
        >>> subset(Cluster.uniform(4, memory="1GiB"), ["/GPU:2", "/GPU:3"]).names
        ['/GPU:2', '/GPU:3']
    """
    index = [cluster.index(k) for k in names]
    rows = [[cluster.bandwidth(a, b) for b in index] for a in index]
    return Cluster([cluster.devices[k] for k in index], bandwidth=rows, name=name or cluster.name)


def same_devices(cluster: Cluster, names: Sequence[str]) -> Cluster:
    """``cluster`` listed in the order of ``names`` (a plan's ``devices``) when it has exactly those devices.

    What the validator and the simulator use, so that a plan made in a searched order is checked
    against the cluster the user has. Returns ``cluster`` itself when the devices differ (the caller
    reports that).
    """
    if sorted(names) != sorted(cluster.names) or len(set(names)) != len(names):
        return cluster
    return reorder(cluster, list(names))


def _profile_devices(
    data: Mapping[str, Any], profile_name: Any, num_devices: Any, efficiency: Any, first: int, source: str
) -> list[Device]:
    """``num_devices`` devices of the bundled profile ``profile_name``, numbered from ``first``, with the
    cluster's ``dtype`` and ``device_prefix`` and ``efficiency`` (None: the profile's own)."""
    profile = load_device_profile(profile_name)
    dtype = data.get("dtype", "float32")
    peaks = profile["peak_flops_per_s"]
    if dtype not in peaks:
        raise ClusterError(
            f"{source}: device profile '{profile['name']}' has no peak for dtype '{dtype}'. "
            f"It has: {sorted(peaks)}. Set the cluster's 'dtype' to one every device profile lists."
        )
    if efficiency is None:
        efficiency = profile["efficiency"]  # the cluster's own, else the profile's
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ClusterError(
            f"{source}: efficiency is the share of peak FLOP/s reached in training, in (0, 1]. "
            f"Received: {efficiency!r}."
        )
    prefix = data.get("device_prefix", "/GPU:")
    return [
        Device(
            f"{prefix}{i}",
            memory_bytes=profile["memory_bytes"],
            hardware=profile["name"],
            peak_flops_per_s=peaks,
            efficiency=efficiency,
            dtype=dtype,
            action_overhead_s=profile.get("action_overhead_s", 0.0),
        )
        for i in range(first, first + _positive_int(num_devices, "num_devices", source))
    ]


def _group_devices(data: Mapping[str, Any], source: str) -> tuple[list[Device], list[list[float]]]:
    """The devices and bandwidth matrix of a cluster made of ``groups`` of one device profile each."""
    clashing = sorted(key for key in ("devices", "device_profile", "num_devices", "topology") if key in data)
    if clashing:
        raise ClusterError(
            f"{source} has 'groups' and {clashing}; a cluster lists its devices one way. "
            "Move each profile and count into a group, or drop 'groups'."
        )
    groups = data["groups"]
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise ClusterError(
            f"{source}: 'groups' must be a non-empty list of objects "
            "{'device_profile', 'num_devices', 'bandwidth_bytes_per_s'}. Received: "
            f"{groups!r}."
        )
    if "inter_group_bandwidth_bytes_per_s" not in data:
        raise ClusterError(
            f"{source} has groups but no 'inter_group_bandwidth_bytes_per_s' (bytes/s between devices of "
            "different groups). Add it, e.g. 12.5e9 for 100 Gb/s Ethernet."
        )
    inter = parse_rate(data["inter_group_bandwidth_bytes_per_s"], name=f"{source}: inter-group bandwidth")
    devices: list[Device] = []
    group_of: list[int] = []
    inside: list[float] = []
    for g, group in enumerate(groups):
        missing = [key for key in ("device_profile", "num_devices", "bandwidth_bytes_per_s") if key not in group]
        if missing:
            raise ClusterError(
                f"{source}: group {g} has no {missing}; each group needs 'device_profile', 'num_devices' "
                "and 'bandwidth_bytes_per_s' (between two of its devices)."
            )
        members = _profile_devices(
            data, group["device_profile"], group["num_devices"], group.get("efficiency"), len(devices), source
        )
        devices += members
        group_of += [g] * len(members)
        inside.append(parse_rate(group["bandwidth_bytes_per_s"], name=f"{source}: bandwidth of group {g}"))
    k = len(devices)
    matrix = [[inside[group_of[i]] if group_of[i] == group_of[j] else inter for j in range(k)] for i in range(k)]
    return devices, matrix


def _positive_int(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{source}: {name} must be an integer >= 1. Received: {value!r}.")
    return value


def _hardware_dir() -> Path:
    return Path(str(resources.files("partitioner") / "hardware"))


def bundled_clusters() -> list[str]:
    """Names of the cluster files shipped in partitioner/hardware."""
    return sorted(p.stem for p in _hardware_dir().glob("*.json"))


def bundled_device_profiles() -> list[str]:
    """Names of the device profiles shipped in partitioner/hardware/devices."""
    return sorted(p.stem for p in (_hardware_dir() / "devices").glob("*.json"))


def load_device_profile(name: str) -> dict[str, Any]:
    """Returns a bundled device profile (peak FLOP/s by dtype, memory, spec-sheet source) by name.

    Raises:
        ClusterError: when no such profile ships; the message lists the ones that do.
    """
    if not isinstance(name, str) or name not in bundled_device_profiles():
        raise ClusterError(f"No device profile {name!r}. Bundled profiles: {bundled_device_profiles()}.")
    path = _hardware_dir() / "devices" / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ClusterError(f"Device profile '{path}' is not valid JSON ({err.msg} at line {err.lineno}).") from err
    missing = [key for key in ("name", "memory_bytes", "peak_flops_per_s", "efficiency") if key not in data]
    if missing:
        raise ClusterError(f"Device profile '{path}' is corrupt: missing field(s) {missing}.")
    return dict(data)
