"""PPO's critic: a value head on the policy's backbone, with its own DeepSpeed engine and optimizer.

The value model is the policy's architecture without its LM head (transformers' AutoModel) plus a
Linear(hidden, 1) value head, initialised from the policy's weights (or `algorithm.critic.path`)
with a zero head, so the first values are 0. The value of response token t is read at the
position whose logits predict token t: the value of the state before the token is chosen.

It is saved HF-style in the update's output, `critic/`: the backbone with `save_pretrained`
(loadable by AutoModel, so a saved critic can seed another run) and `value_head.safetensors`;
its DeepSpeed state goes under `trainer/critic/`. The Actor (hpcrl.actor) owns a Critic when
`algorithm.name = "ppo"`, so the staged update job and the resident trainer both train it.
`gae_targets` turns rewards and values into the advantages and returns of one batch.
Like the policy update, the critic's loss is normalised by the mini-batch's global token count,
so its update does not depend on how the batch is split over ranks and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl import advantages, batches, losses, policy_model, sequence_parallel, trainer
from hpcrl.config import AlgorithmConfig, Experiment

HEAD_FILE = "value_head.safetensors"
STAT_NAMES = ("vf_loss", "vf_clipfrac")


@dataclass
class ValueOutput:
    values: torch.Tensor
    past_key_values: object = None


class ValueModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, dtype=backbone.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                **backbone_kwargs) -> ValueOutput:
        """Values [batch, tokens] (float32) at every position; the backbone's cache when asked for
        (`use_cache`, `past_key_values`, `position_ids` go to the backbone)."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            **{"use_cache": False, **backbone_kwargs})
        return ValueOutput(self.value_head(out.last_hidden_state).squeeze(-1).float(), out.past_key_values)


def load_value_model(path: str | Path, dtype: torch.dtype) -> ValueModel:
    """A saved critic, or any HF model's backbone with a new (zero) value head."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    model = ValueModel(AutoModel.from_pretrained(path, dtype=dtype))
    head = Path(path) / HEAD_FILE
    if head.is_file():
        model.value_head.load_state_dict(load_file(head))
    else:
        torch.nn.init.zeros_(model.value_head.weight)
        torch.nn.init.zeros_(model.value_head.bias)
    return model


class Critic:
    def __init__(self, exp: Experiment, rank: int, world_size: int, weights: Path, state_dir: Path | None,
                 grad_accum: int, pad_id: int, sp_group=None):
        """`sp_group`: this rank's sequence-parallel group (the actor's registration, which the
        value model's attention shares: hpcrl.sequence_parallel), None without."""
        self.exp, self.rank, self.world_size, self.pad_id = exp, rank, world_size, pad_id
        self.sp_group = sp_group
        model = load_value_model(weights, getattr(torch, exp.model.dtype))
        if exp.update.gradient_checkpointing:
            policy_model.checkpoint_layers(model.backbone)
        self.engine = trainer.make_engine(model, exp.algorithm.critic.lr, exp, world_size, grad_accum,
                                          state_dir, "critic")

    @torch.no_grad()
    def values_of(self, samples: batches.Samples, rows: list[int]) -> dict[int, list[float]]:
        """Values at the response tokens of `rows` (all ranks together, gathered)."""
        self.engine.eval()
        out = {}
        u = self.exp.update
        for mb in batches.micro_batches(samples, rows, u.micro_batch_size, self.pad_id, u.share_prompts,
                                        u.max_tokens_per_micro_batch):
            mb = mb.to(self.engine.device)
            values = batches.response_outputs(self.engine, mb, "values")
            for i, v in zip(mb.index.tolist(), batches.response_values(values, mb), strict=True):
                out[i] = v
        return trainer.all_gather_rows(out)

    def train_step(self, samples: batches.Samples, mini: list[int], old_values: dict,
                   returns: dict) -> dict[str, float]:
        """One optimizer step of the critic on one mini-batch; its statistics (global token means)."""
        a, u = self.exp.algorithm, self.exp.update
        self.engine.train()
        n_tokens = sum(len(samples.response_ids[i]) for i in mini)
        mbs = trainer.step_micro_batches(samples, mini, self.rank, self.world_size, u, self.pad_id)
        scale = trainer.gradient_scale(self.engine, u, len(mbs), self.world_size)
        sums = dict.fromkeys(STAT_NAMES, 0.0)
        for j, mb in enumerate(mbs):
            trainer.mark_boundary(self.engine, u, j == len(mbs) - 1)
            mb = mb.to(self.engine.device)
            values = batches.response_outputs(self.engine, mb, "values") if self.sp_group is None else \
                sequence_parallel.values(self.engine, mb, self.sp_group)
            out = losses.value_loss(values, batches.padded(old_values, mb), batches.padded(returns, mb),
                                    mb.mask, a.critic.value_clip, n_tokens, a.loss_agg, len(mini))
            if not torch.isfinite(out.loss):
                raise FloatingPointError(f"non-finite critic loss ({out.loss.item()}) on rank {self.rank}; "
                                         "the update is not committed and the run stays at the last good "
                                         "version")
            self.engine.backward(out.loss * scale)
            sums["vf_loss"] += out.loss.item()
            sums["vf_clipfrac"] += out.clipfrac.item() * float(mb.mask.sum()) / n_tokens
            grad_norm = trainer.engine_step(self.engine)
        n = u.sequence_parallel  # a group's ranks each count its micro-batches
        totals = trainer.all_sum([sums[k] for k in STAT_NAMES])
        stats = dict(zip(STAT_NAMES, [v / n for v in totals], strict=True))
        stats["vf_grad_norm"] = grad_norm
        return stats

    def save(self, out: Path, state_dir: Path) -> None:
        """HF-style weights into `out` (backbone + value_head.safetensors); DeepSpeed state into
        `state_dir`."""
        from safetensors.torch import save_file

        if self.exp.update.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls it
        else:
            state = self.engine.module.state_dict() if self.rank == 0 else None
        if self.rank == 0:
            state = {k: v.contiguous() for k, v in trainer.to_cpu(state).items()}  # tied stay tied
            backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
            head = {k.removeprefix("value_head."): v for k, v in state.items() if k.startswith("value_head.")}
            self.engine.module.backbone.save_pretrained(out, state_dict=backbone, safe_serialization=True)
            save_file(head, str(out / HEAD_FILE))
        if dist.is_initialized():
            dist.barrier()
        trainer.save_state(self.engine, state_dir)


@dataclass
class Targets:
    """What GAE gives one batch ([samples, response tokens], 0 past each response)."""

    advantages: torch.Tensor  # what the policy loss uses (whitened with norm_adv_by_std)
    returns: torch.Tensor  # what the critic regresses on
    rewards: torch.Tensor  # the token-level rewards


def gae_targets(outcome: torch.Tensor, mask: torch.Tensor, values: torch.Tensor,
                kl_tokens: torch.Tensor | None, kl_coef: float, algo: AlgorithmConfig) -> Targets:
    """Token rewards (outcome on the last token, -kl_coef * KL on each), GAE, optional whitening."""
    rewards = advantages.token_rewards(outcome, mask, kl_tokens, kl_coef)
    adv, ret = advantages.gae(rewards, values.to(torch.float64), mask, algo.critic.gamma, algo.critic.lam)
    if algo.norm_adv_by_std:
        adv = advantages.masked_whiten(adv, mask)
    return Targets(adv, ret, rewards)
