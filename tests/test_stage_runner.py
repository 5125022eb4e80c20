"""The stage runner (hpcrl.stage) around a stage's work, with stand-in stages: what a manifest records
about the attempt, the already-committed and sharded paths, the inputs a stage reads, the job entry
point's arguments, and the rank-0-only decisions of a multi-rank stage. No vLLM, DeepSpeed or Slurm:
every stage here writes a small scores table."""

from __future__ import annotations

import argparse
import socket
import sys
import time
import types

import pyarrow as pa
import pytest

from hpcrl import commit, config, stage, stage_kinds
from hpcrl.rundir import RunDir
from tests.synthetic_run import write_config

SLURM_ENV = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SUBMITIT_LOCAL_JOB_ID",
             "SUBMITIT_EXECUTOR", "SLURMD_NODENAME")


def _scores(n: int = 3) -> pa.Table:
    return pa.table({"split": ["train"] * n, "prompt_index": list(range(n)), "sample_index": [0] * n,
                     "reward": [1.0] * n,
                     "reward_components": pa.array([[("a", 1.0)]] * n, pa.map_(pa.string(), pa.float64())),
                     "reward_message": [""] * n})


class _Clock:
    """A perf_counter that moves only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(stage, "time", types.SimpleNamespace(perf_counter=c.perf_counter, time=time.time))
    return c


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A run directory of two iterations, outside any Slurm job."""
    for name in SLURM_ENV:
        monkeypatch.delenv(name, raising=False)
    r = tmp_path / "r"
    write_config(r, 2)
    return r


def _reconfigure(root, overrides: dict) -> None:
    run = RunDir.at(root)
    exp = config.with_overrides(config.load(run.config_path), overrides, "test")
    run.config_path.write_text(config.dumps(exp))


def _commit(d, rows: int = 3, inputs: dict | None = None):
    w = commit.StageWriter(commit.fresh_temp_dir(d))
    w.write_table("scores", _scores(rows))
    return commit.commit(d, w, {"stage": d.name, "inputs": inputs or {}})


def test_derive_seed_is_a_fixed_31_bit_function_of_the_run_seed_iteration_and_stage():
    """Pins: the seed derivation changed (a resumed or replayed run would sample other numbers
    than the run it continues): the hashed text, the digest size, the byte order, the 31-bit mask."""
    assert stage.derive_seed(0, 0, "generate") == 898704925
    assert stage.derive_seed(0, 1, "score") == 39578571
    assert stage.derive_seed(7, 3, "update") == 236082375
    seeds = {stage.derive_seed(s, k, n) for s in range(3) for k in range(20) for n in ("generate", "score")}
    assert len(seeds) == 120 and all(0 <= x < 2 ** 31 for x in seeds)


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"SUBMITIT_LOCAL_JOB_ID": "77"}, "77"),
    ({"SLURM_JOB_ID": "12"}, "12"),
    ({"SLURM_JOB_ID": "12", "SUBMITIT_LOCAL_JOB_ID": "77"}, "12"),
    ({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10"}, "12"),
    ({"SLURM_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}, "12"),
    ({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "3"}, "10_3"),
])
def test_job_id_names_the_job_as_sacct_does(monkeypatch, env, expected):
    """Pins: a task of a job array recorded under its own job id (sacct names it <array>_<task>), an
    array id taken without its task id, and the local executor's id lost or preferred to Slurm's."""
    for name in SLURM_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert stage.job_id() == expected


def test_process_age_is_the_seconds_since_the_process_started(monkeypatch):
    """Pins: the age computed as a sum of times (start-up timings of billions of seconds), or apart
    from the start that utilisation's clocks count from."""
    assert 0.0 < stage.process_age() < 7 * 86400
    monkeypatch.setattr(stage.utilisation, "process_start", lambda: time.time() - 12.5)
    assert stage.process_age() == pytest.approx(12.5, abs=0.1)


def test_the_device_is_the_cpu_model_and_threads_or_the_gpu_that_cuda_started_on(monkeypatch):
    """Pins `stage.device`: torch's thread count and the CPU's model (the first 'model name' of
    /proc/cpuinfo); the GPU's name once CUDA is initialised (a stand-in torch here), no name for
    GPUs held but not opened; no threads in a process without torch."""
    import torch

    with open("/proc/cpuinfo") as f:
        first = next(line for line in f if line.startswith("model name")).split(":", 1)[1].strip()
    assert stage.cpu_model() == first
    assert stage.device() == {"name": first, "threads": torch.get_num_threads()}
    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 1,
                                 get_device_name=lambda i: f"NVIDIA H200 #{i}", device_count=lambda: 0)
    with monkeypatch.context() as m:  # undone before the teardown, where pytest-randomly seeds torch
        m.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda, get_num_threads=lambda: 3))
        assert stage.device() == {"name": "NVIDIA H200 #1", "threads": 3}
        cuda.is_initialized = lambda: False
        assert stage.device() == {"name": first, "threads": 3}
        cuda.device_count = lambda: 2  # GPUs it holds but did not open (vLLM's workers did)
        assert stage.device() == {"name": None, "threads": 3}
        m.setitem(sys.modules, "torch", None)  # a process that never imported torch
        assert stage.device() == {"name": first, "threads": None}


