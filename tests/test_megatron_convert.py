"""HF <-> Megatron-Core conversion (hpcrl.megatron_convert) on tiny random Qwen2 and Llama models:
the round trip is exact for every (tp, pp) layout, each rank's tensors are megatron's splits of the
single-rank ones, and a GPTModel loaded with the converted weights computes HF's logits (on the CPU,
through hpcrl.megatron_shims, in one gloo process)."""

from __future__ import annotations

import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from hpcrl import megatron_convert as mc

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15)


def _config(name: str):
    """Qwen2 (q/k/v biases, GQA), Llama untied with head_dim != hidden/heads, tied, with biases."""
    if name == "qwen2":
        return Qwen2Config(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    llama = dict(SMALL, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    return {"llama": LlamaConfig(**llama),
            "llama_tied": LlamaConfig(**llama, tie_word_embeddings=True),
            "llama_bias": LlamaConfig(**llama, attention_bias=True, mlp_bias=True)}[name]


MODELS = ["qwen2", "llama", "llama_tied", "llama_bias"]


def _model(name: str):
    """A tiny random HF model; every parameter, norms and biases too, drawn with std 0.15."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1.0 if "norm" in pname else 0.0, 0.15)
    return model


def _shards(hf_state, config, tp, pp):
    return {(t, p): mc.to_megatron(hf_state, config, t, tp, p, pp) for t in range(tp) for p in range(pp)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x[0]}pp{x[1]}")
@pytest.mark.parametrize("name", MODELS)
def test_hf_to_megatron_and_back_is_exact(name, layout):
    model = _model(name)
    hf_state = model.state_dict()
    back = mc.to_hf(_shards(hf_state, model.config, *layout), model.config, *layout)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    if model.config.tie_word_embeddings:
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]  # one tensor, as HF shows it


@pytest.mark.parametrize("name", ["qwen2", "llama_tied", "llama_bias"])
def test_each_rank_holds_megatrons_split_of_the_single_rank_tensors(name):
    """TP: column-parallel tensors (qkv by query group, fc1 as [gate shard; up shard], vocab rows) split
    by rows, row-parallel ones by columns, the rest replicated. PP: a stage's layers renumbered from 0,
    the embedding first, norm and output layer last (the tied embedding's copy there)."""
    model = _model(name)
    hf_state, config = model.state_dict(), model.config
    whole = mc.to_megatron(hf_state, config, 0, 1, 0, 1)
    for (t, p), shard in _shards(hf_state, config, 2, 2).items():
        for key, value in shard.items():
            if p == 1 and key.startswith("decoder.layers."):
                i = key.split(".")[2]
                key = key.replace(f"layers.{i}.", f"layers.{int(i) + 2}.")
            elif key == "output_layer.weight" and config.tie_word_embeddings:
                key = "embedding.word_embeddings.weight"
            if key.endswith("linear_fc1.weight") or key.endswith("linear_fc1.bias"):
                gate, up = whole[key].chunk(2)
                expected = torch.cat([gate.chunk(2)[t], up.chunk(2)[t]])
            elif key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight"):
                expected = whole[key].chunk(2, dim=1)[t]
            elif value.shape == whole[key].shape:
                expected = whole[key]
            else:
                expected = whole[key].chunk(2)[t]
            assert torch.equal(value, expected), (t, p, key)
    stages = [set(_shards(hf_state, config, 1, 2)[(0, p)]) for p in (0, 1)]
    assert "embedding.word_embeddings.weight" in stages[0] - stages[1]
    assert {"decoder.final_layernorm.weight", "output_layer.weight"} <= stages[1] - stages[0]
    assert ("output_layer.weight" in whole) != config.tie_word_embeddings
    assert sum(k.endswith("input_layernorm.weight") for k in stages[1]) == 2


@pytest.fixture(scope="module")
def megatron_world():
    """Megatron's parallel state on a one-process gloo group, with the CPU shims; all undone after."""
    from megatron.core import parallel_state, tensor_parallel

    from hpcrl import megatron_shims

    megatron_shims.install()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    megatron_shims.uninstall()


def test_the_shims_put_cuda_on_the_cpu_and_keep_rng_states_apart(megatron_world):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from hpcrl import megatron_shims

    megatron_shims.install()  # idempotent: no second mode pushed
    assert torch.empty(2, device="cuda").device.type == "cpu" and torch.cuda.current_device() == "cpu"
    x = torch.ones(2)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.type() == "torch.cuda.FloatTensor"
    torch.manual_seed(5)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3)) and not torch.equal(inside, after)  # the outer stream untouched


@pytest.mark.parametrize("name", MODELS)
def test_the_megatron_model_computes_hfs_logits(name, megatron_world):
    model = _model(name)
    megatron = mc.build_model(model.config).eval()
    mc.load(megatron, mc.to_megatron(model.state_dict(), model.config, 0, 1, 0, 1))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=positions).logits
        got = megatron(ids, positions, attention_mask=None)
    assert got.shape == expected.shape and expected.abs().max() > 1
    assert (got - expected).abs().max() < 1e-5
    assert mc.to_hf({(0, 0): mc.state(megatron)}, model.config, 1, 1).keys() == model.state_dict().keys()


