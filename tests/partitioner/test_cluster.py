"""Devices and clusters: sizes, bandwidth as a number, a matrix or a mapping, errors, JSON."""

from __future__ import annotations

import math

import pytest

from partitioner.cluster import Cluster, Device
from partitioner.errors import ClusterError, InputError

GIB = 2**30


def _three_devices() -> list[Device]:
    return [Device(f"/GPU:{i}", memory="1GiB", flops_per_s=1e12) for i in range(3)]


# ----- Device ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory", "expected"), [(16 * GIB, 16 * GIB), ("16GiB", 16 * GIB), ("16GB", 16 * 10**9), (2.5e9, 2_500_000_000)]
)
def test_device_memory_as_int_or_string(memory, expected):
    device = Device(name="/GPU:0", memory=memory, flops_per_s=989e12)
    assert device.memory_bytes == expected
    assert device.flops_per_s == 989e12


def test_device_memory_bytes_keyword_and_rate_string():
    device = Device("/CPU:0", memory_bytes=4096, flops_per_s="2e12")
    assert (device.name, device.memory_bytes, device.flops_per_s) == ("/CPU:0", 4096, 2e12)


def test_device_is_frozen():
    device = Device("/GPU:0", memory="1GiB")
    with pytest.raises(AttributeError):
        device.memory_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("memory", "match"),
    [
        ("-3", r"memory of device '/GPU:0' '-3' is not a size"),
        (-3, r"memory of device '/GPU:0' must be positive"),
        (0, r"memory of device '/GPU:0' must be positive"),
        ("lots", r"'lots' is not a size"),
    ],
)
def test_device_nonsensical_memory(memory, match):
    with pytest.raises(InputError, match=match):
        Device("/GPU:0", memory=memory)


def test_device_needs_memory():
    with pytest.raises(ClusterError, match=r"Device '/GPU:0' needs a memory size"):
        Device("/GPU:0")


@pytest.mark.parametrize("name", ["", "   ", None, 0])
def test_device_needs_a_name(name):
    with pytest.raises(ClusterError, match=r"needs a non-empty name"):
        Device(name, memory="1GiB")


@pytest.mark.parametrize("flops", [0, -1e12, "fast"])
def test_device_nonsensical_flops(flops):
    with pytest.raises(InputError, match=r"flops_per_s of device '/GPU:0'"):
        Device("/GPU:0", memory="1GiB", flops_per_s=flops)


# ----- Cluster -----------------------------------------------------------------------------------


def test_cluster_uniform():
    cluster = Cluster.uniform(4, memory="16GiB", flops_per_s=100e12, bandwidth="50GB/s")
    assert cluster.names == ["/GPU:0", "/GPU:1", "/GPU:2", "/GPU:3"]
    assert cluster.num_devices == 4
    assert all(d.memory_bytes == 16 * GIB and d.flops_per_s == 100e12 for d in cluster.devices)
    assert cluster.total_memory_bytes == 64 * GIB
    assert cluster.bandwidth(0, 3) == cluster.bandwidth(2, 1) == 50e9
    assert cluster.bandwidth(1, 1) == math.inf


def test_cluster_uniform_prefix():
    assert Cluster.uniform(2, memory="1GiB", prefix="/CPU:").names == ["/CPU:0", "/CPU:1"]


@pytest.mark.parametrize("num_devices", [0, -1, 2.0, True])
def test_cluster_uniform_bad_count(num_devices):
    with pytest.raises(ClusterError, match=r"num_devices must be an integer >= 1"):
        Cluster.uniform(num_devices, memory="1GiB")


def test_cluster_bandwidth_number():
    cluster = Cluster(_three_devices(), bandwidth=450e9)
    assert cluster.bandwidth_bytes_per_s == (
        (math.inf, 450e9, 450e9),
        (450e9, math.inf, 450e9),
        (450e9, 450e9, math.inf),
    )


def test_cluster_bandwidth_matrix_row_is_sender():
    matrix = [[0, 1e9, 2e9], [3e9, 0, "4GB/s"], [5e9, 6e9, 0]]
    cluster = Cluster(_three_devices(), bandwidth=matrix)
    assert cluster.bandwidth(0, 1) == 1e9
    assert cluster.bandwidth(1, 0) == 3e9
    assert cluster.bandwidth(1, 2) == 4e9
    assert cluster.bandwidth(2, 1) == 6e9
    assert [cluster.bandwidth(i, i) for i in range(3)] == [math.inf] * 3  # the diagonal is ignored


