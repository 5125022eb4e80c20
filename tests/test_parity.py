"""Parity with verl and TRL: every estimator, policy loss and aggregation against numbers written
here, computed by hand or by a few lines of numpy in the test (never by calling hpcrl), including
the counterexamples where hpcrl once differed from verl (docs/algorithms.md)."""

import math

import numpy as np
import pytest
import torch

from hpcrl import advantages, losses
from hpcrl.losses import LossParams


def _tokens(per_sample, lengths):
    return np.concatenate([np.full(n, x, dtype=np.float64) for x, n in zip(per_sample, lengths, strict=True)])


def _whiten(x):  # verl's masked_whiten over the tokens: unbiased variance, eps 1e-8
    return (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)


# Estimators

def test_reinforce_pp_baseline_whitens_over_tokens_as_verl():
    """The counterexample: verl's REINFORCE++-baseline gives [2.2532, -0.4097, 2.2532, -0.4097]."""
    r, g, n = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), torch.tensor([1, 10, 1, 1])
    for name in ("reinforce_plus_plus_baseline", "reinforce_pp"):
        adv = advantages.compute(name, r, g, n)
        assert adv.tolist() == pytest.approx([2.2532, -0.4097, 2.2532, -0.4097], abs=1e-4)


def test_reinforce_pp_baseline_at_equal_lengths_has_the_token_scale():
    """4 samples of 7 tokens: the token std (28 tokens, ddof 1) differs from the sample std."""
    r, g, n = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), torch.full((4,), 7)
    centred = np.array([0.5, -0.5, 0.0, 0.0])
    white = _whiten(_tokens(centred, [7] * 4))
    expected = [white[7 * i] for i in range(4)]
    adv = advantages.compute("reinforce_plus_plus_baseline", r, g, n)
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] == pytest.approx(0.5 / math.sqrt(0.5 * 7 / 27), abs=1e-6)


def test_reinforce_plus_plus_discounts_then_whitens_tokens():
    """gamma 0.5, rewards [1, 0], lengths [2, 1]: returns [0.5, 1] and [0]; over 3 tokens mean 0.5,
    unbiased std 0.5: [0, 1] and [-1]."""
    adv = advantages.compute("reinforce_plus_plus", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                             torch.tensor([2, 1]), gamma=0.5)
    assert adv[0] == pytest.approx([0.0, 1.0], abs=1e-6) and adv[1] == pytest.approx([-1.0], abs=1e-6)
    # gamma 1: the reward on every token, whitened over tokens (per sample)
    flat = advantages.compute("reinforce_plus_plus", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                              torch.tensor([2, 1]))
    white = _whiten(np.array([1.0, 1.0, 0.0]))
    assert flat.tolist() == pytest.approx([white[0], white[2]], abs=1e-6)


def test_gpg_scales_centred_rewards_by_the_share_of_nonzero_rewards():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    alpha = 8 / 3  # 3 nonzero rewards among 8 samples
    expected = alpha * np.array([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    adv = advantages.compute("gpg", r, g, torch.ones(8))
    assert adv.tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_grpo_std_eps_reproduces_trl():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    std = math.sqrt(0.5)  # unbiased
    trl = advantages.compute("grpo", r, g, torch.ones(2), eps=1e-4)
    assert trl.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)], rel=1e-6)
    assert trl[0].item() != pytest.approx(advantages.compute("grpo", r, g, torch.ones(2))[0].item(), rel=1e-6)


# Policy losses

def test_log_ratio_is_clamped_before_exp():
    """The counterexample: dual clip off, A = -1, log(pi / pi_old) = 25: verl's loss exp(20) = 4.85e8,
    not exp(25) = 7.2e10."""
    logp, old, mask = torch.tensor([[25.0]]), torch.tensor([[0.0]]), torch.ones(1, 1)
    out = losses.ppo_clip(logp, old, torch.tensor([-1.0]), mask)
    assert out.loss.item() == pytest.approx(math.exp(20), rel=1e-5)
    tight = losses.ppo_clip(logp, old, torch.tensor([-1.0]), mask, max_log_ratio=5.0)
    assert tight.loss.item() == pytest.approx(math.exp(5), rel=1e-5)


