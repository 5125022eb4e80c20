"""Tiny random-initialised models of every model family hpcrl supports, for the family matrix.

Each model uses the tiny task's tokenizer (tools/build_tiny_task.py) and the same small shape
(hidden 64, 2 layers, 2 heads of 32: the smallest head vLLM's CPU attention takes), with the
family's own features switched on: llama3 RoPE scaling (both config layouts), fused qkv and
gate-up (Phi-3), tied embeddings, attention and final logit soft-capping (Gemma-2), sliding
windows (Gemma-2, Gemma-3, Mistral), and mixtures of experts (Qwen3-MoE, Mixtral). Weights are
drawn with std 0.15, not transformers' 0.02: with 0.02 the logits are near uniform, and a
trainer that computes a different model from vLLM's (Gemma-2 without soft-capping) hides in them.

    python tools/tiny_models.py --out /tmp/families [--family gemma2 ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / ".cache" / "tiny-addition" / "model"
STD = 0.15
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32, rope_theta=10000.0)
MOE = dict(num_experts_per_tok=2)

# family -> (transformers config class, model class, extra config)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama3_legacy": ("LlamaConfig", "LlamaForCausalLM",
                      dict(rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
                           rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=32, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
                    final_logit_softcapping=10.0, sliding_window=16, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=16, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, num_experts=4, moe_intermediate_size=64, decoder_sparse_step=1,
                       mlp_only_layers=[], **MOE)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **MOE)),
}


def token_ids(tokenizer) -> dict[str, int]:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}


def build(family: str, out: Path, tokenizer_dir: Path = TOKENIZER, seed: int = 0) -> Path:
    """A tiny random model of `family` with the tokenizer of `tokenizer_dir`, saved to `out`."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, extra = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_cls)(vocab_size=len(tok), **{**SHAPE, **extra}, **token_ids(tok))
    config.initializer_range = STD
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():  # norms at 1 plus noise, so a wrong norm convention (Gemma's 1 + w) shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * STD)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for name in ("chat_template.jinja",):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--family", action="append", choices=sorted(FAMILIES))
    args = p.parse_args(argv)
    for family in args.family or FAMILIES:
        print(family, build(family, args.out / family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
