"""Shared fixtures: virtual devices are made here, once, before TensorFlow initialises."""

from __future__ import annotations

import os

import pytest

NUM_VIRTUAL_DEVICES = 4

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _make_virtual_devices() -> list[str]:
    """NUM_VIRTUAL_DEVICES logical devices (virtual GPUs where a GPU exists, else logical CPUs), with
    TensorFlow's graph dumps switched on first, so tests can read where executed ops ran."""
    try:
        from runtime import executed, make_virtual_devices
    except ImportError:  # the planner's tests run without TensorFlow
        return []
    executed.enable_collection()
    return make_virtual_devices(NUM_VIRTUAL_DEVICES)


VIRTUAL_DEVICES = _make_virtual_devices()


@pytest.fixture(scope="session")
def virtual_devices() -> list[str]:
    """Names of the logical devices made for this test session (e.g. '/device:CPU:0' ... '/device:CPU:3')."""
    if len(VIRTUAL_DEVICES) < NUM_VIRTUAL_DEVICES:
        pytest.skip("TensorFlow is not installed")
    return VIRTUAL_DEVICES
