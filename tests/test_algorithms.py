"""The advantage and loss functions against values worked out by hand."""

import math

import numpy as np
import pytest
import torch

from hpcrl import advantages, losses


def test_grpo_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3])
    adv = advantages.grpo(rewards, groups, norm_by_std=True, eps=0.0)
    # group 7: mean 0.25, unbiased std 0.5 -> (0.75, -0.25, -0.25, -0.25) / 0.5; group 3: all equal -> 0
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0])


def test_grpo_without_std_only_centres():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = advantages.grpo(rewards, torch.zeros(4, dtype=torch.long), norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.5, -0.5, -0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    out = losses.ppo_clip(logp, old, adv, mask, clip_ratio=0.2)
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    # token 1: ratio 1.65 > 1.2 with A>0 -> clipped -1.2; token 2: ratio 0.61, A>0 -> -0.61 unclipped;
    # token 3: ratio 0.61 < 0.8 with A<0 -> clipped 0.8
    expected = (-1.2 - r_lo + 0.8) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(2 / 3)
    assert out.ppo_kl.item() == pytest.approx((-0.5 + 0.5 + 0.5) / 3)
    # with clip_ratio 1 the range [0, 2] holds every ratio: nothing is clipped, token 1 counts e^0.5
    wide = losses.ppo_clip(logp, old, adv, mask, clip_ratio=1.0)
    assert wide.loss.item() == pytest.approx((-r_hi - r_lo + r_lo) / 3, abs=1e-6)
    assert wide.clipfrac.item() == 0.0


def test_ppo_clip_ignores_masked_tokens_and_broadcasts_sequence_advantages():
    logp = torch.tensor([[0.1, 9.0], [0.0, 0.0]])
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    out = losses.ppo_clip(logp, old, torch.tensor([2.0, -1.0]), mask, clip_ratio=0.2)
    expected = (-2.0 * math.exp(0.1) + 1.0 + 1.0) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([0.5]), torch.tensor([0.0])
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert losses.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert losses.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    with pytest.raises(ValueError, match="k4"):
        losses.kl_penalty(logp, ref, "k4")


def test_kl_term_adds_to_loss_with_its_coefficient():
    logp = torch.tensor([[0.5, 0.5]])
    out = losses.ppo_clip(logp, logp.clone(), torch.zeros(1), torch.ones(1, 2), 0.2,
                          ref_logp=torch.zeros(1, 2), kl_coef=0.1, kl_estimator="k1")
    assert out.pg_loss.item() == pytest.approx(0.0)
    assert out.loss.item() == pytest.approx(0.1 * 0.5)
    assert out.kl_ref.item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_kl_and_entropy_terms_are_the_same_with_one_or_three_parts(mode):
    """pins: the KL and entropy terms are normalised by the mini-batch totals n_tokens / n_seqs too."""
    torch.manual_seed(0)
    logp, old, ref = torch.randn(6, 5) * 0.1, torch.randn(6, 5) * 0.1, torch.randn(6, 5) * 0.1
    ent = torch.rand(6, 5)
    adv = torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).float()
    n_tok, n_seq = mask.sum().item(), 6

    def loss(i: int, j: int) -> torch.Tensor:
        return losses.ppo_clip(logp[i:j], old[i:j], adv[i:j], mask[i:j], 0.2, ref_logp=ref[i:j], kl_coef=0.5,
                               n_tokens=n_tok, agg=mode, n_seqs=n_seq, token_entropy=ent[i:j],
                               entropy_coef=0.3).loss

    assert sum(loss(i, i + 2) for i in range(0, 6, 2)).item() == pytest.approx(loss(0, 6).item(), abs=1e-7)


def test_token_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (0.25, 0.75)
    lp = losses.token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75))
    lp_t2 = losses.token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)  # p ∝ (1, sqrt 3)
    assert lp_t2.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))
    ent = losses.entropy(logits).item()
    assert ent == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


