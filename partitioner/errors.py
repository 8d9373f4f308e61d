"""The one hierarchy of errors the planner, the profiler and the runtime raise.

Every message says what happened, what was expected and how to fix it::

    InfeasiblePlanError: layer 'dense_3' alone needs 5.1 GiB (weights, gradients and 2 optimizer
    slots, activations of 8 micro-batches) but the largest device holds 4.0 GiB.
    Add devices with more memory, lower the batch size, or use mixed precision.
"""

from __future__ import annotations


class PartitionerError(Exception):
    """Base class of every error this project raises on purpose."""


class InputError(PartitionerError, ValueError):
    """An argument has the wrong type or a value that makes no sense (a size of "-3", 0 devices)."""


class ClusterError(InputError):
    """A cluster or device description is malformed (empty, duplicate names, bad bandwidth matrix)."""


class GraphError(PartitionerError, ValueError):
    """A layer graph breaks its contract (missing attributes, a cycle, a corrupt or future-version file)."""


class ProfileError(PartitionerError):
    """A Keras model cannot be profiled (subclassed without a functional graph, not built, ...)."""


class TimingError(ProfileError):
    """A layer traced but could not be run and timed on the timing device (profile without timing instead)."""


class PlanError(PartitionerError, ValueError):
    """A plan is malformed or does not match the graph or cluster it is used with."""


class InfeasiblePlanError(PartitionerError):
    """No placement satisfies the constraints (memory, pins, stage order)."""


class SolverTimeoutError(InfeasiblePlanError):
    """The solver reached its time limit before finding any feasible plan."""


class ScheduleError(PartitionerError, ValueError):
    """A pipeline schedule is malformed or deadlocks (partitioner.schedule); the message draws its grid."""
