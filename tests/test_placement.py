"""GPU placement (hpcrl.placement), on CPU: every task of a resident job gets its own GPUs, each
task narrows CUDA_VISIBLE_DEVICES to them before CUDA starts, and impossible layouts are refused
at submit. GPU-path defects of issue #17 pinned here: (1) the generator task took no GPUs of its
own, so vLLM started on cuda:0..TP-1, a trainer's; (3) the trainers' default group was NCCL only,
which refuses the CPU tensors the update all-reduces; (4) vLLM forked its workers after CUDA was
initialised."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed.distributed_c10d import Backend, BackendConfig

from hpcrl import config, distributed, placement
from hpcrl.roles import Layout


def test_trainers_and_generator_get_disjoint_gpus_on_each_node():
    slots = placement.resident_plan(Layout(3), tp=2, gpus_per_node=8, colocate=False)
    assert [(s.role, s.node, s.gpus) for s in slots] == [
        ("trainer 0", 0, (0,)), ("trainer 1", 0, (1,)), ("trainer 2", 0, (2,)), ("generator 0", 0, (3, 4))]
    two = placement.resident_plan(Layout(3, nodes=2), tp=2, gpus_per_node=3, colocate=False)
    assert [(s.node, s.gpus) for s in two] == [(0, (0,)), (0, (1,)), (1, (0,)), (1, (1, 2))]


def test_each_node_holds_its_share_of_trainers_and_engines():
    """pins (hpcrl.roles.Layout): 16 trainers and 4 engines of TP 4 on 4 nodes of 8 GPUs fit only
    when each node holds 4 trainers and one engine; trainers first, then engines, where the counts
    do not divide by the nodes; task 0 is trainer 0 (it hosts the job's store)."""
    big = Layout(16, engines=4, nodes=4)
    slots = placement.resident_plan(big, tp=4, gpus_per_node=8, colocate=False)
    assert [(s.role, s.gpus) for s in slots[:5]] == [
        ("trainer 0", (0,)), ("trainer 1", (1,)), ("trainer 2", (2,)), ("trainer 3", (3,)),
        ("generator 0", (4, 5, 6, 7))]
    assert [s.node for s in slots if s.role.startswith("generator")] == [0, 1, 2, 3]
    assert sorted(big.role(t) for t in range(20)) == sorted(
        [("trainer", r) for r in range(16)] + [("generator", e) for e in range(4)])
    assert big.task("generator", 2) == 14 and big.name(14) == "generator 2 (task 14)"
    assert [Layout(1, 2, nodes=3).role(t) for t in range(3)] == [
        ("trainer", 0), ("generator", 0), ("generator", 1)]
    assert [Layout(3, 1, nodes=2).role(t)[0] for t in range(4)] == ["trainer"] * 3 + ["generator"]
    with pytest.raises(ValueError, match="do not spread evenly over 2 node"):
        Layout(2, 1, nodes=2)
    colocated = placement.resident_plan(Layout(2, 2), tp=1, gpus_per_node=2, colocate=True)
    assert [s.gpus for s in colocated] == [(0,), (1,), (0,), (1,)]  # each engine on a trainer's GPU


def test_a_layout_that_does_not_fit_is_refused_naming_the_key():
    with pytest.raises(placement.PlacementError, match=r"executor\.resident\.gpus_per_node: node 0 of the "
                       r"resident job needs 1 GPU\(s\) for the trainers placed there and 1 for the "
                       r"generator 0, but has 1"):
        placement.resident_plan(Layout(1), tp=1, gpus_per_node=1, colocate=False)
    shared = placement.resident_plan(Layout(1), tp=1, gpus_per_node=1, colocate=True)
    assert [s.gpus for s in shared] == [(0,), (0,)]  # colocated: the generator on the trainer's GPU


def _resident(write_experiment, **resident):
    return config.load(write_experiment("gpus", update={"world_size": 3},
                                        generate={"tensor_parallel_size": 2},
                                        executor={"kind": "slurm", "mode": "resident",
                                                  "resident": {"gpus_per_node": 8, **resident}}))


@pytest.mark.parametrize("task, visible", [(0, "4"), (2, "6"), (3, "7,8")])
def test_each_task_binds_to_its_own_gpus(write_experiment, monkeypatch, task, visible):
    exp = _resident(write_experiment)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,8,9,10,11")  # what Slurm gave the node's tasks
    monkeypatch.setenv("LOCAL_RANK", str(task))
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    placement.bind(exp, task)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible and os.environ["LOCAL_RANK"] == "0"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_a_cpu_run_binds_nothing(write_experiment, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    exp = _resident(write_experiment, gpus_per_node=0)
    assert placement.bind(exp, 0) is None and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_local_resident_job_on_gpus_gives_each_task_its_own(write_experiment, monkeypatch):
    """The local executor on a GPU machine: one node; its trainers and engine bind as on Slurm
    (they all saw the same GPUs, so vLLM started on trainer 0's)."""
    exp = config.with_overrides(_resident(write_experiment), {"executor.kind": "local"}, "test")
    assert [s.gpus for s in placement.plan(exp)] == [(0,), (1,), (2,), (3, 4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5,6")
    placement.bind(exp, 3)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"


def test_local_jobs_see_the_gpus_their_role_asks_for(write_experiment, monkeypatch, tmp_path):
    """Found on an H200: a local run with executor.update.gpus_per_node = 1 updated on the CPU, as
    submitit's LocalExecutor hid every GPU (it was never told of any). Now each job is given its
    role's count, among the GPUs this process sees, by submitit itself."""
    import submitit

    from hpcrl import executors

    exp = config.with_overrides(config.load(write_experiment("local")),
                                {"executor.update.gpus_per_node": 2}, "test")
    assert executors.local_gpus(exp, "generate", "5,7") == {"gpus_per_node": 0}  # a CPU role: none
    assert executors.local_gpus(exp, "update", "5,7") == {"gpus_per_node": 2, "visible_gpus": [5, 7]}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert executors.local_gpus(exp, "update") == {"gpus_per_node": 2}  # the machine's first two
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    seen = {}
    for stage in ("update", "score"):
        ex = submitit.LocalExecutor(folder=tmp_path / stage)
        ex.update_parameters(timeout_min=1, **executors.local_gpus(exp, stage))
        seen[stage] = ex.submit(os.getenv, "CUDA_VISIBLE_DEVICES").result()  # in the job
    assert seen == {"update": "3,5", "score": ""}
    from hpcrl.rundir import RunDir

    asked = {}  # and hpcrl's local executor asks for them, per stage
    monkeypatch.setattr(executors, "submit_all", lambda ex, calls: asked.update(ex.parameters))
    executors.LocalExecutor(RunDir.at(tmp_path / "run"), exp).submit("update", 0)
    assert (asked["gpus_per_node"], asked["visible_gpus"]) == (2, [3, 5, 7])


def test_local_gpus_this_machine_lacks_are_refused_at_submit(write_experiment, monkeypatch):
    import torch

    from hpcrl import preflight

    exp = config.with_overrides(config.load(write_experiment("local")),
                                {"executor.update.gpus_per_node": 1}, "test")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert preflight._check_gpus(exp) == ["executor.update.gpus_per_node = 1: the local executor runs the "
                                          "job on this machine, which shows 0 GPU(s)"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert preflight._check_gpus(exp) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a1c")
    assert "names them otherwise" in preflight._check_gpus(exp)[0]
    assert preflight._check_gpus(config.with_overrides(exp, {"executor.update.gpus_per_node": 0}, "t")) == []


def test_the_trainers_group_maps_cpu_tensors_to_gloo_on_gpus():
    backends = BackendConfig(Backend(distributed.default_backend(cuda=True))).get_device_backend_map()
    assert backends == {"cpu": "gloo", "cuda": "nccl"}
    assert distributed.default_backend(cuda=False) == "gloo"


def test_the_7b_recipe_places_every_task_on_its_own_gpus():
    """What `hpcrl submit --dry-run` prints for it (the recipe's 7B model is not here to submit)."""
    recipe = Path(__file__).parents[1] / "configs" / "gsm8k-7b-4nodes.toml"
    exp = config.load(recipe)
    out = placement.describe(exp)
    rows = [line.split() for line in out.splitlines()[1:]]
    update = [(int(r[4]), r[5]) for r in rows if r[0] == "update"]
    assert len(update) == 32 and len(set(update)) == 32  # (node, GPU): every rank its own
    assert [r[-1] for r in rows if r[0] == "generate"] == ["0,1,2,3"]
    bad = config.with_overrides(exp, {"executor.update.gpus_per_node": 4}, "test")
    with pytest.raises(placement.PlacementError, match="8 update ranks per node"):
        placement.describe(bad)


def test_vllm_spawns_its_workers_on_gpus(write_experiment, monkeypatch, tmp_path):
    """Defect (4): the generator asks torch whether CUDA is there before vLLM starts its
    tensor-parallel workers, which then must not be forked from it."""
    from hpcrl import generation

    exp = config.load(write_experiment("spawn"))
    # configure_env sets vLLM's variables for the process: a copy keeps them from later tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})
    monkeypatch.setattr(generation, "on_gpu", lambda: True)
    generation.configure_env(exp.generate, tmp_path / "scratch")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_the_7b_resident_layout_renders_as_one_heterogeneous_job(write_experiment):
    """4 nodes x 8 trainers and a node with 4 GPUs for a TP-4 generator: two job components."""
    from hpcrl import sbatch
    from hpcrl.rundir import RunDir

    exp = config.load(write_experiment("7b", update={"world_size": 32, "mini_batches": 1},
                                       generate={"tensor_parallel_size": 4},
                                       executor={"kind": "slurm", "mode": "resident", "resident": {
                                           "nodes": 4, "gpus_per_node": 8, "partition": "train",
                                           "generator": {"gpus_per_node": 4, "partition": "infer"}}}))
    script = sbatch.render(RunDir.at(Path(exp.run.runs_root) / "7b"), exp, "resident")
    trainers, generator = script.split("#SBATCH hetjob\n")
    for line in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=train"):
        assert f"#SBATCH {line}\n" in trainers
    for line in ("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=infer"):
        assert f"#SBATCH {line}\n" in generator
    assert "srun --het-group=0,1 --kill-on-bad-exit=1" in generator
    assert "singleton" not in script  # its second component would wait for its first for ever
    slots = placement.plan(exp)
    assert len({(s.node, s.gpus) for s in slots[:32]}) == 32 and {s.node for s in slots[:32]} == {0, 1, 2, 3}
    assert (slots[32].role, slots[32].node, slots[32].gpus) == ("generator 0", 4, (0, 1, 2, 3))
    with pytest.raises(config.ConfigError, match=r"colocate.*a node of its own"):
        config.with_overrides(exp, {"executor.resident.colocate": True}, "test")


def test_a_process_uses_the_cores_it_may_run_on_not_the_nodes(monkeypatch):
    """Pins `distributed.usable_cores` (the trainers' thread count): a job holding 2 cores of a
    64-core node gets 2 threads, not 64 (os.cpu_count counts the node)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5})
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert distributed.usable_cores() == 2


@pytest.mark.parametrize("env, threads", [({}, 4), ({"SLURM_CPUS_PER_TASK": "8"}, 8),
                                          ({"SLURM_CPUS_PER_TASK": "32"}, 16),
                                          ({"SLURM_CPUS_PER_TASK": "8", "SUBMITIT_LOCAL_JOB_ID": "7"}, 4)])
def test_each_rank_takes_its_share_of_the_cores(monkeypatch, env, threads):
    """Pins `distributed.rank_threads` for 4 ranks on 16 usable cores: a quarter each; a Slurm task
    its cpus per task (at most the cores it sees); the local executor's ranks, which share its
    cores, a quarter whatever Slurm job runs it."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    for name in ("SLURM_CPUS_PER_TASK", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.rank_threads(4) == threads