def test_prompt_draw_never_repeats_within_an_iteration_and_covers_each_epoch():
    from hpcrl.data import draw_prompts

    draws = [draw_prompts(100, 32, k, seed=5) for k in range(10)]
    for d in draws:
        assert len(set(d.tolist())) == 32  # iteration 3 crosses the first epoch boundary
    assert len({int(i) for d in draws[:3] for i in d}) == 96  # no repeats inside the first epoch
    assert (draw_prompts(100, 32, 4, seed=5) == draws[4]).all()  # deterministic


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv = advantages.rloo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_estimator_registry_names_every_estimator():
    assert set(advantages.ESTIMATORS) == {"grpo", "rloo", "reinforce_pp", "reinforce_plus_plus_baseline",
                                          "reinforce_plus_plus", "gpg", "remax"}
    r, g, n = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([3, 3])
    # Dr.GRPO
    assert advantages.compute("grpo", r, g, n, norm_by_std=False).tolist() == pytest.approx([0.5, -0.5])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        advantages.compute("ppo2", r, g, n)


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    adv, ret = advantages.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.4, 0.3])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    adv, _ = advantages.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # deltas (0.04, 0.03, 0.3); A2 = 0.3, A1 = 0.03 + 0.45 * 0.3, A0 = 0.04 + 0.45 * A1
    assert adv[0].tolist() == pytest.approx([0.04 + 0.45 * 0.165, 0.165, 0.3])


def test_aggregations_by_hand():
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert losses.aggregate(values, mask, "token-mean").item() == pytest.approx(6 / 3)
    assert losses.aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2)
    assert losses.aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((3.0 + 3.0) / 2)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_every_aggregation_is_the_same_with_one_or_two_ranks(mode):
    torch.manual_seed(1)
    logp, old = torch.randn(8, 6) * 0.1, torch.randn(8, 6) * 0.1
    adv = torch.randn(8)
    mask = (torch.rand(8, 6) > 0.3).float()
    n_tok, n_seq = mask.sum().item(), 8
    one = losses.ppo_clip(logp, old, adv, mask, 0.2, n_tokens=n_tok, agg=mode, n_seqs=n_seq).loss
    # two ranks, each with two micro-batches, normalised by the mini-batch totals
    parts = sum(losses.ppo_clip(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], 0.2, n_tokens=n_tok,
                                agg=mode, n_seqs=n_seq).loss for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(one.item(), abs=1e-7)


def test_clip_higher_and_dual_clip_by_hand():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    logp = torch.log(torch.tensor([[1.5, 5.0]]))
    adv = torch.tensor([[1.0, -1.0]])
    out = losses.ppo_clip(logp, old, adv, mask, clip_ratio=0.2, clip_high=0.28)
    # token 1: A>0, ratio 1.5 -> clipped at 1.28 -> -1.28; token 2: A<0, ratio 5 -> max(5, 1.2) = 5
    assert out.loss.item() == pytest.approx((-1.28 + 5.0) / 2)
    dual = losses.ppo_clip(logp, old, adv, mask, clip_ratio=0.2, clip_high=0.28, dual_clip_c=3.0)
    # the negative-advantage loss is capped at c|A|
    assert dual.loss.item() == pytest.approx((-1.28 + 3.0) / 2)


def test_entropy_bonus_lowers_the_loss_by_its_coefficient():
    logp = torch.zeros(1, 2)
    ent = torch.tensor([[0.5, 1.5]])
    out = losses.ppo_clip(logp, logp.clone(), torch.ones(1), torch.ones(1, 2), 0.2, token_entropy=ent,
                          entropy_coef=0.1)
    assert out.pg_loss.item() == pytest.approx(-1.0)  # ratio 1, advantage 1
    assert out.loss.item() == pytest.approx(-1.0 - 0.1 * 1.0)  # token mean entropy 1.0


