"""A run whose reward function returns NaN stops at once, commits nothing non-finite, and says why
in `hpcrl status` (a real staged run of the tiny task: vLLM, DeepSpeed, the local executor)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from hpcrl import commit
from hpcrl.rundir import RunDir

pytestmark = pytest.mark.timeout(900)

# Exact match in iteration 0's score job, NaN from the next one on (iteration 1): each score job is
# its own process, so the imports count the jobs; `hpcrl submit` imports the module once first, to
# check that it loads.
NAN_REWARD = '''
import math, os
from pathlib import Path

_counter = Path(os.environ["NAN_REWARD_COUNTER"])
_jobs = int(_counter.read_text()) + 1 if _counter.exists() else 1
_counter.write_text(str(_jobs))


def judge(response, ground_truth, **_):
    return math.nan if _jobs >= 3 else float(response.strip() == ground_truth.strip())
'''


def test_a_nan_reward_stops_the_run_at_once_and_status_names_it(tmp_path, tiny_task):
    import os

    import tests.conftest as c

    (tmp_path / "nan_reward.py").write_text(NAN_REWARD)
    path = tmp_path / "nan.toml"
    path.write_text(c.experiment_toml(tiny_task, tmp_path / "runs", "nan",
                                      run={"iterations": 2, "eval_every": 0},
                                      reward={"functions": ["nan_reward:judge"]}, executor={"max_retries": 2},
                                      tracking={"enabled": False}))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NAN_REWARD_COUNTER": str(tmp_path / "score-jobs")}
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], capture_output=True,
                         text=True, env=env)
    assert out.returncode != 0
    assert "not retried: RewardValueError is not cured by a retry" in out.stdout + out.stderr
    # submit's check, iteration 0's score, one attempt at 1's
    assert (tmp_path / "score-jobs").read_text() == "3"
    run = RunDir.at(tmp_path / "runs" / "nan")
    assert (commit.is_committed(run.stage_dir(0, "update"))
            and not commit.is_committed(run.stage_dir(1, "score")))
    weights = load_file(run.stage_dir(0, "update") / "policy" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())  # every committed policy is finite

    status = subprocess.run([sys.executable, "-m", "hpcrl.cli", "status", str(run.root)], capture_output=True,
                            text=True)
    line = next(x for x in status.stdout.splitlines() if x.startswith("STOPPED"))
    assert ("stage score of iteration 1 failed: RewardValueError: reward source 'nan_reward:judge' "
            "gave score = nan") in line
    assert f"hpcrl resume {run.root}" in line


HUGE_REWARD = '''
def judge(response, ground_truth, **_):  # finite, but no float32 gradient of it is
    return 3.0e38 if response.strip() == ground_truth.strip() else 0.0
'''


def test_an_update_that_goes_non_finite_stops_the_run_at_policy_version_0(tmp_path, tiny_task):
    """A finite reward too large for float32 (3e38, Dr.GRPO's unscaled advantages): the first update
    goes non-finite. The run stops without a retry, commits no policy, and status says why."""
    import os

    import tests.conftest as c

    (tmp_path / "huge_reward.py").write_text(HUGE_REWARD)
    path = tmp_path / "huge.toml"
    path.write_text(c.experiment_toml(tiny_task, tmp_path / "runs", "huge",
                                      run={"iterations": 1, "eval_every": 0},
                                      algorithm={"norm_adv_by_std": False},
                                      reward={"functions": ["huge_reward:judge"]},
                                      executor={"max_retries": 2}, tracking={"enabled": False}))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not retried: FloatingPointError is not cured by a retry" in out.stdout + out.stderr
    run = RunDir.at(tmp_path / "runs" / "huge")
    assert commit.is_committed(run.stage_dir(0, "score"))
    assert not commit.is_committed(run.stage_dir(0, "update"))
    assert not list(run.root.rglob("*.safetensors"))  # no policy was written, finite or not
    status = subprocess.run([sys.executable, "-m", "hpcrl.cli", "status", str(run.root)], capture_output=True,
                            text=True)
    line = next(x for x in status.stdout.splitlines() if x.startswith("STOPPED"))
    assert ("stage update of iteration 0 failed: FloatingPointError: non-finite loss (nan) on rank 0; the "
            "update is not committed") in line


def test_the_failure_reason_is_the_last_exception_line_of_the_log():
    from hpcrl.controller import failure_reason

    tail = """Traceback (most recent call last):
  File "/x/hpcrl/stage.py", line 139, in run
ValueError: inner
During handling of the above exception, another exception occurred:
hpcrl.rewards.RewardValueError: reward source 'f' gave score = nan; expected a finite number, \
for train prompt 3
submitit INFO (2026-12-01) - Exiting after failure"""
    assert failure_reason(tail) == ("RewardValueError", "reward source 'f' gave score = nan; expected a "
                                                        "finite number, for train prompt 3")
    assert failure_reason("Killed\nslurmstepd: error: *** JOB 7 CANCELLED ***") is None
    # a rank's traceback as torch.distributed prints it (pins: a deterministic failure retried)
    tail = "[rank0]:     raise FloatingPointError(...)\n[rank0]: FloatingPointError: non-finite loss (nan)"
    assert failure_reason(tail) == ("FloatingPointError", "non-finite loss (nan)")
