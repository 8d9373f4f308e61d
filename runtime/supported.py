"""Refuses models the pipeline would not run as written: models whose class has steps of its own.

A ``PipelinedModel`` runs its own ``train_step``, ``test_step`` and ``predict_step`` over M
micro-batches of the batch, with Keras' compiled loss and metrics. A model whose class brings steps
of its own would then compute something else than the original, silently, so ``plan_and_wrap`` and
``wrap`` refuse it (``InputError``) before any weight is copied:

- ``check_steps``: a model whose class overrides a step (``train_step``, ``test_step``,
  ``predict_step``, ``compute_loss``, ``compute_metrics``) or ``call``. Such code runs on the whole
  model and the whole batch (``self(x)``, a tape over every weight), which micro-batches and stages
  cannot split; the pipelined model would skip it. Only the user's own classes are read: Keras'
  classes (``Functional``, ``Sequential``) are what the runtime reproduces. keras-hub's task models
  override ``compile`` (default optimizer and loss; ``wrapped.compile`` takes the user's own) and the
  front doors ``fit``, ``evaluate``, ``predict``, ``*_on_batch`` and ``__call__`` (to run a
  preprocessor first: a task with one is refused by ``profiles.walk``; without one they pass the data
  through), none of them a step, so ``GPT2CausalLM`` and ``BertTextClassifier`` are accepted. Its
  tasks that do override a step (RetinaNet's ``compute_loss`` and ``predict_step``, SigLIP's
  contrastive ``compute_loss``, ...) are refused, as their steps are not Keras'.
"""

from __future__ import annotations

from typing import Any

from partitioner.errors import InputError
from profiles.walk import functional_graph

STEPS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics", "call")


def check_steps(model: Any) -> None:
    """Raises InputError when ``model``'s own class (or a parent of its own) overrides a step or ``call``.

    Raises:
        ProfileError: for a model without a functional graph (a subclassed model), as ``profiles.walk``.
        InputError: naming the class and the overridden methods.

    Example:
        >>> check_steps(keras.Model(inputs, outputs))      # doctest: +SKIP
    """
    functional_graph(model)
    overridden = [
        f"{cls.__name__}.{name}"
        for cls in type(model).__mro__
        if not cls.__module__.startswith("keras.")
        for name in STEPS
        if name in vars(cls)
    ]
    if overridden:
        raise InputError(
            f"Model '{model.name}' is a {type(model).__name__} whose class overrides {', '.join(overridden)}: the "
            "pipelined model runs Keras' own steps over micro-batches and stages, so fit, evaluate and predict "
            "would skip that code. Expected a functional or Sequential model with Keras' steps: move the custom "
            "logic into the loss, a metric or a layer (add_loss), or train this model without wrapping it."
        )
