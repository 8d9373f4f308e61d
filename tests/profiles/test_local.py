"""Tests local_cluster and measure_flops_per_s on the logical CPU devices made in conftest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

tf = pytest.importorskip("tensorflow")

from partitioner.cluster import DEFAULT_BANDWIDTH  # noqa: E402
from partitioner.errors import ClusterError, InputError  # noqa: E402
from profiles import local  # noqa: E402
from profiles.local import local_cluster, local_cluster_and_sources, measure_flops_per_s  # noqa: E402


def test_local_cluster_uses_the_virtual_cpu_devices(virtual_devices):
    cluster = local_cluster()
    assert cluster.names == virtual_devices
    assert cluster.num_devices == 4
    for device in cluster.devices:
        assert device.memory_bytes > 0
        assert device.flops_per_s > 0
        assert device.action_overhead_s > 0
    assert 0 < cluster.bandwidth(0, 1) < float("inf")


def test_local_cluster_calibrate_measures_and_records_each_source(virtual_devices):
    cluster, sources = local_cluster_and_sources(2, calibrate=True)
    assert [d.action_overhead_s > 0 for d in cluster.devices] == [True, True]
    assert len({d.action_overhead_s for d in cluster.devices}) == 1  # one figure for all: plans do not jitter
    assert sorted(sources) == [
        "action_overhead_s",
        "bandwidth_bytes_per_s",
        "flops_per_s",
        "memory_bytes",
        "pool_capacity",
    ]
    # the two logical devices share this machine's cores: one pool, its capacity measured
    assert [d.pool for d in cluster.devices] == ["host CPU", "host CPU"]
    assert 1.0 <= cluster.devices[0].pool_capacity <= 2.0
    for field in ("action_overhead_s", "bandwidth_bytes_per_s", "flops_per_s", "pool_capacity"):
        assert sources[field].startswith("measured: "), (field, sources[field])
        assert virtual_devices[0] in sources[field]
    assert sources["memory_bytes"] == "the machine's RAM split over 2"


def test_local_cluster_without_calibration_keeps_the_constants(virtual_devices):
    cluster, sources = local_cluster_and_sources(2, flops_per_s=1e9, calibrate=False)
    assert [d.action_overhead_s for d in cluster.devices] == [0.0, 0.0]
    assert cluster.bandwidth(0, 1) == DEFAULT_BANDWIDTH
    assert sources["action_overhead_s"] == "none: not calibrated"
    assert [d.pool for d in cluster.devices] == [None, None] and cluster.pools() == {}
    assert sources["pool_capacity"].startswith("none: not calibrated")
    assert sources["bandwidth_bytes_per_s"].startswith("DEFAULT_BANDWIDTH")
    assert sources["flops_per_s"] == "given"


def test_local_cluster_given_figures_are_not_measured(virtual_devices):
    cluster, sources = local_cluster_and_sources(
        2, flops_per_s=1e9, action_overhead_s=3e-4, bandwidth="10GB/s", pool_capacity=1.5
    )
    assert [d.action_overhead_s for d in cluster.devices] == [3e-4, 3e-4]
    assert cluster.pools() == {"host CPU": (1.5, (0, 1))} and sources["pool_capacity"] == "given"
    assert cluster.bandwidth(0, 1) == 10e9
    assert [sources[f] for f in ("action_overhead_s", "bandwidth_bytes_per_s", "flops_per_s")] == ["given"] * 3


def test_local_cluster_of_one_device_has_no_link_to_measure(virtual_devices):
    cluster, sources = local_cluster_and_sources(1, flops_per_s=1e9)
    assert cluster.devices[0].action_overhead_s > 0
    assert sources["bandwidth_bytes_per_s"].startswith("DEFAULT_BANDWIDTH")


def test_local_cluster_splits_ram_evenly(virtual_devices):
    four, two = local_cluster(flops_per_s=1e9), local_cluster(2, flops_per_s=1e9)
    assert two.devices[0].memory_bytes == pytest.approx(2 * four.devices[0].memory_bytes, abs=2)
    assert two.names == virtual_devices[:2]


def test_local_cluster_overrides(virtual_devices):
    cluster = local_cluster(2, memory="1GiB", flops_per_s=1e12, bandwidth="10GB/s")
    assert [d.memory_bytes for d in cluster.devices] == [2**30, 2**30]
    assert [d.flops_per_s for d in cluster.devices] == [1e12, 1e12]
    assert cluster.bandwidth(1, 0) == 10e9


@pytest.mark.parametrize(
    ("num_devices", "message"),
    [(0, r"num_devices must be an integer >= 1"), (99, r"Asked for 99 local devices but TensorFlow sees 4")],
)
def test_local_cluster_rejects_bad_num_devices(virtual_devices, num_devices, message):
    with pytest.raises(ClusterError, match=message):
        local_cluster(num_devices, flops_per_s=1e9)


def _fake_gpus(monkeypatch, limits):
    """Pretends TensorFlow sees one physical GPU split into logical GPUs with these limits (MiB)."""
    physical = SimpleNamespace(name="/physical_device:GPU:0", device_type="GPU")
    logical = [SimpleNamespace(name=f"/device:GPU:{i}", device_type="GPU") for i in range(len(limits))]
    configs = None if limits == [None] else [SimpleNamespace(memory_limit=m) for m in limits]
    monkeypatch.setattr(local.tf.config, "list_physical_devices", lambda kind=None: [physical])
    monkeypatch.setattr(local.tf.config, "list_logical_devices", lambda kind=None: logical)
    monkeypatch.setattr(local.tf.config, "get_logical_device_configuration", lambda device: configs)


def test_local_cluster_gpu_memory_from_virtual_device_limits(monkeypatch):
    _fake_gpus(monkeypatch, [1024, 2048])
    cluster = local_cluster(flops_per_s=1e12, calibrate=False)
    assert cluster.names == ["/device:GPU:0", "/device:GPU:1"]
    assert [d.memory_bytes for d in cluster.devices] == [2**30, 2**31]
    assert cluster.name == "local 2x GPU"


def test_local_cluster_gpu_without_limit_needs_memory(monkeypatch):
    _fake_gpus(monkeypatch, [None])
    with pytest.raises(ClusterError, match=r"memory of GPU '/device:GPU:0' is unknown.*Pass memory="):
        local_cluster(flops_per_s=1e12, calibrate=False)
    assert local_cluster(memory="40GiB", flops_per_s=1e12, calibrate=False).devices[0].memory_bytes == 40 * 2**30


def test_measure_flops_per_s_is_positive_and_cached(virtual_devices):
    rate = measure_flops_per_s(virtual_devices[0], size=128, min_seconds=0.01)
    assert rate > 1e6
    assert measure_flops_per_s(virtual_devices[0], size=128, min_seconds=0.01) == rate


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"size": 0}, r"size must be a positive integer"), ({"min_seconds": 0}, r"min_seconds must be positive")],
)
def test_measure_flops_per_s_rejects_bad_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        measure_flops_per_s("/CPU:0", **kwargs)
