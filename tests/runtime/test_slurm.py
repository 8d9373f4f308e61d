"""Workers under Slurm: TF_CONFIG written from the job step's environment where none is set."""

from __future__ import annotations

import json
import os

import pytest

from runtime.workers import _read_tf_config, tf_config_from_slurm

SLURM = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


@pytest.fixture
def slurm(monkeypatch):
    for name in (*SLURM, "TF_CONFIG", "CUDA_VISIBLE_DEVICES", "PARTITIONER_PORT_BASE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)  # a CPU node: no nvidia-smi
    return monkeypatch


def test_one_task_per_node(slurm) -> None:
    for name, value in (("PROCID", "1"), ("STEP_NUM_TASKS", "2"), ("STEP_NODELIST", "node[1-2]")):
        slurm.setenv(f"SLURM_{name}", value)
    slurm.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)")
    assert tf_config_from_slurm()
    config = json.loads(os.environ["TF_CONFIG"])
    assert config == {"cluster": {"worker": ["node1:8888", "node2:8888"]}, "task": {"type": "worker", "index": 1}}
    assert _read_tf_config() == (["node1:8888", "node2:8888"], 1)


def test_two_tasks_on_one_node_take_two_ports(slurm) -> None:
    for name, value in (
        ("PROCID", "0"),
        ("STEP_NUM_TASKS", "2"),
        ("STEP_NODELIST", "node7"),
        ("STEP_TASKS_PER_NODE", "2"),
    ):
        slurm.setenv(f"SLURM_{name}", value)
    slurm.setenv("PARTITIONER_PORT_BASE", "23456")
    assert _read_tf_config() == (["node7:23456", "node7:23457"], 0)


def test_a_tf_config_or_a_single_task_is_left_alone(slurm) -> None:
    slurm.setenv("SLURM_PROCID", "0")
    slurm.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert not tf_config_from_slurm() and _read_tf_config() is None
    slurm.setenv("SLURM_STEP_NUM_TASKS", "2")
    given = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    slurm.setenv("TF_CONFIG", json.dumps(given))
    assert not tf_config_from_slurm() and _read_tf_config() == (["a:1", "b:2"], 1)
