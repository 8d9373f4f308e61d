"""Runs a plan: rebuilds a Keras model on its devices and trains it with pipelined micro-batches.

Importing this package imports TensorFlow and Keras.

Example:
    >>> from runtime import make_virtual_devices, plan_and_wrap     # doctest: +SKIP
    >>> make_virtual_devices(4)                                      # doctest: +SKIP
    >>> wrapped = plan_and_wrap(model, devices=4, batch_size=64, num_microbatches=8)   # doctest: +SKIP
"""

from __future__ import annotations

from runtime.devices import make_virtual_devices, resolve_devices
from runtime.memory import StepMemory, step_memory
from runtime.pipeline import PipelinedModel
from runtime.placement import executed_placement, placement_report, synthetic_batch
from runtime.workers import Worker, current_worker, start_worker
from runtime.wrap import plan_and_wrap, wrap

__all__ = [
    "PipelinedModel",
    "StepMemory",
    "Worker",
    "current_worker",
    "executed_placement",
    "make_virtual_devices",
    "placement_report",
    "plan_and_wrap",
    "resolve_devices",
    "start_worker",
    "step_memory",
    "synthetic_batch",
    "wrap",
]
