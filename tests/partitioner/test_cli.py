"""The partitioner command: tables, JSON for scripts, and one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

import partitioner as pt
from partitioner.cli import main
from partitioner.synthetic import random_dag


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    pt.save_graph(random_dag(40, seed=3), path)
    return path


def test_cli_plan_from_profile_prints_tables(profile_file, capsys) -> None:
    assert main(["plan", str(profile_file), "--devices", "4", "--memory", "16GiB", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    for heading in ("Placement", "Devices", "Transfers between stages", "Prediction", "Against the splits"):
        assert heading in out
    assert "n0" in out and "/GPU:3" in out and "bubble fraction" in out and "gap to the bound" in out


def test_cli_plan_json_round_trips(profile_file, tmp_path, capsys) -> None:
    out_file = tmp_path / "plan.json"
    code = main(["plan", str(profile_file), "--cluster", "4xT4-pcie", "--json", "--out", str(out_file)])
    assert code == 0
    printed = capsys.readouterr().out
    plan = pt.Plan.from_json(printed)
    assert plan == pt.Plan.from_json(out_file.read_text())
    assert json.loads(printed)["kind"] == "plan"
    pt.validate_plan(plan, pt.load_graph(profile_file), pt.Cluster.from_json("4xT4-pcie"))


def test_cli_timeline_as_text(profile_file, capsys) -> None:
    argv = ["plan", str(profile_file), "--devices", "3", "--memory", "16GiB", "--summary", "--timeline", "-"]
    assert main([*argv, "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "1f1b schedule, 3 stages x 8 micro-batches" in out
    rows = [line for line in out.splitlines() if line.strip().startswith("/GPU:") and "|" in line]
    assert len([r for r in rows if "->" not in r]) == 3  # one row per device, then one per link
    assert all("F" in r and "B" in r for r in rows if "->" not in r)
    assert "(3 micro-batches in flight)" in out  # 1F1B: stage 0 holds K = 3 micro-batches, not M = 8


def test_cli_schedule_reaches_the_solver_and_the_report(profile_file, capsys) -> None:
    argv = ["plan", str(profile_file), "--devices", "3", "--memory", "16GiB", "--schedule", "1f1b"]
    assert main([*argv, "--json"]) == 0
    assert pt.Plan.from_json(capsys.readouterr().out).schedule == "1f1b"
    assert main([*argv, "--summary", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "(3 devices), 1f1b schedule" in out
    assert "predicted step time (1f1b, simulated)" in out


def test_cli_timeline_picture(profile_file, tmp_path, capsys) -> None:
    picture = tmp_path / "timeline.png"
    argv = ["plan", str(profile_file), "--devices", "2", "--memory", "16GiB", "--summary", "--timeline", str(picture)]
    assert main(argv) == 0
    assert f"timeline written to {picture}" in capsys.readouterr().out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "{profile}"], "Say which devices to plan for"),
        (["plan", "{profile}", "--devices", "2", "--memory", "-3"], "is not a size. Expected a positive number"),
        (["plan", "{profile}", "--devices", "2", "--memory", "16GiB", "--cluster", "8xH100-nvlink"], "not both"),
        (["plan", "{profile}", "--cluster", "no-such-cluster"], "No cluster file 'no-such-cluster'"),
        (["plan", "{missing}", "--devices", "2", "--memory", "1GiB"], "Cannot read layer graph"),
        (["plan", "{corrupt}", "--devices", "2", "--memory", "1GiB"], "not valid JSON"),
        (["plan", "{future}", "--devices", "2", "--memory", "1GiB"], "newer than the 1 this version reads"),
        (["plan", "{profile}", "--devices", "2", "--memory", "1KiB"], "alone needs"),
        (["plan", "{profile}", "--devices", "99", "--memory", "1GiB"], "only 40 nodes"),
        (["plan", "{profile}", "--devices", "2", "--memory", "1GiB", "--timeline", "t.txt"], "takes a .png, .svg"),
        (["plan", "{profile}", "--devices", "2", "--memory", "1GiB", "--timeline", "-", "--json"], "--json prints"),
    ],
)
def test_cli_errors_are_one_line(argv, message, profile_file, tmp_path, capsys) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    future = tmp_path / "future.json"
    data = json.loads(profile_file.read_text())
    data["schema_version"] = 99
    future.write_text(json.dumps(data))
    paths = {"profile": profile_file, "missing": tmp_path / "nope.json", "corrupt": corrupt, "future": future}
    assert main([a.format(**paths) for a in argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.err.startswith("error:")
    assert "Traceback" not in captured.err


def test_cli_plan_keras_application(capsys, virtual_devices) -> None:
    """A keras.applications name is built with weights=None, profiled and planned."""
    code = main(["plan", "MobileNetV2", "--input-size", "32", "--devices", "4", "--memory", "2GiB", "--summary"])
    assert code == 0
    out = capsys.readouterr().out
    assert "mobilenetv2" in out.lower() and "Prediction" in out and "Placement" not in out


def test_cli_unknown_model_name(capsys, virtual_devices) -> None:
    assert main(["plan", "NoSuchNet", "--devices", "2", "--memory", "1GiB"]) == 2
    assert "Unknown model 'NoSuchNet'" in capsys.readouterr().err


def test_cli_profile_writes_a_layer_graph(tmp_path, capsys, virtual_devices) -> None:
    out_file = tmp_path / "mobilenet.json"
    code = main(["profile", "MobileNetV2", "--input-size", "32", "--no-time", "--out", str(out_file)])
    assert code == 0
    graph = pt.load_graph(out_file)
    assert graph.number_of_nodes() > 100 and "GFLOPs" in capsys.readouterr().out
