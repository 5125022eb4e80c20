"""tools/gpu_check.py, the prepared GPU check: its CPU-runnable parts pass on this machine, and
what needs a GPU says so instead of passing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_what_this_machine_allows():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| check")}
    for check in ("backend_map", "binding", "handoff", "bf16_update"):
        assert rows[check] == "passed", out.stdout
    assert rows["vllm_sleep"] == ("skipped" if not torch.cuda.is_available() else rows["vllm_sleep"])
