"""Colocation (executor.resident.colocate: vLLM on the trainers' GPUs): what each phase of an
iteration holds on a GPU (hpcrl.colocation) against hand-computed bytes, the layouts refused before
any job, and the trainer's state leaving the device and coming back unchanged (real DeepSpeed)."""

from __future__ import annotations

import pytest

from hpcrl import colocation, config, jit_ops, preflight
from hpcrl.colocation import GIB, Trainer, trainer_bytes
from hpcrl.config import ConfigError

P = 7_000_000_000  # a 7B model


def test_a_ranks_bytes_follow_zero_partitions_and_offload():
    """pins: ZeRO partitions applied to the wrong state (ZeRO-2's gradients, ZeRO-3's weights),
    ZeRO-1's 16-bit gradients counted in 16 bits (its bf16 optimizer accumulates them in float32),
    or the float32 master weights left out."""
    assert trainer_bytes(P, 2, 2, 8, "none") == Trainer(2 * P, 2 * P / 8, 12 * P / 8)
    assert trainer_bytes(P, 2, 1, 8, "none") == Trainer(2 * P, 4 * P, 12 * P / 8)
    assert trainer_bytes(P, 2, 3, 8, "none") == Trainer(2 * P / 8, 2 * P / 8, 12 * P / 8)
    assert trainer_bytes(P, 2, 3, 8, "all") == Trainer(0.0, 2 * P / 8, 0.0)
    assert trainer_bytes(P, 2, 2, 1, "optimizer") == Trainer(2 * P, 2 * P, 0.0)
    assert trainer_bytes(P, 4, 0, 1, "none") == Trainer(4 * P, 4 * P, 8 * P)  # float32: no master copy
    assert trainer_bytes(P, 4, 0, 2, "none") == Trainer(4 * P, 4 * P, 8 * P)  # ZeRO-0 partitions nothing


def test_each_phase_that_does_not_fit_is_named():
    """A 7B bf16 policy on one 80 GiB GPU (ZeRO-1 on one rank: 14 + 28 + 84 GB of state) does not fit
    in the update; with its optimizer state offloaded it does (ZeRO-2: 14 + 14 GB). pins: a phase checked
    against the wrong sum, or vLLM's share taken as what it leaves free."""
    gpu = 80 * GIB
    full = trainer_bytes(P, 2, 1, 1, "none")
    found = colocation.problems(full, 2 * P, 0.85, gpu, "an 80 GiB GPU")
    assert len(found) == 1 and found[0].startswith("training: ") and "117.3 GiB" in found[0]
    offloaded = trainer_bytes(P, 2, 2, 1, "optimizer")
    assert colocation.problems(offloaded, 2 * P, 0.85, gpu, "x") == []
    phases = colocation.phases(offloaded, 2 * P, 0.85, gpu)
    assert phases == {"generation": 0.85 * gpu + GIB, "training": 28e9 + 2 * GIB, "sync": 28e9 + 2 * GIB}
    assert [p.split(":")[0] for p in colocation.problems(offloaded, 2 * P, 0.99, gpu, "x")] == ["generation"]
    small = 30 * GIB  # 14 GB of trainer weights and 14 of vLLM's + contexts: 28.1 GiB, fits; at 26 GiB not
    assert not [p for p in colocation.problems(offloaded, 2 * P, 0.5, small, "x") if p.startswith("sync")]
    assert [p for p in colocation.problems(offloaded, 2 * P, 0.5, 26 * GIB, "x") if p.startswith("sync")]
    # a critic's engine like the policy's and a reference model: 28 + 28 + 14 GB, 67.2 GiB with contexts
    others = offloaded.total + offloaded.weights
    assert colocation.problems(offloaded, 2 * P, 0.85, gpu, "x", extra=others) == []
    found = colocation.problems(offloaded, 2 * P, 0.85, 64 * GIB, "x", extra=others)
    assert len(found) == 1 and "and 39.1 GiB of critic and reference" in found[0]


