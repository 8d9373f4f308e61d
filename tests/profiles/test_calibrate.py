"""Tests the measurements of profiles.calibrate on the logical CPU devices made in conftest: shape, not speed."""

from __future__ import annotations

import math

import pytest

tf = pytest.importorskip("tensorflow")

from partitioner.errors import InputError  # noqa: E402
from profiles.calibrate import (  # noqa: E402
    measure_action_overhead_s,
    measure_bandwidth,
    measure_model_pool_capacity,
    measure_pool_capacity,
)
from runtime.devices import resolve_devices  # noqa: E402


@pytest.mark.parametrize("with_peer", [False, True])
def test_measure_action_overhead_s_is_positive_and_cached(virtual_devices, with_peer):
    peer = virtual_devices[1] if with_peer else None
    seconds = measure_action_overhead_s(virtual_devices[0], peer=peer, num_calls=20, num_rounds=3)
    assert 0 < seconds < 0.1
    assert measure_action_overhead_s(virtual_devices[0], peer=peer, num_calls=20, num_rounds=3) == seconds


def test_measure_bandwidth_is_positive_and_finite(virtual_devices):
    rate = measure_bandwidth(virtual_devices[0], virtual_devices[1], num_bytes=2**20, num_rounds=3)
    assert 0 < rate < math.inf


@pytest.mark.parametrize(("together", "expected"), [(1.5, 2 / 1.5), (0.9, 2.0), (3.0, 1.0)])
def test_pool_capacity_is_n_times_alone_over_together_clipped_to_one_and_n(
    virtual_devices, monkeypatch, together, expected
):
    import profiles.calibrate as calibrate

    # the chain on the first device alone (one device synced), then one on each device at once (all synced)
    monkeypatch.setattr(calibrate, "synced_seconds", lambda run, names: 1.0 if len(names) == 1 else together)
    monkeypatch.setattr(calibrate, "_CAPACITY", {})
    assert calibrate.measure_pool_capacity(virtual_devices[:2], width=8, rows=2, depth=1) == pytest.approx(expected)


def test_measure_pool_capacity_is_between_one_device_and_all(virtual_devices):
    capacity = measure_pool_capacity(virtual_devices[:2], width=128, rows=16, depth=2, num_rounds=3)
    assert 1.0 <= capacity <= 2.0
    assert measure_pool_capacity(virtual_devices[:2], width=128, rows=16, depth=2, num_rounds=3) == capacity


def _bn_model():
    keras = pytest.importorskip("keras")
    inputs = keras.Input((16,), name="x")
    h = keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(h), name="small")


def test_measure_model_pool_capacity_runs_the_model_on_every_device_and_gives_its_weights_back(virtual_devices):
    model = _bn_model()
    before = [v.numpy().copy() for v in model.variables]
    capacity = measure_model_pool_capacity(model, virtual_devices[:2], 8, num_rounds=3)
    assert 1.0 <= capacity <= 2.0
    assert all((a == v.numpy()).all() for a, v in zip(before, model.variables, strict=True))  # BN's statistics too


def test_model_pool_capacity_is_n_times_alone_over_together(virtual_devices, monkeypatch):
    import profiles.calibrate as calibrate

    # the model's pass on the first device alone, then one on each at once
    monkeypatch.setattr(calibrate, "synced_seconds", lambda run, names: 1.0 if len(names) == 1 else 1.6)
    assert measure_model_pool_capacity(_bn_model(), virtual_devices[:2], 4) == pytest.approx(2 / 1.6)


def test_with_model_pool_capacities_replaces_each_pool_by_the_models_own(virtual_devices, monkeypatch):
    import profiles.local as local
    from partitioner.cluster import Cluster, Device

    monkeypatch.setattr(local, "measure_model_pool_capacity", lambda model, names, samples, **kw: 1.25)
    pooled = Cluster([Device(n, memory="1GiB", pool="host CPU", pool_capacity=1.5) for n in virtual_devices[:2]])
    assert local.with_model_pool_capacities(pooled, None, 4).pools() == {"host CPU": (1.25, (0, 1))}
    full = Cluster([Device(n, memory="1GiB", pool="host CPU", pool_capacity=2.0) for n in virtual_devices[:2]])
    assert local.with_model_pool_capacities(full, None, 4).pools() == {"host CPU": (1.25, (0, 1))}  # measured too
    unpooled = Cluster([Device(n, memory="1GiB") for n in virtual_devices[:2]])
    assert local.with_model_pool_capacities(unpooled, None, 4) is unpooled

    def out_of_memory(model, names, samples, **kw):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM")

    monkeypatch.setattr(local, "measure_model_pool_capacity", out_of_memory)
    with pytest.warns(UserWarning, match=r"Could not run 'the model' on the 2 devices of host CPU at once"):
        assert local.with_model_pool_capacities(pooled, None, 4).pools() == {"host CPU": (1.5, (0, 1))}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: measure_action_overhead_s("/CPU:0", num_calls=0), r"num_calls must be a positive integer"),
        (lambda: measure_action_overhead_s("/CPU:0", num_rounds=True), r"num_rounds must be a positive integer"),
        (lambda: measure_bandwidth("/CPU:0", "/CPU:1", num_bytes=-1), r"num_bytes must be a positive integer"),
        (lambda: measure_pool_capacity(["/CPU:0"]), r"A pool's capacity needs two devices or more"),
        (lambda: measure_pool_capacity(["/CPU:0", "/CPU:1"], depth=0), r"depth must be a positive integer"),
        (lambda: measure_model_pool_capacity(None, ["/CPU:0"], 4), r"A pool's capacity needs two devices or more"),
        (lambda: measure_model_pool_capacity(None, ["/CPU:0", "/CPU:1"], 0), r"samples must be a positive integer"),
    ],
)
def test_measurements_reject_bad_counts(call, message):
    with pytest.raises(InputError, match=message):
        call()


def test_resolve_devices_gives_the_planner_the_measured_fixed_cost(virtual_devices):
    # plan_and_wrap(devices=2) plans on this cluster: num_microbatches="auto" then prices each pass
    cluster = resolve_devices(2)
    assert [d.action_overhead_s > 0 for d in cluster.devices] == [True, True]