def test_cluster_bandwidth_mapping():
    names = ["/GPU:0", "/GPU:1", "/GPU:2"]
    mapping = {(a, b): (1e9 if {a, b} == {"/GPU:0", "/GPU:1"} else "100GB/s") for a in names for b in names if a != b}
    cluster = Cluster(_three_devices(), bandwidth=mapping)
    assert cluster.bandwidth(0, 1) == cluster.bandwidth(1, 0) == 1e9
    assert cluster.bandwidth(1, 2) == cluster.bandwidth(2, 0) == 100e9


def test_cluster_empty():
    with pytest.raises(ClusterError, match=r"at least one device. Received: devices=\[\]"):
        Cluster([])


def test_cluster_duplicate_names():
    devices = [Device("/GPU:0", memory="1GiB"), Device("/GPU:1", memory="1GiB"), Device("/GPU:0", memory="2GiB")]
    with pytest.raises(ClusterError, match=r"unique. Received duplicates: \['/GPU:0'\]"):
        Cluster(devices)


def test_cluster_devices_must_be_devices():
    with pytest.raises(ClusterError, match=r"must be partitioner.Device objects"):
        Cluster(["/GPU:0"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "matrix",
    [
        [[0, 1e9], [1e9, 0]],  # 2 x 2 for 3 devices
        [[0, 1e9, 1e9], [1e9, 0, 1e9], [1e9, 1e9]],  # a short row
        [[0, 1e9, 1e9, 1e9]] * 3,  # long rows
    ],
)
def test_cluster_bad_matrix_shape(matrix):
    with pytest.raises(ClusterError, match=r"must be 3 x 3 for 3 devices"):
        Cluster(_three_devices(), bandwidth=matrix)


def test_cluster_matrix_with_nonsense_entry():
    with pytest.raises(InputError, match=r"bandwidth\[0\]\[2\] must be positive"):
        Cluster(_three_devices(), bandwidth=[[0, 1e9, -1], [1e9, 0, 1e9], [1e9, 1e9, 0]])


def test_cluster_mapping_missing_a_pair():
    mapping = {("/GPU:0", "/GPU:1"): 1e9, ("/GPU:1", "/GPU:0"): 1e9}
    with pytest.raises(ClusterError, match=r"no entry for link \('/GPU:0', '/GPU:2'\).*every ordered pair"):
        Cluster(_three_devices(), bandwidth=mapping)


@pytest.mark.parametrize("bandwidth", [None, object()])
def test_cluster_bandwidth_of_wrong_type(bandwidth):
    with pytest.raises(ClusterError, match=r"bandwidth must be a number, a K x K matrix or a mapping"):
        Cluster(_three_devices(), bandwidth=bandwidth)


def test_cluster_bandwidth_nonsense_number():
    with pytest.raises(InputError, match=r"bandwidth must be positive"):
        Cluster(_three_devices(), bandwidth=0)


def test_cluster_index():
    cluster = Cluster.uniform(3, memory="1GiB")
    assert [cluster.index(name) for name in cluster.names] == [0, 1, 2]


def test_cluster_index_unknown_device_lists_those_that_exist():
    cluster = Cluster.uniform(2, memory="1GiB")
    with pytest.raises(ClusterError, match=r"Unknown device '/GPU:7'. The cluster has: \['/GPU:0', '/GPU:1'\]"):
        cluster.index("/GPU:7")


def test_cluster_is_frozen():
    cluster = Cluster.uniform(2, memory="1GiB")
    with pytest.raises(AttributeError):
        cluster.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "cluster",
    [
        Cluster.uniform(4, memory="16GiB", flops_per_s=100e12, bandwidth="50GB/s"),
        Cluster.uniform(1, memory="1GiB"),
        Cluster(
            [Device("/GPU:0", memory="80GiB", flops_per_s=989e12, hardware="H100"), *_three_devices()[1:]],
            bandwidth=[[0, 1, 2], [3, 0, 4], [5, 6, 0]],
            name="mixed",
        ),
    ],
)
def test_cluster_json_round_trip(cluster, tmp_path):
    assert Cluster.from_json(cluster.to_json()) == cluster
    path = tmp_path / "cluster.json"
    path.write_text(cluster.to_json())
    again = Cluster.from_json(path)
    assert again == cluster
    assert again.names == cluster.names
    assert again.bandwidth_bytes_per_s == cluster.bandwidth_bytes_per_s


