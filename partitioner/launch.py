"""Starts D worker processes of one training program on this machine, as torchrun does: ``partitioner launch``.

Each worker gets a ``TF_CONFIG`` naming every worker (free ports the OS hands out, new ones on each
restart) and its own index, ``PARTITIONER_DEVICES_PER_WORKER`` (read by ``runtime.start_worker``) and,
with ``--devices-per-worker K``, ``CUDA_VISIBLE_DEVICES`` of its own K GPUs. Workers run in process
groups of their own; their output goes to one log per worker and is echoed with a ``[i]`` prefix.

    partitioner launch --workers 2 --devices-per-worker 2 -- python train.py --epochs 3

The first worker to fail stops all the others (SIGTERM and SIGCONT to each group, SIGKILL to what is
left after a grace period); with ``--max-restarts R`` all are started again, up to R times
(resume with ``keras.callbacks.BackupAndRestore``). SIGTERM and SIGINT are forwarded. The status is
0 when every worker ends with 0, else the first failure's (124 on ``--timeout``, 128 + the signal's
number when the launcher itself is stopped), and no worker is left behind.

Imports no TensorFlow: the launcher only manages processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from partitioner.errors import InputError

DEVICES_PER_WORKER_ENV = "PARTITIONER_DEVICES_PER_WORKER"
TIMEOUT_STATUS = 124
GRACE_S = 5.0  # between SIGTERM and SIGKILL when stopping workers
_POLL_S = 0.05


@dataclass(frozen=True)
class LaunchOptions:
    """How ``launch`` runs the workers."""

    num_workers: int  # D: worker processes, one per pipeline replica
    devices_per_worker: int | None = None  # K: each worker's devices (GPUs: CUDA_VISIBLE_DEVICES of its own)
    max_restarts: int = 0  # how many times every worker is started again after a failure
    timeout_s: float | None = None  # wall-clock limit of the whole launch (all restarts), status 124
    log_dir: str | None = None  # one log per worker here (worker-<i>.log); default: none, echo only
    host: str = "localhost"  # the address workers reach each other at

    def __post_init__(self) -> None:
        for name, flag in (
            ("num_workers", "workers"),
            ("devices_per_worker", "devices-per-worker"),
            ("max_restarts", "max-restarts"),
        ):
            value = getattr(self, name)
            low = 0 if name == "max_restarts" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise InputError(f"--{flag} ({name}) must be an integer >= {low}. Received: {value!r}.")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise InputError(f"--timeout must be a positive number of seconds. Received: {self.timeout_s!r}.")


def free_ports(count: int, host: str = "localhost") -> list[int]:
    """``count`` distinct ports the OS has free now (bound together, then released)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_environment(rank: int, ports: Sequence[int], options: LaunchOptions) -> dict[str, str]:
    """The environment of worker ``rank``: TF_CONFIG, its device count and, with K given, its GPUs.

    Example:
        >>> env = worker_environment(1, [5000, 5001], LaunchOptions(2, devices_per_worker=2))
        >>> json.loads(env["TF_CONFIG"])["task"], env["CUDA_VISIBLE_DEVICES"]
        ({'type': 'worker', 'index': 1}, '2,3')
    """
    config = {
        "cluster": {"worker": [f"{options.host}:{port}" for port in ports]},
        "task": {"type": "worker", "index": rank},
    }
    env = {"TF_CONFIG": json.dumps(config)}
    if options.devices_per_worker is not None:
        k = options.devices_per_worker
        env[DEVICES_PER_WORKER_ENV] = str(k)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(rank * k + i) for i in range(k))
    return env


class _Worker:
    """One running worker: its process (a group of its own) and the thread echoing its output."""

    def __init__(self, rank: int, command: Sequence[str], env: dict[str, str], log: Path | None) -> None:
        self.rank = rank
        self.process = subprocess.Popen(
            list(command),
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._echo = threading.Thread(target=self._pump, args=(log,), daemon=True)
        self._echo.start()

    def _pump(self, log: Path | None) -> None:
        handle: IO[str] | None = log.open("a", encoding="utf-8") if log is not None else None
        try:
            assert self.process.stdout is not None
            for raw in self.process.stdout:
                line = raw.decode("utf-8", "replace")
                if handle is not None:
                    handle.write(line)
                    handle.flush()
                sys.stdout.write(f"[{self.rank}] {line}")
                sys.stdout.flush()
        finally:
            if handle is not None:
                handle.close()

    def signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(self.process.pid, number)

    def finish(self) -> None:
        self._echo.join(timeout=GRACE_S)


def _stop(workers: Sequence[_Worker]) -> None:
    """SIGTERM to every worker's group, then SIGKILL to those still there after the grace period. SIGCONT
    follows SIGTERM (as systemd does): a stopped worker takes its SIGTERM now, not a SIGKILL at the end."""
    running = [w for w in workers if w.process.poll() is None]
    for w in running:
        w.signal(signal.SIGTERM)
        w.signal(signal.SIGCONT)
    deadline = time.monotonic() + GRACE_S
    while any(w.process.poll() is None for w in running) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for w in workers:
        w.signal(signal.SIGKILL)  # the group too: children a worker started
        w.process.wait()
        w.finish()


def launch(command: Sequence[str], options: LaunchOptions) -> int:
    """Runs ``command`` as ``options.num_workers`` workers until all succeed or one fails.

    Returns:
        0 when every worker ended with 0; else the first failure's status (a worker killed by signal n
        gives 128 + n), 124 on timeout, 128 + n when the launcher received signal n.

    Raises:
        InputError: an empty command.
    """
    if not command:
        raise InputError("partitioner launch needs the program to run, after '--': e.g. -- python train.py.")
    logs = Path(options.log_dir) if options.log_dir else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    deadline = None if options.timeout_s is None else time.monotonic() + options.timeout_s
    received: list[int] = []

    def forward(number: int, _frame: object) -> None:
        received.append(number)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for attempt in range(options.max_restarts + 1):
            ports = free_ports(options.num_workers, options.host)
            workers = [
                _Worker(
                    rank,
                    command,
                    worker_environment(rank, ports, options),
                    None if logs is None else logs / f"worker-{rank}.log",
                )
                for rank in range(options.num_workers)
            ]
            status = _watch(workers, deadline, received)
            _stop(workers)
            if status == 0 or status == TIMEOUT_STATUS or received or attempt == options.max_restarts:
                return status
            print(
                f"[launch] a worker failed with status {status}: restarting all {options.num_workers} "
                f"({attempt + 1} of {options.max_restarts} restarts)",
                flush=True,
            )
        return 1  # not reached: the last attempt returns
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _watch(workers: Sequence[_Worker], deadline: float | None, received: list[int]) -> int:
    """Waits until every worker ended with 0 (returns 0), one failed (its status), the deadline passed
    (124) or the launcher was signalled (128 + n)."""
    while True:
        if received:
            return 128 + received[0]
        if deadline is not None and time.monotonic() > deadline:
            print("[launch] timeout: stopping every worker", flush=True)
            return TIMEOUT_STATUS
        codes = [w.process.poll() for w in workers]
        failed = [c for c in codes if c is not None and c != 0]
        if failed:
            code = failed[0]
            return 128 - code if code < 0 else code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(_POLL_S)
