"""The partitioner command: tables, JSON for scripts, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import networkx as nx
import pytest
from rich.console import Console

import partitioner as pt
from partitioner import cli
from partitioner.cli import main
from partitioner.synthetic import random_dag

# Names as long as keras.applications and keras-hub give them, and one that is longer than most.
LONG_NAMES = [
    "conv2_block1_1_conv",
    "conv5_block3_preact_relu",
    "block_16_depthwise_BN",
    "transformer_layer_11_self_attention_output_dense",
    "attention[bench]_scores",  # rich markup would swallow '[bench]'
]


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
    assert "Capacities leave 10% of each device's memory free (--memory-headroom 0.1)." in out
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


def test_cli_plan_device_order(profile_file, tmp_path, capsys) -> None:
    # 1 fast device listed last and 3 slow ones: "given" keeps the listed order, the default searches.
    devices = [pt.Device(f"/GPU:{i}", memory="16GiB", flops_per_s=50e12) for i in range(3)]
    cluster = pt.Cluster([*devices, pt.Device("/GPU:3", memory="32GiB", flops_per_s=200e12)], bandwidth="10GB/s")
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(cluster.to_json())
    argv = ["plan", str(profile_file), "--cluster", str(cluster_file), "--json"]
    assert main([*argv, "--device-order", "given"]) == 0
    given = pt.Plan.from_json(capsys.readouterr().out)
    assert main(argv) == 0
    searched = pt.Plan.from_json(capsys.readouterr().out)
    assert given.devices == tuple(cluster.names)
    assert searched.step_time_s <= given.step_time_s * (1 + 1e-9)
    pt.validate_plan(searched, pt.load_graph(profile_file), cluster)
    with pytest.raises(SystemExit):  # argparse lists the choices
        main([*argv, "--device-order", "fastest"])


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


def test_cli_recompute_reaches_the_solver_and_the_report(profile_file, capsys) -> None:
    argv = ["plan", str(profile_file), "--devices", "3", "--memory", "16GiB", "--recompute", "always"]
    assert main([*argv, "--json"]) == 0
    assert pt.Plan.from_json(capsys.readouterr().out).recompute == (True, True, False)
    assert main([*argv, "--summary", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 recomputes its forward; stage 1 recomputes its forward" in out


def test_cli_timeline_picture(profile_file, tmp_path, capsys) -> None:
    picture = tmp_path / "timeline.png"
    argv = ["plan", str(profile_file), "--devices", "2", "--memory", "16GiB", "--summary", "--timeline", str(picture)]
    assert main(argv) == 0
    assert f"timeline written to {picture}" in capsys.readouterr().out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_memory_headroom_leaves_memory_free(profile_file, capsys) -> None:
    """By default (--memory-headroom 0.1) no device is planned past 90% of its memory: on devices 5%
    larger than the plan made with no headroom needs, that plan no longer fits, and the CLI makes
    another one or says why none fits, naming the headroom."""
    argv = ["plan", str(profile_file), "--devices", "2", "--time-limit", "5", "--json"]
    assert main([*argv, "--memory", "16GiB", "--memory-headroom", "0"]) == 0
    need = max(pt.Plan.from_json(capsys.readouterr().out).memory_bytes.values())
    memory = str(int(need * 1.05))
    assert main([*argv, "--memory", memory, "--memory-headroom", "0"]) == 0
    assert max(pt.Plan.from_json(capsys.readouterr().out).memory_bytes.values()) > 0.9 * int(memory)
    code = main([*argv, "--memory", memory])
    captured = capsys.readouterr()
    if code == 0:
        plan = pt.Plan.from_json(captured.out)
        assert max(plan.memory_bytes.values()) <= 0.9 * int(memory)
        assert all(c <= 0.9 * int(memory) for c in plan.capacity_bytes.values())
    else:
        assert code == 2 and captured.err.startswith("error:")
        assert "leave 10% of each device's memory free (memory headroom 0.1" in captured.err


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
        (["plan", "{profile}", "--devices", "2", "--memory", "1GiB", "--memory-headroom", "1"], "in [0, 1), e.g. 0.1"),
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


@pytest.fixture
def batched_profile_file(tmp_path):
    """A chain profiled at batch 32 in 8 micro-batches: costs are for 4 samples, as the profiler records them."""
    graph = pt.chain_graph(
        [4e12] * 4, param_bytes=[2**20] * 4, activation_bytes=[2**20] * 4, edge_bytes=[2**20] * 3, prefix="dense"
    )
    graph.graph.update(model_name="mlp", batch_size=32, num_microbatches=8, micro_batch_size=4)
    path = tmp_path / "batched.json"
    pt.save_graph(graph, path)
    return path


def _planned(path, capsys, *flags: str) -> pt.Plan:
    argv = ["plan", str(path), "--devices", "1", "--memory", "64GiB", "--flops-per-s", "1e12", *flags, "--json"]
    assert main(argv) == 0
    return pt.Plan.from_json(capsys.readouterr().out)


def test_cli_plan_from_profile_rescales_to_the_batch_size(batched_profile_file, capsys) -> None:
    as_profiled = _planned(batched_profile_file, capsys)
    assert as_profiled.num_microbatches == 8  # the profile's own M
    assert as_profiled.step_time_s == pytest.approx(8 * 4 * 4.0)  # 8 micro-batches of 4 layers x 4 s
    doubled = _planned(batched_profile_file, capsys, "--batch-size", "64")
    assert doubled.num_microbatches == 8
    assert doubled.step_time_s == pytest.approx(2 * as_profiled.step_time_s)  # twice the samples, twice the work
    assert doubled.memory_bytes["/GPU:0"] > as_profiled.memory_bytes["/GPU:0"]  # activations grow, weights do not


def test_cli_plan_from_profile_micro_batches_split_the_batch(batched_profile_file, capsys) -> None:
    eight = _planned(batched_profile_file, capsys, "--batch-size", "64", "--micro-batches", "8")
    two = _planned(batched_profile_file, capsys, "--batch-size", "64", "--micro-batches", "2")
    assert two.num_microbatches == 2
    assert two.step_time_s == pytest.approx(eight.step_time_s)  # one device: the same 64 samples of work
    assert two.compute_times["/GPU:0"] == pytest.approx(4 * eight.compute_times["/GPU:0"])  # 32 samples, not 8


def test_cli_plan_from_profile_says_the_batch(batched_profile_file, capsys) -> None:
    argv = ["plan", str(batched_profile_file), "--devices", "2", "--memory", "64GiB", "--summary", "--no-compare"]
    assert main([*argv, "--batch-size", "48", "--micro-batches", "4"]) == 0
    assert "batch 48 in 4 micro-batches of 12" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "named"), [(["--batch-size", "64"], "--batch-size"), (["--micro-batches", "4"], "--micro-batches")]
)
def test_cli_plan_from_profile_without_a_batch_size_refuses_to_rescale(profile_file, flags, named, capsys) -> None:
    assert main(["plan", str(profile_file), "--devices", "2", "--memory", "16GiB", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    assert "does not record the batch size its costs were measured at" in err and f"so {named} cannot" in err


def test_cli_plan_chooses_microbatches_and_schedule(batched_profile_file, capsys) -> None:
    """1 s per sample and layer, 1 s per forward or backward of a stage, batch 64 on 2 devices: the
    step (M + 1) x (128 / M + 2) s is shortest at M = 8 (162 s); M = 4 (170 s) is within 5% of it with fewer
    micro-batches and wins (choose's margin); GPipe wins the tie with 1F1B."""
    argv = ["plan", str(batched_profile_file), "--devices", "2", "--memory", "64GiB", "--flops-per-s", "1e12"]
    argv += ["--action-overhead-s", "1", "--batch-size", "64", "--micro-batches", "auto", "--schedule", "auto"]
    assert main([*argv, "--summary", "--no-compare"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "M = 4 and gpipe chosen: the fewest micro-batches within 5% of the shortest simulated step "
        "(M = 8 gpipe, 162.00 s against 170.00 s) of 14 candidates"
    ) in out
    assert main([*argv, "--json"]) == 0
    plan = pt.Plan.from_json(capsys.readouterr().out)
    assert (plan.num_microbatches, plan.schedule, plan.num_stages) == (4, "gpipe", 2)
    assert plan.step_time_s == pytest.approx(5 * 34.0, rel=1e-3)
    assert main([*argv[:-3], "4", "--schedule", "1f1b", "--json"]) == 0  # a fixed M and schedule are kept
    fixed = pt.Plan.from_json(capsys.readouterr().out)
    assert (fixed.num_microbatches, fixed.schedule) == (4, "1f1b")


def test_cli_plan_chooses_on_a_dag_after_screening(tmp_path, capsys) -> None:
    graph = random_dag(20, seed=5)
    graph.graph.update(batch_size=16, num_microbatches=1)
    path = tmp_path / "dag.json"
    pt.save_graph(graph, path)
    argv = ["plan", str(path), "--devices", "4", "--memory", "16GiB", "--action-overhead-s", "1e-4"]
    argv += ["--micro-batches", "auto", "--schedule", "auto", "--summary", "--no-compare", "--time-limit", "3"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "chosen: the shortest simulated step of 3 candidates solved, the best screened of 10" in out
    assert "(M in [1, 2, 4, 8, 16], gpipe/1f1b)" in out and "batch 16 in" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "{profile}", "--devices", "2", "--memory", "1GiB", "--micro-batches", "auto"],
         "does not record the batch size its costs were measured at, so --micro-batches auto"),
        (["plan", "{profile}", "--cluster", "4xT4-pcie", "--action-overhead-s", "1e-5"], "Pass either --cluster"),
        (["profile", "mlp", "--micro-batches", "auto"], "measures costs for one micro-batch size"),
    ],
)  # fmt: skip
def test_cli_auto_errors(argv, message, profile_file, capsys) -> None:
    assert main([a.format(profile=profile_file) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in " ".join(err.split())


def test_cli_micro_batches_must_be_a_number_or_auto(profile_file, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", str(profile_file), "--devices", "2", "--memory", "1GiB", "--micro-batches", "many"])
    assert "expected an integer or 'auto', got 'many'" in capsys.readouterr().err


def test_cli_plan_keras_application(capsys, virtual_devices) -> None:
    """A keras.applications name is built with weights=None, profiled and planned."""
    code = main(["plan", "MobileNetV2", "--input-size", "32", "--devices", "4", "--memory", "2GiB", "--summary"])
    assert code == 0
    out = capsys.readouterr().out
    assert "mobilenetv2" in out.lower() and "Prediction" in out and "Placement" not in out


def test_cli_plan_auto_microbatches_by_time_measures_the_fixed_part(
    tmp_path, monkeypatch, capsys, virtual_devices
) -> None:
    """--cost time with --micro-batches auto prices each M by rescaling timed layers: the profile times each
    layer at one sample too (fixed_time_s), or small micro-batches would look free and auto would pick the
    most (16 here, without it); and the step's own work, which a plan for the devices it was measured on
    carries (step_overhead_s), and one for other devices (--devices 2: /GPU:0, /GPU:1) does not."""
    (tmp_path / "tiny_models.py").write_text(
        "import keras\n\n\ndef build():\n    inputs = keras.Input((16,))\n"
        "    hidden = keras.layers.Dense(32, activation='relu')(inputs)\n"
        "    return keras.Model(inputs, keras.layers.Dense(4)(hidden), name='tiny')\n"
    )
    monkeypatch.chdir(tmp_path)
    args = ["plan", "tiny_models:build", "--devices", "2", "--memory", "1GiB", "--batch-size", "16"]
    code = main([*args, "--cost", "time", "--micro-batches", "auto", "--out", str(tmp_path / "plan.json")])
    assert code == 0, capsys.readouterr().err
    plan = pt.Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.cost == "time" and plan.num_microbatches <= 4
    assert plan.step_overhead_s == 0.0 and "with the step's own work" not in capsys.readouterr().out
    # a profile of the whole batch written first and planned later: timed, it times both parts too, so auto
    # prices M alike (without fixed_time_s in the file, the same command picks 16, one sample each)
    profile = tmp_path / "tiny.json"
    whole = ["--batch-size", "16", "--micro-batches", "1"]
    assert main(["profile", "tiny_models:build", *whole, "--out", str(profile)]) == 0
    graph = pt.load_graph(profile)
    timed = [d for _, d in graph.nodes(data=True) if d.get("time_s")]
    assert graph.graph["step_overhead_s"] > 0 and timed and all(d.get("fixed_time_s") is not None for d in timed)
    later = ["plan", str(profile), "--devices", "2", "--memory", "1GiB", "--cost", "time", "--micro-batches", "auto"]
    assert main([*later, "--out", str(tmp_path / "later.json")]) == 0, capsys.readouterr().err
    assert pt.Plan.from_json((tmp_path / "later.json").read_text()).num_microbatches <= 4
    assert main(["profile", "tiny_models:build", "--batch-size", "16", "--no-time", "--out", str(profile)]) == 0
    assert "step_overhead_s" not in pt.load_graph(profile).graph  # untimed: neither part


def test_cli_unknown_model_name(capsys, virtual_devices) -> None:
    assert main(["plan", "NoSuchNet", "--devices", "2", "--memory", "1GiB"]) == 2
    assert "Unknown model 'NoSuchNet'" in capsys.readouterr().err


def test_cli_profile_writes_a_layer_graph(tmp_path, capsys, virtual_devices) -> None:
    out_file = tmp_path / "mobilenet.json"
    code = main(["profile", "MobileNetV2", "--input-size", "32", "--no-time", "--out", str(out_file)])
    assert code == 0
    graph = pt.load_graph(out_file)
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert graph.number_of_nodes() > 100 and "GFLOPs per micro-batch of 4 samples" in out  # 32 in 8
    assert "computed in float32" in out
    assert (graph.graph["batch_size"], graph.graph["micro_batch_size"], graph.graph["compute_dtype"]) == (
        32,
        4,
        "float32",
    )


def _one_error_line(captured) -> str:
    """The error output, checked to be one line and no traceback."""
    assert captured.err.startswith("error:") and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    """A module `cli_models.py` in a fresh current directory that is not on sys.path, as a user has it."""
    (tmp_path / "cli_models.py").write_text(
        textwrap.dedent(
            """
            import keras

            def build():
                inputs = keras.Input((8,), name="x")
                hidden = keras.layers.Dense(4, name="hidden")(inputs)
                return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))

            def tokens():
                ids = keras.Input((None,), dtype="int32", name="token_ids")
                hidden = keras.layers.Dense(8, name="mix")(keras.layers.Embedding(50, 8, name="embed")(ids))
                pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
                return keras.Model(ids, keras.layers.Dense(2, name="head")(pooled))

            def broken():
                raise ValueError("my layer sizes are wrong [see the paper]")

            def not_a_model():
                return [1, 2]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.delitem(sys.modules, "cli_models", raising=False)
    yield "cli_models"
    sys.modules.pop("cli_models", None)


def test_cli_model_function_from_the_current_directory(model_module, capsys, virtual_devices) -> None:
    assert main(["profile", f"{model_module}:build", "--no-time"]) == 0
    assert "3 layers" in capsys.readouterr().out  # input, dense, head


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "{spec}", "--devices", "2", "--memory", "1GiB"],
        ["profile", "{spec}"],
        ["placement", "{spec}", "--devices", "2"],
    ],
    ids=["plan", "profile", "placement"],
)
def test_cli_model_that_fails_to_build_is_one_line(argv, model_module, capsys, virtual_devices) -> None:
    assert main([a.format(spec=f"{model_module}:broken") for a in argv]) == 2
    err = _one_error_line(capsys.readouterr())
    assert "Building the model 'cli_models:broken' raised ValueError: my layer sizes are wrong [see the paper]" in err
    assert "to import and return a keras.Model" in err and "--traceback" in err


def _executed_rows(out: str) -> list[list[str]]:
    """The rows of the 'Executed placement' table: stage, device, then forward/backward/optimizer shares
    (cells 2 to 7), the loss's share ('-' but on the last stage), XLA calls there, calls not read, the step's
    other ops."""
    table = out[out.index("Executed placement (one training step)") :]
    return [line.split() for line in table.splitlines() if line.split()[:1] in (["0"], ["1"])]


def test_cli_placement_runs_a_step_and_reports_where_ops_ran(model_module, capsys, virtual_devices) -> None:
    argv = ["placement", f"{model_module}:build", "--devices", "2", "--batch-size", "8", "--micro-batches", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gpipe schedule, M = 2: every variable and every stage's forward, backward and optimizer op" in out
    rows = _executed_rows(out)
    assert rows and all(row[7] == "(100%)" and not row[2].startswith("0/") for row in rows)
    assert all(row[-2] == "0" for row in rows)  # every call's body read


@pytest.mark.parametrize("spelling", ["tensorflow", "cluster file"])
def test_cli_placement_of_a_plan_with_recompute(spelling, model_module, tmp_path, capsys, virtual_devices) -> None:
    """A two-stage plan written earlier, run with 1F1B and recomputation: both stages' work on their devices,
    whether the plan spells its devices as TensorFlow lists them ('/device:CPU:0') or as the bundled
    cluster files do ('/CPU:0')."""
    import importlib.util

    from profiles import profile_model

    spec = importlib.util.spec_from_file_location("built_here", tmp_path / f"{model_module}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build()
    graph = profile_model(model, batch_size=8, num_microbatches=2, measure_time=False)
    names = [d if spelling == "tensorflow" else d.replace("/device:", "/") for d in virtual_devices[:2]]
    cluster = pt.Cluster([pt.Device(d, memory="1GiB") for d in names])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(pt.baselines.uniform(graph, cluster, num_microbatches=2).to_json())
    argv = ["placement", f"{model_module}:build", "--plan", str(plan_file), "--schedule", "1f1b"]
    assert main([*argv, "--recompute", "always", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "1f1b schedule, M = 2, stages 0 recompute their forward: every variable" in out
    rows = _executed_rows(out)
    assert [row[1] for row in rows] == virtual_devices[:2]
    assert all(cell == "(100%)" for row in rows for cell in row[3:8:2])
    assert rows[-1][8:10] == [rows[-1][8].split("/")[0] + "/" + rows[-1][8].split("/")[0], "(100%)"]  # the loss
    assert all(not row[2].startswith("0/") and not row[4].startswith("0/") for row in rows)


@pytest.mark.parametrize("flag", [["--sequence-length", "16"], ["--input-shape", "token_ids=16"]])
def test_cli_shape_flags_plan_a_model_of_open_length(flag, model_module, capsys, virtual_devices) -> None:
    assert main(["profile", f"{model_module}:tokens", "--no-time", *flag]) == 0
    assert "5 layers" in capsys.readouterr().out
    argv = ["placement", f"{model_module}:tokens", "--devices", "2", "--batch-size", "8", "--micro-batches", "2"]
    assert main([*argv, *flag]) == 0
    assert "every variable and every stage's forward, backward and optimizer op" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ([], r"Input 'token_ids' .* \(None, None\).*CLI: --sequence-length 128 or --input-shape token_ids=128"),
        (["--input-shape", "token_ids"], r"--input-shape takes NAME=SIZE .* Received: 'token_ids'"),
        (["--input-shape", "tokens=16"], r"input_shapes names \['tokens'\], which are not inputs"),
    ],
)
def test_cli_shape_errors_are_one_line(flag, message, model_module, capsys, virtual_devices) -> None:
    assert main(["plan", f"{model_module}:tokens", "--devices", "2", "--memory", "1GiB", *flag]) == 2
    assert re.search(message, _one_error_line(capsys.readouterr()))


def test_cli_model_function_must_return_a_model(model_module, capsys, virtual_devices) -> None:
    assert main(["profile", f"{model_module}:not_a_model"]) == 2
    assert "'cli_models:not_a_model' returned list, not a Keras model" in _one_error_line(capsys.readouterr())


def test_cli_keras_application_with_bad_arguments_is_one_line(capsys, virtual_devices) -> None:
    assert main(["profile", "MobileNetV2", "--input-size", "8"]) == 2  # Keras wants at least 32x32
    assert "Building the model 'MobileNetV2' raised ValueError" in _one_error_line(capsys.readouterr())


def test_cli_without_tensorflow_says_how_to_install_it(model_module, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` now raises ImportError
    assert main(["profile", f"{model_module}:build"]) == 2
    err = _one_error_line(capsys.readouterr())
    assert "needs TensorFlow and Keras 3" in err
    assert "pip install 'keras-partitioner[cpu]' (or [gpu]" in err  # brackets survive rich's markup


def test_cli_timeline_without_matplotlib_is_one_line(profile_file, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["plan", str(profile_file), "--devices", "2", "--memory", "16GiB", "--timeline", str(tmp_path / "t.png")]
    assert main(argv) == 2
    assert "Drawing a timeline needs matplotlib" in _one_error_line(capsys.readouterr())


def test_cli_failure_inside_the_library_is_one_line_status_1(profile_file, capsys, monkeypatch) -> None:
    def crash(*args, **kwargs):
        raise AttributeError("'Multiply' object has no attribute 'weights'\nsecond line of detail")

    monkeypatch.setattr(cli, "solve", crash)
    argv = ["plan", str(profile_file), "--devices", "2", "--memory", "16GiB"]
    assert main(argv) == 1
    err = _one_error_line(capsys.readouterr())
    assert f"'partitioner plan {profile_file}' failed inside keras-partitioner or Keras" in err
    assert "AttributeError: 'Multiply' object has no attribute 'weights' second line of detail" in err
    assert "rerun with --traceback" in err
    with pytest.raises(AttributeError, match="no attribute 'weights'"):
        main([*argv, "--traceback"])


@pytest.fixture
def long_named_profile(tmp_path):
    graph = nx.relabel_nodes(random_dag(len(LONG_NAMES), seed=1), {f"n{i}": name for i, name in enumerate(LONG_NAMES)})
    for node, kind in zip(graph, ["Conv2D", "Activation", "BatchNormalization", "EinsumDense", "Softmax"], strict=True):
        graph.nodes[node]["layer_type"] = kind
    path = tmp_path / "long.json"
    pt.save_graph(graph, path)
    return path


@pytest.mark.parametrize("width", [80, 200])
def test_cli_placement_table_keeps_layer_names_whole(width, long_named_profile, monkeypatch) -> None:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(cli, "_stdout", lambda: console)
    assert main(["plan", str(long_named_profile), "--devices", "2", "--memory", "16GiB", "--no-compare"]) == 0
    text = console.export_text()
    console.file.close()
    placement = text[text.index("Placement") : text.index("Devices")]
    rows = placement.splitlines()
    assert all(len(row) <= width for row in rows)
    for name in LONG_NAMES:
        assert any(name in row and "GPU:" in row for row in rows), name  # whole, beside its device
    assert "…" not in placement
    header = next(row for row in rows if "layer" in row and "device" in row)
    if width == 200:
        assert header.split() == ["layer", "type", "params", "FLOPs", "activation", "stage", "device"]
        assert "left out" not in placement
    else:
        assert "type" not in header.split()  # the widest optional column goes first
        assert "left out to fit the terminal's width: " in placement


def test_cli_plan_replicas_shows_data_pipeline_and_hybrid(batched_profile_file, capsys) -> None:
    """--replicas auto: every D x K tried with its step, the chosen one, and pure data parallel and a
    pure pipeline beside it; --json gives the plan with its replicas."""
    argv = ["plan", str(batched_profile_file), "--devices", "4", "--memory", "64GiB", "--flops-per-s", "1e12"]
    argv += ["--micro-batches", "auto", "--replicas", "auto", "--summary", "--time-limit", "5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Replicas x stages" in out and ", chosen" in out
    for row in ("1 x 4", "2 x 2", "4 x 1"):
        assert row in out
    assert re.search(r"Pure data parallel \(one device per replica\): [\d.]+ \S*s\.", out)
    assert re.search(r"One pipeline \(D = 1\): [\d.]+ \S*s\.", out)
    assert main([*argv, "--json"]) == 0
    plan = pt.Plan.from_json(capsys.readouterr().out)
    assert plan.num_replicas * plan.num_stages <= 4
    assert plan.num_replicas == 4  # 1 MiB of weights per layer over fast links: data parallel wins


def test_cli_plan_replicas_that_cannot_be_is_one_line(batched_profile_file, capsys) -> None:
    argv = ["plan", str(batched_profile_file), "--devices", "4", "--memory", "64GiB", "--replicas", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "replicas=3 needs at least 3 devices and a batch it divides" in err and len(err.strip().splitlines()) == 1


def test_cli_plan_workers_prices_one_workers_pipeline_of_d(batched_profile_file, capsys) -> None:
    """--workers D: the plan of one worker's devices, priced as one of D pipelines (Plan.priced_replicas), whose
    stages hold the packed copy of their gradients the all-reduce takes: 1 MiB more per layer here (SGD, M = 1;
    with M > 1 the sums' copy covers it)."""
    argv = ["plan", str(batched_profile_file), "--devices", "2", "--memory", "64GiB", "--flops-per-s", "1e12"]
    argv += ["--optimizer", "sgd", "--micro-batches", "1", "--time-limit", "5"]
    assert main([*argv, "--json"]) == 0
    alone = pt.Plan.from_json(capsys.readouterr().out)
    assert main([*argv, "--workers", "3", "--json"]) == 0
    one_of_three = pt.Plan.from_json(capsys.readouterr().out)
    assert (alone.priced_replicas, one_of_three.priced_replicas) == (1, 3)
    assert one_of_three.num_replicas == 1 and one_of_three.devices == alone.devices
    for device in one_of_three.stages:
        layers = len(one_of_three.nodes_on(device))
        assert one_of_three.memory_bytes[device] - alone.memory_bytes[device] == layers * 2**20
    assert main([*argv, "--workers", "3", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "The pipeline of one of 3 workers" in out and "replicas=3" in out
    # M chosen by the planner (choose): every candidate priced as one of 3
    auto = [a if a != "1" else "auto" for a in argv]
    assert main([*auto, "--workers", "3", "--json"]) == 0
    chosen = pt.Plan.from_json(capsys.readouterr().out)
    assert chosen.priced_replicas == 3


def test_cli_plan_worker_bandwidth_puts_the_workers_all_reduce_in_the_step(batched_profile_file, capsys) -> None:
    """--worker-bandwidth BW with --workers D: each stage's R, a ring over the D workers at BW (2 (D - 1) / D x its
    gradients' bytes / BW, + the device's fixed cost of an action), after its last action; the step ends with the
    last R; the plan file keeps them, and a simulation of it shows them. The search weighs them: its plan's step is
    no longer than the plan made without them priced with them."""
    argv = ["plan", str(batched_profile_file), "--devices", "2", "--memory", "64GiB", "--flops-per-s", "1e12"]
    argv += ["--optimizer", "sgd", "--micro-batches", "1", "--time-limit", "5", "--workers", "3"]
    assert main([*argv, "--json"]) == 0
    without = pt.Plan.from_json(capsys.readouterr().out)
    assert main([*argv, "--worker-bandwidth", "1GB/s", "--json"]) == 0
    priced = pt.Plan.from_json(capsys.readouterr().out)
    assert priced.priced_replicas == 3
    graph = pt.load_graph(batched_profile_file)
    for device in priced.stages:
        gradients = sum(graph.nodes[v]["param_bytes"] for v in priced.nodes_on(device))  # SGD: all trainable
        assert priced.reduce_times[device] == pytest.approx(2 * 2 / 3 * gradients / 1e9, rel=1e-3)
    # R only lengthens a pipeline's step; the plan without them, priced with them, is no shorter than the search's
    # (each of its R at most a ring of every weight's gradients, after its stage's last action)
    every = 2 * 2 / 3 * sum(graph.nodes[v]["param_bytes"] for v in graph) / 1e9
    assert without.step_time_s < priced.step_time_s <= without.step_time_s + every + 1e-12
    assert priced.step_time_s >= min(priced.reduce_times.values())
    assert main([*argv, "--worker-bandwidth", "1GB/s", "--summary"]) == 0
    assert "each stage's all-reduce between the workers at 1 GB/s is in the step" in " ".join(
        capsys.readouterr().out.split()
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "--workers takes the number of workers D >= 1 that run the pipeline. Received: 0."),
        (["--workers", "2", "--replicas", "2"], "--replicas splits this cluster's devices into D pipelines"),
        (
            ["--worker-bandwidth", "1GB/s"],
            "--worker-bandwidth prices the all-reduce between workers; it needs --workers",
        ),
        (["--workers", "2", "--worker-bandwidth", "fast"], "--worker-bandwidth"),
    ],
)
def test_cli_plan_workers_bad_input_is_one_line(batched_profile_file, capsys, flags, message) -> None:
    argv = ["plan", str(batched_profile_file), "--devices", "2", "--memory", "64GiB", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_calibrate_writes_a_cluster_file_that_loads(tmp_path, capsys, virtual_devices) -> None:
    out_file = tmp_path / "cluster.json"
    assert main(["calibrate", "--devices", "2", "--memory", "1GiB", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    for field in ("memory_bytes", "flops_per_s", "action_overhead_s", "bandwidth_bytes_per_s", "pool_capacity"):
        assert field in printed
    cluster = pt.Cluster.from_json(out_file)
    assert cluster.names == virtual_devices[:2]
    assert [d.memory_bytes for d in cluster.devices] == [2**30, 2**30]
    assert [d.action_overhead_s > 0 for d in cluster.devices] == [True, True]
    sources = json.loads(out_file.read_text())["source"]
    assert sources["memory_bytes"] == "given"
    assert sources["action_overhead_s"].startswith("measured: ")
    assert "by side: 256: " in sources["flops_per_s"]
    assert sources["pool_capacity"].startswith("measured: ")
    assert [d.pool for d in cluster.devices] == ["host CPU", "host CPU"]