# PPO with a critic: value loss, explained variance, token rewards, GAE on padded batches, KL control.

def test_value_loss_with_clipping_by_hand():
    values = torch.tensor([[1.0, 0.9, 7.0]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding
    out = losses.value_loss(values, old, returns, mask, clip=0.2)
    # token 1: (1 - 0)^2 = 1 beats the clipped (0.7 - 0)^2 = 0.49; token 2: (0.9 - 1)^2 = 0.01 loses to
    # the clipped value 0.5 + 0.2 = 0.7, (0.7 - 1)^2 = 0.09, which counts: a clipped token
    assert out.loss.item() == pytest.approx(0.5 * (1.0 + 0.09) / 2)
    assert out.clipfrac.item() == pytest.approx(0.5)
    plain = losses.value_loss(values, old, returns, mask, clip=0.0)
    assert plain.loss.item() == pytest.approx(0.5 * (1.0 + 0.01) / 2)
    assert plain.clipfrac.item() == 0.0


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_value_loss_is_the_same_with_one_or_two_ranks(mode):
    torch.manual_seed(2)
    v, old, ret = torch.randn(8, 5), torch.randn(8, 5), torch.randn(8, 5)
    mask = (torch.rand(8, 5) > 0.3).float()
    n = mask.sum().item()
    whole = losses.value_loss(v, old, ret, mask, 0.2, n_tokens=n, agg=mode, n_seqs=8).loss
    parts = sum(losses.value_loss(v[i:i + 2], old[i:i + 2], ret[i:i + 2], mask[i:i + 2], 0.2, n_tokens=n,
                                  agg=mode, n_seqs=8).loss
                for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0, 5.0]])
    values = torch.tensor([[1.0, 0.0, 0.5, 0.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    # Var(R) = 0.25; residuals (0, 0, 0.5, -0.5) have Var 0.125 -> 1 - 0.5
    assert losses.explained_variance(values, returns, mask) == pytest.approx(0.5)
    assert losses.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert losses.explained_variance(torch.full_like(values, 0.5), returns, mask) == pytest.approx(0.0)
    # returns do not vary
    assert math.isnan(losses.explained_variance(values, torch.ones_like(returns), mask))


def test_token_rewards_put_the_outcome_on_the_last_token_and_kl_on_every_token():
    outcome = torch.tensor([1.0, 0.5, 3.0])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    r = advantages.token_rewards(outcome, mask, kl, kl_coef=0.5)
    assert r[0].tolist() == pytest.approx([-0.05, -0.1, -0.15 + 1.0, 0.0])
    assert r[1].tolist() == pytest.approx([-0.2, -0.25 + 0.5, 0.0, 0.0])
    assert r[2].tolist() == [0.0] * 4  # no response token: nothing to reward
    assert advantages.token_rewards(outcome[:2], mask[:2])[0].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_gae_on_a_padded_batch_matches_each_row_alone():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.2, 9.0, 9.0, 9.0]], dtype=torch.float64)  # 9: padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    adv, ret = advantages.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    alone, alone_ret = advantages.gae(rewards[:1, :3], values[:1, :3], mask[:1, :3], gamma=0.9, lam=0.5)
    assert adv[0, :3].tolist() == pytest.approx(alone[0].tolist())
    assert ret[0, :3].tolist() == pytest.approx(alone_ret[0].tolist())
    assert adv[1].tolist() == pytest.approx([0.5 - 0.2, 0.0, 0.0, 0.0])  # one token: r - V, nothing after it
    assert ret[1].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    assert adv[0, 3].item() == 0.0 and ret[0, 3].item() == 0.0  # padding gets nothing


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    out = advantages.masked_whiten(x, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), eps=0.0)
    assert out[0].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0])  # mean 2, unbiased var 1