def test_a_stage_manifest_records_the_attempt(root, clock, monkeypatch, capsys):
    """Pins: a manifest key renamed or dropped (stage, iteration, seed, notes, packages, host, node,
    world_size, job_id, the startup timing), the node taken from the host when Slurm names it, a
    shard key on a whole stage, a local stage's queue wait not 0, an interrupted update's progress
    left behind, HF_HUB_OFFLINE not set for the stage, and the commit line's wording and metrics."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    run = RunDir.at(root)
    partial = commit.partial_dir(run.stage_dir(1, "score"))
    partial.mkdir(parents=True)
    (partial / "progress.pt").write_bytes(b"half")
    seen = []

    def body(ctx):
        seen.append((ctx.rank, ctx.world_size, ctx.shard, ctx.seed))
        ctx.writer.write_table("scores", _scores())
        ctx.writer.metrics.update({k: float(i) for i, k in enumerate("gfedcba", 1)})
        ctx.notes["attn"] = "sdpa"
        ctx.policy_version = 1
        clock.now += 0.5

    manifest = stage.run_stage("score", root, 1, body, startup=0.0)
    seed = stage.derive_seed(0, 1, "score")
    assert seen == [(0, 1, None, seed)]
    assert manifest == commit.read_manifest(run.stage_dir(1, "score"))
    assert (manifest["stage"], manifest["iteration"], manifest["seed"]) == ("score", 1, seed)
    assert manifest["notes"] == {"attn": "sdpa"} and manifest["policy_version"] == 1
    assert manifest["packages"]["pyarrow"] == pa.__version__
    assert (manifest["host"], manifest["node"]) == (socket.gethostname(), "node7")
    assert (manifest["world_size"], manifest["job_id"]) == (1, "42")
    assert manifest["device"] == stage.device()  # what computed it (hpcrl.replay.environment)
    assert "shard" not in manifest
    assert manifest["timings"] == {"startup": 0.0, "total": 0.5}
    use = manifest["utilisation"]
    assert (use["role"], use["queue_s"]) == ("scorer", 0.0)
    assert not partial.exists()
    assert stage.os.environ["HF_HUB_OFFLINE"] == "1"
    assert capsys.readouterr().out == "[score] iteration 1 committed in 0.5s: a 7, b 6, c 5, d 4, e 3, f 2\n"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert stage.run_stage("generate", root, 1, body, startup=0.0)["node"] == socket.gethostname()


def test_the_default_startup_is_the_process_age(root, clock):
    """Pins: run_stage that drops its `startup` (a resident worker's 0 replaced by the process's
    age), and an attempt without one that records none."""
    before = stage.process_age()
    attempt = stage.OpenStage("score", root, 0)
    assert attempt.manifest is None and attempt.ctx is not None
    assert attempt.ctx.timings["startup"] >= before > 0.0
    attempt.run(lambda ctx: ctx.writer.write_table("scores", _scores()))
    assert attempt.commit()["timings"]["total"] == attempt.ctx.timings["startup"]


@pytest.mark.parametrize(("overrides", "stage_name", "role", "queue"), [
    ({"executor.kind": "slurm"}, "score", "scorer", None),  # Slurm's queue wait comes from sacct
    ({"executor.mode": "resident"}, "score", "generator", 0.0),  # the generator task scores
])
def test_the_utilisation_entry_follows_the_executor(root, clock, overrides, stage_name, role, queue):
    """Pins: utilisation recorded for another stage or executor mode (the role whose devices ran
    it), and a Slurm stage's queue wait recorded as 0 instead of left to sacct (or a local one's
    as unknown)."""
    _reconfigure(root, overrides)
    manifest = stage.run_stage(stage_name, root, 0, lambda ctx: ctx.writer.write_table("scores", _scores()),
                               startup=0.0)
    assert (manifest["utilisation"]["role"], manifest["utilisation"]["queue_s"]) == (role, queue)


def test_a_committed_stage_or_shard_is_left_as_it_is_and_says_so(root, clock, capsys):
    """Pins: the "already committed" line without the stage, the iteration or the shard (i of n),
    and a shard committed to the whole stage's place or without its shard in the manifest."""
    run = RunDir.at(root)
    shard = stage.run_stage("generate", root, 0, lambda ctx: ctx.writer.write_table("scores", _scores()),
                            startup=0.0, shard=(1, 2))
    assert shard == commit.read_manifest(run.shard_dir(0, "generate", 1, 2))
    assert shard["shard"] == [1, 2] and not commit.is_committed(run.stage_dir(0, "generate"))
    assert capsys.readouterr().out.startswith("[generate] iteration 0 shard 1 committed in ")
    assert stage.run_stage("generate", root, 0, lambda ctx: 1 / 0, shard=(1, 2)) == shard
    assert capsys.readouterr().out == ("[generate] iteration 0 shard 1 of 2 is already committed: "
                                       "nothing to do\n")
    whole = stage.run_stage("generate", root, 0, lambda ctx: ctx.writer.write_table("scores", _scores()),
                            startup=0.0)
    capsys.readouterr()
    assert stage.run_stage("generate", root, 0, lambda ctx: 1 / 0) == whole
    assert capsys.readouterr().out == "[generate] iteration 0 is already committed: nothing to do\n"


