"""plan_and_wrap (profile, solve, validate, rewrite) and wrap (rewrite with a plan made earlier)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from partitioner.cluster import DEFAULT_MEMORY_HEADROOM, Cluster, Device
from partitioner.cost import gradient_copies
from partitioner.errors import InfeasiblePlanError, InputError, PlanError, TimingError
from partitioner.plan import Plan
from partitioner.problem import check_recompute
from partitioner.schedule import Schedule, schedule_for
from partitioner.search.choose import AUTO, candidate_schedules, choose, timed_sizes
from partitioner.search.replicas import with_reduce_times
from partitioner.search.solve import solve
from partitioner.validate import match_names, validate_plan
from profiles.local import with_model_pool_capacities
from profiles.profiler import weight_bytes
from profiles.shapes import InputShapes
from runtime.devices import canonical, require_devices, resolve_devices
from runtime.executor import ExecutionOptions
from runtime.optimizer_state import compile_like
from runtime.pipeline import PipelinedModel
from runtime.rebuild import rebuild
from runtime.replicas import Replicas, measure_reductions
from runtime.supported import (
    RowCheck,
    check_rebuilt,
    check_recomputable,
    check_row_count,
    check_rows,
    check_steps,
)
from runtime.workers import current_worker, join_replicas


def _check_microbatches(num_microbatches: Any, batch_size: Any) -> None:
    if num_microbatches == AUTO and batch_size is not None:
        return
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise InputError(
            f"num_microbatches must be an integer >= 1{' or auto' if batch_size is not None else ''}. "
            f"Received: {num_microbatches!r}."
        )
    if batch_size is not None and num_microbatches > batch_size:
        raise InputError(
            f"num_microbatches={num_microbatches} is larger than batch_size={batch_size}: some micro-batches "
            f"would be empty. Use num_microbatches <= {batch_size} or a larger batch."
        )


def stage_recompute(plan: Plan, recompute: str | None) -> tuple[bool, ...]:
    """Which stages of ``plan`` recompute their forward: the plan's choice (None or "auto"), none
    ("never") or all but the last ("always")."""
    if recompute is None or recompute == "auto":
        return tuple(plan.recompute)
    check_recompute(recompute)
    last = plan.num_stages - 1
    return tuple(recompute == "always" and s < last for s in range(plan.num_stages))


def plan_and_wrap(
    model: Any,
    devices: int | Sequence[str] | Cluster = 2,
    batch_size: int = 32,
    num_microbatches: int | str = 4,
    memory: int | float | str | None = None,
    *,
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
    optimizer_slots: int = 2,
    time_limit_s: float = 10.0,
    pins: Mapping[str, str] | None = None,
    schedule: str = "gpipe",
    recompute: str = "never",
    batch_norm: str = "deferred",
    input_shapes: InputShapes | None = None,
    sequence_length: int | None = None,
    replicas: int | None = None,
    added_losses: str = "exact",
) -> PipelinedModel:
    """Profiles ``model``, plans its split over ``devices``, validates the plan and rebuilds the model.

    Args:
        model: a built Functional or Sequential keras.Model. It is left untouched.
        devices: how many local devices to use (GPUs if present, else logical CPU devices), a list
            of TensorFlow device names, or a partitioner.Cluster of local devices.
        batch_size: the global batch size fit() will see.
        num_microbatches: M, micro-batches per step, or "auto": the planner tries the divisors of
            ``batch_size`` up to 64 and keeps the fewest micro-batches within 5% of the shortest
            predicted step (``partitioner.search.choose``). Local devices given as a count or names are calibrated
            once per process (``profiles.local.local_cluster``): their fixed cost per forward or
            backward (``Device.action_overhead_s``) and link bandwidth are measured, so more
            micro-batches are not free; and the model's layers are timed on the first device, at
            the whole batch, at one sample and at the micro-batch sizes of the M tried
            (``profile_model(measure_fixed_time=True, time_samples=timed_sizes(batch_size))``), with
            the time each micro-batch spends adding its weight gradients into the step's sums, and
            planned by those times (``cost="time"``), so a micro-batch too small to use the device
            well is priced as it runs; where the devices share a processor (logical devices of one
            CPU or GPU), how much of it each keeps while the others compute is measured with the
            model's own forward and backward (``profiles.local.with_model_pool_capacities``). A
            Cluster you pass keeps its own figures and FLOP-based costs (``partitioner calibrate``
            writes one to keep and edit).
        memory: capacity per device where the device reports none (CPU), e.g. "4GiB".
        memory_headroom: the share of each device's memory the plan leaves free for what the
            planner does not price (the framework's workspace, the allocator's rounding, the
            batch; ``Cluster.with_headroom``, docs/cost-model.md); 0 plans into all of it. Applied
            to a Cluster passed as ``devices`` too.
        optimizer_slots: 2 for Adam, 1 for momentum, 0 for SGD (for the memory check).
        time_limit_s: the solver's time limit.
        pins: {node: device} placements to keep.
        schedule: the pipeline schedule to plan for and train with: "gpipe" (all forwards, then all
            backwards: M micro-batches of activations in flight) or "1f1b" (one forward, one
            backward: at most K - s in flight on stage s, the same bubble), or "auto": the one of
            the shorter predicted step (GPipe on a tie), planned with each M tried.
        recompute: "never" keeps each micro-batch's activations until its backward; "always" keeps
            only each stage's inputs and runs its forward again in the backward (about a third more
            compute for far less activation memory); "auto" lets the planner recompute a stage only
            where its kept activations would not fit (``plan.recompute`` says which).
        batch_norm: "deferred" (each micro-batch normalised by its own statistics, the moving
            statistics moved once per step towards the whole batch's, as the original model does;
            with M > 1 a batch normalization with renorm, called with a Keras mask or inside another
            layer is refused) or "per_microbatch" (M moving updates per step, as Keras' layer makes
            micro-batch by micro-batch).
        added_losses: how the losses layers add (``add_loss``) are split over the micro-batches (and
            workers). "exact": each part's added loss times its share of the batch's rows, which is the
            original's for a loss that is a mean over the rows or does not depend on them (measured at the
            wrap on a probe batch: ``runtime.supported.check_rows``); a batch-wide one is refused, and a
            mean on a batch that M does not divide is refused at its step. "per_microbatch": a batch-wide
            one (a mixture of experts' load-balancing loss) is taken that way too, as pipelines take it:
            each micro-batch balances its own experts, not the original's number.
        input_shapes: the shapes to plan for where the model leaves non-batch dimensions open
            (keras-hub backbones take ``(None, None)`` token ids): ``{"token_ids": (128,)}`` or a
            list in the order of ``model.inputs``, without the batch axis. The wrapped model still
            runs any shape the original accepts; the plan's costs are for this one.
        sequence_length: shorthand: every unknown non-batch dimension of every input gets this size.
        replicas: D, the copies of the pipeline trained data parallel, one per worker process
            (``runtime.workers``): every stage sums its gradients with the other copies' after each
            step's micro-batches. Defaults to the workers ``start_worker`` joined (1 without). The plan is
            for one copy: ``devices`` and ``batch_size`` are this worker's (its share of the global batch).

    Returns:
        A PipelinedModel; its ``.plan`` is the plan used.

    Raises:
        ProfileError, InfeasiblePlanError, ClusterError, InputError: with the planner's message.
        InputError: also, before profiling, for a model whose class overrides a step or ``call``, or
            whose ops mix the rows of a batch where ``num_microbatches`` cannot (``runtime.supported``).

    Example:
        >>> wrapped = plan_and_wrap(model, devices=4, batch_size=64, num_microbatches=8)   # doctest: +SKIP
        >>> wrapped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")      # doctest: +SKIP
    """
    from profiles import profile_model

    _check_microbatches(num_microbatches, batch_size)
    check_recompute(recompute)
    candidate_schedules(schedule)  # bad options fail before profiling
    num_replicas = _num_replicas(replicas)
    check_steps(model)
    checked = check_rows(
        model,
        num_microbatches,
        num_replicas=num_replicas,
        input_shapes=input_shapes,
        sequence_length=sequence_length,
        added_losses=added_losses,
    )
    fixed_microbatches = 1 if isinstance(num_microbatches, str) else num_microbatches  # "auto": chosen below
    ExecutionOptions(
        fixed_microbatches,
        schedule="gpipe" if schedule == AUTO else schedule,
        batch_norm=batch_norm,
    )
    cluster = resolve_devices(devices, memory=memory).with_headroom(memory_headroom)
    # the model being wrapped keeps its weights where it was built (the PipelinedModel keeps it, and so
    # does the user): on a device of the plan (GPU:0 by default) they are memory the stages cannot have
    cluster = cluster.with_reserved(
        _weights_on(model, cluster), "the weights of the model being wrapped, which stay where it was built"
    )
    # auto M on devices calibrated here: the layers timed where they run, their fixed part too (each M is
    # priced by rescaling); a worker of several does not time (the replicas must agree on one plan)
    timed = num_microbatches == AUTO and not isinstance(devices, Cluster) and current_worker() is None

    def profile(timed: bool) -> Any:
        return profile_model(
            model,
            batch_size=batch_size,
            num_microbatches=1 if num_microbatches == AUTO else num_microbatches,  # auto: rescaled to each M tried
            measure_time=timed,
            device=cluster.devices[0].name if timed else None,
            measure_fixed_time=timed,
            time_samples=timed_sizes(batch_size) if timed else (),
            input_shapes=input_shapes,
            sequence_length=sequence_length,
        )

    try:
        graph = profile(timed)
    except TimingError as error:
        if not timed:
            raise
        warnings.warn(f"{error} Planning num_microbatches='auto' by FLOPs instead of measured times.", stacklevel=2)
        timed = False
        graph = profile(timed)
    if timed:  # the devices' shared processor, as the model shares it (a size in the middle of those timed)
        sizes = timed_sizes(batch_size)
        cluster = with_model_pool_capacities(
            cluster,
            model,
            sizes[len(sizes) // 2],
            input_shapes=input_shapes,
            sequence_length=sequence_length,
        )
    solve_options: dict[str, Any] = {
        "cost": "time" if timed else "flops",
        "optimizer_slots": optimizer_slots,
        "time_limit_s": time_limit_s,
        "pins": pins,
        "recompute": recompute,
        # with workers each stage's all-reduce holds a packed copy of its gradients (Plan.priced_replicas records D)
        "num_replicas": num_replicas,
    }
    try:
        if AUTO in (num_microbatches, schedule):
            choice = choose(
                graph,
                cluster,
                batch_size=batch_size,
                num_microbatches=num_microbatches,
                schedule=schedule,
                **solve_options,
            )
            plan, graph = choice.plan, choice.graph
        else:
            plan = solve(graph, cluster, num_microbatches=fixed_microbatches, schedule=schedule, **solve_options)
    except InfeasiblePlanError as error:
        raise cluster.headroom_note(error) from None
    validate_plan(plan, graph, cluster)
    check_row_count(model, checked.batch, batch_size, plan.num_microbatches)  # M known, B above the probe's
    options = ExecutionOptions(
        plan.num_microbatches,
        schedule=plan.schedule,
        recompute=tuple(plan.recompute),
        batch_norm=batch_norm,
        num_replicas=num_replicas,
    )
    wrapped = _wrap(model, plan, options, checked)
    if num_replicas > 1:  # each stage's all-reduce with the other workers, timed here, in the predicted step
        executor = wrapped.executor
        times = measure_reductions(executor.collectives, [stage.trainable_variables for stage in executor.stages])
        wrapped.reprice(with_reduce_times(wrapped.plan, graph, cluster, dict(zip(wrapped.plan.stages, times))))
    return wrapped


def wrap(
    model: Any,
    plan: Plan,
    *,
    num_microbatches: int | None = None,
    validate: bool = True,
    schedule: str | Schedule | None = None,
    recompute: str | None = None,
    batch_norm: str = "deferred",
    input_shapes: InputShapes | None = None,
    sequence_length: int | None = None,
    replicas: int | None = None,
    added_losses: str = "exact",
) -> PipelinedModel:
    """Rebuilds ``model`` with the placement of a plan made earlier (e.g. by the CLI's ``--out``).

    Args:
        model: the model the plan was made for.
        plan: a Plan (``Plan.from_json(text)``).
        num_microbatches: M; defaults to the plan's.
        validate: profile the model and run ``validate_plan`` first (recommended).
        schedule: "gpipe" or "1f1b", or a ``partitioner.Schedule`` for the plan's stages and M (a custom
            order, ``Schedule.parse``) whose rows the runtime's loop can follow (``Schedule.windows``);
            defaults to the schedule the plan was made for.
        recompute: "never", "always", or None / "auto": the stages the plan recomputes (see
            ``plan_and_wrap``).
        batch_norm: "deferred" or "per_microbatch" (see ``plan_and_wrap``).
        replicas: D, the data-parallel copies, one per worker (see ``plan_and_wrap``).
        added_losses: "exact" or "per_microbatch" (see ``plan_and_wrap``).
        input_shapes, sequence_length: the shapes to validate at, where the model leaves non-batch
            dimensions open (see ``plan_and_wrap``), and to check its rows at (every open dimension 1
            without them).

    A plan made for the same architecture built again (``keras.models.clone_model``, or the same
    ``build()`` run twice in a process, where Keras numbers its names on: ``dense_6`` for ``dense_2``)
    is mapped onto this model's names when its recorded structure (layer types, configs and edges, in
    topological order) equals this model's; the wrapped model's ``plan`` then names this model's nodes.

    Raises:
        PlanError: when the plan was made for another model (naming the first node that differs) or
            names devices that do not exist.
        InputError: when ``batch_norm="deferred"`` meets a batch normalization it cannot defer; for a
            model whose class overrides a step or ``call``, or whose ops mix the rows of a batch where
            ``num_microbatches`` cannot (``runtime.supported``).
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"wrap needs a partitioner.Plan. Received: {type(plan).__name__}.")
    num_microbatches = plan.num_microbatches if num_microbatches is None else num_microbatches
    _check_microbatches(num_microbatches, None)
    schedule = plan.schedule if schedule is None else schedule
    options = ExecutionOptions(
        num_microbatches,
        schedule=schedule,
        recompute=stage_recompute(plan, recompute),
        batch_norm=batch_norm,
        num_replicas=_num_replicas(replicas),
    )
    schedule_for(schedule, plan.num_stages, num_microbatches)  # a Schedule for other K or M fails before rebuilding
    require_devices(plan.devices)  # raises, listing the devices that exist, if one is missing
    check_steps(model)
    checked = check_rows(
        model,
        num_microbatches,
        num_replicas=options.num_replicas,
        input_shapes=input_shapes,
        sequence_length=sequence_length,
        added_losses=added_losses,
    )
    if validate or not _same_names(model, plan):
        from profiles import profile_model

        graph = profile_model(
            model,
            batch_size=num_microbatches,
            num_microbatches=num_microbatches,
            measure_time=False,
            input_shapes=input_shapes,
            sequence_length=sequence_length,
        )
        plan = match_names(plan, graph)  # the same architecture built again: the plan in this model's names
    if validate:
        planned = Cluster([Device(d, memory_bytes=plan.capacity_bytes[d]) for d in plan.devices])
        validate_plan(plan, graph, planned, check_memory=False)  # memory was checked at the planned batch size
    note = unpriced_replicas_note(plan, num_microbatches, options.num_replicas)
    if note:  # after the checks: a plan that cannot run says so first
        warnings.warn(note, stacklevel=2)
    return _wrap(model, plan, options, checked)