def test_gae_targets_of_an_outcome_reward_with_a_kl_penalty():
    from hpcrl.config import AlgorithmConfig
    from hpcrl.critic import gae_targets

    algo = AlgorithmConfig(name="ppo", critic={"gamma": 1.0, "lam": 1.0}, norm_adv_by_std=False)
    mask = torch.ones(1, 2, dtype=torch.float64)
    values = torch.tensor([[0.25, 0.5]], dtype=torch.float64)
    t = gae_targets(torch.tensor([1.0]), mask, values, torch.tensor([[0.2, 0.4]]), 0.5, algo)
    # token rewards (-0.1, -0.2 + 1); returns with gamma = lambda = 1 are reward-to-go: (0.7, 0.8)
    assert t.rewards[0].tolist() == pytest.approx([-0.1, 0.8])
    assert t.returns[0].tolist() == pytest.approx([0.7, 0.8])
    assert t.advantages[0].tolist() == pytest.approx([0.7 - 0.25, 0.8 - 0.5])


def test_adaptive_kl_controller_by_hand(tmp_path):
    from hpcrl import kl_control
    from hpcrl.config_training import KLConfig

    # KL twice the target: the error is clipped to +0.2 -> coef * (1 + 0.2 * 10 / 100)
    assert kl_control.adaptive_kl_coef(0.1, 2.0, 1.0, 100, 10) == pytest.approx(0.102)
    # KL 10% under target -> coef * (1 - 0.1 * 10 / 100)
    assert kl_control.adaptive_kl_coef(0.1, 0.9, 1.0, 100, 10) == pytest.approx(0.099)
    assert kl_control.sequence_kl(torch.tensor([[0.1, 0.2, 5.0], [0.3, 0.0, 0.0]]),
                                  torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])) == pytest.approx(0.3)
    adaptive = KLConfig(coef=0.1, target=1.0, horizon=100)
    assert kl_control.current_coef(adaptive, None) == 0.1  # the first update starts from kl.coef
    kl_control.step(adaptive, 0.1, 2.0, 10).save(tmp_path)
    assert kl_control.current_coef(adaptive, tmp_path) == pytest.approx(0.102)  # the next update reads it
    fixed = KLConfig(coef=0.1)
    assert kl_control.step(fixed, 0.1, 2.0, 10).next_kl_coef == 0.1
    assert kl_control.current_coef(fixed, tmp_path) == 0.1


# Defaults, edge cases and float64 internals, each pinning a bug that the tests above would miss.

def test_estimators_normalise_by_std_by_default():
    """pins: compute() and grpo() divide by the group std unless told otherwise (norm_by_std=True)."""
    r, g, n = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.full((4,), 3)
    # mean 0.25, unbiased std 0.5: (0.75, -0.25, -0.25, -0.25) / 0.5
    assert advantages.compute("grpo", r, g, n).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert (advantages.compute("grpo", r, g, n, norm_by_std=True).tolist()
            == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5))


def test_gae_defaults_to_the_undiscounted_reward_to_go():
    """pins: gamma and lam default to 1 (advantage = reward-to-go - V)."""
    rewards = torch.tensor([[0.5, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.25, 0.5, 0.75]], dtype=torch.float64)
    adv, ret = advantages.gae(rewards, values, torch.ones(1, 3))
    assert ret[0].tolist() == pytest.approx([1.5, 1.0, 1.0])
    assert adv[0].tolist() == pytest.approx([1.25, 0.5, 0.25])


def test_gae_skips_a_masked_hole_inside_a_response():
    """pins: a position outside the mask passes the running advantage and the next value through
    unchanged (`+ (1 - m) * last`, `+ (1 - m) * next_value`), so the row equals the row without it."""
    rewards = torch.tensor([[0.0, 9.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.7]], dtype=torch.float64)
    adv, ret = advantages.gae(rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.9, lam=0.5)
    # without the hole: delta1 = 1 - 0.7 = 0.3, A1 = 0.3;
    # delta0 = 0 + 0.9 * 0.7 - 0.5 = 0.13, A0 = 0.13 + 0.45 * 0.3
    assert adv[0].tolist() == pytest.approx([0.13 + 0.45 * 0.3, 0.0, 0.3])
    assert ret[0].tolist() == pytest.approx([0.13 + 0.45 * 0.3 + 0.5, 0.0, 1.0])


