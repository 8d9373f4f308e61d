"""Bundled hardware files: device profiles (partitioner/hardware/devices) and clusters (partitioner/hardware)."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import pytest

from partitioner.cluster import Cluster, bundled_clusters, bundled_device_profiles, load_device_profile
from partitioner.errors import ClusterError

HARDWARE_DIR = Path(str(resources.files("partitioner") / "hardware"))

# Names that docs and other tests use; they must keep shipping.
EXPECTED_CLUSTERS = {"8xH100-nvlink", "4xA100-nvlink", "4xT4-pcie", "2x8xH100-ib", "2xCPU", "8xTPUv3-core"}
EXPECTED_DEVICES = {
    "A100-SXM-40GB",
    "A100-SXM-80GB",
    "H100-SXM-80GB",
    "H200-SXM-141GB",
    "V100-SXM2-32GB",
    "V100-SXM2-16GB",
    "T4-16GB",
    "L4-24GB",
    "Xeon-Platinum-8480+",
    "TPUv3-core-16GB",
}
DEVICE_FIELDS = {
    "schema_version",
    "kind",
    "name",
    "vendor",
    "memory_bytes",
    "peak_flops_per_s",
    "efficiency",
    "efficiency_source",
    "memory_bandwidth_bytes_per_s",
    "interconnect",
    "source",
    "notes",
}


def _read(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def _is_positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_expected_files_ship() -> None:
    assert set(bundled_clusters()) >= EXPECTED_CLUSTERS
    assert set(bundled_device_profiles()) >= EXPECTED_DEVICES


# ---------------------------------------------------------------- device profiles


@pytest.mark.parametrize("name", bundled_device_profiles())
def test_device_profile_fields(name: str) -> None:
    profile = load_device_profile(name)
    missing = DEVICE_FIELDS - set(profile)
    assert not missing, f"{name} lacks {sorted(missing)}"
    assert profile["schema_version"] == 1
    assert profile["kind"] == "device"
    assert profile["name"] == name  # the name is the file stem
    assert isinstance(profile["vendor"], str) and profile["vendor"].strip()
    assert isinstance(profile["memory_bytes"], int) and not isinstance(profile["memory_bytes"], bool)
    assert profile["memory_bytes"] > 0
    assert _is_positive_number(profile["memory_bandwidth_bytes_per_s"])
    peaks = profile["peak_flops_per_s"]
    assert isinstance(peaks, dict) and "float32" in peaks
    for dtype, value in peaks.items():
        assert _is_positive_number(value), f"{name}: peak for {dtype} is {value!r}"
        # Tensor-core / matrix-unit rates are never below the plain float32 rate.
        assert value >= peaks["float32"], f"{name}: {dtype} peak below float32"
    interconnect = profile["interconnect"]
    assert isinstance(interconnect, dict) and interconnect
    for key, value in interconnect.items():
        if key.endswith("bytes_per_s"):
            assert _is_positive_number(value), f"{name}: interconnect {key} is {value!r}"
    assert isinstance(profile["source"], str) and profile["source"].strip()
    assert "http" in profile["source"]  # a spec sheet to check against
    assert isinstance(profile["notes"], str) and profile["notes"].strip()


@pytest.mark.parametrize("name", bundled_device_profiles())
def test_device_memory_is_whole_gib(name: str) -> None:
    # Capacities are the marketed size read as GiB (2**30 bytes), as documented in each profile.
    assert load_device_profile(name)["memory_bytes"] % 2**30 == 0


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        # Dense datasheet peaks (sparsity figures are twice these and must not be used).
        ("H100-SXM-80GB", "bfloat16", 989.4),
        ("H100-SXM-80GB", "tf32", 494.7),
        ("H100-SXM-80GB", "float32", 67.0),
        ("H200-SXM-141GB", "bfloat16", 989.4),
        ("H200-SXM-141GB", "tf32", 494.7),
        ("A100-SXM-80GB", "bfloat16", 312.0),
        ("A100-SXM-40GB", "tf32", 156.0),
        ("A100-SXM-40GB", "float32", 19.5),
        ("V100-SXM2-32GB", "float16", 125.0),
        ("V100-SXM2-32GB", "float32", 15.7),
        ("T4-16GB", "float16", 65.0),
        ("T4-16GB", "float32", 8.1),
        ("L4-24GB", "float16", 121.0),
        ("L4-24GB", "float32", 30.3),
        ("TPUv3-core-16GB", "bfloat16", 61.5),  # half of the chip's 123 TFLOP/s
    ],
)
def test_dense_datasheet_peaks(name: str, dtype: str, tflops: float) -> None:
    assert load_device_profile(name)["peak_flops_per_s"][dtype] == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    ("name", "efficiency", "cited"),
    [
        ("H100-SXM-80GB", 0.4, "arXiv:2407.21783"),
        ("H200-SXM-141GB", 0.4, "arXiv:2407.21783"),
        ("A100-SXM-80GB", 0.5, "arXiv:2104.04473"),
        ("A100-SXM-40GB", 0.5, "arXiv:2104.04473"),
        ("V100-SXM2-32GB", 0.3, "arXiv:1909.08053"),
        ("TPUv3-core-16GB", 0.32, "arXiv:2204.02311"),
        ("T4-16GB", 0.25, "assumption"),
        ("L4-24GB", 0.3, "assumption"),
        ("Xeon-Platinum-8480+", 0.4, "assumption"),
    ],
)
def test_device_efficiency_and_its_source(name: str, efficiency: float, cited: str) -> None:
    profile = load_device_profile(name)
    assert profile["efficiency"] == efficiency
    assert cited in profile["efficiency_source"]


@pytest.mark.parametrize("value", [0, 1.5, "high", True])
def test_cluster_rejects_a_bad_efficiency(value: object) -> None:
    data = {
        "schema_version": 1,
        "kind": "cluster",
        "device_profile": "H100-SXM-80GB",
        "num_devices": 2,
        "bandwidth_bytes_per_s": 16e9,
        "efficiency": value,
    }
    with pytest.raises(ClusterError, match=r"efficiency is the share of peak FLOP/s reached in training, in \(0, 1\]"):
        Cluster.from_dict(data)


def test_cluster_devices_keep_the_profile_peaks() -> None:
    device = Cluster.from_json("8xH100-nvlink").devices[0]
    assert dict(device.peak_flops_per_s) == load_device_profile("H100-SXM-80GB")["peak_flops_per_s"]
    assert device.efficiency == 0.4
    assert device.flops_per_s == pytest.approx(989.4e12 * 0.4)  # the file's dtype, bfloat16


@pytest.mark.parametrize(
    ("name", "gib"), [("A100-SXM-40GB", 40), ("A100-SXM-80GB", 80), ("T4-16GB", 16), ("TPUv3-core-16GB", 16)]
)
def test_device_memory_sizes(name: str, gib: int) -> None:
    assert load_device_profile(name)["memory_bytes"] == gib * 2**30


@pytest.mark.parametrize("name", ["V100-SXM2-32GB", "V100-SXM2-16GB", "T4-16GB"])
def test_parts_without_bfloat16_do_not_claim_it(name: str) -> None:
    peaks = load_device_profile(name)["peak_flops_per_s"]
    assert "bfloat16" not in peaks and "tf32" not in peaks


def test_unknown_device_profile_lists_bundled_ones() -> None:
    with pytest.raises(ClusterError, match="nope") as info:
        load_device_profile("nope")
    for name in bundled_device_profiles():
        assert name in str(info.value)


# ---------------------------------------------------------------- clusters


@pytest.mark.parametrize("name", bundled_clusters())
def test_cluster_file_fields(name: str) -> None:
    data = _read(HARDWARE_DIR / f"{name}.json")
    assert data["schema_version"] == 1
    assert data["kind"] == "cluster"
    assert isinstance(data["source"], str) and data["source"].strip()
    assert isinstance(data["notes"], str) and data["notes"].strip()
    if "device_profile" in data:
        assert data["device_profile"] in bundled_device_profiles()


@pytest.mark.parametrize("name", bundled_clusters())
def test_cluster_loads_by_name_and_by_path(name: str) -> None:
    by_name = Cluster.from_json(name)
    path = HARDWARE_DIR / f"{name}.json"
    for source in (path, str(path)):
        by_path = Cluster.from_json(source)
        assert by_path.devices == by_name.devices
        assert by_path.bandwidth_bytes_per_s == by_name.bandwidth_bytes_per_s
        assert by_path.name == by_name.name


@pytest.mark.parametrize("name", bundled_clusters())
def test_cluster_devices_come_from_the_profile(name: str) -> None:
    data = _read(HARDWARE_DIR / f"{name}.json")
    if "device_profile" not in data:
        pytest.skip("explicit device list or groups (test_heterogeneous_cluster_lists_slow_devices_first)")
    cluster = Cluster.from_json(name)
    profile = load_device_profile(data["device_profile"])
    prefix = data.get("device_prefix", "/GPU:")
    efficiency = data.get("efficiency", profile["efficiency"])
    expected_flops = profile["peak_flops_per_s"][data.get("dtype", "float32")] * efficiency
    assert cluster.num_devices == data["num_devices"]
    assert cluster.names == [f"{prefix}{i}" for i in range(data["num_devices"])]
    for device in cluster.devices:
        assert device.hardware == profile["name"]
        assert device.memory_bytes == profile["memory_bytes"]
        assert device.flops_per_s == pytest.approx(expected_flops)
    k = cluster.num_devices
    for i in range(k):
        for j in range(k):
            value = cluster.bandwidth(i, j)
            if i == j:
                assert value == math.inf
            else:
                assert 0 < value < math.inf


@pytest.mark.parametrize(
    ("name", "num_devices", "bandwidth"),
    [
        ("8xH100-nvlink", 8, 450e9),
        ("4xA100-nvlink", 4, 300e9),
        ("4xT4-pcie", 4, 15.75e9),
        ("2xCPU", 2, 128e9),
        ("8xTPUv3-core", 8, 82e9),
    ],
)
def test_flat_cluster_bandwidth(name: str, num_devices: int, bandwidth: float) -> None:
    cluster = Cluster.from_json(name)
    assert cluster.num_devices == num_devices
    assert {cluster.bandwidth(i, j) for i in range(num_devices) for j in range(num_devices) if i != j} == {bandwidth}


def test_cpu_cluster_uses_cpu_devices() -> None:
    cluster = Cluster.from_json("2xCPU")
    assert cluster.names == ["/CPU:0", "/CPU:1"]


def test_two_node_cluster_bandwidth_matrix() -> None:
    data = _read(HARDWARE_DIR / "2x8xH100-ib.json")
    topo = data["topology"]
    per_node = topo["devices_per_node"]
    intra = topo["intra_node_bandwidth_bytes_per_s"]
    inter = topo["inter_node_bandwidth_bytes_per_s"]
    assert (per_node, intra, inter) == (8, 450e9, 50e9)
    cluster = Cluster.from_json("2x8xH100-ib")
    assert cluster.num_devices == 16
    for i in range(16):
        for j in range(16):
            if i == j:
                assert cluster.bandwidth(i, j) == math.inf
            elif i // per_node == j // per_node:
                assert cluster.bandwidth(i, j) == intra, (i, j)
            else:
                assert cluster.bandwidth(i, j) == inter, (i, j)
    # Spot checks on the node boundary.
    assert cluster.bandwidth(0, 7) == intra
    assert cluster.bandwidth(7, 8) == inter
    assert cluster.bandwidth(8, 15) == intra
    assert cluster.bandwidth(15, 0) == inter


@pytest.mark.parametrize("name", bundled_clusters())
def test_cluster_json_round_trip(name: str, tmp_path: Path) -> None:
    cluster = Cluster.from_json(name)
    text = cluster.to_json()
    again = Cluster.from_json(text)
    assert again.devices == cluster.devices
    assert again.bandwidth_bytes_per_s == cluster.bandwidth_bytes_per_s
    assert again.name == cluster.name
    # The explicit form also round-trips through a file.
    path = tmp_path / "cluster.json"
    path.write_text(text)
    from_file = Cluster.from_json(path)
    assert from_file.devices == cluster.devices
    assert from_file.bandwidth_bytes_per_s == cluster.bandwidth_bytes_per_s


def test_unknown_cluster_name_lists_bundled_ones() -> None:
    with pytest.raises(ClusterError, match="no-such-cluster") as info:
        Cluster.from_json("no-such-cluster")
    for name in EXPECTED_CLUSTERS:
        assert name in str(info.value)


@pytest.mark.parametrize(("profile", "dtype"), [("T4-16GB", "bfloat16"), ("V100-SXM2-32GB", "tf32")])
def test_cluster_asking_for_a_missing_dtype_fails(profile: str, dtype: str, tmp_path: Path) -> None:
    data = {
        "schema_version": 1,
        "kind": "cluster",
        "name": "bad dtype",
        "device_profile": profile,
        "dtype": dtype,
        "num_devices": 2,
        "bandwidth_bytes_per_s": 16e9,
    }
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match=f"'{dtype}'") as info:
        Cluster.from_json(path)
    message = str(info.value)
    assert profile in message
    assert "float16" in message  # says what the profile does have
    with pytest.raises(ClusterError, match=f"'{dtype}'"):
        Cluster.from_dict(data)


def test_cluster_with_unknown_device_profile_fails() -> None:
    data = {
        "schema_version": 1,
        "kind": "cluster",
        "device_profile": "nope",
        "num_devices": 2,
        "bandwidth_bytes_per_s": 16e9,
    }
    with pytest.raises(ClusterError, match="nope"):
        Cluster.from_dict(data)


@pytest.mark.parametrize(
    ("name", "slow", "fast", "inside", "between"),
    [
        ("2xT4+2xA100", ("T4-16GB", 2), ("A100-SXM-80GB", 2), (15.75e9, 300e9), 12.5e9),
        ("4xT4+4xV100", ("T4-16GB", 4), ("V100-SXM2-32GB", 4), (15.75e9, 25e9), 12.5e9),
        ("2x4xV100+A100-ib", ("V100-SXM2-32GB", 4), ("A100-SXM-80GB", 4), (25e9, 300e9), 25e9),
    ],
)
def test_heterogeneous_cluster_lists_slow_devices_first(name, slow, fast, inside, between) -> None:
    cluster = Cluster.from_json(name)
    hardware = [d.hardware for d in cluster.devices]
    assert hardware == [slow[0]] * slow[1] + [fast[0]] * fast[1]
    n = slow[1]
    for dtype in ("float32", "float16"):  # slow first: the worst order for a pipeline that follows the list
        assert cluster.devices[0].flops_per_s_for(dtype) < cluster.devices[n].flops_per_s_for(dtype)
    for i in range(cluster.num_devices):
        for j in range(cluster.num_devices):
            if i != j:
                same = (i < n) == (j < n)
                expected = (inside[0] if i < n else inside[1]) if same else between
                assert cluster.bandwidth(i, j) == expected, (i, j)
    for group in _read(HARDWARE_DIR / f"{name}.json")["groups"]:
        assert group["device_profile"] in bundled_device_profiles()