def test_cluster_equality_sees_bandwidth():
    a = Cluster.uniform(2, memory="1GiB", bandwidth=1e9)
    b = Cluster.uniform(2, memory="1GiB", bandwidth=2e9)
    assert a != b


def test_cluster_from_json_not_json():
    with pytest.raises(ClusterError, match=r"cluster JSON is not valid JSON"):
        Cluster.from_json('{"kind": "cluster",')


def test_cluster_from_json_future_version():
    text = Cluster.uniform(2, memory="1GiB").to_json().replace('"schema_version": 1', '"schema_version": 99')
    with pytest.raises(ClusterError, match=r"schema_version 99; this version reads up to 1"):
        Cluster.from_json(text)


def test_cluster_from_json_unknown_file():
    with pytest.raises(ClusterError, match=r"No cluster file 'no-such-cluster'. .*bundled"):
        Cluster.from_json("no-such-cluster")


def test_cluster_from_dict_corrupt():
    data = Cluster.uniform(2, memory="1GiB").to_dict()
    del data["devices"][0]["memory_bytes"]
    with pytest.raises(ClusterError, match=r"is corrupt: missing or malformed field"):
        Cluster.from_dict(data)


def test_cluster_from_dict_nonsense_memory_keeps_its_message():
    data = Cluster.uniform(2, memory="1GiB").to_dict()
    data["devices"][1]["memory_bytes"] = "-3"
    with pytest.raises(InputError, match=r"memory of device '/GPU:1' '-3' is not a size"):
        Cluster.from_dict(data)


def test_device_with_peaks_runs_each_dtype_at_its_peak_times_efficiency():
    device = Device("/GPU:0", memory="40GiB", peak_flops_per_s={"float32": 19.5e12, "bfloat16": 312e12}, efficiency=0.5)
    assert device.flops_per_s_for("bfloat16") == pytest.approx(156e12)
    assert device.flops_per_s_for("float32") == pytest.approx(9.75e12)  # no tf32 peak: the float32 one
    assert device.flops_per_s == device.flops_per_s_for("float32")  # the default dtype
    assert device.flops_per_s_for(None) == device.flops_per_s


def test_device_without_peaks_runs_every_dtype_at_its_one_rate():
    device = Device("/GPU:0", memory="1GiB", flops_per_s=5e12)
    assert [device.flops_per_s_for(d) for d in ("float32", "bfloat16", "float64")] == [5e12] * 3


def test_device_missing_dtype_peak_says_what_it_has():
    device = Device("/GPU:3", memory="16GiB", peak_flops_per_s={"float32": 8.1e12, "float16": 65e12}, hardware="T4")
    with pytest.raises(ClusterError, match=r"'/GPU:3' \(T4\) has no peak FLOP/s for the compute dtype 'bfloat16'; "
                       r"it has \['float16', 'float32'\]"):  # fmt: skip
        device.flops_per_s_for("bfloat16")


@pytest.mark.parametrize("value", [0, -0.1, 1.01, True])
def test_device_rejects_a_bad_efficiency(value):
    with pytest.raises(ClusterError, match="efficiency is the share of peak"):
        Device("/GPU:0", memory="1GiB", peak_flops_per_s={"float32": 1e12}, efficiency=value)


def test_cluster_explicit_json_keeps_peaks_and_efficiency():
    device = Device("/GPU:0", memory="40GiB", peak_flops_per_s={"float32": 19.5e12, "tf32": 156e12}, efficiency=0.5)
    again = Cluster.from_json(Cluster([device]).to_json())
    assert again.devices == (device,)
    assert again.devices[0].flops_per_s_for("float32") == pytest.approx(78e12)


