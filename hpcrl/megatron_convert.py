"""Hugging Face <-> Megatron-Core for the Qwen2 and Llama families: the TransformerConfig and GPTModel
that compute what the HF model computes, and the state dict of each (tensor, pipeline) rank's model.

Megatron's layout (megatron-core 0.16.1, the local layer spec, no TransformerEngine):
- `linear_qkv` fuses q, k and v per query group: [q heads of group g; k of g; v of g] for each g,
  and tensor parallelism splits the rows by query group;
- `linear_fc1` holds [gate shard; up shard] on each TP rank;
- `linear_proj` (o_proj) and `linear_fc2` (down_proj) are row parallel: split by input columns;
- the word embedding and the output layer are split by vocabulary rows, the vocabulary padded with
  zero rows to a multiple of TP (`padded_vocab`: megatron's VocabParallelEmbedding needs it
  divisible); the logits of the padding rows are not the model's (hpcrl.megatron_actor drops them)
  and the way back strips them;
- a pipeline stage numbers its layers from 0; the embedding lives on the first stage, the final norm
  and the output layer on the last. With tied embeddings and one stage there is no
  `output_layer.weight`; with several stages the last keeps its own copy of the embedding as
  `output_layer.weight` (megatron keeps the two in step by all-reducing their gradients).

Pure functions over tensors: no process group is needed to convert. Megatron's `_extra_state`
entries (None with the local spec) are neither produced nor read; `load` tolerates only them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2")
_EXTRA = "._extra_state"


@dataclass(frozen=True)
class _Shape:
    layers: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    qkv_bias: bool
    linear_bias: bool  # o_proj and the MLP: megatron's add_bias_linear covers both
    tied: bool


def _shape(hf_config) -> _Shape:
    """The dimensions that matter, refusing what megatron's GPTModel would compute differently."""
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; expected one of {', '.join(FAMILIES)}")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported; expected 'silu'")
    if family == "qwen2":
        sliding = "sliding_attention" in (getattr(hf_config, "layer_types", None) or [])
        if sliding or getattr(hf_config, "use_sliding_window", False):
            raise ValueError("use_sliding_window / layer_types: sliding-window attention is not supported")
        qkv_bias, linear_bias = True, False  # Qwen2 has q/k/v biases only, whatever the config says
    else:
        qkv_bias = linear_bias = bool(getattr(hf_config, "attention_bias", False))
        if bool(getattr(hf_config, "mlp_bias", False)) != linear_bias:
            raise ValueError(f"attention_bias={qkv_bias} with mlp_bias={not qkv_bias} is not supported: "
                             "megatron's add_bias_linear gives o_proj and the MLP a bias together")
    heads = hf_config.num_attention_heads
    return _Shape(layers=hf_config.num_hidden_layers, heads=heads,
                  groups=getattr(hf_config, "num_key_value_heads", None) or heads,
                  head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                  vocab=hf_config.vocab_size, qkv_bias=qkv_bias, linear_bias=linear_bias,
                  tied=bool(hf_config.tie_word_embeddings))


def rope_theta(hf_config) -> float:
    """The RoPE base; a scaled or partial RoPE is refused rather than computed differently."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)  # transformers 4.x; 5.x aliases rope_parameters
    legacy = legacy if isinstance(legacy, dict) else {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported; only 'default' RoPE")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor is not supported; only full RoPE")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_theta: missing from the config (rope_parameters or rope_theta)")
    return float(theta)


def padded_vocab(hf_config, tensor_parallel: int) -> int:
    """The vocabulary size of the megatron model: the HF one rounded up to a multiple of TP."""
    return -(-hf_config.vocab_size // tensor_parallel) * tensor_parallel


def _check_layout(shape: _Shape, tp: int, pp: int) -> None:
    """Megatron splits these evenly (it does not pad the vocabulary): refuse what does not divide."""
    for field, n, parts, over in (("num_key_value_heads", shape.groups, tp, "tensor-parallel ranks"),
                                  ("num_hidden_layers", shape.layers, pp, "pipeline stages")):
        if n % parts:
            raise ValueError(f"{field}={n} does not split evenly over {parts} {over}")


def check(hf_config, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> None:
    """Raise ValueError, naming the field, for a model or layout this module cannot convert (no
    Megatron import: the check before any job, hpcrl.preflight)."""
    _check_layout(_shape(hf_config), tensor_parallel, pipeline_parallel)
    rope_theta(hf_config)


def transformer_config(hf_config, tensor_parallel: int = 1, pipeline_parallel: int = 1, **overrides):
    """Megatron's TransformerConfig for the HF config: fp32, no dropout, no fusions, CPU init."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = _shape(hf_config)
    rope_theta(hf_config)  # refuses a RoPE megatron would compute differently
    _check_layout(shape, tensor_parallel, pipeline_parallel)
    fields = dict(
        num_layers=shape.layers, hidden_size=hf_config.hidden_size, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim,
        ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=hf_config.rms_norm_eps,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_qkv_bias=shape.qkv_bias, add_bias_linear=shape.linear_bias,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False)
    return TransformerConfig(**{**fields, **overrides})


