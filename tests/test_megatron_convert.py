"""HF <-> Megatron-Core conversion (hpcrl.megatron_convert) on tiny random Qwen2 and Llama models:
the round trip is exact for every (tp, pp) layout, each rank's tensors are megatron's splits of the
single-rank ones, and a GPTModel loaded with the converted weights computes HF's logits (on the CPU,
through hpcrl.megatron_shims, in one gloo process)."""

from __future__ import annotations

import re
import socket
from types import SimpleNamespace

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
    wrong = {k: v for k, v in state.items() if not k.startswith("decoder.layers.3.mlp.")}
    wrong["decoder.layers.4.input_layernorm.weight"] = state["decoder.layers.3.input_layernorm.weight"]
    with _refused("state dict does not fit the model: missing ['decoder.layers.3.mlp.linear_fc1.weight', "
                  "'decoder.layers.3.mlp.linear_fc2.weight'], unexpected "
                  "['decoder.layers.4.input_layernorm.weight']"):
        mc.load(megatron, wrong)


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


def _refused(message: str):
    """pytest.raises(ValueError) with exactly this message."""
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1e4}


def _bare(model_type: str, **fields):
    """A config with only the fields every transformers version writes, as an older one reads a
    checkpoint: no head_dim, num_key_value_heads, layer_types, use_sliding_window, attention_bias,
    mlp_bias, rope_parameters or rope_scaling (hence the defaults: one group a head, hidden/heads
    channels, no sliding window, no biases but Qwen2's q/k/v ones, plain RoPE at rope_theta)."""
    base = dict(model_type=model_type, hidden_act="silu", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_theta=1e4)
    return SimpleNamespace(**{**base, **fields})


def _odd(**fields):
    """3 layers and 3 key/value heads: no layout but one rank splits them."""
    return LlamaConfig(**{**SMALL, "hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3,
                          "num_hidden_layers": 3, "rope_parameters": DEFAULT_ROPE, **fields})


FUSIONS = ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "apply_rope_fusion",
           "gradient_accumulation_fusion", "bias_dropout_fusion")


def _assert_maps(tc, hf, qkv_bias: bool, linear_bias: bool, head_dim: int, tp: int = 1, pp: int = 1):
    """The TransformerConfig fields each HF config field maps to, and the fixed ones (fp32, no
    dropout, no fusions, CPU init)."""
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.ffn_hidden_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.intermediate_size)
    assert (tc.num_query_groups, tc.kv_channels) == (getattr(hf, "num_key_value_heads", None)
                                                     or hf.num_attention_heads, head_dim)
    assert (tc.normalization, tc.layernorm_epsilon) == ("RMSNorm", hf.rms_norm_eps)
    assert tc.gated_linear_unit is True and tc.activation_func is torch.nn.functional.silu
    assert (tc.add_qkv_bias, tc.add_bias_linear) == (qkv_bias, linear_bias)
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size) == (tp, pp)
    assert tc.hidden_dropout == tc.attention_dropout == 0.0
    assert tc.params_dtype == tc.pipeline_dtype == torch.float32 and tc.use_cpu_initialization
    assert not any(getattr(tc, f) for f in FUSIONS), {f: getattr(tc, f) for f in FUSIONS}


@pytest.mark.parametrize("name, qkv_bias, linear_bias, head_dim", [
    ("qwen2", True, False, 8), ("llama", False, False, 16), ("llama_tied", False, False, 16),
    ("llama_bias", True, True, 16)])
@pytest.mark.parametrize("layout", [(1, 1), (2, 2)], ids=lambda x: f"tp{x[0]}pp{x[1]}")
def test_the_transformer_config_is_the_hf_configs(name, qkv_bias, linear_bias, head_dim, layout):
    """Each field megatron reads, from the HF field it stands for: Qwen2's q/k/v biases whatever the
    config says, Llama's head_dim over hidden/heads, the RMSNorm epsilon; a pipeline's dtype."""
    hf = _config(name)
    hf.rms_norm_eps = 3e-5  # neither megatron's default nor transformers'
    _assert_maps(mc.transformer_config(hf, *layout), hf, qkv_bias, linear_bias, head_dim, *layout)
    assert mc.transformer_config(hf, hidden_dropout=0.1).hidden_dropout == 0.1  # an override wins


