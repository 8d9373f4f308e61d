"""Rebuilds a keras-hub backbone from its own config, each layer's variables made on that layer's device.

keras-hub 0.32's Llama, Qwen3 and GPT-NeoX decoder blocks and ViT's patch embedding do not rebuild from
their own config (``get_config`` names an attribute ``__init__`` never sets, or omits an argument), so
``rebuild.clone_operation`` cannot copy them, nor can ``keras.models.clone_model``. Their backbone's
config is what presets and ``.keras`` files are saved as, and ``from_config`` rebuilds the backbone
whole, as ``keras.saving.load_model`` does. Such a backbone is rebuilt so, and its layers are taken
from the rebuilt one in place of copies made one by one.

A backbone's ``__init__`` calls its layers on symbolic inputs, so all its variables are made while it is
constructed, not when ``rebuild`` calls each layer under ``tf.device``. They are placed by a
``tf.variable_creator_scope``: while a layer builds (or, for a seed generator, is made), Keras keeps a
stack of name scopes whose entries name the layer that opened them, and each variable is made on the
device of the backbone's layer that opened the outermost one. Every variable of each layer taken is then
checked to be on its device; a layer whose variables are not is copied from its own config as any other
layer, or refused if it cannot be (never placed wrongly).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from partitioner.errors import ProfileError
from profiles.internals import flatten_layers, open_name_scope_callers
from runtime.devices import canonical


def backbone_layers(model: Any, device_of: Mapping[int, str]) -> dict[int, Any]:
    """id(original layer) -> its twin in a rebuilt keras-hub backbone, with every variable on its device.

    Only backbones that hold a layer that does not rebuild from its own config are rebuilt; every layer of
    such a backbone is taken from the rebuilt one (so that no layer's variables are made twice), except a
    layer whose variables the backbone made where no layer of its own was building (a ``Dropout`` made in
    the backbone's ``__init__``, whose seed state is made then): that one is copied from its config.

    Args:
        model: the model being rebuilt; its keras-hub ``Backbone`` (itself, or the one a task holds) is
            found among its layers.
        device_of: {id(original layer): the device of its clone}, for the layers the plan places.

    Raises:
        ProfileError: when a layer that does not rebuild from its own config does not get every variable
            on its device, or the backbone rebuilt from its config holds other layers than the original.
    """
    taken: dict[int, Any] = {}
    for backbone in _backbones(model):
        failing = [layer for layer in backbone.layers if not _rebuilds_from_config(layer)]
        if not failing:
            continue
        placed = {layer.name: device_of[id(layer)] for layer in backbone.layers if id(layer) in device_of}
        with _variables_on_devices(placed):
            twin = type(backbone).from_config(backbone.get_config())
        if [(type(a), a.name) for a in backbone.layers] != [(type(b), b.name) for b in twin.layers]:
            raise ProfileError(
                f"Cannot rebuild '{backbone.name}' ({type(backbone).__name__}) from its config: it holds the layers "
                f"{[a.name for a in twin.layers]}, the original {[a.name for a in backbone.layers]}. Expected the "
                "same layers (as keras.saving.load_model needs); train the model unwrapped."
            )
        for layer, copy in zip(backbone.layers, twin.layers, strict=True):
            if id(layer) not in device_of:
                continue
            misplaced = [v.path for v in copy.variables if canonical(v.value.device) != canonical(device_of[id(layer)])]
            if not misplaced:
                taken[id(layer)] = copy
            elif any(layer is f for f in failing):
                made = canonical(next(v.value.device for v in copy.variables if v.path in misplaced))
                raise ProfileError(
                    f"Cannot place '{layer.name}' ({type(layer).__name__}) on {device_of[id(layer)]}: it does not "
                    f"rebuild from its own config, and rebuilding '{backbone.name}' from its config made its "
                    f"variable(s) {misplaced[:3]} outside its build, on {made}. Expected every variable made while "
                    f"its layer builds; pin the layer where they were made (pins={{'{layer.name}': '{made}'}}), or "
                    "train the model unwrapped."
                )
    return taken


def _backbones(model: Any) -> list[Any]:
    """The keras-hub backbones in ``model`` (itself included); none when keras-hub was never imported."""
    hub = sys.modules.get("keras_hub")
    if hub is None:
        return []
    return [layer for layer in flatten_layers(model) if isinstance(layer, hub.models.Backbone)]


def _rebuilds_from_config(layer: Any) -> bool:
    """True iff ``type(layer).from_config(layer.get_config())`` works (a trial copy, thrown away).

    keras-hub's layers hold no function of the user's, so no ``rebuild.user_code`` is needed here.
    """
    try:
        type(layer).from_config(layer.get_config())
    except Exception:  # any failure: the copy cannot be made, whatever the layer's own error
        return False
    return True


@contextlib.contextmanager
def _variables_on_devices(device_of_layer: Mapping[str, str]) -> Iterator[None]:
    """Every variable made in the block goes to the device of the outermost building layer named in
    ``device_of_layer`` ({layer name: device}); one made where none is building goes where TensorFlow puts it."""
    import tensorflow as tf

    def creator(next_creator: Any, **kwargs: Any) -> Any:
        names = [name for name in _building_layer_names() if name in device_of_layer]
        if not names:
            return next_creator(**kwargs)
        with tf.device(device_of_layer[names[0]]):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def _building_layer_names() -> list[str]:
    """The names of the layers (and seed generators) whose name scopes are open, outermost first
    (``internals.open_name_scope_callers``)."""
    return [caller.name for caller in open_name_scope_callers() if getattr(caller, "name", None) is not None]