def test_load_refuses_a_state_dict_that_does_not_fit(megatron_world):
    model = _model("qwen2")
    state = mc.to_megatron(model.state_dict(), model.config, 0, 1, 0, 1)
    megatron = mc.build_model(model.config)
    with pytest.raises(ValueError, match=r"missing \['decoder.final_layernorm.weight'\], unexpected \[\]"):
        mc.load(megatron, {k: v for k, v in state.items() if k != "decoder.final_layernorm.weight"})


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("config, message", [
    (GPT2Config(), "model_type 'gpt2' is not supported; expected one of llama, qwen2"),
    (LlamaConfig(**SMALL, rope_parameters=LLAMA3), "rope_parameters.rope_type 'llama3' is not supported"),
    (LlamaConfig(**SMALL, attention_bias=True), "attention_bias=True with mlp_bias=False is not supported"),
    (LlamaConfig(**SMALL, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8), "use_sliding_window"),
])
def test_an_unsupported_model_is_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        mc.transformer_config(config)


def test_a_vocabulary_that_tp_does_not_divide_is_padded_and_stripped():
    """63 rows over 2 ranks: 32 each, the last a zero row; the way back is exact."""
    torch.manual_seed(0)
    config = Qwen2Config(**{**SMALL, "vocab_size": 63, "tie_word_embeddings": False})
    hf_state = AutoModelForCausalLM.from_config(config).state_dict()
    shards = _shards(hf_state, config, 2, 2)
    assert mc.padded_vocab(config, 2) == 64 and mc.padded_vocab(config, 1) == 63
    for name, pp in (("embedding.word_embeddings.weight", 0), ("output_layer.weight", 1)):
        first, second = shards[(0, pp)][name], shards[(1, pp)][name]
        assert first.shape[0] == second.shape[0] == 32 and not second[-1].any()
    back = mc.to_hf(shards, config, 2, 2)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_a_layout_that_does_not_divide_is_refused():
    config = LlamaConfig(**{**SMALL, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="num_key_value_heads=1 does not split evenly over 2"):
        mc.to_megatron({}, config, 0, 2, 0, 1)
    with pytest.raises(ValueError, match="num_hidden_layers=4 does not split evenly over 3 pipeline stages"):
        mc.transformer_config(_config("llama"), pipeline_parallel=3)


@pytest.mark.parametrize("name", ["qwen2", "llama_tied"])
def test_the_sync_s_chunks_are_the_checkpoint_layer_by_layer(name):
    """chunks + merge_chunk (what the resident sync and the saved policy stream): every HF tensor
    once, a tied lm_head left out, each decoder layer in one chunk, in the model's order."""
    model = _model(name)
    hf_state = model.state_dict()
    tp, pp = 2, 2
    shards = _shards(hf_state, model.config, tp, pp)
    streamed, layers = {}, []
    for stage, entries in mc.chunks(model.config, pp):
        merged = mc.merge_chunk(entries, [shards[(t, stage)] for t in range(tp)], model.config)
        assert not set(merged) & set(streamed)
        streamed.update(merged)
        layers.append({k.split(".")[2] for k in merged if k.startswith("model.layers.")})
    want = {k for k in hf_state if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert streamed.keys() == want and all(torch.equal(streamed[k], hf_state[k]) for k in want)
    assert [sorted(x) for x in layers if x] == [[str(i)] for i in range(model.config.num_hidden_layers)]