def test_gae_accumulates_in_float64_and_returns_the_input_dtype():
    """pins: the advantages are held in float64 (returns = A + V is not rounded twice) and both outputs
    come back in the rewards' dtype."""
    big = 2.0**24 + 2  # a float32; 1 - big = -(2^24 + 1) is not, and rounds to -2^24
    adv, ret = advantages.gae(torch.tensor([[1.0]]), torch.tensor([[big]]), torch.ones(1, 1))
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    assert adv.item() == float(np.float32(1.0 - big))
    assert ret.item() == 1.0  # float32 advantages would give -2^24 + big = 2


def test_masked_whiten_edge_cases():
    """pins: eps defaults to 1e-8 (added, not subtracted); the mean divides by n (not max(n, 2)), the
    variance by n - 1 (not max(n - 1, 2)) and x - mean is multiplied by 1 / std; float64 inside, the
    input dtype out."""
    two = advantages.masked_whiten(torch.tensor([[1.0, 3.0, 7.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert two.dtype == torch.float32
    assert two[0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0])  # mean 2, var 2
    one = advantages.masked_whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[1.0, 0.0]]))
    assert one[0].tolist() == [0.0, 0.0]
    flat = advantages.masked_whiten(torch.full((1, 3), 4.0), torch.ones(1, 3))
    assert flat[0].tolist() == [0.0, 0.0, 0.0]  # var 0: finite thanks to eps
    x = np.array([2.0**24, 2**24 + 2, 2**24 + 2, 2**24 + 2], dtype=np.float32)
    out = advantages.masked_whiten(torch.tensor(x)[None], torch.ones(1, 4))
    x64 = x.astype(np.float64)
    expected = (x64 - x64.mean()) / np.sqrt(x64.var(ddof=1) + 1e-8)  # float32 sums would lose the 1.5
    assert out[0].tolist() == pytest.approx(expected.tolist(), rel=1e-6)


