"""Asynchronous generation with bounded staleness (algorithm.max_staleness = s): iteration k samples
with policy version max(0, k - s), in both modes, with the same outputs; the staged controller
queues each job behind its own inputs only; a run resumes from a version every pending stage can
run from; the resident generator overlaps the update and loads each version between generations."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from hpcrl import commit, config, executors, plan
from hpcrl.controller import Controller
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE
from tests.test_adoption import FakeSlurm

TRAIN = (GENERATE, SCORE, UPDATE)


class _Slurm(FakeSlurm):
    """tests/test_adoption's fake executor, recording what each job waits on."""

    lookahead = 3

    def __init__(self, saved, run):
        super().__init__(saved, run)
        self.after = {}

    def submit(self, stage, iteration, after=()):
        self.after[(iteration, stage)] = {(j.iteration, j.stage) for j in after}
        return super().submit(stage, iteration)


def test_the_staged_controller_queues_a_generation_beside_the_update_before_it(tmp_path, monkeypatch,
                                                                              tiny_task):
    """pins: a controller that chains every job behind the previous one (no overlap on Slurm), or
    lets a job start before one of its inputs."""
    from tests.synthetic_run import make_run

    run = make_run(tmp_path / "run", iterations=3, rows=16, eval_every=0, policy_from=tiny_task / "model")
    exp = config.with_overrides(config.load(run.config_path), {"tracking.enabled": False,
                                                               "algorithm.max_staleness": "1"}, "test")
    saved = tmp_path / "saved"
    saved.mkdir()
    for k, stage in reversed(plan.all_stages(exp)[3:]):
        shutil.move(run.stage_dir(k, stage), saved / f"{k}-{stage}")
    fake = _Slurm(saved, run)
    monkeypatch.setattr(executors, "make", lambda run, exp: fake)
    Controller(run, exp, echo=lambda line: None, show_progress=False).run_all()
    assert fake.after[(1, GENERATE)] == set()  # version 0: nothing to wait for
    assert fake.after[(1, UPDATE)] == {(1, GENERATE), (1, SCORE)}
    assert fake.after[(2, GENERATE)] == set()  # version 1 (update 0, committed): runs beside update 1
    assert fake.after[(2, UPDATE)] == {(2, GENERATE), (2, SCORE), (1, UPDATE)}
    assert fake.after[(3, GENERATE)] == {(2, UPDATE)}  # the final validation: the final policy
    assert not plan.pending_stages(run, exp)


# -- end to end: real vLLM and DeepSpeed on the tiny task ------------------------------------------

ASYNC = {"algorithm": {"group_size": 4, "prompts_per_iteration": 8, "max_staleness": 1},
         "run": {"iterations": 2, "eval_every": 0}}
RESIDENT = {"mode": "resident", "max_retries": 0,
            "resident": {"stall_s": 5, "checkpoint_every": 2, "weight_sync": "shared_memory"}}


def _submit(path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(path), *args],
                          capture_output=True, text=True, timeout=900)


def _experiment(root, tiny_task, name: str, **sections):
    """The experiment file of a run under `root`, and its run directory."""
    from tests.conftest import experiment_toml

    path = root / f"{name}.toml"
    path.write_text(experiment_toml(tiny_task, root / "runs", name, **sections))
    return path, RunDir.at(config.load(path).run_dir)


@pytest.fixture(scope="module")
def staged_async(tmp_path_factory, tiny_task) -> RunDir:
    """The staged run: two engines, each generation from two shards (hpcrl.shards), two score
    tasks, and a final validation of one prompt (so one shard draws no request, one score part is
    empty)."""
    path, run = _experiment(tmp_path_factory.mktemp("async"), tiny_task, "staged", generate={"engines": 2},
                            executor={"score": {"tasks": 2}}, data={"max_val_prompts": 1}, **ASYNC)
    out = _submit(path)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def resident_async(tmp_path_factory, tiny_task) -> RunDir:
    """The resident run of one engine (the one-engine reference the engines' runs are compared
    with), killed once generation 1 (version 0, made while update 0 ran) is committed, and resumed."""
    path, run = _experiment(tmp_path_factory.mktemp("async"), tiny_task, "killed", executor=RESIDENT, **ASYNC)
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _kill_when_committed(proc, run.stage_dir(1, GENERATE))
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "resume", str(run.root)], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _same_outputs(a: RunDir, b: RunDir, exp, iterations: int | None = None) -> None:
    """The same tables in every stage (of the first `iterations` iterations)."""
    for k, stage in plan.all_stages(exp):
        if iterations is not None and k >= iterations:
            continue
        for table in {GENERATE: ("rollouts",), SCORE: ("scores",), UPDATE: ("stats", "advantages")}[stage]:
            ta, tb = (pq.read_table(r.stage_dir(k, stage) / f"{table}.parquet") for r in (a, b))
            assert ta.equals(tb), (k, stage, table)