def test_each_phase_is_named_with_its_bytes_and_a_phase_that_just_fits_passes():
    """The three messages whole, on a GPU of 10 GiB. pins: a message with a wrong unit or sum, or
    a phase that exactly fills the GPU refused."""
    trainer = Trainer(4 * GIB, 2 * GIB, 3 * GIB)
    found = colocation.problems(trainer, 5 * GIB, 0.95, 10 * GIB, "the GPU", extra=1 * GIB)
    assert found == [
        "generation: vLLM takes generate.gpu_memory_utilization = 0.95 of the GPU (9.5 GiB) and the released "
        "trainer keeps its context (~1 GiB); expected at most 0.90",
        "training: the trainer's weights, gradients and optimizer state take 9.0 GiB (4.0 + 2.0 + 3.0) and "
        "1.0 GiB of critic and reference of the GPU (10.0 GiB) before any activation; expected more ranks "
        "(ZeRO partitions), zero_stage = 3, or update.offload",
        "sync: the trainer's weights (4.0 GiB) and vLLM's (5.0 GiB) do not fit together in the GPU "
        "(10.0 GiB); expected zero_stage = 3 or a larger generate.tensor_parallel_size"]
    exact = Trainer(4 * GIB, 2 * GIB, 2 * GIB)  # 8 GiB + 2 contexts: exactly 10
    assert colocation.problems(exact, 4 * GIB, 0.9, 10 * GIB, "x") == []
    short = colocation.problems(exact, 4 * GIB, 0.9, 10 * GIB - 1, "x")
    assert short[1].startswith("training: the trainer's weights, gradients and optimizer state take 8.0 GiB "
                               "(4.0 + 2.0 + 2.0) of")


@pytest.mark.parametrize(("sections", "expected"), [
    ({"update": {"offload": "optimizer"}}, (Trainer(4 * P, 4 * P, 0.0), 4 * P, 0.0)),
    ({"model": {"dtype": "bfloat16"}, "update": {"world_size": 2, "zero_stage": 2},
      "generate": {"tensor_parallel_size": 2}}, (Trainer(2 * P, P, 6 * P), P, 0.0)),
    ({"model": {"dtype": "bfloat16"}, "update": {"offload": "optimizer"}, "algorithm": {"kl": {"coef": 0.1}}},
     (Trainer(2 * P, 2 * P, 0.0), 2 * P, 2 * P)),
    ({"model": {"dtype": "bfloat16"}, "update": {"offload": "optimizer"},
      "algorithm": {"name": "ppo", "critic": {}, "kl": {"coef": 0.1}}},
     (Trainer(2 * P, 2 * P, 0.0), 2 * P, 4 * P + 2 * P)),
    ({"model": {"dtype": "bfloat16"}, "update": {"offload": "optimizer", "lora": {"rank": 8}},
      "algorithm": {"kl": {"coef": 0.1}}}, (Trainer(2 * P, 0.0, 0.0), 2 * P, 0.0)),
], ids=["fp32-offload", "bf16-zero2-tp2", "reference", "ppo-critic", "lora"])
def test_an_experiments_layout_in_bytes(write_experiment, sections, expected):
    """hpcrl.colocation.layout_bytes for experiments, by hand (P parameters). pins: the width of
    the weights, the ZeRO stage DeepSpeed runs, the tensor-parallel share, the critic's engine,
    the reference model (not for LoRA, whose reference is the policy), LoRA's frozen state."""
    exp = config.load(write_experiment(executor=_resident(), **sections))
    assert colocation.layout_bytes(exp, P) == expected
    trainer, engine, extra = expected
    gpu = colocation.phases(trainer, engine, 0.5, 1e12, extra)["training"] - 1  # one byte short
    found = colocation.check(exp, P, gpu, "g")
    assert [line.split(":")[1].strip() for line in found if "training" in line] == ["training"]
    assert not [line for line in colocation.check(exp, P, gpu + 1, "g") if "training:" in line]


def test_the_job_checks_the_device_it_starts_on(write_experiment, monkeypatch):
    """At a colocated job's start: the device's memory stands for gpu_memory_gib (a stand-in
    device here). pins: a device that does not fit let through, or one that fits refused."""
    import types

    import torch

    from hpcrl import disk_budget

    exp = config.load(write_experiment(update={"offload": "optimizer"}, executor=_resident()))
    monkeypatch.setattr(disk_budget, "params_of", lambda path: P if path == exp.model.path else None)
    for gib, fits in ((80, True), (20, False)):
        devices = {3: types.SimpleNamespace(total_memory=gib * GIB)}  # GPU 3 only
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, devices=devices: devices[i])
        if fits:
            colocation.check_device(exp, 3)
        else:
            with pytest.raises(RuntimeError, match=r"the colocated job does not fit:\n  executor\.resident\."
                                                   r"colocate: training: .* of GPU 3 \(20\.0 GiB\).*\n  "
                                                   r"executor\.resident\.colocate: sync: "):
                colocation.check_device(exp, 3)
    monkeypatch.setattr(disk_budget, "params_of", lambda path: None)  # .bin weights: nothing to count
    colocation.check_device(exp, 3)


