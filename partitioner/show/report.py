"""Renders a plan for people: placement table, per-device summary, transfers and the prediction."""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx
from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from partitioner.plan import Plan
from partitioner.search.replicas import ReplicaCandidate, ReplicaChoice
from partitioner.units import format_bytes, format_flops, format_seconds


class FittedTable:
    """A table that leaves out its least important columns, rather than cutting names, when the console is narrow.

    rich shrinks every column of a table that is too wide, so layer names end in '…' (or fold one letter
    a line); this keeps the first column and ``keep`` whole, drops columns in ``drop_order`` until the
    rest fits, and says in a caption what it left out.

    Example:
        >>> table = FittedTable("Placement", [("layer", "left"), ("stage", "right")], [["conv1", "0"]], ["stage"])
        >>> Console(width=20).print(table)                       # doctest: +SKIP
    """

    def __init__(
        self,
        title: str,
        columns: list[tuple[str, str]],
        rows: list[list[str]],
        drop_order: list[str],
        *,
        keep: tuple[str, ...] = (),
    ) -> None:
        self.title, self.columns, self.rows, self.drop_order, self.keep = title, columns, rows, drop_order, keep

    def table(self, left_out: Iterable[str] = ()) -> Table:
        """The table without the columns in ``left_out``."""
        dropped = set(left_out)
        caption = f"left out to fit the terminal's width: {', '.join(left_out)}" if dropped else None
        table = Table(
            title=self.title, caption=caption, box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left"
        )
        shown = [k for k, (header, _) in enumerate(self.columns) if header not in dropped]
        for k in shown:
            header, justify = self.columns[k]
            first = k == 0  # the name column folds only when it alone is wider than the console
            table.add_column(
                header,
                justify=justify,  # type: ignore[arg-type]
                no_wrap=not first and header in self.keep,
                overflow="fold" if first else "ellipsis",
            )
        for row in self.rows:
            table.add_row(*(row[k] for k in shown))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update_width(1_000_000)  # the natural width, not clamped to the console's

        def fits(left_out: list[str]) -> bool:
            return Measurement.get(console, unbounded, self.table(left_out)).maximum <= options.max_width

        left_out: list[str] = []
        for header in self.drop_order:
            if fits(left_out):
                break
            left_out.append(header)
        for header in reversed(left_out[:-1]):  # a narrow column dropped early may fit beside the rest
            if fits([h for h in left_out if h != header]):
                left_out.remove(header)
        yield self.table(left_out)


def placement_table(plan: Plan, graph: nx.DiGraph) -> FittedTable:
    """One row per node: layer, type, parameters, FLOPs, activation, stage and device.

    Layer and device names are never cut: on a narrow terminal the stage (also in the device table),
    type, FLOPs, activation and parameter columns are left out in that order until the table fits,
    and a caption says so.
    """
    stage_of = {d: k for k, d in enumerate(plan.stages)}
    columns = [
        ("layer", "left"),
        ("type", "left"),
        ("params", "right"),
        ("FLOPs", "right"),
        ("activation", "right"),
        ("stage", "right"),
        ("device", "left"),
    ]
    rows = []
    for node, device in plan.assignment.items():
        data = graph.nodes[node]
        rows.append(
            [
                escape(str(node)),
                escape(str(data.get("layer_type", ""))),
                format_bytes(data["param_bytes"]) if data["param_bytes"] else "-",
                format_flops(data["flops"]) if data["flops"] else "-",
                format_bytes(data["activation_bytes"]) if data["activation_bytes"] else "-",
                str(stage_of[device]),
                escape(device),
            ]
        )
    drop_order = ["stage", "type", "FLOPs", "activation", "params"]
    return FittedTable("Placement", columns, rows, drop_order, keep=("device",))


