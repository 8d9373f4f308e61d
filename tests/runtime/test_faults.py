"""Faults in data x pipeline training: 2 workers x 2 stages fit 4 epochs; worker 1 is killed or stopped
in epoch 3 (slow suite: each case starts 2 TensorFlow processes, about 15 s a start on this machine's CPUs).

Times measured on the 2 shared CPU cores of the development machine (``--durations``; the fault's time is
what worker 1 wrote just before its signal): a killed worker fails the other in 1.9 s, most of it the
survivor's own exit; a stopped one in 7 s (the coordination service's heartbeat), the launcher back 9 s
after the fault.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from partitioner.launch import LaunchOptions, free_ports, worker_environment

HERE = Path(__file__).parent / "workers"
sys.path.insert(0, str(HERE))
from shards import NUM_STEPS, batch, build  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 120
NUM_EPOCHS = 4  # as workers/faults.py runs them
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}  # the workers import this checkout


def _launch(out: Path, case: str, *args: str, script: str = "faults.py") -> tuple[subprocess.CompletedProcess, float]:
    """Runs workers/``script`` (faults.py: ``case`` is the fault) by ``partitioner launch`` with the launcher's
    ``args``; returns its result and when it returned."""
    command = [sys.executable, "-m", "partitioner.cli", "launch", "--workers", "2", "--devices-per-worker", "2"]
    command += ["--timeout", str(TIMEOUT_S), "--log-dir", str(out / "logs"), *args, "--"]
    command += [sys.executable, str(HERE / script), str(out), case]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S + 30, check=False, env=ENV)
    return result, time.time()


def _fault_time(out: Path) -> float:
    return float((out / "faulted").read_text())


def test_a_killed_worker_fails_the_other_within_seconds(tmp_path) -> None:
    """No launcher (as on several machines, where none stops the others): worker 1 SIGKILLs itself before
    the second step of epoch 3; worker 0, waiting in that step's collective, fails on its own (its gRPC
    connection closes: measured 1.9 s from the kill to its exit, most of it the exit itself)."""
    options = LaunchOptions(2, devices_per_worker=2)
    ports = free_ports(2)
    command = [sys.executable, str(HERE / "faults.py"), str(tmp_path), "kill"]
    logs = [(tmp_path / f"worker-{rank}.log").open("w") for rank in range(2)]
    workers = [
        subprocess.Popen(
            command,
            env={**ENV, **worker_environment(rank, ports, options)},
            stdout=logs[rank],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        assert workers[1].wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        assert workers[0].wait(timeout=30) != 0
        failed = time.time()
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        for log in logs:
            log.close()
    log = (tmp_path / "worker-0.log").read_text()
    assert "UnavailableError" in log and "Restart your program to reset" in log, log[-3000:]
    assert "heartbeat" not in log  # the closed connection told it, not the heartbeat 10 s later
    assert failed - _fault_time(tmp_path) < 10
    assert not (tmp_path / "worker-0.npz").exists()


def test_a_stopped_worker_fails_the_other_by_the_heartbeat(tmp_path) -> None:
    """Worker 1 SIGSTOPs itself (a hung worker: its sockets stay open) before the second step of epoch 3:
    worker 0 fails when the coordination service misses worker 1's heartbeats (measured 7 s after the
    stop), and the launcher stops worker 1 and returns worker 0's status (9 s after the stop)."""
    result, returned = _launch(tmp_path, "stop")
    assert result.returncode not in (0, 124), result.stdout[-3000:]
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    assert "stopped sending heartbeats" in log and "/job:worker/replica:0/task:1" in log, log[-3000:]
    assert returned - _fault_time(tmp_path) < 30
    assert not list(tmp_path.glob("worker-*.npz"))