@pytest.mark.parametrize("value", [-1e-6, math.inf, math.nan, True, "20us"])
def test_device_rejects_a_bad_action_overhead(value):
    with pytest.raises(ClusterError, match=r"action_overhead_s is the fixed seconds .* a finite number >= 0"):
        Device("/GPU:0", memory="1GiB", action_overhead_s=value)


def test_device_action_overhead_round_trips_and_comes_from_profiles():
    device = Device("/GPU:0", memory="1GiB", action_overhead_s=2e-5)
    assert Cluster.from_json(Cluster([device]).to_json()).devices == (device,)
    assert Device("/GPU:0", memory="1GiB").action_overhead_s == 0.0  # none unless given
    assert Cluster.uniform(2, memory="1GiB", action_overhead_s=1e-3).devices[1].action_overhead_s == 1e-3
    assert {d.action_overhead_s for d in Cluster.from_json("2xT4+2xA100").devices} == {2e-5}  # the profiles' figure


def test_device_default_speed_needs_a_peak_for_its_dtype():
    with pytest.raises(ClusterError, match=r"'/GPU:0' has no float32 peak for its default speed .* Pass dtype="):
        Device("/GPU:0", memory="1GiB", peak_flops_per_s={"bfloat16": 1e15})
    assert Device("/GPU:0", memory="1GiB", peak_flops_per_s={"bfloat16": 1e15}, dtype="bfloat16").flops_per_s == 1e15


# ----- groups: one cluster of several device profiles


def _groups_cluster(**changes):
    data = {
        "schema_version": 1,
        "kind": "cluster",
        "dtype": "float16",
        "groups": [
            {"device_profile": "T4-16GB", "num_devices": 2, "bandwidth_bytes_per_s": 15.75e9},
            {
                "device_profile": "A100-SXM-80GB",
                "num_devices": 3,
                "bandwidth_bytes_per_s": "300GB/s",
                "efficiency": 0.4,
            },
        ],
        "inter_group_bandwidth_bytes_per_s": 12.5e9,
    }
    data.update(changes)
    return data


def test_cluster_groups_mix_device_profiles_in_the_listed_order():
    cluster = Cluster.from_dict(_groups_cluster())
    assert cluster.names == ["/GPU:0", "/GPU:1", "/GPU:2", "/GPU:3", "/GPU:4"]
    assert [d.hardware for d in cluster.devices] == ["T4-16GB"] * 2 + ["A100-SXM-80GB"] * 3
    t4, a100 = cluster.devices[0], cluster.devices[2]
    assert t4.flops_per_s == pytest.approx(65e12 * 0.25)  # the T4 profile's own efficiency
    assert a100.flops_per_s == pytest.approx(312e12 * 0.4)  # the group's efficiency overrides the profile's
    assert a100.flops_per_s_for("float32") == pytest.approx(156e12 * 0.4)  # tf32 on the A100
    assert t4.flops_per_s_for("float32") == pytest.approx(8.1e12 * 0.25)
    assert cluster.bandwidth(0, 1) == 15.75e9
    assert cluster.bandwidth(2, 4) == cluster.bandwidth(4, 3) == 300e9
    assert cluster.bandwidth(1, 2) == cluster.bandwidth(4, 0) == 12.5e9
    again = Cluster.from_json(cluster.to_json())
    assert again.devices == cluster.devices
    assert again.bandwidth_bytes_per_s == cluster.bandwidth_bytes_per_s


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"groups": []}, "'groups' must be a non-empty list"),
        ({"groups": ["T4-16GB"]}, "'groups' must be a non-empty list"),
        ({"groups": [{"device_profile": "T4-16GB", "num_devices": 2}]}, r"group 0 has no \['bandwidth_bytes_per_s'\]"),
        ({"inter_group_bandwidth_bytes_per_s": None}, "no 'inter_group_bandwidth_bytes_per_s'"),
        ({"device_profile": "T4-16GB"}, r"has 'groups' and \['device_profile'\]"),
        ({"dtype": "bfloat16"}, "'T4-16GB' has no peak for dtype 'bfloat16'.*every device profile lists"),
        (
            {"groups": [{"device_profile": "T4-16GB", "num_devices": 0, "bandwidth_bytes_per_s": 1e9}]},
            "num_devices must be an integer >= 1",
        ),
        (
            {"groups": [{"device_profile": "X9", "num_devices": 1, "bandwidth_bytes_per_s": 1e9}]},
            "No device profile 'X9'",
        ),
        (
            {"groups": [{"device_profile": "T4-16GB", "num_devices": 1, "bandwidth_bytes_per_s": 1, "efficiency": 2}]},
            r"efficiency is the share of peak FLOP/s reached in training, in \(0, 1\]",
        ),
    ],
)
def test_cluster_groups_refuse_malformed_input_in_one_line(changes, match):
    data = _groups_cluster(**changes)
    if changes.get("inter_group_bandwidth_bytes_per_s", 0) is None:
        del data["inter_group_bandwidth_bytes_per_s"]
    with pytest.raises(ClusterError, match=match) as info:
        Cluster.from_dict(data)
    assert "\n" not in str(info.value)


