"""Data x pipeline on one machine: 2 workers x 2 logical devices against 1 worker x 2, the same global batch.

Writes results.json and the table in README.md (between the markers). Synthetic data (random features
and labels), a 6 x Dense(512) MLP split in two stages by pins, Adam, GPipe.

    python benchmarks/data_parallel/run.py            # global batch 256, M = 4, 30 timed steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.readme
from benchmarks.readme import write_block  # noqa: E402


def _results(output: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]


def _run(command: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return _results(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    worker = [str(HERE / "worker.py"), str(args.batch), str(args.micro_batches), str(args.steps)]
    started = time.time()
    alone = _run([sys.executable, *worker])
    launch = [sys.executable, "-m", "partitioner.cli", "launch", "--workers", "2", "--devices-per-worker", "2"]
    together = _run([*launch, "--timeout", "900", "--", sys.executable, *worker])
    one, two = alone[0], sorted(together, key=lambda r: r["rank"])
    rows = [("1 worker x 2 devices", one), *((f"2 workers x 2 devices: worker {r['rank']}", r) for r in two)]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "global_batch": args.batch,
        "num_microbatches": args.micro_batches,
        "steps": args.steps,
        "gradient_bytes": one["gradient_bytes"],
        "alone": one,
        "workers": two,
        "wall_s": round(time.time() - started, 1),
    }
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| configuration | rows per worker | step (median) | R action alone | R share of the step "
        "| R per stage, timed at wrap (the plan's) | predicted step (the plan's) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        step, reduce_s, planned = r["step_s"], r["r_action_s"], r.get("plan_reduce_s") or []
        share = "" if reduce_s is None else f"{reduce_s / step:.0%}"
        reduce_text = "" if reduce_s is None else f"{reduce_s * 1e3:.1f} ms"
        planned_text = " + ".join(f"{t * 1e3:.1f}" for t in planned) + " ms" if any(planned) else ""
        predicted = r.get("predicted_step_s")
        predicted_text = "" if predicted is None else f"{predicted * 1e3:.1f} ms"
        lines.append(
            f"| {name} | {r['local_batch']} | {step * 1e3:.1f} ms | {reduce_text} | {share} | {planned_text} "
            f"| {predicted_text} |"
        )
    table = "\n".join(lines)
    print(table)
    write_block(HERE / "README.md", "results", table)


if __name__ == "__main__":
    main()
