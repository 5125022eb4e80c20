"""Arrow schemas of the stage contracts: the one place that says what each stage writes.

Every committed table is checked against its schema here, and the schema version is recorded in
each manifest. Change a schema only together with SCHEMA_VERSION.
This module owns no I/O beyond schema checks.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 4
# v2: rollouts gained `round` and `kept` (dynamic sampling, hpcrl/dynamic_sampling.py), the update
# its PPO columns (token advantages, values, returns, critic stats). Readers take v1 rollouts, which
# lack `round` and `kept`, as round 0 with every training row kept.
# v3: the update's stats gained the mixture-of-experts routing columns (hpcrl/moe.py; null for a
# dense model). No reader needs them: v2 stats read as before.
# v4: the update's stats gained the off-policy correction's columns (asynchronous generation,
# algorithm.max_staleness; null without the correction). No reader needs them: v3 stats read as before.

# The key of one sample across the generate, score and update outputs.
SAMPLE_KEYS = ("split", "prompt_index", "sample_index")

ROLLOUTS = pa.schema(
    [
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("split", pa.string(), nullable=False),  # "train", "val", or "baseline" (remax's greedy)
        pa.field("prompt_index", pa.int64(), nullable=False),  # row in the dataset of that split
        pa.field("sample_index", pa.int32(), nullable=False),  # index within the prompt's group
        pa.field("data_source", pa.string()),
        pa.field("prompt_text", pa.string()),
        pa.field("ground_truth", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),  # sampler's, one per response token
        pa.field("response_text", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("policy_version", pa.int32(), nullable=False),
        # sampling round that drew the prompt (0 without dynamic sampling)
        pa.field("round", pa.int32(), nullable=False),
        # the update trains on it (false for validation samples)
        pa.field("kept", pa.bool_(), nullable=False),
    ]
)

SCORES = pa.schema(
    [
        pa.field("split", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("reward_components", pa.map_(pa.string(), pa.float64())),
        pa.field("reward_message", pa.string()),
    ]
)

# Per-sample quantities the update computed, so a replay can check them.
ADVANTAGES = pa.schema(
    [
        pa.field("split", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),  # ppo: the mean of token_advantages
        pa.field("old_logprobs", pa.list_(pa.float32()), nullable=False),  # recomputed by the trainer
        pa.field("ref_logprobs", pa.list_(pa.float32())),  # null when no KL to a reference is used
        # ppo only (null otherwise), one per response token: the advantages the policy loss used
        # (GAE, whitened with norm_adv_by_std), the critic's values before the update, and the
        # GAE returns its loss regressed on. Absent from schema v1 files.
        pa.field("token_advantages", pa.list_(pa.float32())),
        pa.field("values", pa.list_(pa.float32())),
        pa.field("returns", pa.list_(pa.float32())),
    ]
)

# One row per optimizer step.
UPDATE_STATS = pa.schema(
    [
        pa.field("step", pa.int32(), nullable=False),
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("loss", pa.float64()),
        pa.field("pg_loss", pa.float64()),
        pa.field("pg_clipfrac", pa.float64()),
        pa.field("ppo_kl", pa.float64()),
        pa.field("kl_ref", pa.float64()),
        pa.field("entropy", pa.float64()),
        # the importance weight pi / pi_old: per token, or per sequence (gspo)
        pa.field("is_weight_mean", pa.float64()),
        pa.field("is_weight_max", pa.float64()),
        pa.field("grad_norm", pa.float64()),
        pa.field("lr", pa.float64()),
        pa.field("tokens", pa.int64()),
        # ppo only (null otherwise; the policy columns are null during algorithm.critic.warmup)
        pa.field("vf_loss", pa.float64()),
        pa.field("vf_clipfrac", pa.float64()),
        pa.field("vf_grad_norm", pa.float64()),
        # mixture-of-experts models only (hpcrl.moe): load relative to an even share, [layer][expert]
        pa.field("expert_load", pa.list_(pa.list_(pa.float64()))),
        pa.field("moe_load_max", pa.float64()),
        pa.field("moe_load_min", pa.float64()),
        pa.field("moe_aux_loss", pa.float64()),
        # the off-policy correction of stale samples only (hpcrl.losses.behaviour_weight; null otherwise):
        # the truncated weight min(pi_old / pi_sampler, cap) per token, and the share the cap truncated
        pa.field("off_policy_weight_mean", pa.float64()),
        pa.field("off_policy_weight_max", pa.float64()),
        pa.field("off_policy_clipfrac", pa.float64()),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "rollouts": ROLLOUTS,
    "scores": SCORES,
    "advantages": ADVANTAGES,
    "stats": UPDATE_STATS,
}


class SchemaError(ValueError):
    """A table does not match its stage contract."""


def conform(name: str, table: pa.Table) -> pa.Table:
    """Return `table` with the columns, order and types of the `name` schema, or raise SchemaError."""
    schema = TABLES[name]
    wanted, have = schema.names, table.column_names
    missing = [c for c in wanted if c not in have]
    extra = [c for c in have if c not in wanted]
    if missing or extra:
        raise SchemaError(f"table {name!r}: missing columns {missing}, unexpected columns {extra}")
    table = table.select(wanted)
    if table.schema.equals(schema, check_metadata=True):  # as it is: no cast (a pass over every column)
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
        raise SchemaError(f"table {name!r} does not match schema v{SCHEMA_VERSION}: {err}") from err
