"""`hpcrl replay` on a real 2-iteration run: score and update replay byte-identically, an override
changes the reward, generate reports token agreement, a replay on one core is judged across
environments, corruption is named, the run is untouched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcrl import commit
from hpcrl.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def hpcrl(*args, **kw):
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def run(staged_ref) -> RunDir:
    return staged_ref


def _manifests(run: RunDir) -> dict:
    return {p: p.read_bytes() for p in sorted(run.root.rglob("_COMMIT.json"))}


@pytest.mark.parametrize("stage", ["score", "update"])
def test_replay_of_a_middle_iteration_is_byte_identical(run, stage, tmp_path):
    before = _manifests(run)
    out = hpcrl("replay", str(run.root), "--iteration", "1", "--stage", stage, "--out", str(tmp_path / stage))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "files: byte-identical" in out.stdout and "verdict: MATCH: byte-identical" in out.stdout
    assert commit.is_committed(tmp_path / stage / "iter_000001" / stage)
    assert _manifests(run) == before  # the run is only read


def test_an_update_replayed_on_one_core_names_the_change_and_matches(run, tmp_path):
    """On one of the run's cores the replay's trainer takes one thread (not os.cpu_count's), the
    report names how the environment changed, and the update still matches: byte for byte, or
    within the tolerances across environments."""
    original = commit.read_manifest(run.stage_dir(1, "update"))
    assert original["utilisation"]["devices"] >= 2, "the run needs 2 cores for this test"
    one = min(os.sched_getaffinity(0))
    out = hpcrl("replay", str(run.root), "--iteration", "1", "--stage", "update", "--out",
                str(tmp_path / "u"), preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.returncode == 0, out.stdout + out.stderr
    replayed = commit.read_manifest(tmp_path / "u" / "iter_000001" / "update")
    assert replayed["utilisation"]["devices"] == 1 and replayed["device"]["threads"] == 1
    cores, threads = original["utilisation"]["devices"], original["device"]["threads"]
    assert f"environment: devices {cores} -> 1, threads {threads} -> 1" in out.stdout
    assert "verdict: MATCH" in out.stdout


def test_a_generation_replayed_on_one_core_is_judged_by_teacher_forcing(run, tmp_path):
    """On another environment the original samples are teacher-forced through the policy on the
    replay's core (hpcrl.replay_forced) and must have the sampler's logprobs; tokens may differ."""
    one = min(os.sched_getaffinity(0))
    out = hpcrl("replay", str(run.root), "--iteration", "1", "--stage", "generate", "--out",
                str(tmp_path / "g"), preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "environment: devices 2 -> 1" in out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("judged across environments"))
    mean = float(line.split("mean difference ")[1].split()[0])
    assert 0 < mean < 1e-4, line  # float32: the demo measures about 5e-7 (docs/debugging.md)
    assert "verdict: MATCH" in out.stdout


def test_replay_with_another_reward_function_reports_the_changed_reward(run, tmp_path):
    out = hpcrl("replay", str(run.root), "--iteration", "1", "--stage", "score", "--out", str(tmp_path / "o"),
                "--set", 'reward.functions=["hpcrl.rewards:gsm8k"]')
    assert out.returncode == 1, out.stdout + out.stderr  # a different result is not a match
    line = next(x for x in out.stdout.splitlines() if x.startswith("critic/score/mean"))
    original, replayed = float(line.split()[1]), float(line.split()[2])
    assert original > 0 and replayed == 0.0  # no '#### <answer>' line in addition answers
    assert "verdict: DIFFERENT" in out.stdout and "overrides: reward.functions=" in out.stdout


def test_replay_of_generate_reports_token_agreement_and_logprobs(run, tmp_path):
    out = hpcrl("replay", str(run.root), "--iteration", "0", "--stage", "generate", "--out",
                str(tmp_path / "g"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "token agreement: 40/40 samples identical (100.0%)" in out.stdout  # 8 prompts x 4 + 8 validation
    assert "logprob difference on identical samples: max" in out.stdout


def test_corrupted_input_is_named_not_a_traceback(run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run.root, copy, symlinks=True)
    target = copy / "iter_000001" / "generate" / "rollouts.parquet"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    out = hpcrl("replay", str(copy), "--iteration", "1", "--stage", "score", "--out", str(tmp_path / "x"))
    assert (out.returncode == 1 and f"{target}: checksum mismatch" in out.stderr
            and "Traceback" not in out.stderr)
    status = hpcrl("status", str(copy), "--verify")
    assert status.returncode == 1 and f"CORRUPT: {target}: checksum mismatch" in status.stderr
