"""The ``partitioner`` command: profile a Keras model, plan its split, print the placement tables.

    partitioner plan ResNet50 --devices 4 --memory 2GiB
    partitioner plan model.keras --cluster 8xH100-nvlink --micro-batches 16 --out plan.json
    partitioner plan profile.json --devices 4 --memory 16GiB --json
    partitioner plan profile.json --cluster 8xH100-nvlink --batch-size 256 --micro-batches 16  # rescaled
    partitioner plan ResNet50 --cluster 4xA100-nvlink --timeline timeline.png   # or --timeline - for text
    partitioner plan ResNet50 --devices 4 --memory 2GiB --schedule 1f1b         # fewer activations held
    partitioner plan ResNet50 --devices 4 --memory 1GiB --recompute auto        # recompute where it must
    partitioner plan profile.json --cluster 4xA100-nvlink --batch-size 256 --micro-batches auto --schedule auto
    partitioner placement ResNet50 --devices 2 --input-size 64                  # where one step's ops ran
    partitioner profile InceptionV3 --batch-size 64 --out profile.json
    partitioner calibrate --devices 2 --out cluster.json                     # measure the local devices

Errors print one line on stderr, never a traceback: what happened, what was expected, how to fix it.
The exit status is 2 for what the user can fix (arguments, files, a model that does not load or
build), 1 for a failure inside this library or Keras (``--traceback`` shows where).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import networkx as nx
from rich.console import Console
from rich.markup import escape

from partitioner.cluster import (
    DEFAULT_BANDWIDTH,
    DEFAULT_FLOPS_PER_S,
    DEFAULT_MEMORY_HEADROOM,
    Cluster,
    bundled_clusters,
    subset,
)
from partitioner.errors import InfeasiblePlanError, InputError, PartitionerError
from partitioner.graph import load_graph, micro_batch_size, rescale_graph, save_graph
from partitioner.plan import Plan
from partitioner.problem import RECOMPUTE, Reductions
from partitioner.schedule import SCHEDULES
from partitioner.search import baselines as baseline_methods
from partitioner.search.choose import AUTO, Choice, choose, timed_sizes
from partitioner.search.options import SolverOptions
from partitioner.search.order import DEVICE_ORDERS
from partitioner.search.replicas import plan_replicas
from partitioner.search.solve import solve
from partitioner.show.report import render, replica_note, replica_table
from partitioner.show.timeline import save_timeline, text_timeline
from partitioner.simulate import simulate
from partitioner.units import format_seconds, parse_rate
from partitioner.validate import validate_plan

OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "momentum": 1, "sgd": 0}
DEFAULT_BATCH_SIZE = 32
DEFAULT_MICROBATCHES = 8
INSTALL_HINT = "pip install 'keras-partitioner[cpu]' (or [gpu] on a machine with an NVIDIA GPU)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partitioner",
        description="Split a Keras model across devices as a pipeline: profile, plan, inspect.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    model_help = (
        "a .keras file (safe mode), a keras.applications name such as ResNet50 (weights=None), "
        "module:function returning a model (the current directory is searched first)"
    )
    plan = commands.add_parser("plan", help="plan the split of a model and print the placement tables")
    plan.add_argument("model", help=model_help + ", or a profile .json written by 'partitioner profile'")
    where = plan.add_argument_group("devices (a bundled or JSON cluster, or N identical devices)")
    where.add_argument("--cluster", help=f"cluster JSON file or bundled name: {', '.join(bundled_clusters())}")
    where.add_argument("--devices", type=int, help="number of identical devices")
    where.add_argument("--memory", help="memory per device, e.g. 16GiB (with --devices)")
    where.add_argument(
        "--flops-per-s", default=str(DEFAULT_FLOPS_PER_S), help="sustained FLOP/s per device (default: %(default)s)"
    )
    where.add_argument(
        "--bandwidth", default=str(DEFAULT_BANDWIDTH), help="bytes/s of every link, e.g. 50GB/s (default: %(default)s)"
    )
    where.add_argument(
        "--action-overhead-s",
        type=float,
        default=0.0,
        help="fixed seconds each forward or backward of a stage costs per micro-batch, e.g. 20e-6: what makes more "
        "micro-batches not free (default: %(default)s)",
    )
    where.add_argument(
        "--memory-headroom",
        type=float,
        default=DEFAULT_MEMORY_HEADROOM,
        metavar="FRACTION",
        help="share of each device's memory the plan leaves free for what the planner does not price (the "
        "framework's workspace, the allocator's rounding, the batch); 0 plans into all of it (default: %(default)s)",
    )
    _add_profile_options(plan)
    _add_traceback_option(plan)
    plan.add_argument(
        "--optimizer", choices=sorted(OPTIMIZER_SLOTS), default="adam", help="sets optimizer slots (default: adam)"
    )
    plan.add_argument("--cost", choices=("flops", "time"), default="flops", help="compute times from FLOPs or measured")
    plan.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in seconds (default: 10)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON only (for scripts)")
    plan.add_argument("--out", help="also write the plan JSON to this file")
    plan.add_argument("--no-compare", action="store_true", help="skip the comparison with baseline splits")
    plan.add_argument("--summary", action="store_true", help="omit the per-layer placement table")
    plan.add_argument(
        "--timeline",
        metavar="PATH",
        help="simulate the step and draw its timeline: a .png/.svg/.pdf Gantt chart, or - to print it as text",
    )
    plan.add_argument(
        "--schedule",
        choices=(*SCHEDULES, AUTO),
        default="gpipe",
        help="pipeline schedule to plan for (activation memory), simulate and draw; auto: the planner picks the "
        "one of the shorter step (default: gpipe)",
    )
    plan.add_argument(
        "--replicas",
        type=_microbatches,
        metavar="D",
        help="data x pipeline: D copies of the pipeline, each on N // D devices, their gradients all-reduced after "
        "each step; auto: the planner tries every D that divides the batch (D = N is pure data parallelism, 1 a "
        "pure pipeline) and prints each one's predicted step (default: one pipeline on every device)",
    )
    plan.add_argument(
        "--workers",
        type=int,
        metavar="D",
        help="plan the pipeline of one of D workers that train it data parallel (partitioner launch --workers D, "
        "runtime.wrap(..., replicas=D)): each stage's memory counts the packed copy of its gradients its "
        "all-reduce takes; the cluster holds one worker's devices and the batch is one worker's (default: 1)",
    )
    plan.add_argument(
        "--worker-bandwidth",
        metavar="BW",
        help="with --workers: bytes/s of the link between the workers, e.g. 25GB/s; each stage's all-reduce with "
        "the other workers (a ring at BW) is then in the predicted step (default: left out)",
    )
    plan.add_argument(
        "--device-order",
        choices=DEVICE_ORDERS,
        default="search",
        help="search: the planner chooses which device runs which stage (and which stay idle); given: stages "
        "follow the cluster's order, for pipelines wired by hand (default: search)",
    )
    plan.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="never",
        help="re-run stage forwards in the backward instead of keeping activations: never, always (every stage "
        "but the last) or auto (only where they would not fit) (default: never)",
    )

    placed = commands.add_parser(
        "placement",
        help="wrap a model on N local devices (virtual CPU devices if needed), run one training step on random "
        "data and show where each stage's forward, backward and optimizer ops ran",
    )
    placed.add_argument("model", help=model_help)
    placed.add_argument("--devices", type=int, default=2, help="number of local devices (default: 2)")
    placed.add_argument("--memory", default="4GiB", help="capacity per device where it reports none (default: 4GiB)")
    placed.add_argument("--plan", help="use this plan JSON instead of planning (its devices must exist here)")
    placed.add_argument(
        "--schedule", choices=SCHEDULES, help="pipeline schedule (default: gpipe, or the plan's with --plan)"
    )
    placed.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="auto",
        help="which stages re-run their forward in the backward (default: auto, or the plan's with --plan)",
    )
    _add_profile_options(placed)
    _add_traceback_option(placed)

    launch = commands.add_parser(
        "launch",
        help="run a training program as D worker processes (data x pipeline parallel), as torchrun does",
        description="Starts D workers of PROGRAM on this machine, each with its TF_CONFIG (free ports) and its "
        "devices; stops all on the first failure; restarts all up to --max-restarts times. In the program, "
        "call runtime.start_worker() first.",
    )
    launch.add_argument("--workers", type=int, required=True, help="D: worker processes, one per pipeline replica")
    launch.add_argument(
        "--devices-per-worker",
        type=int,
        help="K: devices of each worker (logical CPU devices, or its own K GPUs via CUDA_VISIBLE_DEVICES)",
    )
    launch.add_argument("--max-restarts", type=int, default=0, help="restart every worker up to R times (default 0)")
    launch.add_argument("--timeout", type=float, help="stop everything after S seconds; exit status 124")
    launch.add_argument("--log-dir", help="write each worker's output to DIR/worker-<i>.log as well")
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- then the command each worker runs")

    calibrate = commands.add_parser(
        "calibrate",
        help="measure the local devices (the GPUs, else logical CPU devices) and write a cluster file to keep and "
        "edit: FLOP/s, the fixed cost of a pass, the bandwidth between two devices, memory; each with its source",
    )
    calibrate.add_argument(
        "--devices", type=int, default=2, help="number of local devices (logical CPU devices if needed) (default: 2)"
    )
    calibrate.add_argument("--memory", help="memory per device, e.g. 8GiB (default: a GPU's limit, or RAM / N)")
    calibrate.add_argument("--out", required=True, help="the cluster JSON file to write")
    _add_traceback_option(calibrate)

    profile = commands.add_parser("profile", help="profile a model into a layer graph JSON")
    profile.add_argument("model", help=model_help)
    _add_profile_options(profile)
    _add_traceback_option(profile)
    profile.add_argument(
        "--no-time",
        action="store_true",
        help="skip measuring per-layer times, their part that one sample costs and the step's own work (faster)",
    )
    profile.add_argument("--out", help="write the layer graph JSON here (default: print a summary only)")
    return parser


def _add_profile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"global batch size (default: {DEFAULT_BATCH_SIZE}; for a profile .json, the batch it was profiled at, "
        "and another size rescales its costs)",
    )
    parser.add_argument(
        "--micro-batches",
        type=_microbatches,
        help=f"micro-batches per step, M: the batch is split into M, or auto: the planner picks M among the "
        f"divisors of the batch size, the fewest within 5% of the shortest step (default: {DEFAULT_MICROBATCHES}; "
        "for a profile .json, its own)",
    )
    parser.add_argument("--input-size", type=int, help="input height/width for keras.applications models")
    parser.add_argument(
        "--input-shape",
        action="append",
        metavar="NAME=SIZE[xSIZE...]",
        help="the shape to plan for of an input whose size the model leaves open, without the batch axis, "
        "e.g. token_ids=128 (repeat for each input)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        help="the size to plan for of every unknown non-batch dimension of every input (keras-hub models)",
    )


def _microbatches(text: str) -> int | str:
    """--micro-batches: an integer, or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _shape_options(args: argparse.Namespace) -> dict[str, Any]:
    """The input_shapes= and sequence_length= arguments of profile_model and plan_and_wrap, from the flags."""
    from profiles.shapes import parse_input_shape

    shapes = dict(parse_input_shape(text) for text in args.input_shape or [])
    return {"input_shapes": shapes or None, "sequence_length": args.sequence_length}