def device_table(plan: Plan) -> Table:
    """One row per device: nodes, memory used of capacity, compute, receive, stage time, utilisation."""
    table = Table(title="Devices (times per micro-batch)", box=box.SIMPLE_HEAD, title_justify="left")
    for header in ("stage", "device", "layers", "memory", "capacity", "compute", "receive", "stage time", "busy"):
        table.add_column(header, justify="left" if header == "device" else "right")
    stage_of = {d: k for k, d in enumerate(plan.stages)}
    for device in plan.devices:
        nodes = plan.nodes_on(device)
        used, held = plan.memory_bytes[device], plan.capacity_bytes[device]
        memory = f"{format_bytes(used)} ({100 * used / held:.0f}%)"
        busy = plan.stage_times[device] / plan.bottleneck_s if plan.bottleneck_s > 0 else 0.0
        table.add_row(
            str(stage_of[device]) if device in stage_of else "-",
            device,
            str(len(nodes)),
            memory if used <= held else f"[bold red]{memory}[/]",
            format_bytes(held),
            format_seconds(plan.compute_times[device]),
            format_seconds(plan.receive_times[device]),
            format_seconds(plan.stage_times[device]),
            f"{100 * busy:.0f}%" if nodes else "-",
        )
    return table


def transfers(plan: Plan, graph: nx.DiGraph) -> list[tuple[str, str, int, int]]:
    """Returns (sender, receiver, tensors, bytes per micro-batch) for every pair of devices that talk."""
    pairs: dict[tuple[str, str], tuple[int, int]] = {}
    for node, device in plan.assignment.items():
        sizes: dict[str, int] = {}
        for _, succ, size in graph.out_edges(node, data="bytes"):
            receiver = plan.assignment[succ]
            if receiver != device:
                sizes[receiver] = max(sizes.get(receiver, 0), int(size))
        for receiver, size in sizes.items():
            count, total = pairs.get((device, receiver), (0, 0))
            pairs[(device, receiver)] = (count + 1, total + size)
    order = {d: k for k, d in enumerate(plan.devices)}
    return [
        (a, b, count, total)
        for (a, b), (count, total) in sorted(pairs.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]]))
    ]


def transfer_table(plan: Plan, graph: nx.DiGraph) -> Table:
    """One row per link in use: sender, receiver, tensors and bytes per micro-batch."""
    table = Table(title="Transfers between stages (per micro-batch)", box=box.SIMPLE_HEAD, title_justify="left")
    for header in ("from", "to", "tensors", "bytes"):
        table.add_column(header, justify="right" if header in ("tensors", "bytes") else "left")
    for sender, receiver, count, total in transfers(plan, graph):
        table.add_row(sender, receiver, str(count), format_bytes(total))
    if not table.rows:
        table.add_row("-", "-", "0", "0 B")
    return table