def test_token_rewards_edge_cases():
    """pins: kl_coef defaults to 0; no KL tensor means no penalty whatever the coefficient (`and`); a
    response of one token at position 0 still gets its outcome (`last >= 0`); the penalty is computed
    in float64 and the result is float64."""
    outcome = torch.tensor([2.0, 1.0])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.7, 0.7, 0.7], [0.7, 0.7, 0.7]])
    assert advantages.token_rewards(outcome, mask, kl).tolist() == [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert advantages.token_rewards(outcome, mask, None, 0.5).tolist() == [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert advantages.token_rewards(outcome, mask).dtype == torch.float64
    r = advantages.token_rewards(outcome, mask, kl, 0.3)
    assert r.dtype == torch.float64
    pen = -0.3 * float(np.float32(0.7))  # the float32 KL times 0.3 in float64
    assert r[1].tolist() == pytest.approx([pen, pen + 1.0, 0.0], rel=1e-12)
    assert r[0, 0].item() == pytest.approx(pen + 2.0, rel=1e-12)


def test_default_modes_and_messages_of_the_loss_functions():
    """pins: aggregate() defaults to token-mean, kl_penalty() to k3; an unknown mode is named in the error."""
    values, mask = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert losses.aggregate(values, mask).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown loss aggregation 'tokens'"):
        losses.aggregate(values, mask, "tokens")
    logp, ref = torch.tensor([0.25]), torch.tensor([0.75])  # log ratio -0.5
    assert losses.kl_penalty(logp, ref).item() == pytest.approx(math.exp(0.5) - 0.5 - 1)
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(-0.5)


def test_means_over_one_token_or_one_sequence_divide_by_one():
    """pins: the denominators are clamped at 1, not 2 (token_mean and the sequence aggregations)."""
    values, mask = torch.tensor([[3.0, 5.0]]), torch.tensor([[1.0, 0.0]])
    assert losses.token_mean(values, mask).item() == 3.0
    assert losses.token_mean(values, torch.zeros(1, 2)).item() == 0.0  # no token: 0, not a division by 0
    assert losses.aggregate(values, torch.ones(1, 2), "seq-mean-token-sum").item() == 8.0
    assert losses.aggregate(values, torch.ones(1, 2), "seq-mean-token-mean").item() == 4.0


def test_logprobs_and_entropy_per_position():
    """pins: token_logprobs and entropy keep one value per position of a [batch, tokens] input."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [math.log(3.0), 0.0]]])  # p1 = 3/4, 1/2, 1/4
    lp = losses.token_logprobs(logits, torch.tensor([[1, 1, 1]]))
    assert lp.shape == (1, 3)
    assert lp[0].tolist() == pytest.approx([math.log(0.75), math.log(0.5), math.log(0.25)])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert losses.entropy(logits)[0].tolist() == pytest.approx([h, math.log(2.0), h])


def test_ppo_clip_defaults_and_switches():
    """pins: clip_ratio defaults to 0.2, kl_coef and entropy_coef to 0, kl_estimator to k3; the KL term
    needs both a reference and kl_coef > 0, the entropy term both entropies and entropy_coef > 0
    (`and`, `> 0`); kl_ref is 0 without a KL term; the ratio is exp(logp - old_logp)."""
    old = torch.tensor([[0.5, -1.0]])
    logp = old + torch.log(torch.tensor([[1.5, 1.0]]))  # ratios 1.5 and 1
    mask, adv = torch.ones(1, 2), torch.ones(1)
    plain = losses.ppo_clip(logp, old, adv, mask)
    assert plain.loss.item() == pytest.approx((-1.2 - 1.0) / 2)  # 1.5 clipped at 1 + 0.2
    assert plain.clipfrac.item() == 0.5  # the ratio-1 token is not clipped
    assert plain.kl_ref.item() == 0.0
    ref = logp - 0.5
    no_kl = losses.ppo_clip(logp, old, adv, mask, ref_logp=ref)
    no_ent = losses.ppo_clip(logp, old, adv, mask, token_entropy=torch.ones(1, 2))
    only_coefs = losses.ppo_clip(logp, old, adv, mask, kl_coef=0.5, entropy_coef=0.5)
    zero_coef = losses.ppo_clip(logp, old, adv, mask, ref_logp=ref, kl_coef=0.0)
    for out in (no_kl, no_ent, only_coefs, zero_coef):
        assert out.loss.item() == pytest.approx(plain.loss.item())
        assert out.kl_ref.item() == 0.0
    k3 = math.exp(-0.5) + 0.5 - 1
    kl = losses.ppo_clip(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5)
    assert kl.loss.item() == pytest.approx(plain.loss.item() + 0.5 * k3)
    assert kl.kl_ref.item() == pytest.approx(k3)
    ent = losses.ppo_clip(logp, old, adv, mask, token_entropy=torch.tensor([[0.5, 1.5]]) * 2,
                          entropy_coef=0.5)
    assert ent.loss.item() == pytest.approx(plain.loss.item() - 0.5 * 2.0)  # token-mean entropy 2


def test_dual_clip_leaves_positive_advantages_alone():
    """pins: the dual-clip cap applies to negative advantages only (`advantages < 0`)."""
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    logp = torch.log(torch.tensor([[1.0, 1.0]]))
    adv = torch.tensor([[0.5, 0.25]])
    out = losses.ppo_clip(logp, old, adv, mask, clip_ratio=0.2, dual_clip_c=3.0)
    assert out.loss.item() == pytest.approx((-0.5 - 0.25) / 2)


def test_value_clipping_in_both_directions():
    """pins: clip defaults to 0 (plain squared error); the clipped value is V_old + clamp(V - V_old,
    -clip, clip); a token whose clipped and plain errors are equal is not counted as clipped."""
    values = torch.tensor([[0.1, 0.6, 2.0]])
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.ones(1, 3)
    plain = (0.1**2 + 0.4**2 + 2.0**2) / 3
    assert losses.value_loss(values, old, returns, mask).loss.item() == pytest.approx(0.5 * plain)
    out = losses.value_loss(values, old, returns, mask, clip=0.2)
    # token 1 moves down 0.4: clipped to 0.3, error 0.09 > 0.01 counts; token 2 moves 0.1: unclipped, 0.16;
    # token 3 moves up 1.5: clipped to 0.7, error 0.49 < 4.0, the plain error counts
    assert out.loss.item() == pytest.approx(0.5 * (0.09 + 0.16 + 4.0) / 3)
    assert out.clipfrac.item() == pytest.approx(1 / 3)
    # moving 2.5 toward the return: clip 0.2 keeps the error of 3 - 0.2 = 2.8; no clip by default
    toward = [torch.tensor([[x]]) for x in (0.5, 3.0, 0.0, 1.0)]
    assert losses.value_loss(*toward).loss.item() == pytest.approx(0.5 * 0.25)
    assert losses.value_loss(*toward, clip=0.2).loss.item() == pytest.approx(0.5 * 2.8**2)


def test_float64_inputs_give_float64_statistics():
    """pins: kl_ref (without a reference) and the value clipfrac (without clipping) are zeros of the
    inputs' dtype, like every other statistic."""
    logp = torch.zeros(1, 2, dtype=torch.float64)
    out = losses.ppo_clip(logp, logp.clone(), torch.ones(1, dtype=torch.float64),
                          torch.ones(1, 2, dtype=torch.float64))
    assert ([t.dtype for t in (out.loss, out.pg_loss, out.clipfrac, out.ppo_kl, out.kl_ref)]
            == [torch.float64] * 5)
    v = losses.value_loss(logp, logp, logp + 1, torch.ones(1, 2, dtype=torch.float64))
    assert (v.loss.dtype, v.clipfrac.dtype) == (torch.float64, torch.float64)


def test_explained_variance_of_no_tokens_is_nan():
    """pins: an empty mask gives NaN (float("nan")), not an error."""
    assert math.isnan(losses.explained_variance(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1, 2)))


def test_kl_controller_details(tmp_path):
    """pins: the error is KL / target - 1 (a division); an empty batch has KL 0; the record keeps the
    coefficient used and the KL measured, and is written as indented JSON with sorted keys; a missing
    record is named in the error."""
    from hpcrl import kl_control
    from hpcrl.config_training import KLConfig

    # KL 2.2 against target 2: error 0.1 -> coef * (1 + 0.1 * 10 / 100)
    assert kl_control.adaptive_kl_coef(0.5, 2.2, 2.0, 100, 10) == pytest.approx(0.505)
    assert kl_control.sequence_kl(torch.zeros(0, 3), torch.zeros(0, 3)) == 0.0
    adaptive = KLConfig(coef=0.5, target=1.0, horizon=100)
    record = kl_control.step(adaptive, 0.5, 2.0, 10)
    assert (record.kl_coef, record.kl, record.next_kl_coef) == (0.5, 2.0, pytest.approx(0.51))
    record.save(tmp_path)
    assert (tmp_path / kl_control.FILE).read_text() == \
        '{\n  "kl": 2.0,\n  "kl_coef": 0.5,\n  "next_kl_coef": 0.51\n}\n'
    with pytest.raises(FileNotFoundError, match="needs the coefficient the previous update recorded"):
        kl_control.current_coef(adaptive, tmp_path / "nowhere")