def _same_names(model: Any, plan: Plan) -> bool:
    """True iff the plan's nodes are named as ``model``'s layer calls."""
    from profiles.walk import flatten_calls, functional_graph

    calls, _ = flatten_calls(functional_graph(model))
    return {call.name for call in calls} == set(plan.assignment)


def unpriced_replicas_note(plan: Plan, num_microbatches: int, num_replicas: int) -> str | None:
    """What a plan run at ``num_microbatches`` by ``num_replicas`` workers holds that its memory does not count
    (more copies of each stage's weight gradients than it was priced with: ``partitioner.cost.gradient_copies``,
    the sums of more micro-batches or the packed copy an all-reduce takes), or None.

    Example:
        >>> unpriced_replicas_note(plan_for_one_pipeline_at_m_1, 1, 2)  # doctest: +SKIP
        'The plan was priced at M = 1 on 1 pipeline(s) ... partitioner plan --workers 2 --micro-batches 1 ...'
    """
    held = gradient_copies(num_microbatches, num_replicas)
    priced = gradient_copies(plan.num_microbatches, plan.priced_replicas)
    if held <= priced:
        return None
    more = held - priced
    copies = f"{more} more cop{'y' if more == 1 else 'ies'}"
    return (
        f"The plan was priced at M = {plan.num_microbatches} on {plan.priced_replicas} pipeline(s) and runs at "
        f"M = {num_microbatches} as one of {num_replicas}: each stage holds {copies} "
        "of its weight gradients (as many bytes as its trainable weights each: the sums over the micro-batches, "
        "the packed copy its all-reduce takes) than the plan's memory counts. Plan with "
        f"`partitioner plan --workers {num_replicas} --micro-batches {num_microbatches}` "
        f"(or solve(..., num_microbatches={num_microbatches}, num_replicas={num_replicas})) to count them."
    )


