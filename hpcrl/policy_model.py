"""Loading the policy so that the trainer computes the model vLLM samples from.

transformers picks an attention implementation per model, and its default (sdpa) leaves out
what some families do inside attention: Gemma-2 soft-caps the attention logits, which vLLM
applies and sdpa skips (1.7e-3 mean logprob apart on a tiny model, 17 times the sync probe's
tolerance). `attention_for` chooses, per model config, the implementation that computes what
vLLM computes; the update records the choice in its manifest (`notes.attn_implementation`), and
the trainer-sampler checks (hpcrl.agreement) catch what a choice here misses.
"""

from __future__ import annotations

from pathlib import Path


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_for(config) -> str:
    """"eager" where the model soft-caps its attention logits (only the eager path applies the
    cap), else "sdpa"."""
    if getattr(_text_config(config), "attn_logit_softcapping", None):
        return "eager"
    return "sdpa"


def load_causal_lm(path: str | Path, dtype, attn_implementation: str = "auto", **kwargs):
    """The causal LM at `path` with `attn_implementation` (model.attn_implementation; "auto": the
    one `attention_for` chooses); `kwargs` go to from_pretrained (device_map)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if attn_implementation == "auto":
        attn_implementation = attention_for(AutoConfig.from_pretrained(path))
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                **kwargs)


# How a tokenizer was loaded, which transformers keeps among its settings and saves: whether the
# hub was reachable (HF_HUB_OFFLINE, which a stage job sets) and whether the path was a folder.
LOADING_KWARGS = ("local_files_only", "is_local")


def save_tokenizer(source: str | Path, out: str | Path) -> None:
    """The tokenizer at `source` saved into `out` (beside a policy's weights), the same bytes
    whichever process saves it: without the settings of how it was loaded (LOADING_KWARGS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    for key in LOADING_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out)


def checkpoint_layers(model) -> None:
    """Recompute each decoder layer in the backward pass (update.gradient_checkpointing); the
    non-reentrant form, which needs no input that requires grad and keeps autograd's hooks."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def sequence_logprobs(model, sequences: list[list[int]], pad_id: int, device,
                      temperature: float = 1.0) -> list[list[float]]:
    """Logprobs (at `temperature`) of tokens 1.. of each sequence under `model`, the sequences
    padded into one batch: the trainer's side of the weight-sync probe (hpcrl.resident_sync), and
    a generate replay's teacher forcing (hpcrl.replay_forced)."""
    import torch

    from hpcrl import losses

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
    ids, attn = ids.to(device), attn.to(device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = losses.token_logprobs(logits, ids[:, 1:], temperature)
    return [lp[b, : len(s) - 1].tolist() for b, s in enumerate(sequences)]
