"""The family matrix, fast part: for tiny random models of every supported family
(tools/tiny_models.py), the weight sync sends exactly what `save_pretrained` writes, and a real
vLLM engine loaded through hpcrl's worker extension then computes what the trainer computes
(~1e-6 in float32), mixtures of experts, tied and soft-capped models included. The full matrix
(two iterations of each family in both modes) is tools/family_matrix.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hpcrl import agreement, checkpoint_view, policy_model, resident_sync, vllm_ext
from tests.conftest import load_tool

tiny_models = load_tool("tiny_models")
FAMILIES = sorted(tiny_models.FAMILIES)


@pytest.fixture(scope="module")
def family_dir(tiny_task, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        tiny_models.build(family, out / family, tiny_task / "model")
    return out


def _moved(path: Path, seed: int = 1):
    """The model at `path` after "an update": every parameter moved."""
    model = policy_model.load_causal_lm(path, torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sync_sends_what_save_pretrained_writes(family, family_dir, tmp_path):
    from safetensors.torch import load_file

    model = _moved(family_dir / family)
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    view = list(checkpoint_view.tensors(model))
    assert [n for n, _ in view] == list(dict(view))  # every name once: tied parameters once
    assert set(dict(view)) == set(saved)
    for name, t in view:
        assert torch.equal(t, saved[name]), name
    if family.startswith("qwen3_moe") or family == "mixtral":  # held fused in memory, sent per expert
        assert any(".experts.0." in n for n, _ in view)
        assert not any(n.endswith("experts.gate_up_proj") for n, _ in view)


def test_layers_come_one_at_a_time(family_dir):
    model = policy_model.load_causal_lm(family_dir / "qwen3_moe", torch.float32)
    gathered = []

    def gather(params):
        gathered.append(len(params))
        return torch.no_grad()

    chunks = [[n for n, _ in c] for c in checkpoint_view.chunks(model, gather)]
    layers = [c for c in chunks if c[0].startswith("model.layers.")]
    assert len(layers) == 2 and len(gathered) == len(chunks)  # a gather per chunk, never the model
    assert all(len({checkpoint_view.layer_of(n) for n in c}) == 1 for c in layers)
    assert max(gathered) < sum(1 for _ in model.parameters())


def test_the_trainer_applies_gemma2_soft_capping(family_dir):
    from transformers import AutoConfig

    assert policy_model.attention_for(AutoConfig.from_pretrained(family_dir / "gemma2")) == "eager"
    assert policy_model.attention_for(AutoConfig.from_pretrained(family_dir / "qwen2")) == "sdpa"


def _probe(model, sequences: list[list[int]]) -> list[list[float]]:
    from hpcrl import losses

    with torch.no_grad():
        return [losses.token_logprobs(model(torch.tensor([s])).logits[:, :-1], torch.tensor([s[1:]]),
                                      1.0)[0].tolist() for s in sequences]


PROBE = [[1, 5, 9, 13, 20, 7, 3, 11, 4, 6], [2, 8, 4, 16, 30, 12, 3]]


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_computes_the_trainers_model_after_a_sync(family, family_dir, write_experiment, own_engine):
    """Load, sync an updated model through the worker extension, compare the probe logprobs."""
    from hpcrl import config, generation, transports
    from hpcrl.weight_sync import check_probe

    path = family_dir / family
    exp = config.load(write_experiment(model={"path": str(path), "max_model_len": 64}))
    llm = generation.make_engine(exp, path, 0, worker_extension_cls="hpcrl.vllm_ext.WeightReceiver")
    base = policy_model.load_causal_lm(path, torch.float32)
    start = abs(torch.tensor(_flat(resident_sync.engine_logprobs(llm, PROBE)))
                - torch.tensor(_flat(_probe(base, PROBE)))).mean().item()
    assert start < 1e-5, f"{family}: vLLM and the trainer differ by {start:.2e} before any sync"
    if family == "gemma2":  # a trainer without soft-capping is another model, and is refused
        sdpa = policy_model.load_causal_lm(path, torch.float32, "sdpa")
        with pytest.raises(agreement.ModelMismatchError, match=r"differ from the trainer's by \S+ on average "
                           r"\(largest \S+\), above the tolerance 1e-04.*'sdpa'"):
            agreement.check_start(resident_sync.engine_logprobs(llm, PROBE), _probe(sdpa, PROBE), 1e-4,
                                  "sdpa", str(path))
    trained = _moved(path)
    setup = transports.SyncSetup("shared_memory")
    sender = transports.make(setup)
    sender.open_sender()
    llm.collective_rpc("hpcrl_open_sync", args=(setup.as_dict(), 0))
    handoff = sender.send(checkpoint_view.tensors(trained))
    warned = _Records()
    logging.getLogger(vllm_ext.RELOAD_LOGGER).addHandler(warned)
    try:
        loads = llm.collective_rpc("hpcrl_load_weights", args=(handoff.as_dict(),))
    finally:
        logging.getLogger(vllm_ext.RELOAD_LOGGER).removeHandler(warned)
    # nothing on every sync for the layers no checkpoint holds (a tied head, the rotary cache)
    assert not [r.getMessage() for r in warned.records if r.levelno >= logging.WARNING], family
    assert [load["direct"] for load in loads] == [True], family  # CPU, unquantized: hpcrl.vllm_ext.DirectLoad
    llm.reset_prefix_cache()
    synced = resident_sync.engine_logprobs(llm, PROBE)
    metrics = check_probe(synced, _probe(trained, PROBE), _probe(base, PROBE), 1e-5, version=1)
    assert metrics["sync/logp_diff"] < 1e-5 < metrics["sync/update_shift"], (family, metrics)
    # trainer 0 rewrites the buffer while the engine samples (presend: hpcrl.resident_trainer), so
    # the engine must hold copies of what it loaded, no view of the buffer
    sender.sync.buffer.fill_(0xFF)  # every float a NaN
    llm.reset_prefix_cache()
    assert resident_sync.engine_logprobs(llm, PROBE) == synced, f"{family}: vLLM reads the buffer it loaded"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for r in rows for x in r]


def _digests(worker) -> dict[str, str]:
    """Run in each vLLM worker: a hash of every parameter it holds (its shard), and of what each of
    its CPU GEMMs computes from a fixed input (vLLM keeps a linear layer's weight only packed)."""
    import hashlib

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                              ).hexdigest()

    model = worker.model_runner.get_model()
    out = {name: digest(p) for name, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for name, m in model.named_modules():
        if hasattr(m, "cpu_linear"):
            x = torch.randn(2, getattr(m, "input_size_per_partition", None) or m.embedding_dim, generator=g)
            out[f"{name} GEMM"] = digest(m.cpu_linear(x, m.weight, getattr(m, "bias", None)))
    return out


def test_tensor_parallel_workers_each_load_their_shard_of_the_sync(family_dir, write_experiment, tmp_path,
                                                                   own_engine):
    """Issue #17: vLLM with tensor_parallel_size = 2 (on CPU, each worker bound to its own core):
    both workers join the sync (ranks 1 and 2 of its group) and then hold, bit for bit, the shards
    an engine loading the updated checkpoint holds; the probe matches the trainer."""
    import os

    from hpcrl import config, generation, transports

    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("tensor parallelism 2 on CPU needs 2 cores")  # CI's machine has them: never skipped
    path = family_dir / "qwen2"
    exp = config.load(write_experiment(model={"path": str(path), "max_model_len": 64},
                                       generate={"tensor_parallel_size": 2}))
    trained = _moved(path)
    trained.save_pretrained(tmp_path / "trained")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (path / f).exists():
            (tmp_path / "trained" / f).write_bytes((path / f).read_bytes())
    fresh = generation.make_engine(exp, tmp_path / "trained", 0)
    expected = fresh.collective_rpc(_digests)
    assert all(sum(n.endswith(" GEMM") for n in shard) >= 8 for shard in expected)  # 2 layers' q/k/v, o, MLP
    fresh.llm_engine.engine_core.shutdown()  # its workers end (they hold both cores)
    llm = generation.make_engine(exp, path, 0, worker_extension_cls="hpcrl.vllm_ext.WeightReceiver")
    setup = transports.SyncSetup("shared_memory", tp=2)
    sender = transports.make(setup)
    sender.open_sender()
    assert llm.collective_rpc("hpcrl_open_sync", args=(setup.as_dict(), 0)) == [1, 2]
    llm.collective_rpc("hpcrl_load_weights", args=(sender.send(checkpoint_view.tensors(trained)).as_dict(),))
    llm.reset_prefix_cache()
    got = llm.collective_rpc(_digests)
    assert len(got) == 2 and got == expected
    diff = abs(torch.tensor(_flat(resident_sync.engine_logprobs(llm, PROBE)))
               - torch.tensor(_flat(_probe(trained, PROBE)))).mean().item()
    assert diff < 1e-5