def _num_replicas(replicas: int | None) -> int:
    """D: ``replicas`` checked against the workers ``start_worker`` joined (their number by default)."""
    worker = current_worker()
    workers = 1 if worker is None else worker.num_workers
    if replicas is None:
        return workers
    Replicas(replicas)  # an integer >= 1, or one clear error
    if replicas != workers:
        raise InputError(
            f"replicas={replicas} but this process is one of {workers} worker(s): each replica is one worker "
            "process. Start the workers with `partitioner launch --workers D -- python train.py` (or TF_CONFIG) "
            "and call runtime.start_worker() first; or leave replicas out."
        )
    return replicas


def _wrap(model: Any, plan: Plan, options: ExecutionOptions, checked: RowCheck) -> PipelinedModel:
    """Rebuilds ``model`` and checks it computes the original's outputs on the probe batch (``check_rebuilt``); a
    compiled model's compile settings and optimizer state come along. With replicas, every worker checks it runs
    the same plan and takes worker 0's initial weights. ``checked``: what ``check_rows`` found (what each layer's
    added loss is, by id of the original layer; the probe batch)."""
    assignment = {node: canonical(device) for node, device in plan.assignment.items()}
    rebuilt = rebuild(model, assignment, canonical(plan.stages[-1]))
    check_rebuilt(model, rebuilt.model, checked.batch)
    stages = {canonical(device): s for s, device in enumerate(plan.stages)}
    drawing = [rebuilt.clone_of[key] for key in checked.global_draws if key in rebuilt.clone_of]
    check_recomputable({clone.name: stages[rebuilt.device_of[id(clone)]] for clone in drawing}, options.recomputes)
    kinds = {rebuilt.clone_of[key].name: kind for key, kind in checked.loss_kinds.items() if key in rebuilt.clone_of}
    batched = frozenset(rebuilt.clone_of[key].name for key in checked.batched_lookups if key in rebuilt.clone_of)
    wrapped = PipelinedModel(rebuilt, plan, model, replace(options, loss_kinds=kinds, batched_lookups=batched))
    pairs = [(a, b) for original, clone in rebuilt.origin for a, b in zip(original.weights, clone.weights)]
    compile_like(model, wrapped, pairs)
    join_replicas(wrapped, options.num_replicas)
    return wrapped


def _weights_on(model: Any, cluster: Cluster) -> dict[str, int]:
    """{device of ``cluster``: bytes of ``model``'s weights held there} (weights elsewhere: not counted)."""
    held: dict[str, int] = {}
    names = {canonical(name) for name in cluster.names}
    for weight in model.weights:
        device = canonical(getattr(getattr(weight, "value", weight), "device", "") or "")
        if device in names:
            held[device] = held.get(device, 0) + weight_bytes(weight)
    return held
