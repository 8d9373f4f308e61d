"""A plan's verdict: its status and the bound its gap is measured against, decided by one rule.

Every planner ends here. A plan is judged on the objective it minimised, its step
(``Plan.step_lower_bound_s``) or its bottleneck (``Plan.lower_bound_s``), against a *bound*: a value no
plan the search could have returned beats. A bound that holds only for some of those plans (one pipeline
order's CP-SAT bound when several orders were searched, one replica count's) is not one;
:func:`least_bound` makes one from bounds each over one part of them. The rule:

=============  ====================================================================================
"optimal"      the search proved the plan the best (``proven``: CP-SAT's OPTIMAL, an exhaustive search),
               or its value meets the bound (within ``TOLERANCE``, relative: rounding)
"feasible"     a bound exists and the plan does not meet it
"heuristic"    no bound is known, or the plan was not found by a search (a baseline kept as it is)
=============  ====================================================================================

The bound recorded is capped at the plan's value, so ``Plan.gap`` = (value - bound) / value is in [0, 1].

Example:
    >>> verdict(2.0, 1.0)
    ('feasible', 1.0)
    >>> verdict(2.0, 2.0 * (1 - 1e-12))
    ('optimal', 1.999999999998)
    >>> verdict(2.0, None)
    ('heuristic', None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from partitioner.plan import Plan

TOLERANCE = 1e-9  # relative: a value this close above a bound on it meets it (rounding of sums of floats)


def verdict(
    value: float, bound: float | None, *, proven: bool = False, searched: bool = True
) -> tuple[str, float | None]:
    """The status of a plan whose objective is ``value``, and the bound to record (capped at ``value``).

    Args:
        value: the plan's value on its objective (seconds of step or of bottleneck).
        bound: a lower bound on the value of every plan the search could have returned, or None.
        proven: the search proved ``value`` the least on its own terms (CP-SAT's OPTIMAL, the exact
            chain search finished, every legal plan enumerated).
        searched: False for a plan no search found (a baseline returned as it is): "heuristic" unless
            it meets the bound.

    Returns:
        (status, bound): "optimal", "feasible" or "heuristic" (module docstring), and ``bound`` capped at ``value``.

    Example:
        >>> verdict(3.0, 1.0, proven=True)
        ('optimal', 1.0)
        >>> verdict(3.0, 1.0, searched=False)
        ('heuristic', 1.0)
    """
    if bound is not None:
        bound = min(bound, value)
    if proven or (bound is not None and value <= bound * (1 + TOLERANCE)):
        return "optimal", bound
    return ("feasible" if bound is not None and searched else "heuristic"), bound


def least_bound(bounds: Iterable[float | None]) -> float | None:
    """A bound over the union of several parts of the plans (pipeline orders, replica counts), from one
    bound per part: the least of them; None when one is unknown (None) or none is given.

    Example:
        >>> least_bound([3.0, 2.0]), least_bound([3.0, None]), least_bound([])
        (2.0, None, None)
    """
    found = list(bounds)
    if not found or any(b is None for b in found):
        return None
    return min(b for b in found if b is not None)


def on_bottleneck(plan: Plan, bound: float | None, *, proven: bool = False, searched: bool = True) -> Plan:
    """``plan`` judged on its bottleneck: :func:`verdict` sets its ``status`` and ``lower_bound_s``."""
    status, bound = verdict(plan.bottleneck_s, bound, proven=proven, searched=searched)
    return dataclasses.replace(plan, status=status, lower_bound_s=bound)


def on_step(plan: Plan, bound: float | None, *, proven: bool = False, searched: bool = True) -> Plan:
    """``plan`` judged on its simulated step: :func:`verdict` sets its ``status`` and ``step_lower_bound_s``."""
    status, bound = verdict(plan.step_time_s, bound, proven=proven, searched=searched)
    return dataclasses.replace(plan, status=status, step_lower_bound_s=bound)
