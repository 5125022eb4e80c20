"""LoRA adapters on the policy (hpcrl.lora, `[update.lora]`): the merged weights against numpy, the
weight sync's forms and the vLLM worker's merger, and a real DeepSpeed update that trains only the
adapters, commits the merged policy beside them and resumes from them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hpcrl import checkpoint_view, commit, config, executors, lora, policy_model
from hpcrl.config_training import LoraConfig

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # Qwen2's


def _adapted(tiny_task, targets=("q_proj", "v_proj"), seed: int = 0, rank: int = 4, alpha: float = 8.0):
    """The tiny policy with adapters on `targets`, B drawn at random (a trained adapter)."""
    model = policy_model.load_causal_lm(tiny_task / "model", torch.float32)
    model = lora.wrap(model, LoraConfig(rank=rank, alpha=alpha, target_modules=list(targets)), seed)
    _draw_b(model, seed + 1)
    return model


def _draw_b(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def test_the_merged_policy_is_w_plus_scaled_b_a_and_computes_what_the_adapted_model_does(tiny_task):
    """pins: a scale other than alpha / rank, B A in the wrong order, an adapter left in the
    checkpoint or a non-adapted weight changed by the merge."""
    model = _adapted(tiny_task)
    merged = dict(checkpoint_view.tensors(model))
    base = load_file(tiny_task / "model" / "model.safetensors")
    assert set(merged) == set(base)  # the checkpoint's names, no adapter
    p = dict(model.named_parameters())
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        for leaf in ("q_proj", "v_proj"):
            a = p[f"{prefix}.{leaf}.lora_A.default.weight"].detach().double().numpy()
            b = p[f"{prefix}.{leaf}.lora_B.default.weight"].detach().double().numpy()
            want = base[f"{prefix}.{leaf}.weight"].double().numpy() + 8.0 / 4 * (b @ a)
            np.testing.assert_allclose(merged[f"{prefix}.{leaf}.weight"].double().numpy(), want, atol=1e-6)
        assert torch.equal(merged[f"{prefix}.k_proj.weight"], base[f"{prefix}.k_proj.weight"])
    plain = policy_model.load_causal_lm(tiny_task / "model", torch.float32)
    plain.load_state_dict(merged, strict=False)  # the tied lm_head follows the embedding
    ids = torch.tensor([[5, 17, 40, 99, 3, 250, 12]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_fresh_adapters_change_nothing_and_only_they_train(tiny_task):
    """pins: adapters that start non-zero (the policy of version 0 would not be the base model),
    base weights left trainable, or a target that matches nothing accepted silently."""
    base = policy_model.load_causal_lm(tiny_task / "model", torch.float32)
    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():
        want = base(ids).logits
    model = lora.wrap(base, LoraConfig(rank=4, alpha=8.0), seed=0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 4 * 2  # A and B, 4 modules, 2 layers
    assert lora.scaling(model) == 2.0 and lora.scaling(base) == 2.0  # wrapped in place
    with pytest.raises(ValueError, match=r"\['query'\] matches no linear module"):
        lora.wrap(policy_model.load_causal_lm(tiny_task / "model", torch.float32),
                  LoraConfig(rank=4, target_modules=["query"]), seed=0)


def test_the_reference_policy_is_the_adapted_model_with_its_adapters_off(tiny_task):
    """pins: a reference that is the current policy (no KL to the base at all), or adapters left
    off, or no longer training, after the reference pass."""
    model = _adapted(tiny_task)
    base = policy_model.load_causal_lm(tiny_task / "model", torch.float32)
    ids = torch.tensor([[5, 17, 40, 99, 3, 250]])
    with torch.no_grad():
        adapted = model(ids).logits
        assert torch.equal(lora.WithoutAdapters(model)(input_ids=ids).logits, base(ids).logits)
        assert torch.equal(model(ids).logits, adapted) and not torch.equal(adapted, base(ids).logits)
    assert all(p.requires_grad == lora.is_adapter(n) for n, p in model.named_parameters())


def test_the_worker_merger_loads_each_adapted_layer_whole_from_the_adapters_alone(tiny_task):
    """The sync sends the bases and the adapters once, then the adapters only; the vLLM worker's
    merger turns each into the merged weights of every layer vLLM loads with an adapted module
    (q/k/v together as qkv_proj). pins: a sync that resends every weight, a merger that emits only
    the adapted q_proj (vLLM would reload qkv_proj from a third of its weights), that keeps a
    received tensor without copying it, or that merges without a base weight."""
    model = _adapted(tiny_task, targets=("q_proj",))
    wire = list(checkpoint_view.tensors(model, form="wire"))
    assert not any("base_layer" in n or ".default." in n for n, _ in wire)
    merger = lora.Merger(2.0, ["q_proj"], PACKED)
    first = dict(merger((n, t.clone()) for n, t in wire))
    merged = dict(checkpoint_view.tensors(model))
    assert set(first) == set(merged) and all(torch.equal(first[n], merged[n]) for n in merged)

    _draw_b(model, 7)  # an update
    adapters = list(checkpoint_view.tensors(model, form="adapters"))
    assert {n.rpartition(".")[2] for n, _ in adapters} == {"lora_A", "lora_B"}
    assert _nbytes(adapters) <= 0.1 * _nbytes(wire)
    buffer = torch.zeros(1 << 16)  # the receiver's bucket, reused: each tensor a view into it

    def received():
        for name, t in adapters:
            view = buffer[: t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view

    second = dict(merger(received()))
    qkv = {f"model.layers.{i}.self_attn.{m}.{p}" for i in range(2) for m in ("q_proj", "k_proj", "v_proj")
           for p in ("weight", "bias")}
    assert set(second) == qkv
    merged = dict(checkpoint_view.tensors(model))
    assert all(torch.equal(second[n], merged[n]) for n in qkv)
    assert not torch.equal(second["model.layers.0.self_attn.q_proj.weight"],
                           first["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(RuntimeError, match="no base weight"):
        list(lora.Merger(2.0, ["q_proj"], PACKED)(iter(adapters)))


def test_saved_adapters_load_into_a_fresh_policy(tiny_task, tmp_path):
    """pins: adapters saved under names that do not load back, or loaded into nothing."""
    model = _adapted(tiny_task)
    lora.save_adapters(model, {n: p.data for n, p in model.named_parameters()}, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    other = lora.wrap(policy_model.load_causal_lm(tiny_task / "model", torch.float32),
                      LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), seed=5)
    lora.load_adapters(other, tmp_path / "adapter")
    mine, theirs = dict(model.named_parameters()), dict(other.named_parameters())
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    import peft

    loaded = peft.PeftModel.from_pretrained(policy_model.load_causal_lm(tiny_task / "model", torch.float32),
                                            str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 17, 40, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)  # peft's format
    wrong = lora.wrap(policy_model.load_causal_lm(tiny_task / "model", torch.float32),
                      LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"]), seed=5)
    with pytest.raises(ValueError, match="do not fit update.lora"):
        lora.load_adapters(wrong, tmp_path / "adapter")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world_size", "zero_stage"), [(1, 2), (2, 3)], ids=["one-rank", "z3-two-ranks"])
def test_a_lora_update_trains_the_adapters_commits_the_merged_policy_and_resumes_from_them(
        write_experiment, world_size, zero_stage, tmp_path):
    """Two staged updates (real DeepSpeed; one rank, and two under ZeRO-3, whose weights are
    partitioned) with adapters on q_proj and v_proj: the committed policy
    is the base plus alpha / rank x B A of the committed adapters (numpy), every other weight the
    base's; the DeepSpeed state leaves the frozen weights out; the second update starts from the
    first one's policy (its recomputed logprobs are those of the merged policy on disk). pins:
    a merged policy that misses the adapters, a version that reloads fresh adapters, a state that
    holds the whole model, or a reference (algorithm.kl) other than the base model."""
    from transformers import AutoTokenizer

    from tests.test_update_deepspeed import _commit_inputs

    update = {"lr": 1e-2, "world_size": world_size, "zero_stage": zero_stage,
              "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}}
    exp = config.load(write_experiment("lora", run={"iterations": 2}, algorithm={"kl": {"coef": 0.05}},
                                       update=update))
    from hpcrl import runs

    run, _ = runs.prepare(exp, "lora")
    tokenizer = AutoTokenizer.from_pretrained(exp.model.path)
    for k in range(2):
        _commit_inputs(run, exp, tokenizer, iteration=k)
        executors.LocalExecutor(run, exp).submit("update", k).job.results()
        metrics = commit.read_manifest(run.stage_dir(k, "update"))["metrics"]
        assert metrics["rollout/logprob_diff_max"] < 1e-4, metrics  # the policy it resumed is version k's
        first = commit.read_table(run.stage_dir(k, "update"), "stats").to_pylist()[0]
        assert (first["kl_ref"] > 1e-6) == (k == 1), first  # the reference is the base: version 0
    base = load_file(exp.model.path + "/model.safetensors")
    out = run.stage_dir(1, "update")
    merged = load_file(out / "policy" / "model.safetensors")
    adapters = load_file(out / "policy" / "adapter" / "adapter_model.safetensors")
    for name, w in base.items():
        module = name.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            assert torch.equal(merged[name], w), name
            continue
        b = adapters[f"base_model.model.{module}.lora_B.weight"]
        assert b.abs().max() > 0  # trained
        want = w.double().numpy() + 2.0 * (b.double().numpy() @ a.double().numpy())
        np.testing.assert_allclose(merged[name].double().numpy(), want, atol=1e-6)
    state = sum(f.stat().st_size for f in (out / "trainer").rglob("*") if f.is_file())
    assert state < 0.25 * (out / "policy" / "model.safetensors").stat().st_size
    _exports(run, exp, tmp_path)


def _exports(run, exp, tmp_path) -> None:
    """`hpcrl export` writes the merged model, or on request the adapters alone."""
    from hpcrl.export import PROVENANCE, ExportError, export_policy

    merged = {p.name for p in export_policy(run, exp, 2, tmp_path / "merged")}
    assert "model.safetensors" in merged and not {"adapter", "adapter_model.safetensors"} & merged
    adapters = {p.name for p in export_policy(run, exp, 2, tmp_path / "adapters", adapters=True)}
    assert adapters == {"adapter_model.safetensors", "adapter_config.json", PROVENANCE}
    with pytest.raises(ExportError, match="version 0 has no adapters"):
        export_policy(run, exp, 0, tmp_path / "none", adapters=True)