def test_a_stage_merged_from_shards_records_them_and_the_slowest_ones_time(root, clock):
    """Pins: a merge's inputs without the digests of its shards' manifests, and merged timings that
    drop the merge's own time or invent time for a phase the slowest shard did not have."""
    run = RunDir.at(root)
    for i, seconds in ((0, 4.0), (1, 1.0)):
        def body(ctx, seconds=seconds):
            ctx.writer.write_table("scores", _scores(2))
            clock.now += seconds

        stage.run_stage("score", root, 0, body, startup=0.5, shard=(i, 2))

    def merge(ctx):
        with ctx.timed("io"):
            tables = ctx.shard_tables("scores", 2)
            clock.now += 0.25
        ctx.writer.write_table("scores", pa.concat_tables(tables))

    manifest = stage.run_stage("score", root, 0, merge, startup=0.0)
    dirs = [run.shard_dir(0, "score", i, 2) for i in range(2)]
    assert manifest["inputs"] == {f"score.shards/{i}-of-2@iter_000000": commit.manifest_digest(d)
                                  for i, d in enumerate(dirs)}
    assert manifest["timings"] == {"startup": 0.5, "total": 4.75, "io": 0.25}
    assert manifest["tables"]["scores"]["rows"] == 4


def test_input_dir_records_a_committed_input_of_any_iteration_and_refuses_a_bad_one(root, clock):
    """Pins: input_dir reading the stage's own iteration when asked for another, an uncommitted
    input accepted or named vaguely, an input whose own (replayed) input is absent refused, and one
    whose inputs changed accepted or reported with only one of its problems."""
    run = RunDir.at(root)
    prev = run.stage_dir(0, "update")
    _commit(prev, inputs={"generate@iter_000000": "sha256:0"})  # absent from this tree: a replay's input
    gen = run.stage_dir(1, "generate")
    score = run.stage_dir(1, "score")
    attempt = stage.OpenStage("update", root, 1, startup=0.0)
    ctx = attempt.ctx
    try:
        assert ctx.input_dir("update", 0) == prev
        assert ctx.inputs == {"update@iter_000000": commit.manifest_digest(prev)}
        with pytest.raises(commit.CorruptOutputError) as err:
            ctx.input_dir("generate")
        assert str(err.value) == f"{gen}: input of update is not committed"
        _commit(gen)
        _commit(score, inputs={"generate@iter_000001": "sha256:0", "update@iter_000000": "sha256:1"})
        with pytest.raises(commit.CorruptOutputError) as err:
            ctx.input_dir("score")
        assert str(err.value) == (f"input of update: {score}: computed from another {gen} than the one "
                                  f"committed there now; {score}: computed from another {prev} than the one "
                                  "committed there now")
        assert ctx.input_dir("generate") == gen
        assert list(ctx.inputs) == ["update@iter_000000", "generate@iter_000001"]
    finally:
        attempt.close()