def build_model(hf_config, pre_process: bool = True, post_process: bool = True, tensor_parallel: int = 1,
                pipeline_parallel: int = 1, **overrides):
    """This rank's GPTModel (megatron's parallel_state must be initialised with the same layout)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(hf_config, tensor_parallel, pipeline_parallel, **overrides)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=padded_vocab(hf_config, tensor_parallel),
                    max_sequence_length=hf_config.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
                    position_embedding_type="rope", rotary_base=rope_theta(hf_config))


# One layer: (megatron name, HF names, how TP splits it, the _Shape flag it needs or None).
_LAYER = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "replicate", None),
    ("self_attention.linear_qkv.weight",
     ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", None),
    ("self_attention.linear_qkv.bias",
     ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv", "qkv_bias"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "columns", None),
    ("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), "replicate", "linear_bias"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "replicate", None),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", None),
    ("mlp.linear_fc1.bias", ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "gate_up", "linear_bias"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "columns", None),
    ("mlp.linear_fc2.bias", ("mlp.down_proj.bias",), "replicate", "linear_bias"),
)


def _stage_entries(shape: _Shape, pp_rank: int, pp_size: int) -> list[tuple[str, tuple[str, ...], str]]:
    """(megatron name, HF names, split) of every tensor in pipeline stage pp_rank's model."""
    first, last, per = pp_rank == 0, pp_rank == pp_size - 1, shape.layers // pp_size
    out = [("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "rows")] if first else []
    for local in range(per):
        hf, mg = f"model.layers.{pp_rank * per + local}.", f"decoder.layers.{local}."
        out += [(mg + m, tuple(hf + n for n in names), split) for m, names, split, needs in _LAYER
                if needs is None or getattr(shape, needs)]
    if last:
        out.append(("decoder.final_layernorm.weight", ("model.norm.weight",), "replicate"))
        if not shape.tied:
            out.append(("output_layer.weight", ("lm_head.weight",), "rows"))
        elif not first:  # the last stage's own copy of the tied embedding
            out.append(("output_layer.weight", ("model.embed_tokens.weight",), "rows"))
    return out


def _split(split: str, tensors: list[torch.Tensor], tp: int, shape: _Shape) -> list[torch.Tensor]:
    """The TP shards of one megatron tensor, from its HF tensors."""
    if split == "replicate":
        return [tensors[0]] * tp
    if split == "rows":  # the vocabulary, padded to a multiple of tp
        rows = tensors[0]
        extra = -rows.shape[0] % tp
        return list(torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])]).chunk(tp, dim=0))
    if split == "columns":
        return list(tensors[0].chunk(tp, dim=1))
    if split == "gate_up":
        gate, up = (t.chunk(tp, dim=0) for t in tensors)
        return [torch.cat(pair) for pair in zip(gate, up, strict=True)]
    q, k, v = (t.reshape(shape.groups, -1, *t.shape[1:]) for t in tensors)  # "qkv": per query group
    return [c.reshape(-1, *c.shape[2:]) for c in torch.cat([q, k, v], dim=1).chunk(tp, dim=0)]