def _two_sequences():
    # sequence 0: 2 tokens, log ratios 0.2 and 0.4 (s = exp(0.3)); sequence 1: 1 token, log ratio -0.05
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.4], [-0.45, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, old, mask


def test_gspo_clips_the_sequence_ratio_by_hand():
    logp, old, mask = _two_sequences()
    adv = torch.tensor([1.0, 1.0])
    out = losses.policy_loss_of(losses.gspo_surrogate, logp, old, adv, mask, LossParams(clip_ratio=0.2))
    s0, s1 = math.exp(0.3), math.exp(-0.05)  # s0 above 1.2: clipped; s1 inside
    assert out.loss.item() == pytest.approx((-1.2 + -s1) / 2, abs=1e-6)  # seq-mean-token-mean
    assert out.clipfrac.item() == pytest.approx(0.5) and out.level == "sequence"  # one sequence of two
    assert out.weight_mean.item() == pytest.approx((s0 + s1) / 2, abs=1e-6)
    out.loss.backward()
    # the clipped sequence has no gradient; the other's token gets -A s1 / (1 token) / 2 sequences
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -s1 / 2, 0.0], abs=1e-6)


def test_gspo_gradient_is_the_sequence_ratio_spread_over_its_tokens():
    logp, old, mask = _two_sequences()
    out = losses.policy_loss_of(losses.gspo_surrogate, logp, old, torch.tensor([-1.0, 2.0]), mask,
                                LossParams(clip_ratio=0.5))
    s0, s1 = math.exp(0.3), math.exp(-0.05)  # both inside [0.5, 1.5]
    assert out.loss.item() == pytest.approx((s0 - 2 * s1) / 2, abs=1e-6) and out.clipfrac.item() == 0.0
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([s0 / 2 / 2, s0 / 2 / 2, -2 * s1 / 2, 0.0], abs=1e-6)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    logp, old, mask = _two_sequences()
    adv = torch.tensor([1.0, -1.0])
    p = LossParams(clip_ratio=0.2, clip_high=0.25)
    out = losses.policy_loss_of(losses.cispo_surrogate, logp, old, adv, mask, p)
    r = np.exp([0.2, 0.4, -0.05])
    w = np.clip(r, 0.8, 1.25)  # the second token's weight 1.49 is clipped to 1.25
    a, lp = np.array([1.0, 1.0, -1.0]), np.array([-1.0, -2.0, -0.5])
    assert out.loss.item() == pytest.approx(float((-w * a * lp).sum() / 3), abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(1 / 3) and out.level == "token"
    assert out.weight_max.item() == pytest.approx(r[1], abs=1e-6)
    out.loss.backward()
    # d/dlogp = -w A / 3: the clipped token keeps its gradient (PPO's would be 0)
    assert logp.grad.flatten().tolist() == pytest.approx([-w[0] / 3, -w[1] / 3, w[2] / 3, 0.0], abs=1e-6)


def test_gpg_loss_is_the_plain_policy_gradient():
    logp, old, mask = _two_sequences()
    adv = torch.tensor([2.0, -1.0])
    out = losses.policy_loss_of(losses.gpg_surrogate, logp, old, adv, mask, LossParams())
    assert out.loss.item() == pytest.approx((2.0 + 4.0 - 0.5) / 3, abs=1e-6)  # -A logp, token mean
    out.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2 / 3, -2 / 3, 1 / 3, 0.0], abs=1e-6)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "gpg"])