def _add_traceback_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traceback", action="store_true", help="on an error, show the full Python traceback")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 on a user error, 1 on a failure inside the library)."""
    args = _parser().parse_args(argv)
    if args.command == "launch":
        return _launch(args)
    modelled = args.command != "calibrate"  # calibrate has no model; a profile .json brings its own batch
    if modelled and not (args.command == "plan" and args.model.endswith(".json")):
        args.batch_size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
        args.micro_batches = DEFAULT_MICROBATCHES if args.micro_batches is None else args.micro_batches
    err = Console(stderr=True)
    try:
        if args.command == "plan":
            return _plan(args, err)
        if args.command == "placement":
            return _placement(args, err)
        if args.command == "calibrate":
            return _calibrate(args, err)
        return _profile(args, err)
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as error:
        if args.traceback:
            raise
        if isinstance(error, PartitionerError):
            _print_error(err, str(error))
            return 2
        if isinstance(error, OSError):  # a file that cannot be read or written: the message names it
            _print_error(err, f"{type(error).__name__}: {error}")
            return 2
        _print_error(
            err,
            f"'{_command(args)}' failed inside keras-partitioner or Keras: "
            f"{type(error).__name__}: {_one_line(error)}. This is a bug or a model this version does not support; "
            "rerun with --traceback to see where, and report it with the model.",
        )
        return 1


