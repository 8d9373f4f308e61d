"""The ``R`` action: each stage's gradients summed over the D data-parallel replicas of its pipeline.

D replicas of a K-stage pipeline each train on their own share of the global batch (one worker
process per replica, ``runtime.workers``). After a replica's micro-batch loop, every stage sums its
gradients with the same stage of the other replicas, on the stage's own device, by TensorFlow's
collective op (``CollectiveReduceV2``, SUM), the one primitive that works between logical devices of
one process and between processes, with an NCCL path on GPUs:

    replica 0:  stage 0 ── R(group 0) ──┐       stage 1 ── R(group 1) ──┐
    replica 1:  stage 0 ── R(group 0) ──┘       stage 1 ── R(group 1) ──┘

- one collective group per stage (``group_key = GROUP_KEY_BASE + stage``, ``group_size = D``), a fixed
  instance key per stage, purpose and dtype, so every replica issues the same collectives in the same
  order;
- the stage's tensors are packed into one flat tensor per dtype (one collective, not one per
  gradient: 68 ms against 117 ms for 2 x 64 MB, ``../shared/HYBRID-NOTES.md``);
- an ordering token (the handle of a variable on the stage's device) on every collective: without it
  TensorFlow's automatic control dependencies chain the collectives of different devices in program
  order, and two devices that wait for each other's peers deadlock;
- the replicas stay in step: every action that issues collectives (a training step, an evaluate step, the
  start of ``fit``, the end of an epoch's training steps and of ``evaluate``) first sums what it is
  (``ACTIONS``, one-hot) over the replicas in one small collective of a fixed key and shape on the first
  stage's device, and a step asserts that every replica is at the same action (``in_step``,
  ``check_in_step``). Collectives pair up by key in the order they are issued, so a worker with one more
  step in an epoch meets another's end of the epoch there, and both raise one clear error where they
  waited before, each for a collective the other never issues.

What is summed is each replica's local mean times its count (rows, or valid steps with an output
mask), with the count itself, so the sum divided by the summed count is the mean over the global
batch, exact for uneven shards (``TrainStep.finish`` in ``runtime.train_step``).
"""

from __future__ import annotations

import hashlib
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from partitioner.errors import InputError

GROUP_KEY_BASE = 1000  # stage s's collective group is GROUP_KEY_BASE + s (below: TensorFlow's own strategies)
INSTANCE_KEY_BASE = 1_000_000  # the first instance key; TensorFlow's strategies count theirs from 1
# metrics: a training step's metric states (PipelinedModel._metrics_result), evaluate_metrics: evaluate's
_PURPOSES = (
    "actions",  # what each replica is doing (ACTIONS), before any other collective of the action
    "gradients",
    "broadcast",
    "agree",
    "evaluate",
    "measure",
    "metrics",
    "evaluate_metrics",
)  # measure: benchmarks
_DTYPES_PER_PURPOSE = 16  # one instance key per purpose and dtype packed
_MAX_STAGES = 1024
# TensorFlow keeps a collective instance's shape and dtype by its instance key: the n-th StageCollectives
# made for a stage on a device takes keys of its own, the same on every replica that runs the same program
# (one per process, or one per device when the replicas of a test share a process)
_made: dict[tuple[int, str], int] = {}
# what a replica does when it issues collectives; the order is the one-hot's (every replica runs the same code)
ACTIONS = (
    "a training step",
    "an evaluate (or validation) step",
    "the start of fit",
    "the end of an epoch",  # its training steps, before its validation
    "the end of evaluate",
)
OUT_OF_STEP = "The replicas are out of step"  # starts the error of a replica whose action differs from another's


@dataclass(frozen=True)
class Replicas:
    """Where this pipeline sits among its data-parallel copies.

    Example:
        >>> Replicas(num_replicas=2, rank=1)            # doctest: +SKIP
    """

    num_replicas: int  # D, the copies of the pipeline (one per worker process)
    rank: int = 0  # this copy's index, 0..D-1; rank 0 broadcasts its initial weights and writes files

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise InputError(f"replicas must be an integer >= 1. Received: {self.num_replicas!r}.")
        if not 0 <= self.rank < self.num_replicas:
            raise InputError(f"rank must be in [0, {self.num_replicas}). Received: rank={self.rank}.")


