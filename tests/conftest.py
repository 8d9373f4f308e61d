"""Shared fixtures: virtual devices are made here, once, before TensorFlow initialises."""

from __future__ import annotations

import os

import pytest

NUM_VIRTUAL_DEVICES = 4

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _make_virtual_devices() -> list[str]:
    """Splits the CPU (or the first GPU) into NUM_VIRTUAL_DEVICES logical devices; returns their names."""
    try:
        import tensorflow as tf
    except ImportError:  # the planner's tests run without TensorFlow
        return []
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        config = [tf.config.LogicalDeviceConfiguration(memory_limit=1024)] * NUM_VIRTUAL_DEVICES
        tf.config.set_logical_device_configuration(gpus[0], config)
        kind = "GPU"
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_VIRTUAL_DEVICES)
        kind = "CPU"
    return [d.name for d in tf.config.list_logical_devices(kind)]


VIRTUAL_DEVICES = _make_virtual_devices()


@pytest.fixture(scope="session")
def virtual_devices() -> list[str]:
    """Names of the logical devices made for this test session (e.g. '/device:CPU:0' ... '/device:CPU:3')."""
    if len(VIRTUAL_DEVICES) < NUM_VIRTUAL_DEVICES:
        pytest.skip("TensorFlow is not installed")
    return VIRTUAL_DEVICES
