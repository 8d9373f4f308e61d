"""Pictures of a simulated step: a Gantt chart (matplotlib) and a text chart for terminals and logs.

One row per device, forwards and backwards in two colours, each labelled with its micro-batch; one thinner
row per link that carried a transfer (activations forward, gradients back), and per pooled CPU device whose
gradient sums run beside its passes (``accumulate`` spans). matplotlib is imported only
when a picture is drawn, so the planner does not need it.

Example:
    >>> sim = pt.simulate(plan, graph, cluster)                  # doctest: +SKIP
    >>> print(text_timeline(sim, width=60))                      # doctest: +SKIP
    >>> save_timeline(sim, "timeline.png")                       # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from partitioner.errors import InputError
from partitioner.simulate import Simulation, Span
from partitioner.units import format_bytes, format_seconds

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "send_activation": "#55A868",
    "send_gradient": "#C44E52",
    "allreduce": "#8172B3",
    "accumulate": "#937860",
}
SYMBOLS = {
    "forward": "F",
    "backward": "B",
    "send_activation": ">",
    "send_gradient": "<",
    "allreduce": "R",
    "accumulate": "+",
}
LABELS = {
    "forward": "forward",
    "backward": "backward",
    "send_activation": "activation sent",
    "send_gradient": "gradient sent",
    "allreduce": "gradients all-reduced (R)",
    "accumulate": "gradients summed",
}
SUMS = " sums"  # the label of a device's row of gradient sums: the device's name and this


def text_timeline(sim: Simulation, *, width: int = 80) -> str:
    """A text Gantt chart: one line per device and link, ``width`` columns for the whole step.

    A column shows what runs at its midpoint: ``F`` forward, ``B`` backward, ``>`` an activation and
    ``<`` a gradient on a link, ``+`` a stage's gradient sums beside its passes, ``.`` nothing. A summary
    line per device follows.
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 10:
        raise InputError(f"width must be an integer >= 10 columns. Received: {width!r}.")
    rows = _rows(sim)
    label = max(len(r) for r in rows) if rows else 0
    step = sim.step_time_s
    lines = [
        f"{sim.schedule} schedule, {len(sim.stages)} stages x {sim.num_microbatches} micro-batches: "
        f"step {format_seconds(step)}, bubble {100 * sim.bubble_fraction:.1f}%   "
        "(F forward, B backward, > activation, < gradient, + gradients summed, . idle)"
    ]
    for row in rows:
        cells = ["."] * width
        for action in _spans(sim, row):
            if step <= 0:
                continue
            first = int(action.start_s / step * width + 0.5)
            last = int(action.end_s / step * width + 0.5)
            for column in range(first, max(last, first + 1 if action.duration_s > 0 else first)):
                if column < width:
                    cells[column] = SYMBOLS[action.kind]
        lines.append(f"{row:>{label}} |{''.join(cells)}|")
    lines.append("")
    for device in sim.stages:
        lines.append(
            f"{device:>{label}}  busy {format_seconds(sim.busy_s[device])}, idle {format_seconds(sim.idle_s[device])}, "
            f"peak memory {format_bytes(sim.peak_memory_bytes[device])} "
            f"({sim.peak_in_flight[device]} micro-batches in flight)"
        )
    if len(sim.stages) > 1:  # where the devices share one memory (logical CPU devices), what it must hold
        lines.append(f"{'together':>{label}}  peak memory {format_bytes(sim.peak_total_bytes)} at one moment")
    return "\n".join(lines)


def save_timeline(sim: Simulation, path: str | Path, *, title: str | None = None) -> Path:
    """Draws the timeline as a Gantt chart to ``path`` (PNG, SVG or PDF by its suffix); returns the path.

    Raises:
        InputError: when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise InputError(
            "Drawing a timeline needs matplotlib, which keras-partitioner depends on but this environment lacks: "
            "pip install 'matplotlib>=3.8', or write the timeline as text (--timeline -, text_timeline)."
        ) from err
    rows = _rows(sim)
    scale, unit = _time_unit(sim.step_time_s)
    figure, axes = plt.subplots(figsize=(12, 0.9 + 0.45 * len(rows)))
    for index, row in enumerate(rows):
        is_link = row not in sim.stages
        height = 0.4 if is_link else 0.8
        for action in _spans(sim, row):
            start, length = action.start_s * scale, action.duration_s * scale
            axes.broken_barh(
                [(start, length)],
                (index - height / 2, height),
                facecolors=COLOURS[action.kind],
                edgecolor="white",
                linewidth=0.5,
            )
            if not is_link and length > sim.step_time_s * scale / 60:
                axes.text(start + length / 2, index, str(action.microbatch), ha="center", va="center", fontsize=7)
    axes.set_yticks(range(len(rows)), rows)
    axes.invert_yaxis()
    axes.set_xlim(0, max(sim.step_time_s * scale, 1e-12))
    axes.set_xlabel(f"time ({unit})")
    axes.set_title(
        title
        or (
            f"{sim.schedule}: {len(sim.stages)} stages x {sim.num_microbatches} micro-batches, "
            f"step {format_seconds(sim.step_time_s)}, bubble {100 * sim.bubble_fraction:.1f}%"
        )
    )
    kinds = [k for k in COLOURS if any(a.kind == k for a in sim.timeline)]
    axes.legend(
        handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if len(rows) < 6 else -0.12),
        ncol=len(kinds),
        frameon=False,
    )
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def _rows(sim: Simulation) -> list[str]:
    """The chart's rows: the devices, the links that carried a transfer, the devices that summed beside."""
    summed = [f"{d}{SUMS}" for d in sim.stages if any(a.kind == "accumulate" for a in sim.actions_on(d))]
    return [*sim.stages, *sim.links, *summed]


def _spans(sim: Simulation, row: str) -> list[Span]:
    """The spans a row shows: a device's passes (and R), a link's transfers, or a device's gradient sums."""
    if row.endswith(SUMS) and row not in sim.stages:
        return [a for a in sim.actions_on(row[: -len(SUMS)]) if a.kind == "accumulate"]
    return [a for a in sim.actions_on(row) if a.kind != "accumulate"]


def _time_unit(seconds: float) -> tuple[float, str]:
    """A scale and unit that make the step a readable number."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"
