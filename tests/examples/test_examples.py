"""Smoke tests: every example runs to the end as a script (``--quick``) and prints its key result."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 300  # generous: a loaded 2-core machine is several times slower than an idle one


def run_example(script: str, *args: str) -> str:
    """Runs ``examples/<script> <args>`` in a fresh interpreter; returns its stdout, failing on a non-zero exit."""
    env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{script} {' '.join(args)} exited with status {result.returncode}.\n"
            f"--- stdout (end) ---\n{result.stdout[-4000:]}\n--- stderr (end) ---\n{result.stderr[-4000:]}"
        )
    return result.stdout


def number_after(label: str, text: str) -> float:
    """The first number printed after ``label`` in ``text``."""
    match = re.search(re.escape(label) + r"\s*([0-9]*\.?[0-9]+)", text)
    assert match is not None, f"no line with {label!r} in the output:\n{text[-3000:]}"
    return float(match.group(1))


@pytest.mark.slow  # 17-31 s on 2 cores; make test-slow runs it
def test_digits_pipeline_reaches_90_percent() -> None:
    out = run_example("digits_pipeline.py", "--quick")
    assert "load_digits (real)" in out
    assert number_after("test accuracy:", out) >= 0.90
    assert "every variable on its planned device: True" in out


def test_cifar10_model_parallel_synthetic_learns() -> None:
    out = run_example("cifar10_model_parallel.py", "--quick", "--synthetic")
    assert "SYNTHETIC DATA" in out  # the banner
    assert number_after("test accuracy (SYNTHETIC stand-in):", out) > 0.2  # chance is 0.1
    assert len(re.findall(r"^stage \d on ", out, flags=re.MULTILINE)) >= 2  # really split
    assert "every variable on its planned device: True" in out


@pytest.mark.slow  # 17-31 s on 2 cores; make test-slow runs it
def test_transformer_pipeline_loss_falls() -> None:
    out = run_example("transformer_pipeline.py", "--quick")
    assert "SYNTHETIC counting sequences" in out
    match = re.search(r"loss fell from ([0-9.]+) to ([0-9.]+)", out)
    assert match is not None, out[-3000:]
    first, last = map(float, match.groups())
    assert last < first
    assert len(re.findall(r"^stage \d on ", out, flags=re.MULTILINE)) >= 2
    assert number_after("largest logit difference:", out) < 1e-4


def test_plan_demo_prints_measured_and_predicted_step() -> None:
    out = run_example("plan_demo.py", "--quick")
    for table in ("Placement", "Devices (times per micro-batch)", "Prediction", "Against the splits other tools use"):
        assert table in out
    assert "Observed placement" in out
    assert "measured step, pipelined (median)" in out
    assert "predicted step, plan.step_time_s" in out
    # the text timeline; the planner may leave a device idle: 4 logical devices share this machine's cores (their pool)
    assert re.search(r"gpipe schedule, [234] stages x", out) and "/device:CPU:0 -> /device:CPU:1 |" in out
    assert "every variable on its planned device: True" in out


@pytest.mark.slow  # 17-31 s on 2 cores; make test-slow runs it
def test_char_gpt_learns_stdlib_text() -> None:
    out = run_example("char_gpt.py", "--steps", "3")
    assert "REAL text, the source of the standard-library modules" in out
    match = re.search(r"loss fell from ([0-9.]+) to ([0-9.]+)", out)
    assert match is not None, out[-3000:]
    first, last = map(float, match.groups())
    assert last < first
    assert 2 <= len(re.findall(r"^stage \d on ", out, flags=re.MULTILINE)) <= 4  # split over up to 4 devices
    assert re.search(r"^stage 0 on .*\bcumsum\b.*\badd\b", out, flags=re.MULTILINE)  # keras.ops and tok + pos, placed
    assert re.search(r"^greedy continuation: '.{60}'$", out, flags=re.MULTILINE)
    assert number_after("largest logit difference:", out) < 1e-4


@pytest.mark.slow  # 17-31 s on 2 cores; make test-slow runs it
def test_keras_hub_gpt2_pipelines_a_backbone() -> None:
    pytest.importorskip("keras_hub")
    out = run_example("keras_hub_gpt2.py", "--steps", "3")
    match = re.search(r"loss fell from ([0-9.]+) to ([0-9.]+)", out)
    assert match is not None, out[-3000:]
    assert float(match.group(2)) < float(match.group(1))
    stages = re.findall(r"^stage \d on .*$", out, flags=re.MULTILINE)
    assert 2 <= len(stages) <= 4 and all("transformer_layer_" in s for s in stages)  # the backbone's layers split
    assert "every variable on its planned device: True" in out
    differences = re.findall(r"largest logit difference ([0-9.]+e[-+][0-9]+)", out)
    assert len(differences) == 2 and all(float(d) < 1e-4 for d in differences)  # another length; the saved file