def _resident(**resident) -> dict:
    return {"mode": "resident", "resident": {"colocate": True, **resident}}


def test_a_colocated_layout_is_checked_against_the_gpu_memory_at_submit(write_experiment):
    """pins: executor.resident.gpu_memory_gib read but not checked, or checked when not colocated."""
    update = {"offload": "optimizer"}
    path = write_experiment(update=update, executor=_resident(gpu_memory_gib=2))
    with pytest.raises(ConfigError, match=r"executor\.resident\.colocate: generation: vLLM takes "
                                          r"generate\.gpu_memory_utilization = 0\.85 of a GPU of "
                                          r"executor\.resident\.gpu_memory_gib = 2"):
        preflight.check(config.load(path), str(path))
    path = write_experiment(update=update, executor=_resident(gpu_memory_gib=80))
    preflight.check(config.load(path), str(path))


def _release_round_trip(rank: int, path: str, port: int, out: str) -> None:
    """Three bf16 ZeRO-2 steps of the tiny policy on two ranks, twice: plain, and with the state
    released (weights kept, then everything) and restored before each step; rank 0 writes the
    weights of both and what each release moved into `out`."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl import trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    jit_ops.import_deepspeed().init_distributed(dist_backend="gloo", verbose=False)
    exp = config.load(path)
    ids = torch.tensor([[1, 5, 7, 9, 11, 4], [2, 6, 8, 10, 3, 4]])[rank:rank + 1]
    weights, released = [], []
    for release in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(exp.model.path, dtype=torch.bfloat16)
        engine = trainer.make_engine(model, 1e-2, exp, 2, 1, None)
        for _ in range(3):
            if release:
                trainer.release(engine, keep_weights=True)
                trainer.release(engine)
                released.append(sorted(s.value for s in engine.optimizer.offloaded_states))
                trainer.restore(engine)
                assert not engine.optimizer.offloaded_states
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        weights.append({k: v.float().clone() for k, v in engine.module.state_dict().items()})
    if rank == 0:
        torch.save({"weights": weights, "released": released}, out)


def test_released_trainer_state_comes_back_and_the_update_is_unchanged(write_experiment, tmp_path):
    """DeepSpeed's offload_states and reload_states around each step (ZeRO-2, bf16, two ranks)
    give the plain update bit for bit, and a release moves every state. pins: a release that
    leaves a state on the device (the weights, say), or a restore that loses one."""
    import torch
    import torch.multiprocessing as mp

    from hpcrl.distributed import free_port

    path = write_experiment(model={"dtype": "bfloat16"}, update={"world_size": 2, "zero_stage": 2},
                            executor=_resident())
    out = tmp_path / "round_trip.pt"
    mp.spawn(_release_round_trip, args=(str(path), free_port(), str(out)), nprocs=2)
    result = torch.load(out)
    plain, released = result["weights"]
    assert plain.keys() == released.keys()
    assert all(torch.equal(plain[k], released[k]) for k in plain)
    assert result["released"] == [["hp_params", "lp_grads", "lp_params", "optim_states"]] * 3


def test_the_release_returns_cublas_workspaces_before_the_cached_blocks(monkeypatch):
    """Found on an H200: after DeepSpeed's offload_states and torch.cuda.empty_cache a released
    trainer still held 64 of its 66 MiB, cuBLAS's workspaces, which empty_cache leaves
    (tools/gpu_check.py); torch frees them only when told, and they must go before the cache is
    emptied. Without CUDA nothing is called."""
    import torch

    from hpcrl import trainer

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cache"))
    trainer.return_device_memory()
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    trainer.return_device_memory()
    assert calls == ["workspaces", "cache"]