def _merge(split: str, shards: list[torch.Tensor], shape: _Shape) -> list[torch.Tensor]:
    """The HF tensors of one megatron tensor, from its TP shards (the inverse of _split)."""
    if split == "replicate":
        return [shards[0]]
    if split == "rows":
        return [torch.cat(shards)[: shape.vocab]]
    if split == "columns":
        return [torch.cat(shards, dim=1)]
    if split == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    per_group = (shape.heads // shape.groups + 2) * shape.head_dim
    fused = torch.cat([s.reshape(-1, per_group, *s.shape[1:]) for s in shards])
    q, k, v = fused.split([per_group - 2 * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]


def _ranks(shape: _Shape, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
    _check_layout(shape, tp_size, pp_size)
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside the layout "
                         f"tp {tp_size} x pp {pp_size}")


def to_megatron(hf_state: dict[str, torch.Tensor], hf_config, tp_rank: int, tp_size: int, pp_rank: int,
                pp_size: int) -> dict[str, torch.Tensor]:
    """The state dict of rank (tp_rank, pp_rank)'s GPTModel (without `_extra_state`), as new tensors."""
    shape = _shape(hf_config)
    _ranks(shape, tp_rank, tp_size, pp_rank, pp_size)
    out = {}
    for mg, names, split in _stage_entries(shape, pp_rank, pp_size):
        missing = [n for n in names if n not in hf_state]
        if missing:
            raise KeyError(f"{', '.join(missing)}: missing from the Hugging Face state dict")
        shard = _split(split, [hf_state[n] for n in names], tp_size, shape)[tp_rank]
        out[mg] = shard.clone(memory_format=torch.contiguous_format)
    return out


def to_hf(shards: dict[tuple[int, int], dict[str, torch.Tensor]], hf_config, tp_size: int,
          pp_size: int) -> dict[str, torch.Tensor]:
    """The HF state dict from every rank's megatron state dict, keyed (tp_rank, pp_rank). A tied
    lm_head.weight is the embedding tensor itself, as HF's model.state_dict() shows it."""
    shape = _shape(hf_config)
    _check_layout(shape, tp_size, pp_size)
    out = {}
    for pp in range(pp_size):
        entries = _stage_entries(shape, pp, pp_size)
        for tp in range(tp_size):
            if (tp, pp) not in shards:
                raise ValueError(f"no state dict for rank (tp {tp}, pp {pp})")
            keys = {k for k in shards[(tp, pp)] if not k.endswith(_EXTRA)}
            if keys != {mg for mg, _, _ in entries}:
                raise ValueError(f"rank (tp {tp}, pp {pp}): keys {sorted(keys ^ {e[0] for e in entries})} "
                                 f"differ from a tp {tp_size} x pp {pp_size} layout's")
        for mg, names, split in entries:
            if shape.tied and mg == "output_layer.weight":
                continue  # the last stage's copy of the embedding
            out.update(zip(names, _merge(split, [shards[(tp, pp)][mg] for tp in range(tp_size)], shape),
                           strict=True))
    if shape.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def chunks(hf_config, pp_size: int) -> list[tuple[int, list[tuple[str, tuple[str, ...], str]]]]:
    """The checkpoint's tensors in the model's order, one decoder layer (or one other tensor) at a
    time: (the pipeline stage that holds it, its (megatron name, HF names, split) entries). A tied
    output layer is left out: the checkpoint holds the embedding once."""
    from hpcrl.checkpoint_view import layer_of

    shape = _shape(hf_config)
    out = []
    for pp in range(pp_size):
        groups: dict[str, list] = {}
        for mg, names, split in _stage_entries(shape, pp, pp_size):
            if not (shape.tied and mg == "output_layer.weight"):
                groups.setdefault(layer_of(names[0]), []).append((mg, names, split))
        out += [(pp, entries) for entries in groups.values()]
    return out


def merge_chunk(entries: list[tuple[str, tuple[str, ...], str]], shards: list[dict[str, torch.Tensor]],
                hf_config) -> dict[str, torch.Tensor]:
    """One chunk's HF tensors from its tensor-parallel shards (`shards[tp]`, megatron names)."""
    shape = _shape(hf_config)
    out = {}
    for mg, names, split in entries:
        out.update(zip(names, _merge(split, [s[mg] for s in shards], shape), strict=True))
    return out


def load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load to_megatron's state dict into a GPTModel: strict, but for megatron's `_extra_state` keys."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    wrong = sorted(k for k in [*missing, *unexpected] if not k.endswith(_EXTRA))
    if wrong:
        raise ValueError(f"state dict does not fit the model: missing {sorted(set(missing) & set(wrong))}, "
                         f"unexpected {sorted(set(unexpected) & set(wrong))}")


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A GPTModel's state dict without megatron's `_extra_state` entries (what to_hf reads)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith(_EXTRA)}