@pytest.mark.parametrize("family, qkv_bias", [("llama", False), ("qwen2", True)])
def test_a_config_with_only_the_older_fields_converts_with_the_defaults(family, qkv_bias):
    hf = _bare(family)
    assert mc.rope_theta(hf) == 1e4
    mc.check(hf, 2, 2)
    _assert_maps(mc.transformer_config(hf, 2, 2), hf, qkv_bias, False, 8, 2, 2)
    with _refused("model_type None is not supported; expected one of llama, qwen2"):
        mc.check(SimpleNamespace(hidden_act="silu"))  # no model_type at all


def test_check_and_the_config_default_to_one_rank():
    """check() and transformer_config() without a layout: tensor and pipeline parallel 1, which
    splits any model; check refuses what the layout does not divide, and a RoPE it cannot compute."""
    hf = _odd()
    mc.check(hf)
    mc.check(hf, 3, 3)
    tc = mc.transformer_config(hf)
    assert (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size) == (1, 1)
    with _refused("num_key_value_heads=3 does not split evenly over 2 tensor-parallel ranks"):
        mc.check(hf, 2)
    with _refused("num_hidden_layers=3 does not split evenly over 2 pipeline stages"):
        mc.check(hf, 1, 2)
    with _refused("rope_parameters.partial_rotary_factor is not supported; only full RoPE"):
        mc.check(_odd(rope_parameters={**DEFAULT_ROPE, "partial_rotary_factor": 0.5}))


@pytest.mark.parametrize("config, theta", [
    (_bare("llama"), 1e4),  # transformers 4.x: rope_theta, no rope_parameters
    (_bare("llama", rope_theta=None, rope_parameters={"rope_theta": 5e5}), 5e5),  # no rope_type: default
    (_bare("llama", rope_theta=2e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}), 5e5),
    (_bare("llama", rope_scaling=None), 1e4),  # config.json's "rope_scaling": null
    (_config("qwen2"), 1e6),
], ids=["rope_theta", "parameters-without-type", "parameters-first", "scaling-null", "qwen2"])
def test_the_rope_base_is_read_from_either_place(config, theta):
    assert mc.rope_theta(config) == theta