class StageCollectives:
    """The collectives of one stage with the same stage of every other replica, issued on its device.

    Args:
        stage: the stage's index (its collective group).
        device: the stage's device (local name).
        num_replicas: D, the group's size.
    """

    def __init__(self, stage: int, device: str, num_replicas: int) -> None:
        self.stage = stage
        self.device = device
        self.num_replicas = num_replicas
        self.group_key = GROUP_KEY_BASE + stage
        if not 0 <= stage < _MAX_STAGES:
            raise InputError(f"A pipeline has at most {_MAX_STAGES} stages. Received: stage {stage}.")
        nth = _made[(stage, device)] = _made.get((stage, device), -1) + 1
        self._first_key = INSTANCE_KEY_BASE + (nth * _MAX_STAGES + stage) * len(_PURPOSES) * _DTYPES_PER_PURPOSE
        self.counting: dict[str, Any] = {}  # check_in_step's function per action
        with tf.device(device):
            # its handle orders this device's collectives (and only them) in program order
            self._token = tf.Variable(0, dtype=tf.int32, trainable=False, name=f"stage{stage}_collective_order")

    def _instance_key(self, purpose: str, part: int) -> int:
        if part >= _DTYPES_PER_PURPOSE:
            raise InputError(f"A stage's tensors come in {part + 1} dtypes; at most {_DTYPES_PER_PURPOSE} are packed.")
        return self._first_key + _DTYPES_PER_PURPOSE * _PURPOSES.index(purpose) + part

    def sum(self, tensors: Sequence[tf.Tensor], purpose: str = "gradients") -> list[tf.Tensor]:
        """Each tensor summed over the replicas (SUM), in one collective per dtype, on the stage's device."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if self.num_replicas == 1 or not tensors:
            return list(tensors)
        dtypes = list(dict.fromkeys(t.dtype for t in tensors))
        result: list[Any] = [None] * len(tensors)
        with tf.device(self.device):
            for part, dtype in enumerate(dtypes):
                members = [i for i, t in enumerate(tensors) if t.dtype == dtype]
                packed = tf.concat([tf.reshape(tensors[i], [-1]) for i in members], 0)
                summed = tf.raw_ops.CollectiveReduceV2(
                    input=packed,
                    group_size=self.num_replicas,
                    group_key=self.group_key,
                    instance_key=self._instance_key(purpose, part),
                    ordering_token=[self._token.handle],
                    merge_op="Add",
                    final_op="Id",
                    communication_hint="auto",
                )
                sizes = tf.stack([tf.size(tensors[i]) for i in members])
                pieces = tf.split(summed, sizes, num=len(members))
                for i, piece in zip(members, pieces):
                    result[i] = tf.reshape(piece, tf.shape(tensors[i]))
        return result

    def broadcast(self, values: Sequence[tf.Tensor], rank: int) -> list[tf.Tensor]:
        """Replica 0's ``values`` on every replica (a sum in which the others send zeros: exact)."""
        values = [tf.convert_to_tensor(v) for v in values]
        if self.num_replicas == 1:
            return values
        sent = values if rank == 0 else [tf.zeros_like(v) for v in values]
        return self.sum(sent, "broadcast")


def _action_counts(group: StageCollectives, action: str) -> tf.Tensor:
    """How many replicas are at each of ``ACTIONS`` (float64: exact), summed on ``group``'s device."""
    mine = tf.one_hot(ACTIONS.index(action), len(ACTIONS), dtype=tf.float64)
    return group.sum([mine], "actions")[0]


def out_of_step(action: str, counts: Sequence[float] | None = None) -> str:
    """The one-line error of a replica at ``action`` when another is not: ``counts`` per ``ACTIONS`` where known."""
    where = ""
    if counts is not None:
        where = " (" + ", ".join(f"{int(n)} at {a}" for a, n in zip(ACTIONS, counts) if n) + ")"
    return (
        f"{OUT_OF_STEP}: this worker is at {action} and another is not{where}. Expected every worker to run the "
        "same number of training and validation steps and to call fit and evaluate alike (evaluate on every "
        "worker, not only on worker 0); give each worker shards of equal size, or steps_per_epoch and "
        "validation_steps (and steps for evaluate) that the data of every worker can fill."
    )


def in_step(collectives: Sequence[StageCollectives], action: str, data: Sequence[tf.Tensor]) -> None:
    """While a step that issues collectives is traced, before its other collectives: the replicas sum which of
    ``ACTIONS`` each is at, on the first stage's device, and an assertion that all are at ``action`` fails the
    step where one is not (``OUT_OF_STEP``'s message and the counts, tf.errors.InvalidArgumentError; the step's
    collectives waiting for the other replica are cancelled with it). Nothing with one replica.

    The sum waits for the step's ``data`` (its input tensors): a step that finds its data ended (a dataset of
    unknown size ends so, in one more call of the step) issues no collective. Without it the check ran in that
    call on one worker, was cancelled there, and the workers' checks paired up a step apart: a false error, a
    hang or a crash with even shards of a filtered dataset or a generator (found by probing, stop 39).

    The step's other collectives do not wait for the assertion: a worker killed just before a step was found
    in 0.05 s by a step's gradient sum waiting on its connection, and in 7.5 s (the coordination service's
    heartbeat) when every collective of the step waited for this small one first (measured with 2 workers,
    tests/runtime/test_faults.py)."""
    if not collectives or collectives[0].num_replicas == 1:
        return
    group = collectives[0]
    with tf.device(group.device), tf.control_dependencies(tf.nest.flatten(list(data), expand_composites=True)):
        counts = _action_counts(group, action)
        tf.debugging.Assert(  # TensorFlow's message: "[out_of_step(action)] [the counts]"
            tf.equal(counts[ACTIONS.index(action)], group.num_replicas),
            [out_of_step(action), counts],
            summarize=len(ACTIONS),
        )


