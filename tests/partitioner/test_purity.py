"""The planner is pure: importing it loads networkx and OR-Tools, never TensorFlow or Keras."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import partitioner as pt
graph = pt.chain_graph([1e9, 2e9, 1e9], edge_bytes=[4096, 4096])
plan = pt.solve(graph, pt.Cluster.uniform(2, memory="1GiB"), time_limit_s=5,
                options=pt.SolverOptions(exact_chains=False, device_order="given", shortest_step=False))
print(json.dumps({"modules": sorted(sys.modules), "status": plan.status}))
"""


def _modules_after(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_purity_import_partitioner_loads_no_tensorflow_or_keras():
    report = _modules_after(_PROBE)
    modules = set(report["modules"])
    assert report["status"] == "optimal"  # the probe imported and ran the planner, CP-SAT included
    assert {"partitioner", "partitioner.search.solve", "networkx", "ortools"} <= modules
    loaded = sorted(m for m in modules if m.split(".")[0] in {"tensorflow", "keras", "tf_keras", "jax", "torch"})
    assert loaded == []


def test_purity_bundled_hardware_is_read_without_the_profiler_package():
    # The pure core owns the hardware profiles it reads (partitioner/hardware): a bundled cluster loads
    # without importing the TensorFlow-side `profiles` package.
    code = (
        "import json, sys\n"
        "import partitioner as pt\n"
        "cluster = pt.Cluster.from_json('2xT4+2xA100')\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'status': str(cluster.num_devices)}))\n"
    )
    report = _modules_after(code)
    assert report["status"] == "4"
    assert "profiles" not in report["modules"]


def test_purity_solver_runs_after_tensorflow_is_imported():
    # TensorFlow imported first used to crash CP-SAT's Solve (google/or-tools#3230); the planner must
    # work in a process that already holds TensorFlow, as in `profile_model` followed by `solve`.
    # It also shows the check above can fail: this child does list TensorFlow in sys.modules.
    report = _modules_after("import tensorflow\n" + _PROBE)
    assert report["status"] == "optimal"
    assert "tensorflow" in report["modules"]