def summary_table(plan: Plan) -> Table:
    """The prediction: schedule, bottleneck, step time, bubble, speedup, the proven bounds on the bottleneck
    and the step, and the solver's status and gap (on the objective it minimised, ``Plan.objective``)."""
    table = Table(title="Prediction", box=box.SIMPLE_HEAD, show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    gap = plan.gap
    rows = [
        ("method / status", f"{plan.method} / {plan.status}"),
        ("schedule", plan.schedule),
        ("stages (K) x micro-batches (M)", f"{plan.num_stages} x {plan.num_microbatches}"),
        ("bottleneck stage time", format_seconds(plan.bottleneck_s)),
        (
            "proven lower bound on the bottleneck",
            format_seconds(plan.lower_bound_s) if plan.lower_bound_s is not None else "none",
        ),
        (f"predicted step time ({plan.schedule}, simulated)", format_seconds(plan.step_time_s)),
        *(
            [("with the step's own work (+ measured overhead)", format_seconds(plan.predicted_step_s))]
            if plan.step_overhead_s
            else []
        ),
        (
            "proven lower bound on the step",
            format_seconds(plan.step_lower_bound_s) if plan.step_lower_bound_s is not None else "none",
        ),
        (f"gap to the bound on the {plan.objective}", f"{100 * gap:.2f}%" if gap is not None else "unknown"),
        (
            "fill-drain bound (M + K - 1) x bottleneck",
            format_seconds(plan.fill_drain_step_s) if plan.fill_drain_step_s is not None else "unknown",
        ),
        ("bubble fraction (K - 1) / (M + K - 1)", f"{100 * plan.bubble_fraction:.1f}%"),
        ("speedup over the fastest single device", f"{plan.speedup:.2f}x"),
        ("bytes sent per micro-batch", format_bytes(plan.transfer_bytes)),
        ("fits in memory", "yes" if plan.fits_memory else "[bold red]no[/]"),
        ("solve time", format_seconds(plan.solve_time_s)),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def comparison_table(plans: Iterable[Plan]) -> Table:
    """The same model split by several methods, side by side."""
    table = Table(title="Against the splits other tools use", box=box.SIMPLE_HEAD, title_justify="left")
    for header in ("method", "bottleneck", "step time", "speedup", "max memory", "fits"):
        table.add_column(header, justify="left" if header == "method" else "right")
    for plan in plans:
        table.add_row(
            plan.method,
            format_seconds(plan.bottleneck_s),
            format_seconds(plan.step_time_s),
            f"{plan.speedup:.2f}x",
            format_bytes(max(plan.memory_bytes.values())),
            "yes" if plan.fits_memory else "[red]no[/]",
        )
    return table


def replica_table(choice: ReplicaChoice) -> Table:
    """Every D x K the replica search tried: its step, the longest all-reduce, M, schedule, memory, or why none."""
    table = Table(title="Replicas x stages", box=box.SIMPLE_HEAD, title_justify="left")
    for header in ("D x K", "layout", "M", "schedule", "step time", "all-reduce", "max memory", "note"):
        table.add_column(header, justify="left" if header in ("D x K", "layout", "note") else "right")
    for candidate in choice.candidates:
        plan = candidate.plan
        label = f"{candidate.num_replicas} x {candidate.devices_per_replica}"
        if plan is None:
            what = "no plan in time" if candidate.timed_out else "no plan"
            table.add_row(label, candidate.layout, "", "", "", "", "", f"[red]{what}[/]: {escape(candidate.reason)}")
            continue
        chosen = plan.replica_devices == choice.plan.replica_devices and plan.assignment == choice.plan.assignment
        table.add_row(
            f"[bold]{label}[/]" if chosen else label,
            candidate.layout,
            str(plan.num_microbatches),
            plan.schedule,
            format_seconds(plan.step_time_s),
            format_seconds(max(plan.reduce_times.values(), default=0.0)),
            format_bytes(max(plan.memory_bytes.values())),
            _kind(candidate) + (", chosen" if chosen else ""),
        )
    return table


def _kind(candidate: ReplicaCandidate) -> str:
    if candidate.num_replicas == 1:
        return "pipeline"
    return "data parallel" if candidate.plan is not None and candidate.plan.num_stages == 1 else "hybrid"


def replica_note(choice: ReplicaChoice) -> str:
    """Why the chosen D x K: its step beside pure data parallelism's and a pure pipeline's."""
    plan = choice.plan
    lines = [
        f"Chosen: {plan.num_replicas} replica(s) of {plan.num_stages} stage(s), the shortest predicted step "
        f"({format_seconds(plan.step_time_s)}, status {plan.status}); replicas on "
        + "; ".join(", ".join(group) for group in (plan.replica_devices or (plan.devices,)))
        + "."
    ]
    kinds = (
        ("Pure data parallel (one device per replica)", [c for c in choice.candidates if c.devices_per_replica == 1]),
        ("One pipeline (D = 1)", [c for c in choice.candidates if c.num_replicas == 1]),
    )
    for what, tried in kinds:
        fitting = [c.plan for c in tried if c.plan is not None]
        if fitting:
            lines.append(f"{what}: {format_seconds(min(p.step_time_s for p in fitting))}.")
        elif tried:
            in_time = " in time" if all(c.timed_out for c in tried) else ""
            lines.append(f"{what}: no plan{in_time} ({tried[0].reason}).")
        else:
            lines.append(f"{what}: not tried (the number of replicas was fixed, or does not divide the batch).")
    lines.append(
        "Each stage's all-reduce runs after its last backward (not overlapped), a ring paced by its slowest link. "
        "The runtime runs each replica in one worker process on one machine (partitioner launch --workers D "
        "--devices-per-worker K): a replica whose devices span machines is priced here, not yet run."
    )
    return "\n".join(lines)


def render(plan: Plan, graph: nx.DiGraph, baselines: Iterable[Plan] = (), *, placement: bool = True) -> Group:
    """Everything a person needs to judge a plan, as one rich renderable."""
    parts: list[Table | FittedTable] = [placement_table(plan, graph)] if placement else []
    parts += [device_table(plan), transfer_table(plan, graph), summary_table(plan)]
    others = list(baselines)
    if others:
        parts.append(comparison_table([plan, *others]))
    return Group(*parts)