class FakeStage(stage.Stage):
    """A stage kind's work that writes a scores table; records how the runner built and ran it."""

    name = "score"
    calls: list = []

    def startup(self) -> None:
        self.calls.append(("startup",))

    def setup(self, version: int, seed: int) -> None:
        self.calls.append(("setup", version, seed))

    def run(self, ctx) -> None:
        self.calls.append(("run", ctx.iteration, self.exp is ctx.exp, self.rundir is ctx.run, self.rank,
                           self.world_size, self.resident))
        ctx.writer.write_table("scores", _scores(2))


def fake_merge(ctx, n: int) -> None:
    FakeStage.calls.append(("merge", n))
    ctx.writer.write_table("scores", pa.concat_tables(ctx.shard_tables("scores", n)))


def _fake_kind(name: str = "score", **fields) -> stage_kinds.Kind:
    return stage_kinds.Kind(name, f"{__name__}:FakeStage", **fields)


@pytest.fixture
def calls(monkeypatch) -> list:
    monkeypatch.setattr(FakeStage, "calls", [])
    return FakeStage.calls


def test_a_stage_job_builds_the_kinds_stage_for_its_rank_and_times_startup_and_load(root, calls, monkeypatch):
    """Pins: the job body building the stage object with another experiment, run directory, rank or
    world size (or none at all), and Stage.job that skips or mis-times the start-up and the setup
    (for the policy version of its iteration, with the stage's seed) or runs another context."""
    clock = types.SimpleNamespace(now=100.0, time=time.time)
    clock.perf_counter = lambda: clock.now
    monkeypatch.setattr(stage, "time", clock)

    def setup(self, version, seed):
        calls.append(("setup", version, seed))
        clock.now += 2.0

    def startup(self):
        calls.append(("startup",))
        clock.now += 1.0

    monkeypatch.setattr(FakeStage, "setup", setup)
    monkeypatch.setattr(FakeStage, "startup", startup)
    attempt = stage.OpenStage("score", root, 1, rank=0, world_size=1, startup=0.0)
    try:
        stage._job_body(_fake_kind(), 1, 2)(attempt.ctx)
        assert calls == [("startup",), ("setup", 1, stage.derive_seed(0, 1, "score")),
                         ("run", 1, True, True, 1, 2, False)]
        assert attempt.ctx.timings == {"startup": 1.0, "load": 2.0}
        calls.clear()
        stage._job_body(_fake_kind())(attempt.ctx)
        assert calls[-1] == ("run", 1, True, True, 0, 1, False)
    finally:
        attempt.close()


def test_a_sharded_job_commits_its_shard_and_the_last_one_merges(root, calls, monkeypatch, clock):
    """Pins: a shard job that runs no stage (or another kind's), a merge that waits for a shard
    already committed or starts before every shard is, a merge whose start-up counts this process's
    age on top of the slowest shard's, and a kind without shards accepted or refused without
    naming it."""
    monkeypatch.setitem(stage_kinds.KINDS, "score", _fake_kind(merge=f"{__name__}:fake_merge"))
    run = RunDir.at(root)
    stage._shard_job(stage_kinds.kind("score"), str(root), 0, (1, 2))
    assert commit.is_committed(run.shard_dir(0, "score", 1, 2)) and calls[-1][0] == "run"
    assert not commit.is_committed(run.stage_dir(0, "score"))
    stage._shard_job(stage_kinds.kind("score"), str(root), 0, (0, 2))
    assert calls[-1] == ("merge", 2)
    merged = commit.read_manifest(run.stage_dir(0, "score"))
    assert merged["tables"]["scores"]["rows"] == 4
    shards = [commit.read_manifest(run.shard_dir(0, "score", i, 2)) for i in range(2)]
    slowest = max((m["timings"] for m in shards), key=lambda t: t["total"])
    assert merged["timings"]["startup"] == slowest["startup"]  # the merge's own start-up is 0
    with pytest.raises(SystemExit, match="^the update stage does not run in shards$"):
        stage._shard_job(_fake_kind("update"), str(root), 0, (0, 2))