@pytest.mark.parametrize(("fault", "resumed_epochs"), [("kill", 2), ("kill-unsaved", 1)])
def test_a_restart_resumes_from_the_last_backup_as_if_never_killed(fault, resumed_epochs, tmp_path) -> None:
    """``--max-restarts 1`` and ``BackupAndRestore`` in a folder per worker: worker 1 is killed in epoch 3
    (``kill``: before its second step, both folders hold epoch 2; ``kill-unsaved``: after its last step,
    once worker 0 wrote its backup of epoch 3 and before worker 1 wrote its own). The restart resumes at
    replica 0's epoch with replica 0's state, and the workers end bitwise equal, and equal within 1e-6 to
    the original model trained 4 epochs on the whole batches with worker 0's initial weights (measured
    2.3e-7). Before replicas took replica 0's state, ``kill-unsaved`` resumed worker 0 at epoch 4 and
    worker 1 at epoch 3: worker 0 wrote weights trained against another model's gradients, and the
    launch failed."""
    result, _ = _launch(tmp_path, fault, "--max-restarts", "1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("restarting all 2") == 1
    assert (tmp_path / "faulted").exists()
    keras.utils.set_random_seed(100)  # worker 0's seed
    reference = build()
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    for _ in range(NUM_EPOCHS):
        for step in range(NUM_STEPS):
            reference.train_on_batch(*batch(step))
    expected = reference.get_weights()
    workers = [np.load(tmp_path / f"worker-{rank}.npz") for rank in range(2)]
    for saved in workers:
        assert int(saved["iterations"]) == NUM_EPOCHS * NUM_STEPS
        assert len(saved["losses"]) == resumed_epochs  # the epochs the restarted fit ran
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files) - 2)]
        assert len(weights) == len(expected)
        for actual, value in zip(weights, expected, strict=True):
            np.testing.assert_allclose(actual, value, rtol=1e-5, atol=1e-6)
    for key in workers[0].files:
        if key != "losses":
            np.testing.assert_array_equal(workers[0][key], workers[1][key])


def test_sigterm_ends_a_worker_that_joined_its_cluster(tmp_path) -> None:
    """TensorFlow's preemption notifier (installed by the cluster's strategy) caught SIGTERM and the worker went
    on, so ``timeout``, ``kill`` or a scheduler's first signal did not end a hung worker (found by probing, stop
    38: one waited 600 s in a collective after it)."""
    options = LaunchOptions(2, devices_per_worker=2)
    ports = free_ports(2)
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "sleeper.py"), str(tmp_path)],
            env={**ENV, **worker_environment(rank, ports, options)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.time() + TIMEOUT_S
        while not all((tmp_path / f"joined-{rank}").exists() for rank in range(2)) and time.time() < deadline:
            time.sleep(0.5)
        workers[0].send_signal(signal.SIGTERM)
        assert workers[0].wait(timeout=20) == -signal.SIGTERM
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


@pytest.mark.parametrize("case", ["training", "validation"])
def test_workers_with_a_step_more_fail_with_one_clear_error(case, tmp_path) -> None:
    """Worker 1 has a training (or validation) batch more in every epoch. Each waited until the launcher's
    timeout before, for a collective the other never issued, both alive (found by probing, stop 38); a step more
    in training summed worker 1's last step with worker 0's first of the next epoch. Now every action that issues
    collectives first sums which action each worker is at, and both fail there."""
    result, _ = _launch(tmp_path, case, script="uneven.py")
    assert result.returncode not in (0, 124), result.stdout[-3000:]
    here, there = (
        ("the end of an epoch", "a training step")
        if case == "training"
        else ("the end of evaluate", "an evaluate (or validation) step")
    )
    for rank, at in enumerate((here, there)):
        log = (tmp_path / "logs" / f"worker-{rank}.log").read_text()
        expected = f"InputError: The replicas are out of step: this worker is at {at} and another is not (1 at "
        assert expected in log, log[-3000:]
    assert not list(tmp_path.glob("done-*"))


def test_evaluate_on_one_worker_fails_when_the_other_ends(tmp_path) -> None:
    """Worker 0 alone calls evaluate after fit; worker 1 ends: worker 0's evaluate step, waiting for worker 1 in
    a collective, fails when worker 1's connection closes, with a note that says why."""
    result, _ = _launch(tmp_path, "evaluate", script="uneven.py")
    assert result.returncode not in (0, 124), result.stdout[-3000:]
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    assert "another worker left the cluster (it ended, failed or was killed)" in log, log[-3000:]
    assert (tmp_path / "done-1").exists() and not (tmp_path / "done-0").exists()


def test_workers_with_data_of_unknown_size_find_its_end_together(tmp_path) -> None:
    """Datasets of unknown size (a filter) end in one more call of the step; a step's check of the workers' actions
    ran in that call until it waited for the step's data: false out-of-step errors, hangs and crashes with even
    shards (found by probing, stop 39, in the same session as the check)."""
    result, _ = _launch(tmp_path, "unknown-size", script="uneven.py")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "done-0").exists() and (tmp_path / "done-1").exists()