def _checks(run: RunDir, exp) -> None:
    """Each sample records the version it was made with; each generation names the update that
    made its policy as its input."""
    for k in range(exp.run.iterations + 1):
        version = plan.policy_version(exp, k)
        rollouts = pq.read_table(run.stage_dir(k, GENERATE) / "rollouts.parquet")
        assert set(rollouts["policy_version"].to_pylist()) == {version}, k
        inputs = commit.read_manifest(run.stage_dir(k, GENERATE))["inputs"]
        inputs = [i for i in inputs if not i.startswith("generate.shards/")]  # a merged generation's
        assert inputs == ([f"update@iter_{version - 1:06d}"] if version else []), k
    assert [plan.policy_version(exp, k) for k in range(3)] == [0, 0, 2]


def test_two_engines_and_two_score_tasks_commit_what_one_of_each_does(staged_async, resident_async):
    """pins (generate.engines, executor.score.tasks, hpcrl.shards): shards that draw other prompts
    or seeds than one engine, a merge out of one engine's order, score parts that overlap, a shard
    with no request that fails (the final validation of one prompt over two engines), or a stage
    committed before each of its shards."""
    run = staged_async
    exp = config.load(run.config_path)
    _like_one_engine(resident_async, run, exp)
    for k in range(exp.run.iterations + 1):
        rows = pq.read_metadata(run.stage_dir(k, GENERATE) / "rollouts.parquet").num_rows
        scored = [pq.read_metadata(run.shard_dir(k, SCORE, i, 2) / "scores.parquet").num_rows
                  for i in range(2)]
        assert sum(scored) == rows and (min(scored) > 0 or k == exp.run.iterations), (k, scored)


def _like_one_engine(ref: RunDir, run: RunDir, exp, n: int = 2) -> None:
    """`run`, made by several engines, committed what `ref` (one engine, max_val_prompts unset; the
    resident run, which commits what the staged mode does) did: every training table, the one
    validation prompt's rows, and each generation from `n` disjoint shards committed before it."""
    last = exp.run.iterations
    _same_outputs(ref, run, exp, iterations=last)  # the training iterations
    for stage, table in ((GENERATE, "rollouts"), (SCORE, "scores")):  # the one validation prompt's rows
        want = pq.read_table(ref.stage_dir(last, stage) / f"{table}.parquet")
        first = want.filter(pc.equal(want["prompt_index"], 0))
        mine = pq.read_table(run.stage_dir(last, stage) / f"{table}.parquet")
        assert first.num_rows == 1 and mine.equals(first)
    for k in range(last + 1):
        stage = run.stage_dir(k, GENERATE)
        manifest = commit.read_manifest(stage)
        parts = [run.shard_dir(k, GENERATE, i, n) for i in range(n)]
        shard_manifests = [commit.read_manifest(d) for d in parts]
        assert [m["shard"] for m in shard_manifests] == [[i, n] for i in range(n)]
        assert all(m["committed_at"] < manifest["committed_at"] for m in shard_manifests)
        tables = [pq.read_table(d / "rollouts.parquet") for d in parts]
        prompts = [set(t["prompt_index"].to_pylist()) for t in tables]
        assert prompts[0] and (all(prompts) or k == last), k
        assert sum(len(p) for p in prompts) == len(set().union(*prompts)), k  # disjoint
        rows = pq.read_metadata(stage / "rollouts.parquet").num_rows
        assert sum(t.num_rows for t in tables) == rows
        assert {f"generate.shards/{i}-of-{n}@iter_{k:06d}" for i in range(n)} <= set(manifest["inputs"])
        assert manifest["utilisation"]["devices"] == sum(m["utilisation"]["devices"] for m in shard_manifests)