def test_shard_arguments_are_i_of_n(capsys):
    """Pins: --shard parsing that accepts a shard outside 0 <= I < N, or refuses without saying
    what it expects and what it got."""
    assert stage._shard("0/1") == (0, 1) and stage._shard("2/3") == (2, 3)
    for text in ("3/3", "-1/2", "a/2", "2", "1/0"):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            stage._shard(text)
        assert str(err.value) == f"expected I/N with 0 <= I < N, got {text!r}"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_job_main_runs_the_named_stage_of_the_iteration_given(root, calls, monkeypatch, capsys):
    """Pins (`python -m stages.<name>`): the job's arguments (required run directory and iteration,
    an integer iteration, --shard I/N) and their help, a whole stage run as a shard or not at all,
    a sharded job that never merges, and a trainer stage run without the distributed set-up (or
    without shutting it down)."""
    from hpcrl import distributed

    monkeypatch.setitem(stage_kinds.KINDS, "score", _fake_kind(merge=f"{__name__}:fake_merge"))
    with pytest.raises(SystemExit):
        stage.job_main("score", ["--help"])
    help_text = _flat(capsys.readouterr().out)
    assert help_text.startswith("usage: python -m stages.score [-h] --run-dir RUN_DIR --iteration ITERATION "
                                "[--shard SHARD] Run the score stage of one iteration and commit it.")
    for line in ("--run-dir RUN_DIR run directory (holds the frozen experiment.toml)",
                 "--iteration ITERATION iteration number, from 0",
                 "--shard SHARD I/N: commit shard I of N (from 0; hpcrl.shards), and the stage once every "
                 "shard is committed"):
        assert line in help_text
    for argv, error in ((["--iteration", "0"], "the following arguments are required: --run-dir"),
                        (["--run-dir", str(root)], "the following arguments are required: --iteration"),
                        (["--run-dir", str(root), "--iteration", "x"], "invalid int value: 'x'"),
                        (["--run-dir", str(root), "--iteration", "0", "--shard", "2/2"],
                         "expected I/N with 0 <= I < N, got '2/2'")):
        with pytest.raises(SystemExit):
            stage.job_main("score", argv)
        assert error in capsys.readouterr().err
    run = RunDir.at(root)
    stage.job_main("score", ["--run-dir", str(root), "--iteration", "1"])
    assert commit.read_manifest(run.stage_dir(1, "score"))["tables"]["scores"]["rows"] == 2
    assert [c[0] for c in calls] == ["startup", "setup", "run"]
    calls.clear()
    stage.job_main("score", ["--run-dir", str(root), "--iteration", "0", "--shard", "0/1"])
    assert [c[0] for c in calls] == ["startup", "setup", "run", "merge"]
    assert commit.is_committed(run.shard_dir(0, "score", 0, 1))
    assert commit.is_committed(run.stage_dir(0, "score"))

    monkeypatch.setitem(stage_kinds.KINDS, "update", _fake_kind("update", on_trainers=True))
    ranks = []
    monkeypatch.setattr(distributed, "init", lambda: (ranks.append("init"), (0, 1))[1])
    monkeypatch.setattr(distributed, "shutdown", lambda: ranks.append("shutdown"))
    calls.clear()
    stage.job_main("update", ["--run-dir", str(root), "--iteration", "0"])
    assert ranks == ["init", "shutdown"] and calls[-1] == ("run", 0, True, True, 0, 1, False)
    assert commit.read_manifest(run.stage_dir(0, "update"))["utilisation"]["role"] == "trainer"


def test_only_rank_0_decides_and_the_other_ranks_take_its_answers(root, monkeypatch):
    """Pins: a multi-rank stage whose ranks do not broadcast rank 0's decisions (committed or not,
    the temporary directory), a non-zero rank that empties the temporary directory rank 0 is
    writing in, and the context's rank or world size lost."""
    told = []
    answers = []

    def broadcast(value):
        told.append(value)
        return answers.pop(0) if answers else value

    monkeypatch.setattr(stage, "_dist_broadcast", broadcast)
    first = stage.OpenStage("update", root, 0, rank=0, world_size=2, startup=0.0)
    try:
        tmp = commit.temp_dir(first.out)
        assert told == [False, str(tmp)] and first.ctx.writer.dir == tmp
        assert (first.ctx.rank, first.ctx.world_size) == (0, 2)
        (tmp / "rank0.bin").write_bytes(b"written by rank 0")
        answers[:] = [False, str(tmp)]
        told.clear()
        other = stage.OpenStage("update", root, 0, rank=1, world_size=2, startup=0.0)
        assert other.ctx.writer.dir == tmp and (other.ctx.rank, other.ctx.world_size) == (1, 2)
        assert (tmp / "rank0.bin").read_bytes() == b"written by rank 0"
        other.close()
    finally:
        first.close()


