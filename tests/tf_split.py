"""What TensorFlow's split of a function into forward and backward hands the backward.

TensorFlow keeps for a function's backward every forward tensor a gradient op it builds reads; the
runtime's stages are functions, and the profiler charges what they keep (profiles/profiler.py ``_saved``).
Tests read the split itself to hold both to it. It is a private API (``_delayed_rewrite_functions``, read
on TensorFlow 2.21): this is the one place to mend when TensorFlow changes it.
"""

from __future__ import annotations

from typing import Any


def kept_for_backward(concrete: Any) -> list[Any]:
    """The tensors a concrete function's forward hands its backward: the forward graph's outputs past the
    function's own returns."""
    import tensorflow as tf

    forward, _ = concrete._delayed_rewrite_functions.forward_backward()
    num_returns = len(tf.nest.flatten(concrete.structured_outputs))
    return list(forward.graph.outputs[num_returns:])