def test_each_policy_loss_is_the_same_however_the_batch_is_split(name):
    torch.manual_seed(3)
    logp, old = torch.randn(8, 5) * 0.1 - 1, torch.randn(8, 5) * 0.1 - 1
    adv, mask = torch.randn(8), (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1.0
    fn, p = losses.POLICY_LOSSES[name], LossParams(clip_ratio=0.05)
    whole = losses.policy_loss_of(fn, logp, old, adv, mask, p, n_tokens=mask.sum().item(), n_seqs=8).loss
    parts = sum(losses.policy_loss_of(fn, logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], p,
                                      n_tokens=mask.sum().item(), n_seqs=8).loss for i in range(0, 8, 2))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_seq_mean_token_sum_norm_divides_by_a_constant_length():
    values = torch.tensor([[1.0, 2.0, 5.0], [3.0, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert losses.aggregate(values, mask, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(
        (3 / 4 + 3 / 4) / 2)
    padded_width = losses.aggregate(values, mask, "seq-mean-token-sum-norm")
    assert padded_width.item() == pytest.approx((3 / 3 + 3 / 3) / 2)


def test_value_clipfrac_does_not_count_a_clamp_that_only_rounds():
    """The counterexample: V moved 0.16 of a 0.2 range; V_old + clamp(V - V_old) rounds one ulp
    away from V in float32, and the clipped error came out larger. Not a clipped token."""
    values = torch.tensor([[0.11984150856733322, 0.9]])
    old = torch.tensor([[0.28216156363487244, 0.5]])
    returns = torch.tensor([[-1.7313506603240967, 1.0]])
    assert (old + torch.clamp(values - old, -0.2, 0.2))[0, 0].item() != values[0, 0].item()
    out = losses.value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    assert out.clipfrac.item() == pytest.approx(0.5)  # only the second token, which moved 0.4


def test_policy_loss_is_built_from_the_config():
    from hpcrl.config import AlgorithmConfig

    a = AlgorithmConfig(policy_loss="cispo", clip_ratio=0.1, clip_ratio_high=0.3, max_log_ratio=7.0,
                        loss_agg="seq-mean-token-sum-norm", dual_clip_c=3.0)
    fn = losses.policy_loss(a, max_tokens=16)
    assert fn.func is losses.policy_loss_of and fn.args == (losses.cispo_surrogate,)
    assert fn.keywords["params"] == LossParams(0.1, 0.3, 3.0, "k3", "seq-mean-token-sum-norm", 0.0, 7.0, 16)
    with pytest.raises(ValueError, match="'ppo2'; registered: ppo_clip, gspo, cispo, gpg"):
        losses.policy_loss(AlgorithmConfig(policy_loss="ppo2"))


def test_a_discount_is_refused_where_no_estimator_takes_it():
    from pydantic import ValidationError

    from hpcrl.config import AlgorithmConfig

    assert AlgorithmConfig(name="reinforce_plus_plus", reinforce_gamma=0.9).reinforce_gamma == 0.9
    with pytest.raises(ValidationError, match="only algorithm.name = \"reinforce_plus_plus\" discounts"):
        AlgorithmConfig(name="grpo", reinforce_gamma=0.9)


def test_remax_subtracts_the_greedy_baseline():
    r, b = torch.tensor([1.0, 0.0, 1.0, 0.5]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    adv = advantages.compute("remax", r, torch.tensor([0, 0, 1, 1]), torch.ones(4), baselines=b)
    assert adv.tolist() == pytest.approx([0.0, -1.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="greedy baseline"):
        advantages.compute("remax", r, torch.tensor([0, 0, 1, 1]), torch.ones(4))


def test_remax_baselines_are_read_from_the_scores_by_prompt():
    import pyarrow as pa
    import pyarrow.compute as pc

    from hpcrl.batches import _baselines

    scores = pa.table({"split": ["train", "train", "baseline", "baseline", "val"],
                       "prompt_index": [7, 3, 3, 7, 0], "reward": [1.0, 0.0, 0.25, 0.75, 1.0]})
    assert _baselines(scores, [7, 3, 7]).tolist() == [0.75, 0.25, 0.75]
    with pytest.raises(ValueError, match=r"no greedy baseline sample for the training prompts \[5\]"):
        _baselines(scores, [5, 3])
    assert _baselines(scores.filter(pc.not_equal(scores["split"], "baseline")), [7]) is None


def test_statistics_leave_out_padding_and_rows_without_tokens():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [-3.0, -3.0]])
    old = torch.tensor([[-0.9, -1.8], [-0.4, 0.0], [-1.0, -1.0]])  # every ratio below 1
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # the third row has no response token
    s0, s1 = math.exp(-0.15), math.exp(-0.1)
    adv = torch.tensor([-1.0, 1.0, 1.0])  # s0 = 0.861 is below 0.88 with A < 0: clipped
    seq = losses.policy_loss_of(losses.gspo_surrogate, logp, old, adv, mask, LossParams(clip_ratio=0.12))
    assert seq.clipfrac.item() == pytest.approx(0.5)
    assert seq.weight_mean.item() == pytest.approx((s0 + s1) / 2)
    assert seq.weight_max.item() == pytest.approx(s1)
    tok = losses.policy_loss_of(losses.cispo_surrogate, logp, old, torch.tensor([1.0, 1.0, 1.0]), mask,
                                LossParams())
    assert tok.weight_max.item() == pytest.approx(math.exp(-0.1))  # padding (ratio 1, and exp(-2)) left out
    assert tok.weight_mean.item() == pytest.approx((math.exp(-0.1) + math.exp(-0.2) + math.exp(-0.1)) / 3)
    nothing = torch.zeros(3, 2)
    empty = losses.policy_loss_of(losses.ppo_surrogate, logp, old, torch.ones(3), nothing, LossParams())
    assert (empty.loss.item(), empty.clipfrac.item(), empty.weight_max.item()) == (0.0, 0.0, 0.0)
    empty_seq = losses.policy_loss_of(losses.gspo_surrogate, logp, old, torch.ones(3), nothing, LossParams())
    assert (empty_seq.clipfrac.item(), empty_seq.weight_max.item()) == (0.0, 0.0)


def test_the_reference_kl_and_the_constant_length_come_only_when_asked():
    logp, old, mask = _two_sequences()
    ref = old - 1.0
    p = LossParams(agg="seq-mean-token-sum-norm", norm_len=4)
    plain = losses.policy_loss_of(losses.gpg_surrogate, logp, old, torch.tensor([2.0, -1.0]), mask, p)
    assert plain.loss.item() == pytest.approx(((2.0 + 4.0) / 4 + -0.5 / 4) / 2)  # -A logp, token sums / 4
    with_ref = losses.policy_loss_of(losses.gpg_surrogate, logp, old, torch.tensor([2.0, -1.0]), mask, p,
                                     ref_logp=ref)
    assert with_ref.loss.item() == plain.loss.item()  # kl_coef defaults to 0


def test_token_whitening_edge_cases():
    # two tokens, one per sample: mean 0.5, unbiased variance 0.5
    two = advantages.compute("reinforce_plus_plus", torch.tensor([1.0, 0.0]), torch.tensor([0, 1]),
                             torch.tensor([1, 1]))
    assert two.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], abs=1e-6)
    one = advantages.compute("reinforce_plus_plus", torch.tensor([3.0]), torch.tensor([0]),
                             torch.tensor([1]))
    assert one.tolist() == [0.0]  # one token: nothing to compare it with
    equal = advantages.compute("reinforce_plus_plus", torch.tensor([1.0, 1.0]), torch.tensor([0, 1]),
                               torch.tensor([1, 2]))
    assert equal.tolist() == [0.0, 0.0]  # no variance: zeros, not NaN
    empty = advantages.compute("reinforce_plus_plus_baseline", torch.tensor([1.0, 0.0, 0.5]),
                               torch.tensor([0, 0, 1]), torch.tensor([2, 0, 1]))
    assert empty[1].item() == 0.0  # a response without tokens gets 0


def test_the_log_ratio_is_clamped_from_below_too():
    logp, old = torch.tensor([[-25.0]]), torch.tensor([[0.0]])
    out = losses.ppo_clip(logp, old, torch.tensor([1.0]), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(-math.exp(-20), rel=1e-5)


def test_a_value_whose_clipped_error_only_ties_is_not_counted():
    # V moved 1.5 from 0 (clip 0.5): clipped to 0.5; both errors 0.25 against R = 1
    values, old, returns = torch.tensor([[1.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]])
    out = losses.value_loss(values, old, returns, torch.ones(1, 1), clip=0.5)
    assert out.clipfrac.item() == 0.0


def test_sequence_statistics_of_a_single_sequence():
    logp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.2, -2.4]])  # s = exp(0.3), above 1.2
    out = losses.policy_loss_of(losses.gspo_surrogate, logp, old, torch.ones(1), torch.ones(1, 2),
                                LossParams(clip_ratio=0.2))
    assert (out.clipfrac.item(), out.weight_mean.item()) == pytest.approx((1.0, math.exp(0.3)))
