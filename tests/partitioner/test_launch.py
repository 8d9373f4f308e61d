"""partitioner launch: workers with their TF_CONFIG, logs, failures, restarts, timeouts (no TensorFlow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from partitioner.cli import main
from partitioner.launch import LaunchOptions, free_ports, worker_environment

PY = sys.executable


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "partitioner.cli", "launch", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_launch_gives_each_worker_its_tf_config_and_a_log(tmp_path) -> None:
    show = "import os; print(os.environ['TF_CONFIG']); print(os.environ['PARTITIONER_DEVICES_PER_WORKER'])"
    result = _run(["--workers", "3", "--devices-per-worker", "2", "--log-dir", str(tmp_path), "--", PY, "-c", show])
    assert result.returncode == 0, result.stdout + result.stderr
    configs = []
    for rank in range(3):
        log = (tmp_path / f"worker-{rank}.log").read_text().splitlines()
        assert f"[{rank}] {log[0]}" in result.stdout.splitlines()
        configs.append(json.loads(log[0]))
        assert log[1] == "2"
    assert [c["task"] for c in configs] == [{"type": "worker", "index": r} for r in range(3)]
    workers = configs[0]["cluster"]["worker"]
    assert all(c["cluster"]["worker"] == workers for c in configs)
    assert len(set(workers)) == 3


def test_the_first_failure_stops_every_worker_and_is_the_status(tmp_path) -> None:
    program = "import json, os, sys, time; rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    program += "time.sleep(0.2) if rank == 1 else time.sleep(60); sys.exit(7)"
    started = time.monotonic()
    result = _run(["--workers", "3", "--", PY, "-c", program])
    assert result.returncode == 7
    assert time.monotonic() - started < 30  # the sleepers were stopped, not waited for


def test_a_stopped_worker_takes_its_sigterm_when_another_fails(tmp_path) -> None:
    """Worker 0 stops itself (SIGSTOP, a hung worker); worker 1 fails: the launcher's SIGCONT after
    SIGTERM lets worker 0 run its SIGTERM handler instead of waiting for the SIGKILL."""
    handled = tmp_path / "handled"
    program = "import json, os, signal, sys, time; rank = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
    program += f"signal.signal(signal.SIGTERM, lambda *_: (open({str(handled)!r}, 'w').close(), sys.exit(9)))\n"
    program += "os.kill(os.getpid(), signal.SIGSTOP) if rank == 0 else (time.sleep(0.5), sys.exit(5))"
    result = _run(["--workers", "2", "--", PY, "-c", program])
    assert result.returncode == 5
    assert handled.exists()


def test_restarts_every_worker_then_returns_the_failure(tmp_path) -> None:
    counter = tmp_path / "starts"
    # each worker fails only once both workers of its attempt have written (an odd count waits for the other): a
    # worker that failed at once could have the other stopped before it wrote (CI, on a loaded machine)
    program = f"import sys, time; f = open({str(counter)!r}, 'a'); f.write('x'); f.close(); end = time.time() + 20\n"
    program += f"while open({str(counter)!r}).read().count('x') % 2 and time.time() < end: time.sleep(0.01)\n"
    program += "sys.exit(3)"
    result = _run(["--workers", "2", "--max-restarts", "2", "--", PY, "-c", program])
    assert result.returncode == 3
    assert counter.read_text() == "x" * 6  # 2 workers, 3 attempts
    assert result.stdout.count("restarting all 2") == 2


def test_timeout_returns_124_and_leaves_no_worker(tmp_path) -> None:
    pids = tmp_path / "pids"
    program = f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}} '); time.sleep(120)"
    result = _run(["--workers", "2", "--timeout", "3", "--", PY, "-c", program])
    assert result.returncode == 124
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path) -> None:
    pids = tmp_path / "pids"
    program = f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}} '); time.sleep(120)"
    launcher = subprocess.Popen([PY, "-m", "partitioner.cli", "launch", "--workers", "2", "--", PY, "-c", program])
    deadline = time.monotonic() + 30
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.terminate()
    assert launcher.wait(timeout=30) == 128 + 15
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_worker_environment_and_ports() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4
    env = worker_environment(1, ports[:2], LaunchOptions(2, devices_per_worker=3))
    assert env["CUDA_VISIBLE_DEVICES"] == "3,4,5"
    assert json.loads(env["TF_CONFIG"])["cluster"]["worker"] == [f"localhost:{p}" for p in ports[:2]]
    assert "CUDA_VISIBLE_DEVICES" not in worker_environment(0, ports[:2], LaunchOptions(2))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0", "--", "true"], r"--workers \(num_workers\) must be an integer >= 1. Received: 0."),
        (["--workers", "2", "--timeout", "-1", "--", "true"], "--timeout must be a positive number of seconds"),
        (["--workers", "2"], "needs the program to run, after '--'"),
    ],
)
def test_bad_launch_options_are_one_line(argv, message, capsys) -> None:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) <= 2
    assert re.search(message, " ".join(err.split()))