def test_the_broadcast_hands_every_rank_rank_0s_value(tmp_path):
    """Pins: `_dist_broadcast` that broadcasts another list or from another rank, or returns
    another element than the one received (a gloo group of one process, on the CPU)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert stage._dist_broadcast({"committed": False, "tmp": "/r/.score.tmp"}) == {
            "committed": False, "tmp": "/r/.score.tmp"}
    finally:
        dist.destroy_process_group()


def test_a_stage_defaults_to_rank_0_of_one_outside_a_resident_task(root):
    """Pins: a stage kind's object built without a rank or world size (a resident task's
    generator, the score stage) believing it is one rank of several, or resident."""
    exp = config.load(RunDir.at(root).config_path)
    s = FakeStage(exp, RunDir.at(root))
    assert (s.exp, s.rank, s.world_size, s.resident) == (exp, 0, 1, False)
    assert s.version_for(3) == 3


def test_a_hand_submitted_slurm_job_takes_usr2_and_a_trainer_job_runs_every_rank(root, calls, monkeypatch):
    """Pins: job_main that does not install the requeue handler of the run it was given (a job
    submitted by hand then dies at its time limit instead of requeueing), and a trainer stage whose
    manifest or stage object lose the world size that torch.distributed reported."""
    import functools
    import signal

    from hpcrl import distributed, requeue, utilisation

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setitem(stage_kinds.KINDS, "update", _fake_kind("update", on_trainers=True))
    monkeypatch.setattr(distributed, "init", lambda: (0, 2))
    monkeypatch.setattr(distributed, "shutdown", lambda: None)
    monkeypatch.setattr(stage, "_dist_broadcast", lambda value: value)  # rank 0 of two: it decides
    monkeypatch.setattr(utilisation, "stage_ranks", lambda world: [utilisation.held()] * world)
    before = signal.getsignal(signal.SIGUSR2)
    try:
        stage.job_main("update", ["--run-dir", str(root), "--iteration", "0"])
        handler = signal.getsignal(signal.SIGUSR2)
        assert isinstance(handler, functools.partial) and handler.func is requeue.requeue
        assert handler.args == (config.load(RunDir.at(root).config_path).executor.max_requeues,)
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert calls[-1] == ("run", 0, True, True, 0, 2, False)
    manifest = commit.read_manifest(RunDir.at(root).stage_dir(0, "update"))
    assert (manifest["world_size"], manifest["job_id"]) == (2, "42")


def test_the_stage_lines_are_flushed_to_the_job_log_as_they_are_printed(root, clock, monkeypatch):
    """Pins: the "committed" and "already committed" lines printed without a flush: a job log is a
    file (block-buffered), and a job killed afterwards (time limit, preemption) would lose them."""
    import io

    class Log(io.StringIO):
        def __init__(self):
            super().__init__()
            self.flushed: list[str] = []

        def flush(self):
            self.flushed.append(self.getvalue())

    log = Log()
    monkeypatch.setattr(sys, "stdout", log)
    stage.run_stage("score", root, 0, lambda ctx: ctx.writer.write_table("scores", _scores()), startup=0.0)
    assert log.flushed and log.flushed[-1] == "[score] iteration 0 committed in 0.0s: \n"
    stage.run_stage("score", root, 0, lambda ctx: 1 / 0)
    assert log.flushed[-1].endswith("[score] iteration 0 is already committed: nothing to do\n")


def test_a_failing_trainer_job_leaves_the_group_without_waiting_for_the_other_ranks(root, monkeypatch):
    """Pins: a rank that raises and then waits at the shutdown barrier. The other ranks may never
    reach it (they wait in a collective for this one), so the job hangs and its traceback never
    prints; a rank that succeeds still waits for the others before leaving."""
    from hpcrl import distributed

    monkeypatch.setitem(stage_kinds.KINDS, "update", _fake_kind("update", on_trainers=True))
    monkeypatch.setattr(distributed, "init", lambda: (0, 2))
    shutdowns = []
    monkeypatch.setattr(distributed, "shutdown", lambda barrier=True: shutdowns.append(barrier))

    def fail(*args, **kwargs):
        raise RuntimeError("rank 0 lost its GPU")

    monkeypatch.setattr(stage, "run_stage", fail)
    with pytest.raises(RuntimeError, match="rank 0 lost its GPU"):
        stage.job_main("update", ["--run-dir", str(root), "--iteration", "0"])
    assert shutdowns == [False]
    monkeypatch.setattr(stage, "run_stage", lambda *args, **kwargs: None)
    stage.job_main("update", ["--run-dir", str(root), "--iteration", "0"])
    assert shutdowns == [False, True]
