"""Turns a MODEL argument into a Keras model: a .keras file, a keras.applications name, or module:function."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from partitioner.errors import InputError, ProfileError


def load_model(spec: str, *, input_size: int | None = None) -> Any:
    """Returns the Keras model named by ``spec``.

    Args:
        spec: a path to a ``.keras`` file (loaded in Keras' safe mode), the name of a
            ``keras.applications`` model such as ``"ResNet50"`` (built with ``weights=None``, no
            download), or ``"package.module:function"`` returning a model.
        input_size: for keras.applications models, the input height and width (default: the
            model's own, e.g. 224).

    Raises:
        InputError: when the spec names nothing that exists; the message lists what is accepted.

    Example:
        >>> model = load_model("MobileNetV2", input_size=96)     # doctest: +SKIP
    """
    import keras

    if spec.endswith(".keras"):
        path = Path(spec)
        if not path.exists():
            raise InputError(f"Model file '{spec}' does not exist.")
        try:
            return keras.models.load_model(path, safe_mode=True, compile=False)
        except (ValueError, TypeError, OSError) as err:
            raise ProfileError(f"Keras could not load '{spec}' in safe mode: {err}") from err
    if ":" in spec:
        module_name, _, function_name = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise InputError(f"Cannot import module '{module_name}' for model '{spec}': {err}.") from err
        function = getattr(module, function_name, None)
        if not callable(function):
            raise InputError(f"Module '{module_name}' has no function '{function_name}' to build the model.")
        return function()
    builder = getattr(keras.applications, spec, None)
    if builder is None or not callable(builder):
        names = sorted(n for n in dir(keras.applications) if n[:1].isupper())
        raise InputError(
            f"Unknown model '{spec}'. Pass a .keras file, module:function, or a keras.applications name "
            f"such as {', '.join(names[:8])}, ... ({len(names)} in all)."
        )
    kwargs: dict[str, Any] = {"weights": None}
    if input_size is not None:
        kwargs["input_shape"] = (input_size, input_size, 3)
    return builder(**kwargs)