def test_cluster_index_finds_any_spelling_of_a_device() -> None:
    cluster = Cluster([Device("/CPU:0", memory="1GiB"), Device("/device:GPU:1", memory="1GiB")])
    assert [cluster.index(n) for n in ("/device:CPU:0", "cpu:0", "/CPU:0")] == [0, 0, 0]
    assert [cluster.index(n) for n in ("/GPU:1", "/job:localhost/replica:0/task:0/device:GPU:1")] == [1, 1]
    with pytest.raises(ClusterError, match=r"Unknown device '/job:worker/task:1/device:CPU:0'"):
        cluster.index("/job:worker/task:1/device:CPU:0")  # another worker's device is another device


def test_cluster_refuses_two_spellings_of_one_device() -> None:
    with pytest.raises(ClusterError, match=r"Received duplicates: \['/GPU:0', '/device:GPU:0'\] \(two spellings"):
        Cluster([Device("/GPU:0", memory="1GiB"), Device("/device:GPU:0", memory="1GiB")])


def pooled(capacity: float, num_devices: int = 2, pool: str = "host CPU") -> list[Device]:
    return [Device(f"/CPU:{i}", memory="1GiB", pool=pool, pool_capacity=capacity) for i in range(num_devices)]


def test_device_pool_round_trips_and_names_the_shared_pools():
    cluster = Cluster([*pooled(1.5), Device("/GPU:0", memory="1GiB")])
    assert Cluster.from_json(cluster.to_json()) == cluster
    assert cluster.pools() == {"host CPU": (1.5, (0, 1))}
    assert Cluster(pooled(2.0)).pools() == {}  # two devices' worth for two devices: nothing shared
    assert Cluster(pooled(1.5)).take(1).pools() == {}  # one device of the pool left
    assert cluster.with_headroom(0.1).devices[0].pool_capacity == 1.5
    assert "pool" not in Device("/GPU:0", memory="1GiB").to_dict()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pool": ""}, r"pool names the processor it shares .* Received: ''"),
        ({"pool": 3}, r"pool names the processor it shares"),
        ({"pool": "cpu", "pool_capacity": 0}, r"pool_capacity is how many devices' worth .* Received: 0"),
        ({"pool": "cpu", "pool_capacity": math.inf}, r"pool_capacity .* a finite number > 0"),
        ({"pool": "cpu", "pool_capacity": True}, r"pool_capacity .* Received: True"),
        ({"pool_capacity": 2.0}, r"pool_capacity=2 without a pool: name the processor .* pool='host CPU'"),
    ],
)
def test_device_rejects_a_bad_pool(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        Device("/CPU:0", memory="1GiB", **kwargs)


def test_cluster_refuses_one_pool_with_two_capacities():
    devices = [*pooled(1.5, 1), Device("/CPU:1", memory="1GiB", pool="host CPU", pool_capacity=1.8)]
    with pytest.raises(ClusterError, match=r"pool 'host CPU' give two capacities \(1.5 and 1.8 on '/CPU:1'\)"):
        Cluster(devices)


def test_cluster_file_with_a_bad_pool_says_which_device():
    data = Cluster(pooled(1.5)).to_dict()
    data["devices"][1]["pool_capacity"] = -1
    with pytest.raises(ClusterError, match=r"Device '/CPU:1': pool_capacity is how many devices' worth"):
        Cluster.from_dict(data)
