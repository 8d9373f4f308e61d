"""The profiler: Keras model -> layer graph with measured costs (hardware profiles live in partitioner/hardware).

Importing this package does not import TensorFlow; ``profile_model`` does, on first use.

Example:
    >>> from profiles import profile_model                          # doctest: +SKIP
    >>> graph = profile_model(model, batch_size=32, num_microbatches=8)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_profile", "profile_model", "save_profile"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from profiles import profiler

        return getattr(profiler, name)
    raise AttributeError(f"module 'profiles' has no attribute {name!r}")
