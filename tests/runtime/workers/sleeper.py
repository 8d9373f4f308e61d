"""A worker that joins its cluster and waits: run by tests/runtime/test_faults.py, which sends it SIGTERM."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from runtime import start_worker

worker = start_worker(num_devices=2)
(Path(sys.argv[1]) / f"joined-{worker.rank}").write_text("")
time.sleep(60)
print(f"worker {worker.rank} woke: SIGTERM did not end it", flush=True)