@pytest.mark.parametrize("config, message", [
    (_bare("llama", rope_scaling={"type": "linear", "factor": 2.0}),  # transformers < 4.45 wrote "type"
     "rope_parameters.rope_type 'linear' is not supported; only 'default' RoPE"),
    (_bare("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_parameters.rope_type 'dynamic' is not supported; only 'default' RoPE"),
    (_bare("qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type 'yarn' is not supported; only 'default' RoPE"),
    (_bare("llama", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor is not supported; only full RoPE"),
    (_bare("llama", rope_theta=None), "rope_theta: missing from the config (rope_parameters or rope_theta)"),
    (_bare("llama", attention_bias=True), "attention_bias=True with mlp_bias=False is not supported: "
     "megatron's add_bias_linear gives o_proj and the MLP a bias together"),
    (_bare("llama", mlp_bias=True), "attention_bias=False with mlp_bias=True is not supported: "
     "megatron's add_bias_linear gives o_proj and the MLP a bias together"),
    (Qwen2Config(**SMALL, layer_types=["full_attention"] * 3 + ["sliding_attention"]),
     "use_sliding_window / layer_types: sliding-window attention is not supported"),
], ids=["scaling-type", "scaling-rope_type", "parameters-yarn", "partial", "no-theta", "attention-bias",
        "mlp-bias", "layer-types"])
def test_what_megatron_would_compute_differently_is_refused_in_full(config, message):
    with _refused(message):
        mc.check(config)


def test_a_rank_outside_the_layout_is_refused():
    model = _model("llama")
    hf_state, config = model.state_dict(), model.config
    for tp_rank, tp, pp_rank, pp in ((2, 2, 0, 1), (0, 1, 1, 1), (0, 2, 2, 2), (-1, 2, 0, 1), (0, 1, -1, 2)):
        with _refused(f"rank (tp {tp_rank}, pp {pp_rank}) is outside the layout tp {tp} x pp {pp}"):
            mc.to_megatron(hf_state, config, tp_rank, tp, pp_rank, pp)


def test_a_missing_hf_tensor_is_named():
    model = _model("llama")
    hf_state = dict(model.state_dict())
    del hf_state["model.layers.3.self_attn.q_proj.weight"], hf_state["model.layers.3.self_attn.v_proj.weight"]
    with pytest.raises(KeyError, match=re.escape("model.layers.3.self_attn.q_proj.weight, "
                                                 "model.layers.3.self_attn.v_proj.weight: missing from the "
                                                 "Hugging Face state dict")):
        mc.to_megatron(hf_state, model.config, 0, 1, 0, 1)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in mc.to_megatron(
        hf_state, model.config, 0, 1, 0, 2)  # the first of two stages does not need layer 3


def test_to_hf_names_a_missing_rank_and_keys_that_do_not_fit():
    model = _model("llama")
    shards = _shards(model.state_dict(), model.config, 2, 2)
    shards[(0, 0)]["decoder.layers.0.self_attention.core_attention._extra_state"] = None  # skipped
    with _refused("no state dict for rank (tp 1, pp 0)"):
        mc.to_hf({k: v for k, v in shards.items() if k != (1, 0)}, model.config, 2, 2)
    bad = dict(shards[(0, 1)], **{"decoder.layers.2.mlp.linear_fc1.weight": torch.zeros(1)})
    del bad["decoder.final_layernorm.weight"]
    with _refused("rank (tp 0, pp 1): keys ['decoder.final_layernorm.weight', "
                  "'decoder.layers.2.mlp.linear_fc1.weight'] differ from a tp 2 x pp 2 layout's"):
        mc.to_hf({**shards, (0, 1): bad}, model.config, 2, 2)
    back = mc.to_hf(shards, model.config, 2, 2)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_to_hf_reads_a_tied_embedding_from_the_first_stage():
    """The last stage's copy of a tied embedding (output_layer.weight) is not read back: the
    checkpoint's embedding is the first stage's word embedding, lm_head.weight that same tensor."""
    model = _model("llama_tied")
    hf_state = model.state_dict()
    shards = _shards(hf_state, model.config, 2, 2)
    for t in range(2):
        shards[(t, 1)]["output_layer.weight"] = torch.zeros_like(shards[(t, 1)]["output_layer.weight"])
    back = mc.to_hf(shards, model.config, 2, 2)
    assert torch.equal(back["model.embed_tokens.weight"], hf_state["model.embed_tokens.weight"])
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


def test_merge_chunk_refuses_entries_whose_names_its_split_does_not_yield():
    """A chunk entry with more (or fewer) HF names than its split gives tensors: refused, rather
    than a tensor silently left out of the streamed checkpoint."""
    model = _model("qwen2")
    shards = _shards(model.state_dict(), model.config, 2, 1)
    [entry] = [e for _, entries in mc.chunks(model.config, 1) for e in entries
               if e[0] == "decoder.layers.0.self_attention.linear_qkv.weight"]
    mg, names, split = entry
    for wrong in (names[:2], (*names, "model.layers.0.self_attn.x_proj.weight")):
        with pytest.raises(ValueError, match="zip"):
            mc.merge_chunk([(mg, wrong, split)], [shards[(t, 0)] for t in range(2)], model.config)
    assert set(mc.merge_chunk([entry], [shards[(t, 0)] for t in range(2)], model.config)) == set(names)


@pytest.mark.parametrize("vocab, tp", [(63, 2), (61, 4), (60, 4)])
def test_every_vocabulary_shard_has_the_padded_rows(vocab, tp):
    """The padding is what brings the vocabulary to a multiple of tp: each shard padded/tp rows."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMALL, "vocab_size": vocab, "num_key_value_heads": 4})
    hf_state = AutoModelForCausalLM.from_config(config).state_dict()
    shards = _shards(hf_state, config, tp, 1)
    padded = mc.padded_vocab(config, tp)
    assert padded == -(-vocab // tp) * tp
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = [shards[(t, 0)][name] for t in range(tp)]
        assert [r.shape[0] for r in rows] == [padded // tp] * tp
        assert not torch.cat(rows)[vocab:].any()
    back = mc.to_hf(shards, config, tp, 1)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_each_pipeline_stage_s_model_takes_that_stage_s_state_dict(megatron_world):
    """build_model's layout reaches the model: the first of two stages holds the embedding and two
    layers, the last two layers, the final norm and the output layer; by default one stage, one
    tensor-parallel rank (a vocabulary of 63 unpadded)."""
    model = _model("llama")
    hf_state, config = model.state_dict(), model.config
    config.vocab_size = 63
    hf_state = dict(hf_state, **{k: hf_state[k][:63] for k in ("model.embed_tokens.weight",
                                                                 "lm_head.weight")})
    for pre, post, pp_rank, pp in ((True, True, 0, 1), (True, False, 0, 2), (False, True, 1, 2)):
        kwargs = {"pipeline_parallel": pp} if pp > 1 else {}
        stage = mc.build_model(config, pre_process=pre, post_process=post, **kwargs)
        assert (stage.config.tensor_model_parallel_size, stage.config.pipeline_model_parallel_size) == (1, pp)
        mc.load(stage, mc.to_megatron(hf_state, config, 0, 1, pp_rank, pp))
        assert len(stage.decoder.layers) == 4 // pp
    whole = mc.build_model(_odd())
    assert (whole.config.tensor_model_parallel_size, whole.config.pipeline_model_parallel_size) == (1, 1)


class _ApexNorm(torch.nn.LayerNorm):
    """What megatron's local spec builds for a norm by default where Apex is installed (its
    FusedLayerNorm: a LayerNorm)."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__(hidden_size, eps=eps)


@pytest.mark.parametrize("name, head_dim", [("llama_tied", 16), ("qwen2", 8)])
def test_the_built_model_is_the_hf_configs(name, head_dim, megatron_world, monkeypatch):
    """RMSNorm with the HF epsilon in every norm whatever megatron's default norm (Apex's LayerNorm
    where installed), the RoPE base, tied embeddings, the maximum length; overrides reach the model."""
    from megatron.core.models import backends

    monkeypatch.setattr(backends, "LNImpl", _ApexNorm)
    hf = _config(name)
    model = mc.build_model(hf)
    norms = {n: m for n, m in model.named_modules()
             if n.endswith(("input_layernorm", "pre_mlp_layernorm", "final_layernorm"))}
    assert len(norms) == 2 * hf.num_hidden_layers + 1
    assert all(type(m) is torch.nn.RMSNorm and m.eps == hf.rms_norm_eps for m in norms.values()), norms
    theta = mc.rope_theta(hf)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.allclose(model.rotary_pos_emb.inv_freq.cpu(), inv_freq)
    assert model.share_embeddings_and_output_weights == hf.tie_word_embeddings
    assert model.max_sequence_length == hf.max_position_embeddings
    _assert_maps(model.config, hf, name == "qwen2", False, head_dim)
    half = mc.build_model(hf, params_dtype=torch.bfloat16)
    assert half.config.params_dtype == torch.bfloat16
    assert half.embedding.word_embeddings.weight.dtype == torch.bfloat16