def _kill_task(proc: subprocess.Popen, task: int) -> int:
    """SIGKILL the local resident job's task `task` (a child of `proc`); its pid."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("SUBMITIT_LOCAL_GLOBALID") == str(task):
                child.kill()
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no task {task} among the children of {proc.pid}")


def test_two_resident_engines_commit_what_one_does_even_when_one_is_killed(resident_async, write_experiment):
    """pins (generate.engines and generate.shards in the resident mode, hpcrl.resident_engines): an
    engine that samples other prompts or with another version than engine 0, misses an update's
    weights (its probe is checked), two engines claiming one shard, a shard nobody claims, a merge
    before every shard is committed, or a retry that samples a committed shard again. Two engines
    share four shards each generation; engine 1 is killed once it has committed its own shard
    (1 of 4) of iteration 0: the job stops (no later generation can commit without it), the
    controller resubmits it, and the run ends as one engine's, its updates' weights loaded by both
    engines of the second job."""
    path = write_experiment("resident-engines", generate={"engines": 2, "shards": 4},
                            data={"max_val_prompts": 1}, executor={**RESIDENT, "max_retries": 1}, **ASYNC)
    exp = config.load(path)
    run = RunDir.at(exp.run_dir)
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "submit", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    shard = run.shard_dir(0, GENERATE, 1, 4)
    deadline = time.monotonic() + 600
    while not commit.is_committed(shard):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    first_commit = commit.read_manifest(shard)["committed_at"]
    _kill_task(proc, exp.update.world_size + 1)  # engine 1: the task after the trainer and engine 0
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    assert "generator 1 (task 2) stopped responding" in stdout + stderr + _logs(run)
    assert [j["role"] for j in run.jobs()].count("resident") == 2  # resubmitted once
    assert commit.read_manifest(shard)["committed_at"] == first_commit  # kept, not sampled again
    _checks(run, exp)
    _like_one_engine(resident_async, run, exp, n=4)
    synced = commit.read_manifest(run.stage_dir(2, GENERATE))["metrics"]
    assert synced["sync/logp_diff"] < 1e-4 < synced["sync/update_shift"]
    # shared memory: trainer 0 presends, the engine loads what it finds (its wait, its load, then the probe)
    assert synced["sync/wait_s"] >= 0 and 0 < synced["sync/load_s"] <= synced["sync/seconds"], synced
    assert 0 < synced["sync/probe_s"], synced


def _logs(run: RunDir) -> str:
    return "".join(p.read_text(errors="replace") for p in run.logs.rglob("*") if p.is_file())


def _kill_when_committed(proc: subprocess.Popen, stage_dir, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not commit.is_committed(stage_dir):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _staged_again(run: RunDir, iteration: int, stage: str, out) -> RunDir:
    """`stage` of `run`'s iteration run again as a stage job (hpcrl replay) from `run`'s inputs."""
    from hpcrl import replay

    again, exp = replay.prepare(run, config.load(run.config_path), iteration, stage, {}, out)
    replay.run_stage(again, exp, iteration, stage)
    return again


def test_a_resident_async_run_killed_and_resumed_commits_what_the_staged_does(staged_async, resident_async,
                                                                              tmp_path):
    """The resident job is killed once generation 1 (version 0, made while update 0 ran) is
    committed, and resumed (the `resident_async` run). pins: a resident generator that loads a
    version before the generation that needs it (or after) or mixes versions in one generation; a
    resume that samples a pending generation with the trainers' (newer) version, or that discards
    the generation made while the killed update ran. The staged run validates one prompt: the
    resident run's whole validation (eight prompts) is also made again by stage jobs from its
    inputs, the policy its updates made."""
    run = resident_async
    exp = config.load(run.config_path)
    last = exp.run.iterations
    _checks(staged_async, config.load(staged_async.config_path))
    _checks(run, exp)
    _same_outputs(staged_async, run, exp, iterations=last)  # every training table
    for stage, table in ((GENERATE, "rollouts"), (SCORE, "scores")):
        mine = pq.read_table(run.stage_dir(last, stage) / f"{table}.parquet")
        staged = pq.read_table(staged_async.stage_dir(last, stage) / f"{table}.parquet")
        assert staged.num_rows == 1 and mine.filter(pc.equal(mine["prompt_index"], 0)).equals(staged), stage
        again = _staged_again(run, last, stage, tmp_path / stage).stage_dir(last, stage)
        assert mine.num_rows == 8 and mine.equals(pq.read_table(again / f"{table}.parquet")), stage
    synced = commit.read_manifest(run.stage_dir(2, GENERATE))["metrics"]
    assert synced["sync/logp_diff"] < 1e-4 < synced["sync/update_shift"]
    # shared memory: trainer 0 presends, the engine loads what it finds (its wait, its load, then the probe)
    assert synced["sync/wait_s"] >= 0 and 0 < synced["sync/load_s"] <= synced["sync/seconds"], synced
    assert 0 < synced["sync/probe_s"], synced