def _launch(args: argparse.Namespace) -> int:
    """``partitioner launch``: the first failing worker's status, 2 on bad options."""
    from partitioner.launch import LaunchOptions, launch

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    try:
        options = LaunchOptions(
            args.workers,
            devices_per_worker=args.devices_per_worker,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
            log_dir=args.log_dir,
        )
        return launch(program, options)
    except InputError as error:
        _print_error(Console(stderr=True), str(error))
        return 2


def _command(args: argparse.Namespace) -> str:
    """The command as the user typed its first words: 'partitioner plan ResNet50', 'partitioner calibrate'."""
    return " ".join(("partitioner", args.command, *([args.model] if getattr(args, "model", None) else [])))


def _print_error(err: Console, message: str) -> None:
    """Prints ``error: message``; the message is text, never rich markup (a hint such as '[cpu]' stays)."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _one_line(error: BaseException) -> str:
    """An exception from Keras or user code as one line (Keras' messages span many)."""
    return " ".join(str(error).split()).rstrip(".")


def _stdout() -> Console:
    """A console that keeps tables on one line each when output goes to a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 140))


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        if args.devices or args.memory or args.action_overhead_s:
            raise InputError(
                "Pass either --cluster or --devices/--memory (and --action-overhead-s), not both; a cluster file "
                "gives each device's action_overhead_s."
            )
        return Cluster.from_json(args.cluster).with_headroom(args.memory_headroom)
    if args.devices is None or args.memory is None:
        raise InputError(
            "Say which devices to plan for: --devices N --memory SIZE (e.g. --devices 4 --memory 16GiB) "
            f"or --cluster with a JSON file or one of {bundled_clusters()}."
        )
    return Cluster.uniform(
        args.devices,
        memory=args.memory,
        flops_per_s=args.flops_per_s,
        bandwidth=args.bandwidth,
        action_overhead_s=args.action_overhead_s,
    ).with_headroom(args.memory_headroom)


def _require_tensorflow(args: argparse.Namespace) -> None:
    """Imports TensorFlow and Keras, or says how to install them (they are extras: the planner needs neither)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    except ImportError as error:
        raise InputError(
            f"'{_command(args)}' "
            + ("measures devices with TensorFlow" if args.command == "calibrate" else "builds a Keras model")
            + ", which needs TensorFlow and Keras 3, "
            f"but they cannot be imported here ({error}). Install them with {INSTALL_HINT}, "
            "or plan from a profile .json written by 'partitioner profile' on a machine that has them."
        ) from error


def _load_model(args: argparse.Namespace, err: Console) -> Any:
    """Loads or builds the user's model; anything that goes wrong there is the user's to fix (status 2).

    For ``module:function``, the current directory is searched first, as ``python -m`` does, so
    ``partitioner plan mymodels:build`` finds ``./mymodels.py``.
    """
    import keras

    from profiles.loader import load_model

    spec = args.model
    if ":" in spec and not spec.endswith(".keras") and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with err.status(f"building {escape(spec)} ..."):
            model = load_model(spec, input_size=args.input_size)
    except PartitionerError:
        raise
    except Exception as error:
        raise InputError(
            f"Building the model '{spec}' raised {type(error).__name__}: {_one_line(error)}. Expected "
            + (
                f"'{spec}' to import and return a keras.Model"
                if ":" in spec and not spec.endswith(".keras")
                else "a model Keras can build with these arguments"
            )
            + "; fix it and try again (--traceback shows where it failed)."
        ) from error
    if not isinstance(model, keras.Model):
        raise InputError(
            f"'{spec}' returned {type(model).__name__}, not a Keras model. "
            "Expected a function that returns a keras.Model (functional or Sequential); return the model itself."
        )
    return model


def _profile_graph(args: argparse.Namespace) -> nx.DiGraph:
    """A profile .json's layer graph, rescaled to --batch-size split into --micro-batches where they are given.

    Costs in a profile are per micro-batch of the batch it was profiled at (``micro_batch_size``);
    without either flag they are used as they are, with the profile's M (8 if it records none).
    """
    graph = load_graph(args.model)
    if args.micro_batches == AUTO:  # choose() rescales to each candidate M
        _check_batch_recorded(graph, args)
        return graph
    if args.batch_size is None and args.micro_batches is None:
        graph.graph.setdefault("num_microbatches", DEFAULT_MICROBATCHES)
        return graph
    if micro_batch_size(graph) is None:
        given = " and ".join(
            flag
            for flag, value in (("--batch-size", args.batch_size), ("--micro-batches", args.micro_batches))
            if value is not None
        )
        raise InputError(
            f"'{args.model}' does not record the batch size its costs were measured at, so {given} cannot rescale "
            "them. Profile the model again with 'partitioner profile' (it records the batch), or drop "
            f"{given} to plan with its costs as they are (one micro-batch's each, M = {DEFAULT_MICROBATCHES})."
        )
    batch_size = (
        args.batch_size if args.batch_size is not None else graph.graph.get("batch_size", micro_batch_size(graph))
    )
    num_microbatches = args.micro_batches
    if num_microbatches is None:
        num_microbatches = graph.graph.get("num_microbatches", DEFAULT_MICROBATCHES)
    return rescale_graph(graph, batch_size=batch_size, num_microbatches=num_microbatches)


def _check_batch_recorded(graph: nx.DiGraph, args: argparse.Namespace) -> None:
    """InputError unless a profile's batch can be split into micro-batches of --micro-batches auto."""
    if micro_batch_size(graph) is None:
        raise InputError(
            f"'{args.model}' does not record the batch size its costs were measured at, so --micro-batches auto "
            "cannot rescale them to each M. Profile the model again with 'partitioner profile' (it records the "
            "batch), or pass an integer --micro-batches."
        )
    if args.batch_size is None and graph.graph.get("batch_size") is None:
        raise InputError(
            f"--micro-batches auto needs the global batch size, and '{args.model}' records none. Pass --batch-size."
        )


def _graph(args: argparse.Namespace, err: Console, *, measure_time: bool, measure_fixed_time: bool) -> nx.DiGraph:
    if args.model.endswith(".json"):
        return _profile_graph(args)
    _require_tensorflow(args)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from profiles import profile_model

    model = _load_model(args, err)
    columns = (TextColumn("profiling {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task(model.name, total=None)

        def update(done: int, total: int, name: str) -> None:
            progress.update(task, completed=done, total=total)

        return profile_model(
            model,
            batch_size=args.batch_size,
            num_microbatches=1 if args.micro_batches == AUTO else args.micro_batches,  # auto: the whole batch
            measure_time=measure_time,
            progress=update,
            measure_fixed_time=measure_time and measure_fixed_time,
            # and at the micro-batch sizes auto weighs: a device's speed changes with the rows
            time_samples=timed_sizes(args.batch_size) if measure_time and measure_fixed_time else (),
            **_shape_options(args),
        )


def _plan(args: argparse.Namespace, err: Console) -> int:
    if args.timeline == "-" and args.json:
        raise InputError("--json prints only the plan; write the timeline to a file (--timeline timeline.png).")
    if args.timeline not in (None, "-") and Path(args.timeline).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise InputError(f"--timeline takes a .png, .svg or .pdf file, or - for text. Received: {args.timeline!r}.")
    if args.workers is not None and args.workers < 1:
        raise InputError(
            f"--workers takes the number of workers D >= 1 that run the pipeline. Received: {args.workers}."
        )
    if args.worker_bandwidth is not None and (args.workers or 1) < 2:
        raise InputError(
            "--worker-bandwidth prices the all-reduce between workers; it needs --workers D with D >= 2. "
            f"Received: --worker-bandwidth {args.worker_bandwidth} with --workers {args.workers}."
        )
    link = None if args.worker_bandwidth is None else parse_rate(args.worker_bandwidth, name="--worker-bandwidth")
    if args.workers is not None and args.replicas is not None:
        raise InputError(
            "--replicas splits this cluster's devices into D pipelines; --workers plans one worker's pipeline of D "
            "(the cluster file holds that worker's devices). Give one of them."
        )
    cluster = _cluster(args)
    # auto M from timed layers: each M is priced by rescaling, which needs the part of a layer's time one
    # sample costs too (else small micro-batches look free), and the step's own work
    graph = _graph(args, err, measure_time=args.cost == "time", measure_fixed_time=args.micro_batches == AUTO)
    options: dict[str, Any] = {
        "optimizer_slots": OPTIMIZER_SLOTS[args.optimizer],
        "cost": args.cost,
        "recompute": args.recompute,
    }
    chosen = ""
    if args.replicas is not None:
        return _plan_replicas(args, err, cluster, graph, options)
    if args.workers is not None:
        options["num_replicas"] = args.workers
        if link is not None:  # each stage's all-reduce over the workers' link: the search weighs it
            options["reductions"] = Reductions.between_workers(cluster, args.workers, link)
    with err.status(f"planning {graph.number_of_nodes()} layers on {cluster.num_devices} devices ..."):
        search = SolverOptions(device_order=args.device_order)
        try:
            if AUTO in (args.micro_batches, args.schedule):
                microbatches = graph.graph["num_microbatches"] if args.micro_batches is None else args.micro_batches
                choice = choose(
                    graph,
                    cluster,
                    batch_size=args.batch_size,
                    num_microbatches=microbatches,
                    schedule=args.schedule,
                    time_limit_s=args.time_limit,
                    options=search,
                    **options,
                )
                plan, graph = choice.plan, choice.graph
                chosen = _choice_note(choice)
            else:
                options.update(num_microbatches=int(graph.graph["num_microbatches"]), schedule=args.schedule)
                plan = solve(graph, cluster, time_limit_s=args.time_limit, options=search, **options)
        except InfeasiblePlanError as error:
            raise cluster.headroom_note(error) from None
    options.update(num_microbatches=plan.num_microbatches, schedule=plan.schedule)
    validate_plan(plan, graph, cluster)
    if args.out:
        Path(args.out).write_text(plan.to_json())
    simulation = simulate(plan, graph, cluster, schedule=plan.schedule) if args.timeline else None
    if simulation is not None and args.timeline != "-":
        save_timeline(simulation, args.timeline)
    if args.json:
        print(plan.to_json())
        return 0
    others: list[Plan] = []
    if not args.no_compare and cluster.num_devices <= graph.number_of_nodes():
        # compared on the same step: each with the workers' all-reduce, where their link is given
        others = [method(graph, cluster, **options) for method in baseline_methods.BASELINES.values()]
    out = _stdout()
    name = graph.graph.get("model_name", args.model)
    out.print(
        f"[bold]{escape(str(name))}[/]: {graph.number_of_nodes()} layers on {escape(cluster.name)} "
        f"({cluster.num_devices} devices), {plan.schedule} schedule"
        + _batch_note(graph)
        + "".join(f"; stage {s} recomputes its forward" for s, again in enumerate(plan.recompute) if again)
    )
    if cluster.memory_headroom:
        out.print(
            f"Capacities leave {cluster.memory_headroom:.0%} of each device's memory free "
            f"(--memory-headroom {cluster.memory_headroom:g}).",
            highlight=False,
            markup=False,
        )
    if chosen:
        out.print(chosen, highlight=False, markup=False)
    if plan.priced_replicas > 1:
        reduced = max(plan.reduce_times.values(), default=0.0)
        timed = (
            f"each stage's all-reduce between the workers at {link / 1e9:g} GB/s is in "
            f"the step (the longest {format_seconds(reduced)})"
            if link is not None
            else "the all-reduce's time between the workers is not in the step (their link is not in this "
            "cluster: give it with --worker-bandwidth)"
        )
        out.print(
            f"The pipeline of one of {plan.priced_replicas} workers: each stage's memory counts the packed copy of "
            f"its gradients its all-reduce takes; {timed}. Run it with runtime.wrap(model, plan, "
            f"replicas={plan.priced_replicas}) in each of `partitioner launch --workers {plan.priced_replicas}`.",
            highlight=False,
            markup=False,
        )
    out.print(render(plan, graph, others, placement=not args.summary))
    if simulation is not None and args.timeline == "-":
        out.print(text_timeline(simulation, width=max(40, min(out.width - 30, 120))), highlight=False, markup=False)
    elif simulation is not None:
        out.print(f"timeline written to {args.timeline}", highlight=False, markup=False)
    if args.out:
        out.print(f"plan written to {args.out}", highlight=False, markup=False)
    return 0


def _plan_replicas(
    args: argparse.Namespace, err: Console, cluster: Cluster, graph: nx.DiGraph, options: dict[str, Any]
) -> int:
    """``partitioner plan --replicas``: every D x K tried, the chosen one, and replica 0's placement."""
    if args.timeline:
        raise InputError("--timeline draws one pipeline; plan without --replicas to draw it.")
    microbatches = graph.graph["num_microbatches"] if args.micro_batches is None else args.micro_batches
    batch_size = args.batch_size or graph.graph.get("batch_size")
    with err.status(f"planning replicas of {graph.number_of_nodes()} layers on {cluster.num_devices} devices ..."):
        try:
            choice = plan_replicas(
                graph,
                cluster,
                batch_size=batch_size,
                replicas=args.replicas,
                num_microbatches=microbatches,
                schedule=args.schedule,
                time_limit_s=args.time_limit,
                options=SolverOptions(device_order=args.device_order),
                **options,
            )
        except InfeasiblePlanError as error:
            raise cluster.headroom_note(error) from None
    plan = choice.plan
    validate_plan(plan, choice.graph, subset(cluster, plan.devices))
    if args.out:
        Path(args.out).write_text(plan.to_json())
    if args.json:
        print(plan.to_json())
        return 0
    out = _stdout()
    name = graph.graph.get("model_name", args.model)
    out.print(
        f"[bold]{escape(str(name))}[/]: {graph.number_of_nodes()} layers on {escape(cluster.name)} "
        f"({cluster.num_devices} devices), global batch {batch_size}"
    )
    out.print(replica_table(choice))
    out.print(replica_note(choice), highlight=False, markup=False)
    out.print(render(plan, choice.graph, [], placement=not args.summary))
    if args.out:
        out.print(f"plan written to {args.out}", highlight=False, markup=False)
    return 0


def _choice_note(choice: Choice) -> str:
    """'M = 8 and gpipe chosen: the shortest simulated step of 14 candidates (M in [1, 2, 4, 8, 16, 32, 64],
    gpipe/1f1b)', saying why where a shorter step had more micro-batches (``choose``'s margin), which
    candidates were screened out (DAGs) and which had no plan."""
    tried = choice.candidates
    solved = [c for c in tried if c.solved]
    counts = sorted({c.num_microbatches for c in tried})
    schedules = "/".join(dict.fromkeys(c.schedule for c in tried))
    failed = [f"M = {c.num_microbatches} {c.schedule}" for c in solved if c.step_time_s is None]
    how_many = (
        f"{len(tried)} candidates"
        if len(solved) == len(tried)
        else f"{len(solved)} candidates solved, the best screened of {len(tried)}"
    )
    shortest = min((c for c in solved if c.step_time_s is not None), key=lambda c: c.step_time_s or 0.0)
    why = "the shortest simulated step"
    if shortest.step_time_s is not None and shortest.step_time_s < choice.plan.step_time_s:
        why = (
            f"the fewest micro-batches within {choice.margin:.0%} of the shortest simulated step "
            f"(M = {shortest.num_microbatches} {shortest.schedule}, {format_seconds(shortest.step_time_s)} "
            f"against {format_seconds(choice.plan.step_time_s)})"
        )
    return (
        f"M = {choice.plan.num_microbatches} and {choice.plan.schedule} chosen: {why} of "
        f"{how_many} (M in {counts}, {schedules})" + (f"; no plan for {', '.join(failed)}" if failed else "")
    )


def _batch_note(graph: nx.DiGraph) -> str:
    """', batch 64 in 8 micro-batches of 8' where the graph records its batch, else ''."""
    batch, samples = graph.graph.get("batch_size"), micro_batch_size(graph)
    if batch is None or samples is None:
        return ""
    return f", batch {batch} in {graph.graph['num_microbatches']} micro-batches of {samples}"


def _placement(args: argparse.Namespace, err: Console) -> int:
    _require_tensorflow(args)
    from runtime import executed

    executed.enable_collection()  # before TensorFlow places its first function
    import keras

    from runtime import (
        executed_placement,
        make_virtual_devices,
        placement_report,
        plan_and_wrap,
        synthetic_batch,
        wrap,
    )

    make_virtual_devices(args.devices)
    model = _load_model(args, err)
    shapes = _shape_options(args)
    with err.status(f"wrapping {escape(args.model)} on {args.devices} devices ..."):
        if args.plan:
            plan = Plan.from_json(Path(args.plan).read_text())
            recompute = None if args.recompute == "auto" else args.recompute
            wrapped = wrap(model, plan, schedule=args.schedule, recompute=recompute, **shapes)
        else:
            wrapped = plan_and_wrap(
                model,
                devices=args.devices,
                batch_size=args.batch_size,
                num_microbatches=args.micro_batches,
                memory=args.memory,
                schedule=args.schedule or "gpipe",
                recompute=args.recompute,
                **shapes,
            )
        report = placement_report(wrapped)
    batch = max(args.batch_size, wrapped.num_microbatches)
    with err.status(f"running one training step on {batch} random rows ..."):
        wrapped.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        ran = executed_placement(wrapped, *synthetic_batch(model, batch, **shapes))
    out = _stdout()
    out.print(report.table())
    for line in report.misplaced:
        out.print(f"[red]misplaced:[/] {escape(line)}")
    out.print(ran.table())
    for line in ran.off_device:
        out.print(f"[red]off its device:[/] {escape(line)}")
    for line in ran.unread:
        out.print(f"[yellow]not read:[/] {escape(line)}")
    again = [str(s) for s, flag in enumerate(wrapped.options.recompute) if flag]
    out.print(
        f"{wrapped.options.schedule} schedule, M = {wrapped.num_microbatches}"
        + (f", stages {', '.join(again)} recompute their forward" if again else "")
        + ": "
        + (
            "every variable and every stage's forward, backward and optimizer op is on its planned device"
            if report.ok and ran.ok
            else f"[bold yellow]nothing read is off its device, but {len(ran.unread)} function calls were not read[/]"
            if not report.misplaced and not ran.off_device
            else "[bold red]placement differs from the plan[/]"
        )
    )
    return 0 if report.ok and ran.ok else 1


CALIBRATION_SIZES = (256, 1024)  # the sides of the matmuls timed for the table; local_cluster uses 1024 (CPU)


def _calibrate(args: argparse.Namespace, err: Console) -> int:
    """``partitioner calibrate``: measures the local devices, writes the cluster file, prints what it measured."""
    import json

    _require_tensorflow(args)
    from runtime import make_virtual_devices

    make_virtual_devices(args.devices)  # before TensorFlow initialises; the GPUs or CPU split in N
    from profiles.local import local_cluster_and_sources, measure_flops_per_s

    with err.status(f"measuring {args.devices} local devices ..."):
        cluster, sources = local_cluster_and_sources(args.devices, memory=args.memory)
        first = cluster.names[0]
        rates = {side: measure_flops_per_s(first, size=side) for side in CALIBRATION_SIZES}
    sources["flops_per_s"] += "; by side: " + ", ".join(
        f"{side}: {rate / 1e9:.1f} GFLOP/s" for side, rate in rates.items()
    )
    data = {**cluster.to_dict(), "source": sources}
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    device = cluster.devices[0]
    link = cluster.bandwidth(0, 1) if cluster.num_devices > 1 else None
    rows = [
        ("memory_bytes", f"{device.memory_bytes / 2**30:.2f} GiB per device"),
        ("flops_per_s", f"{device.flops_per_s / 1e9:.1f} GFLOP/s"),
        ("action_overhead_s", f"{device.action_overhead_s * 1e6:.1f} µs per forward or backward of a stage"),
        ("bandwidth_bytes_per_s", "no link (one device)" if link is None else f"{link / 1e9:.1f} GB/s"),
        (
            "pool_capacity",
            "no pool"
            if device.pool is None
            else f"{device.pool_capacity:.2f} of {cluster.num_devices} devices' work at once ({device.pool})",
        ),
    ]
    from rich.table import Table

    table = Table(title=f"{escape(cluster.name)}: {', '.join(cluster.names)}")
    for column in ("field", "value", "source"):
        table.add_column(column)
    for name, value in rows:
        table.add_row(name, value, escape(sources[name]))
    out = _stdout()
    out.print(table)
    out.print(f"cluster written to {args.out}: plan with --cluster {args.out}", highlight=False, markup=False)
    return 0


def _profile(args: argparse.Namespace, err: Console) -> int:
    if args.micro_batches == AUTO:
        raise InputError(
            "'partitioner profile' measures costs for one micro-batch size: give an integer --micro-batches "
            "(or leave it out), and choose M when planning: 'partitioner plan profile.json --micro-batches auto'."
        )
    # timed: also each layer at one sample and the step's own work, so that the profile planned later with
    # --micro-batches auto --cost time prices every M by what it costs (as 'plan --micro-batches auto' does)
    graph = _graph(args, err, measure_time=not args.no_time, measure_fixed_time=True)
    if args.out:
        save_graph(graph, args.out)
    flops = sum(f for _, f in graph.nodes(data="flops"))
    params = sum(p for _, p in graph.nodes(data="param_bytes"))
    timed = [t for _, t in graph.nodes(data="time_s") if t is not None]
    out = _stdout()
    out.print(
        f"{escape(str(graph.graph.get('model_name', args.model)))}: {graph.number_of_nodes()} layers, "
        f"{graph.number_of_edges()} edges, {params / 2**20:.1f} MiB of weights, "
        f"{flops / 1e9:.2f} GFLOPs per micro-batch of {micro_batch_size(graph)} samples (forward + backward), "
        f"computed in {graph.graph.get('compute_dtype', 'float32')}"
        + (f", {sum(timed) * 1e3:.1f} ms measured per micro-batch" if timed else "")
    )
    if args.out:
        out.print(f"layer graph written to {args.out}", highlight=False, markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