def out_of_step_raised(message: str) -> str | None:
    """``out_of_step``'s line, with the counts, from the message of the error ``in_step``'s assertion raised
    (None for another error's)."""
    for action in ACTIONS:
        found = re.search(re.escape(out_of_step(action)) + r"\] \[([^\]]*)\]", message)
        if found:
            counts = found.group(1).split()
            known = len(counts) == len(ACTIONS) and all(re.fullmatch(r"[\d.]+", n) for n in counts)
            return out_of_step(action, [float(n) for n in counts] if known else None)
    return None


def check_in_step(collectives: Sequence[StageCollectives], action: str) -> None:
    """Out of a step (the start of ``fit``, the end of an epoch's training steps and of ``evaluate``): the
    replicas sum which of ``ACTIONS`` each is at, as ``in_step`` does, and this one raises where another is
    elsewhere.

    Raises:
        InputError: ``OUT_OF_STEP``'s message, with how many replicas are at which action.
    """
    if not collectives or collectives[0].num_replicas == 1:
        return
    group = collectives[0]
    if action not in group.counting:  # traced once per action (the end of every epoch runs it)

        @tf.function(autograph=False)  # type: ignore[untyped-decorator]  # TensorFlow ships no type hints
        def run() -> tf.Tensor:
            with tf.device(group.device):
                return _action_counts(group, action)

        group.counting[action] = run
    counts = group.counting[action]().numpy()
    if counts[ACTIONS.index(action)] != group.num_replicas:
        raise InputError(out_of_step(action, counts.tolist()))


def broadcast_variables(collectives: Sequence[StageCollectives], variables: Sequence[Sequence[Any]], rank: int) -> None:
    """Sets every stage's variables to replica 0's (the initial weights of every replica must agree)."""

    @tf.function(autograph=False)  # type: ignore[untyped-decorator]  # TensorFlow ships no type hints
    def run() -> None:
        for group, stage_variables in zip(collectives, variables):
            if not stage_variables:
                continue
            with tf.device(group.device):
                values = group.broadcast([v.read_value() for v in stage_variables], rank)
                for variable, value in zip(stage_variables, values):
                    variable.assign(value)

    run()


def agree(collectives: Sequence[StageCollectives], fingerprint: str, what: str) -> None:
    """Refuses to go on unless every replica computed the same ``fingerprint`` (a digest of the plan and
    the stage variables' shapes): replicas that disagree would issue collectives of other shapes, and
    hang or fail later with a message that names nothing.

    Raises:
        InputError: naming ``what`` differs, when a replica's fingerprint is not this one's.
    """
    if not collectives or collectives[0].num_replicas == 1:
        return
    digest = hashlib.sha256(fingerprint.encode()).digest()[:8]
    words = [int.from_bytes(digest[i : i + 2], "little") for i in range(0, 8, 2)]  # exact in float32
    mine = tf.constant(words, tf.float32)
    group = collectives[0]

    @tf.function(autograph=False)  # type: ignore[untyped-decorator]  # TensorFlow ships no type hints
    def run() -> tf.Tensor:
        with tf.device(group.device):
            return group.sum([mine, tf.square(mine)], "agree")

    total, squares = run()
    d = group.num_replicas
    # every replica holds the same words iff sum = D x mine and sum of squares = D x mine^2
    if not (bool(tf.reduce_all(total == d * mine)) and bool(tf.reduce_all(squares == d * tf.square(mine)))):
        raise InputError(
            f"The {d} replicas do not agree on {what}: this worker's differs from another's. Expected every "
            "worker to wrap the same model with the same plan (make the plan once, on worker 0 or as a plan "
            "file, and pass it to wrap on every worker)."
        )


def measure_reductions(
    collectives: Sequence[StageCollectives], variables: Sequence[Sequence[Any]], repeats: int = 3
) -> list[float]:
    """Each stage's ``R`` timed alone: the packed sum of gradients the shape of its trainable ``variables`` with
    the same stage of every other replica, on its device, the collective its step issues; the median of ``repeats``
    runs after an untimed one (its first run sets the collective up). Every replica must call it at the same point
    of its program (it is collective), as ``plan_and_wrap`` does after wrapping.

    Returns:
        Seconds per stage, in ``collectives``' order (0 for a stage without trainable variables).
    """
    seconds = []
    for group, stage_variables in zip(collectives, variables, strict=True):
        if not stage_variables:
            seconds.append(0.0)
            continue

        @tf.function(autograph=False)  # type: ignore[untyped-decorator]  # TensorFlow ships no type hints
        def run(group: StageCollectives = group, stage_variables: Sequence[Any] = stage_variables) -> Any:
            with tf.device(group.device):
                summed = group.sum([tf.ones(v.shape, v.dtype) for v in stage_variables], "measure")
                return [tf.reshape(t, [-1])[:1] for t in summed]  # a small result: the time is the collective's

        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return seconds
